"""The `qlm` command. The command modules import nothing heavy at start-up (torch, transformers, datasets load
inside the commands), so that --help and --version answer at once."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.markup import escape

from qlm_cli.commands import convert, data, profile, train
from qlm_cli.commands.eval import eval_command
from qlm_cli.render import console, err_console
from qlm_core.errors import QlmError

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


def main():
    """Console entry point: user errors become one line on stderr and exit code 2."""
    try:
        app()
    except QlmError as exc:
        err_console.print(f"[bold red]error:[/] {escape(exc.line())}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
