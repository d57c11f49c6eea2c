"""torchrun worker (2 gloo ranks) for weight sync: each case rolls out on the synced weights and trains on it (the
trainer's log-probs against the rollout's; an MoE policy's routes recorded by the rollout and compared by the
trainer), trains one more step at its layout, then every rank builds
the whole rollout model from the trainer's shards (train/weight_sync.py); rank 0 saves it, and every rank writes
its shards as a Megatron checkpoint (the reference `qlm convert` reads)."""

import copy
import json
from pathlib import Path

import torch
from parallel_cases import GLOBAL_BATCH, MOE, MOE_TRAINING, SEQ, SPEC, make_batch

from qlm_core.checkpoint.formats.megatron.args import make_args
from qlm_core.checkpoint.formats.megatron.legacy import SHARD_FILE, iteration_dir_name, write_latest, write_shard_file
from qlm_core.config import OptimConfig, ParallelConfig
from qlm_core.decode.sampling import Sampling
from qlm_core.parallel.state import Grid, resolve_sizes
from qlm_core.train.checkpointing import legacy_shard_dir, model_states
from qlm_core.train.engine import Batch, Engine
from qlm_core.train.objectives.grpo import GrpoObjective, RolloutBatch
from qlm_core.train.objectives.grpo_loss import GrpoLoss
from qlm_core.train.objectives.lm import LanguageModelObjective
from qlm_core.train.rewards import Rewards, RewardSource
from qlm_core.train.rollouts import RolloutConfig, rollout
from qlm_core.train.weight_sync import (
    WeightSync,
    fill_rollout_model,
    gather_weights,
    rollout_model,
    sync_rollout_model,
)
from workers.harness import run_jobs

# name -> (ParallelConfig fields, MoE model?, micro-batch size)
CASES = {
    "tp2_sp": (dict(tp=2, sp=True), False, 2),
    "pp2": (dict(pp=2, pp_schedule="1f1b"), False, 2),
    "cp2": (dict(cp=2), False, 2),
    "dp2_zero3": (dict(zero_stage=3), False, 2),
    "moe_ep2": (dict(ep=2), True, 1),
    "moe_tp2_etp1": (dict(tp=2, sp=True, ep=2, etp=1), True, 1),
}


def run_case(name: str, outdir: Path):
    fields, moe, micro = CASES[name]
    config = ParallelConfig(**fields)
    sizes = resolve_sizes(2, tp=config.tp, pp=config.pp, cp=config.cp, ep=config.ep, etp=config.etp)
    grid = Grid.build(sizes, ranks=[0, 1])
    loss = GrpoLoss(loss_type="dapo", max_completion_length=8)
    engine = Engine(MOE if moe else SPEC, config, grid, micro_batch_size=micro, global_batch_size=GLOBAL_BATCH,
                    seq_length=SEQ, optim=OptimConfig(lr=1e-2), seed=1234, moe=MOE_TRAINING if moe else None,
                    objective=GrpoObjective(loss, routing_replay=True if moe else None))
    # a rollout with the synced weights (every rank the same draws), then the trainer's step on this rank's rows:
    # the trainer's log-probs of the rollout's tokens, at its layout, against the rollout's
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, SPEC.vocab_size, (5,), generator=g).tolist() for _ in range(2)]
    config_rl = RolloutConfig(num_generations=GLOBAL_BATCH // 2, max_completion_length=8,
                              sampling=Sampling(temperature=1.0, seed=3))
    batch, _ = rollout(rollout_model(engine), prompts, [{"prompt": ""}] * 2, config_rl,
                       Rewards([RewardSource("think_format")]), str, seq_length=SEQ, eos_token_id=None, pad_id=0)
    rows = GLOBAL_BATCH // sizes.dp
    mine = slice(grid.dp_rank * rows, (grid.dp_rank + 1) * rows)
    step = engine.train_step(RolloutBatch(batch.input_ids[mine], batch.labels[mine],
                                          old_logps=batch.old_logps[mine], advantages=batch.advantages[mine],
                                          routes=None if batch.routes is None else batch.routes[mine]))
    drift = step.figures["train_rollout_logprob_abs_diff/max"]
    # an MoE policy: the share of the rollout's recorded routes the trainer's own routers chose otherwise
    mismatch = step.moe["moe_route_mismatch"] if moe else None
    input_ids, labels, _, _ = make_batch("plain")  # then weights away from the init
    engine.objective = LanguageModelObjective()
    engine.train_step(Batch(input_ids[mine], labels[mine]), lr=1e-2)
    model = rollout_model(engine)
    # to the replica leaders only, in buckets of 4 KiB (many of them): the same tensors there, nothing elsewhere
    leads = gather_weights(engine, bucket_bytes=4096)
    leader = grid.tp_rank == 0 and grid.pp_rank == 0 and grid.cp_rank == 0
    same = (leads is not None) == leader
    if leads is not None:
        refilled = fill_rollout_model(engine, leads, copy.deepcopy(model)).state_dict()
        same = same and all(torch.equal(refilled[k], v) for k, v in model.state_dict().items()
                            if isinstance(v, torch.Tensor))
    # streamed: each bucket of 4 KiB refills a model shell as it arrives, nothing else kept: the same tensors
    shell = sync_rollout_model(WeightSync(engine, bucket_bytes=4096), None, leader)  # the run's sync
    if leader:
        streamed = shell.state_dict()
        same = same and all(torch.equal(streamed[k], v) for k, v in model.state_dict().items()
                            if isinstance(v, torch.Tensor))
    agree = torch.tensor([int(same)])
    torch.distributed.all_reduce(agree, op=torch.distributed.ReduceOp.MIN)
    states = model_states(engine)
    rank_dir = legacy_shard_dir(grid, sizes.pp)
    if rank_dir is not None:
        root = outdir / name
        write_shard_file(root / iteration_dir_name(None) / rank_dir / SHARD_FILE, states,
                         make_args(engine.layout, torch.float32), None)
        if grid.rank == 0:
            write_latest(root, None)
    if grid.rank == 0:
        torch.save({k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
                   outdir / f"{name}.rollout.pt")
        (outdir / f"{name}.json").write_text(json.dumps({"train_rollout_logprob_abs_diff/max": drift,
                                                         "moe_route_mismatch": mismatch,
                                                         "leaders_bucketed_equal": bool(agree.item())}))


if __name__ == "__main__":
    run_jobs([(name, lambda out, name=name: run_case(name, out)) for name in CASES])
