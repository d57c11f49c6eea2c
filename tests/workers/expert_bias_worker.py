"""torchrun worker (2 ranks) for tests/models/test_moe_expert_bias_parallel.py: the sigmoid-routed MoE model with expert
biases (aux-loss-free balancing) trains STEPS steps at dp2 ZeRO 1, tp2 (sp), cp2, ep2 and pp2, each writing its
losses and every MoE layer's final bias; then an ep2 run saves after SAVED steps (both formats) and a one-rank run
resumes from it, writing the losses after the save and the biases at the end.

    torchrun --nproc-per-node 2 tests/workers/expert_bias_worker.py OUTDIR
"""

import dataclasses
import json
from functools import partial
from pathlib import Path

import torch.distributed as dist
from parallel_cases import GLOBAL_BATCH, MOE, SEQ, make_batch

from qlm_core.config import MoeConfig, OptimConfig, ParallelConfig
from qlm_core.models.moe import MoELayer
from qlm_core.parallel.state import Grid, resolve_sizes
from qlm_core.train.checkpointing import TrainState, load_checkpoint, save_checkpoint
from qlm_core.train.engine import Batch, Engine

BIASED = MOE.replace(moe=dataclasses.replace(MOE.moe, score_function="sigmoid", expert_bias=True))
TRAINING = MoeConfig(aux_loss_coeff=0.01, z_loss_coeff=0.001, router_bias_update_rate=0.01)
OPTIM = OptimConfig(lr=1e-3)
STEPS, SAVED = 10, 3
LAYOUTS = {"dp2": dict(zero_stage=1), "tp2": dict(tp=2, sp=True), "cp2": dict(cp=2), "ep2": dict(ep=2),
           "pp2": dict(pp=2)}


def make_engine(world: int, parallel: dict) -> Engine | None:
    config = ParallelConfig(**parallel)
    grid = Grid.build(resolve_sizes(world, tp=config.tp, pp=config.pp, cp=config.cp, ep=config.ep),
                      ranks=list(range(world)))
    if grid is None:
        return None
    return Engine(BIASED, config, grid, micro_batch_size=2, global_batch_size=GLOBAL_BATCH, seq_length=SEQ,
                  optim=OPTIM, moe=TRAINING)


def step(engine: Engine) -> float:
    input_ids, labels, _, _ = make_batch("plain")
    rows = GLOBAL_BATCH // engine.grid.sizes.dp
    mine = slice(engine.grid.dp_rank * rows, (engine.grid.dp_rank + 1) * rows)
    loss = engine.forward_backward(Batch(input_ids[mine], labels[mine]))
    engine.update()
    return engine.global_loss(loss)


def biases(engine: Engine) -> dict[str, list[float]]:
    """Every MoE layer's bias (global layer index -> values) over the pipeline stages."""
    mine = {str(layer.mlp.layer): layer.mlp.router.expert_bias.tolist() for chunk in engine.chunks
            for layer in chunk.decoder.layers if isinstance(layer.mlp, MoELayer)}
    if engine.grid.sizes.pp == 1:
        return mine
    stages = [None] * engine.grid.sizes.pp
    dist.all_gather_object(stages, mine, group=engine.grid.pp_group)
    return {k: v for stage in stages for k, v in stage.items()}


def parity(name: str, outdir: Path):
    engine = make_engine(2, LAYOUTS[name])
    losses = [step(engine) for _ in range(STEPS)]
    found = biases(engine)
    if dist.get_rank() == 0:
        (outdir / f"{name}.json").write_text(json.dumps({"losses": losses, "biases": found}))


def checkpoint(fmt: str, job: str, outdir: Path):
    engine = make_engine(*((2, dict(ep=2)) if job == "saved" else (1, {})))
    if engine is None:
        return
    root = outdir / fmt / "checkpoints"
    if job == "saved":
        for _ in range(SAVED):
            step(engine)
        save_checkpoint(root, engine, TrainState(iteration=SAVED, consumed_samples=SAVED * GLOBAL_BATCH), 0, {}, fmt)
    else:
        load_checkpoint(root, engine)
    losses = [step(engine) for _ in range(STEPS - SAVED)]
    found = biases(engine)
    if engine.grid.rank == 0:
        (outdir / f"{fmt}.{job}.json").write_text(json.dumps({"losses": losses, "biases": found}))


def main():
    from workers.harness import run_jobs

    jobs = [(name, partial(parity, name)) for name in LAYOUTS]
    jobs += [(f"{fmt}.{job}", partial(checkpoint, fmt, job)) for fmt in ("torch", "torch_dist")
             for job in ("saved", "resumed")]
    run_jobs(jobs, timeout_s=300, num_threads=1)


if __name__ == "__main__":
    main()
