"""The `qlm` command."""

from __future__ import annotations

import sys

import typer

from qlm_core.errors import QlmError

from .commands import convert, data, profile, train
from .commands.eval import eval_command
from .render import err_console

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


def main():
    """Console entry point: user errors become one line on stderr and exit code 2."""
    try:
        app()
    except QlmError as exc:
        err_console.print(f"[bold red]error:[/] {exc.line()}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
