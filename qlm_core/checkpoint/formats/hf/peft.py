"""Export adapters as a PEFT LoRA adapter (adapter_model.safetensors + adapter_config.json) that
`peft.PeftModel.from_pretrained(hf_model, out_dir)` loads onto the HF model.

Fused tensors are un-fused through the layout's segments: linear_qkv's A becomes the same A for q/k/v_proj and its
B is cut into their rows after un-grouping the query groups; linear_fc1's likewise into gate/up_proj.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from qlm_core.checkpoint.formats.megatron.lora_args import LoraSettings, all_lora_tensors
from qlm_core.models.layout import ModelLayout, TensorSource, assemble_pieces, hf_pieces

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PeftModel wraps the *ForCausalLM model, which is `base_model.model`


def peft_tensors(layout: ModelLayout, adapter_source: TensorSource, lora_config: LoraSettings,
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """PEFT state_dict name -> tensor (contiguous, each its own storage)."""
    pieces = hf_pieces(all_lora_tensors(layout, lora_config))
    return {PEFT_PREFIX + name: assemble_pieces(parts, adapter_source, dtype) for name, parts in pieces.items()}


def hf_target_modules(layout: ModelLayout, lora_config: LoraSettings) -> list[str]:
    """HF module names (q_proj, ..., down_proj) the adapters attach to."""
    names = hf_pieces(all_lora_tensors(layout, lora_config))
    return list(dict.fromkeys(name.split(".")[-3] for name in names))


def export_peft(layout: ModelLayout, adapter_source: TensorSource, lora_config: LoraSettings, out_dir: str | Path,
                base_model_name_or_path: str | None = None, dtype: torch.dtype | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(peft_tensors(layout, adapter_source, lora_config, dtype), out / ADAPTER_WEIGHTS,
              metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None if base_model_name_or_path is None else str(base_model_name_or_path),
        "r": lora_config.rank,
        "lora_alpha": lora_config.alpha,
        "lora_dropout": lora_config.dropout,
        "target_modules": hf_target_modules(layout, lora_config),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out
