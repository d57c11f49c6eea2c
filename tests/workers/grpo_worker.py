"""torchrun worker (2 gloo ranks) for the GRPO parity checks: every case of tests/rl_cases.py runs STEPS steps of
the same rollout batch and rank 0 writes its losses and grad norms (JSON)."""

import json
from pathlib import Path

from parallel_cases import GLOBAL_BATCH, SEQ
from rl_cases import CASES, MICRO, STEPS, case_parts, rank_rows, rollout_batch

from qlm_core.config import OptimConfig, ParallelConfig
from qlm_core.parallel.state import Grid, resolve_sizes
from qlm_core.train.engine import Engine
from qlm_core.train.objectives.grpo import GrpoObjective
from workers.harness import run_jobs


def run_case(name: str, outdir: Path):
    fields, loss, reference, spec, moe, replay = case_parts(name)
    config = ParallelConfig(**fields)
    sizes = resolve_sizes(2, tp=config.tp, pp=config.pp, cp=config.cp, ep=config.ep, etp=config.etp)
    grid = Grid.build(sizes, ranks=[0, 1])
    engine = Engine(spec, config, grid, micro_batch_size=MICRO, global_batch_size=GLOBAL_BATCH, seq_length=SEQ,
                    optim=OptimConfig(lr=1e-3), seed=3, moe=moe,
                    objective=GrpoObjective(loss, reference=reference, routing_replay=replay))
    batch = rank_rows(rollout_batch(spec), grid.dp_rank, sizes.dp)
    losses, norms = [], []
    for _ in range(STEPS):
        result = engine.train_step(batch, lr=1e-3)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    if grid.rank == 0:
        (outdir / f"{name}.json").write_text(json.dumps({"losses": losses, "grad_norms": norms,
                                                         "figures": result.figures, "moe": result.moe}))


if __name__ == "__main__":
    run_jobs([(name, lambda out, name=name: run_case(name, out)) for name in CASES])
