"""What a run reports: one JSON object per step in metrics.jsonl (fixed keys), TensorBoard events when the package
is installed, and a loss-curve PNG at the end."""

from __future__ import annotations

import json
import math
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from qlm_core.disk import replace_atomically, write_text_atomic


@dataclass
class StepMetrics:
    """One line of metrics.jsonl (these names are what scripts rely on)."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    label_tokens: int  # the tokens the loss is taken on (non-ignored labels) in this step's global batch
    # (tokens_per_s counts every token the step processed, padding and prompts included)
    samples: int  # sequences consumed so far
    step_time_s: float
    s_per_sample: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    mem_peak_gb: float
    skipped: bool = False
    # CUDA only (torch keeps no allocator statistics on the CPU, where mem_peak_gb is the peak RSS): the bytes in
    # tensors after the step, and the caching allocator's peak reservation (peak reserved / mem_peak_gb - 1 is what
    # the profile's allocator allowance stands for); left out of the line when None
    mem_allocated_gb: float | None = None
    mem_reserved_gb: float | None = None
    # MoE models: moe_aux_loss and moe_z_loss (as they entered the objective), moe_load_max / moe_load_min (the
    # most and least loaded expert's share of its layer's choices over an even split); written as top-level keys
    moe: dict[str, float] | None = None
    # the objective's figures, top-level keys (TRL's names). Preference training: rewards/chosen, rewards/rejected,
    # rewards/accuracies, rewards/margins, logps/chosen, logps/rejected (and nll_loss, log_odds_ratio,
    # log_odds_chosen where the loss has them). RL: reward, reward_std, frac_reward_zero_std, rewards/<name>/mean and
    # /std, completions/mean_length (min, max, clipped_ratio), clip_ratio/..., kl (beta > 0),
    # train_rollout_logprob_abs_diff/mean and /max (dynamic_sampling/draws and /filled_groups with it), and the
    # step's seconds in time/weight_sync_s and time/rollout_s (step_time_s holds them and the training pass)
    figures: dict[str, float] | None = None

    def record(self) -> dict:
        """The metrics.jsonl line."""
        line = asdict(self)
        line.update(line.pop("moe") or {})
        line.update(line.pop("figures") or {})
        for key in DEVICE_MEMORY_KEYS:
            if line[key] is None:
                del line[key]
        return line


DEVICE_MEMORY_KEYS = ("mem_allocated_gb", "mem_reserved_gb")
COMPLETIONS_FILE = "completions.jsonl"  # RL evaluations' sampled answers (train/rollout_batches.py)


def peak_memory_gb() -> float:
    """CUDA: max allocated; CPU: the process's peak resident set."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


def device_memory_gb() -> dict[str, float]:
    """StepMetrics' mem_allocated_gb (now) and mem_reserved_gb (peak) on CUDA, in GiB; empty on the CPU."""
    if not torch.cuda.is_available():
        return {}
    return {"mem_allocated_gb": torch.cuda.memory_allocated() / 2**30,
            "mem_reserved_gb": torch.cuda.max_memory_reserved() / 2**30}


def finite(value):
    """VALUE with every NaN / inf float (also inside lists and dicts) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def strict_json(value, **kwargs) -> str:
    """Standard JSON (no bare NaN / Infinity, which strict parsers reject): non-finite floats become null."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)


def parse_log(log: Path) -> tuple[list[tuple[str, dict]], int, bool]:
    """RUN/metrics.jsonl or RUN/eval.jsonl as (line, row) pairs, the count of non-blank lines, and whether the last
    line was cut short (a run killed mid-write; left out). Any other line that is not a JSON object with a step is a
    QlmError naming the file and line (`qlm train` checks this before it starts the ranks)."""
    from qlm_core.errors import QlmError

    if not log.exists():
        return [], 0, False
    try:
        lines = log.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise QlmError(f"{log} is not UTF-8 text (offset {exc.start})",
                       "delete the damaged lines (or the file) and re-run to resume") from None
    except OSError as exc:
        raise QlmError(f"cannot read {log}: {exc.strerror or exc}", "fix its permissions and re-run") from None
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    rows, dropped_partial = [], False
    for index, (number, line) in enumerate(numbered):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError
        except ValueError:  # json.JSONDecodeError included
            if index == len(numbered) - 1:
                dropped_partial = True
                continue
            raise QlmError(f"{log} line {number} is not a JSON object with a step: {line[:60]!r}",
                           "delete that line (or the file) and re-run to resume") from None
        rows.append((line, row))
    return rows, len(numbered), dropped_partial


def _repair_log(log: Path, resumed_from: int) -> list[dict]:
    """The rows of a log (parse_log) up to step `resumed_from`, the file rewritten to them (temporary + rename)
    when that drops anything; a cut-short last line is dropped with a notice."""
    from qlm_core.errors import QlmError

    rows, count, dropped_partial = parse_log(log)
    kept = [(line, row) for line, row in rows if row["step"] <= resumed_from]
    if dropped_partial:
        print(f"note: dropped the incomplete last line of {log} (a run stopped while writing it)", file=sys.stderr,
              flush=True)
    if len(kept) != count:
        try:
            write_text_atomic(log, "".join(line + "\n" for line, _ in kept))
        except OSError as exc:
            raise QlmError(f"cannot rewrite {log}: {exc.strerror or exc}",
                           "free space or fix permissions on the run directory and re-run") from None
    return [row for _, row in kept]


class MetricsWriter:
    """Appends to RUN/metrics.jsonl and RUN/eval.jsonl and, if available, TensorBoard. A run resumed from step
    `resumed_from` continues the same files without what was logged after that step (it is about to be redone)."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, resumed_from: int = 0):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._eval_steps: set[int] = set()  # steps eval.jsonl holds: a re-run of a finished run adds no duplicate
        for log in (self.path, self.run_dir / "eval.jsonl"):
            rows = _repair_log(log, resumed_from)
            if log.name == "eval.jsonl":
                self._eval_steps = {row["step"] for row in rows}
        # an RL run's sampled completions: a fresh start's step-0 evaluation writes its block again
        _repair_log(self.run_dir / COMPLETIONS_FILE, resumed_from if resumed_from else -1)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.run_dir / "tensorboard"),
                                        purge_step=resumed_from + 1 if resumed_from else None)
            except Exception:  # noqa: BLE001 - tensorboard not installed: the JSON log is the record
                self.tb = None

    def log_step(self, metrics: StepMetrics):
        with open(self.path, "a") as fh:
            fh.write(strict_json(metrics.record()) + "\n")
        if self.tb is not None:
            for key in ("loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_device", "mfu", "mem_peak_gb",
                        *DEVICE_MEMORY_KEYS):
                if getattr(metrics, key) is not None:
                    self.tb.add_scalar(f"train/{key}", getattr(metrics, key), metrics.step)
            for key, value in (metrics.moe or {}).items():
                self.tb.add_scalar(f"train/{key}", value, metrics.step)

    def log_eval(self, step: int, loss: float | None, figures: dict[str, float] | None = None):
        """One eval.jsonl line: valid_loss (an RL run has none), and the objective's metrics as valid_<name>."""
        if step in self._eval_steps:
            return
        self._eval_steps.add(step)
        line = {"step": step, **({"valid_loss": loss} if loss is not None else {}),
                **{f"valid_{k}": v for k, v in (figures or {}).items()}}
        with open(self.run_dir / "eval.jsonl", "a") as fh:
            fh.write(strict_json(line) + "\n")
        if self.tb is not None:
            if loss is not None:
                self.tb.add_scalar("valid/loss", loss, step)
            for key, value in (figures or {}).items():
                self.tb.add_scalar(f"valid/{key}", value, step)

    def close(self):
        if self.tb is not None:
            self.tb.close()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()] if path.exists() else []


def plot_loss(run_dir: Path) -> Path | None:
    """loss.png from metrics.jsonl (and eval.jsonl) on a log y-axis (a loss falls fast, then slowly: on a linear
    axis most of a run looks flat); None when matplotlib is missing. Non-finite (null) losses are left out."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    def positive(rows, key):
        return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and r[key] > 0]

    train = positive(read_jsonl(Path(run_dir) / "metrics.jsonl"), "loss")
    valid = positive(read_jsonl(Path(run_dir) / "eval.jsonl"), "valid_loss")
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot([s for s, _ in train], [v for _, v in train], label="train loss")
    if valid:
        axis.plot([s for s, _ in valid], [v for _, v in valid], "o-", label="validation loss")
    if train or valid:
        axis.set_yscale("log")
    axis.set_xlabel("step")
    axis.set_ylabel("loss (log scale)")
    axis.legend()
    axis.grid(alpha=0.3)
    out = Path(run_dir) / "loss.png"
    figure.tight_layout()
    try:  # a full disk mid-write never leaves a truncated loss.png
        replace_atomically(out, lambda partial: figure.savefig(partial, dpi=120), keep_suffix=True)
    finally:
        plt.close(figure)
    return out
