"""`qlm convert SRC --to FORMAT`: one entry for every pair of formats qlm reads and writes. The source's format is
the registry's (checkpoint/sources/registry.py; a qlm run directory reads as its checkpoints), the direction is
looked up in DIRECTIONS, and the options that direction takes are handed to it; an option it does not take is one
line naming it. The directions are the functions behind the named verbs (hf2mcore, mcore2hf, ...), which stay as
aliases with the same flags and outputs; each runs the one conversion of skeleton.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import get_args

from qlm_core.checkpoint.convert.deepspeed import ds_to_hf, ds_to_mcore, hf_to_ds, mcore_to_ds
from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore, mcore_to_hf, mcore_to_mcore, mcore_to_peft
from qlm_core.checkpoint.convert.skeleton import ConvertResult
from qlm_core.checkpoint.io.progress import no_progress
from qlm_core.checkpoint.sources.registry import format_of
from qlm_core.config import ConvertTargetName
from qlm_core.errors import QlmError

TARGETS: tuple[str, ...] = get_args(ConvertTargetName)


@dataclass(frozen=True)
class ConvertOptions:
    """Every option of `qlm convert SRC --to FORMAT`; None: not given (the direction's default)."""

    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    ep: int | None = None
    etp: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    iteration: int | None = None
    tag: str | None = None
    config: str | None = None
    dtype: str | None = None
    max_shard_size_gb: float | None = None
    make_vocab_size_divisible_by: int | None = None
    fp32_master: bool | None = None
    allow_bf16_weights: bool | None = None

    def given(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


FLAGS = {"tp": "--tp", "pp": "--pp", "vpp": "--vpp", "ep": "--ep", "etp": "--etp",
         "first_stage_layers": "--num-layers-in-first-pipeline-stage",
         "last_stage_layers": "--num-layers-in-last-pipeline-stage", "iteration": "--iteration", "tag": "--tag",
         "config": "--config", "dtype": "--dtype", "max_shard_size_gb": "--max-shard-size",
         "make_vocab_size_divisible_by": "--make-vocab-size-divisible-by", "fp32_master": "--fp32-master",
         "allow_bf16_weights": "--allow-bf16-weights"}

_LAYOUT = ("tp", "pp", "vpp", "ep", "etp", "first_stage_layers", "last_stage_layers", "make_vocab_size_divisible_by")
_DENSE_LAYOUT = ("tp", "pp", "vpp", "first_stage_layers", "last_stage_layers", "make_vocab_size_divisible_by")


@dataclass(frozen=True)
class Direction:
    run: Callable[..., ConvertResult]  # (src, out, *, force, verify, progress, **options)
    options: tuple[str, ...]  # the ConvertOptions fields it takes
    alias: str  # the named verb it is
    fixed: tuple[tuple[str, str], ...] = ()  # arguments the target decides (the Megatron format)
    verifies: bool = True  # takes --verify


HF, MEGATRON, DEEPSPEED = "hf", "megatron", "deepspeed"  # the registry's format names (Megatron: either format)
DIRECTIONS: dict[tuple[str, str], Direction] = {
    (HF, "torch"): Direction(hf_to_mcore, (*_LAYOUT, "dtype"), "hf2mcore", (("format", "torch"),)),
    (HF, "torch_dist"): Direction(hf_to_mcore, (*_LAYOUT, "dtype"), "hf2mcore --format torch_dist",
                                  (("format", "torch_dist"),)),
    (HF, "deepspeed"): Direction(hf_to_ds, ("tag", "dtype", "fp32_master"), "hf2ds"),
    (MEGATRON, "hf"): Direction(mcore_to_hf, ("iteration", "dtype", "max_shard_size_gb", "config"), "mcore2hf"),
    (MEGATRON, "torch"): Direction(mcore_to_mcore, (*_LAYOUT, "iteration", "dtype", "config"), "mcore2mcore",
                                   (("format", "torch"),)),
    (MEGATRON, "torch_dist"): Direction(mcore_to_mcore, (*_LAYOUT, "iteration", "dtype", "config"),
                                        "mcore2mcore --format torch_dist", (("format", "torch_dist"),)),
    (MEGATRON, "deepspeed"): Direction(mcore_to_ds, ("iteration", "tag", "dtype", "fp32_master", "config"),
                                       "mcore2ds"),
    (MEGATRON, "peft"): Direction(mcore_to_peft, ("iteration", "config"), "mcore2peft", verifies=False),
    (DEEPSPEED, "hf"): Direction(ds_to_hf, ("tag", "config", "dtype", "max_shard_size_gb", "allow_bf16_weights"),
                                 "ds2hf"),
    (DEEPSPEED, "torch"): Direction(ds_to_mcore, (*_DENSE_LAYOUT, "tag", "config", "dtype", "allow_bf16_weights"),
                                    "ds2mcore"),
}


def source_kind(src: Path) -> str:
    """hf | megatron | deepspeed: the format of the directory SRC (a qlm run directory: megatron)."""
    if not src.is_dir():
        raise QlmError(f"{src} is not a directory", "point at a checkpoint directory")
    found = format_of(src)
    if found is None:
        raise QlmError(f"cannot tell the checkpoint format of {src}",
                       "expected config.json + weights (HF), latest_checkpointed_iteration.txt (Megatron) or latest + "
                       "global_step*/ (DeepSpeed)")
    return found.name


def convert(src: str | Path, out: str | Path, to: str, options: ConvertOptions = ConvertOptions(), *,
            force: bool = False, verify: bool | None = None, progress=no_progress) -> ConvertResult:
    """SRC (any format qlm reads) -> OUT in format `to`, by the direction the pair names."""
    if to not in TARGETS:
        raise QlmError(f"--to {to!r} is not a format qlm writes", f"use one of {', '.join(TARGETS)}")
    path = Path(src)
    kind = source_kind(path)
    direction = DIRECTIONS.get((kind, to))
    if direction is None:
        reachable = sorted(t for k, t in DIRECTIONS if k == kind)
        raise QlmError(f"qlm does not convert {kind} to {to}", f"from {kind} it writes {', '.join(reachable)}"
                       + ("; convert to torch first, then on" if kind == DEEPSPEED else ""))
    given = options.given()
    refused = [FLAGS[name] for name in given if name not in direction.options]
    if verify is not None and not direction.verifies:
        refused.append("--verify" if verify else "--no-verify")
    if refused:
        raise QlmError(f"{', '.join(refused)} {'does' if len(refused) == 1 else 'do'} not apply to {kind} -> {to} "
                       f"({direction.alias})",
                       f"drop {'it' if len(refused) == 1 else 'them'}; {kind} -> {to} takes "
                       + (", ".join(FLAGS[name] for name in direction.options) or "no layout or dtype option"))
    extra = {"verify": verify} if direction.verifies else {}
    return direction.run(path, out, force=force, progress=progress, **dict(direction.fixed), **extra, **given)
