"""Every parallel layout reproduces the one-process run: 3 AdamW steps' losses (10 for the expert-parallel cases)
within rtol 1e-4 and the first step's reduced gradients within 1e-5 (relative L2 per tensor). One torchrun launch
(8 gloo ranks) runs all cases; a second one (2 ranks) runs the train.compile = true cases (COMPILED_CASES)."""

import json

import pytest
import torch
from conftest import TESTS_DIR, launch_torchrun, run_worker_jobs
from parallel_cases import (
    CASES,
    COMPILED_CASES,
    COMPILED_WORLD,
    DATA_KINDS,
    GLOBAL_BATCH,
    SEQ,
    STEPS,
    WINDOWED,
    WORLD,
    case_moe,
    case_mtp_scale,
    case_spec,
    make_batch,
)
from workers.parity_worker import OPTIM

from qlm_core.checkpoint.formats.megatron.legacy import MegatronTorchCheckpoint
from qlm_core.config import ParallelConfig
from qlm_core.kernels.pieces import Documents
from qlm_core.models.layout import ModelLayout, assemble_hf_tensor
from qlm_core.parallel.state import Grid
from qlm_core.train.engine import Batch, Engine


def reference(data: str, micro_batch_size: int = GLOBAL_BATCH, steps: int = STEPS):
    """One process, no parallelism: losses, grad norms and the first step's gradients (global names). An MoE
    model's losses are per micro-batch (as Megatron's), so its reference splits the batch as the layout does."""
    engine = Engine(case_spec(data), ParallelConfig(), Grid.single(), micro_batch_size=micro_batch_size,
                    global_batch_size=GLOBAL_BATCH, seq_length=SEQ, optim=OPTIM, seed=1234, moe=case_moe(data),
                    mtp_loss_scaling_factor=case_mtp_scale(data))
    batch = Batch(*make_batch(data))
    losses, norms, grads, moe, mtp = [], [], None, [], []
    for step in range(steps):
        loss = engine.forward_backward(batch)
        if step == 0:
            grads = {n: engine.optimizer.full_grad(p).detach().clone() if p.requires_grad
                     else torch.zeros(tuple(p.shape)) for n, p in engine.chunks[0].named_parameters()}
        norm, _ = engine.update()
        losses.append(engine.global_loss(loss))
        norms.append(norm)
        moe.append(engine.moe_step_figures())
        if engine.mtp_depths:
            mtp.append(engine.mtp_step_loss())
    return losses, norms, grads, moe, mtp


def reference_key(case) -> tuple[str, int]:
    return case.data, case.micro_batch_size if case.moe is not None else GLOBAL_BATCH


@pytest.fixture(scope="module")
def references():
    """One reference per (data, micro-batch size), as many steps as its longest case runs."""
    steps = {(data, GLOBAL_BATCH): STEPS for data in DATA_KINDS}
    for case in CASES.values():
        steps[reference_key(case)] = max(steps.get(reference_key(case), 0), case.steps)
    return {key: reference(*key, steps=n) for key, n in steps.items()}


def test_windowed_cases_have_documents_longer_than_the_window():
    segment_ids = make_batch("window")[3]
    longest = max(end - start for row in Documents.from_segment_ids(segment_ids).rows for start, end in row)
    assert longest > WINDOWED.sliding_window


@pytest.fixture(scope="module")
def parallel_run(tmp_path_factory):
    return run_worker_jobs("parity_worker.py", WORLD, tmp_path_factory.mktemp("parity"), timeout=1200)


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity_compiled")
    proc = launch_torchrun(TESTS_DIR / "workers" / "parity_worker.py", COMPILED_WORLD, out, *COMPILED_CASES,
                           timeout=1500)
    errors = "\n".join(p.read_text() for p in out.glob("*.error"))
    return out, proc.returncode, errors or proc.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_layout_matches_one_process(case, references, parallel_run):
    check_case(case, CASES[case], references, parallel_run)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", COMPILED_CASES)
def test_compiled_layout_matches_one_process(case, references, compiled_run):
    """train.compile = true under TP, PP, CP, ZeRO 1 and FSDP2 against the eager one-process run; the worker
    records the frames torch.compile captured, so an eager fallback cannot pass."""
    check_case(case, COMPILED_CASES[case], references, compiled_run)
    assert json.loads((compiled_run[0] / f"{case}.json").read_text())["compiled_frames"] > 0


def check_case(case: str, layout_case, references, run):
    out, code, errors = run
    result_file = out / f"{case}.json"
    assert result_file.exists(), f"worker exit {code}: {errors}"
    result = json.loads(result_file.read_text())
    ref_losses, ref_norms, ref_grads, ref_moe, ref_mtp = references[reference_key(layout_case)]
    steps = layout_case.steps
    ref_losses, ref_norms, ref_moe, ref_mtp = ref_losses[:steps], ref_norms[:steps], ref_moe[:steps], ref_mtp[:steps]
    assert len(result["losses"]) == steps
    assert result["losses"] == pytest.approx(ref_losses, rel=1e-4), case
    assert result["mtp"] == pytest.approx(ref_mtp, rel=1e-4), case  # multi-token prediction's loss (MLA's cases)
    assert len(ref_mtp) == (steps if layout_case.spec.mtp_num_layers and case_mtp_scale(layout_case.data) else 0)
    assert result["grad_norms"] == pytest.approx(ref_norms, rel=1e-4), case
    if layout_case.moe is not None:  # the MoE losses and loads as one process has them, at every step
        for got, want in zip(result["moe"], ref_moe, strict=True):
            assert got == pytest.approx(want, rel=1e-4), case
            assert want["moe_aux_loss"] > 0 and want["moe_z_loss"] > 0 and want["moe_load_max"] > 1
    spec = layout_case.spec
    reloaded = MegatronTorchCheckpoint(out / case, spec=spec)
    layout = ModelLayout(spec)
    # a gradient that is zero in exact arithmetic is rounding noise (OPT's k_proj bias: without RoPE it adds the
    # same q·b to every score of a query, which the softmax cancels): below 1e-4 of the whole gradient's norm, a
    # tensor's error is taken relative to that floor
    floor = 1e-4 * torch.stack([g.norm() for g in ref_grads.values()]).norm()
    for hf_name, parts in layout.hf_tensors.items():
        if parts[0][0].buffer:  # the routers' expert bias: no gradient
            continue
        ours = assemble_hf_tensor(reloaded.layout, hf_name, reloaded)
        theirs = torch.cat([ref_grads[t.name].narrow(t.axis, s.start, s.stop - s.start) for t, s in parts],
                           dim=parts[0][0].axis)
        error = (ours - theirs).norm() / theirs.norm().clamp(min=floor)
        assert error <= 1e-5, (case, hf_name, error.item())


@pytest.mark.distributed
def test_tp_sp_layer_issues_megatrons_collectives(parallel_run):
    """Forward: 2 all-gathers (before linear_qkv and linear_fc1) + 2 reduce-scatters (after linear_proj and
    linear_fc2), no all-reduce. Backward: the transposes (2 reduce-scatters, 2 all-gathers) plus the 2 all-gathers
    that re-assemble the saved sequence shard for the weight gradients (Megatron keeps only the shard too)."""
    out, code, errors = parallel_run
    assert (out / "collectives.json").exists(), errors
    counts = json.loads((out / "collectives.json").read_text())
    assert counts["forward"] == {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 0}
    assert counts["backward"] == {"all_gather": 4, "reduce_scatter": 2, "all_reduce": 0}
