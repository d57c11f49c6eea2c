"""Pretraining samples: windows of seq_length + 1 tokens packed across document boundaries.

For one indexed dataset and a range of its documents (a train or valid split), the sample order is built in numpy:
  1. sequence order: each epoch is a fresh seeded permutation of the split's documents (a document of several
     sequences keeps them together, in order); as many epochs as the samples need (the last one is used in part);
  2. sample index: sample j covers stream tokens [j*S, j*S + S] of those epochs laid end to end, so consecutive
     samples share one token (the last label of one is the first input of the next), as in Megatron;
  3. sample order: a seeded permutation of the samples.
The three arrays are cached in PREFIX.<hash>.qlm-samples.npz (hash of every parameter and the file sizes) next to
the data or in `cache_dir`; a missing, unreadable or unwritable cache only costs rebuilding them.

Several datasets blend by weight: sample i of the blend comes from the dataset whose next sample is most overdue
(dataset d's k-th sample is due at (k+1)/w_d), so every prefix of the blend follows the weights to within one sample.

Items are numpy int64 arrays of length S: input_ids, labels (= next token), and with reset_position_ids position_ids
restarting after each EOD token and segment_ids numbering the documents in the sample (else both None).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qlm_core.data.indexed import IndexedDataset
from qlm_core.disk import replace_atomically
from qlm_core.errors import QlmError

CACHE_VERSION = 2


@dataclass
class PretrainConfig:
    seq_length: int
    seed: int = 1234
    split: str = "98,2"  # train,valid shares of each dataset's documents (a third, test, share is allowed)
    reset_position_ids: bool = False  # positions restart after each EOD; segment_ids then mark the documents
    eod_token_id: int | None = None  # needed by reset_position_ids
    cache: bool = True
    cache_dir: str | None = None  # None: next to the data


def parse_split(split: str) -> list[float]:
    """"98,2" -> [0.98, 0.02] (shares are normalised; 1-3 of them)."""
    try:
        shares = [float(part) for part in split.replace("/", ",").split(",") if part.strip()]
    except ValueError:
        shares = []
    if not 1 <= len(shares) <= 3 or any(s < 0 or not math.isfinite(s) for s in shares) or sum(shares) <= 0:
        raise QlmError(f"split {split!r} is not 1-3 non-negative numbers", 'write it like "98,2" or "949,50,1"')
    total = sum(shares)
    return [s / total for s in shares]


def split_documents(num_documents: int, split: str) -> list[range]:
    """Consecutive document ranges, one per share of `split` (rounded; the last ends at num_documents)."""
    bounds = np.round(np.cumsum([0.0] + parse_split(split)) * num_documents).astype(int)
    bounds[-1] = num_documents
    return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def build_sample_order(lengths: np.ndarray, seq_length: int, num_samples: int | None, seed: int,
                       document_indices: np.ndarray | None = None):
    """(sequence order, sample index [N+1, 2] of (position in sequence order, token offset), sample shuffle [N]).

    `lengths` are the split's sequence lengths; `document_indices` (0, ..., lengths.size) group them into documents
    (None: one sequence each)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    tokens_per_epoch = int(lengths.sum())
    if tokens_per_epoch == 0:
        raise QlmError("the dataset split has no tokens", "check the data and the split shares")
    if num_samples is None:
        num_samples = (tokens_per_epoch - 1) // seq_length
        if num_samples == 0:
            raise QlmError(f"the dataset split has {tokens_per_epoch} tokens, fewer than one sample of "
                           f"{seq_length + 1}", "use more data, a larger split share or a shorter seq_length")
    epochs = -(-(num_samples * seq_length + 1) // tokens_per_epoch)
    rng = np.random.default_rng(seed)
    index_dtype = np.int32 if lengths.size < 2**31 else np.int64
    num_documents = lengths.size if document_indices is None else len(document_indices) - 1
    epoch_orders = [rng.permutation(num_documents) for _ in range(epochs)]
    if document_indices is not None and num_documents != lengths.size:
        epoch_orders = [_document_sequences(order, np.asarray(document_indices)) for order in epoch_orders]
    sequence_order = np.concatenate(epoch_orders).astype(index_dtype)
    ordered = lengths[sequence_order]
    ends = np.cumsum(ordered)
    first_tokens = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    positions = np.searchsorted(ends, first_tokens, side="right")
    offsets = first_tokens - (ends[positions] - ordered[positions])
    sample_index = np.stack([positions, offsets], axis=1)
    shuffle = rng.permutation(num_samples)
    return sequence_order, sample_index, shuffle


def _document_sequences(document_order: np.ndarray, document_indices: np.ndarray) -> np.ndarray:
    """The sequences of the documents in `document_order`, each document's in its own order."""
    starts = document_indices[document_order]
    counts = document_indices[document_order + 1] - starts
    first_of_each = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + np.arange(int(counts.sum())) - first_of_each


def document_positions(input_ids: np.ndarray, eod_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(position_ids, segment_ids) for one sequence: a new document starts after each EOD token."""
    segment_ids = np.zeros(input_ids.shape, dtype=np.int64)
    np.cumsum(input_ids[:-1] == eod_token_id, out=segment_ids[1:])
    starts = np.flatnonzero(np.diff(segment_ids, prepend=-1))
    position_ids = np.arange(input_ids.size, dtype=np.int64) - starts[segment_ids]
    return position_ids, segment_ids


class PackedDataset:
    """Samples of seq_length + 1 tokens from the sequences of `documents` of one indexed dataset."""

    def __init__(self, indexed: IndexedDataset, documents: range, num_samples: int | None, config: PretrainConfig):
        if config.seq_length < 1:
            raise QlmError(f"seq_length must be positive, got {config.seq_length}", "set a positive seq_length")
        if config.reset_position_ids and config.eod_token_id is None:
            raise QlmError("reset_position_ids needs the EOD token id", "set eod_token_id (the tokenizer's eos id)")
        self.indexed, self.config = indexed, config
        self.seq_length = config.seq_length
        self.first_sequence = int(indexed.document_indices[documents.start])
        last_sequence = int(indexed.document_indices[documents.stop])
        lengths = indexed.sequence_lengths[self.first_sequence:last_sequence]
        document_indices = indexed.document_indices[documents.start:documents.stop + 1] - self.first_sequence
        key = dict(version=CACHE_VERSION, prefix=os.path.realpath(indexed.prefix),
                   sizes=[indexed.idx_path.stat().st_size, indexed.bin_path.stat().st_size],
                   sequences=[self.first_sequence, last_sequence], seq_length=self.seq_length,
                   num_samples=num_samples, seed=config.seed)
        arrays = self._load_cache(key) if config.cache else None
        if arrays is None:
            arrays = build_sample_order(lengths, self.seq_length, num_samples, config.seed, document_indices)
            if config.cache:
                self._save_cache(key, arrays)
        self.sequence_order, self.sample_index, self.shuffle = arrays

    def __len__(self) -> int:
        return self.shuffle.size

    def tokens(self, sample: int) -> np.ndarray:
        """The seq_length + 1 tokens of sample `sample` in stream order (before the shuffle)."""
        (p0, o0), (p1, o1) = self.sample_index[sample], self.sample_index[sample + 1]
        sequences = self.first_sequence + self.sequence_order[p0:p1 + 1].astype(np.int64)
        if p0 == p1:
            return self.indexed.get(int(sequences[0]), int(o0), int(o1 - o0 + 1))
        parts = [self.indexed.get(int(sequences[0]), int(o0))]
        parts += [self.indexed.get(int(s)) for s in sequences[1:-1]]
        parts.append(self.indexed.get(int(sequences[-1]), 0, int(o1 + 1)))
        return np.concatenate(parts)

    def __getitem__(self, i: int) -> dict:
        tokens = self.tokens(int(self.shuffle[i])).astype(np.int64)
        return make_item(tokens, self.config)

    # ---- cache -------------------------------------------------------------------------------------------------------

    def _cache_path(self, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        prefix = Path(self.indexed.prefix)
        folder = Path(self.config.cache_dir) if self.config.cache_dir else prefix.parent
        return folder / f"{prefix.name}.{digest}.qlm-samples.npz"

    def _load_cache(self, key: dict):
        path = self._cache_path(key)
        try:
            with np.load(path) as cached:
                arrays = cached["sequence_order"], cached["sample_index"], cached["shuffle"]
                digest = bytes(cached["digest"])
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):  # unreadable: rebuild it
            return None
        if digest != _digest(arrays):  # damaged or edited since it was written: rebuilt, never read
            return None
        order, index, shuffle = arrays
        expected = key["num_samples"]
        if index.ndim != 2 or index.shape[0] != shuffle.size + 1 or (expected is not None and shuffle.size != expected):
            return None
        return order, index, shuffle

    def _save_cache(self, key: dict, arrays) -> None:
        path = self._cache_path(key)
        order, index, shuffle = arrays
        digest = np.frombuffer(_digest(arrays), np.uint8)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            replace_atomically(path, lambda temporary: np.savez(  # concurrent ranks never read half a file
                temporary, sequence_order=order, sample_index=index, shuffle=shuffle, digest=digest), keep_suffix=True)
        except OSError:
            pass  # a cache only: the order is computed again next time


def _digest(arrays) -> bytes:
    """sha256 of a sample-order cache's arrays (their dtypes, shapes and bytes)."""
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.digest()


def make_item(tokens: np.ndarray, config: PretrainConfig) -> dict:
    input_ids, labels = tokens[:-1], tokens[1:]
    position_ids = segment_ids = None
    if config.reset_position_ids:
        position_ids, segment_ids = document_positions(input_ids, config.eod_token_id)
    return dict(input_ids=input_ids, labels=labels, position_ids=position_ids, segment_ids=segment_ids)


def blend_schedule(weights: list[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each blended sample, its sample number within that dataset)."""
    weights = np.asarray(weights, dtype=np.float64)
    with np.errstate(over="ignore"):
        overflows = not np.isfinite(weights.sum())
    if overflows:  # weights near the float limit: scaled down first (only then, so other blends keep their order)
        weights = weights / weights.max()
    weights = weights / weights.sum()
    due, dataset, local = [], [], []
    for d, weight in enumerate(weights):
        if weight == 0:
            continue
        count = int(math.ceil(num_samples * weight)) + 1
        due.append((np.arange(count) + 1) / weight)
        dataset.append(np.full(count, d, dtype=np.int64))
        local.append(np.arange(count, dtype=np.int64))
    due, dataset, local = np.concatenate(due), np.concatenate(dataset), np.concatenate(local)
    order = np.lexsort((dataset, due))[:num_samples]
    return dataset[order], local[order]


class BlendedDataset:
    """Samples of several PackedDatasets interleaved by weight (see blend_schedule)."""

    def __init__(self, datasets: list, weights: list[float], num_samples: int):
        self.datasets, self.weights = datasets, weights
        self.dataset_index, self.sample_index = blend_schedule(weights, num_samples)

    def __len__(self) -> int:
        return self.dataset_index.size

    def __getitem__(self, i: int) -> dict:
        return self.datasets[int(self.dataset_index[i])][int(self.sample_index[i])]


def parse_blend(data) -> list[tuple[str, float | None]]:
    """A prefix, a list of prefixes, or a list of (weight, prefix) / (prefix, weight) pairs."""
    if isinstance(data, (str, os.PathLike)):
        return [(str(data), None)]
    blend = []
    for entry in data:
        if isinstance(entry, (str, os.PathLike)):
            blend.append((str(entry), None))
            continue
        a, b = entry
        prefix, weight = (b, a) if isinstance(a, (int, float)) else (a, b)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < math.inf:
            raise QlmError(f"blend weight {weight!r} of {prefix} is not a finite non-negative number",
                           "give each dataset a weight >= 0")
        blend.append((str(prefix), float(weight)))
    if not blend:
        raise QlmError("no pretraining data was given", "list one or more indexed-dataset prefixes")
    if len({w is None for _, w in blend}) > 1:
        raise QlmError("some datasets of the blend have weights and some do not", "weight all of them or none")
    if blend[0][1] is not None and sum(w for _, w in blend) <= 0:
        raise QlmError("the blend weights add up to 0", "give at least one dataset a positive weight")
    return blend


def build_pretrain_datasets(data, config: PretrainConfig, train_samples: int | None,
                            valid_samples: int | None = None):
    """(train, valid) datasets over the blend `data`; valid is None when the split leaves it no documents.

    Without weights the datasets blend in proportion to their tokens. num_samples None means one pass over
    the split's tokens."""
    blend = parse_blend(data)
    indexed = [IndexedDataset(prefix) for prefix, _ in blend]
    ranges = [split_documents(ds.num_documents, config.split) for ds in indexed]
    splits = []
    for part, num_samples in ((0, train_samples), (1, valid_samples)):
        members = [(ds, r[part], w) for ds, r, (_, w) in zip(indexed, ranges, blend, strict=True)
                   if len(r) > part and len(r[part])]
        if not members:
            splits.append(None)
            continue
        if len(members) == 1:
            ds, documents, _ = members[0]
            splits.append(PackedDataset(ds, documents, num_samples, config))
            continue
        weights = [w if w is not None else _split_tokens(ds, documents) for ds, documents, w in members]
        if num_samples is None:
            num_samples = sum((_split_tokens(ds, documents) - 1) // config.seq_length for ds, documents, _ in members)
        dataset_index, _ = blend_schedule(weights, num_samples)
        counts = np.bincount(dataset_index, minlength=len(members))
        parts = [PackedDataset(ds, documents, max(int(n), 1), config)
                 for (ds, documents, _), n in zip(members, counts, strict=True)]
        splits.append(BlendedDataset(parts, weights, num_samples))
    if splits[0] is None:
        raise QlmError(f"split {config.split!r} leaves no training documents", "give the train share more weight")
    return splits[0], splits[1]


def _split_tokens(indexed: IndexedDataset, documents: range) -> int:
    first, last = indexed.document_indices[documents.start], indexed.document_indices[documents.stop]
    return int(indexed.sequence_lengths[first:last].sum(dtype=np.int64))
