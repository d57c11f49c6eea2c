"""What several test files share: reading qlm's model from an HF directory, comparing HF directories, the one-line
failure of a conversion, and `qlm train` in a fresh process with its metrics."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import load_safetensors_dir

from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
from qlm_core.models.gpt import GPTModel
from qlm_core.models.layout import HFTensorSource, ModelLayout, build_shard

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny-parity.toml"


def qlm_from_hf(path):
    ckpt = HFCheckpoint(path)
    layout = ModelLayout(ckpt.spec)
    model = GPTModel(ckpt.spec, padded_vocab=layout.padded_vocab)
    model.load_state_dict(build_shard(layout, 0, 0, 0, HFTensorSource(ckpt)), strict=True)
    return model.eval(), ckpt.spec


def assert_same_hf(a, b, dtype: torch.dtype | None = None):
    """HF directory `a` holds exactly the tensors of `b` (a directory or a name -> tensor dict), bit for bit; with
    `dtype`, `a`'s tensors are in that dtype and equal `b`'s cast to it."""
    ta, tb = load_safetensors_dir(a), b if isinstance(b, dict) else load_safetensors_dir(b)
    assert sorted(ta) == sorted(tb)
    for name, expected in tb.items():
        expected = expected if dtype is None else expected.to(dtype)
        assert ta[name].dtype == expected.dtype and torch.equal(ta[name], expected), name


def assert_clean_failure(result, out, *needles):
    code, stdout, stderr = result
    assert code == 2, (code, stdout, stderr)
    lines = [line for line in stderr.strip().splitlines() if line.strip() and "hf2mcore" not in line
             and "mcore2hf" not in line and "mcore2mcore" not in line]
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert not out.exists()


def qlm_train(*args, timeout=600, check=True, env_extra=None, child_code=None):
    """`qlm train ARGS` in a fresh process (or `python -c child_code train ARGS`)."""
    entry = ["-c", child_code] if child_code else ["-m", "qlm_cli.main"]
    cmd = [sys.executable, *entry, "train", *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", **(env_extra or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def metrics(run: Path) -> list[dict]:
    """The run's metrics.jsonl, a dict a step."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]


def losses(run: Path) -> list[float]:
    return [line["loss"] for line in metrics(run)]


def assert_greedy_generate_equals_transformers(path, model, max_new_tokens: int = 10):
    """`qlm generate` of the HF model at `path` (a left-padded batch of two chatml prompts) gives the tokens
    transformers' greedy `generate` of `model` (that model, loaded) gives, over more than two distinct tokens."""
    import transformers
    from conftest import call_qlm

    from qlm_core.data.tokenizer import CHATML

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompts = ["the quick brown fox", "the lazy dog jumps over the quick brown fox, how?"]
    code, out, err = call_qlm("generate", path, "-p", prompts[0], "-p", prompts[1], "--chat-template", "chatml",
                              "--max-new-tokens", str(max_new_tokens), "--jsonl")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    eos = tokenizer.eos_token_id
    for prompt, row in zip(prompts, rows, strict=True):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], chat_template=CHATML,
                                             tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new_tokens, eos_token_id=eos,
                                  pad_token_id=eos)[0, ids.shape[1]:].tolist()
        expected = expected[: next((i for i, t in enumerate(expected) if t == eos), len(expected))]
        assert len(set(expected)) > 2 and row["token_ids"] == expected
