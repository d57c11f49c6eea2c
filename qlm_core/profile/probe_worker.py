"""One rank of `qlm profile --probe`: build the trainer's Engine for the case, run steps, write what it measured.

    python -m torch.distributed.run --standalone --nproc-per-node W \
        -m qlm_core.profile.probe_worker CASE.json OUTDIR STEPS

Also called in-process for a one-rank case (run_rank). A preference case trains as qlm train does: its pairs'
two sequences, its reference (the frozen copy, the adapters switched off, or a precomputed table), with DPO's
sigmoid loss (SimPO's when reference-free; the NLL terms of ORPO or rpo_alpha are not run). An RL case runs its
rollouts too (profile/probe_rl.py: a leader's `rollout` bytes and `rl_times` beside the rest).
Each rank writes OUTDIR/rank{R}.json:
  stage, dp_rank, tp_rank, cp_rank; states (bytes of weights, grads, optimizer actually allocated after a step);
  activations / logits_loss (peak live bytes saved for backward during the first step, saved-tensor hooks);
  max_allocated (CUDA only, the first step); comm_buffers (ZeRO 2: peak fp32 bucket storage borrowed in backward);
  step_times (seconds of the timed steps after the first); expert_load (expert parallelism: the rows this rank's
  MoE layers received over those they sent in the first step, measure.ExpertLoadMeter; else absent).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from qlm_core.config import LoraConfig, OptimConfig
from qlm_core.parallel.state import Grid, default_device, destroy_distributed, init_distributed
from qlm_core.profile.case import ProfileCase, case_from_dict
from qlm_core.profile.measure import ExpertLoadMeter, SavedTensorMeter, measure_model_states
from qlm_core.profile.probe_rl import rl_engine, run_rl_rank
from qlm_core.train.engine import Batch, Engine
from qlm_core.train.objectives.preference import PreferenceObjective
from qlm_core.train.objectives.preference_loss import PreferenceLossConfig


def _batch(case: ProfileCase, grid: Grid) -> Batch:
    rows = case.micro_batch_size * case.num_microbatches
    generator = torch.Generator().manual_seed(1000 + grid.dp_rank)
    tokens = torch.randint(0, case.spec.vocab_size, (rows, case.seq_len + 1), generator=generator)
    reference = -torch.rand(rows, generator=generator) if case.preference_reference == "precomputed" else None
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), reference_logps=reference)


def _preference(case: ProfileCase) -> tuple[PreferenceLossConfig | None, str | None]:
    """What the trainer's Engine gets for a preference case: its loss (DPO, or SimPO when reference-free) and
    reference; (None, None) for language-model training."""
    if not case.preference_reference:
        return None, None
    if case.preference_reference == "none":
        return PreferenceLossConfig(loss_type="simpo"), None
    return PreferenceLossConfig(loss_type="sigmoid"), case.preference_reference


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_step(case: ProfileCase, grid: Grid, engine: Engine, batch: Batch, reset: bool = True) -> dict:
    """Run and measure the first training step (module docstring: all but step_times); `reset`: CUDA's peak counts
    from here (an RL case resets it before its rollout)."""
    cuda = grid.device.type == "cuda"
    if cuda and reset:
        torch.cuda.reset_peak_memory_stats(grid.device)
    with SavedTensorMeter(engine.chunks) as meter, ExpertLoadMeter(engine.chunks) as load:
        engine.train_step(batch)
    _sync(grid.device)
    result = {"stage": grid.pp_rank, "dp_rank": grid.dp_rank, "cp_rank": grid.cp_rank, "tp_rank": grid.tp_rank,
              "states": measure_model_states(engine)}
    regions = meter.peak_by_region
    if load.load is not None:
        result["expert_load"] = load.load
    result["logits_loss"] = regions.get("head", 0)
    result["activations"] = sum(v for k, v in regions.items() if k != "head")
    result["max_allocated"] = torch.cuda.max_memory_allocated(grid.device) if cuda else None
    if case.parallel.zero_stage == 2:  # the bucket storage ZeRO 2 borrows during backward (GradientBuffers records it)
        result["comm_buffers"] = 4 * engine.optimizer.buffers.peak_transient_grad_numel
    return result


def run_rank(case: ProfileCase, steps: int, grid: Grid, on_step: Callable[[int, int], None] | None = None) -> dict:
    """`on_step(done, total)` after each step (the probe's progress)."""
    if case.rl:  # rollouts and the GRPO objective (profile/probe_rl.py)
        engine = rl_engine(case, grid)
        return run_rl_rank(case, steps, grid, engine, lambda batch: _first_step(case, grid, engine, batch, False),
                           lambda: _sync(grid.device), on_step)
    lora = LoraConfig(rank=case.lora_rank, target_modules=list(case.lora_targets)) if case.lora_rank else None
    preference, reference = _preference(case)
    engine = Engine(case.spec, case.parallel, grid, micro_batch_size=case.micro_batch_size,
                    global_batch_size=case.global_batch_size, seq_length=case.seq_len, dtype=case.torch_dtype,
                    optim=OptimConfig(lr=1e-4), seed=1234, lora=lora, loss_chunk_tokens=case.loss_chunk_tokens,
                    moe=case.moe, mtp_loss_scaling_factor=case.mtp_loss_scaling_factor,
                    objective=None if preference is None else PreferenceObjective(preference, reference))
    batch = _batch(case, grid)
    result = _first_step(case, grid, engine, batch)
    total = 1 + max(1, steps - 1)
    if on_step is not None:
        on_step(1, total)
    times = []
    for _ in range(max(1, steps - 1)):
        _sync(grid.device)
        start = time.perf_counter()
        engine.train_step(batch)
        _sync(grid.device)
        times.append(time.perf_counter() - start)
        if on_step is not None:
            on_step(1 + len(times), total)
    result["step_times"] = times
    return result


def _progress_file(outdir: Path) -> Callable[[int, int], None]:
    """Rank 0's steps, for the launcher's progress bar: "done total" in outdir/progress (replaced whole)."""
    def write(done: int, total: int):
        temporary = outdir / ".progress.tmp"
        temporary.write_text(f"{done} {total}")
        temporary.replace(outdir / "progress")
    return write


def main(argv: list[str]):
    case_file, outdir, steps = Path(argv[0]), Path(argv[1]), int(argv[2])
    case = case_from_dict(json.loads(case_file.read_text()))
    rank, _ = init_distributed(timeout_s=300)
    try:
        if default_device().type == "cpu":
            torch.set_num_threads(1)
        grid = Grid.build(case.sizes)
        result = run_rank(case, steps, grid, on_step=_progress_file(outdir) if rank == 0 else None)
        (outdir / f"rank{rank}.json").write_text(json.dumps(result))
    except Exception:
        (outdir / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
