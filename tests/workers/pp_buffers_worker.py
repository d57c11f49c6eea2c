"""torchrun worker for tests/parallel/test_pp_buffers.py (2 gloo ranks, one launch): per pipeline schedule and number of
micro-batches, the peak bytes the trainer allocates on each stage from building the Engine through two training
steps (AllocationMeter: every tensor, weights, optimizer states, activations, receive buffers, transients), what the
pipeline stages still reference after the step, and memory.py's components for the same case.

    torchrun --nproc-per-node 2 tests/workers/pp_buffers_worker.py OUTDIR

Writes OUTDIR/peak/<schedule>.m<M>.stage<R>.json.
"""

import json
from functools import partial
from pathlib import Path

import torch
from parallel_cases import SPEC

from qlm_core.config import OptimConfig, ParallelConfig
from qlm_core.parallel.state import Grid, resolve_sizes
from qlm_core.profile.case import ProfileCase
from qlm_core.profile.measure import AllocationMeter
from qlm_core.profile.memory import Allowance, stage_memory
from qlm_core.train.engine import Batch, Engine

SEQ = 32
MICROBATCHES = (8, 64)
SCHEDULES = {"1f1b": dict(pp=2, pp_schedule="1f1b"),
             "interleaved_1f1b": dict(pp=2, vpp=2, pp_schedule="interleaved_1f1b"),
             "zero_bubble": dict(pp=2, pp_schedule="zero_bubble")}


def held_by_stages(engine: Engine) -> int:
    """Bytes of the receive buffers (and their gradients) the PipelineStages still reference between steps."""
    seen = {}
    for stage in engine.runner.stages:
        infos = [i for infos in stage.args_recv_info.values() for i in infos]
        infos += [i for infos in stage.grad_recv_info.values() for i in infos]
        for info in infos:
            for t in (info.buffer, getattr(info.buffer, "grad", None)):
                if isinstance(t, torch.Tensor):
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def peak_case(schedule: str, microbatches: int, out: Path):
    config = ParallelConfig(**SCHEDULES[schedule])
    grid = Grid.build(resolve_sizes(2, pp=2), ranks=[0, 1])
    spec = SPEC.replace(num_layers=4 * config.vpp)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (microbatches, SEQ + 1), generator=g)
    batch = Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    with AllocationMeter(grid.device) as meter:  # the model, optimizer, stages' buffers and two steps
        engine = Engine(spec, config, grid, micro_batch_size=1, global_batch_size=microbatches, seq_length=SEQ,
                        dtype=torch.float32, optim=OptimConfig(lr=1e-3))
        for _ in range(2):
            engine.train_step(batch)
    case = ProfileCase(spec, "tiny", config, seq_len=SEQ, micro_batch_size=1, global_batch_size=microbatches,
                       num_gpus=2, dtype="fp32")
    predicted = stage_memory(case, grid.pp_rank, device="cpu", allowance=Allowance(0.0, 0.0)).components
    result = {"peak": meter.peak, "held_by_stages": held_by_stages(engine), "predicted": predicted}
    (out / "peak").mkdir(exist_ok=True)
    (out / "peak" / f"{schedule}.m{microbatches}.stage{grid.pp_rank}.json").write_text(json.dumps(result))


def main():
    from workers.harness import run_jobs

    jobs = [(f"{s}.m{m}", partial(peak_case, s, m)) for s in SCHEDULES for m in MICROBATCHES]
    run_jobs(jobs, num_threads=1)


if __name__ == "__main__":
    main()
