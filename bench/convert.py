"""Benchmark `qlm convert hf2mcore` against the physical floor: reading the same source bytes and writing as many
bytes as the converted checkpoint holds, measured in the same run on the same (page-cached) files.

    python bench/convert.py                       # random bf16 Qwen2-1.5B, hf2mcore --tp 4 --pp 2
    python bench/convert.py --shape qwen2-7b      # the 15 GB case
    python bench/convert.py --format torch_dist   # write megatron-core's torch_dist format instead
    python bench/convert.py --direction ds2hf     # a DeepSpeed ZeRO checkpoint (8 fp32 partitions) -> HF fp32
    python bench/convert.py --shape deepseek-v3-scaled --tp 2 --pp 4 --ep 8 --pairs 3 --doubled
        # DeepSeek-V3's structure (61 layers, the first 3 dense, 256 experts top 8 in 8 groups, a shared expert,
        # MLA) at narrower widths; --doubled also converts the same structure with twice the expert width (about
        # twice the bytes) and reports both peaks: the RSS must not grow with the checkpoint

Two figures, each a median of --pairs alternating pairs (with their min and max, so the spread shows):
  in-process     the conversion call against the raw copy, each timed inside its own child process (start-up left
                 out); target <= 1.1
  whole process  `qlm convert hf2mcore --hf SRC --out DST ...` as a user runs it (interpreter and CLI start-up included)
                 against a `python` process that does the raw copy; target <= 1.3
and the peak RSS of each (measured in the child processes, so generating the checkpoint does not count), next to the
budget "one output file + two largest tensors" above an idle interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import copy_floor
import torch

from qlm_core.checkpoint.formats.hf.checkpoint import plan_hf_shards, shard_file_names, write_hf_index, write_hf_shard
from qlm_core.checkpoint.formats.megatron.torch_dist import dist_key
from qlm_core.config import CheckpointFormat, choices
from qlm_core.models import load_model_spec
from qlm_core.models.layout import ModelLayout

SCALED_V3 = "deepseek-v3-scaled"


def bench_spec(shape: str, expert_ffn: int = 128):
    """A preset, or SCALED_V3: DeepSeek-V3's layer structure and expert count at 1/14 of its widths (hidden 512,
    8 heads, latents 128 / 96) with routed experts `expert_ffn` wide."""
    if shape != SCALED_V3:
        return load_model_spec(shape)
    import dataclasses

    from qlm_core.models.mla_spec import MlaSpec

    v3 = load_model_spec("deepseek-v3")
    return v3.replace(vocab_size=32768, hidden_size=512, ffn_hidden_size=1280, num_attention_heads=8,
                      num_query_groups=8, kv_channels=48,
                      mla=MlaSpec(kv_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                                  q_lora_rank=128),
                      moe=dataclasses.replace(v3.moe, ffn_hidden_size=expert_ffn, shared_expert_hidden_size=expert_ffn))


def make_random_checkpoint(path: Path, shape: str, max_shard_gb: float = 4.0, expert_ffn: int = 128):
    """A random bf16 HF checkpoint written tensor by tensor (no model is instantiated)."""
    spec = bench_spec(shape, expert_ffn)
    layout = ModelLayout(spec)
    shapes = {name: layout.hf_shape(name) for name in layout.hf_tensors}
    sizes = {name: torch.Size(s).numel() * 2 for name, s in shapes.items()}
    shards = plan_hf_shards(sizes, int(max_shard_gb * 2**30))
    files = shard_file_names(len(shards))
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for names, file in zip(shards, files, strict=True):
        tensors = {n: (torch.randn(shapes[n], generator=generator) * 0.02).to(torch.bfloat16) for n in names}
        write_hf_shard(path / file, tensors)
        weight_map.update({n: file for n in names})
        del tensors
    if len(files) > 1:
        write_hf_index(path, weight_map, sum(sizes.values()))
    (path / "config.json").write_text(json.dumps(spec.to_hf_config("bfloat16"), indent=2))
    (path / "DONE").write_text("ok")


def raw_copy(src: Path, dst: Path, write_bytes: int | None = None) -> int:
    """Read every safetensors byte of `src` and write `write_bytes` bytes (default: as many as read)."""
    files = sorted(src.glob("*.safetensors"))
    if write_bytes is None:
        write_bytes = sum(f.stat().st_size for f in files)
    return copy_floor.raw_copy(files, dst, write_bytes)


def child(mode: str, src: Path, dst: Path, tp: int, pp: int, write_bytes: int = 0, fmt: str = "torch",
          ep: int = 1) -> dict:
    """Run one measurement in a fresh process; returns its timing and peak RSS."""
    code = (
        "import json, sys, time\n"
        "from pathlib import Path\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import convert as bench\n"
        "from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore\n"
        f"src, dst = Path({str(src)!r}), Path({str(dst)!r})\n"
        "import threading, psutil\n"
        "process, peak_rss = psutil.Process(), [0]\n"
        "def watch():\n"
        "    while True:\n"
        "        peak_rss[0] = max(peak_rss[0], process.memory_info().rss)\n"
        "        time.sleep(0.01)\n"
        "idle = process.memory_info().rss // 1024  # the interpreter with everything imported, now\n"
        "threading.Thread(target=watch, daemon=True).start()\n"
        "start = time.perf_counter()\n"
        f"if {mode!r} == 'raw':\n"
        f"    nbytes = bench.raw_copy(src, dst, {write_bytes:d})\n"
        "else:\n"
        f"    nbytes = hf_to_mcore(src, dst, tp={tp:d}, pp={pp:d}, ep={ep:d}, verify=False, "
        f"format={fmt!r}).bytes_written\n"
        "seconds = time.perf_counter() - start\n"
        "time.sleep(0.05)\n"
        "peak = peak_rss[0] // 1024  # sampled every 10 ms: the import's own transient peak does not hide it\n"
        "print(json.dumps({'seconds': seconds, 'bytes': nbytes, 'idle_rss_kb': idle, 'peak_rss_kb': peak}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def whole_process(mode: str, src: Path, dst: Path, tp: int, pp: int, write_bytes: int, fmt: str,
                  ep: int = 1) -> float:
    """Wall seconds of a whole process: `qlm convert hf2mcore` as a user types it, or a python that raw-copies."""
    if mode == "raw":
        command = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                   f"import copy_floor; from pathlib import Path; "
                   f"copy_floor.raw_copy(sorted(Path({str(src)!r}).glob('*.safetensors')), Path({str(dst)!r}), "
                   f"{write_bytes:d})"]
    else:
        command = [sys.executable, "-m", "qlm_cli.main", "convert", "hf2mcore", "--hf", str(src), "--out", str(dst),
                   "--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--no-verify", "--format", fmt]
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - start


def settle(out: Path):
    """Remove a previous output and write back every dirty page (the deletion's journal included)."""
    shutil.rmtree(out, ignore_errors=True)
    os.sync()


def spread(ratios: list[float]) -> str:
    return (f"{statistics.median(ratios):.2f} median of {len(ratios)} pairs (min {min(ratios):.2f}, "
            f"max {max(ratios):.2f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2-1.5b", help="model preset to build (default qwen2-1.5b)")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE shapes)")
    parser.add_argument("--doubled", action="store_true",
                        help=f"{SCALED_V3}: also convert it with twice the expert width and compare the peaks")
    parser.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "qlm-bench")
    parser.add_argument("--pairs", type=int, default=7, help="alternating pairs of each figure (median reported)")
    parser.add_argument("--format", default="torch", choices=choices(CheckpointFormat), help="Megatron format to write")
    parser.add_argument("--direction", default="hf2mcore", choices=["hf2mcore", "ds2hf"],
                        help="ds2hf: a DeepSpeed ZeRO checkpoint of the same model -> HF (see convert_deepspeed.py)")
    parser.add_argument("--dp", type=int, default=8, help="ds2hf: ZeRO partitions the fp32 masters are split into")
    parser.add_argument("--keep-source", action="store_true",
                        help="keep the random source checkpoints in --workdir for the next run (default: everything "
                             "the bench wrote there is removed at the end)")
    args = parser.parse_args()
    made = [args.workdir / name for name in ("warm", "raw-out", "convert-out", "doubled-out")]
    try:
        return run(args)
    finally:
        cleanup(args.workdir, args.keep_source, made)


def run(args) -> int:
    src = args.workdir / f"{args.shape}-hf"
    if not (src / "DONE").exists():
        print(f"building random bf16 {args.shape} checkpoint in {src} ...", flush=True)
        make_random_checkpoint(src, args.shape)
    if args.direction == "ds2hf":
        import convert_deepspeed

        return convert_deepspeed.run(args, src)
    source_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))

    layout = ModelLayout(bench_spec(args.shape), args.tp, args.pp, ep=args.ep)
    tensor_bytes = sorted(torch.Size(t.shape).numel() * 2 for t in layout.global_tensors)
    stage_bytes = [  # one (tp, pp, ep) output file's tensors, per stage (EP rank 0's experts)
        sum(torch.Size(t.shard_shape(layout.split_size(t))).numel() * 2 for c in range(layout.vpp)
            for _, t in layout.shard_entries(stage, c) if t is not None)
        for stage in range(args.pp)
    ]
    file_bytes, output_bytes = max(stage_bytes), sum(stage_bytes) * args.tp * args.ep
    held = "largest output file"
    if args.format == "torch_dist":  # one set of global tensors (no tied copy); DCP holds about one chunk per key
        output_bytes, held = sum(tensor_bytes), "a TP shard per DCP key"
        per_key: dict[str, int] = {}
        for t in layout.global_tensors:
            key = dist_key(t.name)[0]
            per_key[key] = max(per_key.get(key, 0), torch.Size(t.shard_shape(args.tp)).numel() * 2)
        file_bytes = sum(per_key.values())
    raw_copy(src, args.workdir / "warm")  # bring the source into the page cache for both contenders

    runs = {"raw": [], "convert": []}
    whole = {"raw": [], "convert": []}
    for i in range(args.pairs):
        # Alternate the order; before each run remove the previous output and flush, so that no run pays for
        # another's deletion or writeback.
        for mode in ("raw", "convert") if i % 2 == 0 else ("convert", "raw"):
            settle(args.workdir / f"{mode}-out")
            runs[mode].append(child(mode, src, args.workdir / f"{mode}-out", args.tp, args.pp, output_bytes,
                                    args.format, args.ep))
        for mode in ("convert", "raw") if i % 2 == 0 else ("raw", "convert"):
            settle(args.workdir / f"{mode}-out")
            whole[mode].append(whole_process(mode, src, args.workdir / f"{mode}-out", args.tp, args.pp,
                                             output_bytes, args.format, args.ep))
    best = {k: min(v, key=lambda r: r["seconds"]) for k, v in runs.items()}
    ratios = [c["seconds"] / r["seconds"] for c, r in zip(runs["convert"], runs["raw"], strict=True)]
    whole_ratios = [c / r for c, r in zip(whole["convert"], whole["raw"], strict=True)]
    peak = {k: max(r["peak_rss_kb"] for r in v) * 1024 for k, v in runs.items()}
    idle = min(r["idle_rss_kb"] for v in runs.values() for r in v) * 1024
    budget = file_bytes + sum(tensor_bytes[-2:])
    gib = 2**30
    print(f"shape {args.shape}: source {source_bytes / gib:.2f} GiB, hf2mcore --tp {args.tp} --pp {args.pp} "
          f"--format {args.format}")
    print(f"  raw read+write   {best['raw']['seconds']:7.2f} s  ({best['raw']['bytes'] / gib:.2f} GiB written)")
    print(f"  qlm hf2mcore     {best['convert']['seconds']:7.2f} s  ({best['convert']['bytes'] / gib:.2f} GiB written)")
    print(f"  in-process    ratio convert / raw = {spread(ratios)}; "
          f"{best['convert']['seconds'] / best['raw']['seconds']:.2f} best-of-each  (target <= 1.1)")
    print(f"  whole process qlm convert {statistics.median(whole['convert']):.2f} s, python raw copy "
          f"{statistics.median(whole['raw']):.2f} s (medians): ratio = {spread(whole_ratios)}  (target <= 1.3)")
    print(f"  peak RSS above idle: convert {(peak['convert'] - idle) / gib:.2f} GiB, "
          f"raw {(peak['raw'] - idle) / gib:.2f}"
          f" GiB; budget ({held} {file_bytes / gib:.2f} + two largest tensors "
          f"{sum(tensor_bytes[-2:]) / gib:.2f}) = {budget / gib:.2f} GiB -> "
          f"{'within' if peak['convert'] - idle <= budget else 'OVER'} budget")
    checks = {"in-process ratio <= 1.1": statistics.median(ratios) <= 1.1,
              "whole-process ratio <= 1.3": statistics.median(whole_ratios) <= 1.3,
              "peak RSS within budget": peak["convert"] - idle <= budget}
    if args.doubled:
        checks["peak RSS flat when the checkpoint doubles"] = doubled_peak(args, source_bytes, peak["convert"] - idle)
    return verdict(checks)


def doubled_peak(args, source_bytes: int, peak_above_idle: int) -> bool:
    """Convert the same structure with twice the expert width; its peak RSS above idle against the first's."""
    src = args.workdir / f"{args.shape}-doubled-hf"
    if not (src / "DONE").exists():
        print(f"building the doubled checkpoint in {src} ...", flush=True)
        make_random_checkpoint(src, args.shape, expert_ffn=256)
    doubled_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    settle(args.workdir / "doubled-out")
    run = child("convert", src, args.workdir / "doubled-out", args.tp, args.pp, 0, args.format, args.ep)
    above = (run["peak_rss_kb"] - run["idle_rss_kb"]) * 1024
    gib = 2**30
    flat = above <= 1.15 * peak_above_idle + 64 * 2**20  # noise: allocator pages, Python objects of more files
    print(f"  doubled: source {doubled_bytes / gib:.2f} GiB ({doubled_bytes / source_bytes:.2f}x), converted in "
          f"{run['seconds']:.2f} s, peak RSS above idle {above / gib:.2f} GiB against {peak_above_idle / gib:.2f} -> "
          f"{'flat' if flat else 'GROWS'}")
    return flat


def verdict(checks: dict[str, bool]) -> int:
    """The last line: PASS or FAIL with the targets missed; the exit code says the same."""
    missed = [name for name, ok in checks.items() if not ok]
    print(f"verdict: {'FAIL (missed: ' + '; '.join(missed) + ')' if missed else 'PASS'} "
          f"({len(checks) - len(missed)}/{len(checks)} targets met)")
    return 1 if missed else 0


def cleanup(workdir: Path, keep_source: bool, made: list[Path]):
    """Remove what this run wrote under the work directory (outputs, the page-cache copy) and, unless
    --keep-source, the random source it built: tens of GiB for the larger shapes."""
    for path in made:
        shutil.rmtree(path, ignore_errors=True)
    if keep_source:
        print(f"kept the source checkpoints under {workdir} (--keep-source): rm -r {workdir} frees them")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
