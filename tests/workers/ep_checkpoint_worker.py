"""torchrun worker (4 ranks) for tests/checkpoint/test_ep_checkpoint.py: an MoE run at tp2 (sp) x ep2 (etp 2)
trains, saves a
checkpoint after SAVED steps and trains on; the same checkpoint resumed at ep1 x tp1 (one rank) and at ep4 trains
the remaining steps. Per format (torch, torch_dist) and job, OUTDIR/{job}.json holds the losses after the save.

    torchrun --nproc-per-node 4 tests/workers/ep_checkpoint_worker.py OUTDIR
"""

import json
from functools import partial
from pathlib import Path

from parallel_cases import GLOBAL_BATCH, MOE, MOE_TRAINING, SEQ, make_batch

from qlm_core.config import OptimConfig, ParallelConfig
from qlm_core.parallel.state import Grid, resolve_sizes
from qlm_core.train.checkpointing import TrainState, load_checkpoint, save_checkpoint
from qlm_core.train.engine import Batch, Engine

OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
SAVED, AFTER = 2, 2  # steps before the save, steps after it
LAYOUTS = {  # job -> (world, [parallel])
    "saved": (4, dict(tp=2, sp=True, ep=2)),
    "ep1": (1, dict()),
    "ep4": (4, dict(ep=4)),
}


def _engine(world: int, parallel: dict) -> Engine | None:
    config = ParallelConfig(**parallel)
    sizes = resolve_sizes(world, tp=config.tp, ep=config.ep, etp=config.etp)
    grid = Grid.build(sizes, ranks=list(range(world)))
    if grid is None:
        return None
    return Engine(MOE, config, grid, micro_batch_size=1, global_batch_size=GLOBAL_BATCH, seq_length=SEQ,
                  optim=OPTIM, seed=1234, moe=MOE_TRAINING)


def _step(engine: Engine) -> float:
    input_ids, labels, _, _ = make_batch("moe")
    rows = GLOBAL_BATCH // engine.grid.sizes.dp
    mine = slice(engine.grid.dp_rank * rows, (engine.grid.dp_rank + 1) * rows)
    loss = engine.forward_backward(Batch(input_ids[mine], labels[mine], None, None))
    engine.update()
    return engine.global_loss(loss)


def run(fmt: str, job: str, outdir: Path):
    engine = _engine(*LAYOUTS[job])
    if engine is None:
        return
    root = outdir / fmt / "checkpoints"
    if job == "saved":
        for _ in range(SAVED):
            _step(engine)
        save_checkpoint(root, engine, TrainState(iteration=SAVED, consumed_samples=SAVED * GLOBAL_BATCH), 0, {},
                        fmt)
        resumed_from = SAVED
    else:
        state, _ = load_checkpoint(root, engine)
        resumed_from = state.iteration
    losses = [_step(engine) for _ in range(AFTER)]
    if engine.grid.rank == 0:
        result = {"losses": losses, "resumed_from": resumed_from}
        (outdir / f"{fmt}.{job}.json").write_text(json.dumps(result))


def main():
    from workers.harness import run_jobs

    run_jobs([(f"{fmt}.{job}", partial(run, fmt, job)) for fmt in ("torch", "torch_dist") for job in LAYOUTS],
             timeout_s=240, num_threads=1)


if __name__ == "__main__":
    main()
