"""The `qlm` command. The command modules import nothing heavy at start-up (torch, transformers, datasets load
inside the commands), so that --help and --version answer at once."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import Annotated

import typer
from rich.markup import escape

from qlm_cli.commands import convert, data, generate, profile, train
from qlm_cli.commands.eval import eval_command
from qlm_cli.render import console, err_console
from qlm_core.errors import QlmError

try:  # typer >= 0.20 vendors click as typer._click; its exceptions derive from TyperException
    from typer import TyperException as ClickError
except ImportError:  # older typer runs on click itself
    from click import ClickException as ClickError

app = typer.Typer(
    name="qlm",
    help="Train, convert, evaluate and profile LLMs with Megatron-style hybrid parallelism.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(convert.app, name="convert")
app.add_typer(data.app, name="data")
app.command("train")(train.train)
app.command("profile")(profile.profile)
app.command("eval")(eval_command)
app.command("generate")(generate.generate_command)


def _print_version(wanted: bool):
    if wanted:
        from importlib.metadata import version

        console.print(f"qlm {version('qlm')}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _options(
    _version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                           help="Print qlm's version and exit.")] = False,
):
    pass


def _help_as_written(command):
    """Typer renders help texts as Rich markup: `[model] [parallel]` would vanish. Escape every help text of the
    command tree once, so brackets show as written (Typer's own additions, defaults and ranges, escape themselves)."""
    for attr in ("help", "short_help", "epilog"):
        if getattr(command, attr, None):
            setattr(command, attr, escape(getattr(command, attr)))
    for param in command.params:
        if getattr(param, "help", None):
            param.help = escape(param.help)
    for sub in getattr(command, "commands", {}).values():
        _help_as_written(sub)


def command():
    """The click command tree of `app`, help texts escaped."""
    tree = typer.main.get_command(app)
    _help_as_written(tree)
    return tree


def _usage_line(exc: ClickError) -> str:
    """A click/Typer usage error (missing option, bad choice, bad number) as qlm's one line."""
    ctx = getattr(exc, "ctx", None)
    path = ctx.command_path if ctx is not None else "qlm"
    return QlmError(exc.format_message(), f"run '{path} --help'").line()


def _print_error(line: str):
    err_console.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)


def main(argv: list[str] | None = None):
    """Console entry point: user errors (qlm's and click's usage errors) become one line on stderr and exit code 2."""
    try:
        code = command().main(args=argv, prog_name="qlm", standalone_mode=False)
    except QlmError as exc:
        _print_error(exc.line())
        sys.exit(2)
    except ClickError as exc:  # UsageError / BadParameter / NoSuchOption (exit 2), FileError (exit 1)
        if type(exc).__name__ != "NoArgsIsHelpError":  # `qlm` alone: the help is printed already
            _print_error(_usage_line(exc))
        sys.exit(getattr(exc, "exit_code", 2))
    except typer.Abort:
        _print_error("interrupted (Ctrl-C); run the command again (a training run resumes from its last checkpoint)")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


def _exit_code(done: SystemExit) -> int:
    if done.code is None or isinstance(done.code, int):
        return done.code or 0
    print(done.code, file=sys.stderr)  # sys.exit("text") prints the text and exits 1
    return 1


def run():
    """The installed `qlm` script: main(), then a quick exit. Once torch is imported, the interpreter's teardown
    (clearing thousands of module dicts, torch.library finalizers) takes ~0.45 s and does nothing for a command that
    has finished, so the exit handlers run (W&B, logging, run-directory locks), the streams are flushed and the
    process leaves. With a non-daemon thread still running, the normal exit joins it instead."""
    try:
        main()
        code = 0
    except SystemExit as done:
        code = _exit_code(done)
    if "torch" not in sys.modules or any(
        thread.is_alive() and not thread.daemon for thread in threading.enumerate()
        if thread is not threading.main_thread()
    ):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is None or stream.closed:
            continue
        try:
            stream.flush()
        except BrokenPipeError:  # the reader left (`| head`): nothing more to say
            pass
        except OSError as exc:  # a full disk: the output is lost, so the exit says so (as CPython's does, 120)
            with contextlib.suppress(OSError):
                os.write(2, f"error: the output could not be written ({exc})\n".encode())
            code = code or 120
    os._exit(code)


if __name__ == "__main__":
    run()
