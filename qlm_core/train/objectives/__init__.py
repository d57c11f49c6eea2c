"""The objectives the Engine trains (train/objective.py): lm.py next-token prediction, preference.py the DPO family;
recipe.py picks a recipe's."""
