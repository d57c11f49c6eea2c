"""A frozen copy of the starting weights beside the policy: an objective's reference model (the DPO family's,
the KL term's of RL)."""

from __future__ import annotations


def frozen_chunks(engine, weights) -> list:
    """The engine's chunks of this rank, filled from `weights` in the compute dtype, never trained, never sharded
    by ZeRO, in evaluation mode."""
    chunks = engine.build_chunks(weights, param_dtype=engine.dtype)
    for chunk in chunks:
        chunk.requires_grad_(False)
        chunk.train(False)
    return chunks
