"""What a run reports: one JSON object per step in metrics.jsonl (fixed keys), TensorBoard events when the package
is installed, and a loss-curve PNG at the end."""

from __future__ import annotations

import json
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass
class StepMetrics:
    """One line of metrics.jsonl (these names are what scripts rely on)."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int  # non-ignored label tokens in this step's global batch
    samples: int  # sequences consumed so far
    step_time_s: float
    s_per_sample: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    mem_peak_gb: float
    skipped: bool = False


def peak_memory_gb() -> float:
    """CUDA: max allocated; CPU: the process's peak resident set."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


class MetricsWriter:
    """Appends to RUN/metrics.jsonl and RUN/eval.jsonl and, if available, TensorBoard. A run resumed from step
    `resumed_from` continues the same files without what was logged after that step (it is about to be redone)."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, resumed_from: int = 0):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        for log in (self.path, self.run_dir / "eval.jsonl"):
            if log.exists():
                lines = [line for line in log.read_text().splitlines() if line]
                kept = [line for line in lines if json.loads(line)["step"] <= resumed_from]
                log.write_text("".join(line + "\n" for line in kept))
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
            fh.write(json.dumps(asdict(metrics)) + "\n")
        if self.tb is not None:
            for key in ("loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_device", "mfu", "mem_peak_gb"):
                self.tb.add_scalar(f"train/{key}", getattr(metrics, key), metrics.step)

    def log_eval(self, step: int, loss: float):
        with open(self.run_dir / "eval.jsonl", "a") as fh:
            fh.write(json.dumps({"step": step, "valid_loss": loss}) + "\n")
        if self.tb is not None:
            self.tb.add_scalar("valid/loss", loss, step)

    def close(self):
        if self.tb is not None:
            self.tb.close()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()] if path.exists() else []


def plot_loss(run_dir: Path) -> Path | None:
    """loss.png from metrics.jsonl (and eval.jsonl); None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train = read_jsonl(Path(run_dir) / "metrics.jsonl")
    valid = read_jsonl(Path(run_dir) / "eval.jsonl")
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if valid:
        axis.plot([r["step"] for r in valid], [r["valid_loss"] for r in valid], "o-", label="validation loss")
    axis.set_xlabel("step")
    axis.set_ylabel("loss")
    axis.legend()
    axis.grid(alpha=0.3)
    out = Path(run_dir) / "loss.png"
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out
