"""User-facing errors: each names where the problem is and how to fix it (no traceback needed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One located problem in a graph spec."""

    path: str
    message: str
    fix: str = ""
    line: int | None = None
    column: int | None = None

    def render(self, file: str | None) -> str:
        where = file or "<spec>"
        if self.line is not None:
            where += f":{self.line}:{self.column or 1}"
        text = f"{where}: {self.path or '<root>'}: {self.message}"
        return text + (f"\n    fix: {self.fix}" if self.fix else "")


class MasgraphError(Exception):
    """Base of the errors masgraph reports to users without a traceback."""


class SpecError(MasgraphError):
    """A graph spec is invalid; carries every problem found, each located."""

    def __init__(self, problems: list[Problem], file: str | None = None):
        self.problems = problems
        self.file = file
        head = f"{len(problems)} problems in {file or 'the spec'}:\n" if len(problems) > 1 else ""
        super().__init__(head + "\n".join(p.render(file) for p in problems))


class ModelNotFoundError(MasgraphError):
    """A policy names a model that is neither the embedded default nor a local directory."""
