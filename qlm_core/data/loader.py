"""Global batches for data parallelism, resumable from a sample count.

The samples form one stream: the dataset's own (deterministic) order, epoch after epoch (optionally a seeded
permutation per epoch). Global batch b is rows [consumed + b*B, consumed + (b+1)*B) of that stream, and data-parallel
rank d takes its contiguous share [d*B/dp, (d+1)*B/dp) of each. Resuming needs only consumed_samples: the
trainer adds B per step (a DataLoader's prefetching runs the sampler ahead, so the sampler does not count).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from qlm_core.errors import QlmError


class GlobalBatchSampler:
    """Yields this rank's dataset indices of each global batch; usable as a DataLoader's `batch_sampler`."""

    def __init__(self, dataset_length: int, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 consumed_samples: int = 0, seed: int = 1234, shuffle: bool = False, cycle: bool = True):
        if dataset_length < 1:
            raise QlmError("the dataset is empty", "check the data")
        if global_batch_size % dp_size:
            raise QlmError(f"global_batch_size {global_batch_size} is not divisible by the data-parallel "
                           f"size {dp_size}",
                           "make the global batch a multiple of dp")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        if not cycle and global_batch_size > dataset_length:
            raise QlmError(f"global_batch_size {global_batch_size} is larger than the dataset "
                           f"({dataset_length} samples)",
                           "use a smaller global batch or more data")
        self.dataset_length, self.global_batch_size = dataset_length, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples, self.seed, self.shuffle, self.cycle = consumed_samples, seed, shuffle, cycle
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def rows_per_rank(self) -> int:
        return self.global_batch_size // self.dp_size

    def sample_index(self, stream_position: int) -> int:
        """The dataset index at this position of the epoch-after-epoch stream."""
        epoch, position = divmod(stream_position, self.dataset_length)
        if not self.shuffle:
            return position
        if epoch not in self._permutations:
            self._permutations = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.dataset_length)}
        return int(self._permutations[epoch][position])

    def __iter__(self) -> Iterator[list[int]]:
        start = self.consumed_samples
        while self.cycle or start + self.global_batch_size <= self.dataset_length:
            first = start + self.dp_rank * self.rows_per_rank
            yield [self.sample_index(p) for p in range(first, first + self.rows_per_rank)]
            start += self.global_batch_size

    def __len__(self) -> int:
        """Global batches left in the first pass (cycle=False); a cycling sampler never ends."""
        if self.cycle:
            raise TypeError("a cycling GlobalBatchSampler has no length")
        return max(self.dataset_length - self.consumed_samples, 0) // self.global_batch_size


def collate(items: list[dict]):
    """Dataset items -> (input_ids, labels, position_ids | None, segment_ids | None), int64 tensors [rows, seq]."""
    def stack(key):
        values = [item[key] for item in items]
        if all(v is None for v in values):
            return None
        if any(v is None for v in values):
            raise ValueError(f"some items have {key} and some do not")
        return torch.as_tensor(np.stack([np.asarray(v) for v in values])).long()

    return stack("input_ids"), stack("labels"), stack("position_ids"), stack("segment_ids")
