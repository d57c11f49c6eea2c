"""RL through a recipe (data.kind = "rl"): each step's rows are the policy's own rollouts; metrics.jsonl carries TRL's
reward metrics and the train/rollout log-prob difference, evaluations score held-out prompts and write completions,
a stopped run resumes to the uninterrupted numbers (dynamic sampling's extra draws included), and bad input is one
line before the first step."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_clean_failure, metrics, qlm_train

from qlm_core.config import load_recipe
from qlm_core.train.trainer import Trainer

RECIPE = """
[model]
spec = "qlm-tiny"
dtype = "fp32"
[data]
kind = "rl"
train = ["@demo"]
seq_length = 32
cache_dir = "{cache}"
[rl]
num_generations = 4
max_completion_length = 12
eval_prompts = 8
num_completions_to_print = 3
reward_funcs = ["rl_test_rewards:odd_length"]
[train]
micro_batch_size = 8
global_batch_size = 16
train_iters = 4
eval_interval = 2
[optim]
lr = 1e-3
[schedule]
lr_schedule = "constant"
[logging]
tensorboard = false
plot = false
"""


# a random model's answers earn different rewards (exact_answer would give every one 0: no advantage, no update)
REWARDS = ("def odd_length(prompt, completion, record):\n    return float(len(completion) % 2)\n\n\n"
           "def answer_value(prompt, completion, record):\n    return float(record['answer'])\n")


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    path = root / "rl.toml"
    path.write_text(RECIPE.format(cache=root / "cache"))
    (root / "rl_test_rewards.py").write_text(REWARDS)
    return path


@pytest.fixture
def rewards_path(recipe_file, monkeypatch):
    """The reward module importable in this process and in the runs it launches."""
    monkeypatch.syspath_prepend(str(recipe_file.parent))
    monkeypatch.setenv("PYTHONPATH", str(recipe_file.parent))


def _run(recipe_file, run_dir, *overrides):
    recipe = load_recipe(recipe_file, list(overrides))
    return Trainer(recipe, run_dir).run()


def _learning(rows):
    """The runs' numbers are not a degenerate 0 everywhere: rewards differ within groups, losses and lengths vary."""
    assert any(row["reward_std"] > 0 for row in rows) and any(row["loss"] != 0 for row in rows)
    assert any(row["completions/min_length"] < row["completions/max_length"] for row in rows)


def test_an_rl_run_logs_rewards_scores_held_out_prompts_and_writes_completions(recipe_file, rewards_path, tmp_path):
    summary = _run(recipe_file, tmp_path / "run")
    rows = metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for row in rows:
        assert {"reward", "reward_std", "frac_reward_zero_std", "rewards/odd_length/mean", "completions/mean_length",
                "completions/clipped_ratio", "clip_ratio/region_mean"} <= set(row), sorted(row)
        assert row["train_rollout_logprob_abs_diff/max"] <= 1e-5  # the trainer's forward of the rollout's tokens
        assert "kl" not in row  # beta 0: no reference
        assert row["time/weight_sync_s"] >= 0 and row["time/rollout_s"] >= 0
    assert [row["samples"] for row in rows] == [16, 32, 48, 64]  # completions drawn
    _learning(rows)
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 4] and all("valid_loss" not in e for e in evals)
    assert all(0.0 <= e["valid_reward"] <= 1.0 for e in evals) and len({e["valid_reward"] for e in evals}) > 1
    assert summary["valid_reward"] == evals[-1]["valid_reward"]
    written = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert [w["step"] for w in written] == [0] * 3 + [2] * 3 + [4] * 3
    assert all(set(w) == {"step", "prompt", "completion", "reward"} for w in written)
    assert (tmp_path / "run" / "checkpoints" / "iter_0000004").is_dir()


def test_a_stopped_rl_run_resumes_to_the_uninterrupted_numbers(recipe_file, rewards_path, tmp_path):
    """With dynamic sampling a step may draw several times: the draws are the run's consumed samples, so the
    resumed run draws the same prompts at the same seeds."""
    sets = ["rl.dynamic_sampling=true", "rl.max_sampling_tries=3", "train.eval_interval=0"]
    _run(recipe_file, tmp_path / "straight", *sets)
    _run(recipe_file, tmp_path / "run", *sets, "train.exit_interval=2")
    assert len(metrics(tmp_path / "run")) == 2
    _run(recipe_file, tmp_path / "run", *sets)
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "run")
    keys = ("loss", "grad_norm", "samples", "reward", "reward_std", "dynamic_sampling/draws",
            "completions/mean_length", "completions/max_length")
    assert [[row[k] for k in keys] for row in resumed] == [[row[k] for k in keys] for row in straight]
    _learning(straight)


def test_rollout_rows_and_batch_scaled_advantages_are_the_global_batchs_across_data_parallel_ranks():
    """assemble on two data-parallel ranks, each with its own groups: the rewards are gathered, so each rank's
    advantages (scaled by the whole batch's std) and the metrics are those of one rank holding every group."""
    from qlm_core.decode.sampling import Generation
    from qlm_core.train.rewards import Rewards, RewardSource
    from qlm_core.train.rollouts import DataRanks, Groups, RolloutConfig, assemble

    g = torch.Generator().manual_seed(0)
    rows = 8
    gens = [Generation(tokens=[5] * (1 + r % 3), finish="stop", logprobs=[-1.0] * (2 + r % 3), eos_token=2)
            for r in range(rows)]
    groups = Groups([[9, 9]] * rows, [{"prompt": ""}] * rows, gens, torch.rand(rows, 1, generator=g,
                                                                             dtype=torch.float64))
    config = RolloutConfig(num_generations=2, max_completion_length=8, scale_rewards="batch")
    rewards = Rewards([RewardSource("exact_answer")])
    whole, whole_metrics = assemble(groups, config, rewards, seq_length=16, pad_id=0)
    halves = [groups.select([0, 1], 2), groups.select([2, 3], 2)]
    sent = [assemble_rows(half, config, rewards) for half in halves]  # what each rank puts in the gather
    for rank, half in enumerate(halves):
        def gather(mine, rank=rank):
            return torch.cat([mine if r == rank else sent[r] for r in range(2)])
        part, part_metrics = assemble(half, config, rewards, seq_length=16, pad_id=0,
                                      ranks=DataRanks(rank, 2, gather))
        assert torch.equal(part.advantages, whole.advantages[rank * 4:(rank + 1) * 4])
        assert part_metrics == whole_metrics
    alone, _ = assemble(halves[1], config, rewards, seq_length=16, pad_id=0)
    assert not torch.equal(alone.advantages, whole.advantages[4:])  # without the gather: its own std


def assemble_rows(groups, config, rewards) -> torch.Tensor:
    """The rows one rank puts in assemble's gather (its rewards, lengths and truncation flags)."""
    captured = []

    def gather(rows):
        captured.append(rows)
        return rows

    from qlm_core.train.rollouts import DataRanks, assemble

    assemble(groups, config, rewards, seq_length=16, pad_id=0, ranks=DataRanks(0, 1, gather))
    return captured[0]


@pytest.mark.parametrize("sets, needles", [
    (["rl.reward_funcs=['no_such_module_q:score']"], ["reward no_such_module_q:score: cannot import"]),
    (["rl.max_completion_length=30"], ["leaves no room for rl.max_completion_length 30"]),
])
def test_bad_rl_input_is_one_line_before_the_first_step(recipe_file, rewards_path, tmp_path, sets, needles):
    out = tmp_path / "run"
    result = qlm_train(recipe_file, "--output", out, *[a for s in sets for a in ("--set", s)], check=False)
    assert_clean_failure((result.returncode, result.stdout, result.stderr), out / "metrics.jsonl", *needles)


@pytest.mark.parametrize("world, sets, message", [
    (1, ["train.global_batch_size=18"], "train.global_batch_size 18 .* rl.num_generations 4"),
    (1, ["rl.reward_weights=[1.0, 2.0]"], "rl.reward_weights has 2 entries for 1"),
    (2, ["train.micro_batch_size=1", "train.global_batch_size=12"], "the step's 3 prompts .* among 2 data-parallel"),
    (1, ["lora.rank=4", "model.load=nowhere"], "RL with LoRA"),
])
def test_rl_recipe_rules_are_checked_when_the_run_is_planned(recipe_file, rewards_path, tmp_path, world, sets,
                                                             message):
    """What `qlm train` checks before any process starts (the two cases above show the line it prints)."""
    from qlm_core.errors import QlmError
    from qlm_core.train.plan import plan_run

    recipe = load_recipe(recipe_file, [*sets, f"train.output='{tmp_path / 'run'}'"])
    with pytest.raises(QlmError, match=message):
        plan_run(recipe, world)


def test_a_reward_that_returns_nan_names_itself_and_the_record(recipe_file, tmp_path):
    (tmp_path / "bad_reward_q.py").write_text("def score(prompt, completion, record):\n    return float('nan')\n")
    out = tmp_path / "run"
    result = qlm_train(recipe_file, "--output", out, "--set", "rl.reward_funcs=['bad_reward_q:score']", check=False,
                       env_extra={"PYTHONPATH": str(tmp_path)})
    assert_clean_failure((result.returncode, result.stdout, result.stderr), out / "metrics.jsonl",
                         "reward bad_reward_q:score returned NaN or infinite", "on record 0")


LAYOUT_SETS = ("train.train_iters=3", "train.eval_interval=0")


@pytest.fixture(scope="module")
def one_process_run(recipe_file, tmp_path_factory):
    """The layout tests' one-process run (in this process, once)."""
    run = tmp_path_factory.mktemp("one") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(recipe_file.parent))
        _run(recipe_file, run, *LAYOUT_SETS)
    return run


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [("parallel.tp=2", "parallel.sp=true"), ("parallel.pp=2",)])
def test_an_rl_run_at_a_model_parallel_layout_reproduces_the_one_process_run(recipe_file, rewards_path, tmp_path,
                                                                             layout, one_process_run):
    """tp2·SP or pp2 (one data-parallel rank): the replica's leader samples at the one-process seeds from weights the
    sync gathers whole, so the rollouts, rewards and losses are the one-process run's (rtol 1e-4)."""
    qlm_train(recipe_file, "--output", tmp_path / "layout", *[a for s in (*LAYOUT_SETS, *layout) for a in ("--set", s)])
    one, other = metrics(one_process_run), metrics(tmp_path / "layout")
    _learning(one)
    for a, b in zip(one, other, strict=True):
        for key in ("reward", "reward_std", "completions/mean_length", "completions/min_length",
                    "completions/max_length"):  # the same completions sampled
            assert a[key] == b[key], key
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-7)
        assert b["train_rollout_logprob_abs_diff/max"] <= 1e-5


@pytest.mark.distributed
def test_an_rl_run_on_two_data_parallel_ranks_shares_the_prompts_and_gathers_the_rewards(recipe_file, rewards_path,
                                                                                        tmp_path):
    """dp2: each rank answers half of the step's prompts, which are the one-process run's; the step's metrics are
    every completion's (a reward that is the prompt's answer, whatever the completion, has the one-process mean)."""
    sets = ["train.train_iters=2", "train.eval_interval=2", "rl.reward_funcs=['rl_test_rewards:odd_length', "
            "'rl_test_rewards:answer_value']"]
    _run(recipe_file, tmp_path / "one", *sets)
    run = tmp_path / "dp2"
    qlm_train(recipe_file, "--output", run, "--set", "parallel.dp=2", "--set", "parallel.zero_stage=1",
              *[a for s in sets for a in ("--set", s)])
    rows, one = metrics(run), metrics(tmp_path / "one")
    assert [row["samples"] for row in rows] == [16, 32]
    assert [r["rewards/answer_value/mean"] for r in rows] == [r["rewards/answer_value/mean"] for r in one]
    assert [r["rewards/answer_value/std"] for r in rows] == [r["rewards/answer_value/std"] for r in one]
    for row in rows:
        assert row["train_rollout_logprob_abs_diff/max"] <= 1e-5
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2]


def test_the_profile_counts_an_rl_leaders_rollout_model_and_kv_cache(recipe_file):
    """The memory estimate of an RL recipe: stage 0 holds the whole rollout model and, beyond the training step's
    transient memory, the KV cache and the prefill's working set of the completions decoded at once
    (rl.rollout_batch_size bounds both; here one completion a prompt, so each row prefills its own — a group's
    prompt prefilled once is tests/profile/test_profile_rl.py's); a frozen reference (rl.beta > 0) adds the
    policy's weights again; a language-model run has no rollout term."""
    from qlm_core.models.parameters import num_parameters
    from qlm_core.models.presets import PRESETS
    from qlm_core.profile.case import case_from_recipe
    from qlm_core.profile.memory import estimate_memory

    def memory(*sets, world=1):
        recipe = load_recipe(recipe_file, ["model.spec=qwen3-8b", "data.seq_length=4096", "model.dtype=bf16",
                                           "train.global_batch_size=64", "train.micro_batch_size=1",
                                           "rl.max_completion_length=8", "rl.num_generations=1", *sets])
        return estimate_memory(case_from_recipe(recipe, world), capacity_gib=1e4).stages[0].components

    model_bytes = 2 * num_parameters(PRESETS["qwen3-8b"])
    kv_row = 4096 * 36 * 2 * 8 * 128 * 2  # tokens x layers x (K, V) x groups x head dim x bf16 (+ fp32 logits)
    # the prefill of a row's prompt (4096 - 8 tokens), each token at the peak of a layer's forward: the residual,
    # the norm's output and the hidden state handed on, fc1's [gate; up], silu(gate) and the product, the new K, V
    # and their RoPE copies, in bf16
    prefill_row = 4088 * 2 * (3 * 4096 + 2 * 12288 + 2 * 12288 + 2 * (2 * 8 * 128))
    whole, bounded = memory(), memory("rl.rollout_batch_size=32")
    assert model_bytes < bounded["rollout"] < whole["rollout"]
    assert whole["rollout"] - bounded["rollout"] == pytest.approx((64 - 32) * (kv_row + 4 * 151936 + prefill_row),
                                                                  rel=1e-6)
    assert memory("rl.beta=0.04")["weights"] - whole["weights"] == pytest.approx(model_bytes, rel=0.01)
    assert memory("data.kind='sft'", "data.packing=false")["rollout"] == 0


@pytest.fixture(scope="module")
def reward_model_run(recipe_file):
    """A reward model trained 2 steps by qlm on the demo's pairs (the RL run's tokenizer and chat template)."""
    text = recipe_file.read_text()
    for old, new in (('kind = "rl"', 'kind = "reward"'), ("seq_length = 32", "seq_length = 32\npacking = false"),
                     ("train_iters = 4", "train_iters = 2"), ("eval_interval = 2", "eval_interval = 0")):
        text = text.replace(old, new)
    text = text.split("[rl]")[0] + "[train]" + text.split("[train]")[1]
    path = recipe_file.parent / "reward.toml"
    path.write_text(text)
    run = recipe_file.parent / "reward-model"
    qlm_train(path, "--output", run)
    return run


def test_a_trained_reward_model_is_a_reward_source(recipe_file, reward_model_run, rewards_path, tmp_path):
    """rl.reward_funcs naming a qlm reward-model run beside a function: its scores enter the rewards with their
    weight and are logged under the run's directory name; a language model named there is one line."""
    sets = ("rl.reward_funcs=['rl_test_rewards:odd_length', " + json.dumps(str(reward_model_run)) + "]",
            "rl.reward_weights=[1.0, 0.5]", "train.train_iters=2")
    _run(recipe_file, tmp_path / "run", *sets)
    rows = metrics(tmp_path / "run")
    for row in rows:
        scored = row["rewards/reward-model/mean"]
        assert scored != 0 and row["reward"] == pytest.approx(row["rewards/odd_length/mean"] + 0.5 * scored, abs=1e-6)
    lm = tmp_path / "lm"
    qlm_train(recipe_file, "--output", lm, "--set", "data.kind=sft", "--set", "train.train_iters=1",
              "--set", "train.eval_interval=0", "--set", "data.packing=false")
    out = tmp_path / "refused"
    result = qlm_train(recipe_file, "--output", out, "--set", f"rl.reward_funcs=[{json.dumps(str(lm))}]", check=False)
    assert_clean_failure((result.returncode, result.stdout, result.stderr), out / "metrics.jsonl",
                         "is a language model, not a reward model")


def test_the_profile_counts_a_reward_models_weights_on_each_leader(recipe_file, reward_model_run):
    from qlm_core.checkpoint.sources.open import open_checkpoint
    from qlm_core.models.parameters import num_parameters
    from qlm_core.profile.case import case_from_recipe
    from qlm_core.profile.memory import estimate_memory

    def rollout(*sets):
        case = case_from_recipe(load_recipe(recipe_file, list(sets)), num_gpus=1)
        return case, estimate_memory(case, 80.0).stages[0].components["rollout"]

    _, without = rollout()
    case, with_model = rollout("rl.reward_funcs=['exact_answer', " + json.dumps(str(reward_model_run)) + "]")
    params = num_parameters(open_checkpoint(reward_model_run).spec)
    spec = case.spec  # the policy: the reward model is it with a one-row score head for its output layer (untied)
    head = spec.hidden_size * (1 if spec.tie_word_embeddings else 1 - spec.vocab_size)
    assert case.rl_reward_model_params == params == num_parameters(spec) + head
    assert with_model - without == pytest.approx(4 * params)  # fp32
