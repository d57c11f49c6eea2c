"""Megatron indexed datasets: qlm's writer and reader against megatron-core's IndexedDataset(Builder), both ways."""

import numpy as np
import pytest
import torch

from qlm_core.data.indexed import IndexedDataset, IndexedWriter, token_dtype
from qlm_core.errors import QlmError


def random_documents(seed: int, count: int = 40, vocab: int = 500) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(0, 30)) for _ in range(count)]


def write_qlm(prefix, documents, dtype):
    with IndexedWriter(prefix, dtype) as writer:
        for i, doc in enumerate(documents):
            if i % 2:
                writer.add_document(doc)
            else:
                writer.add_documents(doc, [doc.size])  # the batch API with a batch of one
    return writer


def test_token_dtype_follows_megatron():
    assert token_dtype(50000) == np.uint16 and token_dtype(65499) == np.uint16
    assert token_dtype(65500) == np.int32 and token_dtype(151_936) == np.int32 and token_dtype(None) == np.int32


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_qlm_round_trip(tmp_path, dtype):
    documents = random_documents(0)
    writer = write_qlm(tmp_path / "data", documents, dtype)
    dataset = IndexedDataset(tmp_path / "data")
    assert writer.num_documents == len(documents) == len(dataset) == dataset.num_documents
    assert dataset.dtype == dtype
    assert dataset.num_tokens == writer.num_tokens == sum(d.size for d in documents)
    for i, doc in enumerate(documents):
        assert np.array_equal(dataset[i], doc)
    long = next(i for i, d in enumerate(documents) if d.size > 10)
    assert np.array_equal(dataset.get(long, 3, 5), documents[long][3:8])
    assert np.array_equal(dataset.get(long, 4), documents[long][4:])
    assert np.array_equal(dataset.document_indices, np.arange(len(documents) + 1))
    with pytest.raises(IndexError):
        dataset.get(long, 0, documents[long].size + 1)


@pytest.mark.peer
@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_core_reads_qlm_files(tmp_path, dtype):
    megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    documents = random_documents(1)
    write_qlm(tmp_path / "data", documents, dtype)
    theirs = megatron.IndexedDataset(str(tmp_path / "data"))
    assert len(theirs) == len(documents) and theirs.index.dtype == dtype
    assert np.array_equal(theirs.document_indices, np.arange(len(documents) + 1))
    for i, doc in enumerate(documents):
        assert np.array_equal(theirs[i], doc)
        if doc.size > 4:
            assert np.array_equal(theirs.get(i, 2, 2), doc[2:4])
    assert all(np.array_equal(a, b) for a, b in zip(theirs[3:9], documents[3:9], strict=True))


@pytest.mark.peer
def test_documents_of_several_sequences_both_ways(tmp_path):
    megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    documents = random_documents(4)
    with IndexedWriter(tmp_path / "data", np.int32) as writer:
        for doc in documents:
            writer.add_document(doc, [doc.size // 3, doc.size - doc.size // 3])
    ours, theirs = IndexedDataset(tmp_path / "data"), megatron.IndexedDataset(str(tmp_path / "data"))
    assert len(ours) == len(theirs) == 2 * len(documents)
    assert np.array_equal(theirs.document_indices, np.arange(0, 2 * len(documents) + 1, 2))
    assert np.array_equal(ours.document_indices, theirs.document_indices)
    for d, doc in enumerate(documents):
        sequences = ours.document_sequences(d)
        assert np.array_equal(np.concatenate([theirs[s] for s in sequences]), doc)
        assert np.array_equal(np.concatenate([ours[s] for s in sequences]), doc)


@pytest.mark.peer
@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_qlm_reads_megatron_core_files(tmp_path, dtype):
    megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    documents = random_documents(2)
    prefix = str(tmp_path / "theirs")
    builder = megatron.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in documents[:20]:
        builder.add_document(doc, [doc.size])  # it calls numpy.array() on it
    for doc in documents[20:]:  # documents of several sequences (Megatron's sentence split)
        half = doc.size // 2
        builder.add_item(torch.from_numpy(doc[:half]))
        builder.add_item(torch.from_numpy(doc[half:]))
        builder.end_document()
    builder.finalize(prefix + ".idx")

    ours, theirs = IndexedDataset(prefix), megatron.IndexedDataset(prefix)
    assert len(ours) == len(theirs) == 20 + 2 * 20 and ours.dtype == dtype
    assert ours.num_documents == len(documents)
    assert np.array_equal(ours.document_indices, theirs.document_indices)
    assert np.array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    for i in range(len(theirs)):
        assert np.array_equal(ours[i], theirs[i])
    for d in range(20, len(documents)):
        assert np.array_equal(np.concatenate([ours[s] for s in ours.document_sequences(d)]), documents[d])


def test_missing_and_corrupt_files_are_user_errors(tmp_path):
    with pytest.raises(QlmError, match="does not exist"):
        IndexedDataset(tmp_path / "nothing")
    write_qlm(tmp_path / "data", random_documents(3), np.uint16)
    (tmp_path / "data.idx").write_bytes(b"not an index at all, not at all" * 2)
    with pytest.raises(QlmError, match="bad header"):
        IndexedDataset(tmp_path / "data")


def test_writer_rejects_ids_beyond_its_dtype_and_cleans_up(tmp_path):
    with pytest.raises(QlmError, match="do not fit in uint16"):
        with IndexedWriter(tmp_path / "data", np.uint16) as writer:
            writer.add_document([1, 2, 70000])
    assert not (tmp_path / "data.bin").exists() and not (tmp_path / "data.idx").exists()


def test_empty_documents_and_empty_dataset(tmp_path):
    with IndexedWriter(tmp_path / "data", np.uint16) as writer:
        writer.add_document([])
    dataset = IndexedDataset(tmp_path / "data")
    assert len(dataset) == 1 and dataset[0].size == 0 and dataset.num_tokens == 0
