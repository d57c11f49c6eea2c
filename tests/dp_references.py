"""One-process references for the runs of tests/workers/dp_worker.py, and how far a run's raw results are from them
(tests/parallel/test_data_parallel.py asserts on these numbers)."""

import torch
from torch import nn
from workers.dp_worker import (
    BETAS,
    DATA_X,
    DATA_Y,
    EMB_IDS,
    EMB_INIT,
    EMB_MAX_NORM,
    EMB_STEPS,
    EMB_TGT,
    EPS,
    LR,
    MAX_NORM,
    SP_INIT,
    SP_MAX_NORM,
    SP_STEPS,
    SP_T,
    SP_X,
    STEPS,
    WD,
    build_mlp,
    emb_first,
    emb_last,
    microbatch,
    mlp_loss,
    param_groups,
    sp_loss,
)


def reference_fp32():
    """(losses, norms, final params, step 0's grads) of TinyMLP trained with torch's AdamW on the whole batch."""
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
    master_of = dict(zip(map(id, params), masters, strict=True))
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
                for a, p in zip(accum, params, strict=True):
                    a.add_(p.grad)
                    p.grad = None
        for w, a in zip(masters, accum, strict=True):
            w.grad = a
        if step == 0:
            first_grads = [a.clone() for a in accum]
        norms.append(torch.nn.utils.clip_grad_norm_(masters, MAX_NORM).item())
        opt.step()
        with torch.no_grad():
            for p, w in zip(params, masters, strict=True):
                p.copy_(w)
        losses.append(total)
    return losses, norms, [w.clone() for w in masters], first_grads


def reference_sequence_parallel():
    """(norms, final [scale, weight, bias]) of the sequence-parallel model on one process."""
    ref = [nn.Parameter(w.clone()) for w in SP_INIT]
    groups = [{"params": [ref[1]], "weight_decay": WD}, {"params": [ref[0], ref[2]], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    norms = []
    for step in range(SP_STEPS):
        opt.zero_grad()
        sp_loss(SP_X[step], *ref, SP_T[step]).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref, SP_MAX_NORM).item())
        opt.step()
    return norms, [p.detach() for p in ref]


def reference_tied_embedding():
    """(losses, norms, final [E, A, B]) of the two-stage tied-embedding model on one process."""
    ref = [nn.Parameter(w.clone()) for w in EMB_INIT]
    opt = torch.optim.AdamW(ref, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses, norms = [], []
    for step in range(EMB_STEPS):
        opt.zero_grad()
        loss = emb_last(emb_first(EMB_IDS[step], ref[0], ref[1]), ref[2], ref[0], EMB_TGT[step])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref, EMB_MAX_NORM).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms, [p.detach() for p in ref]


def max_rel(values, expected) -> float:
    """The largest |a - b| / |b| over two equally long lists of numbers."""
    assert len(values) == len(expected), (len(values), len(expected))
    return max(abs(a - b) / abs(b) for a, b in zip(values, expected, strict=True))


def max_abs(tensors, expected) -> float:
    """The largest elementwise |a - b| over two equally long lists of tensors (compared in fp32)."""
    assert len(tensors) == len(expected), (len(tensors), len(expected))
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(tensors, expected, strict=True))


def compare_mlp(raw: dict, ref) -> dict:
    """A TinyMLP run's distance from its reference: losses and norms (relative), final params and step 0's reduced
    grads (absolute), which steps clipped; for bf16, each bf16 param's distance from the reference master cast to
    bf16 in units of the value (1 bf16 ulp is 2^-8 to 2^-7 of it)."""
    ref_losses, ref_norms, ref_params, ref_grads = ref
    result = {
        "loss_rel": max_rel(raw["losses"], ref_losses),
        "norm_rel": max_rel(raw["norms"], ref_norms),
        "clipped": [n > MAX_NORM for n in raw["norms"]],
        "ref_clipped": [n > MAX_NORM for n in ref_norms],
        "param_abs": max_abs(raw["params"], ref_params),
        "grad_abs": max_abs(raw["grads"], ref_grads),
    }
    if "bf16_params" in raw:
        result["bf16_param_rel"] = max(
            ((p.float() - r.bfloat16().float()).abs() / r.bfloat16().float().abs().clamp_min(1e-3)).max().item()
            for p, r in zip(raw["bf16_params"], ref_params, strict=True))
    return result
