"""FP8 weights with block scales (DeepSeek-V3 / R1, Kimi-K2 as released: `quantization_config.quant_method` "fp8",
e4m3 weights and an fp32 `weight_scale_inv` [ceil(rows / bm), ceil(columns / bn)] per linear), dequantised as
transformers does: weight · scale of its (bm, bn) block, in fp32, then cast to the dtype asked for."""

from __future__ import annotations

from typing import Any

import torch

from qlm_core.errors import QlmError

SCALE_SUFFIX = "weight_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEQUANTISED_DTYPE = torch.bfloat16  # what an FP8 weight reads as unless a wider dtype is asked for


def block_size(config: dict[str, Any]) -> tuple[int, int] | None:
    """The (rows, columns) block of an FP8 config.json's quantization_config; None when the model is not FP8."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2 and all(type(n) is int and n > 0 for n in block)):
        raise QlmError(f"config.json: quantization_config's weight_block_size is {block!r}, not two positive "
                       "integers", "set it as the released checkpoint has it (e.g. [128, 128])")
    return block[0], block[1]


def scale_name(weight_name: str) -> str:
    return weight_name[: -len("weight")] + SCALE_SUFFIX


def check_scale_shape(name: str, weight_shape: tuple[int, ...], scale_shape: tuple[int, ...],
                      block: tuple[int, int]):
    if len(weight_shape) != 2:
        raise QlmError(f"the FP8 tensor {name} is {list(weight_shape)}, not a matrix",
                       "qlm dequantises 2-D block-scaled weights (per-expert tensors, as DeepSeek releases them)")
    wanted = tuple(-(-n // b) for n, b in zip(weight_shape, block, strict=True))
    if tuple(scale_shape) != wanted:
        raise QlmError(f"{scale_name(name)} is {list(scale_shape)} but a {list(weight_shape)} weight in "
                       f"{block[0]}x{block[1]} blocks needs {list(wanted)}",
                       "the FP8 scales do not match the weights or quantization_config.weight_block_size")


def dequantise(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], axis: int, start: int,
               dtype: torch.dtype) -> torch.Tensor:
    """`weight`: entries [start, start + weight.shape[axis]) along `axis` of an FP8 matrix (all of the other axis);
    `scale`: the matrix's whole scale grid. -> the entries times their blocks' scales, in `dtype`."""
    rows, cols = weight.shape
    row0, col0 = (start, 0) if axis == 0 else (0, start)
    row_block = torch.arange(row0, row0 + rows) // block[0]
    col_block = torch.arange(col0, col0 + cols) // block[1]
    scales = scale.float().index_select(0, row_block).index_select(1, col_block)
    return (weight.float() * scales).to(dtype)
