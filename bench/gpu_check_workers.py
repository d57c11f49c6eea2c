"""The commands bench/gpu_check.py runs, one subcommand each, each in its own process:

    python bench/gpu_check_workers.py NAME --out DIR [options]

A check's last command judges it: it writes DIR/results/<check>.json = {"status": PASS | FAIL | SKIP, "figures":
{...}, "note": "..."}, which becomes the check's row of the summary table. The others leave their figures in
DIR/<check>/. On a machine without CUDA the workers run on the CPU (that is how the CPU suite tries them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # qlm without an install; parallel_cases, workers.parity_worker

GIB = 2**30
PARITY_DATA = ("plain", "packed", "window", "moe")
RTOL = 1e-4  # the parity suite's


def write_json(path: Path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(value, indent=1))
    partial.replace(path)


def result(out: Path, check: str, status: str, figures: dict, note: str = ""):
    write_json(out / "results" / f"{check}.json", {"status": status, "figures": figures, "note": note})
    print(json.dumps({"check": check, "status": status, "figures": figures, "note": note}))


def read_json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def synchronize():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def flash_attn_version() -> str | None:
    try:
        import flash_attn
    except Exception:  # noqa: BLE001 - any import failure means "not available" (as qlm_core/kernels reads it)
        return None
    return getattr(flash_attn, "__version__", "?")


# ---- env ------------------------------------------------------------------------------------------------------------

def env(args):
    import torch

    from qlm_core.hardware import ALLOCATOR_CONF_VARIABLES, configure_cuda_allocator, local_gpu

    users = {name: os.environ[name] for name in ALLOCATOR_CONF_VARIABLES if name in os.environ}
    applied = configure_cuda_allocator()  # as each rank's set-up calls it: torch imported, CUDA not yet used
    figures = {"torch": torch.__version__, "cuda": torch.version.cuda, "flash_attn": flash_attn_version() or "none"}
    if not torch.cuda.is_available():
        return result(args.out, "env", "FAIL", figures, "no CUDA device")
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    segments = torch.cuda.memory_snapshot()
    expandable = any(segment.get("is_expandable") for segment in segments)
    settings = getattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "?")()
    del block
    gpu = local_gpu()
    properties = torch.cuda.get_device_properties(0)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    a @ a
    synchronize()
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        a @ a
        synchronize()
        best = min(best, time.perf_counter() - start)
    figures.update(device=torch.cuda.get_device_name(0), preset=gpu.name if gpu else "none",
                   memory_gib=round(properties.total_memory / GIB, 1), devices=torch.cuda.device_count(),
                   nccl=".".join(map(str, torch.cuda.nccl.version())), alloc_conf_by_qlm=applied or "no",
                   user_alloc_conf=users or "none", expandable_segments=expandable,
                   allocator_settings=str(settings), bf16_matmul_tflops=round(2 * 8192**3 / best / 1e12, 1))
    wanted = applied is not None or "expandable_segments:true" in ",".join(users.values()).lower()
    ok = expandable == wanted
    note = "" if ok else ("the allocator did not take PYTORCH_CUDA_ALLOC_CONF set after `import torch`" if applied
                          else "segments expandable without being asked")
    result(args.out, "env", "PASS" if ok else "FAIL", figures, note)


# ---- nccl -----------------------------------------------------------------------------------------------------------

def nccl(args):
    """Under torchrun: every collective qlm issues (parallel/comm.py, expert_dispatch.py), values checked."""
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    on = torch.device("cuda", local)
    checks = {}
    x = torch.arange(4.0, device=on) + rank
    total = x.clone()
    dist.all_reduce(total)
    checks["all_reduce"] = torch.equal(total, sum(torch.arange(4.0, device=on) + r for r in range(world)))
    gathered = torch.empty(4 * world, device=on)
    dist.all_gather_into_tensor(gathered, x)
    checks["all_gather_into_tensor"] = torch.equal(gathered.view(world, 4)[rank], x)
    scattered = torch.empty(4, device=on)
    dist.reduce_scatter_tensor(scattered, torch.cat([x] * world))
    checks["reduce_scatter_tensor"] = torch.equal(scattered, x * world)
    swapped = torch.empty(4 * world, device=on)
    dist.all_to_all_single(swapped, torch.cat([x] * world))
    checks["all_to_all_single"] = torch.equal(swapped.view(world, 4)[0], torch.arange(4.0, device=on))
    value = torch.full((3,), float(rank), device=on)
    dist.broadcast(value, src=0)
    checks["broadcast"] = torch.equal(value, torch.zeros(3, device=on))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        failed = [name for name, ok in checks.items() if not ok]
        result(args.out, "nccl", "FAIL" if failed else "PASS", {"world": world, **checks},
               f"wrong values: {', '.join(failed)}" if failed else "")


# ---- parity ---------------------------------------------------------------------------------------------------------

def reference(data: str, micro_batch_size: int, steps: int) -> dict:
    """The parity suite's one-process run (tests/parallel/test_parallel_parity.py's reference) on this process's
    device."""
    from parallel_cases import GLOBAL_BATCH, SEQ, case_moe, case_spec, make_batch
    from workers.parity_worker import OPTIM

    from qlm_core.config import ParallelConfig
    from qlm_core.parallel.state import Grid
    from qlm_core.train.engine import Batch, Engine

    engine = Engine(case_spec(data), ParallelConfig(), Grid.single(), micro_batch_size=micro_batch_size,
                    global_batch_size=GLOBAL_BATCH, seq_length=SEQ, optim=OPTIM, seed=1234, moe=case_moe(data))
    batch = Batch(*make_batch(data))
    losses, norms = [], []
    for _ in range(steps):
        loss = engine.forward_backward(batch)
        norm, _ = engine.update()
        losses.append(engine.global_loss(loss))
        norms.append(float(norm))
    return {"losses": losses, "grad_norms": norms}


def parity_reference(args):
    import torch
    from parallel_cases import GLOBAL_BATCH, STEPS

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as the CPU computes it
    torch.backends.cudnn.allow_tf32 = False
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    runs = {data: reference(data, 2 if data == "moe" else GLOBAL_BATCH, STEPS) for data in PARITY_DATA}
    write_json(args.out / "parity" / f"reference_{args.device}.json", runs)


def compare(got: dict, want: dict) -> float:
    """The largest relative difference of the losses and grad norms."""
    pairs = [*zip(got["losses"], want["losses"], strict=True), *zip(got["grad_norms"], want["grad_norms"], strict=True)]
    return max(relative(a, b) for a, b in pairs)


def parity_compare_devices(args):
    cpu, cuda = (read_json(args.out / "parity" / f"reference_{d}.json") for d in ("cpu", "cuda"))
    if cpu is None or cuda is None:
        return result(args.out, "parity-cuda-cpu", "FAIL", {}, "a reference run did not finish (see the log)")
    errors = {data: compare(cuda[data], cpu[data]) for data in PARITY_DATA}
    worst = max(errors.values())
    result(args.out, "parity-cuda-cpu", "PASS" if worst <= RTOL else "FAIL",
           {f"{data}_rel": err for data, err in errors.items()}, f"largest relative difference {worst:.2g}")


def parity_rank(args):
    """One parity case on this torchrun's ranks over gloo; tensors on the CUDA device when there is one (Grid's
    default device), so every rank shares it."""
    from datetime import timedelta

    import torch.distributed as dist
    from workers.parity_worker import run_case

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out = args.out / "parity" / "gloo"
    out.mkdir(parents=True, exist_ok=True)
    run_case(args.case, out)
    dist.barrier()
    dist.destroy_process_group()


def parity_compare_gloo(args):
    from parallel_cases import CASES

    references = read_json(args.out / "parity" / "reference_cuda.json")
    if references is None:
        return result(args.out, "gloo-cuda-parity", "FAIL", {}, "no CUDA reference (parity-cuda-cpu failed)")
    figures, failed = {}, []
    for case in args.cases:
        got = read_json(args.out / "parity" / "gloo" / f"{case}.json")
        if got is None:
            figures[case], ok = "did not run", False
        else:
            error = compare(got, references[CASES[case].data])
            figures[case], ok = error, error <= RTOL
        if not ok:
            failed.append(case)
    result(args.out, "gloo-cuda-parity", "FAIL" if failed else "PASS", figures,
           f"failed: {', '.join(failed)} (errors in the log)" if failed else "")


# ---- Qwen2-1.5B at 4k -----------------------------------------------------------------------------------------------

def throughput(args):
    import torch

    from qlm_core.config import ParallelConfig
    from qlm_core.hardware import GPUS, configure_cuda_allocator, local_gpu
    from qlm_core.models.flops import flops_per_sequence
    from qlm_core.models.presets import PRESETS
    from qlm_core.parallel.state import Grid
    from qlm_core.train.engine import Batch, Engine
    from qlm_core.train.metrics import device_memory_gb, peak_memory_gb

    configure_cuda_allocator()
    spec = PRESETS[args.model]
    if args.layers:
        spec = spec.replace(num_layers=args.layers)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    engine = Engine(spec, ParallelConfig(), Grid.single(), micro_batch_size=1, global_batch_size=args.gbs,
                    seq_length=args.seq, dtype=dtype, seed=1, compile=args.compile)
    generator = torch.Generator().manual_seed(0)
    losses, seconds, first_s = [], [], None
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, spec.vocab_size, (args.gbs, args.seq + 1), generator=generator)
        synchronize()
        start = time.perf_counter()
        losses.append(engine.train_step(Batch(tokens[:, :-1], tokens[:, 1:]), 1e-5).loss)
        synchronize()
        if step >= args.warmup:
            seconds.append(time.perf_counter() - start)
        elif first_s is None:
            first_s = time.perf_counter() - start
    step_s = statistics.median(seconds)
    tflops = flops_per_sequence(spec, args.seq) * args.gbs / step_s / 1e12
    gpu = local_gpu() or GPUS["h200"]
    memory = device_memory_gb()
    peak = peak_memory_gb()
    figures = {"model": args.model, "seq": args.seq, "step_s": step_s, "tokens_per_s": args.gbs * args.seq / step_s,
               "tflops": tflops, "mfu": tflops / gpu.peak_tflops, "peak_of": gpu.name, "mem_peak_gb": peak,
               **memory, "flash_attn": flash_attn_version() or "none", "loss_first": losses[0],
               "loss_last": losses[-1], "compile": args.compile}
    if args.compile and first_s is not None:
        figures["compile_s"] = first_s - step_s  # the first step compiled the layers
    if "mem_reserved_gb" in memory:
        figures["reserved_over_peak"] = memory["mem_reserved_gb"] / peak - 1  # the profile allows 0.08
    finite = all(loss == loss and abs(loss) != float("inf") for loss in losses)
    result(args.out, "qwen2-1.5b-4k-compiled" if args.compile else "qwen2-1.5b-4k", "PASS" if finite else "FAIL",
           figures,
           "" if finite else "a non-finite loss")


# ---- profile --probe ------------------------------------------------------------------------------------------------

def profile_summary(args):
    try:
        document = json.loads((args.out / "profile_probe.json").read_text())
    except (OSError, ValueError) as exc:
        return result(args.out, "profile-probe", "FAIL", {}, f"no probe JSON: {exc}")
    probe = document.get("probe") or {}
    if not probe:
        return result(args.out, "profile-probe", "FAIL", {}, "the JSON has no probe")
    gbs = probe["layout"]["global_batch_size"]
    seconds = probe["s_per_sample"]
    figures = {"device": probe["device"], "mem_predicted_gib": probe["total"]["predicted_gib"],
               "mem_measured_gib": probe["total"]["measured_gib"], "mem_error": probe["total"]["error"],
               "s_per_sample_predicted": seconds["predicted"], "s_per_sample_measured": seconds["measured"],
               "time_error": seconds["error"]}
    figures["step_s_predicted"], figures["step_s_measured"] = seconds["predicted"] * gbs, seconds["measured"] * gbs
    write_json(args.out / "profile_probe_components.json", probe["components"])
    result(args.out, "profile-probe", "PASS" if probe["device"] == "cuda" else "FAIL", figures,
           "errors are predicted / measured - 1 (components in profile_probe_components.json)")


# ---- long context ---------------------------------------------------------------------------------------------------

def attention(args):
    """One packed or unpacked forward + backward at --seq of a 2-layer model with Qwen2-1.5B's attention shape
    (12 heads, 2 query groups, head dim 128): time (median of 3 after a warm-up), peak allocated above the model and
    batch, the loss and a projection of every gradient onto a fixed random direction (comparable across runs)."""
    tag = f"{args.kernels}_{args.dtype}_{'packed' if args.packed else 'unpacked'}"
    target = args.out / "long_context" / f"{tag}.json"
    if args.kernels == "native":
        sys.modules["flash_attn"] = None  # qlm_core.kernels then takes torch's own kernels
    elif flash_attn_version() is None:
        return write_json(target, {"skipped": "flash-attn is not installed"})
    import torch

    from qlm_core.hardware import configure_cuda_allocator
    from qlm_core.models.gpt import GPTModel
    from qlm_core.models.presets import PRESETS

    configure_cuda_allocator()
    on = device()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    spec = dataclasses.replace(PRESETS["qwen2-1.5b"], num_layers=2, vocab_size=32000,
                               max_position_embeddings=args.seq)
    model = GPTModel(spec, dtype=dtype).to(on)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (1, args.seq + 1), generator=generator)
    ids, labels = ids[:, :-1], ids[:, 1:]
    segments = None
    positions = torch.arange(args.seq)[None]
    if args.packed:
        weights = torch.rand(8, generator=generator) + 0.5
        lengths = (weights / weights.sum() * args.seq).long().tolist()
        lengths[-1] += args.seq - sum(lengths)
        segments = torch.repeat_interleave(torch.arange(8), torch.tensor(lengths))[None].to(on)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
    ids, labels, positions = ids.to(on), labels.to(on), positions.to(on)

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(ids, positions, segment_ids=segments, labels=labels).float().mean()
        loss.backward()
        return loss.item()

    step()
    synchronize()
    cuda = on.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        loss = step()
        synchronize()
        seconds.append(time.perf_counter() - start)
    projection = 0.0
    directions = torch.Generator(on).manual_seed(2)
    for param in model.parameters():
        if param.grad is not None:
            projection += float((param.grad.float() * torch.randn(param.shape, generator=directions, device=on,
                                                                    dtype=torch.float32)).sum())
    write_json(target, {"seconds": statistics.median(seconds), "loss": loss, "projection": projection,
                        "peak_bytes": (torch.cuda.max_memory_allocated() - before) if cuda else None})


def long_context_summary(args):
    runs = {path.stem: json.loads(path.read_text()) for path in (args.out / "long_context").glob("*.json")}
    reference = runs.get("native_fp32_packed")
    figures, problems = {}, []
    for kernels in ("native", "flash"):
        packed, plain = runs.get(f"{kernels}_bf16_packed"), runs.get(f"{kernels}_bf16_unpacked")
        if packed is None or plain is None:
            problems.append(f"{kernels} did not run")
            continue
        if "skipped" in packed:
            figures[f"{kernels}"] = "skipped (not installed)"
            continue
        figures[f"{kernels}_packed_s"] = packed["seconds"]
        figures[f"{kernels}_time_ratio"] = packed["seconds"] / plain["seconds"]
        if packed["peak_bytes"] and plain["peak_bytes"]:
            figures[f"{kernels}_packed_gib"] = packed["peak_bytes"] / GIB
            figures[f"{kernels}_peak_ratio"] = packed["peak_bytes"] / plain["peak_bytes"]
        if reference is not None:
            figures[f"{kernels}_loss_err"] = relative(packed["loss"], reference["loss"])
            figures[f"{kernels}_grad_err"] = relative(packed["projection"], reference["projection"])
    if reference is None:
        problems.append("no fp32 reference")
    native_err = max(figures.get("native_loss_err", 0), figures.get("native_grad_err", 0))
    flash_err = max(figures.get("flash_loss_err", 0), figures.get("flash_grad_err", 0))
    if "flash_loss_err" in figures and flash_err > max(2 * native_err, 1e-2):
        problems.append(f"flash-attn's error {flash_err:.2g} is more than twice the native kernels' {native_err:.2g}")
    result(args.out, "long-context", "FAIL" if problems else "PASS", figures, "; ".join(problems)
           or "errors: bf16 against the fp32 native run; ratios: packed / unpacked")


# ---- qlm train metrics ----------------------------------------------------------------------------------------------

def train_metrics(args):
    path = args.out / "tiny-sft" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    if not rows:
        return result(args.out, "train-metrics", "FAIL", {}, f"no rows in {path}")
    missing = [row["step"] for row in rows if "mem_reserved_gb" not in row or "mem_allocated_gb" not in row]
    below = [row["step"] for row in rows if row.get("mem_reserved_gb", 0) < row["mem_peak_gb"]]
    last = rows[-1]
    figures = {"steps": len(rows), "loss_first": rows[0]["loss"], "loss_last": last["loss"],
               "mem_peak_gb": last["mem_peak_gb"], "mem_allocated_gb": last.get("mem_allocated_gb"),
               "mem_reserved_gb": last.get("mem_reserved_gb")}
    problems = ([f"steps without the CUDA memory keys: {missing}"] if missing else []) + (
        [f"reserved below peak allocated at steps {below}"] if below else [])
    result(args.out, "train-metrics", "FAIL" if problems else "PASS", figures, "; ".join(problems))


# ---- GRPO -----------------------------------------------------------------------------------------------------------

def grpo_summary(args):
    path = args.out / "tiny-grpo" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    if not rows:
        return result(args.out, "grpo", "FAIL", {}, f"no rows in {path}")
    drift = max(row["train_rollout_logprob_abs_diff/max"] for row in rows)
    timed = rows[1:] or rows  # the first step builds the rollout model
    figures = {"steps": len(rows), "reward_first": rows[0]["reward"], "reward_last": rows[-1]["reward"],
               "logprob_abs_diff_max": drift,
               "sync_s": sum(r["time/weight_sync_s"] for r in timed) / len(timed),
               "rollout_s": sum(r["time/rollout_s"] for r in timed) / len(timed),
               "step_s": sum(r["step_time_s"] for r in timed) / len(timed)}
    # fp32 on CUDA: cuBLAS may pick other GEMM algorithms for the decode's shapes than for the training forward's
    ok = drift <= 1e-4
    result(args.out, "grpo", "PASS" if ok else "FAIL", figures,
           "" if ok else f"the trainer's and the sampler's log-probs differ by {drift:.2e} (> 1e-4)")


WORKERS = {"env": env, "nccl": nccl, "parity-reference": parity_reference,
           "parity-compare-devices": parity_compare_devices, "parity-rank": parity_rank,
           "parity-compare-gloo": parity_compare_gloo, "throughput": throughput, "profile-summary": profile_summary,
           "attention": attention, "long-context-summary": long_context_summary, "train-metrics": train_metrics,
           "grpo-summary": grpo_summary}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(WORKERS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda", help="parity-reference")
    parser.add_argument("--case", help="parity-rank: a case of tests/parallel_cases.py")
    parser.add_argument("--cases", nargs="+", default=[], help="parity-compare-gloo")
    parser.add_argument("--kernels", choices=["native", "flash"], default="native", help="attention")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="attention, throughput")
    parser.add_argument("--packed", action="store_true", help="attention: 8 documents")
    parser.add_argument("--seq", type=int, default=None, help="attention (32768), throughput (4096)")
    parser.add_argument("--model", default="qwen2-1.5b", help="throughput: a preset")
    parser.add_argument("--layers", type=int, default=0, help="throughput: fewer layers (0: the preset's)")
    parser.add_argument("--gbs", type=int, default=8, help="throughput: micro-batches of 1 per step")
    parser.add_argument("--steps", type=int, default=4, help="throughput: timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="throughput: untimed steps first")
    parser.add_argument("--compile", action="store_true", help="throughput: train.compile (each layer compiled)")
    return parser


def main(argv: list[str] | None = None):
    args = build_parser().parse_args(argv)
    if args.seq is None:
        args.seq = 32768 if args.name == "attention" else 4096
    WORKERS[args.name](args)


if __name__ == "__main__":
    main()
