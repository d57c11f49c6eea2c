"""model.load pinned to what a run started from. A run whose model.load is a qlm run or a Megatron checkpoint root
reads that checkpoint's latest iteration when it starts; if it resumes after the other run saved more, the latest
has moved, and the reference model (a frozen copy, precomputed log-probs, or LoRA's base with the adapters off)
would silently become the newer weights. The iteration read at the first start is recorded in RUN/model_load.json,
and a resume reads that iteration again."""

from __future__ import annotations

import json
from pathlib import Path

from qlm_core.disk import write_text_atomic
from qlm_core.errors import QlmError

PIN_FILE = "model_load.json"


def pinned_iteration(run_dir: Path, load: str) -> int | None:
    """The iteration of `load` the run in RUN started from, as recorded; None when nothing is recorded for this
    model.load (a changed model.load is the user's choice: it is read afresh)."""
    path = Path(run_dir) / PIN_FILE
    if not path.is_file():
        return None
    fix = (f"restore {path.name}, or point model.load at the iteration the run started from (e.g. "
           f"{load.rstrip('/')}/checkpoints/iter_0000100 for a qlm run)")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise QlmError(f"{path} (which iteration of model.load this run started from) is damaged", fix) from None
    except OSError as exc:
        raise QlmError(f"cannot read {path} ({exc.strerror or exc})", "check its permissions") from None
    iteration = data.get("iteration") if isinstance(data, dict) else "?"
    if not isinstance(data, dict) or not isinstance(data.get("load"), str) or not (
            iteration is None or (isinstance(iteration, int) and not isinstance(iteration, bool) and iteration >= 0)):
        raise QlmError(f"{path} (which iteration of model.load this run started from) is damaged", fix)
    return iteration if data["load"] == load else None


def record_pin(run_dir: Path, load: str, iteration: int | None):
    write_text_atomic(Path(run_dir) / PIN_FILE, json.dumps({"load": load, "iteration": iteration}) + "\n")


def pinned_error(run_dir: Path, load: str, iteration: int, exc: QlmError) -> QlmError:
    return QlmError(f"model.load {load}: iteration {iteration}, which this run started from ({Path(run_dir) / PIN_FILE}"
                    f"), cannot be read ({exc.problem})", "restore that checkpoint, or start the run over with --force")
