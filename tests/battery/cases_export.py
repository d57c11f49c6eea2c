"""export: Megatron checkpoints without Megatron-LM args (--config, Megatron-Bridge run_config.yaml), the --config
values themselves, and the tokenizer / generation files an HF export reads to name its eos ids."""

from __future__ import annotations

import json
import shutil

from battery.case import Case

BRIDGE_MODEL = {  # the tiny HF fixture (qwen2, tests/conftest.py TINY) as Megatron-Bridge's model section
    "_target_": "megatron.bridge.models.qwen.qwen_provider.Qwen2ModelProvider",
    "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4, "num_query_groups": 2,
    "kv_channels": None, "seq_length": 256, "rotary_base": 10000.0, "layernorm_epsilon": 1e-6,
    "normalization": "RMSNorm", "gated_linear_unit": True,
    "activation_func": {"_target_": "torch.nn.functional.silu", "_call_": False}, "add_bias_linear": False,
    "add_qkv_bias": True, "share_embeddings_and_output_weights": False, "vocab_size": 300,
    "position_embedding_type": "rope", "rotary_percent": 1.0,
}


def expect(*texts: str, out: str = "out"):
    """The error names every one of `texts`, and nothing was written at `out`."""
    def check(root, outcome):
        if (root / out).exists():
            return f"{out} was written"
        missing = [t for t in texts if t not in outcome.stderr]
        return f"message lacks {missing}: {outcome.stderr.strip()[-300:]}" if missing else None
    return check


def argsless(root, fx, kind: str = "dist"):
    """A private copy of an args-less checkpoint (see fixtures.argsless)."""
    dst = root / f"ck_{kind}"
    shutil.copytree(fx.argsless() / kind, dst)
    return dst


def hf_config(root, fx, name: str = "cfg", **changes):
    """A directory holding only the HF fixture's config.json, with `changes`."""
    config = json.loads((fx.hf() / "config.json").read_text())
    config.update(changes)
    (root / name).mkdir()
    (root / name / "config.json").write_text(json.dumps(config))
    return root / name


def with_run_config(root, fx, text: str | bytes | None = None, where: str = "release", **model):
    """An args-less torch_dist checkpoint with a run_config.yaml (in WHERE: release, the root, or `above`)."""
    import yaml

    ck = argsless(root, fx)
    target = {"release": ck / "release", "root": ck, "above": ck.parent}[where]
    if text is None:
        text = yaml.safe_dump({"model": {**BRIDGE_MODEL, **model}, "train": {"train_iters": 4}})
    (target / "run_config.yaml").write_bytes(text if isinstance(text, bytes) else text.encode())
    return ck


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def mcore2hf(ck, root, *extra):
    return ["convert", "mcore2hf", "--mcore", ck, "--out", root / "out", *extra]


CASES = [
    Case("first hour", "export: args-less torch_dist without --config says to pass it",
         lambda root, fx: mcore2hf(fx.argsless() / "dist", root),
         check=expect("--config", "run_config.yaml")),
    Case("first hour", "export: args-less legacy torch (TP2) without --config says to pass it",
         lambda root, fx: mcore2hf(fx.argsless() / "torch", root),
         check=expect("--config")),
    Case("first hour", "export: mcore2mcore of an args-less checkpoint without --config",
         lambda root, fx: ["convert", "mcore2mcore", "--mcore", fx.argsless() / "dist", "--out", root / "out"],
         check=expect("--config")),
    Case("first hour", "export: --config names a directory that does not exist",
         lambda root, fx: mcore2hf(fx.argsless() / "dist", root, "--config", root / "no_such_model"),
         check=expect("no_such_model", "preset")),
    Case("first hour", "export: --config preset name with a typo",
         lambda root, fx: mcore2hf(fx.argsless() / "dist", root, "--config", "qwen2-05b"),
         check=expect("qwen2-05b", "qwen2-0.5b")),
    Case("first hour", "export: --config directory without config.json",
         lambda root, fx: (root / "empty").mkdir() or mcore2hf(fx.argsless() / "dist", root, "--config",
                                                               root / "empty"),
         check=expect("no config.json")),
    Case("first hour", "export: --config config.json that is not JSON",
         lambda root, fx: write(root / "bad" / "config.json", "{nope") or mcore2hf(
             fx.argsless() / "dist", root, "--config", root / "bad"),
         check=expect("config.json")),
    Case("first hour", "export: --config config.json missing num_attention_heads",
         lambda root, fx: write(root / "part" / "config.json", json.dumps(
             {"model_type": "qwen2", "vocab_size": 300, "hidden_size": 64})) or mcore2hf(
             fx.argsless() / "dist", root, "--config", root / "part"),
         check=expect("num_attention_heads")),
    Case("first hour", "export: --config is a file that is not a config.json",
         lambda root, fx: write(root / "model.txt", "qwen2") or mcore2hf(
             fx.argsless() / "dist", root, "--config", root / "model.txt"),
         check=expect("model.txt")),
    Case("first hour", "export: --config with another ffn size than the torch_dist shards",
         lambda root, fx: mcore2hf(fx.argsless() / "dist", root, "--config", hf_config(root, fx,
                                                                                        intermediate_size=128)),
         check=expect("implies")),
    Case("first hour", "export: --config with another ffn size than the legacy TP2 shards",
         lambda root, fx: mcore2hf(fx.argsless() / "torch", root, "--config", hf_config(root, fx,
                                                                                         intermediate_size=128)),
         check=expect("implies", "mp_rank_")),
    Case("first hour", "export: --config with fewer layers than the args of a TP2 PP2 checkpoint",
         lambda root, fx: mcore2hf(fx.megatron(), root, "--config", hf_config(root, fx, num_hidden_layers=2)),
         check=expect("num_layers")),
    Case("first hour", "export: --config with a larger vocabulary than the embedding rows",
         lambda root, fx: mcore2hf(fx.argsless() / "dist", root, "--config", hf_config(root, fx, vocab_size=1000)),
         check=expect("vocab_size 1000", "384")),
    Case("first hour", "export: mcore2mcore --config that contradicts the shards",
         lambda root, fx: ["convert", "mcore2mcore", "--mcore", fx.argsless() / "torch", "--out", root / "out",
                           "--config", hf_config(root, fx, num_key_value_heads=4)],
         check=expect("implies")),
    Case("first hour", "export: run_config.yaml that is not YAML",
         lambda root, fx: mcore2hf(with_run_config(root, fx, "model: [num_layers: 4\n  hidden: {"), root),
         check=expect("run_config.yaml", "YAML")),
    Case("first hour", "export: run_config.yaml without a model section",
         lambda root, fx: mcore2hf(with_run_config(root, fx, "train:\n  train_iters: 4\n"), root),
         check=expect("model:")),
    Case("first hour", "export: run_config.yaml (in the root) without model.num_layers",
         lambda root, fx: mcore2hf(with_run_config(root, fx, where="root", num_layers=None), root),
         check=expect("model.num_layers")),
    Case("first hour", "export: run_config.yaml (above the root) with num_layers: four",
         lambda root, fx: mcore2hf(with_run_config(root, fx, where="above", num_layers="four"), root),
         check=expect("model.num_layers", "four")),
    Case("first hour", "export: run_config.yaml of a LayerNorm model",
         lambda root, fx: mcore2hf(with_run_config(root, fx, normalization="LayerNorm"), root),
         check=expect("LayerNorm")),
    Case("first hour", "export: run_config.yaml with learned absolute positions",
         lambda root, fx: mcore2hf(with_run_config(root, fx, position_embedding_type="learned_absolute"), root),
         check=expect("learned_absolute")),
    Case("first hour", "export: run_config.yaml that is not UTF-8",
         lambda root, fx: mcore2hf(with_run_config(root, fx, b"model:\n  num_layers: \xff\xfe\n"), root),
         check=expect("run_config.yaml")),
    Case("first hour", "export: run_config.yaml whose hidden size contradicts the shards",
         lambda root, fx: mcore2hf(with_run_config(root, fx, hidden_size=128, kv_channels=16), root),
         check=expect("run_config.yaml")),
    Case("first hour", "export: the checkpoint's hf/generation_config.json is not JSON",
         lambda root, fx: (lambda ck: write(ck / "hf" / "generation_config.json", "{broken") or mcore2hf(
             ck, root, "--no-verify"))(fx.copy("megatron", root)),
         check=expect("generation_config.json")),
    Case("first hour", "export: mcore2peft of an args-less checkpoint without --config",
         lambda root, fx: ["convert", "mcore2peft", "--mcore", fx.argsless() / "torch", "--out", root / "out"],
         check=expect("--config")),
]
