"""The CLI surface (qlm issue 13): help and user text shown as written, usage errors as one line, eval and profile
refusing bad numbers and unwritable outputs before any work, `--model` announcing its resolved case."""

from __future__ import annotations

import errno
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from qlm_core.errors import QlmError

REPO = Path(__file__).resolve().parents[2]


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "; " in lines[0], err
    return lines[0]


def command_paths():
    from qlm_cli.main import command

    def walk(cmd, path):
        yield path, cmd
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, [*path, name])

    return list(walk(command(), []))


def test_every_help_shows_brackets_as_written(run_qlm):
    """Typer renders help as Rich markup: `[model] [parallel] ...` used to vanish from `qlm train --help`."""
    from typer.main import get_command

    from qlm_cli.main import app

    raw = {tuple(path): cmd for path, cmd in _walk_raw(get_command(app), [])}
    checked = 0
    for path, _ in command_paths():
        code, out, err = run_qlm(*path, "--help")
        assert code == 0, err
        flat = " ".join(out.replace("│", " ").split())
        cmd = raw[tuple(path)]
        texts = [cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params]
        for token in {t for text in texts for t in re.findall(r"\[[^\]\s]+\]", text)}:
            assert token in flat, (path, token)
            checked += 1
    assert checked >= 9  # the recipe sections of `qlm train --help` at least


def _walk_raw(cmd, path):
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _walk_raw(sub, [*path, name])


@pytest.mark.parametrize("args,expected", [
    (["eval", "x"], "Missing option '--tasks'; run 'qlm eval --help'"),
    (["profile", "--tp", "x"], "Invalid value for '--tp'"),
    (["profile", "--recompute", "most"], "'most' is not one of"),
    (["convert", "hf2mcore", "--bogus"], "No such option: --bogus"),
    (["bogus"], "No such command 'bogus'; run 'qlm --help'"),
])
def test_usage_errors_are_one_line_with_exit_2(run_qlm, args, expected):
    code, _, err = run_qlm(*args)
    assert code == 2 and expected in one_error_line(err), err
    assert "╭" not in err


def test_progress_bar_shows_names_as_written(monkeypatch):
    from rich.text import Text

    from qlm_cli import render

    seen = {}

    class FakeProgress:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def add_task(self, description, **fields):
            seen["description"] = description

        def update(self, task, **fields):
            seen.update(fields)

    monkeypatch.setattr(render, "Progress", FakeProgress)
    monkeypatch.setattr(render.err_console, "_force_terminal", True)  # the bar is drawn on terminals only
    with render.progress_bar("conv[red]x") as report:
        report(1, 2, "layers.[bold]0")
    assert Text.from_markup(seen["description"]).plain == "conv[red]x"
    assert Text.from_markup(seen["what"]).plain == "layers.[bold]0"


# ---- eval ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("limit", ["0", "-1", "2.5"])
def test_eval_limit_out_of_range_is_refused_before_any_work(run_qlm, tmp_path, limit):
    code, _, err = run_qlm("eval", tmp_path, "--tasks", "qlm_demo_mc", "--limit", limit)
    assert code == 2 and f"--limit {limit}" in one_error_line(err) and "(0, 1)" in err


def test_eval_output_on_a_file_or_unwritable_is_refused_before_any_work(run_qlm, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    code, _, err = run_qlm("eval", tmp_path, "--tasks", "qlm_demo_mc", "--output", tmp_path / "file")
    assert code == 2 and "is a file, not a folder" in one_error_line(err)
    real = Path.write_bytes

    def denied(self, data):
        if self.name.startswith(".qlm-write-check"):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", denied)
    code, _, err = run_qlm("eval", tmp_path, "--tasks", "qlm_demo_mc", "--output", tmp_path / "ro")
    assert code == 2 and "cannot write to --output" in one_error_line(err) and "Permission denied" in err


def test_eval_without_lm_eval_names_the_extra(run_qlm, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    code, _, err = run_qlm("eval", tmp_path, "--tasks", "qlm_demo_mc")
    assert code == 2 and 'pip install -e ".[eval]"' in one_error_line(err) and "lm_eval" in err


def test_eval_hf_backend_without_accelerate_names_the_extra(run_qlm, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)
    code, _, err = run_qlm("eval", tmp_path, "--tasks", "qlm_demo_mc", "--backend", "hf")
    assert code == 2 and "accelerate" in one_error_line(err) and ".[eval]" in err


def test_eval_extra_brings_accelerate():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("accelerate") for d in extras["eval"])


def test_eval_results_go_under_the_model_name_not_none(tmp_path):
    pytest.importorskip("lm_eval")
    from qlm_core.eval.runner import EvalConfig, save_results

    config = EvalConfig(checkpoint="runs/tiny-sft", tasks=["qlm_demo_mc"], output=str(tmp_path / "out"))
    written = save_results({"results": {}, "configs": {}, "versions": {}}, config)
    assert written.parent == tmp_path / "out" / "runs__tiny-sft" and written.is_file()
    assert not (tmp_path / "out" / "None").exists()


def test_eval_opens_an_iteration_directory_and_passes_iteration(tmp_path, monkeypatch):
    from qlm_core.checkpoint.sources import megatron_format
    from qlm_core.checkpoint.sources import open as opening
    from qlm_core.eval.runner import EvalConfig, worker_argv

    calls = []

    class Opened(Exception):
        pass

    def record(root, iteration, config):
        calls.append((root, iteration))
        raise Opened

    monkeypatch.setattr(megatron_format, "open_megatron_with", record)
    root = tmp_path / "run" / "checkpoints"
    (root / "iter_0000004" / "mp_rank_00").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    for path, iteration in ((root / "iter_0000004", None), (tmp_path / "run", 4)):
        with pytest.raises(Opened):
            opening.open_checkpoint(path, iteration)
    assert calls == [(root, 4), (root, 4)]
    with pytest.raises(QlmError, match="is iteration 4, not 2"):
        opening.open_checkpoint(root / "iter_0000004", 2)
    argv = worker_argv(EvalConfig(checkpoint="r", tasks=["t"], iteration=4))
    assert argv[argv.index("--iteration") + 1] == "4"


def test_demo_ppl_task_declares_every_metric_field(tmp_path):
    """lm-eval warned 6 times that qlm_demo_ppl's metrics had no aggregation / higher_is_better."""
    import yaml

    from qlm_core.eval.tasks import _YAML

    task = yaml.safe_load(_YAML["qlm_demo_ppl"].format(data="x.jsonl", prompt=""))
    assert all({"aggregation", "higher_is_better"} <= set(m) for m in task["metric_list"])


def test_lm_eval_git_hash_prints_nothing(tmp_path, monkeypatch, capfd):
    """Outside a repository lm-eval's own git call prints `fatal: not a git repository`; qlm's replaces it."""
    import lm_eval.evaluator

    from qlm_core.eval.runner import _git_hash_quietly, _quiet_libraries

    monkeypatch.setattr(lm_eval.evaluator, "get_git_commit_hash", lm_eval.evaluator.get_git_commit_hash)
    _quiet_libraries()
    assert lm_eval.evaluator.get_git_commit_hash is _git_hash_quietly
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    lm_eval.evaluator.get_git_commit_hash()
    assert "fatal" not in capfd.readouterr().err


# ---- profile -------------------------------------------------------------------------------------------------------

def test_profile_model_resolves_its_own_smallest_layout(run_qlm):
    """--model used to keep the seed's cp 4 on 32 GPUs, unannounced."""
    code, out, err = run_qlm("profile", "--model", "llama3-8b", "--seq-len", "8192")
    assert code == 0, err
    first = out.splitlines()[0]
    assert first.startswith("resolved case: llama3-8b, seq 8192") and "smallest layout that fits" in first
    assert " on 2 x a100-80g" in first and "on 32 x" not in out and "cp4" not in out


def test_profile_model_with_a_layout_option_keeps_no_seed_layout():
    from qlm_core.profile.case import build_case

    case = build_case(model="llama3-8b", tp=2)
    assert (case.parallel.cp, case.num_gpus, case.parallel.recompute) == (1, 2, "none")


def test_search_note_does_not_claim_every_layout_ooms_when_some_fit():
    """The note used to say `recompute none: every layout OOMs` above a top list of `none` layouts (with CP) that
    fit: it only looked at the layouts without CP."""
    from qlm_core.profile.search import explain_full_sequence

    def candidate(cp, mode, gib):
        parts = {"activations": gib * 2**30, "allocator": 0.0}
        return SimpleNamespace(
            case=SimpleNamespace(parallel=SimpleNamespace(cp=cp, recompute=mode), describe=lambda: f"cp{cp} {mode}"),
            memory=SimpleNamespace(total_gib=gib, capacity_gib=80.0, headroom_gib=80.0 - gib,
                                   heaviest=SimpleNamespace(components=parts, activation_per_layer=2**30)),
            oom_by_gib=max(0.0, gib - 80.0), s_per_sample=1.0)

    fitting = [candidate(4, "none", 70.0)]
    notes = explain_full_sequence(fitting, [candidate(1, "none", 90.0), candidate(1, "selective", 95.0)], 131072)
    none_note = next(n for n in notes if n.startswith("recompute none:"))
    assert "every layout OOMs" not in none_note and "without CP" in none_note
    selective_note = next(n for n in notes if n.startswith("recompute selective:"))
    assert "every layout OOMs" in selective_note  # true: no selective layout fits at all


@pytest.mark.parametrize("args,expected", [
    (["--plot", "FILE/mem.png"], "is a file, not a folder"),
    (["--plot", "mem.txt"], "has no image suffix"),
    (["--allocator-fraction", "-1"], "--allocator-fraction"),
    (["--context-gb", "-1"], "--context-gb"),
    (["--gpu-memory-gb", "0"], "--gpu-memory-gb must be > 0"),
    (["--gpu-memory-gb", "inf"], "--gpu-memory-gb must be a finite number, got inf"),
    (["--peak-tflops", "nan"], "--peak-tflops must be a finite number, got nan"),
    (["--efficiency", "nan"], "--efficiency must be a finite number"),
    (["--moe-imbalance", "inf"], "--moe-imbalance must be a finite number"),
    (["--moe-imbalance", "0.5"], "--moe-imbalance must be >= 1"),
])
def test_profile_bad_output_or_number_is_one_line_before_the_work(run_qlm, tmp_path, monkeypatch, args, expected):
    import qlm_core.profile.case as case_module

    (tmp_path / "FILE").write_text("x")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(case_module, "build_case", lambda *a, **k: pytest.fail("the work started"))
    code, _, err = run_qlm("profile", *args)
    assert code == 2 and expected in one_error_line(err), err


def test_profile_plot_unwritable_is_refused(run_qlm, tmp_path, monkeypatch):
    real = Path.write_bytes

    def denied(self, data):
        if self.name.startswith(".qlm-write-check"):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", denied)
    code, _, err = run_qlm("profile", "--plot", tmp_path / "ro" / "mem.png")
    assert code == 2 and "cannot write --plot" in one_error_line(err)


def test_dry_run_memory_without_a_gpu_names_the_preset(monkeypatch):
    import torch

    from qlm_core.config import load_recipe
    from qlm_core.models.presets import PRESETS
    from qlm_core.profile.memory import planned_memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = SimpleNamespace(sizes=SimpleNamespace(world=1), spec=PRESETS["qlm-tiny"])
    _, device = planned_memory(load_recipe(REPO / "recipes" / "tiny-sft.toml"), plan)
    assert "a100-80g preset" in device and "no GPU" in device and "an 80 GiB GPU" not in device
