"""One rank of `qlm profile --probe` for an RL case (data.kind = "rl"): the trainer's Engine with the GRPO objective
(DAPO's loss; a frozen reference when the case has one) and the rollout as train/rollout_batches.py runs it —
weight sync to each replica's leader, the leader's KV-cache decoding of its share of the completions
(rl.rollout_batch_size at a time; rl.num_generations completions of each random prompt of seq_len -
max_completion_length tokens, every completion taken to its length limit as the profile assumes, no eos), the rows
handed to the replica — then the training step on them, each row whole (the profile prices no shared prompts in
training: an upper bound of what rl.shared_prefix saves).
Reward functions are not run (random advantages); reward models are not loaded.

Beside probe_worker.py's measurements, a leader reports:
  rollout        the rollout model's bytes, plus how far the peak allocated during the weight sync and decoding
                 (the synced weights, the KV cache, the logits) rises above the training step's peak (both measured
                 the same way, measure.AllocationMeter, in the second step: the rollout model is built in the first)
  rl_times       seconds of the weight sync and of the decoding with the rows handed to the replica (a rank that
                 does not decode: its wait for them), per timed step
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from qlm_core.decode.sampling import Sampling
from qlm_core.models.gpt import GPTModel
from qlm_core.parallel.comm import group_size
from qlm_core.parallel.state import Grid
from qlm_core.profile.case import ProfileCase
from qlm_core.profile.measure import AllocationMeter
from qlm_core.train.engine import Engine
from qlm_core.train.objectives.grpo import GrpoObjective, RolloutBatch
from qlm_core.train.objectives.grpo_loss import GrpoLoss
from qlm_core.train.rollouts import RolloutConfig, generate_groups, pack_rollouts
from qlm_core.train.weight_sync import WeightSync, sync_rollout_model


def rl_engine(case: ProfileCase, grid: Grid) -> Engine:
    loss = GrpoLoss(loss_type="dapo", beta=0.04 if case.rl_reference else 0.0,
                    max_completion_length=case.rl_completion_tokens)
    return Engine(case.spec, case.parallel, grid, micro_batch_size=case.micro_batch_size,
                  global_batch_size=case.global_batch_size, seq_length=case.seq_len, dtype=case.torch_dtype,
                  seed=1234, loss_chunk_tokens=case.loss_chunk_tokens, moe=case.moe,
                  objective=GrpoObjective(loss, reference="frozen" if case.rl_reference else "batch",
                                          routing_replay=True if case.spec.moe is not None else None,
                                          shared_prefix=False))


class ProbeRollout:
    """The rollout side of the probe's RL step on one rank (a collective: every rank calls step())."""

    def __init__(self, case: ProfileCase, engine: Engine):
        self.case, self.engine, self.grid = case, engine, engine.grid
        self.grid.build_replica_groups()
        self.sync = WeightSync(engine)
        self.leader = self.grid.tp_rank == 0 and self.grid.pp_rank == 0 and self.grid.cp_rank == 0
        self.model: GPTModel | None = None
        self.rows = case.global_batch_size // self.grid.sizes.dp
        self.completion = case.rl_completion_tokens
        self.generations = case.rl_generations if self.rows % case.rl_generations == 0 else 1
        self.config = RolloutConfig(num_generations=self.generations, max_completion_length=self.completion,
                                    sampling=Sampling(temperature=1.0, seed=7 + self.grid.dp_rank),
                                    batch_rows=case.rl_batch_rows)

    def sync_weights(self) -> None:
        self.model = sync_rollout_model(self.sync, self.model, self.leader)

    def decode(self) -> RolloutBatch | None:
        if not self.leader:
            return None
        g = torch.Generator().manual_seed(100 + self.grid.dp_rank)
        prompt = self.case.seq_len - self.completion
        groups = self.rows // self.generations
        prompts = torch.randint(1, self.case.spec.vocab_size, (groups, prompt), generator=g).tolist()
        generations = generate_groups(self.model, prompts, self.config, eos_token_id=None, pad_id=0)
        rows = [p for p in prompts for _ in range(self.generations)]  # each completion's prompt
        batch = pack_rollouts(rows, generations, self.case.seq_len, pad_id=0)
        batch.advantages = torch.randn(self.rows, generator=g)
        return batch

    def share(self, batch: RolloutBatch | None) -> RolloutBatch:
        """The leader's rows on every rank of its replica."""
        if group_size(self.grid.replica_group) > 1:
            box = [batch]
            dist.broadcast_object_list(box, src=self.grid.replica_ranks[0], group=self.grid.replica_group)
            batch = box[0]
        return batch

    def model_bytes(self) -> int:
        if self.model is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values()
                   if isinstance(t, torch.Tensor))


def run_rl_rank(case: ProfileCase, steps: int, grid: Grid, engine: Engine,
                measure_first: Callable[[RolloutBatch], dict], sync: Callable[[], None],
                on_step: Callable[[int, int], None] | None = None) -> dict:
    """probe_worker.run_rank for an RL case: `measure_first(batch)` runs and measures the first training step as
    run_rank does for any case (its result dict is completed here), `sync` waits for the device. Every rank times
    the sync and the decoding (a rank that does not decode waits for its leader's rows)."""
    rollout = ProbeRollout(case, engine)
    total = 2 + max(1, steps - 2)

    def step_batch() -> RolloutBatch:
        rollout.sync_weights()
        return rollout.share(rollout.decode())

    if grid.device.type == "cuda":  # max_allocated covers the first step's rollout too
        torch.cuda.reset_peak_memory_stats(grid.device)
    result = measure_first(step_batch())
    if on_step is not None:
        on_step(1, total)
    # the second step: the training's peak, then the third's rollout's, each allocated beyond what it found on
    # entering (the training first: a block that the rollout's meter saw allocated and the training's freed would
    # count against the training)
    batch = step_batch()
    with AllocationMeter(grid.device) as training_peak:
        engine.train_step(batch)
    del batch
    with AllocationMeter(grid.device) as rollout_peak:
        rollout.sync_weights()
        batch = rollout.decode()
    batch = rollout.share(batch)
    engine.train_step(batch)
    if on_step is not None:
        on_step(2, total)
    if rollout.leader:
        result["rollout"] = rollout.model_bytes() + max(0, rollout_peak.peak - training_peak.peak)
    times, sync_s, generate_s = [], [], []
    for _ in range(total - 2):
        sync()
        start = time.perf_counter()
        rollout.sync_weights()
        sync()
        synced = time.perf_counter()
        batch = rollout.share(rollout.decode())
        sync()
        decoded = time.perf_counter()
        engine.train_step(batch)
        sync()
        times.append(time.perf_counter() - start)
        sync_s.append(synced - start)
        generate_s.append(decoded - synced)
        if on_step is not None:
            on_step(2 + len(times), total)
    result["step_times"] = times
    result["rl_times"] = {"rl_sync": sum(sync_s) / len(sync_s), "rl_generate": sum(generate_s) / len(generate_s)}
    return result
