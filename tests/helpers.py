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


def tiny_recipe(demo_data: Path, cache: Path, kind: str = "sft", lr: float = 3e-3) -> str:
    """A recipe's text past [model] for a few steps on one of the demo's data sets (`kind`: its data.kind)."""
    packing = "packing = false\n" if kind == "preference" else ""
    return f"""
[data]
kind = "{kind}"
{packing}train = [{json.dumps(str(demo_data))}]
seq_length = 64
cache_dir = {json.dumps(str(cache))}
[train]
micro_batch_size = 4
global_batch_size = 8
train_iters = 6
[optim]
lr = {lr}
weight_decay = 0.0
[schedule]
lr_schedule = "constant"
[logging]
tensorboard = false
plot = false
"""


def train_from(load: Path, out: Path, recipe: str) -> list[float]:
    """`qlm train` of `recipe` (tiny_recipe's text, plus any tables) from `load` in fp32 into `out`; its losses."""
    from conftest import call_qlm

    path = out.parent / f"{out.name}.toml"
    path.write_text(f'[model]\nload = {json.dumps(str(load))}\ndtype = "fp32"\n' + recipe)
    code, stdout, stderr = call_qlm("train", path, "--output", out)
    assert code == 0, stdout[-2000:] + stderr[-2000:]
    return [line["loss"] for line in metrics(out) if "loss" in line]


def assert_sft_then_lora_export_equals_transformers(tmp_path: Path, kind: str, dpo: bool = False):
    """`qlm train` of a tiny `kind` model: SFT (its loss falls), with `dpo` DPO from that run on the demo's
    preference pairs (its loss falls), LoRA on linear_qkv and linear_proj from the SFT run, and the merged export
    loads in transformers with qlm's logits."""
    import transformers
    from conftest import make_chat_hf_model

    from qlm_core.checkpoint.convert.hf_megatron import mcore_to_hf

    demo = make_chat_hf_model(tmp_path / "hf", tmp_path / "demo", kind=kind)
    sft = train_from(tmp_path / "hf", tmp_path / "sft", tiny_recipe(demo.train, tmp_path / "cache"))
    assert sft[-1] < sft[0]
    if dpo:
        preference = tiny_recipe(demo.preference, tmp_path / "cache", kind="preference", lr=1e-3)
        trained = train_from(tmp_path / "sft", tmp_path / "dpo", preference)
        assert trained[-1] < trained[0]
    lora = tiny_recipe(demo.train, tmp_path / "cache") + \
        '[lora]\nrank = 4\nalpha = 8.0\ntarget_modules = ["linear_qkv", "linear_proj"]\n'
    train_from(tmp_path / "sft", tmp_path / "lora", lora)
    mcore_to_hf(tmp_path / "lora/checkpoints", tmp_path / "merged", verify=True)
    model, spec = qlm_from_hf(tmp_path / "merged")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model(ids) - reference(ids).logits).abs().max().item() <= 1e-5


def cached_logits(model, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """The model's logits of `ids` [b, s] decoded with a KV cache: `prefix` tokens at once, then one at a time."""
    from qlm_core.models.attention import KVCache

    cache = KVCache.empty(len(model.decoder.layers))
    steps = [model(ids[:, :prefix], cache=cache)]
    steps += [model(ids[:, t:t + 1], torch.full((ids.shape[0], 1), t), cache=cache)
              for t in range(prefix, ids.shape[1])]
    return torch.cat(steps, dim=1)
