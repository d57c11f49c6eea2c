"""The objective a recipe trains (train/objective.py's seam; the Engine is given it)."""

from __future__ import annotations

from qlm_core.config import Recipe, preference_reference
from qlm_core.train.objective import Objective
from qlm_core.train.objectives.grpo import GrpoObjective
from qlm_core.train.objectives.grpo_loss import GrpoLoss
from qlm_core.train.objectives.lm import LanguageModelObjective
from qlm_core.train.objectives.preference import PreferenceObjective
from qlm_core.train.objectives.preference_loss import PreferenceLossConfig
from qlm_core.train.objectives.reward import RewardObjective


def recipe_objective(recipe: Recipe) -> Objective:
    """The objective a recipe's data kind trains."""
    if recipe.data.kind == "rl":  # the reference (beta > 0): a frozen copy of the starting weights
        return GrpoObjective(GrpoLoss.from_recipe(recipe.rl), recipe.rl.temperature, reference="frozen",
                             routing_replay=recipe.rl.routing_replay, shared_prefix=recipe.rl.shared_prefix)
    if recipe.data.kind == "reward":
        return RewardObjective(recipe.reward.center_rewards_coefficient)
    if recipe.data.kind == "preference":
        return PreferenceObjective(PreferenceLossConfig.from_recipe(recipe.preference), preference_reference(recipe))
    return LanguageModelObjective()
