"""Rewards for reinforcement learning and the group-relative advantages made of them.

A reward source is a Python function named in the recipe — a built-in (`exact_answer`, `math_answer`, `think_format`)
or `module:function` — called as fn(prompt, completion, record) with the record's other fields, returning a number
(or None: the function does not score this record, as in TRL), or a trained reward model named by its checkpoint
directory (reward_model_source.py), which scores a batch of rows at once. Several sources are summed with their
weights. Each is imported (a reward model opened) when the run is planned, so a name that cannot be is one line
before step 1; a function that raises, returns NaN or something that is not a number is one line naming it and the
record.

Advantages are TRL 1.16's GRPOTrainer ("sum_then_normalize"): the weighted sum r, minus its group's mean (the
`num_generations` completions of one prompt), divided by the group's std + 1e-4 (scale "group"), the batch's
(scale "batch"), or not at all (scale "none": Dr. GRPO); a completion no function scored gets advantage 0 and is left
out of the means. Metrics, TRL's names: reward, reward_std, frac_reward_zero_std, rewards/<name>/mean and /std.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qlm_core.config import ScaleRewards
from qlm_core.data.rl_prompts import user_fields
from qlm_core.errors import QlmError
from qlm_core.train.reward_model_source import RewardModelSource, is_reward_model_path

RewardFunction = Callable[[str, str, dict[str, Any]], float | None]


def exact_answer(prompt: str, completion: str, record: dict[str, Any]) -> float:
    """1.0 when the completion, stripped, is the record's `answer` (qlm's demo tasks), else 0.0."""
    return 1.0 if completion.strip() == str(record["answer"]).strip() else 0.0


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def _as_number(text: str) -> float | None:
    found = _NUMBER.findall(text.replace(",", ""))
    if not found:
        return None
    last = found[-1]
    if "/" in last:
        numerator, denominator = last.split("/")
        return float(numerator) / float(denominator) if float(denominator) else None
    return float(last)


def math_answer(prompt: str, completion: str, record: dict[str, Any]) -> float | None:
    """1.0 when the completion's answer — its last \\boxed{} or else its last number — equals the record's `answer`
    (or `solution`); with math-verify installed, its parser and verifier decide (as TRL's accuracy_reward). None
    when the gold answer holds no number (the record is not scored)."""
    gold = str(record.get("answer", record.get("solution", "")))
    try:
        from math_verify import parse, verify  # optional: pip install math-verify
    except ImportError:
        parse = None
    if parse is not None:
        gold_parsed = parse(gold)
        if not gold_parsed:
            return None
        return 1.0 if verify(gold_parsed, parse(completion)) else 0.0
    expected = _as_number(_boxed(gold) or gold)
    if expected is None:
        return None
    boxed = _boxed(completion)
    answer = _as_number(boxed if boxed is not None else completion)
    return 1.0 if answer is not None and math.isclose(answer, expected, rel_tol=1e-9, abs_tol=1e-9) else 0.0


_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format(prompt: str, completion: str, record: dict[str, Any]) -> float:
    """1.0 when the completion opens with one <think>...</think> block (TRL's think_format_reward), else 0.0."""
    return 1.0 if _THINK.match(completion) else 0.0


BUILT_IN: dict[str, RewardFunction] = {"exact_answer": exact_answer, "math_answer": math_answer,
                                       "think_format": think_format}


@dataclass(frozen=True)
class RewardSource:
    name: str  # a built-in, "module:function" or a reward model's checkpoint directory
    weight: float = 1.0


def load_reward(name: str) -> RewardFunction:
    """The function a recipe names: a built-in, or `module:function` importable from the run's Python path."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    module_name, _, function_name = name.partition(":")
    if not module_name or not function_name:
        raise QlmError(f"reward {name!r} is neither a built-in, module:function nor a reward model's directory",
                       f"use one of {', '.join(BUILT_IN)}, name a function as package.module:function, or give "
                       "the path of a reward model")
    if "" not in sys.path and os.getcwd() not in sys.path:  # `python -m` has it; the qlm script does not
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: any error while importing it is theirs to see, named
        raise QlmError(f"reward {name}: cannot import {module_name} ({type(exc).__name__}: {exc})",
                       "run qlm from the module's folder or put that folder on PYTHONPATH, and fix its import"
                       ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise QlmError(f"reward {name}: {module_name} has no function {function_name}",
                       f"define {function_name}(prompt, completion, record) in {module_name}")
    return function


class Rewards:
    """The recipe's reward sources, loaded (each import checked) when built."""

    def __init__(self, sources: Sequence[RewardSource], model_dtype: torch.dtype = torch.float32):
        if not sources:
            raise QlmError("an RL run names no reward", "add rl.reward_funcs, e.g. [\"exact_answer\"]")
        for source in sources:
            if isinstance(source.weight, bool) or not isinstance(source.weight, (int, float)) or not math.isfinite(
                    source.weight):
                raise QlmError(f"reward {source.name}'s weight is {source.weight!r}, not a finite number",
                               "give each reward a finite weight")
        self.sources = list(sources)
        self.functions = [RewardModelSource(source.name, model_dtype)
                          if source.name not in BUILT_IN and is_reward_model_path(source.name)
                          else load_reward(source.name) for source in sources]
        self.weights = torch.tensor([float(source.weight) for source in sources], dtype=torch.float64)

    @property
    def names(self) -> list[str]:
        """Each source's name in the metrics: a function's name, a reward model's directory name."""
        return [function.name if isinstance(function, RewardModelSource) else source.name.rpartition(":")[2]
                for source, function in zip(self.sources, self.functions, strict=True)]

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              records: Sequence[dict[str, Any]]) -> torch.Tensor:
        """[N, sources] rewards (float64; NaN where a function returned None)."""
        out = torch.full((len(completions), len(self.functions)), float("nan"), dtype=torch.float64)
        for column, (source, function) in enumerate(zip(self.sources, self.functions, strict=True)):
            if isinstance(function, RewardModelSource):
                out[:, column] = torch.tensor(function(prompts, completions, records), dtype=torch.float64)
                continue
            for row, (prompt, completion, record) in enumerate(zip(prompts, completions, records, strict=True)):
                try:
                    value = function(prompt, completion, user_fields(record))
                except Exception as exc:  # the user's function: its failure is named with the record
                    raise QlmError(f"reward {source.name} raised {type(exc).__name__}: {exc} on record {row} "
                                   f"(prompt {prompt[:60]!r})", "fix the reward function") from None
                if value is None:
                    continue
                if isinstance(value, bool):
                    value = float(value)
                if not isinstance(value, (int, float)) or not math.isfinite(value):
                    what = "NaN or infinite" if isinstance(value, (int, float)) else f"a {type(value).__name__}"
                    raise QlmError(f"reward {source.name} returned {what} ({value!r}) on record {row} "
                                   f"(prompt {prompt[:60]!r})", "return a finite number (or None to skip it)")
                out[row, column] = float(value)
        return out


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's nanstd: Bessel-corrected, NaN entries left out (NaN with fewer than two values)."""
    keep = dim is not None
    mean = torch.nanmean(x, dim=dim, keepdim=True) if keep else torch.nanmean(x)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keep) if keep else torch.nanmean((x - mean) ** 2)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=keep) if keep else (~torch.isnan(x)).sum()
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan"), dtype=x.dtype))
    std = torch.sqrt(variance * correction)
    return std.squeeze(dim) if keep else std


def group_advantages(per_source: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale: ScaleRewards = "group") -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages [N] of N = prompts x num_generations completions (a prompt's completions adjacent), and the
    step's reward metrics (module docstring)."""
    unscored = torch.isnan(per_source).all(dim=1)
    rewards = (per_source * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscored] = float("nan")
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    metrics = {"reward": torch.nanmean(rewards).item(), "reward_std": nanstd(rewards).item(),
               "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).double().mean().item()}
    return torch.nan_to_num(advantages, nan=0.0), metrics


def source_metrics(per_source: torch.Tensor, names: Sequence[str]) -> dict[str, float]:
    """rewards/<name>/mean and /std of each source over the completions it scored."""
    out = {}
    for column, name in enumerate(names):
        out[f"rewards/{name}/mean"] = torch.nanmean(per_source[:, column]).item()
        out[f"rewards/{name}/std"] = nanstd(per_source[:, column]).item()
    return out
