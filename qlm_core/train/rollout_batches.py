"""The batch source of an RL run (data.kind = "rl"): every step's rows are rollouts of the policy's current weights.

Each step, on every rank together:
1. weight sync: the trainer's shards, whatever the layout, become one whole model on each model replica's leader
   (tp = pp = cp = 0 of its data-parallel rank; weight_sync.py);
2. the leader draws its data-parallel rank's share of the step's prompts — train.global_batch_size /
   rl.num_generations of them, in a seeded order per epoch — answers each rl.num_generations times with KV-cache
   decoding at the sampling seed of (train.seed, the run's draw, the data-parallel rank), scores the answers and
   hands the groups to the replica's other ranks (one broadcast);
3. the rewards of every data-parallel rank are gathered, so that advantages scaled by the batch and the step's
   metrics are the global batch's; each rank packs its rows (rollouts.assemble).
With rl.dynamic_sampling every data-parallel rank draws in step until each holds its share of groups that carry a
signal (rollouts.collect_groups). What a step drew is a count of prompts: it is the run's consumed_samples (in
completions) and numbers the draws, which seed the sampling: a run resumed at the same data-parallel size draws the
same prompts at the same seeds as an uninterrupted one (another size shares the prompts and seeds out otherwise).

Evaluation (train.eval_interval) answers rl.eval_prompts held-out prompts once each at the rollout's sampling, with
a fixed seed, and reports their mean reward; the first rl.num_completions_to_print answers go to
RUN/completions.jsonl."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from qlm_core.config import Recipe
from qlm_core.data.loader import GlobalBatchSampler
from qlm_core.data.rl_prompts import PromptSet, prompts_template
from qlm_core.data.tokenizer import load_tokenizer
from qlm_core.decode.prompts import answer_text, stop_tokens
from qlm_core.decode.sampling import MAX_SEED, Sampling
from qlm_core.dtypes import DTYPES
from qlm_core.models.gpt import GPTModel
from qlm_core.parallel.comm import group_size
from qlm_core.train.engine import Engine
from qlm_core.train.metrics import COMPLETIONS_FILE
from qlm_core.train.objectives.grpo import RolloutBatch
from qlm_core.train.rewards import Rewards, RewardSource, source_metrics
from qlm_core.train.rollouts import (
    DataRanks,
    Groups,
    RolloutConfig,
    assemble,
    collect_groups,
    sample_groups,
    trained_tokens,
)
from qlm_core.train.weight_sync import WeightSync, sync_rollout_model


def rollout_config(recipe: Recipe) -> RolloutConfig:
    rl = recipe.rl
    return RolloutConfig(
        num_generations=rl.num_generations, max_completion_length=rl.max_completion_length,
        sampling=Sampling(temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k, seed=recipe.train.seed),
        scale_rewards=rl.scale_rewards, overlong_filter=rl.mask_truncated_completions,
        overlong_buffer=rl.overlong_buffer, overlong_penalty_factor=rl.overlong_penalty_factor,
        max_sampling_tries=rl.max_sampling_tries if rl.dynamic_sampling else 1, batch_rows=rl.rollout_batch_size)


def recipe_rewards(recipe: Recipe) -> Rewards:
    """rl.reward_funcs with rl.reward_weights (default 1 each; their count checked by validate_rl), every
    function imported and every reward model opened now (its weights read in model.dtype at its first score)."""
    rl = recipe.rl
    weights = rl.reward_weights or [1.0] * len(rl.reward_funcs)
    return Rewards([RewardSource(name, weight) for name, weight in zip(rl.reward_funcs, weights, strict=True)],
                   model_dtype=DTYPES[recipe.model.dtype])


class RolloutBatches:
    def __init__(self, recipe: Recipe, engine: Engine, train: PromptSet, valid: PromptSet | None,
                 tokenizer_dir: Path, run_dir: Path):
        self.recipe, self.engine, self.grid = recipe, engine, engine.grid
        self.train, self.valid, self.run_dir = train, valid, Path(run_dir)
        self.config = rollout_config(recipe)
        self.rewards = recipe_rewards(recipe)
        self.tokenizer = load_tokenizer(tokenizer_dir)
        template = prompts_template(self.tokenizer, recipe.data.chat_template or None)
        self.stops = stop_tokens(self.tokenizer, template, [tokenizer_dir])
        self.eos_ids = sorted(self.stops.ids)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.prompts_per_step = recipe.train.global_batch_size // self.config.num_generations
        self.grid.build_replica_groups()  # every rank builds the source: the collective's place
        self.dp, self.dp_rank = self.grid.sizes.dp, self.grid.dp_rank
        self.share = self.prompts_per_step // self.dp  # this data-parallel rank's prompts of a draw
        # the prompts' order: a seeded permutation per epoch (positions past one epoch wrap into the next)
        self.order = GlobalBatchSampler(len(train), self.prompts_per_step, seed=recipe.train.seed, shuffle=True)
        self.leader = self.grid.replica_ranks[0]  # a global rank (broadcast's src)
        self.is_leader = self.grid.tp_rank == 0 and self.grid.pp_rank == 0 and self.grid.cp_rank == 0
        self.sync = WeightSync(engine)
        self.metrics: dict[str, float] = {}  # the last step's rollout metrics
        self._rollout: GPTModel | None = None
        self.drawn = 0  # prompts drawn so far (every rank's)

    # -- collectives over the replica and the data-parallel ranks ------------------------------------------------
    def _from_leader(self, value):
        """The replica leader's `value` on every rank of the replica."""
        if group_size(self.grid.replica_group) == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=self.leader, group=self.grid.replica_group)
        return box[0]

    def _gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        if group_size(self.grid.dp_group) == 1:
            return rows
        everyone: list = [None] * self.dp
        dist.all_gather_object(everyone, rows, group=self.grid.dp_group)
        return torch.cat(everyone)

    def _all_done(self, done: bool) -> bool:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return done
        flag = torch.tensor([0 if done else 1], dtype=torch.int64, device=self.grid.device)
        dist.all_reduce(flag)  # the default group: every rank draws in step
        return flag.item() == 0

    # -- one step ---------------------------------------------------------------------------------------------------
    def _model(self, builds: bool | None = None) -> GPTModel | None:
        """The policy's current weights as one whole model on the ranks that `builds` (default: the replica
        leaders; None elsewhere), filled bucket by bucket as the sync brings them (the model is built once, then
        refilled: never a second whole copy). A collective: every rank calls it."""
        builds = self.is_leader if builds is None else builds
        model = sync_rollout_model(self.sync, self._rollout, builds)
        if model is not None:  # built once, then refilled
            self._rollout = model
        return model

    def _text(self, tokens: list[int]) -> str:
        return answer_text(self.tokenizer, tokens, self.stops)

    def _sample(self, model: GPTModel | None, prompts: PromptSet, seed: int) -> Groups:
        """The groups of `prompts`, sampled and scored on the leader, on every rank of the replica."""
        groups = None
        if model is not None:
            config = replace(self.config, sampling=replace(self.config.sampling, seed=seed % MAX_SEED))
            groups = sample_groups(model, prompts.ids, prompts.records, config, self.rewards, self._text,
                                   seq_length=self.recipe.data.seq_length, eos_token_id=self.eos_ids,
                                   pad_id=self.pad_id)
        return self._from_leader(groups)

    def _draw(self, draw: int) -> PromptSet:
        """This data-parallel rank's prompts of the run's `draw`-th draw."""
        first = draw * self.prompts_per_step + self.dp_rank * self.share
        return self.train.subset([self.order.sample_index(p) for p in range(first, first + self.share)])

    def _step(self) -> RolloutBatch:
        started = time.perf_counter()
        model = self._model()
        synced = time.perf_counter()
        first_draw = self.drawn // self.prompts_per_step

        def sample(attempt: int) -> Groups:  # each draw of each data-parallel rank its own seed
            draw = first_draw + attempt
            return self._sample(model, self._draw(draw), self.recipe.train.seed + draw * self.dp + self.dp_rank)

        groups, counts = collect_groups(sample, self.share, self.config, self.rewards, agree=self._all_done)
        self.drawn += int(counts["dynamic_sampling/draws"]) * self.prompts_per_step
        ranks = DataRanks(self.dp_rank, self.dp, self._gather_rows)
        batch, metrics = assemble(groups, self.config, self.rewards, seq_length=self.recipe.data.seq_length,
                                  pad_id=self.pad_id, ranks=ranks)
        if self.recipe.rl.dynamic_sampling:  # the draws are every rank's; the groups filled are summed over them
            counts["dynamic_sampling/filled_groups"] = self._gather_rows(
                torch.tensor([[counts["dynamic_sampling/filled_groups"]]])).sum().item()
            metrics.update(counts)
        # where a step's time goes beside the training pass (rank 0's clock): the weight sync, and the sampling
        # and scoring of the rollouts (the replica's other ranks wait in it)
        metrics.update({"time/weight_sync_s": synced - started, "time/rollout_s": time.perf_counter() - synced})
        self.metrics = metrics
        return batch

    # -- BatchSource ----------------------------------------------------------------------------------------------
    def batches(self, split: str, consumed: int) -> Iterator[RolloutBatch]:
        """The training rows of each step from `consumed` completions on (the valid split is scored by evaluate)."""
        if split != "train":
            raise ValueError("an RL run's validation is evaluate(), not a batch stream")
        self.drawn = consumed // self.config.num_generations
        while True:
            yield self._step()

    def consumed_after_step(self, consumed: int) -> int:
        """The completions drawn so far, dynamic sampling's extra draws included (the run's consumed_samples)."""
        return self.drawn * self.config.num_generations

    # -- evaluation -------------------------------------------------------------------------------------------------
    def evaluate(self, step: int) -> dict[str, float] | None:
        """The held-out prompts' mean reward (each answered once, at the rollout's sampling and a fixed seed), and
        rank 0 writes the first answers to RUN/completions.jsonl. A collective: every rank calls it."""
        if self.valid is None:
            return None
        model = self._model(builds=self.grid.rank == 0)
        figures = None
        if self.grid.rank == 0:
            prompts = self.valid.subset(range(min(self.recipe.rl.eval_prompts, len(self.valid))))
            config = replace(self.config, num_generations=1)
            groups = sample_groups(model, prompts.ids, prompts.records, config, self.rewards, self._text,
                                   seq_length=self.recipe.data.seq_length, eos_token_id=self.eos_ids,
                                   pad_id=self.pad_id, record_routes=False)  # scored, not trained on
            totals = (groups.per_source * self.rewards.weights).nansum(dim=1)
            lengths = torch.tensor([len(trained_tokens(g)) for g in groups.generations], dtype=torch.float64)
            figures = {"reward": totals.mean().item(), **source_metrics(groups.per_source, self.rewards.names),
                       "completions/mean_length": lengths.mean().item()}
            self._write_completions(step, groups, totals)
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [figures]
            dist.broadcast_object_list(box, src=0)
            figures = box[0]
        return figures

    def _write_completions(self, step: int, groups: Groups, totals: torch.Tensor):
        count = self.recipe.rl.num_completions_to_print
        if count == 0:
            return
        lines = [json.dumps({"step": step, "prompt": groups.records[row].get("prompt", ""),
                             "completion": self._text(groups.generations[row].tokens), "reward": totals[row].item()},
                            ensure_ascii=False) + "\n" for row in range(min(count, len(groups.generations)))]
        with open(self.run_dir / COMPLETIONS_FILE, "a", encoding="utf-8") as out:  # one write: whole lines only
            out.write("".join(lines))
