"""Context parallelism: layout helpers in-process, and p2p / allgather / a2a attention against full attention on 4
gloo ranks (one torchrun launch for the whole module, see docs/ARCHITECTURE.md §7; the float64 full attention is
computed here from the worker's inputs)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from conftest import launch_torchrun
from workers.cp_worker import CHECKS, SCALE, CpCheck, S, check_inputs, slopes

from qlm_core.kernels.pieces import Documents
from qlm_core.parallel.context_parallel import (
    context_parallel_attention,
    cp_token_indices,
    gather_from_cp,
    split_for_cp,
)

TOL = 1e-5
WORKER = Path(__file__).parents[1] / "workers" / "cp_worker.py"


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_token_indices_and_split(cp):
    seq = 8 * cp
    held = [cp_token_indices(seq, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(seq))
    c = seq // (2 * cp)
    for r, idx in enumerate(held):
        if cp == 1:
            assert torch.equal(idx, torch.arange(seq))
        else:
            assert idx.tolist() == list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
        x = torch.randn(3, seq, 2)
        assert torch.equal(split_for_cp(x, cp, r, 1), x.index_select(1, idx))
        assert torch.equal(split_for_cp(x, cp, r, -2), x.index_select(1, idx))
    assert cp_token_indices(6, 1, 0).tolist() == list(range(6))  # cp = 1 needs no even split


def test_layout_errors():
    with pytest.raises(ValueError, match="divisible"):
        cp_token_indices(10, 2, 0)
    with pytest.raises(ValueError, match="divisible"):
        split_for_cp(torch.zeros(1, 10), 4, 0, 1)


def test_no_group_is_plain_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    segments = torch.tensor([[0] * 3 + [1] * 7, [0] * 10])
    x = torch.randn(2, 10)
    assert gather_from_cp(x, None, 1) is x
    back = torch.arange(10)[:, None] - torch.arange(10)[None, :]
    for seg, window in itertools.product((None, segments), (None, 4)):
        docs = None if seg is None else Documents.from_segment_ids(seg)
        got = context_parallel_attention(q, k, v, group=None, comm_type="p2p", scale=0.3, documents=docs,
                                         window=window)
        mask = (back >= 0) & (back < (window or 10))
        if seg is not None:
            mask = mask & (seg[:, :, None] == seg[:, None, :])[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
        assert (got - want).abs().max() <= TOL


def full_attention(q, k, v, segments, window, sinks=None, alibi_slopes=None):
    """Causal (+ same-document, + sliding-window) attention over the whole sequence, GQA by repeating k and v;
    with `sinks`, gpt-oss's eager formula (each head's sink logit joins the softmax and is dropped after it); with
    `alibi_slopes`, ALiBi's slope * (j - i) added to the scores."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    back = torch.arange(S)[:, None] - torch.arange(S)[None, :]
    allowed = ((back >= 0) & (back < (window or S)))[None, None]
    if segments is not None:
        allowed = allowed & (segments[:, :, None] == segments[:, None, :])[:, None]
    scores = q @ k.transpose(-1, -2) * SCALE
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.to(scores.dtype).view(1, -1, 1, 1) * back
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, -1) @ v
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    return torch.cat((scores, sink), -1).softmax(-1)[..., :-1] @ v


def full_reference(check: CpCheck) -> dict[str, torch.Tensor]:
    """out, dq, dk, dv (and dsinks) of full attention in float64 with autograd, on the worker's inputs."""
    q, k, v, grad, segments, sinks = check_inputs(check)
    full = [t.double().requires_grad_() for t in (q, k, v)]
    sinks = None if sinks is None else sinks.double().requires_grad_()
    out = full_attention(*full, segments, check.window, sinks, slopes(check))
    out.backward(grad.double())
    grads = {n: t.grad for n, t in zip(("dq", "dk", "dv"), full, strict=True)}
    return {"out": out.detach(), **grads, **({} if sinks is None else {"dsinks": sinks.grad})}


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    """Per rank: (its {check name: raw slices}, its gather / a2a results)."""
    out = tmp_path_factory.mktemp("cp")
    proc = launch_torchrun(WORKER, 4, out, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    for r, result in enumerate(ranks):
        assert "error" not in result, f"rank {r}:\n{result['error']}"
    return [(torch.load(out / f"rank{r}.pt", weights_only=True), result) for r, result in enumerate(ranks)]


@pytest.mark.distributed
@pytest.mark.parametrize("name", CHECKS)
def test_context_parallel_attention_matches_full(cp_results, name):
    check = CHECKS[name]
    expected = full_reference(check)
    dsinks = expected.pop("dsinks", None)
    for rank, (checks, _) in enumerate(cp_results):
        got = checks[name]
        diffs = {key: (got[key].double() - split_for_cp(expected[key], check.cp, got["cp_rank"], 2)).abs().max().item()
                 for key in expected}
        assert max(diffs.values()) <= TOL, (name, rank, diffs)
    if dsinks is not None:  # each group of cp ranks' shares sum to the whole gradient
        ranks = [checks[name] for checks, _ in cp_results]
        for members in ([0, 2], [1, 3]) if check.cp == 2 else ([0, 1, 2, 3],):
            total = sum(ranks[r]["dsinks"].double() for r in members)
            assert (total - dsinks).abs().max() <= TOL, (name, members)


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_gather_round_trip_and_a2a_errors(cp_results, cp):
    for _, result in cp_results:
        assert result["gather"][f"cp{cp}"] == {"value": 0.0, "grad": 0.0}
        assert result["a2a_errors"][f"cp{cp}"] is True
