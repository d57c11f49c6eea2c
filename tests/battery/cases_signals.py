"""Stopping a run (SIGTERM / SIGINT, train.exit_duration_minutes), its figures and wandb logging (area `signals:`).

Most signal cases signal from inside: a sitecustomize.py on the case's PYTHONPATH wraps Engine.train_step so that
step N of rank R sends the signal to its own process mid-step (a fixed delay cannot hit a given step on a loaded
machine). Those cases carry `interrupt=(1, 0)`: signal 0 sends nothing, it marks them as interrupt cases for the
judge (a stopped run ends with its stop line, not an `error:` line). The Case.interrupt cases send the signal from
outside after a delay and accept whichever moment it lands in."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from battery.case import Case
from battery.fixtures import recipe_text

REPO = Path(__file__).resolve().parents[2]

SITECUSTOMIZE = '''
import os, signal, sys
_at = os.environ.get("QLM_TEST_SIGNAL_AT")  # STEP:SIGNAME[:RANK]
if _at:
    _step, _name, *_rank = _at.split(":")
    if not _rank or os.environ.get("RANK", "0") == _rank[0]:
        import qlm_core.train.engine as _engine
        _real, _calls = _engine.Engine.train_step, [0]

        def _train_step(self, batch, lr):
            _calls[0] += 1
            if _calls[0] == int(_step):
                os.kill(os.getpid(), getattr(signal, _name))
            return _real(self, batch, lr)
        _engine.Engine.train_step = _train_step
if os.environ.get("QLM_TEST_HIDE_WANDB"):
    class _NoWandb:
        def find_spec(self, name, path=None, target=None):
            if name == "wandb" or name.startswith("wandb."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, _NoWandb())
'''


def _site(root: Path) -> str:
    site = root / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return f"{site}:{REPO}"


def train(root: Path, fx, *sets: str, steps: int = 6, env: dict | None = None):
    """argv, env for a `steps`-step SFT run of the tiny HF fixture into root/run (no interval checkpoints)."""
    recipe = root / "recipe.toml"
    recipe.write_text(recipe_text(fx.hf(), fx.sft_jsonl() / "chat.jsonl", steps))
    argv = ["train", recipe, "--output", root / "run", "--set", "checkpoint.save_interval=0",
            "--set", f"data.cache_dir={root / 'cache'}"]
    for kv in sets:
        argv += ["--set", kv]
    return argv, {"PYTHONPATH": _site(root), "WANDB_SILENT": "true", **(env or {})}


def latest(root: Path) -> str | None:
    path = root / "run" / "checkpoints" / "latest_checkpointed_iteration.txt"
    return path.read_text().strip() if path.exists() else None


def quiet(out) -> str | None:
    for noise in ("death signal", "closing signal", "OMP_NUM_THREADS", "SignalException", "failed (exitcode"):
        if noise in out.stderr:
            return f"launcher noise {noise!r}: {out.stderr[-300:]}"
    return None


def stopped_at(signame: str, step: int, code: int | None = None):
    """Exit 128 + signal (or CODE), the one stop line naming step STEP, its checkpoint on disk, summary.stopped."""
    want = 128 + getattr(signal, signame) if code is None else code

    def check(root: Path, out) -> str | None:
        if out.code != want:
            return f"exit {out.code}, expected {want}: {out.stderr.strip()[-300:]}"
        reason = signame if signame.startswith("SIG") else "train.exit_duration_minutes"
        line = f"at step {step}; checkpoint saved to"
        lines = [line_ for line_ in out.stderr.splitlines() if line in line_]
        if len(lines) != 1 or reason not in lines[0] or "resume by re-running the same command" not in lines[0]:
            return f"no single stop line for step {step}: {out.stderr.strip()[-300:]}"
        if latest(root) != str(step):
            return f"latest checkpoint {latest(root)}, expected {step}"
        summary = json.loads((root / "run" / "summary.json").read_text())
        if summary.get("stopped", {}).get("step") != step:
            return f"summary.json stopped = {summary.get('stopped')}"
        return quiet(out)
    return check


def landed_anywhere(signame: str):
    """A signal from outside at an unknown moment: exit 128 + signal (or killed by it before the handler was
    installed, or the run finished), and if a stop line says a checkpoint was saved, it is there."""
    signum = getattr(signal, signame)

    def check(root: Path, out) -> str | None:
        if out.code not in (0, 128 + signum, -signum, 130 if signum == signal.SIGINT else -999):
            return f"exit {out.code}: {out.stderr.strip()[-300:]}"
        for line in out.stderr.splitlines():
            if "checkpoint saved to" in line:
                step = line.split(" at step ")[1].split(";")[0]
                if latest(root) != step:
                    return f"line says step {step}, latest checkpoint is {latest(root)}"
        if out.code == 0 and latest(root) != "200":
            return "exit 0 but the run did not finish"
        return quiet(out)
    return check


def one_error(*words: str, nothing_written: bool = True):
    def check(root: Path, out) -> str | None:
        missing = [w for w in words if w not in out.stderr]
        if missing:
            return f"message lacks {missing}: {out.stderr.strip()[-300:]}"
        if nothing_written and (root / "run" / "checkpoints").exists():
            return "training started anyway"
        return None
    return check


def finished_with_figures(root: Path, out) -> str | None:
    def refuse(constant):
        raise ValueError(constant)
    rows = [json.loads(line, parse_constant=refuse) for line in (root / "run" / "metrics.jsonl").read_text()
            .splitlines() if line.strip()]
    summary = json.loads((root / "run" / "summary.json").read_text(), parse_constant=refuse)
    if not all(0 < r["mfu"] <= 1 for r in rows) or not 0 < summary["mfu"] <= 1:
        return f"MFU above 1: {[r['mfu'] for r in rows]} / {summary['mfu']}"
    if abs(summary["tokens_per_s"] * summary["train_wall_s"] - summary["tokens"]) > 1e-6 * summary["tokens"]:
        return "tokens_per_s is not tokens / wall time"
    if "raised" not in summary["peak_source"]:
        return f"the raised peak is not said: {summary['peak_source']}"
    return None


def wandb_offline_logged(root: Path, out) -> str | None:
    run = root / "run"
    if not (run / "wandb_run_id").is_file():
        return "no wandb_run_id in the run directory"
    run_id = (run / "wandb_run_id").read_text().strip()
    files = list((run / "wandb").rglob(f"run-{run_id}.wandb"))
    if not files or files[0].stat().st_size < 100:
        return "no offline .wandb file"
    return None


def duration_stop(step: int):
    return stopped_at("train.exit_duration_minutes", step, code=0)


def resume_then_signal(root: Path, fx):
    fx.copy("run", root)  # root/run: 4 steps done, checkpoints at 2 and 4
    argv, env = train(root, fx, "train.train_iters=8", env={"QLM_TEST_SIGNAL_AT": "2:SIGTERM"})
    return [a if a != "checkpoint.save_interval=0" else "checkpoint.save_interval=2" for a in argv], env


MARK = (1, 0)  # see the module docstring
CASES = [
    Case("signals stop", "signals: SIGTERM mid-step 2, one rank: step finished, checkpoint 2, exit 143",
         lambda root, fx: train(root, fx, env={"QLM_TEST_SIGNAL_AT": "2:SIGTERM"}),
         check=stopped_at("SIGTERM", 2), interrupt=MARK),
    Case("signals stop", "signals: SIGINT (Ctrl-C) mid-step 3, one rank: checkpoint 3, exit 130",
         lambda root, fx: train(root, fx, env={"QLM_TEST_SIGNAL_AT": "3:SIGINT"}),
         check=stopped_at("SIGINT", 3), interrupt=MARK),
    Case("signals stop", "signals: SIGTERM mid-step 1 with checkpoint.format=torch_dist",
         lambda root, fx: train(root, fx, "checkpoint.format=torch_dist", env={"QLM_TEST_SIGNAL_AT": "1:SIGTERM"}),
         check=stopped_at("SIGTERM", 1), interrupt=MARK),
    Case("signals stop", "signals: SIGTERM on a save_interval step: one checkpoint, no duplicate save",
         lambda root, fx: train(root, fx, "checkpoint.save_interval=2", env={"QLM_TEST_SIGNAL_AT": "4:SIGTERM"}),
         check=stopped_at("SIGTERM", 4), interrupt=MARK),
    Case("signals stop", "signals: SIGTERM during the last step: the run simply completes (exit 0)",
         lambda root, fx: train(root, fx, steps=3, env={"QLM_TEST_SIGNAL_AT": "3:SIGTERM"}),
         check=lambda root, out: None if latest(root) == "3" and "stopped" not in out.stderr
         else f"latest {latest(root)}: {out.stderr[-300:]}", expect_ok=True),
    Case("signals stop", "signals: SIGTERM in a resumed run (4 steps done) stops at step 6 with checkpoint 6",
         resume_then_signal, check=stopped_at("SIGTERM", 6), interrupt=MARK),
    Case("signals stop", "signals: SIGTERM with eval_interval=1 (the signal lands before an evaluation)",
         lambda root, fx: train(root, fx, "train.eval_interval=1", env={"QLM_TEST_SIGNAL_AT": "2:SIGTERM"}),
         check=stopped_at("SIGTERM", 2), interrupt=MARK),
    Case("signals stop", "signals: SIGTERM from outside 2 s after start (start-up or setup)",
         lambda root, fx: train(root, fx, "train.train_iters=200"),
         check=landed_anywhere("SIGTERM"), interrupt=(2, signal.SIGTERM)),
    Case("signals stop", "signals: SIGINT from outside 45 s after start (setup or training)",
         lambda root, fx: train(root, fx, "train.train_iters=200"),
         check=landed_anywhere("SIGINT"), interrupt=(45, signal.SIGINT)),
    Case("signals 2 ranks", "signals: 2 ranks, SIGTERM to rank 1 only at step 2: both agree, checkpoint 2",
         lambda root, fx: train(root, fx, "parallel.dp=2", env={"QLM_TEST_SIGNAL_AT": "2:SIGTERM:1"}),
         check=stopped_at("SIGTERM", 2), interrupt=MARK, timeout=600),
    Case("signals 2 ranks", "signals: 2 ranks (tp=2), SIGINT to rank 0 only at step 3: checkpoint 3, exit 130",
         lambda root, fx: train(root, fx, "parallel.tp=2", env={"QLM_TEST_SIGNAL_AT": "3:SIGINT:0"}),
         check=stopped_at("SIGINT", 3), interrupt=MARK, timeout=600),
    Case("signals 2 ranks", "signals: 2 ranks, SIGTERM to the launcher 60 s after start: forwarded, no traceback",
         lambda root, fx: train(root, fx, "parallel.dp=2", "train.train_iters=200"),
         check=landed_anywhere("SIGTERM"), interrupt=(60, signal.SIGTERM), timeout=600),
    Case("signals duration", "signals: train.exit_duration_minutes tiny: checkpoint after step 1, exit 0",
         lambda root, fx: train(root, fx, "train.exit_duration_minutes=0.0001"),
         check=duration_stop(1), expect_ok=True),
    Case("signals duration", "signals: 2 ranks, train.exit_duration_minutes tiny: rank 0's clock, all agree",
         lambda root, fx: train(root, fx, "parallel.dp=2", "train.exit_duration_minutes=0.0001"),
         check=duration_stop(1), expect_ok=True, timeout=600),
    Case("signals figures", "signals: peak_tflops far below a step's rate: MFU <= 1, raised peak said, strict JSON",
         lambda root, fx: train(root, fx, "logging.peak_tflops=1e-9", steps=3),
         check=finished_with_figures, expect_ok=True),
    Case("signals wandb", "signals: wandb_project set, wandb not importable: one line naming the extra",
         lambda root, fx: train(root, fx, "logging.wandb_project=qlm", env={"QLM_TEST_HIDE_WANDB": "1"}),
         check=one_error('pip install "qlm[wandb]"')),
    Case("signals wandb", "signals: 2 ranks, wandb not importable: one line before any process starts",
         lambda root, fx: train(root, fx, "parallel.dp=2", "logging.wandb_project=qlm",
                                env={"QLM_TEST_HIDE_WANDB": "1"}),
         check=one_error('pip install "qlm[wandb]"')),
    Case("signals wandb", "signals: wandb_project with a slash",
         lambda root, fx: train(root, fx, "logging.wandb_project=team/proj"),
         check=one_error("logging.wandb_project", "/")),
    Case("signals wandb", "signals: wandb_entity with '#'",
         lambda root, fx: train(root, fx, "logging.wandb_project=p", "logging.wandb_entity=me#1"),
         check=one_error("logging.wandb_entity", "#")),
    Case("signals wandb", "signals: wandb_save_dir is a file",
         lambda root, fx: ((root / "afile").write_text("x"),
                           train(root, fx, "logging.wandb_project=p", f"logging.wandb_save_dir={root / 'afile'}"))[1],
         check=one_error("wandb_save_dir", "afile")),
    Case("signals wandb", "signals: wandb online with no API key and no network: one line, no hang",
         lambda root, fx: train(root, fx, "logging.wandb_project=p",
                                env={"WANDB_MODE": "online", "WANDB_API_KEY": "", "HOME": str(root),
                                     "WANDB_CONFIG_DIR": str(root / "wcfg"), "NETRC": str(root / "none")}),
         check=one_error("wandb", nothing_written=False), timeout=240),
    Case("signals wandb", "signals: wandb offline: the run's history lands in RUN/wandb, id kept for resume",
         lambda root, fx: train(root, fx, "logging.wandb_project=qlm-battery", steps=2,
                                env={"WANDB_MODE": "offline"}),
         check=wandb_offline_logged, expect_ok=True),
]
