"""Open any model checkpoint qlm understands as a TensorSource: an HF directory, a Megatron checkpoint (written
by qlm or Megatron-LM, any TP/PP, torch or torch_dist), a DeepSpeed checkpoint (with its model's config.json
beside it), or a qlm run directory (its latest checkpoint; a LoRA run's adapters merged onto
their base). Every verb that reads weights (train's model.load, eval, profile) goes through here."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from qlm_core.checkpoint.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from qlm_core.checkpoint.formats.deepspeed.config import find_hf_config
from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint, is_hf_dir, read_config
from qlm_core.checkpoint.formats.megatron.legacy import HF_SIDE_DIR, LATEST_FILE
from qlm_core.checkpoint.formats.megatron.open_configured import open_megatron_with
from qlm_core.checkpoint.sources.lora import merged_source
from qlm_core.errors import QlmError
from qlm_core.models.layout import HFTensorSource, TensorSource
from qlm_core.models.spec import ModelSpec

CHECKPOINTS_DIR = "checkpoints"  # inside a qlm run directory


@dataclass
class OpenedCheckpoint:
    spec: ModelSpec
    weights: TensorSource
    tokenizer_dir: Path | None
    description: str
    make_vocab_size_divisible_by: int = 128
    iteration: int | None = None  # the Megatron iteration read (None: an HF or DeepSpeed model, or `release`)
    weights_dir: Path | None = None  # the directory the weights were read from (a Megatron iteration's own)


def run_checkpoint_dir(path: Path) -> Path | None:
    """The checkpoint root of a qlm run directory, if `path` is one."""
    candidate = Path(path) / CHECKPOINTS_DIR
    return candidate if (candidate / LATEST_FILE).exists() else None


def tokenizer_near(path: Path) -> Path | None:
    for candidate in (path, path / HF_SIDE_DIR, path.parent / HF_SIDE_DIR):
        if (candidate / "tokenizer_config.json").exists() or (candidate / "tokenizer.json").exists():
            return candidate
    return None


def megatron_weights(src) -> tuple[TensorSource, Path]:
    """A Megatron checkpoint's weights, and where its HF config/tokenizer files are kept. A LoRA run's are the base
    merged with the adapters; the base is the checkpoint itself when it holds the base weights too, else the HF or
    Megatron checkpoint its args name."""
    if src.lora is None:
        return src, src.root / HF_SIDE_DIR
    if src.holds_base:
        return merged_source(src, src, src.layout, src.lora), src.root / HF_SIDE_DIR
    if not src.lora.base:
        raise QlmError(f"{src.root} holds only LoRA adapters and its args do not name the base (qlm_lora_base)",
                       "set args.qlm_lora_base to the base model's HF or Megatron checkpoint")
    path = Path(src.lora.base)
    if not path.exists() and not path.is_absolute():
        path = src.root / path
    if not path.exists():
        raise QlmError(f"the LoRA base {src.lora.base} does not exist", "put the base checkpoint back at that path")
    if is_hf_dir(path):
        hf = HFCheckpoint(path)
        base, base_spec, side_dir = HFTensorSource(hf), hf.spec, path
    else:
        base = open_megatron_with(path)
        base_spec, side_dir = base.spec, path / HF_SIDE_DIR
    shape = ("num_layers", "hidden_size", "ffn_hidden_size", "num_query_groups", "vocab_size")
    if any(getattr(base_spec, f) != getattr(src.spec, f) for f in shape):
        raise QlmError(f"the LoRA base {path} is not the model the adapters were trained on",
                       "point args.qlm_lora_base at the right base checkpoint")
    return merged_source(base, src, src.layout, src.lora), side_dir


def open_deepspeed(ds: str | Path, tag: str | None, config: str | Path | None, allow_bf16_weights: bool = False):
    """A DeepSpeed checkpoint, the ModelSpec of the config.json that describes it, and that config's path.
    `allow_bf16_weights`: read a bf16/fp16 ZeRO 1/2 run without its optimizer files from its module weights."""
    src = DeepSpeedCheckpoint(ds, tag, allow_low_precision=allow_bf16_weights)
    config_path = find_hf_config(src, config)
    return src, ModelSpec.from_hf_config(read_config(config_path)), config_path


def _open_megatron(root: Path, iteration: int | None, what: str) -> OpenedCheckpoint:
    ckpt = open_megatron_with(root, iteration)  # legacy torch or torch_dist; args or a Bridge run_config.yaml
    weights, side = megatron_weights(ckpt)
    if ckpt.lora is not None:
        what += f" (LoRA rank {ckpt.lora.rank} merged)"
    return OpenedCheckpoint(ckpt.spec, weights, tokenizer_near(side) or tokenizer_near(root), what,
                            ckpt.layout.make_vocab_size_divisible_by, ckpt.iteration, Path(ckpt.dir))


def open_checkpoint(path: str | Path, iteration: int | None = None) -> OpenedCheckpoint:
    path = Path(path)
    if not path.exists():
        raise QlmError(f"{path} does not exist",
                       "point at an HF model, a Megatron or DeepSpeed checkpoint, or a qlm run directory")
    if not path.is_dir():
        raise QlmError(f"{path} is not a directory",
                       "point at an HF model, a Megatron or DeepSpeed checkpoint, or a qlm run directory")
    root = run_checkpoint_dir(path)
    if root is not None:
        return _open_megatron(root, iteration, f"qlm run {path}")
    named = re.fullmatch(r"iter_(\d+)", path.name)
    if named:  # one iteration of a Megatron root, e.g. runs/x/checkpoints/iter_0000004
        number = int(named.group(1))
        if iteration is not None and iteration != number:
            raise QlmError(f"{path} is iteration {number}, not {iteration}",
                           "drop --iteration or point at the checkpoint root")
        return _open_megatron(path.parent, number, f"Megatron checkpoint {path}")
    try:
        names = [p.name for p in path.iterdir()]
    except OSError as exc:
        raise QlmError(f"cannot read {path}: {exc.strerror or exc}", "check its permissions") from None
    if (path / LATEST_FILE).exists() or any(name.startswith(("iter_", "release")) for name in names):
        return _open_megatron(path, iteration, f"Megatron checkpoint {path}")
    if iteration is not None:
        raise QlmError(f"--iteration {iteration} needs a Megatron checkpoint or a qlm run, and {path} is neither",
                       "drop --iteration")
    if is_hf_dir(path):
        ckpt = HFCheckpoint(path)
        ckpt.check_model()  # a config.json with fewer layers than the weights would drop some silently
        return OpenedCheckpoint(ckpt.spec, HFTensorSource(ckpt), tokenizer_near(path), f"HF model {path}",
                                weights_dir=path)
    if (path / "latest").is_file() or list(path.glob("global_step*")) or list(path.glob("*mp_rank_*_model_states.pt")):
        # reading to evaluate, generate or train from needs no fp32 masters: a bf16 module without them will do
        ckpt, spec, config_path = open_deepspeed(path, None, None, allow_bf16_weights=True)
        config_dir = config_path.parent if config_path.is_file() else config_path
        weights = "module weights, no optimizer files" if ckpt.warnings else "fp32 masters"
        return OpenedCheckpoint(spec, HFTensorSource(ckpt), tokenizer_near(config_dir) or tokenizer_near(path),
                                f"DeepSpeed checkpoint {path} (ZeRO {ckpt.zero_stage}, {weights})", weights_dir=path)
    raise QlmError(f"cannot tell what {path} holds",
                   "expected an HF model, a Megatron or DeepSpeed checkpoint, or a qlm run directory")
