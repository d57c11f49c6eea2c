"""`preprocess`: json / jsonl / parquet / txt -> a Megatron indexed dataset, the same whatever the worker count."""

import json

import numpy as np
import pytest

from qlm_core.data.indexed import IndexedDataset
from qlm_core.data.preprocess import preprocess
from qlm_core.data.tokenizer import build_demo_tokenizer
from qlm_core.errors import QlmError

TEXTS = [f"document {i}: the quick brown fox jumps over {i % 7} lazy dogs" * (1 + i % 3) for i in range(60)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_demo_tokenizer(tmp_path_factory.mktemp("tok"), TEXTS * 3)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from qlm_core.data.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_dir)


def write_jsonl(path, texts, key="text"):
    with open(path, "w") as out:
        for i, text in enumerate(texts):
            out.write(json.dumps({key: text, "id": i, "meta": {"source": "test"}}) + "\n")
    return path


def read_all(prefix):
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))], dataset


def test_jsonl_parquet_and_txt_with_one_and_two_workers(tmp_path, tokenizer_dir, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_jsonl(tmp_path / "a.jsonl", TEXTS[:30])
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"body": pa.array(TEXTS[30:50], pa.large_string()), "n": list(range(20))}), parquet)
    txt = tmp_path / "c.txt"
    txt.write_text("\n\n".join(TEXTS[50:]) + "\n\n\n")  # paragraphs; trailing blank lines make no document

    outputs = {}
    for workers in (1, 2):
        calls = []
        stats = preprocess([jsonl], tokenizer_dir, tmp_path / f"j{workers}", workers=workers, append_eod=True,
                           progress=lambda done, total, calls=calls: calls.append((done, total)),
                           cache_dir=str(tmp_path / f"cache{workers}"))  # separate caches: really run twice
        assert calls[-1] == (30, 30) and stats.documents == 30 and stats.tokens_per_second > 0
        preprocess([parquet, txt], tokenizer_dir, tmp_path / f"pt{workers}", json_key="body", workers=workers,
                   cache_dir=str(tmp_path / f"cache{workers}"))
        outputs[workers] = (read_all(tmp_path / f"j{workers}")[0], read_all(tmp_path / f"pt{workers}")[0])
        for suffix in (".bin", ".idx"):
            assert (tmp_path / f"j{workers}{suffix}").read_bytes() == (tmp_path / f"j1{suffix}").read_bytes()
    assert outputs[1] == outputs[2]

    eos = tokenizer.eos_token_id
    jsonl_docs, pt_docs = outputs[1]
    assert jsonl_docs == [tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in TEXTS[:30]]
    assert pt_docs == [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS[30:]]
    _, dataset = read_all(tmp_path / "j1")
    assert dataset.dtype == np.uint16 and stats.tokens == dataset.num_tokens


def test_empty_texts_are_skipped_and_an_empty_dataset_is_an_error(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "some.jsonl", ["", "hello fox", "   ", "lazy dog"])
    stats = preprocess([tmp_path / "some.jsonl"], tokenizer_dir, tmp_path / "out", cache_dir=str(tmp_path / "c"))
    assert stats.documents == 3  # whitespace is text; the empty string is not
    write_jsonl(tmp_path / "empty.jsonl", ["", ""])
    with pytest.raises(QlmError, match="no documents"):
        preprocess([tmp_path / "empty.jsonl"], tokenizer_dir, tmp_path / "none", cache_dir=str(tmp_path / "c"))
    assert not (tmp_path / "none.bin").exists()


def test_user_errors(tmp_path, tokenizer_dir):
    cache = str(tmp_path / "c")
    with pytest.raises(QlmError, match="does not exist"):
        preprocess([tmp_path / "missing.jsonl"], tokenizer_dir, tmp_path / "out", cache_dir=cache)
    write_jsonl(tmp_path / "a.jsonl", TEXTS[:3], key="content")
    with pytest.raises(QlmError, match=r"no key 'text' \(its keys: content, id, meta\)"):
        preprocess([tmp_path / "a.jsonl"], tokenizer_dir, tmp_path / "out", cache_dir=cache)
    with pytest.raises(QlmError, match="'meta' holds"):
        preprocess([tmp_path / "a.jsonl"], tokenizer_dir, tmp_path / "out", json_key="meta", cache_dir=cache)
    with pytest.raises(QlmError, match="tokenizer directory .* does not exist"):
        preprocess([tmp_path / "a.jsonl"], tmp_path / "nowhere", tmp_path / "out", json_key="content")
    (tmp_path / "notatokenizer").mkdir()
    (tmp_path / "notatokenizer" / "tokenizer.json").write_text("{broken")
    with pytest.raises(QlmError, match="cannot read a tokenizer"):
        preprocess([tmp_path / "a.jsonl"], tmp_path / "notatokenizer", tmp_path / "out", json_key="content")
    with pytest.raises(QlmError, match="unknown type .csv"):
        (tmp_path / "x.csv").write_text("a,b\n")
        preprocess([tmp_path / "x.csv"], tokenizer_dir, tmp_path / "out")


def test_cli_preprocess_is_read_by_megatron_core(run_qlm, tmp_path):
    import json

    import pytest

    pytest.importorskip("megatron.core")
    from conftest import make_tokenizer
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed

    from qlm_core.data.tokenizer import load_tokenizer

    make_tokenizer(tmp_path / "tok")
    docs = ["the quick brown fox", "jumps over", "the lazy dog " * 5]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    code, stdout, stderr = run_qlm("data", "preprocess", "--input", tmp_path / "in.jsonl", "--tokenizer",
                                   tmp_path / "tok", "--output", tmp_path / "out", "--json-key", "body",
                                   "--append-eod")
    assert code == 0, stderr
    assert "3 documents" in stdout
    tok = load_tokenizer(tmp_path / "tok")
    theirs = MegatronIndexed(str(tmp_path / "out"))
    assert len(theirs) == 3
    for i, doc in enumerate(docs):
        assert theirs[i].tolist() == tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
