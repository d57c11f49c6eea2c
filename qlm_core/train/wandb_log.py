"""Weights & Biases logging (logging.wandb_project; empty = off). Rank 0 only: the resolved recipe as the run's
config, each step's metrics (train/*) and the validation losses (valid/*) against the `step` metric. The wandb run's
id is kept in RUN/wandb_run_id, so a resumed qlm run continues the same wandb run. wandb is an optional extra
(`pip install "qlm[wandb]"`); WANDB_MODE=offline logs without a network (`wandb sync` uploads later)."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

from qlm_core.config import LoggingConfig
from qlm_core.disk import write_text_atomic
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
        read_run_id(Path(run_dir) / RUN_ID_FILE)  # a damaged id file is named before any process starts
        target = wandb_dir(logging, run_dir)
        for parent in (target, *target.parents):
            if parent.exists():
                if not parent.is_dir():
                    raise QlmError(f"logging.wandb_save_dir: {parent} is a file, not a directory",
                                   "set logging.wandb_save_dir to a directory (or leave it empty for RUN/wandb)")
                break


_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # what wandb generates and accepts as a run id


def read_run_id(id_file: Path) -> str | None:
    """The wandb run id a resumed run continues (None: none stored yet); a file that holds anything but an id is
    one line naming it."""
    if id_file.exists() and not id_file.is_file():
        raise QlmError(f"{id_file} is a directory, not the file that holds the wandb run id",
                       "remove it (a new wandb run is started) or put the run's id in a file of that name")
    if not id_file.is_file():
        return None
    fix = (f"write the run's wandb id into {id_file.name} (its run page's URL ends with it), or delete the file to "
           "log to a new wandb run")
    try:
        text = id_file.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        raise QlmError(f"{id_file} is not UTF-8 text, so it holds no wandb run id", fix) from None
    except OSError as exc:
        raise QlmError(f"cannot read {id_file} ({exc.strerror or exc})", "check its permissions") from None
    if not text:
        return None
    if not _RUN_ID.fullmatch(text):
        raise QlmError(f"{id_file} holds {text[:40]!r}, which is not a wandb run id (letters, digits, - and _)", fix)
    return text


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
        run_id = read_run_id(id_file)
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
            write_text_atomic(id_file, self.run.id + "\n")
        self.run.define_metric("step")
        self.run.define_metric("train/*", step_metric="step")
        self.run.define_metric("valid/*", step_metric="step")

    def log_step(self, metrics) -> None:
        if self.run is not None:
            values = {f"train/{k}": v for k, v in metrics.record().items() if k != "step"}
            self.run.log(_finite({"step": metrics.step, **values}))

    def log_eval(self, step: int, loss: float | None, figures: dict[str, float] | None = None) -> None:
        if self.run is not None:
            self.run.log(_finite({"step": step, **({"valid/loss": loss} if loss is not None else {}),
                                  **{f"valid/{k}": v for k, v in (figures or {}).items()}}))

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None
