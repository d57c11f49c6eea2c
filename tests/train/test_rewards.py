"""Reward sources and group-relative advantages: TRL 1.16's formulas (its nanstd, its think_format_reward), the
built-ins' answers, and every bad reward function as one line naming it and the record."""

import sys

import pytest
import torch

from qlm_core.errors import QlmError
from qlm_core.train.rewards import (
    Rewards,
    RewardSource,
    exact_answer,
    group_advantages,
    load_reward,
    math_answer,
    source_metrics,
    think_format,
)

pytest.importorskip("trl")


def _trl_advantages(per_source, weights, num_generations, scale):
    """TRL 1.16's GRPOTrainer._generate_and_score_completions, sum_then_normalize, with its own nanstd."""
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(per_source).all(dim=1)
    rewards = (per_source * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    if scale in ("group", "none"):
        std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    else:
        std = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    zero = torch.isclose(std, torch.zeros_like(std)).float().mean().item()
    return torch.nan_to_num(advantages, nan=0.0), nanstd(rewards).item(), torch.nanmean(rewards).item(), zero


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_and_metrics_equal_trl(scale):
    g = torch.Generator().manual_seed(0)
    per_source = torch.rand(12, 2, generator=g, dtype=torch.float64).round()
    per_source[4:8] = 1.0  # a group whose rewards are all equal: std 0
    per_source[9, 1] = float("nan")  # one source skips a record
    per_source[10] = float("nan")  # no source scores it: advantage 0, out of the mean
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    ours, metrics = group_advantages(per_source, weights, num_generations=4, scale=scale)
    theirs, std, mean, zero = _trl_advantages(per_source, weights, 4, scale)
    assert torch.allclose(ours, theirs, rtol=1e-12, atol=1e-12)
    assert metrics["reward_std"] == pytest.approx(std) and metrics["reward"] == pytest.approx(mean)
    assert metrics["frac_reward_zero_std"] == pytest.approx(zero)
    assert ours[10] == 0 and (scale == "batch" or torch.all(ours[4:8] == 0))


def test_think_format_is_trls():
    from trl.rewards import think_format_reward

    texts = ["<think>\nreasoning\n</think>\nanswer", "<think>\nreasoning\nanswer", "answer <think>x</think>",
             "<think>a</think><think>b</think>", "<think></think>"]
    assert [think_format("p", t, {}) for t in texts] == think_format_reward([[{"content": t}] for t in texts])


@pytest.mark.parametrize("completion, gold, expected", [
    ("so the answer is \\boxed{42}", "42", 1.0), ("\\boxed{\\frac{1}{2}} or 3", "3", 0.0),
    ("first 3, then 7", "7", 1.0), ("it is 1/2", "0.5", 1.0), ("1,234 apples", "1234", 1.0),
    ("no number", "5", 0.0), ("\\boxed{5}", "\\boxed{5}", 1.0), ("anything", "not a number", None)])
def test_math_answer(completion, gold, expected, monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # the fallback's rules, whether or not it is installed
    assert math_answer("q", completion, {"answer": gold}) == expected


def test_exact_answer_and_the_weighted_sum():
    rewards = Rewards([RewardSource("exact_answer", 2.0), RewardSource("think_format", 0.5)])
    scored = rewards.score(["a", "b"], [" 1 2 3 ", "<think>x</think>3 2 1"], [{"answer": "1 2 3"}, {"answer": "1 2 3"}])
    assert scored.tolist() == [[1.0, 0.0], [0.0, 1.0]]
    assert exact_answer("q", "x y", {"answer": "x y"}) == 1.0
    assert source_metrics(scored, rewards.names) == {"rewards/exact_answer/mean": 0.5,
                                                     "rewards/exact_answer/std": pytest.approx(2 ** -0.5),
                                                     "rewards/think_format/mean": 0.5,
                                                     "rewards/think_format/std": pytest.approx(2 ** -0.5)}


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompt, completion, record):\n    return len(completion) / 10\n"
        "def boom(prompt, completion, record):\n    if record.get('bad'):\n        raise KeyError('label')\n"
        "    return 1.0\n"
        "def nan(prompt, completion, record):\n    return float('nan')\n"
        "def text(prompt, completion, record):\n    return 'high'\n"
        "def skip(prompt, completion, record):\n    return None\n")
    (tmp_path / "broken_rewards.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("my_rewards", "broken_rewards"):
        sys.modules.pop(name, None)


def test_a_user_function_by_module_and_name(user_rewards):
    rewards = Rewards([RewardSource("my_rewards:length"), RewardSource("my_rewards:skip")])
    assert rewards.names == ["length", "skip"]
    scored = rewards.score(["p"], ["abcde"], [{}])
    assert scored[0, 0].item() == 0.5 and torch.isnan(scored[0, 1])


@pytest.mark.parametrize("name, message", [
    ("my_rewards:boom", r"reward my_rewards:boom raised KeyError: 'label' on record 1 \(prompt 'second'\)"),
    ("my_rewards:nan", r"reward my_rewards:nan returned NaN or infinite \(nan\) on record 0"),
    ("my_rewards:text", r"reward my_rewards:text returned a str \('high'\) on record 0"),
])
def test_a_bad_reward_value_is_one_line_naming_it_and_the_record(user_rewards, name, message):
    rewards = Rewards([RewardSource(name)])
    with pytest.raises(QlmError, match=message):
        rewards.score(["first", "second"], ["x", "y"], [{}, {"bad": True}])


@pytest.mark.parametrize("name, message", [
    ("my_rewards:missing", "my_rewards has no function missing"),
    ("broken_rewards:f", r"cannot import broken_rewards \(ModuleNotFoundError"),
    ("no_such_module_q:f", "cannot import no_such_module_q"),
    ("plainname", "neither a built-in, module:function nor a reward model"),
])
def test_a_reward_that_cannot_be_loaded_is_one_line(user_rewards, name, message):
    with pytest.raises(QlmError, match=message):
        load_reward(name)


def test_no_reward_or_a_bad_weight_is_one_line():
    with pytest.raises(QlmError, match="names no reward"):
        Rewards([])
    with pytest.raises(QlmError, match="weight is nan"):
        Rewards([RewardSource("exact_answer", float("nan"))])
