"""Data parallelism (GradientBuffers) and the distributed optimizer (ZeRO 0/1/2) against one-process references.

One torchrun launch (4 gloo ranks, tests/workers/dp_worker.py) runs every distributed case and writes each rank's
raw results; the one-process references are computed here (tests/dp_references.py). The single-process tests below
cover the bucket layout and the error paths."""

from pathlib import Path

import pytest
import torch
from conftest import launch_torchrun
from dp_references import (
    compare_mlp,
    max_abs,
    max_rel,
    reference_bf16,
    reference_fp32,
    reference_sequence_parallel,
    reference_tied_embedding,
)
from torch import nn
from workers.dp_worker import DP_SIZES, EMB_MAX_NORM, MLP_CASES, RESUME_CASES, SP_MAX_NORM, SP_ZEROS, TIED_ZEROS

from qlm_core.parallel.grad_buffers import GradientBuffers, plan_buckets
from qlm_core.parallel.optimizer import DistributedOptimizer
from qlm_core.parallel.param_meta import mark

WORLD = 4
TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """Per rank: {case name: raw results} (see dp_worker.py)."""
    out = tmp_path_factory.mktemp("dp")
    worker = Path(__file__).parents[1] / "workers" / "dp_worker.py"
    proc = launch_torchrun(worker, WORLD, out, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.fixture(scope="module")
def mlp_metrics(results) -> list[tuple[int, str, object, dict]]:
    """(rank, case name, MlpCase, raw results + their distance from the one-process reference) for every TinyMLP
    case on every rank; the bf16 references follow each case's dp size and microbatch count."""
    fp32 = reference_fp32()
    bf16 = {}
    rows = []
    for rank, per_rank in enumerate(results):
        for name, case in MLP_CASES.items():
            if case.dtype == "fp32":
                ref = fp32
            else:
                key = (DP_SIZES[case.group], case.microbatches)
                ref = bf16[key] if key in bf16 else bf16.setdefault(key, reference_bf16(*key))
            raw = per_rank[name]
            rows.append((rank, name, case, {**raw, **compare_mlp(raw, ref)}))
    return rows


def _mlp_cases(mlp_metrics, dtype):
    cases = [(rank, name, case, r) for rank, name, case, r in mlp_metrics if case.dtype == dtype]
    assert cases, dtype
    return cases


def _summary(r: dict) -> dict:
    """A result without its tensors, for assertion messages."""
    return {k: v for k, v in r.items() if k not in ("params", "bf16_params", "grads")}


@pytest.mark.distributed
def test_fp32_matches_one_process_adamw(mlp_metrics):
    """dp 4 and dp 2 × ZeRO 0/1/2 × overlapped or not × 1 or 4 microbatches, buckets cut at shard boundaries."""
    assert {case.group for _, _, case, _ in _mlp_cases(mlp_metrics, "fp32")} == {"dp4", "dp2"}
    for rank, name, _, r in _mlp_cases(mlp_metrics, "fp32"):
        where = (rank, name, _summary(r))
        assert r["loss_rel"] <= TOL, where
        assert r["norm_rel"] <= TOL, where
        assert r["clipped"] == r["ref_clipped"] and any(r["clipped"]) and not all(r["clipped"]), where
        assert r["param_abs"] <= TOL, where
        assert r["grad_abs"] <= 1e-6, where  # the reduced grads of step 0 (full_grad)


@pytest.mark.distributed
def test_layouts_exercised(results):
    r = results[0]
    assert r["dp4_z1_og1_opg1_m4"]["buckets"] == 3 and r["dp4_z1_onebucket"]["buckets"] == 1
    assert r["dp4_z1_aligned"]["largest_bucket"] % (4 * 64) == 0  # padded so each shard is 64-element aligned


@pytest.mark.distributed
def test_overlapped_param_gather_is_waited_by_forward(mlp_metrics):
    for rank, name, case, r in _mlp_cases(mlp_metrics, "fp32"):
        if case.overlap_gather:
            assert r["pending_after_step"] == r["buckets"], (rank, name)  # step() returned with gathers in flight
            assert r["pending_after_forward"] == 0, (rank, name)  # the forward pre-hooks waited for them
        else:
            assert r["pending_after_step"] == 0, (rank, name)


@pytest.mark.distributed
def test_zero2_keeps_no_full_gradient_buffer(mlp_metrics):
    for rank, name, case, r in _mlp_cases(mlp_metrics, "fp32"):
        if case.zero != 2:
            assert r["full_grad_buffer"] and r["peak_transient_grad_numel"] == 0
            continue
        assert not r["full_grad_buffer"], (rank, name)
        if not case.overlap_grad:  # reduced synchronously: one bucket's storage at a time
            assert r["peak_transient_grad_numel"] == r["largest_bucket"], (rank, name)
        else:  # at most max_reductions_in_flight (2) buckets in flight + the one being filled
            assert r["peak_transient_grad_numel"] <= 3 * r["largest_bucket"], (rank, name)


@pytest.mark.distributed
def test_bf16_params_with_fp32_master_weights(mlp_metrics):
    """The reference runs the same bf16 microbatches and accumulates their grads in fp32, but sums them in another
    order than the dp reduction, so the fp32 masters differ by fp32 rounding (~1e-7). A master that sits on a bf16
    rounding boundary can then cast to the neighbouring bf16 value: a bf16 param may be 1 ulp (at most 2^-7 of the
    value) off, which perturbs later bf16 forwards slightly; hence the looser loss and master tolerances."""
    for rank, name, _, r in _mlp_cases(mlp_metrics, "bf16"):
        where = (rank, name, _summary(r))
        assert r["loss_rel"] <= 1e-4, where
        assert r["norm_rel"] <= 1e-4, where
        assert r["param_abs"] <= 1e-4, where  # fp32 masters, re-assembled from state_dict fragments
        assert r["bf16_param_rel"] <= 2**-7, where
        assert r["grad_abs"] <= 1e-6, where


@pytest.mark.distributed
def test_sequence_parallel_grads_are_summed_over_tp(results):
    ref_norms, (scale, weight, bias) = reference_sequence_parallel()
    clipped = [n > SP_MAX_NORM for n in ref_norms]
    assert any(clipped) and not all(clipped), ref_norms
    for rank, per_rank in enumerate(results):
        for zero in SP_ZEROS:
            r = per_rank[f"sp_z{zero}"]
            tp, t = r["tp"], r["tp_rank"]  # weight and bias are split by output rows over tp
            param_abs = max_abs(r["params"], [scale, weight.chunk(tp)[t], bias.chunk(tp)[t]])
            norm_rel = max_rel(r["norms"], ref_norms)
            assert param_abs <= TOL and norm_rel <= TOL, (rank, zero, param_abs, norm_rel)


@pytest.mark.distributed
def test_tied_embedding_grads_are_summed_over_the_embedding_group(results):
    ref_losses, ref_norms, (emb, a, b) = reference_tied_embedding()
    clipped = [n > EMB_MAX_NORM for n in ref_norms]
    assert any(clipped) and not all(clipped), ref_norms
    for rank, per_rank in enumerate(results):
        for zero in TIED_ZEROS:
            r = per_rank[f"tied_z{zero}"]
            expected = [emb, a] if r["stage"] == 0 else [b, emb]  # each stage's params, its copy of E included
            param_abs, norm_rel = max_abs(r["params"], expected), max_rel(r["norms"], ref_norms)
            assert param_abs <= TOL and norm_rel <= TOL, (rank, zero, param_abs, norm_rel)
            if r["stage"] == 1:  # the loss is computed on the last stage
                loss_rel = max_rel(r["losses"], ref_losses)
                assert loss_rel <= TOL, (rank, zero, loss_rel)


@pytest.mark.distributed
def test_state_dict_round_trip_is_bit_exact(results):
    for rank, per_rank in enumerate(results):
        for name in RESUME_CASES:
            full, resumed = per_rank[name]["uninterrupted"], per_rank[name]["resumed"]
            assert resumed["losses"] == full["losses"], (rank, name, resumed["losses"], full["losses"])
            assert all(torch.equal(a, b) for a, b in zip(resumed["params"], full["params"], strict=True)), (rank, name)


# ---- one process -----------------------------------------------------------------------------------------------------


def _params(*sizes, dtype=torch.float32):
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]


def test_bucket_layout_reverse_order_and_padding():
    params = _params(10, 7, 5, 20, 3)
    layouts = plan_buckets(params, bucket_numel=12, pad_multiple=4)
    # reverse order; a bucket closes once it holds >= 12 elements; params are never split
    assert [b.param_indices for b in layouts] == [(4, 3), (2, 1), (0,)]
    assert [b.param_ranges for b in layouts] == [((0, 3), (3, 23)), ((0, 5), (5, 12)), ((0, 10),)]
    assert [b.numel for b in layouts] == [24, 12, 12]
    assert [b.numel_unpadded for b in layouts] == [23, 12, 10]
    assert layouts[0].shard_range(1, 4) == (6, 12)  # shard 1 cuts param 3 at bucket element 6
    assert plan_buckets(params, None, 8)[0].numel == 48  # one bucket


def test_bucket_layout_dtypes_and_shared_embedding():
    params = _params(4, 4) + _params(6, dtype=torch.bfloat16) + _params(8)
    mark(params[0], shared_embedding=True)
    layouts = plan_buckets(params, bucket_numel=100, pad_multiple=1)
    assert [(b.dtype, b.param_indices, b.deferred) for b in layouts] == [
        (torch.float32, (3, 1), False), (torch.float32, (0,), True), (torch.bfloat16, (2,), False),
    ]


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_buffers_views_and_main_grads(zero):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    ref = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    ref.load_state_dict(model.state_dict())
    ddp = GradientBuffers(list(model.parameters()), zero_stage=zero, bucket_size_mb=20 * 4 / 2**20, shard_alignment=8)
    # reverse order [l1.bias 3, l1.weight 15, l0.bias 5] closes at >= 20 elements; ZeRO 1/2 pad to 8
    assert [b.numel for b in ddp.buckets] == ([23, 30] if zero == 0 else [24, 32])
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.detach(), r.detach())
        if zero:  # .data lives in the param buffer
            assert p.untyped_storage().data_ptr() == ddp.param_buffers[torch.float32].untyped_storage().data_ptr()
    x = torch.randn(4, 6)
    ddp.zero_grad()
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is None
        if zero < 2:  # accumulated into the persistent fp32 buffer
            assert torch.allclose(p.main_grad, r.grad)
        else:  # reduced into the shard and the bucket storage freed
            assert p.main_grad is None
    ddp.finish_grad_sync()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(ddp.full_grad(p), r.grad)


def test_incomplete_bucket_is_an_error_with_overlap():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ddp = GradientBuffers(list(model.parameters()), zero_stage=1, num_microbatches=2)
    ddp.zero_grad()
    model(torch.randn(2, 4)).sum().backward()  # one microbatch of two
    with pytest.raises(RuntimeError, match="expected 8"):
        ddp.finish_grad_sync()


def test_non_finite_norm_is_not_clipped_and_the_step_can_be_skipped():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ddp = GradientBuffers(list(model.parameters()), zero_stage=1)
    opt = DistributedOptimizer([{"params": list(model.parameters())}], ddp, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    ddp.zero_grad()
    (model(torch.randn(3, 4)).sum() * float("inf")).backward()
    ddp.finish_grad_sync()
    assert not torch.isfinite(torch.tensor(opt.clip_grad_norm(1.0)))
    opt.zero_grad()  # the trainer skips step()
    model(torch.randn(3, 4)).sum().backward()
    ddp.finish_grad_sync()
    assert 0 < opt.clip_grad_norm(1e9) < float("inf")
    opt.step()
    assert all(torch.isfinite(p).all() and not torch.equal(p, b)
               for p, b in zip(model.parameters(), before, strict=True))


def test_overlap_param_gather_requires_hooks_and_layouts_must_match():
    model = nn.Linear(4, 2)
    ddp = GradientBuffers(list(model.parameters()), zero_stage=1)
    opt = DistributedOptimizer([{"params": list(model.parameters())}], ddp, lr=0.1, overlap_param_gather=True)
    with pytest.raises(RuntimeError, match="register_param_gather_hooks"):
        opt.step()
    other = nn.Linear(4, 3)
    ddp2 = GradientBuffers(list(other.parameters()), zero_stage=1)
    opt2 = DistributedOptimizer([{"params": list(other.parameters())}], ddp2, lr=0.1)
    with pytest.raises(ValueError, match="layout differs"):
        opt2.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="in no param group"):
        DistributedOptimizer([{"params": [model.weight]}], ddp, lr=0.1)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_grads_written_straight_to_dot_grad_are_reduced(zero):
    """torch.distributed.pipelining's zero-bubble weight pass assigns .grad without firing post-accumulate hooks."""
    backward = pytest.importorskip("torch.distributed.pipelining._backward")
    stage_backward_input, stage_backward_weight = backward.stage_backward_input, backward.stage_backward_weight

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    ref = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    ref.load_state_dict(model.state_dict())
    ddp = GradientBuffers(list(model.parameters()), zero_stage=zero, bucket_size_mb=20 * 4 / 2**20, num_microbatches=2)
    ddp.zero_grad()
    for x in torch.randn(2, 4, 6):
        x.requires_grad_()
        out = model(x).square()
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], model.parameters())
        stage_backward_weight(model.parameters(), groups)
        ref(x).square().sum().backward()
    ddp.finish_grad_sync()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is None
        assert torch.allclose(ddp.full_grad(p), r.grad)
