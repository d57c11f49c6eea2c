"""The one error type users see: a single line naming the problem and how to fix it."""


class QlmError(Exception):
    """A problem with the user's input or environment (not a bug in qlm)."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem.rstrip(".")
        self.fix = fix
        super().__init__(self.line())

    def line(self) -> str:
        text = self.problem
        if self.fix:
            text += f"; {self.fix.rstrip('.')}"
        text = " ".join(text.split())
        return text if text.endswith(("?", "!")) else text + "."
