"""parallel.grad_reduce_dtype: gradient buffers (and their reduction) in the training dtype, fp32 masters.

One-process tests cover the buffers' dtype and bytes against profile/states.py, the optimizer's fp32 copy of the
gradients at step time, the profile and the recipe rule. The dp2 runs (ZeRO 1 and ZeRO 3 on gloo) are launched with
torchrun on this file itself:

    torchrun --nproc-per-node 2 tests/parallel/test_grad_reduce_dtype.py OUTDIR
"""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from parallel_cases import SPEC
from torch import nn

from qlm_core.config import OptimConfig, ParallelConfig, Recipe, recipe_from_dict
from qlm_core.errors import QlmError
from qlm_core.parallel.grad_buffers import GradientBuffers
from qlm_core.parallel.optimizer import DistributedOptimizer
from qlm_core.parallel.param_meta import mark
from qlm_core.parallel.state import Grid, resolve_sizes
from qlm_core.profile.case import build_case, case_from_recipe
from qlm_core.profile.measure import measure_model_states
from qlm_core.profile.memory import stage_memory
from qlm_core.profile.states import model_state_bytes
from qlm_core.train.engine import Batch, Engine
from qlm_core.train.validate import validate_recipe

SEQ, STEPS = 32, 4
DP_CASES = {f"zero{z}_{g}": (z, g) for z in (1, 3) for g in ("fp32", "bf16")}


def _ids(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, SPEC.vocab_size, (rows, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _grad_tensors(buffers: GradientBuffers) -> list[torch.Tensor]:
    tensors = list(buffers.grad_buffers.values()) + list(buffers.shard_buffers.values())
    return tensors + [b.grad_data for b in buffers.buckets if b.grad_data is not None]


# ---- buffers and their bytes (one process) ------------------------------------------------------------------------


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_bf16_buffers_match_the_profile(zero_stage):
    """bf16 params, grad_reduce_dtype bf16: every gradient buffer is bf16, and its bytes are what states.py predicts
    (half the fp32 run's, with the same bucket layout)."""
    measured, layouts = {}, {}
    for grad in ("fp32", "bf16"):
        config = ParallelConfig(zero_stage=zero_stage, grad_reduce_dtype=grad, bucket_size_mb=0.01)
        engine = Engine(SPEC, config, Grid.single(), micro_batch_size=1, global_batch_size=2, seq_length=SEQ,
                        dtype=torch.bfloat16, optim=OptimConfig(lr=1e-3))
        engine.train_step(Batch(*_ids(2, 0)))
        buffers = engine.optimizer.buffers
        want = torch.bfloat16 if grad == "bf16" else torch.float32
        assert {t.dtype for t in _grad_tensors(buffers)} == {want}
        assert {p.main_grad.dtype for p in buffers.params if p.main_grad is not None} <= {want}
        predicted = model_state_bytes(engine.layout, 0, dtype=torch.bfloat16, zero_stage=zero_stage, shards=1,
                                      bucket_size_mb=0.01, grad_dtype=want)
        measured[grad] = measure_model_states(engine)
        assert measured[grad] == {"weights": predicted.weights, "grads": predicted.grads,
                                  "optimizer": predicted.optimizer}
        layouts[grad] = [(b.layout.numel, b.layout.param_indices) for b in buffers.buckets]
    assert len(layouts["fp32"]) > 1 and layouts["bf16"] == layouts["fp32"]  # bucket_size_mb means the same
    assert measured["bf16"]["grads"] * 2 == measured["fp32"]["grads"]
    assert {k: v for k, v in measured["bf16"].items() if k != "grads"} == {
        k: v for k, v in measured["fp32"].items() if k != "grads"}


def test_zero2_transient_and_deferred_buckets_in_bf16():
    """ZeRO 2: the storage a bucket borrows during backward and the whole shared-embedding bucket are bf16."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)).to(torch.bfloat16)
    mark(layers[0].weight, shared_embedding=True)
    params = list(layers.parameters())
    buffers = GradientBuffers(params, zero_stage=2, bucket_size_mb=None, overlap_grad_reduce=False,
                              grad_dtype=torch.bfloat16)
    seen = set()
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: seen.add(None if p.main_grad is None else p.main_grad.dtype))
    buffers.zero_grad()
    layers(torch.randn(3, 8, dtype=torch.bfloat16)).square().sum().backward()
    buffers.finish_grad_sync()
    assert buffers.peak_transient_grad_numel > 0 and torch.bfloat16 in seen and torch.float32 not in seen
    deferred = [b for b in buffers.buckets if b.layout.deferred]
    assert len(deferred) == 1 and deferred[0].grad_data.dtype == torch.bfloat16
    assert {b.grad_shard.dtype for b in buffers.buckets} == {torch.bfloat16}


# ---- the optimizer (one process) ----------------------------------------------------------------------------------


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_update_reads_fp32_copies_of_bf16_grads(zero_stage):
    """The norm, the clip and AdamW see fp32 copies of the bf16 reduced gradients (the same update as AdamW on
    those values in fp32), and no fp32 gradient outlives step()."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).to(torch.bfloat16)
    reference = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    buffers = GradientBuffers(list(model.parameters()), zero_stage=zero_stage, grad_dtype=torch.bfloat16)
    opt = DistributedOptimizer([{"params": list(model.parameters())}], buffers, lr=1e-2, weight_decay=0.1)
    seen = []
    inner_step = opt.optimizer.step

    def spy_step(*args, **kwargs):
        seen.extend(p.grad.dtype for group in opt.optimizer.param_groups for p in group["params"])
        return inner_step(*args, **kwargs)

    opt.optimizer.step = spy_step
    opt.zero_grad()
    model(torch.randn(5, 16, dtype=torch.bfloat16)).square().sum().backward()
    opt.finish_grad_sync()
    grads = [opt.full_grad(p).clone() for p in model.parameters()]
    assert {g.dtype for g in grads} == {torch.bfloat16}
    norm = opt.clip_grad_norm(0.5)
    want = math.sqrt(sum(g.float().square().sum().item() for g in grads))
    assert norm == pytest.approx(want, rel=1e-6) and norm > 0.5
    opt.step()
    assert seen and set(seen) == {torch.float32}
    assert all(f.grad is f.model_grad and f.master.grad is None for f in opt._fragments)  # copies freed

    ref = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, foreach=True)
    for r, g in zip(reference, grads, strict=True):
        r.grad = g.float() * (0.5 / (want + 1e-6))
    ref.step()
    masters = {f.param_index: f.master for f in opt._fragments}
    for i, r in enumerate(reference):
        torch.testing.assert_close(masters[i].view_as(r), r.detach(), rtol=1e-6, atol=1e-7)


def test_fp32_grads_keep_their_views():
    """grad_reduce_dtype fp32 (the default): the optimizer reads the buffers themselves, as before."""
    model = nn.Linear(8, 8).to(torch.bfloat16)
    buffers = GradientBuffers(list(model.parameters()), zero_stage=1)
    opt = DistributedOptimizer([{"params": list(model.parameters())}], buffers, lr=1e-3)
    assert not opt.copy_grads
    assert all(f.master.grad is f.grad and f.grad.dtype == torch.float32 for f in opt._fragments)


# ---- profile and recipe rules -------------------------------------------------------------------------------------


def test_profile_counts_the_optimizers_fp32_copies():
    """With bf16 gradients the optimizer steps on fp32 copies (4 bytes per element it updates): when little else is
    held (full recompute, short sequences) they set the peak, which must then cover states plus copies."""
    for zero in (0, 1):
        case = build_case(zero_stage=zero, recompute="full", seq_len=256, grad_reduce_dtype="bf16")
        memory = stage_memory(case, 0)
        c = memory.components
        shards = case.sizes.dp * case.parallel.cp if zero else 1
        copies = 4 * model_state_bytes(case.layout(), 0, dtype=case.torch_dtype, zero_stage=zero,
                                       shards=case.sizes.dp * case.parallel.cp,
                                       grad_dtype=torch.bfloat16).trainable_numel / shards
        held_at_step = c["weights"] + c["grads"] + c["optimizer"] + c["comm_buffers"] + copies
        assert memory.total - c["allocator"] >= held_at_step - 1, (zero, c, copies)
        assert c["activations"] < copies  # the case the copies decide


def test_an_engine_refuses_a_gradient_dtype_its_training_dtype_cannot_take():
    with pytest.raises(QlmError, match="grad_reduce_dtype"):
        Engine(SPEC, ParallelConfig(grad_reduce_dtype="bf16"), Grid.single(), micro_batch_size=1,
               global_batch_size=1, seq_length=8, dtype=torch.float32)


def test_profile_counts_bf16_grads():
    """ZeRO 2: the grad shards and the bucket transients in bf16 are half the fp32 ones; ZeRO 3's reduce-scatter
    input likewise; the recipe's value reaches the case."""
    for zero in (2, 3):
        fp32 = build_case(zero_stage=zero, recompute="full")
        bf16 = fp32.with_parallel(grad_reduce_dtype="bf16")
        a, b = stage_memory(fp32, 0).components, stage_memory(bf16, 0).components
        if zero == 2:
            assert b["grads"] * 2 == a["grads"] and b["comm_buffers"] * 2 == a["comm_buffers"]
        else:
            assert b["grads"] == a["grads"] and b["comm_buffers"] < a["comm_buffers"]
    recipe = Recipe()
    recipe.parallel = dataclasses.replace(recipe.parallel, grad_reduce_dtype="bf16")
    assert case_from_recipe(recipe, num_gpus=1, spec=SPEC).grad_reduce_dtype == "bf16"


def test_profile_flag(run_qlm):
    outs = {}
    for grad in ("fp32", "bf16"):
        code, out, err = run_qlm("profile", "--zero", "1", "--grad-reduce-dtype", grad, "--json")
        assert code == 0, err
        outs[grad] = json.loads(out)
    text = json.dumps(outs["bf16"])
    assert '"bf16"' in text and json.dumps(outs["fp32"]) != text


def test_bf16_grads_need_bf16_training():
    recipe = recipe_from_dict({"parallel": {"grad_reduce_dtype": "bf16"}, "model": {"dtype": "fp32"}})
    with pytest.raises(QlmError) as info:
        validate_recipe(recipe)
    message = str(info.value)
    assert "parallel.grad_reduce_dtype" in message and "model.dtype" in message and "fp32" in message
    assert "\n" not in message
    validate_recipe(recipe_from_dict({"parallel": {"grad_reduce_dtype": "bf16"}, "model": {"dtype": "bf16"}}))
    with pytest.raises(QlmError, match="grad_reduce_dtype"):
        recipe_from_dict({"parallel": {"grad_reduce_dtype": "int8"}})


# ---- dp2 training (torchrun) --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory) -> dict[str, dict]:
    from conftest import launch_torchrun

    out = tmp_path_factory.mktemp("grad-reduce-dtype")
    proc = launch_torchrun(Path(__file__), 2, out, timeout=600)
    errors = "\n".join(p.read_text() for p in out.glob("*.error"))
    assert proc.returncode == 0, errors or proc.stderr[-4000:]
    return {name: json.loads((out / f"{name}.json").read_text()) for name in DP_CASES}


@pytest.mark.distributed
@pytest.mark.parametrize("zero_stage", [1, 3])
def test_dp2_bf16_grads_train_like_fp32(dp_runs, zero_stage):
    fp32, bf16 = dp_runs[f"zero{zero_stage}_fp32"], dp_runs[f"zero{zero_stage}_bf16"]
    assert bf16["losses"][-1] < bf16["losses"][0] - 0.05  # it trains
    for a, b in zip(fp32["losses"], bf16["losses"], strict=True):
        assert abs(a - b) < 5e-3 * abs(a)
    assert bf16["losses"] != fp32["losses"]  # the reduction did change dtype
    assert fp32["reduce"] == "torch.float32" and bf16["reduce"] == "torch.bfloat16"
    assert set(bf16["update_grads"]) == {"torch.float32"}  # AdamW on the fp32 masters read fp32 gradients


def _dp_case(name: str, out: Path):
    zero, grad = DP_CASES[name]
    sizes = resolve_sizes(2, 1, 1, 1)
    grid = Grid.build(sizes, ranks=[0, 1])
    config = ParallelConfig(zero_stage=zero, grad_reduce_dtype=grad, overlap_grad_reduce=zero < 3)
    engine = Engine(SPEC, config, grid, micro_batch_size=1, global_batch_size=4, seq_length=SEQ,
                    dtype=torch.bfloat16, optim=OptimConfig(lr=1e-2), seed=7)
    optimizer = engine.optimizer
    update_grads = []
    inner_step = optimizer.optimizer.step

    def spy_step(*args, **kwargs):
        update_grads.extend(str(p.grad.dtype) for g in optimizer.optimizer.param_groups for p in g["params"]
                            if p.grad is not None)
        return inner_step(*args, **kwargs)

    optimizer.optimizer.step = spy_step
    if zero == 3:
        reduce = engine.chunks[0]._get_fsdp_state()._fsdp_param_group.mp_policy.reduce_dtype
    else:
        reduce = next(iter(optimizer.buffers.grad_buffers.values())).dtype
    losses = [engine.train_step(Batch(*_ids(2, grid.dp_rank))).loss for _ in range(STEPS)]  # one batch, learnt
    if grid.rank == 0:
        (out / f"{name}.json").write_text(json.dumps({"losses": losses, "reduce": str(reduce),
                                                      "update_grads": sorted(set(update_grads))}))


if __name__ == "__main__":
    from functools import partial

    from workers.harness import run_jobs

    run_jobs([(name, partial(_dp_case, name)) for name in DP_CASES], num_threads=1)
