"""`qlm generate`: bad checkpoints, tokenizers, templates, options and prompts; odd but valid prompts and paths."""

from __future__ import annotations

import json
import shutil

from battery.case import Case

TAG = "gen:"


def _hf_copy(root, fx, name="hf"):
    dst = root / name
    shutil.copytree(fx.hf(), dst)
    return dst


def _no_tokenizer(root, fx):
    ckpt = _hf_copy(root, fx)
    for item in ckpt.glob("tokenizer*"):
        item.unlink()
    return ["generate", ckpt, "-p", "hi", "--raw"]


def _bad_tokenizer_json(root, fx):
    ckpt = _hf_copy(root, fx)
    (ckpt / "tokenizer.json").write_bytes(b"\x00\xff not json")
    return ["generate", ckpt, "-p", "hi", "--raw"]


def _bad_generation_config(root, fx):
    ckpt = _hf_copy(root, fx)
    (ckpt / "generation_config.json").write_text('{"eos_token_id": ')
    return ["generate", ckpt, "-p", "hi", "--raw"]


def _small_vocab(root, fx):
    """A model of 64 tokens with a tokenizer of 280: the prompt's ids do not fit its embedding."""
    from conftest import make_hf_model

    make_hf_model(root / "small", "qwen2", vocab_size=64)
    return ["generate", root / "small", "-p", "the quick brown fox jumps over the lazy dog", "--raw"]


def _torch_dist(root, fx):
    """The tiny HF model as a torch_dist checkpoint at TP2: generate reads it with no conversion back."""
    from battery.fixtures import qlm

    qlm("convert", "hf2mcore", "--hf", fx.hf(), "--out", root / "dist", "--tp", "2", "--format", "torch_dist",
        "--no-verify")
    return ["generate", root / "dist", "-p", "the fox", "-p", "jumps", "--raw", "--max-new-tokens", "3"]


def _check_two_blocks(root, out):
    if not (out.stdout.startswith("==> prompt 1 <==\n") and "\n==> prompt 2 <==\n" in out.stdout):
        return f"expected one block a prompt: {out.stdout[:200]!r}"
    return None


def _prompt_file(root, name, data: bytes):
    (root / name).write_bytes(data)
    return root / name


def _jsonl_rows(out):
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def _check_brackets(root, out):
    rows = _jsonl_rows(out)
    if [r["prompt"] for r in rows] != ["[bold]hi[/bold] :smile: [x]"]:
        return f"prompt not echoed as written: {out.stdout[:200]!r}"
    return None


def _check_three(root, out):
    rows = _jsonl_rows(out)
    if [r["prompt"] for r in rows] != ["one [a]", "two", "three"] or any(len(r["token_ids"]) != 3 for r in rows):
        return f"expected 3 answers of 3 tokens: {out.stdout[:300]!r}"
    return None


def _check_one_answer(root, out):
    rows = _jsonl_rows(out)
    if len(rows) != 1 or len(rows[0]["token_ids"]) != 4:
        return f"expected one answer of 4 tokens: {out.stdout[:300]!r}"
    return None


def _names(text):
    return lambda root, out: None if text in out.stderr else f"message does not name {text!r}"


CASES = [
    Case("first hour", f"{TAG} checkpoint that does not exist",
         lambda root, fx: ["generate", root / "nope[1]", "-p", "hi"], check=_names("nope[1]")),
    Case("first hour", f"{TAG} checkpoint without tokenizer files", _no_tokenizer, check=_names("--tokenizer DIR")),
    Case("first hour", f"{TAG} tokenizer without a chat template, no --raw",
         lambda root, fx: ["generate", fx.hf(), "-p", "hi"], check=_names("--chat-template")),
    Case("first hour", f"{TAG} --chat-template typo",
         lambda root, fx: ["generate", fx.hf(), "-p", "hi", "--chat-template", "chatmll"], check=_names("chatmll")),
    Case("4 zero and negative", f"{TAG} --max-new-tokens 0",
         lambda root, fx: ["generate", fx.hf(), "-p", "hi", "--raw", "--max-new-tokens", "0"]),
    Case("4 zero and negative", f"{TAG} --batch-size 0",
         lambda root, fx: ["generate", fx.hf(), "-p", "hi", "--raw", "--batch-size", "0"]),
    Case("4 zero and negative", f"{TAG} --temperature -1",
         lambda root, fx: ["generate", fx.hf(), "-p", "hi", "--raw", "--temperature", "-1"]),
    Case("first hour", f"{TAG} --top-k without sampling",
         lambda root, fx: ["generate", fx.hf(), "-p", "hi", "--raw", "--top-k", "5"]),
    Case("first hour", f"{TAG} --raw with --system",
         lambda root, fx: ["generate", fx.hf(), "-p", "hi", "--raw", "--system", "be brief"]),
    Case("first hour", f"{TAG} --dtype that is not a dtype",
         lambda root, fx: ["generate", fx.hf(), "-p", "hi", "--raw", "--dtype", "fp8"]),
    Case("first hour", f"{TAG} prompt longer than the context window",
         lambda root, fx: ["generate", fx.hf(), "-p", "fox " * 400, "--raw"], check=_names("context window")),
    Case("first hour", f"{TAG} --tokenizer folder that does not exist",
         lambda root, fx: ["generate", fx.hf(), "-p", "hi", "--raw", "--tokenizer", root / "tok[x]"],
         check=_names("tok[x]")),
    Case("first hour", f"{TAG} tokenizer vocabulary larger than the model's", _small_vocab,
         check=_names("--tokenizer")),
    Case("3 corrupt input", f"{TAG} corrupt tokenizer.json", _bad_tokenizer_json),
    Case("first hour", f"{TAG} --chat-template Jinja with a syntax error",
         lambda root, fx: ["generate", fx.hf(), "-p", "hi", "--chat-template", "{% for m in messages %}{{ m }"],
         check=_names("chat template")),
    Case("3 corrupt input", f"{TAG} truncated generation_config.json", _bad_generation_config,
         check=_names("generation_config.json")),
    Case("2 not utf-8", f"{TAG} --prompt-file not UTF-8",
         lambda root, fx: ["generate", fx.hf(), "--raw", "--prompt-file", _prompt_file(root, "p.txt", b"caf\xe9\n")],
         check=_names("p.txt")),
    Case("2 not utf-8", f"{TAG} --prompt bytes not UTF-8",
         lambda root, fx: ["generate", fx.hf(), "--raw", "-p", "caf\udce9"]),
    Case("first hour", f"{TAG} --prompt-file that does not exist",
         lambda root, fx: ["generate", fx.hf(), "--raw", "--prompt-file", root / "missing.txt"]),
    Case("first hour", f"{TAG} --prompt-file of blank lines",
         lambda root, fx: ["generate", fx.hf(), "--raw", "--prompt-file", _prompt_file(root, "p.txt", b"\n \n")]),
    Case("5 rich markup", f"{TAG} prompt with [brackets] and :emoji: in a [bracketed] path, echoed as written",
         lambda root, fx: ["generate", _hf_copy(root, fx, "a[b]"), "-p", "[bold]hi[/bold] :smile: [x]",
                           "--chat-template", "chatml", "--max-new-tokens", "2", "--jsonl"],
         check=_check_brackets, expect_ok=True),
    Case("2 not utf-8", f"{TAG} stdout that cannot show the prompt's characters (latin-1), --jsonl",
         lambda root, fx: (["generate", fx.hf(), "--raw", "-p", "tea \u2615", "--max-new-tokens", "2", "--jsonl"],
                           {"PYTHONIOENCODING": "latin-1"}),
         check=lambda root, out: None if _jsonl_rows(out)[0]["prompt"] == "tea \u2615" else "prompt lost",
         expect_ok=True),
    Case("first hour", f"{TAG} prompts from a file, batched 2 at a time",
         lambda root, fx: ["generate", fx.hf(), "--raw", "--max-new-tokens", "3", "--batch-size", "2", "--jsonl",
                           "--prompt-file", _prompt_file(root, "p.txt", b"\xef\xbb\xbfone [a]\r\n\ntwo\nthree")],
         check=_check_three, expect_ok=True),
    Case("first hour", f"{TAG} Megatron TP2 PP2 checkpoint, sampled",
         lambda root, fx: ["generate", fx.megatron(), "-p", "the fox", "--chat-template", "llama3", "--system", "hi",
                           "--temperature", "0.7", "--top-p", "0.9", "--max-new-tokens", "4", "--jsonl"],
         check=_check_one_answer, expect_ok=True),
    Case("first hour", f"{TAG} Megatron torch_dist TP2 checkpoint, two prompts", _torch_dist,
         check=_check_two_blocks, expect_ok=True),
    Case("first hour", f"{TAG} --iteration the qlm run does not have",
         lambda root, fx: ["generate", fx.run(), "-p", "say 3", "--chat-template", "chatml", "--iteration", "3"]),
    Case("first hour", f"{TAG} qlm run directory, streamed answer",
         lambda root, fx: ["generate", fx.run(), "-p", "say 3", "--chat-template", "chatml", "--max-new-tokens", "4"],
         expect_ok=True),
    Case("first hour", f"{TAG} prompts from stdin (--prompt -), blank lines skipped",
         lambda root, fx: ["generate", fx.hf(), "--raw", "--max-new-tokens", "3", "--jsonl", "--prompt", "-"],
         check=_check_three, expect_ok=True, extra={"stdin": "one [a]\n\ntwo\nthree\n"}),
]
