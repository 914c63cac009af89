"""User-facing errors: each names where the problem is and how to fix it (no traceback needed)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def shorten(text: str, limit: int = 60) -> str:
    """`text` cut to `limit` characters (with its full length noted), so a huge value cannot flood a message."""
    return text if len(text) <= limit else text[:limit] + f"...({len(text)} chars)"


def one_of(names: Iterable[str], limit: int = 12) -> str:
    """`use one of ...` text for the first `limit` names in sorted order (each shortened)."""
    names = sorted(names)
    shown = ", ".join(repr(shorten(n)) for n in names[:limit])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > limit else ''}]"


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


class ToolError(MasgraphError):
    """A tool rejected its input or failed; the message is shown to the model (the step records it)."""
