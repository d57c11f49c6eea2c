"""Shared, read-only inputs for the battery's cases, built once per battery run under one cache directory: copy
what a case modifies (`fixtures.copy(name, root)`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path


class Fixtures:
    def __init__(self, cache: Path):
        self.cache = cache
        cache.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()  # cases run on several threads; builders call other builders

    def _built(self, name: str, build) -> Path:
        path = self.cache / name
        with self._lock:
            if not (self.cache / f"{name}.done").exists():
                shutil.rmtree(path, ignore_errors=True)
                build(path)
                (self.cache / f"{name}.done").touch()
        return path

    def copy(self, name: str, root: Path) -> Path:
        """A private copy of fixture NAME under root/NAME."""
        src = getattr(self, name)()
        dst = root / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
        return dst

    def hf(self) -> Path:
        """A tiny random Qwen2 HF model (fp32, safetensors) with a BPE tokenizer."""
        from conftest import make_hf_model

        return self._built("hf", lambda p: make_hf_model(p, "qwen2"))

    def tokenizer(self) -> Path:
        from conftest import make_tokenizer

        return self._built("tokenizer", make_tokenizer)

    def megatron(self) -> Path:
        """The tiny HF model converted to a Megatron legacy checkpoint at TP2 PP2."""
        return self._built("megatron", lambda p: qlm("convert", "hf2mcore", "--hf", self.hf(), "--out", p,
                                                     "--tp", "2", "--pp", "2"))

    def sft_jsonl(self) -> Path:
        def build(path: Path):
            import json

            path.mkdir()
            rows = [{"messages": [{"role": "user", "content": f"say {i}"},
                                  {"role": "assistant", "content": f"the number {i}"}]} for i in range(64)]
            (path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return self._built("sft_jsonl", build)

    def run(self) -> Path:
        """A finished 4-step qlm run directory (tiny model from the HF fixture, SFT, one checkpoint)."""
        return self._built("run", lambda p: qlm(
            "train", self.recipe(), "--output", p))

    def recipe(self) -> Path:
        """A 4-step SFT recipe on the HF fixture and the jsonl fixture (output is set per case with --output)."""
        path = self.cache / "recipe.toml"
        if not path.exists():
            path.write_text(recipe_text(self.hf(), self.sft_jsonl() / "chat.jsonl"))
        return path

    def checkpoints(self, name: str) -> Path:
        """Checkpoint fixture NAME (deepspeed, deepspeed_bf16, torch_dist, hf_sharded, megatron), built once even
        when cases run in parallel threads (a file lock around the build)."""
        import fcntl

        def sharded(path: Path):  # the HF fixture re-saved by transformers in shards with an index
            import transformers

            transformers.AutoModelForCausalLM.from_pretrained(self.hf()).save_pretrained(path, max_shard_size="200KB")
            for item in self.hf().iterdir():
                if item.name.startswith("tokenizer"):
                    shutil.copy2(item, path / item.name)

        builders = {
            "megatron": self.megatron,
            "deepspeed": lambda: self._built("deepspeed", lambda p: qlm(
                "convert", "hf2ds", "--hf", self.hf(), "--out", p, "--no-verify")),
            "deepspeed_bf16": lambda: self._built("deepspeed_bf16", lambda p: qlm(
                "convert", "hf2ds", "--hf", self.hf(), "--out", p, "--dtype", "bf16", "--no-verify")),
            "torch_dist": lambda: self._built("torch_dist", lambda p: qlm(
                "convert", "hf2mcore", "--hf", self.hf(), "--out", p, "--format", "torch_dist", "--no-verify")),
            "hf_sharded": lambda: self._built("hf_sharded", sharded),
        }
        with open(self.cache / ".checkpoints.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return builders[name]()

    def argsless(self) -> Path:
        """Megatron checkpoints without Megatron-LM args or hf/ (as megatron-core's dist_checkpointing and
        Megatron-Bridge write them): ARGSLESS/dist (torch_dist, TP1) and ARGSLESS/torch (legacy, TP2)."""
        import fcntl

        def build(path: Path):
            import torch

            from qlm_core.checkpoint.io.safe_load import safe_torch_load

            qlm("convert", "hf2mcore", "--hf", self.hf(), "--out", path / "dist", "--format", "torch_dist",
                "--no-verify")
            qlm("convert", "hf2mcore", "--hf", self.hf(), "--out", path / "torch", "--tp", "2", "--no-verify")
            for root in (path / "dist", path / "torch"):
                shutil.rmtree(root / "hf")
                for file in [*root.glob("*/common.pt"), *root.glob("*/mp_rank_*/model_optim_rng.pt")]:
                    state = safe_torch_load(file)
                    state.pop("args")
                    torch.save(state, file)

        with open(self.cache / ".argsless.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return self._built("argsless", build)


def recipe_text(hf: Path, data: Path, steps: int = 4) -> str:
    return f"""[model]
spec = "{hf}"
load = "{hf}"
dtype = "fp32"

[data]
kind = "sft"
train = ["{data}"]
seq_length = 64
chat_template = "chatml"

[train]
micro_batch_size = 2
global_batch_size = 4
train_iters = {steps}
eval_iters = 1

[checkpoint]
save_interval = 2

[logging]
plot = false
tensorboard = false
"""


def qlm(*args) -> subprocess.CompletedProcess:
    """Run qlm in a subprocess; raise when it fails (fixtures must build)."""
    proc = subprocess.run([sys.executable, "-m", "qlm_cli.main", *map(str, args)], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"qlm {' '.join(map(str, args))} failed:\n{proc.stderr[-2000:]}")
    return proc
