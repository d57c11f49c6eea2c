"""The `qlm` command starts without the heavy libraries: --help and --version answer at once, and option choices
come from the core's single source of the values."""

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "datasets")


def test_importing_the_cli_loads_no_heavy_library():
    """Structural, not a stopwatch: the command modules keep torch/transformers/datasets inside the commands."""
    code = f"import sys; import qlm_cli.main; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", (
        f"importing qlm_cli.main loads {proc.stdout.strip()}; find the importer with "
        "`python -X importtime -c 'import qlm_cli.main'`"
    )



def test_the_convert_path_loads_no_compiler():
    """`qlm convert` imports the model definition (verify) and the formats: none of them may import torch.compile's
    dynamo at import time (1.5 s of every conversion's start-up); it is imported when train.compile asks for it."""
    code = ("import sys; import qlm_core.checkpoint.convert.hf_megatron, qlm_core.checkpoint.convert.deepspeed; "
            "print('torch._dynamo' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "False", "find the importer with `python -X importtime -c 'import ...'`"

def test_version(run_qlm):
    code, out, _ = run_qlm("--version")
    assert code == 0 and out.strip() == f"qlm {version('qlm')}"


def test_a_bad_choice_is_refused_with_the_choices(run_qlm):
    code, _, err = run_qlm("profile", "--recompute", "most")
    assert code == 2
    assert "'most'" in err and all(f"'{choice}'" in err for choice in ("none", "selective", "full")), err


def test_every_cli_choice_is_the_cores_list():
    """The option Enums hold exactly the values the core defines (one source: a new value needs no CLI edit)."""
    from qlm_cli import choices as cli
    from qlm_core import config
    from qlm_core.hardware import GPUS

    pairs = [(cli.CpComm, config.CpCommType), (cli.PipelineSchedule, config.PpSchedule),
             (cli.Recompute, config.RecomputeMode), (cli.ComputeDtype, config.TrainDtype),
             (cli.WeightDtype, config.WeightDtype), (cli.MegatronFormat, config.CheckpointFormat),
             (cli.EvalBackend, config.EvalBackend)]
    for enum, literal in pairs:
        assert [m.value for m in enum] == list(config.choices(literal)), enum
    assert [m.value for m in cli.Gpu] == list(GPUS)


QUICK_EXIT_MARK = "[left through os._exit]"


def _run_script(body: str, **run_options) -> subprocess.CompletedProcess:
    """A process whose `qlm_cli.main.main` is replaced by `body`'s main(), left through the installed script's run();
    os._exit writes QUICK_EXIT_MARK (unbuffered) before it leaves. Output buffered as in a user's shell."""
    code = ("import os, qlm_cli.main as cli\n"
            "real_exit = os._exit\n"
            "def marked_exit(code):\n"
            "    try:\n"
            f"        os.write(1, {QUICK_EXIT_MARK!r}.encode())\n"
            "    except OSError:\n"
            "        pass\n"
            "    real_exit(code)\n"
            "os._exit = marked_exit\n"
            + body + "\ncli.main = main\ncli.run()\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    options = run_options or {"capture_output": True}
    return subprocess.run([sys.executable, "-c", code], text=True, timeout=120, check=False, env=env, **options)


def test_the_script_leaves_quickly_but_runs_exit_handlers_and_flushes():
    """After a command that imported torch, run() skips the interpreter's teardown: the exit code, the buffered
    output and the atexit handlers (W&B, run-directory locks) must survive that."""
    proc = _run_script(
        "import atexit, sys\n"
        "def main():\n"
        "    import torch\n"
        "    atexit.register(lambda: print('handler ran'))\n"
        "    sys.stdout.write('unflushed output')\n"
        "    sys.exit(3)\n"
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout == "unflushed outputhandler ran\n" + QUICK_EXIT_MARK


def test_output_lost_on_a_full_disk_is_an_error():
    """The normal exit reports a failed final flush (exit 120); the quick one must too, not exit 0."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    with open("/dev/full", "w") as full:
        proc = _run_script("def main():\n    import torch\n    print('result line')\n",
                           stdout=full, stderr=subprocess.PIPE)
    assert proc.returncode == 120, proc.stderr[-2000:]
    assert "the output could not be written" in proc.stderr


def test_the_script_waits_for_a_running_thread():
    """A non-daemon thread still at work (a background writer) is joined by the normal exit, not cut off."""
    proc = _run_script(
        "import threading, time\n"
        "def main():\n"
        "    import torch\n"
        "    threading.Thread(target=lambda: (time.sleep(0.5), print('thread finished', flush=True))).start()\n"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "thread finished\n"  # and no QUICK_EXIT_MARK: the normal exit joined the thread
