"""`qlm convert`: reshard checkpoints between Hugging Face and Megatron-Core, and inspect any checkpoint."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from qlm_core.checkpoint import convert as core
from qlm_core.checkpoint.inspect import inspect_checkpoint

from ..render import console, err_console, kv_table, progress_bar

app = typer.Typer(
    help="Convert and reshard checkpoints (HF <-> Megatron-Core legacy `torch` format), streaming, with a "
    "verification of the result (tensor by tensor, then logits).",
    no_args_is_help=True,
)


class DType(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


TP = Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel size of the output.")]
PP = Annotated[int, typer.Option("--pp", min=1, help="Pipeline-parallel size of the output.")]
VPP = Annotated[int, typer.Option("--vpp", min=1, help="Virtual pipeline chunks per stage (interleaved 1F1B).")]
FIRST = Annotated[Optional[int], typer.Option(
    "--num-layers-in-first-pipeline-stage", min=1, help="Layers on the first stage (uneven pipeline split).")]
LAST = Annotated[Optional[int], typer.Option(
    "--num-layers-in-last-pipeline-stage", min=1, help="Layers on the last stage (uneven pipeline split).")]
DTYPE = Annotated[Optional[DType], typer.Option("--dtype", help="Weight dtype to write (default: the source's).")]
FORCE = Annotated[bool, typer.Option("--force", help="Replace a non-empty output directory.")]
VERIFY = Annotated[Optional[bool], typer.Option(
    "--verify/--no-verify",
    help="Read the result back: every tensor bit-exact against the source (at the written dtype) and logits on a "
    "fixed input within 1e-4 relative. Default: on for models up to 2B parameters.",
    show_default=False,
)]
ITERATION = Annotated[Optional[int], typer.Option(
    "--iteration", help="Iteration to read (default: latest_checkpointed_iteration.txt).")]


def _report(result: core.ConvertResult, verifiable: bool = True):
    console.print(
        f"[green]wrote[/] {result.out}  ({result.files} files, {result.bytes_written / 2**20:.1f} MiB, "
        f"{result.seconds:.1f} s)"
    )
    if result.verify is not None:
        console.print(f"[green]verified[/] {result.verify.summary()}")
    elif verifiable:
        console.print("[yellow]not verified[/] (pass --verify to check the result)")


def _dtype(value: Optional[DType]) -> Optional[str]:
    return value.value if value is not None else None


@app.command("hf2mcore")
def hf2mcore(
    hf: Annotated[Path, typer.Option("--hf", help="Hugging Face model directory (config.json + safetensors).")],
    out: Annotated[Path, typer.Option("--out", help="Output Megatron checkpoint directory.")],
    tp: TP = 1,
    pp: PP = 1,
    vpp: VPP = 1,
    first: FIRST = None,
    last: LAST = None,
    dtype: DTYPE = None,
    make_vocab_size_divisible_by: Annotated[int, typer.Option(
        "--make-vocab-size-divisible-by", min=1,
        help="Pad the vocabulary to a multiple of this times --tp (Megatron's rule); padding rows are zeros and "
        "are excluded from qlm's softmax.")] = 128,
    force: FORCE = False,
    verify: VERIFY = None,
):
    """HF -> Megatron-Core legacy `torch` checkpoint (release/mp_rank_TT[_PPP]/model_optim_rng.pt).

    The HF config and tokenizer files are kept in OUT/hf/ so that mcore2hf gives back the same files."""
    with progress_bar("hf2mcore") as progress:
        result = core.hf_to_mcore(
            hf, out, tp=tp, pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last, dtype=_dtype(dtype),
            make_vocab_size_divisible_by=make_vocab_size_divisible_by, force=force, verify=verify, progress=progress,
        )
    _report(result)


@app.command("mcore2hf")
def mcore2hf(
    mcore: Annotated[Path, typer.Option("--mcore", help="Megatron checkpoint directory (written by qlm or Megatron-LM).")],
    out: Annotated[Path, typer.Option("--out", help="Output Hugging Face model directory.")],
    iteration: ITERATION = None,
    dtype: DTYPE = None,
    max_shard_size: Annotated[float, typer.Option(
        "--max-shard-size", min=0.001, help="Largest safetensors file in GiB; above it the weights are sharded with "
        "model.safetensors.index.json.")] = 5.0,
    force: FORCE = False,
    verify: VERIFY = None,
):
    """Megatron-Core -> HF (config.json, safetensors, tokenizer files), loadable with AutoModelForCausalLM.

    A LoRA run's checkpoint (adapters + args naming the base) is written merged: W + alpha/r * B A."""
    with progress_bar("mcore2hf") as progress:
        result = core.mcore_to_hf(
            mcore, out, iteration=iteration, dtype=_dtype(dtype), max_shard_size_gb=max_shard_size, force=force,
            verify=verify, progress=progress,
        )
    _report(result)


@app.command("mcore2mcore")
def mcore2mcore(
    mcore: Annotated[Path, typer.Option("--mcore", help="Source Megatron checkpoint directory.")],
    out: Annotated[Path, typer.Option("--out", help="Output Megatron checkpoint directory.")],
    tp: TP = 1,
    pp: PP = 1,
    vpp: VPP = 1,
    first: FIRST = None,
    last: LAST = None,
    iteration: ITERATION = None,
    dtype: DTYPE = None,
    make_vocab_size_divisible_by: Annotated[Optional[int], typer.Option(
        "--make-vocab-size-divisible-by", min=1, help="Default: the source's.")] = None,
    force: FORCE = False,
    verify: VERIFY = None,
):
    """Reshard a Megatron-Core checkpoint to another TP/PP/VPP (model weights; Transformer-Engine names are read
    and written back as the local spec). The iteration number is kept."""
    with progress_bar("mcore2mcore") as progress:
        result = core.mcore_to_mcore(
            mcore, out, tp=tp, pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last, iteration=iteration,
            dtype=_dtype(dtype), make_vocab_size_divisible_by=make_vocab_size_divisible_by, force=force,
            verify=verify, progress=progress,
        )
    _report(result)


@app.command("mcore2peft")
def mcore2peft(
    mcore: Annotated[Path, typer.Option("--mcore", help="Checkpoint root of a LoRA run (RUN/checkpoints).")],
    out: Annotated[Path, typer.Option("--out", help="Output directory for the PEFT adapter.")],
    iteration: ITERATION = None,
    force: FORCE = False,
):
    """LoRA adapters -> PEFT (adapter_model.safetensors + adapter_config.json with HF module names), for
    peft.PeftModel.from_pretrained on the base transformers model. For a merged model use mcore2hf."""
    with progress_bar("mcore2peft") as progress:
        result = core.mcore_to_peft(mcore, out, iteration=iteration, force=force, progress=progress)
    _report(result, verifiable=False)


@app.command("inspect")
def inspect(
    path: Annotated[Path, typer.Argument(help="Checkpoint directory (HF, Megatron torch / torch_dist, DeepSpeed).")],
    iteration: ITERATION = None,
    tensors: Annotated[bool, typer.Option("--tensors/--no-tensors", help="Print the tensor table.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
):
    """Detect a checkpoint's format and print its layout, args and tensors."""
    report = inspect_checkpoint(path, iteration)
    if as_json:
        print(json.dumps(report.to_json(), indent=2, default=str))
        return
    console.print(kv_table(f"{report.path}  [bold]({report.format})[/]", report.layout))
    if report.args:
        console.print(kv_table("architecture / args", report.args))
    if tensors:
        table = Table(title=f"{len(report.tensors)} tensors", title_justify="left")
        for column in ("name", "shape", "dtype", "where"):
            table.add_column(column)
        for row in report.tensors:
            table.add_row(row.name, "x".join(map(str, row.shape)) or "scalar", row.dtype, row.where)
        console.print(table)
    err_console.print(f"{len(report.tensors)} tensors, format {report.format}")
