"""The one error type users see: a single line naming the problem and how to fix it."""

import re


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

    def renamed(self, names: dict[str, str]) -> "QlmError":
        """The same error with command-line flags replaced by what the user wrote instead (a recipe's keys)."""
        pattern = re.compile("|".join(re.escape(flag) for flag in sorted(names, key=len, reverse=True)) + r"(?![\w-])")

        def swap(text: str | None) -> str | None:
            return None if text is None else pattern.sub(lambda m: names[m.group(0)], text)

        return QlmError(swap(self.problem), swap(self.fix))
