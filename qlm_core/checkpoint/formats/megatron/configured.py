"""The architecture of a Megatron checkpoint that may come from elsewhere than Megatron-LM's stored `args`: what the
legacy reader (megatron_open.py) and the torch_dist reader (megatron_open_dist.py) share.

megatron-core's own `dist_checkpointing.save` and Megatron-Bridge write no `args`. Their architecture comes, in
this order, from `config` (`--config`: an HF model directory / config.json or a preset name), else a
Megatron-Bridge run_config.yaml next to or above the iteration directory (bridge_config.py). When the checkpoint
does carry args, `config` is checked against them and against every stored shard shape; its vocab_size (not the
padded embedding rows) is what an HF export writes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qlm_core.checkpoint.formats.megatron.args import make_args
from qlm_core.checkpoint.formats.megatron.bridge_config import bridge_args, find_run_config
from qlm_core.checkpoint.formats.megatron.legacy import HF_SIDE_DIR
from qlm_core.errors import QlmError
from qlm_core.models.layout import ModelLayout
from qlm_core.models.presets import load_model_spec
from qlm_core.models.spec import ModelSpec

if TYPE_CHECKING:
    pass

EMBEDDING = "embedding.word_embeddings.weight"
_STRUCTURE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "qkv_bias", "tie_word_embeddings", "qk_layernorm", "moe")
FIX_CONFIG = "pass --config with the HF config (or preset) of the model this checkpoint holds"
NO_ARGS_FIX = ("pass --config with the model's HF directory (config.json) or a preset name, or put the run's "
               "Megatron-Bridge run_config.yaml beside it")


def config_dir(config: str | Path | None) -> Path | None:
    """The HF directory `config` names (its config.json and tokenizer files describe the export), else None."""
    if config is None:
        return None
    path = Path(config)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.name.endswith(".json"):
        return path.parent if (path.parent / "config.json").resolve() == path.resolve() else None
    return None


def load_config_spec(config: str | Path) -> ModelSpec:
    """`--config`: a preset name, an HF model directory or its config.json."""
    path = Path(config)
    if path.exists() and not path.is_dir() and not path.name.endswith(".json"):
        raise QlmError(f"--config {config} is a file but not a config.json",
                       "pass an HF model directory, its config.json or a preset name")
    return load_model_spec(config)  # from_hf_config names a missing or ill-typed size itself


class ConfiguredMixin:
    """Supplies args when the checkpoint has none, and the --config spec (checked) instead of the args' one."""

    _config_spec: ModelSpec | None = None
    _config_name: str = ""
    args_from = "checkpoint"  # where the args came from: "checkpoint", a run_config.yaml path, or "--config"

    def _fallback_args(self, dtype: torch.dtype, embedding_rows: int | None) -> argparse.Namespace:
        cached = self.__dict__.get("_fallback")
        if cached is not None:
            return cached
        run_config = find_run_config(self.root, self.dir) if self._config_spec is None else None
        if self._config_spec is not None:  # --config first: it is how a user overrides a wrong run_config.yaml
            args = make_args(ModelLayout(self._config_spec, padded_vocab=embedding_rows)
                             if embedding_rows and embedding_rows >= self._config_spec.vocab_size
                             else ModelLayout(self._config_spec), dtype)
            self.args_from = "--config"
        elif run_config is not None:
            args = bridge_args(run_config)
            self.args_from = str(run_config)
        else:
            raise QlmError(f"{self.dir} stores no Megatron args (a megatron-core dist_checkpointing or "
                           "Megatron-Bridge save), so its architecture is unknown", NO_ARGS_FIX)
        if getattr(args, "vocab_size", None) is None and getattr(args, "padded_vocab_size", None) is None:
            args.padded_vocab_size = embedding_rows
        args.bf16, args.fp16, args.params_dtype = dtype == torch.bfloat16, dtype == torch.float16, dtype
        self._fallback = args
        return args

    def _embedding_rows(self) -> int | None:
        raise NotImplementedError

    def _spec(self) -> ModelSpec:
        if self._config_spec is None:
            return super()._spec()
        spec, what = self._config_spec, f"--config {self._config_name}"
        if self.args_from != "--config":
            stored = super()._spec()  # an architecture qlm cannot convert stays refused, --config or not
            exact_vocab = (self.root / HF_SIDE_DIR / "config.json").is_file() or getattr(
                self.args, "vocab_size", None) is not None
            if exact_vocab and spec.vocab_size < stored.vocab_size:
                raise QlmError(f"{what} has vocab_size {spec.vocab_size} but the checkpoint's model has "
                               f"{stored.vocab_size} tokens (an export would drop rows)", FIX_CONFIG)
            if stored is not None:
                for key in _STRUCTURE:
                    if getattr(stored, key) != getattr(spec, key):
                        where = "the checkpoint's args (or hf/config.json)" if self.args_from == "checkpoint" \
                            else self.args_from
                        raise QlmError(f"{what} has {key} = {getattr(spec, key)} but {where} say "
                                       f"{getattr(stored, key)}", FIX_CONFIG)
        rows = self._embedding_rows()
        if rows is not None and rows < spec.vocab_size:
            raise QlmError(f"{what} has vocab_size {spec.vocab_size} but the checkpoint's embedding has only {rows} "
                           "rows", FIX_CONFIG)
        return spec

    def _described_by(self) -> str | None:
        """What the architecture came from, when not the checkpoint's own args: shape errors name it."""
        if self._config_spec is not None:
            return f"--config {self._config_name}"
        return None if self.args_from == "checkpoint" else self.args_from
