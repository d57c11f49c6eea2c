"""The CPU demo data: deterministic, held-out eval, and it flows through the SFT, preprocess and pretrain paths."""

import json

import numpy as np

from qlm_core.data.demo import TASKS, build_demo
from qlm_core.data.preprocess import preprocess
from qlm_core.data.pretrain import PretrainConfig, build_pretrain_datasets
from qlm_core.data.sft import SFTConfig, build_sft_dataset
from qlm_core.data.tokenizer import load_tokenizer


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def test_demo_builds_deterministically(tmp_path):
    a = build_demo(tmp_path / "a", seed=5, num_train=300, num_eval=30, corpus_paragraphs=40)
    b = build_demo(tmp_path / "b", seed=5, num_train=300, num_eval=30, corpus_paragraphs=40)
    c = build_demo(tmp_path / "c", seed=6, num_train=300, num_eval=30, corpus_paragraphs=40)
    for name in ("train.jsonl", "eval.jsonl", "corpus.txt", "tokenizer/tokenizer.json"):
        assert (a.root / name).read_bytes() == (b.root / name).read_bytes(), name
    assert a.train.read_bytes() != c.train.read_bytes()

    train, evals = read_jsonl(a.train), read_jsonl(a.eval)
    assert len(train) == 300 and len(evals) == 30
    assert {e["task"] for e in evals} == set(TASKS)
    train_questions = {r["messages"][0]["content"] for r in train}
    for e in evals:
        assert e["question"] not in train_questions  # held out
        assert len(set(e["choices"])) == 4 and e["choices"][e["label"]] == e["answer"]
    for record in train[:30]:  # answers are right
        question, answer = (m["content"] for m in record["messages"])
        task, items = question.split(": ")
        items = items.split()
        expected = {"Reverse": " ".join(items[::-1]), "Sort": " ".join(sorted(items)), "Largest of": max(items)}
        assert answer == expected[task]

    tokenizer = load_tokenizer(a.tokenizer)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>" and len(tokenizer) <= 512
    assert len(tokenizer.tokenize(" a b c")) == 3  # one token per letter (with its leading space)
    assert len(tokenizer.tokenize(" 7 3")) == 4  # Qwen2's split: each digit alone, spaces apart
    dataset = build_sft_dataset(a.train, tokenizer, SFTConfig(seq_length=128), cache_dir=str(tmp_path / "cache"))
    assert 0 < len(dataset) < 300 and (dataset[0]["labels"] != -100).sum() > 0
    stats = preprocess([a.corpus], a.tokenizer, tmp_path / "corpus", append_eod=True, cache_dir=str(tmp_path / "c"))
    assert stats.documents == 40
    train_set, valid_set = build_pretrain_datasets(
        tmp_path / "corpus", PretrainConfig(seq_length=64, split="90,10", reset_position_ids=True,
                                            eod_token_id=tokenizer.eos_token_id), train_samples=100)
    assert len(train_set) == 100 and valid_set is not None
    assert np.all(train_set[0]["position_ids"] >= 0)


def test_demo_tokenizer_tokenises_the_same_beside_a_qwen2_config(tmp_path):
    """An exported model directory holds config.json (model_type qwen2): AutoTokenizer then builds
    Qwen2Tokenizer around the vocabulary. It must split text exactly as the tokenizer qlm trained with."""
    import json
    import shutil

    from qlm_core.data.demo import build_demo
    from qlm_core.data.tokenizer import load_tokenizer
    from qlm_core.models.presets import PRESETS

    paths = build_demo(tmp_path / "demo", num_train=50, num_eval=5, corpus_paragraphs=20)
    exported = tmp_path / "exported"
    shutil.copytree(paths.tokenizer, exported)
    (exported / "config.json").write_text(json.dumps(PRESETS["qlm-tiny"].to_hf_config()))
    plain, beside_config = load_tokenizer(paths.tokenizer), load_tokenizer(exported)
    assert type(beside_config).__name__ == "Qwen2Tokenizer"
    for line in paths.train.read_text().splitlines()[:50] + ["  Mixed CASE, digits 12 345\nand\ttabs! é"]:
        assert plain(line)["input_ids"] == beside_config(line)["input_ids"]
