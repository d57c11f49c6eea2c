"""Weights & Biases logging (logging.wandb_project; empty = off). Rank 0 only: the resolved recipe as the run's
config, each step's metrics (train/*) and the validation losses (valid/*) against the `step` metric. The wandb run's
id is kept in RUN/wandb_run_id, so a resumed qlm run continues the same wandb run. wandb is an optional extra
(`pip install "qlm[wandb]"`); WANDB_MODE=offline logs without a network (`wandb sync` uploads later)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from qlm_core.config import LoggingConfig
from qlm_core.errors import QlmError

RUN_ID_FILE = "wandb_run_id"
_BAD_NAME_CHARS = set("/\\#?%:")


def wandb_dir(logging: LoggingConfig, run_dir: Path) -> Path:
    return Path(logging.wandb_save_dir) if logging.wandb_save_dir else Path(run_dir) / "wandb"


def check_wandb(logging: LoggingConfig, run_dir: Path | None = None) -> None:
    """Raise QlmError when wandb logging is asked for but cannot work (package missing, a name wandb refuses, a save
    directory that is a file). Cheap: wandb is not imported."""
    if not logging.wandb_project:
        return
    for key in ("wandb_project", "wandb_entity"):
        value = getattr(logging, key)
        bad = sorted(set(value) & _BAD_NAME_CHARS)
        if bad or len(value) > 128 or value != value.strip():
            raise QlmError(f"logging.{key} = {value!r} is not a name wandb accepts"
                           + (f" (it contains {' '.join(bad)})" if bad else ""),
                           f"use at most 128 characters without {' '.join(sorted(_BAD_NAME_CHARS))} or spaces at "
                           "either end")
    try:
        missing = importlib.util.find_spec("wandb") is None
    except (ImportError, ValueError):
        missing = True
    if missing:
        raise QlmError("logging.wandb_project is set but the wandb package is not installed",
                       'pip install "qlm[wandb]" (or leave logging.wandb_project empty)')
    if run_dir is not None:
        target = wandb_dir(logging, run_dir)
        for parent in (target, *target.parents):
            if parent.exists():
                if not parent.is_dir():
                    raise QlmError(f"logging.wandb_save_dir: {parent} is a file, not a directory",
                                   "set logging.wandb_save_dir to a directory (or leave it empty for RUN/wandb)")
                break


def _finite(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not (isinstance(v, float) and not math.isfinite(v))}


class WandbLogger:
    """One wandb run per qlm run directory (resumed with the stored id)."""

    def __init__(self, logging: LoggingConfig, run_dir: Path, config: dict):
        check_wandb(logging, run_dir)
        try:
            import wandb
        except ImportError:
            raise QlmError("logging.wandb_project is set but wandb cannot be imported",
                           'pip install "qlm[wandb]" (or leave logging.wandb_project empty)') from None
        run_dir = Path(run_dir)
        save_dir = wandb_dir(logging, run_dir)
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise QlmError(f"cannot create the wandb directory {save_dir} ({exc.strerror})",
                           "set logging.wandb_save_dir to a writable directory") from None
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        try:
            self.run = wandb.init(
                project=logging.wandb_project, entity=logging.wandb_entity or None,
                name=logging.wandb_exp_name or run_dir.resolve().name, dir=str(save_dir), config=config,
                id=run_id or None, resume="allow",
            )
        except wandb.errors.Error as exc:
            raise QlmError(f"wandb could not start a run ({' '.join(str(exc).split())[:300]})",
                           "run `wandb login`, set WANDB_MODE=offline, or leave logging.wandb_project empty") from None
        if self.run is None:  # WANDB_MODE=disabled
            return
        if run_id != self.run.id:
            tmp = id_file.with_name(id_file.name + ".tmp")
            tmp.write_text(self.run.id + "\n")
            tmp.replace(id_file)
        self.run.define_metric("step")
        self.run.define_metric("train/*", step_metric="step")
        self.run.define_metric("valid/*", step_metric="step")

    def log_step(self, metrics) -> None:
        if self.run is not None:
            values = {f"train/{k}": v for k, v in metrics.record().items() if k != "step"}
            self.run.log(_finite({"step": metrics.step, **values}))

    def log_eval(self, step: int, loss: float, figures: dict[str, float] | None = None) -> None:
        if self.run is not None:
            self.run.log(_finite({"step": step, "valid/loss": loss,
                                  **{f"valid/{k}": v for k, v in (figures or {}).items()}}))

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None
