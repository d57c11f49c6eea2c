"""`qlm convert ds2hf` against the physical floor (bench/convert.py --direction ds2hf): reading the fp32 master
partitions a ZeRO checkpoint keeps (what ds2hf reads) and writing as many bytes as the HF output holds, in the same
run on the same page-cached files.

The source is a random bf16 model written by qlm as a DeepSpeed checkpoint whose fp32 masters are split into --dp
ZeRO-2 partitions (bf16_zero_pp_rank_R_mp_rank_00_optim_states.pt), so parameters straddle partition boundaries as
they do in a real run. Peak memory is reported twice: total RSS, which counts the memory-mapped partition pages
ds2hf touched (clean page cache the kernel can drop), and anonymous RSS (what qlm itself allocates), sampled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from copy_floor import raw_copy

from qlm_core.checkpoint.formats.deepspeed.config import copy_hf_side_files
from qlm_core.checkpoint.formats.deepspeed.write import write_deepspeed
from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint, plan_hf_shards
from qlm_core.models import load_model_spec
from qlm_core.models.layout import HFTensorSource, ModelLayout

TAG = "global_step1"

_CHILD = """
import json, resource, shutil, sys, threading, time
from pathlib import Path
sys.path.insert(0, {bench!r})
import convert_deepspeed as bench
from qlm_core.checkpoint.convert.deepspeed import ds_to_hf
src, dst = Path({src!r}), Path({dst!r})
shutil.rmtree(dst, ignore_errors=True)
peak_anon, done = [0], [False]
def sample():
    while not done[0]:
        peak_anon[0] = max(peak_anon[0], bench.anon_rss())
        time.sleep(0.01)
idle, idle_anon = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, bench.anon_rss()
threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
if {mode!r} == 'raw':
    nbytes = bench.raw_copy(bench.partition_files(src), dst, {write_bytes})
else:
    nbytes = ds_to_hf(src, dst, verify=False).bytes_written
seconds = time.perf_counter() - start
done[0] = True
print(json.dumps({{'seconds': seconds, 'bytes': nbytes, 'idle_rss_kb': idle,
                  'peak_rss_kb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  'anon_above_idle': max(peak_anon[0], bench.anon_rss()) - idle_anon}}))
"""


def anon_rss() -> int:
    """Resident anonymous memory of this process in bytes (Linux), excluding file-backed mmap pages."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def partition_files(ds: Path) -> list[Path]:
    return sorted((ds / TAG).glob("*_optim_states.pt"))


def make_deepspeed_checkpoint(hf: Path, ds: Path, dp: int):
    src = HFCheckpoint(hf)
    write_deepspeed(ds, ModelLayout(src.spec), HFTensorSource(src), torch.bfloat16, TAG, 1, partitions=dp)
    copy_hf_side_files(hf, ds)
    (ds / "DONE").write_text("ok")


def child(mode: str, src: Path, dst: Path, write_bytes: int) -> dict:
    code = _CHILD.format(bench=str(Path(__file__).parent), src=str(src), dst=str(dst), mode=mode,
                         write_bytes=write_bytes)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args, hf: Path):
    """Called by bench/convert.py with its parsed arguments and the random HF source."""
    ds = args.workdir / f"{args.shape}-ds-dp{args.dp}"
    if not (ds / "DONE").exists():
        print(f"writing it as a DeepSpeed checkpoint with {args.dp} fp32 partitions in {ds} ...", flush=True)
        make_deepspeed_checkpoint(hf, ds, args.dp)
    layout = ModelLayout(load_model_spec(args.shape))
    sizes = {name: torch.Size(layout.hf_shape(name)).numel() * 4 for name in layout.hf_tensors}
    output_bytes = sum(sizes.values())
    file_bytes = max(sum(sizes[n] for n in shard) for shard in plan_hf_shards(sizes, 5 * 2**30))
    two_largest = sum(sorted(sizes.values())[-2:])
    source_bytes = sum(p.stat().st_size for p in partition_files(ds))
    raw_copy(partition_files(ds), args.workdir / "warm", source_bytes)  # page-cache the source for both

    runs = {"raw": [], "convert": []}
    for i in range(args.pairs):
        for mode in ("raw", "convert") if i % 2 == 0 else ("convert", "raw"):
            os.sync()
            runs[mode].append(child(mode, ds, args.workdir / f"{mode}-out", output_bytes))
    best = {k: min(v, key=lambda r: r["seconds"]) for k, v in runs.items()}
    ratios = sorted(c["seconds"] / r["seconds"] for c, r in zip(runs["convert"], runs["raw"], strict=True))
    peak = {k: max(r["peak_rss_kb"] - r["idle_rss_kb"] for r in v) * 1024 for k, v in runs.items()}
    anon = max(r["anon_above_idle"] for r in runs["convert"])
    budget = file_bytes + two_largest
    gib = 2**30
    print(f"shape {args.shape}: fp32 masters in {args.dp} ZeRO partitions {source_bytes / gib:.2f} GiB, ds2hf -> fp32")
    print(f"  raw read+write   {best['raw']['seconds']:7.2f} s  ({best['raw']['bytes'] / gib:.2f} GiB written)")
    print(f"  qlm ds2hf        {best['convert']['seconds']:7.2f} s  ({best['convert']['bytes'] / gib:.2f} GiB written)")
    print(f"  time ratio convert / raw = {best['convert']['seconds'] / best['raw']['seconds']:.2f} best-of-each, "
          f"{ratios[len(ratios) // 2]:.2f} median of paired runs  (target <= 1.3)")
    print(f"  peak RSS above idle: convert {peak['convert'] / gib:.2f} GiB (with mapped partition pages), "
          f"anonymous {anon / gib:.2f} GiB, raw {peak['raw'] / gib:.2f} GiB; budget (largest output file "
          f"{file_bytes / gib:.2f} + two largest tensors {two_largest / gib:.2f}) = {budget / gib:.2f} GiB -> "
          f"anonymous {'within' if anon <= budget else 'OVER'} budget")
    from convert import verdict

    return verdict({"time ratio <= 1.3 (median)": ratios[len(ratios) // 2] <= 1.3,
                    "anonymous RSS within budget": anon <= budget})
