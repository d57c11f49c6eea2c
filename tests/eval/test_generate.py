"""`qlm generate`: greedy decoding equals transformers' generate, turns stop at eos / <|im_end|> / generation_config's
eos ids, a Megatron TP2 conversion answers the same, and bad inputs are one line."""

from __future__ import annotations

import io
import json
import shutil
import sys

import pytest
import torch
from conftest import call_qlm, make_hf_model

from qlm_core.data.tokenizer import CHATML, build_demo_tokenizer
from qlm_core.models.gpt import GPTModel

CORPUS = ["hello there, how are you today? the quick brown fox jumps over the lazy dog."] * 20


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random Qwen2 model with a tokenizer that knows <|im_start|> / <|im_end|> and has the chatml template."""
    path = tmp_path_factory.mktemp("gen") / "hf"
    model = make_hf_model(path, "qwen2", initializer_range=0.2)  # not one token repeated
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    build_demo_tokenizer(path, CORPUS, vocab_size=280)
    return path, model


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    """A tiny model whose tokenizer has no chat template and spells <|im_end|> as ordinary text."""
    path = tmp_path_factory.mktemp("gen") / "plain"
    make_hf_model(path, "qwen2", seed=1, initializer_range=0.2)
    return path


def generate_jsonl(*args) -> list[dict]:
    code, out, err = call_qlm("generate", *args, "--jsonl")
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


def hf_greedy(model, tokenizer, prompt: str, max_new_tokens: int, eos: list[int]) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], chat_template=CHATML,
                                         tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=eos, pad_token_id=eos[0])[0, ids.shape[1]:].tolist()
    return out[: next((i for i, t in enumerate(out) if t in eos), len(out))]


def test_greedy_matches_transformers_generate(chat_model):
    from transformers import AutoTokenizer

    path, model = chat_model
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    prompts = ["hello there", "the quick brown fox jumps over the lazy dog, how are you?"]  # batch: left-padded
    rows = generate_jsonl(path, "-p", prompts[0], "-p", prompts[1], "--max-new-tokens", "12")
    for prompt, row in zip(prompts, rows, strict=True):
        expected = hf_greedy(model, tokenizer, prompt, 12, eos)
        assert len(expected) >= 4  # the comparison is over real decoding steps
        assert row["prompt"] == prompt and row["token_ids"] == expected
        assert row["answer"] == tokenizer.decode(expected, skip_special_tokens=True)


def forcing(monkeypatch, schedule: dict[int, int]):
    """Make qlm's model choose token schedule[step] at decoding step `step` (0: the first new token)."""
    calls = {"n": 0}
    original = GPTModel.logits  # once per decoding step (the prompt's pass projects only its last position)

    def logits_of(self, *args, **kwargs):
        logits = original(self, *args, **kwargs)
        step, calls["n"] = calls["n"], calls["n"] + 1
        if step in schedule:
            logits = logits.clone()
            logits[:, -1, schedule[step]] = 1e4
        return logits

    monkeypatch.setattr(GPTModel, "logits", logits_of)


def test_stops_at_im_end(chat_model, monkeypatch):
    path, _ = chat_model
    free = generate_jsonl(path, "-p", "hello there", "--max-new-tokens", "8")[0]
    assert free["finish"] == "length" and len(free["token_ids"]) == 8
    forcing(monkeypatch, {3: 2})  # <|im_end|> is id 2 of the demo tokenizer
    row = generate_jsonl(path, "-p", "hello there", "--max-new-tokens", "8")[0]
    assert row["token_ids"] == free["token_ids"][:3] and row["finish"] == "stop"
    assert "im_end" not in row["answer"]


def test_stops_at_generation_config_eos(chat_model, tmp_path, monkeypatch):
    path, _ = chat_model
    copy = tmp_path / "hf"
    shutil.copytree(path, copy)
    free = generate_jsonl(copy, "-p", "hello there", "--max-new-tokens", "6")[0]
    forcing(monkeypatch, {2: 77})
    assert generate_jsonl(copy, "-p", "hello there", "--max-new-tokens", "6")[0]["finish"] == "length"
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 77]}))
    forcing(monkeypatch, {2: 77})
    row = generate_jsonl(copy, "-p", "hello there", "--max-new-tokens", "6")[0]
    assert row["token_ids"] == free["token_ids"][:2] and row["finish"] == "stop"


def test_end_of_turn_spelled_as_text_is_cut_while_streaming(plain_model, monkeypatch):
    from transformers import AutoTokenizer

    marker = AutoTokenizer.from_pretrained(plain_model).encode("<|im_end|>", add_special_tokens=False)
    assert len(marker) > 1  # this tokenizer spells it as ordinary text
    code, free, err = call_qlm("generate", plain_model, "-p", "the fox", "--chat-template", "chatml",
                               "--max-new-tokens", "3")
    assert code == 0, err
    forcing(monkeypatch, {3 + i: token for i, token in enumerate(marker)})
    code, out, err = call_qlm("generate", plain_model, "-p", "the fox", "--chat-template", "chatml",
                              "--max-new-tokens", "40")
    assert code == 0, err
    assert out == free and "<|" not in out  # streamed: the marker's first pieces were held back, then cut


def test_megatron_tp2_answers_as_the_hf_model(chat_model, tmp_path):
    path, _ = chat_model
    code, _, err = call_qlm("convert", "hf2mcore", "--hf", path, "--out", tmp_path / "mcore", "--tp", "2",
                            "--no-verify")
    assert code == 0, err
    args = ["-p", "hello there", "-p", "how are you?", "--system", "be brief", "--max-new-tokens", "8"]
    assert generate_jsonl(tmp_path / "mcore", *args) == generate_jsonl(path, *args)


def test_prompts_from_stdin_and_sampling_seed(chat_model, monkeypatch):
    path, _ = chat_model
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello [b]x[/b]\n\n  \nthe lazy dog\r\n")))
    args = ["-p", "-", "--max-new-tokens", "5", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9"]
    rows = generate_jsonl(path, *args)
    assert [r["prompt"] for r in rows] == ["hello [b]x[/b]", "the lazy dog"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello [b]x[/b]\nthe lazy dog\n")))
    assert generate_jsonl(path, *args) == rows  # same seed, same samples


def test_several_prompts_print_one_block_each(chat_model):
    path, _ = chat_model
    code, out, err = call_qlm("generate", path, "-p", "[red]hi[/red]", "-p", "hello", "--max-new-tokens", "3")
    assert code == 0, err
    assert out.startswith("==> prompt 1 <==\n") and "\n==> prompt 2 <==\n" in out


@pytest.mark.parametrize("args, expected", [
    (["MISSING", "-p", "hi"], "MISSING does not exist"),
    (["{model}", "-p", "hi", "--chat-template", "chatmll"], "unknown chat template 'chatmll'"),
    (["{model}", "-p", "hi", "--max-new-tokens", "0"], "--max-new-tokens 0"),
    (["{model}", "-p", "hi", "--top-p", "0"], "--top-p 0.0"),
    (["{model}", "-p", "hi", "--top-k", "5"], "--temperature 0"),
    (["{model}", "-p", "hi", "--raw", "--system", "x"], "--system needs a chat template"),
    (["{model}", "-p", "   "], "the prompt is empty"),
    (["{model}"], "no prompt given"),
    (["{model}", "-p", "fox " * 300], "the model's context window is 256"),
    (["{plain}", "-p", "hi"], "has no chat template"),
    (["{bare}", "-p", "hi"], "--tokenizer DIR"),
    (["{model}", "-p", "-"], "stdin is not UTF-8"),
])
def test_bad_input_is_one_line(chat_model, plain_model, tmp_path, monkeypatch, args, expected):
    path, _ = chat_model
    bare = tmp_path / "bare"
    bare.mkdir()
    for item in path.iterdir():
        if not item.name.startswith("tokenizer"):
            shutil.copy2(item, bare / item.name)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9\n")))
    code, out, err = call_qlm("generate", *[a.format(model=path, plain=plain_model, bare=bare) for a in args])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "; " in lines[0], err
    assert expected in lines[0] and "Traceback" not in err + out
