"""RMSNormFunction and SwiGLUFunction against the plain expressions they replace: outputs and gradients bit-identical,
and only the input (plus the norm's fp32 1/rms) saved for backward."""

import pytest
import torch

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
def test_rms_norm_matches_the_plain_expression_bit_for_bit(dtype, weight_trains):
    torch.manual_seed(0)
    x = (torch.randn(3, 5, 64) * 3).to(dtype).requires_grad_()
    weight = (1 + 0.1 * torch.randn(64)).to(dtype).requires_grad_(weight_trains)
    grad = torch.randn(3, 5, 64).to(dtype)
    results = []
    for fn in (lambda a, w: rms_norm_reference(a, w, 1e-6), lambda a, w: RMSNormFunction.apply(a, w, 1e-6)):
        a, w = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_(weight_trains)
        out = fn(a, w)
        out.backward(grad)
        results.append((out, a.grad, w.grad))
    (out0, gx0, gw0), (out1, gx1, gw1) = results
    assert torch.equal(out0, out1)
    assert torch.equal(gx0, gx1)
    assert (gw0 is None and gw1 is None) or torch.equal(gw0, gw1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_the_plain_expression_bit_for_bit(dtype):
    torch.manual_seed(0)
    y = (torch.randn(4, 3, 2 * 48) * 2).to(dtype)
    grad = torch.randn(4, 3, 48).to(dtype)
    results = []
    for fn in (swiglu_reference, SwiGLUFunction.apply):
        a = y.detach().clone().requires_grad_()
        out = fn(a)
        out.backward(grad)
        results.append((out, a.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


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
