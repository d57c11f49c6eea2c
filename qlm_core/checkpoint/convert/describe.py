"""Detect a checkpoint's format and describe it: layout, args and a tensor table."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
from qlm_core.checkpoint.formats.megatron.format import TORCH_DIST, megatron_format
from qlm_core.checkpoint.formats.megatron.legacy import (
    LATEST_FILE,
)
from qlm_core.checkpoint.formats.megatron.open_configured import open_megatron_with
from qlm_core.checkpoint.sources.megatron_format import run_checkpoint_dir
from qlm_core.checkpoint.sources.registry import format_of
from qlm_core.errors import QlmError
from qlm_core.models.parameters import num_parameters

HF, MCORE_TORCH, MCORE_TORCH_DIST, DEEPSPEED = "hf", "mcore-torch", "mcore-torch_dist", "deepspeed"

_ARG_KEYS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "max_position_embeddings", "rotary_base", "use_rope_scaling", "add_qkv_bias",
    "untie_embeddings_and_output_weights", "norm_epsilon", "vocab_size", "padded_vocab_size",
    "make_vocab_size_divisible_by", "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
    "params_dtype", "ckpt_format", "iteration", "qk_layernorm", "num_experts", "moe_router_topk",
    "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_pre_softmax",
    "moe_router_score_function", "moe_router_enable_expert_bias", "moe_layer_freq",
)


@dataclass
class TensorRow:
    name: str
    shape: tuple[int, ...]
    dtype: str
    where: str


@dataclass
class Inspection:
    format: str
    path: Path
    layout: dict[str, Any] = field(default_factory=dict)
    args: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorRow] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "format": self.format, "path": str(self.path), "layout": self.layout,
            "args": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in self.args.items()},
            "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "where": t.where}
                        for t in self.tensors],
        }


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def detect_format(path: Path, iteration: int | None = None) -> str:
    """The registry's format of `path` (checkpoint/sources/registry.py), a Megatron one told apart by its layout."""
    if not path.is_dir():
        raise QlmError(f"{path} is not a directory", "point at a checkpoint directory")
    found = format_of(path)
    if found is None:
        raise QlmError(
            f"cannot tell the checkpoint format of {path}",
            "expected config.json + weights (HF), latest_checkpointed_iteration.txt (Megatron) or latest + "
            "global_step*/ (DeepSpeed)",
        )
    if found.name != "megatron":
        return {"hf": HF, "deepspeed": DEEPSPEED}[found.name]
    root = run_checkpoint_dir(path) or path
    if not (root / LATEST_FILE).exists() and iteration is None and any(
            re.fullmatch(r"iter_\d{7}|release", p.name) for p in root.iterdir()):
        raise QlmError(f"{path} has iteration folders but no {LATEST_FILE}", "pass --iteration")
    return MCORE_TORCH_DIST if megatron_format(root, iteration) == TORCH_DIST else MCORE_TORCH


def inspect_checkpoint(path: str | Path, iteration: int | None = None,
                       config: str | Path | None = None) -> Inspection:
    """`config` (HF directory or preset): the architecture of a Megatron checkpoint that stores no args (else
    its run_config.yaml is read; see formats/megatron/open_configured.py). A qlm run directory: its checkpoints."""
    path = Path(path)
    fmt = detect_format(path, iteration)
    if fmt in (MCORE_TORCH, MCORE_TORCH_DIST):
        inspect = {MCORE_TORCH: _inspect_mcore, MCORE_TORCH_DIST: _inspect_torch_dist}[fmt]
        return inspect(run_checkpoint_dir(path) or path, iteration, config)
    if config is not None:
        raise QlmError(f"--config applies to Megatron checkpoints and {path} is {fmt}", "drop --config")
    return {HF: _inspect_hf, DEEPSPEED: _inspect_deepspeed}[fmt](path, iteration)


def _inspect_hf(path: Path, iteration) -> Inspection:
    ckpt = HFCheckpoint(path)
    spec = ckpt.spec
    report = Inspection(HF, path, layout={"files": len({ckpt.file_of(n) for n in ckpt.names})})
    report.args = {k: v for k, v in vars(spec).items() if not k.startswith("_")}
    if spec.moe is not None:
        report.args["moe"] = dataclasses.asdict(spec.moe)
    report.args["num_parameters"] = num_parameters(spec)
    report.tensors = [
        TensorRow(n, ckpt.shape(n), _dtype_name(ckpt.dtype(n)), ckpt.file_of(n).name) for n in ckpt.names
    ]
    return report


def _args_row(ckpt) -> dict[str, Any]:
    args = {k: getattr(ckpt.args, k) for k in _ARG_KEYS if hasattr(ckpt.args, k)}
    if ckpt.args_from != "checkpoint":
        args["args_from"] = ckpt.args_from
    return args


def _inspect_mcore(path: Path, iteration, config=None) -> Inspection:
    ckpt = open_megatron_with(path, iteration, config)
    layout = ckpt.layout
    report = Inspection(MCORE_TORCH, path, layout={
        "iteration": "release" if ckpt.iteration is None else ckpt.iteration, "tp": ckpt.tp, "pp": ckpt.pp,
        "vpp": ckpt.vpp, "stage_layers": list(layout.stage_layer_counts), "padded_vocab": layout.padded_vocab,
        "dtype": _dtype_name(ckpt.dtype),
    })
    report.args = _args_row(ckpt)
    for (tp_rank, pp_rank, ep_rank), file in sorted(ckpt.rank_files.items(), key=lambda kv: (kv[0][1], kv[0][2],
                                                                                          kv[0][0])):
        for chunk in range(ckpt.vpp):
            where = file.parent.name + (f"/model{chunk}" if ckpt.vpp > 1 else "")
            for name, tensor in ckpt.chunk_state(tp_rank, pp_rank, chunk, ep_rank).items():
                report.tensors.append(TensorRow(name, tuple(tensor.shape), _dtype_name(tensor.dtype), where))
    return report


def _inspect_torch_dist(path: Path, iteration, config=None) -> Inspection:
    ckpt = open_megatron_with(path, iteration, config)
    report = Inspection(MCORE_TORCH_DIST, path, layout={
        "iteration": "release" if ckpt.iteration is None else ckpt.iteration, "saved_tp": ckpt.tp,
        "saved_pp": ckpt.pp, "padded_vocab": ckpt.layout.padded_vocab, "dtype": _dtype_name(ckpt.dtype),
        "common_state": "common.pt" if (ckpt.dir / "common.pt").exists() else "dcp",
        "files": len({info.relative_path for info in (ckpt.metadata.storage_data or {}).values()}),
    })
    report.args = _args_row(ckpt)
    for name, meta in sorted(ckpt.tensors.items()):
        report.tensors.append(TensorRow(name, tuple(meta.size), _dtype_name(meta.properties.dtype),
                                        f"dcp ({len(meta.chunks)} chunks)"))
    return report


def _inspect_deepspeed(path: Path, iteration) -> Inspection:
    """The weights ds2hf would write: where each comes from (fp32 partitions, frozen fragments, module, a tie)."""
    from qlm_core.checkpoint.formats.deepspeed.checkpoint import DeepSpeedCheckpoint

    ckpt = DeepSpeedCheckpoint(path, None if iteration is None else f"global_step{iteration}")
    report = Inspection(DEEPSPEED, path, layout={
        "tag": ckpt.tag, "zero_stage": ckpt.zero_stage, "dp_world_size": ckpt.dp_world_size,
        "optimizer_files": len(ckpt.optimizer_files), "module_dtype": _dtype_name(ckpt.module_dtype),
        "global_steps": ckpt.global_steps, "ds_version": ckpt.ds_version,
    })
    report.tensors = [TensorRow(name, ckpt.shape(name), _dtype_name(ckpt.dtype(name)), ckpt.where(name))
                      for name in ckpt.names]
    return report
