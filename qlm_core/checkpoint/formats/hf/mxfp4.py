"""MXFP4 expert weights (gpt-oss as released: `quantization_config.quant_method` "mxfp4"): each packed expert weight
as `<name>_blocks` [E, rows, columns / 32, 16] uint8, two 4-bit E2M1 values a byte (the low nibble first), and
`<name>_scales` [E, rows, columns / 32] uint8, a power of two 2^(scale - 127) per 32 values (OCP's microscaling
format), dequantised as transformers does."""

from __future__ import annotations

from typing import Any

import torch

from qlm_core.errors import QlmError

BLOCKS, SCALES = "_blocks", "_scales"
DEQUANTISED_DTYPE = torch.bfloat16  # transformers' dequantised gpt-oss
# the 16 values of an E2M1 nibble: sign bit, two exponent bits, one mantissa bit
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SCALE_BIAS = 127
_BLOCK = 32  # values sharing one scale


def is_mxfp4(config: dict[str, Any]) -> bool:
    quant = config.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def dequantised_shape(name: str, blocks: tuple[int, ...], scales: tuple[int, ...]) -> tuple[int, ...]:
    """[E, columns, rows]: the packed tensor transformers holds (its experts' inputs first) of these blocks and
    scales, which must agree."""
    if len(blocks) != 4 or blocks[-1] != _BLOCK // 2 or tuple(scales) != tuple(blocks[:3]):
        raise QlmError(f"the MXFP4 tensor {name} is {list(blocks)} with scales {list(scales)}, not [E, rows, "
                       f"groups, {_BLOCK // 2}] with [E, rows, groups]", "restore the released weights")
    experts, rows, groups, _ = blocks
    return experts, groups * _BLOCK, rows


def dequantise(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One expert's blocks [rows, groups, 16] and scales [rows, groups] -> its weight [rows, groups · 32] in
    `dtype` (exact: every E2M1 value times a power of two is a bf16)."""
    rows, groups, _ = blocks.shape
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    pairs = torch.stack([values[(codes & 0x0F).long()], values[(codes >> 4).long()]], dim=-1)  # low nibble first
    exponents = scales.to(torch.int32) - _SCALE_BIAS
    weight = torch.ldexp(pairs.reshape(rows, groups, _BLOCK), exponents.unsqueeze(-1).float())
    return weight.reshape(rows, groups * _BLOCK).to(dtype)
