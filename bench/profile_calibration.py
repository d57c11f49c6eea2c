"""The profile's time and memory models against published training runs (qlm_core/profile/calibration_runs.json):
a table of published vs predicted tokens/s/GPU and memory, the error statistics issue 14 targets, and a refit.

    python bench/profile_calibration.py                  # the table and the figures with the committed constants
    python bench/profile_calibration.py --fit            # least-squares refit of the constants (needs scipy)
    python bench/profile_calibration.py --fit --write    # ... and write them into qlm_core/profile/efficiency.py
    python bench/profile_calibration.py --json out.json  # the rows and figures as JSON too

The fit minimises the squared log ratio predicted / published over every run (each run weighs the same), with
the rates bounded to physical ranges. It fits per GPU family the GEMM curve (gemm_max, gemm_half) and shares the
attention-kernel, elementwise, communication and overhead constants (one kernel library, one NCCL).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from qlm_core.profile import efficiency
from qlm_core.profile.calibration import evaluate, evaluate_orderings, load_runs, statistics_of
from qlm_core.train.run_dir import write_atomic

SHARED = ("attn_fwd", "attn_bwd", "elementwise", "comm", "overlap_penalty", "step_overhead_s")
PER_FAMILY = ("gemm_max", "gemm_half")
# physical ranges: flash attention forward sustains 25-80% of peak on A100/H100, NCCL's bus bandwidth 50-90% of
# the link's, an optimizer step's fixed cost is under a second
BOUNDS = {"gemm_max": (0.3, 0.95), "gemm_half": (0.0, 4000.0), "attn_fwd": (0.25, 0.8), "attn_bwd": (0.2, 0.8),
          "elementwise": (0.0, 80.0), "comm": (0.5, 0.9), "overlap_penalty": (0.0, 0.5),
          "step_overhead_s": (0.0, 1.0)}


def _table(results) -> Table:
    table = Table(title="published vs predicted (tokens/s/GPU)", title_justify="left")
    for name in ("run", "GPUs", "layout", "published", "predicted", "ratio", "GiB", "published GiB", "fits"):
        table.add_column(name, justify="left" if name in ("run", "layout") else "right")
    for r in results:
        c = r.run.case
        ratio = f"{r.ratio:.2f}"
        if abs(r.ratio - 1) > 0.15:
            ratio = f"[yellow]{ratio}[/]"
        table.add_row(r.run.id, str(c.num_gpus), c.describe(), f"{r.run.published_tokens_per_s:,.0f}",
                      f"{r.predicted_tokens_per_s:,.0f}", ratio, f"{r.memory_gib:.1f}",
                      "" if r.run.published_memory_gib is None else f"{r.run.published_memory_gib:.1f}",
                      "yes" if r.fits else "[red]no[/]")
    return table


def _vector_to_rates(x, families):
    shared = dict(zip(SHARED, x[:len(SHARED)], strict=True))
    rates, i = {}, len(SHARED)
    for family in families:
        own = dict(zip(PER_FAMILY, x[i:i + len(PER_FAMILY)], strict=True))
        i += len(PER_FAMILY)
        rates[family] = replace(efficiency.FITTED[family], **shared, **own)
    return rates


def fit(runs):
    from scipy.optimize import least_squares

    families = sorted(efficiency.FITTED)
    start, low, high = [], [], []
    for name in SHARED:
        start.append(getattr(efficiency.FITTED["hopper"], name))
    for family in families:
        for name in PER_FAMILY:
            start.append(getattr(efficiency.FITTED[family], name))
    for name in SHARED + PER_FAMILY * len(families):
        low.append(BOUNDS[name][0])
        high.append(BOUNDS[name][1])
    start = [min(max(v, lo + 1e-9), hi - 1e-9) for v, lo, hi in zip(start, low, high, strict=True)]
    saved = dict(efficiency.FITTED)

    def residuals(x):
        efficiency.FITTED.update(_vector_to_rates(x, families))
        return [math.log(r.ratio) for r in evaluate(runs)]

    try:
        solution = least_squares(residuals, start, bounds=(low, high), x_scale="jac", diff_step=1e-3)
    finally:
        efficiency.FITTED.clear()
        efficiency.FITTED.update(saved)
    return _vector_to_rates(solution.x, families)


def _rates_source(name: str, rates) -> str:
    values = [f"{k}={round(float(v), 4)!r}" for k, v in asdict(rates).items() if k != "source"]
    half = (len(values) + 1) // 2
    return (f'    "{name}": KernelRates(\n        {", ".join(values[:half])},\n        {", ".join(values[half:])},\n'
            f'        source={rates.source!r}),')


def write_fitted(path: Path, fitted: dict, runs):
    counts = {family: sum(r.gpu.family == family for r in runs) for family in fitted}
    lines = [_rates_source(name, replace(rates, source=f"fit to {counts[name]} runs of calibration_runs.json"))
             for name, rates in sorted(fitted.items())]
    text = path.read_text()
    block = "FITTED: dict[str, KernelRates] = {\n" + "\n".join(lines) + "\n}"
    new, count = re.subn(r"FITTED: dict\[str, KernelRates\] = \{\n.*?\n\}", lambda _: block, text, flags=re.S)
    if count != 1:
        raise SystemExit(f"could not find the FITTED block in {path}")
    write_atomic(path, new)  # a killed write never leaves efficiency.py torn


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", action="store_true", help="refit the constants (scipy)")
    parser.add_argument("--write", action="store_true", help="with --fit: write them into efficiency.py")
    parser.add_argument("--json", type=Path, help="also write the rows and figures to this JSON file")
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 160))
    runs = load_runs()
    before = statistics_of(evaluate(runs))
    if args.fit:
        try:
            fitted = fit(runs)
        except ImportError:
            console.print("error: --fit needs scipy; pip install scipy", markup=False)
            return 2
        for name, rates in sorted(fitted.items()):
            console.print(_rates_source(name, rates), markup=False, highlight=False)
        efficiency.FITTED.update(fitted)
        if args.write:
            write_fitted(Path(efficiency.__file__), fitted, runs)
            console.print(f"wrote the fitted constants into {efficiency.__file__}", markup=False)
    results = evaluate(runs)
    figures = statistics_of(results)
    console.print(_table(results))
    for key, value in figures.items():
        shown = f"{value:.3f}" if isinstance(value, float) else value
        console.print(f"{key}: {shown}", markup=False, highlight=False)
    orderings = evaluate_orderings()
    table = Table(title="orderings the sources publish (ratio of tokens/s/GPU)", title_justify="left")
    for name in ("table", "change", "published", "predicted", "error"):
        table.add_column(name, justify="left" if name in ("table", "change") else "right")
    for step in orderings:
        error = f"{step.error:+.1%}"
        table.add_row(step.ordering, step.change, f"{step.published_ratio:.3f}", f"{step.predicted_ratio:.3f}",
                      error if abs(step.error) <= 0.10 else f"[yellow]{error}[/]")
    console.print(table)
    if args.fit:
        console.print(f"median |error| before the fit {before['median_abs_error']:.3f}, after "
                      f"{figures['median_abs_error']:.3f}", markup=False)
    if args.json:
        rows = [{"id": r.run.id, "published_tokens_per_s": r.run.published_tokens_per_s,
                 "predicted_tokens_per_s": r.predicted_tokens_per_s, "ratio": r.ratio, "memory_gib": r.memory_gib,
                 "published_memory_gib": r.run.published_memory_gib, "fits": r.fits, "mfu": r.mfu,
                 "megatron_mfu": r.megatron_mfu} for r in results]
        steps = [asdict(step) | {"error": step.error} for step in orderings]
        args.json.write_text(json.dumps({"figures": figures, "runs": rows, "orderings": steps}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
