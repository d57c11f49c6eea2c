"""RMSNormFunction and SwiGLUFunction against transformers' own Qwen2RMSNorm and Qwen2MLP activation: outputs and
gradients bit-identical, and only the input (plus the norm's fp32 1/rms) saved for backward."""

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from qlm_core.kernels.norm import RMSNormFunction, rms_norm_reference
from qlm_core.kernels.swiglu import SwiGLUFunction, swiglu_reference


def saved_bytes(fn, *inputs) -> int:
    """Bytes of distinct storages autograd keeps for backward of fn(*inputs), parameters excluded."""
    storages = {}
    params = {t.untyped_storage().data_ptr() for t in inputs[1:]}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_trains", [True, False])
def test_rms_norm_matches_transformers_bit_for_bit(dtype, weight_trains):
    torch.manual_seed(0)
    x = (torch.randn(3, 5, 64) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(64)).to(dtype)
    grad = torch.randn(3, 5, 64).to(dtype)
    hf = Qwen2RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
    hf.weight.requires_grad_(weight_trains)
    theirs_x, ours_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours_w = weight.clone().requires_grad_(weight_trains)
    theirs, ours = hf(theirs_x), RMSNormFunction.apply(ours_x, ours_w, 1e-6)
    theirs.backward(grad)
    ours.backward(grad)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours_x.grad, theirs_x.grad)
    assert (not weight_trains and ours_w.grad is None) or torch.equal(ours_w.grad, hf.weight.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_transformers_bit_for_bit(dtype):
    """Qwen2MLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)); qlm's linear_fc1 holds [gate; up] in one output.
    The width is a multiple of 64, as models' intermediate sizes are: qlm's gate is a row-strided view, and torch's
    vectorised silu runs a row's last partial block of an AVX-512 unroll (a width of 48 there) on another code
    path than it does inside one contiguous tensor, a last-bit difference."""
    torch.manual_seed(0)
    gate, up = ((torch.randn(4, 3, 64) * 2).to(dtype) for _ in range(2))
    grad = torch.randn(4, 3, 64).to(dtype)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    theirs = ACT2FN["silu"](g) * u
    theirs.backward(grad)
    fc1_out = torch.cat([gate, up], dim=-1).requires_grad_()
    ours = SwiGLUFunction.apply(fc1_out)
    ours.backward(grad)
    assert torch.equal(ours, theirs)
    assert torch.equal(fc1_out.grad, torch.cat([g.grad, u.grad], dim=-1))


def test_rms_norm_keeps_its_input_and_rstd_only():
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(64, dtype=torch.bfloat16, requires_grad=True)
    fused = saved_bytes(lambda a, b: RMSNormFunction.apply(a, b, 1e-6), x, w)
    plain = saved_bytes(lambda a, b: rms_norm_reference(a, b, 1e-6), x, w)
    assert fused == 8 * 64 * 2 + 8 * 4  # the bf16 input and an fp32 1/rms per token
    assert plain == 8 * 64 * 4 + 8 * 4 + 8 * 64 * 2  # fp32 input copy, 1/rms, the normalised value


def test_swiglu_keeps_fc1_output_only():
    y = torch.randn(8, 2 * 32, dtype=torch.bfloat16, requires_grad=True)
    assert saved_bytes(SwiGLUFunction.apply, y) == 8 * 64 * 2
    assert saved_bytes(swiglu_reference, y) == 8 * 64 * 2 + 8 * 32 * 2  # and silu(gate)
