"""open_megatron_with's reader for torch_dist checkpoints: its own module because it imports
torch.distributed.checkpoint, which a process reading only legacy checkpoints need not pay for."""

from __future__ import annotations

import torch

from qlm_core.checkpoint.formats.megatron.configured import EMBEDDING, FIX_CONFIG, ConfiguredMixin
from qlm_core.checkpoint.formats.megatron.torch_dist import TorchDistCheckpoint
from qlm_core.errors import QlmError


class ConfiguredTorchDist(ConfiguredMixin, TorchDistCheckpoint):
    def __init__(self, root, iteration=None, config_spec=None, config_name="", view="model"):
        self._config_spec, self._config_name = config_spec, config_name
        super().__init__(root, iteration, None, view)

    def _embedding_rows(self) -> int | None:
        meta = self.tensors.get(EMBEDDING)
        return None if meta is None else meta.size[0]

    def _load_common(self) -> dict:
        common = super()._load_common()
        if common.get("args") is None:
            meta = self.tensors.get(EMBEDDING)
            dtype = meta.properties.dtype if meta is not None else torch.float32
            common = {**common, "args": self._fallback_args(dtype, self._embedding_rows())}
        return common

    def _described_as(self) -> str | None:
        return self._described_by()

    def _check_tensors(self):
        what = self._described_by()
        if what is not None:
            for tensor in self.layout.global_tensors:
                key, expected = self._key(tensor)[0], self.expected_size(tensor)
                meta = self.tensors.get(key)
                if meta is None:
                    raise QlmError(f"{self.dir} lacks {key}, which {what} implies",
                                   FIX_CONFIG)
                if tuple(meta.size) != tuple(expected):
                    raise QlmError(f"{self.dir}: {key} is {list(meta.size)} but {what} implies {list(expected)}",
                                   FIX_CONFIG)
        super()._check_tensors()
