"""Open a Megatron checkpoint whose architecture may come from elsewhere than Megatron-LM's stored `args`.

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

from qlm_core.checkpoint.formats.bridge_config import bridge_args, find_run_config
from qlm_core.checkpoint.formats.megatron import TORCH_DIST, megatron_format
from qlm_core.checkpoint.formats.megatron_args import make_args
from qlm_core.checkpoint.formats.megatron_legacy import HF_SIDE_DIR, MegatronTorchCheckpoint, check_no_leftovers
from qlm_core.errors import QlmError
from qlm_core.models.layout import ModelLayout
from qlm_core.models.spec import ModelSpec, load_model_spec

if TYPE_CHECKING:
    from qlm_core.checkpoint.formats.torch_dist import TorchDistCheckpoint

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


class _ConfiguredMixin:
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


class ConfiguredTorch(_ConfiguredMixin, MegatronTorchCheckpoint):
    def __init__(self, root, iteration=None, config_spec=None, config_name="", view="model"):
        self._config_spec, self._config_name = config_spec, config_name
        super().__init__(root, iteration, None, view)
        if not hasattr(MegatronTorchCheckpoint, "_check_shapes"):
            self._check_shapes()

    def _check_shapes(self):
        if self._described_by() is not None:
            self._check_shard_shapes()
        elif hasattr(MegatronTorchCheckpoint, "_check_shapes"):
            super()._check_shapes()

    def _load(self, file: Path) -> dict:
        state = super()._load(file)
        if "args" not in state:
            model = state.get("model", state.get("model0"))
            first = next((v for v in model.values() if isinstance(v, torch.Tensor)), None) \
                if isinstance(model, dict) else None
            embed = model.get(EMBEDDING) if isinstance(model, dict) else None
            rows = embed.shape[0] * len({t for t, _ in self.files}) if isinstance(embed, torch.Tensor) else None
            state["args"] = self._fallback_args(first.dtype if first is not None else torch.float32, rows)
        return state

    def _spec(self) -> ModelSpec:
        spec = super()._spec()
        if self._config_spec is not None and sum(self._layer_counts()) != spec.num_layers:
            raise QlmError(f"--config {self._config_name} has {spec.num_layers} layers but the rank files hold "
                           f"{sum(self._layer_counts())}", FIX_CONFIG)
        return spec

    def _embedding_rows(self) -> int | None:
        embed = self._state(0, 0).get("model", self._state(0, 0).get("model0", {})).get(EMBEDDING)
        return None if embed is None else embed.shape[0] * len({t for t, _ in self.files})

    def _check_shard_shapes(self):
        what = self._described_by()
        for (_, pp_rank, ep_rank), file in sorted(self.rank_files.items()):
            for chunk in range(self.vpp):
                state = self._file_chunk(file, chunk)
                entries = self.layout.stored_tensors(pp_rank, chunk, self.lora, ep_rank)
                check_no_leftovers(file, state, {local for local, _ in entries}, what)
                for local, tensor in entries:
                    if local not in state:
                        if self.holds_base or ".lora_" in local:
                            raise QlmError(f"{file} lacks {local}, which {what} implies",
                                           FIX_CONFIG)
                        continue
                    expected = tensor.shard_shape(self.layout.split_size(tensor))
                    if tuple(state[local].shape) != expected:
                        raise QlmError(f"{file}: {local} is {list(state[local].shape)} but {what} implies "
                                       f"{list(expected)}", FIX_CONFIG)


def open_megatron_with(path: str | Path, iteration: int | None = None, config: str | Path | None = None,
                       view: str = "model") -> MegatronTorchCheckpoint | TorchDistCheckpoint:
    """open_megatron, with the architecture from `config` (checked against the checkpoint) or, for a checkpoint
    without args, from its run_config.yaml; the result's `args_from` says where the args came from."""
    spec = load_config_spec(config) if config is not None else None
    if megatron_format(path, iteration) == TORCH_DIST:
        from qlm_core.checkpoint.formats.megatron_open_dist import ConfiguredTorchDist  # imports DCP: only now

        return ConfiguredTorchDist(path, iteration, spec, str(config or ""), view)
    return ConfiguredTorch(path, iteration, spec, str(config or ""), view)
