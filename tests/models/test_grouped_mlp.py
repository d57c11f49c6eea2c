"""The routed experts' kernel: torch._grouped_mm and the per-expert loop both equal autograd on a plain per-expert
SwiGLU MLP (outputs and every gradient), with empty experts and token counts the grouped GEMM cannot take unpadded;
shapes it cannot align fall back to the loop."""

import pytest
import torch
import torch.nn.functional as F

from qlm_core.kernels.grouped_mlp import grouped_mm_fits, grouped_swiglu_mlp


def reference(x, counts, fc1, fc2):
    outs = []
    for part, w1, w2 in zip(x.split(counts), fc1, fc2, strict=True):
        h = F.linear(part, w1)
        ffn = w2.shape[1]
        outs.append(F.linear(F.silu(h[:, :ffn]) * h[:, ffn:], w2))
    return torch.cat(outs)


def tensors(counts, hidden, ffn, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), hidden, generator=g).to(dtype).requires_grad_()
    fc1 = [torch.randn(2 * ffn, hidden, generator=g).to(dtype).requires_grad_() for _ in counts]
    fc2 = [torch.randn(hidden, ffn, generator=g).to(dtype).requires_grad_() for _ in counts]
    return x, fc1, fc2


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_paths_equal_autograd_on_a_per_expert_loop(grouped, dtype):
    counts = [3, 0, 6, 4]  # 13 tokens: not a multiple of the grouped GEMM's row alignment; expert 1 gets none
    x, fc1, fc2 = tensors(counts, 16, 8, dtype)
    grad = torch.randn(sum(counts), 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    reference(x, counts, fc1, fc2).backward(grad)
    expected = [t.grad.clone() for t in (x, *fc1, *fc2)]
    out_ref = reference(x, counts, fc1, fc2).detach()
    for t in (x, *fc1, *fc2):
        t.grad = None
    out = grouped_swiglu_mlp(x, counts, fc1, fc2, grouped=grouped)
    out.backward(grad)
    tol = 0 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out, out_ref, atol=tol, rtol=tol)
    for got, want in zip((t.grad for t in (x, *fc1, *fc2)), expected, strict=True):
        assert got.dtype == want.dtype and torch.allclose(got, want, atol=tol * 10, rtol=tol)
    assert fc1[1].grad.abs().max() == 0  # the empty expert


def test_shapes_the_grouped_gemm_cannot_align_use_the_loop():
    assert grouped_mm_fits(torch.float32, 16, 8) and grouped_mm_fits(torch.bfloat16, 16, 8)
    assert not grouped_mm_fits(torch.float32, 16, 6)  # 24 bytes a row
    assert not grouped_mm_fits(torch.bfloat16, 16, 4)  # 8 bytes a row
    counts = [2, 3]
    x, fc1, fc2 = tensors(counts, 12, 6, torch.float32)
    out = grouped_swiglu_mlp(x, counts, fc1, fc2)  # grouped=None: chooses the loop
    assert torch.equal(out, reference(x, counts, fc1, fc2))


@pytest.mark.parametrize("counts", [(8, 0), (0, 8), (5, 0, 3, 0)])
def test_an_empty_experts_weight_gradient_is_zero_even_where_the_kernel_leaves_it_unwritten(monkeypatch, counts):
    """Some GPU kernels leave an empty group's weight gradient as it was; imitate that (NaN in every group without
    rows) on CPU: the kernel must zero those gradients itself, the last expert's too when no padding rows join it."""
    real = torch._grouped_mm

    def unwritten_empty_groups(a, b, offs):
        out = real(a, b, offs=offs)
        if out.dim() != 3:  # only the weight gradients are [groups, ...]
            return out
        starts = torch.cat([offs.new_zeros(1), offs[:-1]])
        out[(offs - starts) == 0] = float("nan")
        return out

    monkeypatch.setattr(torch, "_grouped_mm", unwritten_empty_groups)
    hidden, ffn = 16, 8
    x = torch.randn(sum(counts), hidden, requires_grad=True)
    fc1 = [torch.randn(2 * ffn, hidden, requires_grad=True) for _ in counts]
    fc2 = [torch.randn(hidden, ffn, requires_grad=True) for _ in counts]
    grouped_swiglu_mlp(x, counts, fc1, fc2, grouped=True).sum().backward()
    for count, w1, w2 in zip(counts, fc1, fc2, strict=True):
        assert torch.isfinite(w1.grad).all() and torch.isfinite(w2.grad).all()
        if count == 0:
            assert not w1.grad.any() and not w2.grad.any()
