"""Example cases (the pattern the other cases_*.py files follow)."""

from battery.case import Case

CASES = [
    Case("4 zero and negative", "train --set parallel.tp=0",
         lambda root, fx: ["train", fx.recipe(), "--set", "parallel.tp=0", "--output", root / "run"],
         check=lambda root, out: "run directory written" if (root / "run").exists() else None),
    Case("5 rich markup", "recipe path with [brackets] that does not exist",
         lambda root, fx: ["train", root / "a[b]/recipe.toml"],
         check=lambda root, out: None if "a[b]" in out.stderr else "path not shown as written"),
]
