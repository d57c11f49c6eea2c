"""torchrun worker for tests/parallel/test_data_parallel.py (4 gloo ranks): data parallelism + the distributed
optimizer on
tiny models. It writes what each run produced (losses, grad norms, final params, step 0's reduced grads, bucket and
gather counters); the test computes the one-process references (tests/dp_references.py) and compares.

    torchrun --nproc-per-node 4 tests/workers/dp_worker.py OUTDIR

Writes OUTDIR/rank{R}.pt (torch.save): {case name: raw results}. A failing collective raises, so torchrun fails the
launch.
"""

import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from qlm_core.parallel.comm import all_reduce, group_rank, group_size
from qlm_core.parallel.grad_buffers import GradientBuffers
from qlm_core.parallel.optimizer import DistributedOptimizer
from qlm_core.parallel.param_meta import mark
from qlm_core.parallel.tensor import gather_from_sp

STEPS, GLOBAL_BATCH, LR, BETAS, EPS, WD = 5, 32, 1e-2, (0.9, 0.95), 1e-8, 0.1
MAX_NORM = 0.4  # the reference's norms are 0.34-0.43: some steps clip, some do not
SMALL_BUCKET_MB = 300 * 4 / 2**20  # 300 fp32 elements: 3 buckets for TinyMLP


class TinyMLP(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(40, dtype=dtype))  # a replicated norm-like weight
        self.fc1 = nn.Linear(12, 40, dtype=dtype)
        self.fc2 = nn.Linear(40, 24, dtype=dtype)
        self.fc3 = nn.Linear(24, 6, dtype=dtype)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)) * self.scale)))


def build_mlp(dtype, seed=0):
    torch.manual_seed(seed)
    model = TinyMLP()
    with torch.no_grad():
        model.scale.add_(0.1 * torch.randn(40))
    return model.to(dtype)


def param_groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]


_gen = torch.Generator().manual_seed(1234)
DATA_X = torch.randn(STEPS, GLOBAL_BATCH, 12, generator=_gen)
DATA_Y = torch.randn(STEPS, GLOBAL_BATCH, 6, generator=_gen)


def microbatch(step, dp_rank, dp, k, m):
    """Rank dp_rank's k-th of m microbatches of the step's global batch."""
    rows = GLOBAL_BATCH // dp
    x = DATA_X[step, dp_rank * rows : (dp_rank + 1) * rows].chunk(m)[k]
    y = DATA_Y[step, dp_rank * rows : (dp_rank + 1) * rows].chunk(m)[k]
    return x, y


def mlp_loss(model, x, y):
    """Sum of squared errors divided by the GLOBAL element count of the step (the trainer's normalisation)."""
    out = model(x.to(model.fc1.weight.dtype)).float()
    return ((out - y) ** 2).sum() / (GLOBAL_BATCH * 6)


# ---- the distributed runs --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MlpCase:
    """One data-parallel TinyMLP run over `group`: "dp4" (all 4 ranks) or "dp2" (ranks {0, 1} and {2, 3})."""

    group: str
    zero: int
    overlap_grad: bool
    overlap_gather: bool
    microbatches: int
    dtype: str = "fp32"  # "bf16": bf16 params with fp32 master weights
    bucket_mb: float | None = SMALL_BUCKET_MB  # None: one bucket per dtype
    align: int = 1  # shard alignment (elements)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "bf16" else torch.float32


DP_SIZES = {"dp4": 4, "dp2": 2}


def mlp_cases() -> dict[str, MlpCase]:
    """fp32: dp 4 and dp 2 × ZeRO 0/1/2 × overlapped or not × 1 or 4 microbatches, one bucket per dtype and the
    64-element shard alignment; bf16: dp 4 × ZeRO 0/1/2."""
    cases = {}
    for group in DP_SIZES:
        for zero in (0, 1, 2):
            for overlap_grad in (False, True):
                for overlap_gather in ((False, True) if zero else (False,)):
                    for m in (1, 4):
                        name = f"{group}_z{zero}_og{int(overlap_grad)}_opg{int(overlap_gather)}_m{m}"
                        cases[name] = MlpCase(group, zero, overlap_grad, overlap_gather, m)
        for zero in (1, 2):
            cases[f"{group}_z{zero}_onebucket"] = MlpCase(group, zero, True, True, 2, bucket_mb=None)
            cases[f"{group}_z{zero}_aligned"] = MlpCase(group, zero, True, True, 2, align=64)
    for zero in (0, 1, 2):
        cases[f"bf16_dp4_z{zero}"] = MlpCase("dp4", zero, True, zero > 0, 2, dtype="bf16")
    return cases


MLP_CASES = mlp_cases()
# save after 2 steps, load into a model built from another init, 3 more steps: the same as 5 uninterrupted
RESUME_CASES = {f"resume_z{zero}": MlpCase("dp4", zero, True, zero > 0, 2) for zero in (0, 1, 2)}
RESUME_CASES["resume_bf16_z1"] = MlpCase("dp4", 1, True, False, 2, dtype="bf16")
SP_ZEROS = TIED_ZEROS = (0, 1, 2)  # dp 2 × tp 2 (sequence parallel) and dp 2 × pp 2 (tied embedding)


def build_dp(case: MlpCase, dp_group, seed=0):
    model = build_mlp(case.torch_dtype, seed)
    ddp = GradientBuffers(
        list(model.parameters()), dp_group=dp_group, zero_stage=case.zero, bucket_size_mb=case.bucket_mb,
        overlap_grad_reduce=case.overlap_grad, num_microbatches=case.microbatches, shard_alignment=case.align,
    )
    opt = DistributedOptimizer(param_groups(model), ddp, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                               overlap_param_gather=case.overlap_gather)
    if opt.overlap_param_gather:
        opt.register_param_gather_hooks([model])
    return model, ddp, opt


def train(model, ddp, opt, dp_group, m, steps, probe=None):
    """`probe` (a dict) receives step 0's reduced grads and how many param all-gathers were pending after
    step 0's update and after step 1's first forward."""
    dp, rank = group_size(dp_group), group_rank(dp_group)
    losses, norms = [], []
    for step in steps:
        ddp.zero_grad()
        local = torch.zeros(())
        for k in range(m):
            loss = mlp_loss(model, *microbatch(step, rank, dp, k, m))
            if probe is not None and step == 1 and k == 0:
                probe["pending_after_forward"] = opt.pending_param_gathers
            loss.backward()
            local += loss.detach()
        ddp.finish_grad_sync()
        if probe is not None and step == 0:
            probe["grads"] = [ddp.full_grad(p).clone() for p in ddp.params]
        norms.append(opt.clip_grad_norm(MAX_NORM))
        opt.step()
        if probe is not None and step == 0:
            probe["pending_after_step"] = opt.pending_param_gathers
        losses.append(all_reduce(local, dp_group).item())
    opt.wait_param_gather()
    return losses, norms


def detached(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def run_mlp(case: MlpCase, dp_group):
    """Losses, norms, the final params (fp32: the model's; bf16: the fp32 masters re-assembled from the state_dict
    fragments, and the bf16 params), step 0's reduced grads, and the bucket / gather counters."""
    model, ddp, opt = build_dp(case, dp_group)
    probe = {}
    losses, norms = train(model, ddp, opt, dp_group, case.microbatches, range(STEPS), probe)
    result = {"losses": losses, "norms": norms, "grads": probe["grads"]}
    if case.dtype == "fp32":
        result["params"] = detached(model.parameters())
    else:
        result["params"] = full_masters(opt, ddp, dp_group)
        result["bf16_params"] = detached(model.parameters())
    result["pending_after_step"] = probe["pending_after_step"]
    result["pending_after_forward"] = probe["pending_after_forward"]
    result["buckets"] = len(ddp.buckets)
    result["full_grad_buffer"] = bool(ddp.grad_buffers)
    result["peak_transient_grad_numel"] = ddp.peak_transient_grad_numel
    result["largest_bucket"] = max(b.numel for b in ddp.buckets)
    result["total_numel"] = sum(p.numel() for p in ddp.params)
    return result


def full_masters(opt, ddp, dp_group):
    """Re-assemble full fp32 params from every dp rank's state_dict fragments (what an offline tool would do)."""
    pieces = [None] * group_size(dp_group)
    dist.all_gather_object(pieces, opt.state_dict()["fragments"], group=dp_group)
    full = [torch.zeros(p.numel()) for p in ddp.params]
    for fragments in pieces:
        for f in fragments:
            full[f["param_index"]][f["start"] : f["end"]] = f["master"]
    return [w.view(p.shape) for w, p in zip(full, ddp.params, strict=True)]


def run_resume(name: str, case: MlpCase, dp_group, outdir):
    """5 uninterrupted steps, and: 2 steps, save, rebuild everything from a different init, load, 3 more steps.
    Both runs' losses of steps 2-4 and final params."""
    full_model, ddp, opt = build_dp(case, dp_group)
    full_losses, _ = train(full_model, ddp, opt, dp_group, case.microbatches, range(STEPS))
    model, ddp, opt = build_dp(case, dp_group)
    train(model, ddp, opt, dp_group, case.microbatches, range(2))
    path = outdir / f"opt_{name}_rank{dist.get_rank()}.pt"
    torch.save(opt.state_dict(), path)
    model, ddp, opt = build_dp(case, dp_group, seed=99)
    opt.load_state_dict(torch.load(path, weights_only=True))
    resumed_losses, _ = train(model, ddp, opt, dp_group, case.microbatches, range(2, STEPS))
    return {"uninterrupted": {"losses": full_losses[2:], "params": detached(full_model.parameters())},
            "resumed": {"losses": resumed_losses, "params": detached(model.parameters())}}


# ---- sequence parallelism: dp 2 × tp 2 -------------------------------------------------------------------------------

SP_S, SP_B, SP_H, SP_O, SP_STEPS, SP_MAX_NORM = 8, 4, 10, 6, 3, 1.5
_gen = torch.Generator().manual_seed(7)
SP_X = torch.randn(SP_STEPS, SP_S, SP_B, SP_H, generator=_gen)
SP_T = torch.randn(SP_STEPS, SP_S, SP_B, SP_O, generator=_gen)
SP_INIT = (1 + 0.5 * torch.randn(SP_H, generator=_gen), 0.3 * torch.randn(SP_O, SP_H, generator=_gen),
           0.1 * torch.randn(SP_O, generator=_gen))


def sp_loss(x, scale, weight, bias, target):
    return ((x * scale @ weight.t() + bias - target) ** 2).sum() / (SP_S * SP_B * SP_O)


def run_sequence_parallel(zero, dp_group, tp_group):
    """y = (x * scale) W^T + b with a replicated `scale` (sequence_parallel: each TP rank sees its own sequence
    shard) and W, b split by output rows over TP. Without the TP all-reduce of scale's grad it would get half."""
    tp, t, dp, d, m = group_size(tp_group), group_rank(tp_group), group_size(dp_group), group_rank(dp_group), 2
    scale = nn.Parameter(SP_INIT[0].clone())
    mark(scale, sequence_parallel=True)
    weight = mark(nn.Parameter(SP_INIT[1].chunk(tp)[t].clone()), tp_split=True)
    bias = mark(nn.Parameter(SP_INIT[2].chunk(tp)[t].clone()), tp_split=True)
    ddp = GradientBuffers([scale, weight, bias], dp_group=dp_group, zero_stage=zero, bucket_size_mb=40 * 4 / 2**20,
                          num_microbatches=m, tp_group=tp_group, shard_alignment=1)
    groups = [{"params": [weight], "weight_decay": WD}, {"params": [scale, bias], "weight_decay": 0.0}]
    opt = DistributedOptimizer(groups, ddp, lr=LR, betas=BETAS, eps=EPS, tp_group=tp_group)
    norms = []
    for step in range(SP_STEPS):
        ddp.zero_grad()
        columns = SP_X[step].chunk(dp, dim=1)[d], SP_T[step].chunk(dp, dim=1)[d]
        for x, target in zip(columns[0].chunk(m, dim=1), columns[1].chunk(m, dim=1), strict=True):
            z = gather_from_sp(x.chunk(tp)[t] * scale, tp_group)  # [S, b, H] after the SP all-gather
            loss = ((z @ weight.t() + bias - target.chunk(tp, dim=-1)[t]) ** 2).sum() / (SP_S * SP_B * SP_O)
            loss.backward()
        ddp.finish_grad_sync()
        norms.append(opt.clip_grad_norm(SP_MAX_NORM))
        opt.step()
    return {"norms": norms, "params": detached([scale, weight, bias]), "tp": tp, "tp_rank": t}


# ---- tied embedding over two pipeline stages: dp 2 × pp 2 ------------------------------------------------------------

V, H, SEQ, EMB_BATCH, EMB_STEPS, EMB_MAX_NORM = 16, 8, 4, 4, 3, 0.7
_gen = torch.Generator().manual_seed(11)
EMB_IDS = torch.randint(V, (EMB_STEPS, EMB_BATCH, SEQ), generator=_gen)
EMB_TGT = torch.randint(V, (EMB_STEPS, EMB_BATCH, SEQ), generator=_gen)
EMB_INIT = [0.5 * torch.randn(V, H, generator=_gen), 0.5 * torch.randn(H, H, generator=_gen),
            0.5 * torch.randn(H, H, generator=_gen)]


def emb_first(ids, emb, a):
    return torch.tanh(F.embedding(ids, emb) @ a.t())


def emb_last(h, b, emb, tgt):
    logits = torch.tanh(h @ b.t()) @ emb.t()
    return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1), reduction="sum") / (EMB_BATCH * SEQ)


def run_tied_embedding(zero, dp_group, pp_group):
    """Stage 0 holds the embedding E and A, stage 1 holds B and its copy of E (the output layer). Run by hand
    (GPipe: all forwards, then all backwards, with send/recv); E's grad must be summed over the embedding group."""
    stage, dp, d, m = group_rank(pp_group), group_size(dp_group), group_rank(dp_group), 2
    peer = dist.get_global_rank(pp_group, 1 - stage)
    if stage == 0:
        emb, a = nn.Parameter(EMB_INIT[0].clone()), nn.Parameter(EMB_INIT[1].clone())
        mark(emb, shared_embedding=True)
        params = [emb, a]
    else:
        b, emb = nn.Parameter(EMB_INIT[2].clone()), nn.Parameter(EMB_INIT[0].clone())
        mark(emb, shared_embedding=True, tied_copy=True)
        params = [b, emb]
    ddp = GradientBuffers(params, dp_group=dp_group, zero_stage=zero, bucket_size_mb=None, num_microbatches=m,
                          embedding_group=pp_group, shard_alignment=1)
    opt = DistributedOptimizer([{"params": params}], ddp, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                               pp_group=pp_group)
    norms, losses = [], []
    for step in range(EMB_STEPS):
        ddp.zero_grad()
        ids = EMB_IDS[step].chunk(dp)[d].chunk(m)
        tgt = EMB_TGT[step].chunk(dp)[d].chunk(m)
        outputs = []
        for k in range(m):
            if stage == 0:
                outputs.append(emb_first(ids[k], emb, a))
                dist.send(outputs[-1].detach(), peer)
            else:
                h = torch.empty(ids[k].shape + (H,))
                dist.recv(h, peer)
                h.requires_grad_()
                outputs.append((h, emb_last(h, b, emb, tgt[k])))
        local = torch.zeros(())
        for k in range(m):
            if stage == 0:
                grad = torch.empty_like(outputs[k])
                dist.recv(grad, peer)
                outputs[k].backward(grad)
            else:
                h, loss = outputs[k]
                loss.backward()
                dist.send(h.grad, peer)
                local += loss.detach()
        ddp.finish_grad_sync()
        norms.append(opt.clip_grad_norm(EMB_MAX_NORM))
        opt.step()
        losses.append(all_reduce(local, dp_group).item())
    return {"stage": stage, "losses": losses, "norms": norms, "params": detached(params)}


# ---- main ------------------------------------------------------------------------------------------------------------


def main():
    outdir = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    assert dist.get_world_size() == 4
    # every rank creates every group, in the same order
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # adjacent ranks: TP or PP groups
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # the matching dp groups
    half, stride = halves[rank // 2], strided[rank % 2]
    results = {}

    dp_groups = {"dp4": dist.group.WORLD, "dp2": half}
    for name, case in MLP_CASES.items():
        results[name] = run_mlp(case, dp_groups[case.group])
    for zero in SP_ZEROS:
        results[f"sp_z{zero}"] = run_sequence_parallel(zero, dp_group=stride, tp_group=half)
    for zero in TIED_ZEROS:
        results[f"tied_z{zero}"] = run_tied_embedding(zero, dp_group=stride, pp_group=half)
    for name, case in RESUME_CASES.items():
        results[name] = run_resume(name, case, dp_groups[case.group], outdir)

    torch.save(results, outdir / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
