"""RMSNorm, computed in fp32 and cast back before the weight multiply (as HF Llama/Qwen2 do).

Autograd on the plain expression would save the fp32 copy of the input, 1/rms and the normalised value (6h bytes a
token in bf16, 8h in fp32) for a tensor whose input already exists; Megatron's fused norms keep only the input and
1/rms. `RMSNormFunction` does that: it saves the input (in its own dtype) and the fp32 1/rms and recomputes the rest
in backward, with the same operations autograd would run, so outputs and gradients are bit-identical to the plain
expression (tests/models/test_fused_pointwise.py).
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The plain expression, for tests and as the definition of what RMSNormFunction computes."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rms_input_grad(grad_normed: torch.Tensor, x32: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """The fp32 gradient of x32 * rstd, rstd = (mean(x32^2) + eps)^-1/2, given that of the product: autograd's
    terms, in its order."""
    grad_rstd = (grad_normed * x32).sum(-1, keepdim=True)
    grad_mean = (-0.5 * grad_rstd) * rstd.pow(3)
    grad_square = grad_mean.expand_as(x32) / x32.shape[-1]
    return grad_normed * rstd + grad_square * (2.0 * x32)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        x32 = x.to(torch.float32)
        normed = (x32 * rstd).to(x.dtype)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed).sum_to_size(weight.shape).to(weight.dtype)
        if not ctx.needs_input_grad[0]:
            return None, grad_weight, None
        grad_normed = (grad * weight).to(normed.dtype).to(torch.float32)
        return _rms_input_grad(grad_normed, x32, rstd).to(x.dtype), grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return RMSNormFunction.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def zero_centered_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: the weight is an offset from 1 and multiplies in fp32, before the cast (Megatron's
    zero-centred gamma)."""
    x32 = x.to(torch.float32)
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.to(torch.float32))).to(x.dtype)


class ZeroCenteredRMSNormFunction(torch.autograd.Function):
    """zero_centered_rms_norm_reference keeping only the input and the fp32 1/rms, as RMSNormFunction does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x32 * rstd * (1.0 + weight.to(torch.float32))).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        x32, grad32 = x.to(torch.float32), grad.to(torch.float32)
        normed = x32 * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad32 * normed).sum_to_size(weight.shape).to(weight.dtype)
        if not ctx.needs_input_grad[0]:
            return None, grad_weight, None
        grad_normed = grad32 * (1.0 + weight.to(torch.float32))
        return _rms_input_grad(grad_normed, x32, rstd).to(x.dtype), grad_weight, None


class ZeroCenteredRMSNorm(nn.Module):
    """Gemma's RMSNorm, `(1 + w)` times the normalised input; its weight starts at 0."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return ZeroCenteredRMSNormFunction.apply(x, self.weight, self.eps)
        return zero_centered_rms_norm_reference(x, self.weight, self.eps)
