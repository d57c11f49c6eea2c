"""The `qlm` command starts without the heavy libraries: --help and --version answer at once, and option choices
come from the core's single source of the values."""

import subprocess
import sys
from importlib.metadata import version

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


def _run_script(body: str) -> subprocess.CompletedProcess:
    """A process whose `qlm_cli.main.main` is replaced by `body`'s main(), left through the installed script's run()."""
    code = "import qlm_cli.main as cli\n" + body + "\ncli.main = main\ncli.run()\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)


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
    assert proc.stdout == "unflushed outputhandler ran\n"


def test_the_script_waits_for_a_running_thread():
    """A non-daemon thread still at work (a background writer) is joined by the normal exit, not cut off."""
    proc = _run_script(
        "import threading, time\n"
        "def main():\n"
        "    import torch\n"
        "    threading.Thread(target=lambda: (time.sleep(0.5), print('thread finished', flush=True))).start()\n"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "thread finished\n"
