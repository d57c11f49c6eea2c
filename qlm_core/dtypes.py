"""The dtype names qlm takes (recipes, --dtype) and the names HF's config.json uses for them."""

from __future__ import annotations

import torch

from qlm_core.config import WeightDtype, choices
from qlm_core.errors import QlmError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(DTYPES) == choices(WeightDtype), "DTYPES maps exactly config.WeightDtype's names"
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def dtype_named(name: str, what: str = "dtype", allowed: tuple[str, ...] = tuple(DTYPES)) -> torch.dtype:
    """DTYPES[name], or a one-line error naming the allowed ones."""
    if name not in allowed:
        raise QlmError(f"{what} {name!r} is not one of {', '.join(allowed)}", f"set {what} to one of them")
    return DTYPES[name]


def set_hf_config_dtype(config: dict, dtype: torch.dtype) -> dict:
    """config.json's dtype entry (transformers 4.x writes `torch_dtype`, 5.x `dtype`: keep the one it has)."""
    config["torch_dtype" if "torch_dtype" in config or "dtype" not in config else "dtype"] = HF_DTYPE_NAMES[dtype]
    return config
