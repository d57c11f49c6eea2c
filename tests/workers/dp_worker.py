"""torchrun worker for tests/test_data_parallel.py (4 gloo ranks): data parallelism + the distributed optimizer
against one-process references computed inside each worker. Run as: torchrun --nproc-per-node 4 dp_worker.py OUTDIR

Writes OUTDIR/rank{R}.json: {check name: metrics}. A failing collective raises, so torchrun fails the launch.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from qlm_core.parallel.comm import all_reduce, group_rank, group_size
from qlm_core.parallel.grad_buffers import GradientBuffers
from qlm_core.parallel.optimizer import DistributedOptimizer
from qlm_core.parallel.tensor import gather_from_sp, mark_tp_split

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


# ---- one-process references ------------------------------------------------------------------------------------------


def reference_fp32():
    model = build_mlp(torch.float32)
    opt = torch.optim.AdamW(param_groups(model), lr=LR, betas=BETAS, eps=EPS)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = mlp_loss(model, DATA_X[step], DATA_Y[step])
        loss.backward()
        if step == 0:
            first_grads = [p.grad.clone() for p in model.parameters()]
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms, [p.detach().clone() for p in model.parameters()], first_grads


def reference_bf16(dp, m):
    """bf16 model, fp32 master weights, fp32 accumulation of the bf16 grads of the same dp×m chunks."""
    model = build_mlp(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    master_of = dict(zip(map(id, params), masters))
    groups = [{**g, "params": [master_of[id(p)] for p in g["params"]]} for g in param_groups(model)]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    losses, norms = [], []
    for step in range(STEPS):
        accum = [torch.zeros_like(w) for w in masters]
        total = 0.0
        for r in range(dp):
            for k in range(m):
                loss = mlp_loss(model, *microbatch(step, r, dp, k, m))
                loss.backward()
                total += loss.item()
                for a, p in zip(accum, params):
                    a.add_(p.grad)
                    p.grad = None
        for w, a in zip(masters, accum):
            w.grad = a
        if step == 0:
            first_grads = [a.clone() for a in accum]
        norms.append(torch.nn.utils.clip_grad_norm_(masters, MAX_NORM).item())
        opt.step()
        with torch.no_grad():
            for p, w in zip(params, masters):
                p.copy_(w)
        losses.append(total)
    return losses, norms, [w.clone() for w in masters], first_grads


# ---- the distributed runs --------------------------------------------------------------------------------------------


def build_dp(dtype, dp_group, cfg, seed=0):
    model = build_mlp(dtype, seed)
    ddp = GradientBuffers(
        list(model.parameters()), dp_group=dp_group, zero_stage=cfg["zero"],
        bucket_size_mb=cfg.get("bucket_mb", SMALL_BUCKET_MB), overlap_grad_reduce=cfg["overlap_grad"],
        num_microbatches=cfg["m"], shard_alignment=cfg.get("align", 1),
    )
    opt = DistributedOptimizer(param_groups(model), ddp, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                               overlap_param_gather=cfg.get("overlap_gather", False))
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


def compare(losses, norms, params, ref):
    ref_losses, ref_norms, ref_params, _ = ref
    return {
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "norm_rel": max(abs(a - b) / abs(b) for a, b in zip(norms, ref_norms)),
        "clipped": [n > MAX_NORM for n in norms],
        "ref_clipped": [n > MAX_NORM for n in ref_norms],
        "param_abs": max((p.detach().float() - r.float()).abs().max().item() for p, r in zip(params, ref_params)),
    }


def run_mlp(dtype, dp_group, cfg, ref):
    model, ddp, opt = build_dp(dtype, dp_group, cfg)
    probe = {}
    losses, norms = train(model, ddp, opt, dp_group, cfg["m"], range(STEPS), probe)
    if dtype == torch.float32:
        result = compare(losses, norms, list(model.parameters()), ref)
    else:  # compare the fp32 masters (gathered per param from the dp ranks' fragments) and the bf16 params
        result = compare(losses, norms, full_masters(opt, ddp, dp_group), ref)
        # how far each bf16 param is from the reference master cast to bf16, in units of the value (1 bf16 ulp is
        # 2^-8 to 2^-7 of it)
        result["bf16_param_rel"] = max(
            ((p.detach().float() - r.bfloat16().float()).abs() / r.bfloat16().float().abs().clamp_min(1e-3)).max()
            .item() for p, r in zip(model.parameters(), ref[2]))
    result["grad_abs"] = max((g - r).abs().max().item() for g, r in zip(probe["grads"], ref[3]))
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
    return [w.view(p.shape) for w, p in zip(full, ddp.params)]


def run_resume(dtype, dp_group, cfg, outdir):
    """Save after 2 steps, rebuild everything from a different init, load, 3 more steps == 5 uninterrupted."""
    full_model, ddp, opt = build_dp(dtype, dp_group, cfg)
    full_losses, _ = train(full_model, ddp, opt, dp_group, cfg["m"], range(STEPS))
    model, ddp, opt = build_dp(dtype, dp_group, cfg)
    train(model, ddp, opt, dp_group, cfg["m"], range(2))
    path = outdir / f"opt_z{cfg['zero']}_{str(dtype)[6:]}_rank{dist.get_rank()}.pt"
    torch.save(opt.state_dict(), path)
    model, ddp, opt = build_dp(dtype, dp_group, cfg, seed=99)
    opt.load_state_dict(torch.load(path, weights_only=True))
    resumed_losses, _ = train(model, ddp, opt, dp_group, cfg["m"], range(2, STEPS))
    return {
        "losses_equal": resumed_losses == full_losses[2:],
        "params_equal": all(torch.equal(a, b) for a, b in zip(model.parameters(), full_model.parameters())),
    }


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
    scale.sequence_parallel = True
    weight = mark_tp_split(nn.Parameter(SP_INIT[1].chunk(tp)[t].clone()))
    bias = mark_tp_split(nn.Parameter(SP_INIT[2].chunk(tp)[t].clone()))
    ddp = GradientBuffers([scale, weight, bias], dp_group=dp_group, zero_stage=zero, bucket_size_mb=40 * 4 / 2**20,
                          num_microbatches=m, tp_group=tp_group, shard_alignment=1)
    groups = [{"params": [weight], "weight_decay": WD}, {"params": [scale, bias], "weight_decay": 0.0}]
    opt = DistributedOptimizer(groups, ddp, lr=LR, betas=BETAS, eps=EPS, tp_group=tp_group)
    norms = []
    for step in range(SP_STEPS):
        ddp.zero_grad()
        columns = SP_X[step].chunk(dp, dim=1)[d], SP_T[step].chunk(dp, dim=1)[d]
        for x, target in zip(columns[0].chunk(m, dim=1), columns[1].chunk(m, dim=1)):
            z = gather_from_sp(x.chunk(tp)[t] * scale, tp_group)  # [S, b, H] after the SP all-gather
            loss = ((z @ weight.t() + bias - target.chunk(tp, dim=-1)[t]) ** 2).sum() / (SP_S * SP_B * SP_O)
            loss.backward()
        ddp.finish_grad_sync()
        norms.append(opt.clip_grad_norm(SP_MAX_NORM))
        opt.step()
    # reference: the whole model on one process
    ref = [nn.Parameter(w.clone()) for w in SP_INIT]
    groups = [{"params": [ref[1]], "weight_decay": WD}, {"params": [ref[0], ref[2]], "weight_decay": 0.0}]
    ref_opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    ref_norms = []
    for step in range(SP_STEPS):
        ref_opt.zero_grad()
        sp_loss(SP_X[step], *ref, SP_T[step]).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref, SP_MAX_NORM).item())
        ref_opt.step()
    mine = [scale, weight, bias]
    expected = [ref[0], ref[1].chunk(tp)[t], ref[2].chunk(tp)[t]]
    return {
        "param_abs": max((a - b).abs().max().item() for a, b in zip(mine, expected)),
        "norm_rel": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
        "clipped": [n > SP_MAX_NORM for n in ref_norms],
    }


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
        emb.shared_embedding = True
        params = [emb, a]
    else:
        b, emb = nn.Parameter(EMB_INIT[2].clone()), nn.Parameter(EMB_INIT[0].clone())
        emb.shared_embedding = emb.tied_copy = True
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
    ref = [nn.Parameter(w.clone()) for w in EMB_INIT]
    ref_opt = torch.optim.AdamW(ref, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    ref_norms, ref_losses = [], []
    for step in range(EMB_STEPS):
        ref_opt.zero_grad()
        loss = emb_last(emb_first(EMB_IDS[step], ref[0], ref[1]), ref[2], ref[0], EMB_TGT[step])
        loss.backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref, EMB_MAX_NORM).item())
        ref_opt.step()
        ref_losses.append(loss.item())
    expected = [ref[0], ref[1]] if stage == 0 else [ref[2], ref[0]]
    result = {
        "param_abs": max((p - r).abs().max().item() for p, r in zip(params, expected)),
        "norm_rel": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
        "clipped": [n > EMB_MAX_NORM for n in ref_norms],
    }
    if stage == 1:
        result["loss_rel"] = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
    return result


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

    ref = reference_fp32()
    for dp_name, dp_group in (("dp4", dist.group.WORLD), ("dp2", half)):
        for zero in (0, 1, 2):
            for overlap_grad in (False, True):
                for overlap_gather in ((False, True) if zero else (False,)):
                    for m in (1, 4):
                        cfg = dict(zero=zero, overlap_grad=overlap_grad, overlap_gather=overlap_gather, m=m)
                        name = f"{dp_name}_z{zero}_og{int(overlap_grad)}_opg{int(overlap_gather)}_m{m}"
                        results[name] = run_mlp(torch.float32, dp_group, cfg, ref)
        for zero in (1, 2):  # one bucket per dtype / the default 64-element shard alignment
            cfg = dict(zero=zero, overlap_grad=True, overlap_gather=True, m=2)
            results[f"{dp_name}_z{zero}_onebucket"] = run_mlp(torch.float32, dp_group, {**cfg, "bucket_mb": None}, ref)
            results[f"{dp_name}_z{zero}_aligned"] = run_mlp(torch.float32, dp_group, {**cfg, "align": 64}, ref)

    ref_bf16 = reference_bf16(4, 2)
    for zero in (0, 1, 2):
        cfg = dict(zero=zero, overlap_grad=True, overlap_gather=zero > 0, m=2)
        results[f"bf16_dp4_z{zero}"] = run_mlp(torch.bfloat16, dist.group.WORLD, cfg, ref_bf16)

    for zero in (0, 1, 2):
        results[f"sp_z{zero}"] = run_sequence_parallel(zero, dp_group=stride, tp_group=half)
        results[f"tied_z{zero}"] = run_tied_embedding(zero, dp_group=stride, pp_group=half)

    for zero in (0, 1, 2):
        cfg = dict(zero=zero, overlap_grad=True, overlap_gather=zero > 0, m=2)
        results[f"resume_z{zero}"] = run_resume(torch.float32, dist.group.WORLD, cfg, outdir)
    cfg = dict(zero=1, overlap_grad=True, m=2)
    results["resume_bf16_z1"] = run_resume(torch.bfloat16, dist.group.WORLD, cfg, outdir)

    (outdir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
