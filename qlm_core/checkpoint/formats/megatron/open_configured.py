"""Open a Megatron checkpoint whose architecture may come from elsewhere than Megatron-LM's stored `args`
(megatron_configured.py says where from, in which order, and how it is checked)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qlm_core.checkpoint.formats.megatron.configured import EMBEDDING, FIX_CONFIG, ConfiguredMixin, load_config_spec
from qlm_core.checkpoint.formats.megatron.format import TORCH_DIST, megatron_format
from qlm_core.checkpoint.formats.megatron.legacy import MegatronTorchCheckpoint, check_no_leftovers
from qlm_core.errors import QlmError
from qlm_core.models.spec import ModelSpec

if TYPE_CHECKING:
    from qlm_core.checkpoint.formats.megatron.torch_dist import TorchDistCheckpoint


class ConfiguredTorch(ConfiguredMixin, MegatronTorchCheckpoint):
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
        from qlm_core.checkpoint.formats.megatron.open_configured_dist import (
            ConfiguredTorchDist,  # imports DCP: only now
        )

        return ConfiguredTorchDist(path, iteration, spec, str(config or ""), view)
    return ConfiguredTorch(path, iteration, spec, str(config or ""), view)
