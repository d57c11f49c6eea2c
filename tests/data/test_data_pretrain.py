"""Pretraining samples: exact windows of a seeded document stream, deterministic, blended by weight, split by
document."""

import numpy as np
import pytest

from qlm_core.data.indexed import IndexedDataset, IndexedWriter
from qlm_core.data.pretrain import (
    PackedDataset,
    PretrainConfig,
    blend_schedule,
    build_pretrain_datasets,
    document_positions,
    split_documents,
)
from qlm_core.errors import QlmError

EOD = 0


def write_documents(prefix, num_documents, base=0, seed=0, eod=False):
    """Document d holds (base + d + 1) repeated 3..40 times, so every token names its document."""
    rng = np.random.default_rng(seed)
    documents = []
    with IndexedWriter(prefix, np.uint16) as writer:
        for d in range(num_documents):
            doc = np.full(rng.integers(3, 40), base + d + 1)
            if eod:
                doc[-1] = EOD
            writer.add_document(doc)
            documents.append(doc)
    return documents


@pytest.fixture
def corpus(tmp_path):
    documents = write_documents(tmp_path / "data", 100)
    return tmp_path / "data", documents


def sample_tokens(item):
    return np.append(item["input_ids"], item["labels"][-1])


def test_samples_are_windows_of_the_shuffled_document_stream(corpus):
    prefix, documents = corpus
    config = PretrainConfig(seq_length=16, split="100", cache=False)
    dataset = PackedDataset(IndexedDataset(prefix), range(100), 500, config)  # several epochs
    assert len(dataset) == 500
    epochs = dataset.sequence_order.reshape(-1, 100)
    assert len(epochs) > 2 and all(sorted(epoch) == list(range(100)) for epoch in epochs)
    assert not all(np.array_equal(epochs[0], epoch) for epoch in epochs[1:])  # reshuffled every epoch
    stream = np.concatenate([documents[d] for d in dataset.sequence_order])
    assert sorted(dataset.shuffle.tolist()) == list(range(500)) and not np.array_equal(dataset.shuffle, np.arange(500))
    for i in range(len(dataset)):
        item, j = dataset[i], dataset.shuffle[i]
        assert item["input_ids"].dtype == np.int64 and item["input_ids"].shape == (16,)
        assert np.array_equal(item["labels"][:-1], item["input_ids"][1:])
        assert np.array_equal(sample_tokens(item), stream[j * 16:j * 16 + 17])
        assert item["position_ids"] is None and item["segment_ids"] is None


def test_documents_of_several_sequences_stay_together(tmp_path):
    with IndexedWriter(tmp_path / "multi", np.uint16) as writer:
        for d in range(30):  # document d: sequences [d, d] and [d + 100] * 3
            writer.add_document([d + 1] * 2 + [d + 101] * 3, [2, 3])
    dataset = PackedDataset(IndexedDataset(tmp_path / "multi"), range(30), 60,
                            PretrainConfig(seq_length=7, split="100", cache=False))
    order = dataset.sequence_order.reshape(-1, 60)
    assert np.all(order[:, 1::2] == order[:, 0::2] + 1) and np.all(order[:, 0::2] % 2 == 0)
    assert sorted(order[0, 0::2] // 2) == list(range(30)) and not np.array_equal(order[0], order[1])
    stream = np.concatenate([[s // 2 + 1] * 2 if s % 2 == 0 else [s // 2 + 101] * 3 for s in dataset.sequence_order])
    for i in range(len(dataset)):
        j = dataset.shuffle[i]
        assert np.array_equal(sample_tokens(dataset[i]), stream[j * 7:j * 7 + 8])


def test_one_epoch_when_no_sample_count_is_given(corpus):
    prefix, documents = corpus
    tokens = sum(d.size for d in documents)
    dataset = PackedDataset(IndexedDataset(prefix), range(100), None, PretrainConfig(seq_length=16, cache=False))
    assert len(dataset) == (tokens - 1) // 16
    assert dataset.sequence_order.size == 100


def test_order_is_deterministic_per_seed(corpus):
    prefix, _ = corpus
    def samples(seed):
        config = PretrainConfig(seq_length=8, seed=seed, cache=False)
        dataset = PackedDataset(IndexedDataset(prefix), range(100), 50, config)
        return np.stack([sample_tokens(dataset[i]) for i in range(len(dataset))])

    assert np.array_equal(samples(1), samples(1))
    assert not np.array_equal(samples(1), samples(2))


def test_the_cache_is_used_and_never_changes_the_result(corpus, tmp_path):
    prefix, _ = corpus
    indexed = IndexedDataset(prefix)
    fresh = PackedDataset(indexed, range(100), 300, PretrainConfig(seq_length=8, cache=False))
    assert not list(tmp_path.glob("*.qlm-samples.npz"))
    cached = PackedDataset(indexed, range(100), 300, PretrainConfig(seq_length=8))
    files = list(tmp_path.glob("data.*.qlm-samples.npz"))
    assert len(files) == 1
    again = PackedDataset(indexed, range(100), 300, PretrainConfig(seq_length=8))
    other = PackedDataset(indexed, range(100), 301, PretrainConfig(seq_length=8))  # another key, another file
    assert len(list(tmp_path.glob("data.*.qlm-samples.npz"))) == 2 and len(other) == 301
    for dataset in (cached, again):
        for name in ("sequence_order", "sample_index", "shuffle"):
            assert np.array_equal(getattr(dataset, name), getattr(fresh, name))
    valid = files[0].read_bytes()
    for broken in (b"garbage", valid[:len(valid) // 2], valid[:100]):
        files[0].write_bytes(broken)
        rebuilt = PackedDataset(indexed, range(100), 300, PretrainConfig(seq_length=8))
        assert np.array_equal(rebuilt.sample_index, fresh.sample_index)
        assert files[0].read_bytes() == valid  # and rewritten
    elsewhere = tmp_path / "cache"
    PackedDataset(indexed, range(100), 300, PretrainConfig(seq_length=8, cache_dir=str(elsewhere)))
    assert len(list(elsewhere.glob("*.qlm-samples.npz"))) == 1


def test_train_and_valid_splits_are_disjoint_document_ranges(corpus):
    prefix, _ = corpus
    assert split_documents(100, "98,2") == [range(0, 98), range(98, 100)]
    assert split_documents(10, "8,1,1") == [range(0, 8), range(8, 9), range(9, 10)]
    train, valid = build_pretrain_datasets(str(prefix), PretrainConfig(seq_length=8, split="90,10", cache=False),
                                           train_samples=400, valid_samples=30)
    assert len(train) == 400 and len(valid) == 30
    train_docs = {int(t) - 1 for i in range(len(train)) for t in sample_tokens(train[i])}
    valid_docs = {int(t) - 1 for i in range(len(valid)) for t in sample_tokens(valid[i])}
    assert train_docs <= set(range(90)) and valid_docs <= set(range(90, 100)) and len(train_docs) > 80
    only_train, none = build_pretrain_datasets(prefix, PretrainConfig(seq_length=8, split="100,0", cache=False), 10)
    assert none is None and len(only_train) == 10
    with pytest.raises(QlmError, match="not 1-3 non-negative numbers"):
        split_documents(100, "98,x")


def test_blends_follow_their_weights(tmp_path):
    prefixes = []
    for k in range(3):
        write_documents(tmp_path / f"d{k}", 50, base=1000 * k, seed=k)
        prefixes.append(str(tmp_path / f"d{k}"))
    weights = [0.5, 0.3, 0.2]
    config = PretrainConfig(seq_length=8, split="100", cache=False)
    blend, _ = build_pretrain_datasets(list(zip(weights, prefixes, strict=True)), config, train_samples=1000)
    source = np.array([int(sample_tokens(blend[i])[0]) // 1000 for i in range(len(blend))])
    for n in (10, 100, 1000):
        counts = np.bincount(source[:n], minlength=3)
        assert np.all(np.abs(counts - n * np.array(weights)) <= 1), (n, counts)
    # each member's samples are its own samples, in its own order
    member = blend.datasets[1]
    ones = [i for i in range(len(blend)) if source[i] == 1]
    assert all(np.array_equal(blend[i]["input_ids"], member[k]["input_ids"]) for k, i in enumerate(ones))
    # unweighted blends follow the datasets' token counts
    unweighted, _ = build_pretrain_datasets(prefixes, config, train_samples=None)
    tokens = [IndexedDataset(p).num_tokens for p in prefixes]
    counts = np.bincount(unweighted.dataset_index, minlength=3)
    assert np.allclose(counts / counts.sum(), np.array(tokens) / sum(tokens), atol=0.01)


def test_blend_schedule_prefixes():
    dataset, local = blend_schedule([3, 1], 8)
    assert dataset.tolist() == [0, 0, 0, 1, 0, 0, 0, 1]
    assert local.tolist() == [0, 1, 2, 0, 3, 4, 5, 1]


def test_reset_position_ids_restart_after_each_eod(tmp_path):
    write_documents(tmp_path / "eod", 30, eod=True)
    config = PretrainConfig(seq_length=32, reset_position_ids=True, eod_token_id=EOD, cache=False)
    dataset = PackedDataset(IndexedDataset(tmp_path / "eod"), range(30), 40, config)
    for i in range(len(dataset)):
        item = dataset[i]
        ids, positions, segments = item["input_ids"], item["position_ids"], item["segment_ids"]
        for t in range(1, 32):
            new_document = ids[t - 1] == EOD
            assert positions[t] == (0 if new_document else positions[t - 1] + 1)
            assert segments[t] == segments[t - 1] + int(new_document)
        assert positions[0] == 0 and segments[0] == 0
    positions, segments = document_positions(np.array([5, 5, 0, 7, 0, 0, 9]), eod_token_id=0)
    assert positions.tolist() == [0, 1, 2, 0, 1, 0, 0] and segments.tolist() == [0, 0, 0, 1, 1, 2, 3]
    with pytest.raises(QlmError, match="needs the EOD token id"):
        PackedDataset(IndexedDataset(tmp_path / "eod"), range(30), 4, PretrainConfig(8, reset_position_ids=True))


def test_index_of_a_million_documents(tmp_path):
    """A million documents and 300k samples: every sample starts exactly seq_length tokens after the previous one."""
    from qlm_core.data.pretrain import build_sample_order

    lengths = np.random.default_rng(0).integers(1, 500, 1_000_000)
    order, index, shuffle = build_sample_order(lengths, 2048, 300_000, seed=0)
    assert index.shape == (300_001, 2) and shuffle.size == 300_000
    ends = np.cumsum(lengths[order])
    starts = ends - lengths[order]
    assert np.array_equal(starts[index[:, 0]] + index[:, 1], np.arange(300_001) * 2048)
