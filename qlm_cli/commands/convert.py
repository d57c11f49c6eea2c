"""`qlm convert`: reshard checkpoints between Hugging Face and Megatron-Core, and inspect any checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from qlm_cli.choices import ConvertTarget, MegatronFormat, WeightDtype, value_of
from qlm_cli.render import console, err_console, kv_table, progress_bar

if TYPE_CHECKING:
    from qlm_core.checkpoint.convert.skeleton import ConvertResult

class _ConvertGroup(TyperGroup):
    """`qlm convert SRC --to FORMAT`: a first word that names no verb is a source, for the `to` command."""

    def resolve_command(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["to", *args]
        return super().resolve_command(ctx, args)


app = typer.Typer(
    cls=_ConvertGroup,
    help="Convert and reshard checkpoints between Hugging Face, Megatron-Core (`torch` / `torch_dist`), DeepSpeed "
    "and PEFT, streaming, with a verification of the result (tensor by tensor, then logits): `qlm convert SRC --to "
    "FORMAT [options]` for any pair, or the named directions below.",
    no_args_is_help=True,
)


TP = Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel size of the output.")]
PP = Annotated[int, typer.Option("--pp", min=1, help="Pipeline-parallel size of the output.")]
VPP = Annotated[int, typer.Option("--vpp", min=1, help="Virtual pipeline chunks per stage (interleaved 1F1B).")]
EP = Annotated[int, typer.Option("--ep", min=1, help="Expert-parallel size of the output (MoE models): the routed "
                                 "experts divided among EP ranks, legacy folders mp_rank_TT[_PPP]_EEE.")]
ETP = Annotated[int | None, typer.Option("--etp", min=1, help="Expert tensor-parallel size of the output (MoE "
                                         "models; default: --tp). The legacy format needs it to divide --tp.",
                                         show_default=False)]
FIRST = Annotated[int | None, typer.Option(
    "--num-layers-in-first-pipeline-stage", min=1, help="Layers on the first stage (uneven pipeline split).")]
LAST = Annotated[int | None, typer.Option(
    "--num-layers-in-last-pipeline-stage", min=1, help="Layers on the last stage (uneven pipeline split).")]
DTYPE = Annotated[WeightDtype | None, typer.Option("--dtype", help="Weight dtype to write (default: the source's).")]
FORCE = Annotated[bool, typer.Option("--force", help="Replace a non-empty output directory.")]
VERIFY = Annotated[bool | None, typer.Option(
    "--verify/--no-verify",
    help="Read the result back: every tensor bit-exact against the source (at the written dtype) and logits on a "
    "fixed input within 1e-4 relative. Default: on for models up to 2B parameters.",
    show_default=False,
)]
ITERATION = Annotated[int | None, typer.Option(
    "--iteration", help="Iteration to read (default: latest_checkpointed_iteration.txt).")]
HF_IN = Annotated[Path, typer.Option("--hf", help="Hugging Face model directory (config.json + safetensors).")]
MCORE_IN = Annotated[Path, typer.Option(
    "--mcore", help="Megatron checkpoint directory (written by qlm or Megatron-LM).")]
MAX_SHARD = Annotated[float, typer.Option(
    "--max-shard-size", min=0.001, help="Largest safetensors file in GiB; above it the weights are sharded with "
    "model.safetensors.index.json.")]
VOCAB_HELP = ("Pad the vocabulary to a multiple of this times --tp (Megatron's rule); padding rows are zeros and are "
              "excluded from qlm's softmax.")
VOCAB_DIVISOR = Annotated[int, typer.Option("--make-vocab-size-divisible-by", min=1, help=VOCAB_HELP)]
MCORE_CONFIG = Annotated[str | None, typer.Option(
    "--config", help="Architecture of the Megatron checkpoint: an HF model directory (its config.json and tokenizer "
    "files are used) or a preset name. Needed for checkpoints without Megatron-LM args (megatron-core "
    "dist_checkpointing, Megatron-Bridge without run_config.yaml); checked against the shards otherwise. "
    "mcore2hf then writes exactly its vocab_size rows.", show_default=False)]


FORMAT_HELP = ("Megatron checkpoint format to write: `torch` (legacy, mp_rank_TT[_PPP]/model_optim_rng.pt) or "
               "`torch_dist` (megatron-core's distributed format: common.pt + metadata.json + .distcp files, "
               "loadable at any TP/PP).")


def _report(result: ConvertResult, verifiable: bool = True, skipped_verify: bool = False):
    """`skipped_verify`: --no-verify was passed (no read-back and no NaN scan)."""
    console.print(
        f"[green]wrote[/] {escape(str(result.out))}  ({result.files} files, {result.bytes_written / 2**20:.1f} MiB, "
        f"{result.seconds:.1f} s)"
    )
    if result.verify is not None:
        console.print(f"[green]verified[/] {escape(result.verify.summary())}")
    elif verifiable:
        scanned = not skipped_verify
        console.print("[yellow]not verified[/] (pass --verify to check the result" +
                      ("; the source was scanned for NaN)" if scanned else "; NaN in the source were not looked for)"))
    for note in result.notes:
        console.print(f"[yellow]note[/] {escape(note)}")
    from qlm_core.checkpoint.convert.skeleton import missing_tokenizer_warning

    missing = missing_tokenizer_warning(result.out) if verifiable else None
    for warning in [*result.warnings, *(result.verify.warnings() if result.verify is not None else []),
                    *filter(None, [missing])]:
        err_console.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)  # one line, never wrapped


@app.command("hf2mcore")
def hf2mcore(
    hf: HF_IN,
    out: Annotated[Path, typer.Option("--out", help="Output Megatron checkpoint directory.")],
    tp: TP = 1,
    pp: PP = 1,
    vpp: VPP = 1,
    ep: EP = 1,
    etp: ETP = None,
    first: FIRST = None,
    last: LAST = None,
    dtype: DTYPE = None,
    make_vocab_size_divisible_by: VOCAB_DIVISOR = 128,
    force: FORCE = False,
    verify: VERIFY = None,
    fmt: Annotated[MegatronFormat, typer.Option("--format", help=FORMAT_HELP)] = MegatronFormat["torch"],
):
    """HF -> Megatron-Core checkpoint: legacy `torch` (release/mp_rank_TT[_PPP]/model_optim_rng.pt) or `torch_dist`.

    The HF config and tokenizer files are kept in OUT/hf/ so that mcore2hf gives back the same files."""
    from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore

    with progress_bar("hf2mcore") as progress:
        result = hf_to_mcore(
            hf, out, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, first_stage_layers=first, last_stage_layers=last,
            dtype=value_of(dtype), make_vocab_size_divisible_by=make_vocab_size_divisible_by, force=force,
            verify=verify, progress=progress, format=fmt.value,
        )
    _report(result, skipped_verify=verify is False)


@app.command("mcore2hf")
def mcore2hf(
    mcore: MCORE_IN,
    out: Annotated[Path, typer.Option("--out", help="Output Hugging Face model directory.")],
    iteration: ITERATION = None,
    dtype: DTYPE = None,
    max_shard_size: MAX_SHARD = 5.0,
    force: FORCE = False,
    verify: VERIFY = None,
    config: MCORE_CONFIG = None,
):
    """Megatron-Core -> HF (config.json, safetensors, tokenizer files), loadable with AutoModelForCausalLM
    (AutoModelForSequenceClassification for a reward model).

    A LoRA run's checkpoint (adapters + args naming the base) is written merged: W + alpha/r * B A."""
    from qlm_core.checkpoint.convert.hf_megatron import mcore_to_hf

    with progress_bar("mcore2hf") as progress:
        result = mcore_to_hf(
            mcore, out, iteration=iteration, dtype=value_of(dtype), max_shard_size_gb=max_shard_size, force=force,
            verify=verify, progress=progress, config=config,
        )
    _report(result, skipped_verify=verify is False)


@app.command("mcore2mcore")
def mcore2mcore(
    mcore: Annotated[Path, typer.Option("--mcore", help="Source Megatron checkpoint directory.")],
    out: Annotated[Path, typer.Option("--out", help="Output Megatron checkpoint directory.")],
    tp: TP = 1,
    pp: PP = 1,
    vpp: VPP = 1,
    ep: EP = 1,
    etp: ETP = None,
    first: FIRST = None,
    last: LAST = None,
    iteration: ITERATION = None,
    dtype: DTYPE = None,
    make_vocab_size_divisible_by: Annotated[int | None, typer.Option(
        "--make-vocab-size-divisible-by", min=1, help=VOCAB_HELP + " Default: the source's.")] = None,
    force: FORCE = False,
    verify: VERIFY = None,
    fmt: Annotated[MegatronFormat | None, typer.Option(
        "--format", help=FORMAT_HELP + " Default: the source's format.", show_default=False)] = None,
    config: MCORE_CONFIG = None,
):
    """Reshard a Megatron-Core checkpoint (torch or torch_dist) to another TP/PP/VPP/EP/ETP or format.
    Transformer-Engine names are read and written back as the local spec; the iteration number is kept. A qlm
    training checkpoint keeps its Adam states (re-sliced like the weights), step, train state and scheduler, so
    `qlm train` resumes it at the new layout."""
    from qlm_core.checkpoint.convert.hf_megatron import mcore_to_mcore

    with progress_bar("mcore2mcore") as progress:
        result = mcore_to_mcore(
            mcore, out, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, first_stage_layers=first, last_stage_layers=last,
            iteration=iteration, dtype=value_of(dtype), make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            force=force, verify=verify, progress=progress, format=value_of(fmt), config=config,
        )
    _report(result, skipped_verify=verify is False)


@app.command("mcore2peft")
def mcore2peft(
    mcore: Annotated[Path, typer.Option("--mcore", help="Checkpoint root of a LoRA run (RUN/checkpoints).")],
    out: Annotated[Path, typer.Option("--out", help="Output directory for the PEFT adapter.")],
    iteration: ITERATION = None,
    force: FORCE = False,
    config: MCORE_CONFIG = None,
):
    """LoRA adapters -> PEFT (adapter_model.safetensors + adapter_config.json with HF module names), for
    peft.AutoPeftModelForCausalLM.from_pretrained(OUT): base_model_name_or_path is the run's HF base, or its
    Megatron base exported as HF into OUT/base. For a merged model use mcore2hf."""
    from qlm_core.checkpoint.convert.hf_megatron import mcore_to_peft

    with progress_bar("mcore2peft") as progress:
        result = mcore_to_peft(mcore, out, iteration=iteration, force=force, progress=progress, config=config)
    _report(result, verifiable=False)


DS_DIR = Annotated[Path, typer.Option(
    "--ds", help="DeepSpeed checkpoint directory: the one holding `latest` and global_stepN/ (or a tag directory).")]
DS_TAG = Annotated[str | None, typer.Option(
    "--tag", help="Checkpoint tag to read, e.g. global_step100 (default: the one the `latest` file names).")]
DS_CONFIG = Annotated[Path | None, typer.Option(
    "--config", help="HF config of the trained model (a model directory or config.json; its tokenizer files are "
    "copied too). DeepSpeed does not store it. Default: a config.json next to the checkpoint.")]
DS_DTYPE = Annotated[WeightDtype | None, typer.Option(
    "--dtype", help="Weight dtype to write (default: fp32, DeepSpeed's master weights).")]
DS_OUT_TAG = Annotated[str | None, typer.Option(
    "--tag", help="Tag directory to write (default: global_step0, or global_step<iteration> from Megatron).")]
ALLOW_BF16 = Annotated[bool, typer.Option(
    "--allow-bf16-weights", help="Convert a bf16/fp16 ZeRO 1/2 checkpoint whose optimizer files (the fp32 master "
    "weights) are missing from its module weights; fp32 precision is lost (a warning says so).")]
FP32_MASTER = Annotated[bool, typer.Option(
    "--fp32-master/--no-fp32-master", help="Also write the fp32 master weights as one ZeRO-2 partition "
    "(zero_pp_rank_0_mp_rank_00_optim_states.pt), which DeepSpeed's zero_to_fp32 and ds2hf read; engines load the "
    "module with load_checkpoint(OUT, load_module_only=True) either way.")]


@app.command("ds2hf")
def ds2hf(
    ds: DS_DIR,
    out: Annotated[Path, typer.Option("--out", help="Output Hugging Face model directory.")],
    tag: DS_TAG = None,
    config: DS_CONFIG = None,
    dtype: DS_DTYPE = None,
    max_shard_size: MAX_SHARD = 5.0,
    force: FORCE = False,
    verify: VERIFY = None,
    allow_bf16_weights: ALLOW_BF16 = False,
):
    """DeepSpeed (ZeRO 0-3, fp32/bf16/fp16) -> HF, without deepspeed installed.

    The full fp32 weights are rebuilt from the ZeRO partitions as DeepSpeed's zero_to_fp32 does; frozen parameters
    come from the model states, tied ones from `shared_params`."""
    from qlm_core.checkpoint.convert.deepspeed import ds_to_hf

    with progress_bar("ds2hf") as progress:
        result = ds_to_hf(ds, out, tag=tag, config=config, dtype=value_of(dtype), max_shard_size_gb=max_shard_size,
                          force=force, verify=verify, progress=progress, allow_bf16_weights=allow_bf16_weights)
    _report(result, skipped_verify=verify is False)


@app.command("ds2mcore")
def ds2mcore(
    ds: DS_DIR,
    out: Annotated[Path, typer.Option("--out", help="Output Megatron checkpoint directory.")],
    tag: DS_TAG = None,
    config: DS_CONFIG = None,
    tp: TP = 1,
    pp: PP = 1,
    vpp: VPP = 1,
    ep: EP = 1,
    etp: ETP = None,
    first: FIRST = None,
    last: LAST = None,
    dtype: DS_DTYPE = None,
    make_vocab_size_divisible_by: VOCAB_DIVISOR = 128,
    force: FORCE = False,
    verify: VERIFY = None,
    allow_bf16_weights: ALLOW_BF16 = False,
):
    """DeepSpeed (ZeRO 0-3) -> Megatron-Core legacy `torch` checkpoint at any TP/PP/VPP (and EP for MoE models),
    streamed one rank file at a time. The HF config and tokenizer files go to OUT/hf/."""
    from qlm_core.checkpoint.convert.deepspeed import ds_to_mcore

    with progress_bar("ds2mcore") as progress:
        result = ds_to_mcore(
            ds, out, tag=tag, config=config, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, first_stage_layers=first,
            last_stage_layers=last,
            dtype=value_of(dtype), make_vocab_size_divisible_by=make_vocab_size_divisible_by, force=force,
            verify=verify, progress=progress, allow_bf16_weights=allow_bf16_weights,
        )
    _report(result, skipped_verify=verify is False)


@app.command("hf2ds")
def hf2ds(
    hf: HF_IN,
    out: Annotated[Path, typer.Option("--out", help="Output DeepSpeed checkpoint directory.")],
    tag: DS_OUT_TAG = None,
    dtype: DTYPE = None,
    fp32_master: FP32_MASTER = True,
    force: FORCE = False,
    verify: VERIFY = None,
):
    """HF -> DeepSpeed: OUT/latest + OUT/<tag>/mp_rank_00_model_states.pt, for
    engine.load_checkpoint(OUT, load_module_only=True) under ZeRO 0-2. Config and tokenizer files go next to
    `latest`."""
    from qlm_core.checkpoint.convert.deepspeed import hf_to_ds

    with progress_bar("hf2ds") as progress:
        result = hf_to_ds(hf, out, tag=tag, dtype=value_of(dtype), fp32_master=fp32_master,
                          force=force, verify=verify, progress=progress)
    _report(result, skipped_verify=verify is False)


@app.command("mcore2ds")
def mcore2ds(
    mcore: MCORE_IN,
    out: Annotated[Path, typer.Option("--out", help="Output DeepSpeed checkpoint directory.")],
    iteration: ITERATION = None,
    tag: DS_OUT_TAG = None,
    dtype: DTYPE = None,
    fp32_master: FP32_MASTER = True,
    force: FORCE = False,
    verify: VERIFY = None,
    config: MCORE_CONFIG = None,
):
    """Megatron-Core (any TP/PP; a LoRA run merged) -> DeepSpeed, as hf2ds writes it."""
    from qlm_core.checkpoint.convert.deepspeed import mcore_to_ds

    with progress_bar("mcore2ds") as progress:
        result = mcore_to_ds(mcore, out, iteration=iteration, tag=tag, dtype=value_of(dtype),
                             fp32_master=fp32_master, force=force, verify=verify, progress=progress, config=config)
    _report(result, skipped_verify=verify is False)


@app.command("to", hidden=True)
def to_format(
    src: Annotated[Path, typer.Argument(help="Any checkpoint qlm reads: HF, Megatron (torch / torch_dist, or a qlm "
                                             "run directory), DeepSpeed.")],
    to: Annotated[ConvertTarget, typer.Option("--to", help="The format to write.")],
    out: Annotated[Path, typer.Option("--out", help="Output directory.")],
    tp: Annotated[int | None, typer.Option("--tp", min=1, help="Tensor-parallel size (Megatron outputs).")] = None,
    pp: Annotated[int | None, typer.Option("--pp", min=1, help="Pipeline-parallel size (Megatron outputs).")] = None,
    vpp: Annotated[int | None, typer.Option("--vpp", min=1, help="Virtual chunks per stage (Megatron outputs).")
                   ] = None,
    ep: Annotated[int | None, typer.Option("--ep", min=1, help="Expert-parallel size (Megatron outputs).")] = None,
    etp: ETP = None,
    first: FIRST = None,
    last: LAST = None,
    iteration: ITERATION = None,
    tag: Annotated[str | None, typer.Option("--tag", help="DeepSpeed tag: the one to read (a DeepSpeed source) "
                                            "or to write (--to deepspeed).")] = None,
    config: Annotated[str | None, typer.Option("--config", help="The model's architecture where the source does "
                                               "not store it (Megatron without args, DeepSpeed).")] = None,
    dtype: DTYPE = None,
    max_shard_size: Annotated[float | None, typer.Option("--max-shard-size", min=0.001, help="Largest safetensors "
                                                         "file in GiB (--to hf).")] = None,
    make_vocab_size_divisible_by: Annotated[int | None, typer.Option("--make-vocab-size-divisible-by", min=1,
                                                                     help=VOCAB_HELP)] = None,
    fp32_master: Annotated[bool | None, typer.Option("--fp32-master/--no-fp32-master", help="--to deepspeed: "
                                                     "write the fp32 master weights too.", show_default=False)] = None,
    allow_bf16_weights: Annotated[bool | None, typer.Option("--allow-bf16-weights", help="A DeepSpeed source "
                                                            "without its fp32 masters.", show_default=False)] = None,
    force: FORCE = False,
    verify: VERIFY = None,
):
    """SRC -> FORMAT for any pair qlm converts (the named verbs are the same directions)."""
    from qlm_core.checkpoint.convert.pipeline import ConvertOptions, convert

    options = ConvertOptions(tp, pp, vpp, ep, etp, first, last, iteration, tag, config, value_of(dtype),
                             max_shard_size, make_vocab_size_divisible_by, fp32_master, allow_bf16_weights)
    with progress_bar(f"convert to {to.value}") as progress:
        result = convert(src, out, to.value, options, force=force, verify=verify, progress=progress)
    _report(result, verifiable=to.value != "peft", skipped_verify=verify is False)


@app.command("inspect")
def inspect(
    path: Annotated[Path, typer.Argument(help="Checkpoint directory (HF, Megatron torch / torch_dist, DeepSpeed).")],
    iteration: ITERATION = None,
    tensors: Annotated[bool, typer.Option("--tensors/--no-tensors", help="Print the tensor table.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    config: MCORE_CONFIG = None,
):
    """Detect a checkpoint's format and print its layout, args and tensors."""
    from qlm_core.checkpoint.convert.describe import inspect_checkpoint

    report = inspect_checkpoint(path, iteration, config)
    if as_json:
        print(json.dumps(report.to_json(), indent=2, default=str))
        return
    console.print(kv_table(f"{escape(str(report.path))}  [bold]({report.format})[/]", report.layout))
    if report.args:
        console.print(kv_table("architecture / args", report.args))
    if tensors:
        table = Table(title=f"{len(report.tensors)} tensors", title_justify="left")
        for column in ("name", "shape", "dtype", "where"):
            table.add_column(column)
        for row in report.tensors:
            table.add_row(escape(row.name), "x".join(map(str, row.shape)) or "scalar", row.dtype, escape(row.where))
        console.print(table)
    err_console.print(f"{len(report.tensors)} tensors, format {report.format}")
