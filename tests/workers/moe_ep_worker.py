"""torchrun worker (2 ranks) for tests/parallel/test_moe_ep.py: LoRA on the MoE model at ep2 x dp2 ZeRO 1 (the adapters
are dense, the frozen routed experts divided over the EP ranks), the dispatch's plan on both ranks, and the
global-batch load-balancing loss at dp2.

    torchrun --nproc-per-node 2 tests/workers/moe_ep_worker.py OUTDIR
"""

import json
from pathlib import Path

import torch
from parallel_cases import GLOBAL_BATCH, MOE, MOE_GLOBAL_TRAINING, MOE_TRAINING, SEQ, make_batch

from qlm_core.config import LoraConfig, OptimConfig, ParallelConfig
from qlm_core.parallel.expert_dispatch import ExpertParallel, plan_dispatch
from qlm_core.parallel.state import Grid, resolve_sizes
from qlm_core.train.engine import Batch, Engine
from workers.harness import run_jobs

LORA = LoraConfig(rank=4, target_modules=["linear_qkv", "linear_fc1", "linear_fc2"])
STEPS = 3


def lora_losses(config: ParallelConfig, grid: Grid) -> list[float]:
    engine = Engine(MOE, config, grid, micro_batch_size=1, global_batch_size=GLOBAL_BATCH, seq_length=SEQ,
                    optim=OptimConfig(lr=1e-3), moe=MOE_TRAINING, lora=LORA)
    input_ids, labels, _, _ = make_batch("plain")
    rows = GLOBAL_BATCH // grid.sizes.dp
    mine = slice(grid.dp_rank * rows, (grid.dp_rank + 1) * rows)
    return [engine.train_step(Batch(input_ids[mine], labels[mine])).loss for _ in range(STEPS)]


def lora_ep2(outdir: Path):
    grid = Grid.build(resolve_sizes(2, ep=2))
    losses = lora_losses(ParallelConfig(ep=2, zero_stage=1), grid)
    if grid.rank == 0:
        (outdir / "lora_ep2.json").write_text(json.dumps(losses))


def dispatch_plan(outdir: Path):
    """ep2 x etp1 over both ranks: rank r routes r+1 pairs to each of the 4 experts (2 per rank)."""
    grid = Grid.build(resolve_sizes(2, ep=2))
    counts = torch.full((4,), grid.rank + 1, dtype=torch.long)
    plan = plan_dispatch(counts, ExpertParallel(2, 1, grid.expert_group))
    (outdir / f"plan.rank{grid.rank}.json").write_text(json.dumps({
        "input_splits": plan.input_splits, "output_splits": plan.output_splits,
        "expert_counts": plan.expert_counts, "to_expert_major": plan.to_expert_major.tolist()}))


def first_step_moe(config: ParallelConfig, grid: Grid, moe, rows: int) -> dict[str, float]:
    """The MoE figures of one step over the batch's first `rows` rows, one micro-batch per data rank."""
    engine = Engine(MOE, config, grid, micro_batch_size=rows // grid.sizes.dp, global_batch_size=rows,
                    seq_length=SEQ, moe=moe)
    input_ids, labels, _, _ = make_batch("plain")
    share = rows // grid.sizes.dp
    mine = slice(grid.dp_rank * share, (grid.dp_rank + 1) * share)
    return engine.train_step(Batch(input_ids[mine], labels[mine])).moe


def global_dp2(outdir: Path):
    grid = Grid.build(resolve_sizes(2))
    figures = first_step_moe(ParallelConfig(), grid, MOE_GLOBAL_TRAINING, rows=4)
    if grid.rank == 0:
        (outdir / "global_dp2.json").write_text(json.dumps(figures))


if __name__ == "__main__":
    run_jobs([("lora_ep2", lora_ep2), ("dispatch_plan", dispatch_plan), ("global_dp2", global_dp2)],
             timeout_s=240)
