"""Where the trainer's global batches come from: a BatchSource hands this data-parallel rank its rows of each global
batch, resumable from a sample count. Today's source reads the run's datasets (DatasetBatches: packed SFT or pretrain
samples, preference pairs with their precomputed reference log-probs, or a reward model's pairs); an objective that
makes its own batches brings another source (RL: train/rollout_batches.py, the policy's rollouts)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np
from torch.utils.data import DataLoader

from qlm_core.config import PAIR_KINDS, Recipe
from qlm_core.data.loader import GlobalBatchSampler, collate
from qlm_core.data.preference import PositionedPairs, collate_pairs
from qlm_core.parallel.state import Grid
from qlm_core.train.data import RunData
from qlm_core.train.engine import Batch
from qlm_core.train.objectives.reward import reward_labels


class BatchSource(Protocol):
    metrics: dict[str, float]  # figures of the last batch handed out (an RL step's rollout metrics), logged with it

    def batches(self, split: str, consumed: int) -> Iterator[Batch]:
        """This rank's rows of the global batches of `split` ("train" / "valid"), from sample `consumed` on."""
        ...

    def consumed_after_step(self, consumed: int) -> int:
        """The run's consumed samples after a step's batch that started at `consumed`."""
        ...


class DatasetBatches:
    def __init__(self, recipe: Recipe, grid: Grid, data: RunData, reference_tables: dict[str, np.ndarray]):
        self.recipe, self.grid, self.data, self.reference_tables = recipe, grid, data, reference_tables
        self.metrics: dict[str, float] = {}  # a dataset's rows bring no figures of their own

    def consumed_after_step(self, consumed: int) -> int:
        return consumed + self.recipe.train.global_batch_size

    def batches(self, split: str, consumed: int) -> Iterator[Batch]:
        r = self.recipe
        dataset = self.data.train if split == "train" else self.data.valid
        preference = r.data.kind in PAIR_KINDS  # pairs in a seeded order per epoch (SFT data is shuffled when built)
        sampler = GlobalBatchSampler(len(dataset), r.train.global_batch_size, self.grid.dp_rank,
                                     self.grid.sizes.dp, consumed_samples=consumed, seed=r.train.seed,
                                     shuffle=preference and split == "train")
        if preference:
            table = self.reference_tables.get(split)
            loader = DataLoader(PositionedPairs(dataset), batch_sampler=sampler,
                                collate_fn=lambda items: collate_pairs(items, r.train.micro_batch_size, table))
            for input_ids, labels, reference in loader:
                if r.data.kind == "reward":  # scored at each sequence's last token
                    labels = reward_labels(labels)
                yield Batch(input_ids, labels, reference_logps=reference)
            return
        for input_ids, labels, position_ids, segment_ids in DataLoader(dataset, batch_sampler=sampler,
                                                                      collate_fn=collate):
            yield Batch(input_ids, labels, position_ids, segment_ids)
