"""Multi-token prediction (DeepSeek-V3; Megatron-Core's MultiTokenPredictionBlock): after the decoder, layer k of
`mtp_num_layers` predicts the token k + 1 places further than the next one. Its input joins two things at each
position i: the previous depth's output there (depth 1: the decoder's final norm's output) and the embedding of token
i + k; a linear `eh_proj` folds them back to the hidden size, a transformer layer like the decoder's last runs on
that, and its own final norm hands the result to the shared output layer.

The tokens each depth embeds and the labels it predicts are the sequence shifted left by k within each document,
made before the context-parallel split (train/engine.py: mtp_shifted), so no rank needs its neighbour's tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from qlm_core.parallel import shape_inference
from qlm_core.parallel.tensor import ColumnParallelLinear, scatter_to_sp


class MultiTokenPredictionLayer(nn.Module):
    """One depth. `norm()` builds a replicated norm over the hidden size; `layer` is its transformer layer."""

    def __init__(self, hidden_size: int, norm: Callable[[], nn.Module], layer: nn.Module, parallel, dtype):
        super().__init__()
        self.enorm = norm()
        self.hnorm = norm()
        # gathered whole on every TP rank, then (sequence parallelism) cut back to this rank's tokens
        self.eh_proj = ColumnParallelLinear(2 * hidden_size, hidden_size, tp_group=parallel.tp_group,
                                            sequence_parallel=parallel.sp, gather_output=True, dtype=dtype)
        self.transformer_layer = layer
        self.final_layernorm = norm()
        self.parallel = parallel

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, positions, inputs) -> torch.Tensor:
        """hidden, embedded: [s, b, h] (this rank's tokens) -> this depth's output [s, b, h]."""
        joined = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))
        if self.parallel.sp:
            joined = scatter_to_sp(joined, self.parallel.tp_group)
        return self.final_layernorm(self.transformer_layer(joined, positions, inputs))


class MultiTokenPredictionBlock(nn.Module):
    def __init__(self, layers: list[MultiTokenPredictionLayer], parallel):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.parallel = parallel

    def forward(self, hidden: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor,
                positions, inputs) -> list[torch.Tensor]:
        """hidden: the decoder's final norm's output [s, b, h]; `embed` the model's embedding; tokens [b, s,
        depths]: depth k's shifted input ids. Returns each depth's output [s, b, h]."""
        if shape_inference.active():  # pipelining's shape pass: placeholder ids, perhaps past the vocabulary
            tokens = torch.zeros_like(tokens)
        outputs = []
        for depth, layer in enumerate(self.layers):
            embedded = embed(tokens[:, :, depth].clone())  # the embedding keeps its ids: this depth's only
            if self.parallel.recompute == "full" and torch.is_grad_enabled():
                hidden = checkpoint(layer, hidden, embedded, positions, inputs, use_reentrant=False)
            else:
                hidden = layer(hidden, embedded, positions, inputs)
            outputs.append(hidden)
        return outputs
