"""ActionLog: the episode memory as an append-only log of actions, serialised into prompts with truncation.

Contract: `append` never edits earlier entries; `render` shows the last `max_actions` entries (earlier
ones are counted, not shown) and cuts each result to `max_result_chars` (head and tail kept)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Action:
    """One recorded action: who did what, with which tool and input, and what came back."""

    node: str
    sub_goal: str = ""
    tool: str | None = None
    input: str | None = None
    result: str | None = None
    error: str | None = None


@dataclass
class ActionLog:
    """AgentFlow's evolving memory (re-serialised into every prompt).

    Example:
        >>> log = ActionLog(max_actions=2)
        >>> log.append(Action("executor", "add", "calculator", "2+2", "4"))
        >>> print(log.render())
        Step 1: add
          tool: calculator, input: 2+2
          result: 4
    """

    max_actions: int = 6
    max_result_chars: int = 300
    actions: list[Action] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Summaries written by a memory node (kept in full; they replace what they summarise)."""
    shown: set[int] = field(default_factory=set)
    """`id()`s of the actions some render displayed (read by a prompt: what the scheduler calls used)."""

    def append(self, action: Action) -> None:
        self.actions.append(action)

    def render(self) -> str:
        if not self.actions and not self.notes:
            return "(nothing yet)"
        lines = [f"Summary: {n}" for n in self.notes]
        hidden = max(0, len(self.actions) - self.max_actions)
        if hidden:
            lines.append(f"({hidden} earlier step{'s' if hidden > 1 else ''} not shown)")
        for i, a in enumerate(self.actions[hidden:], start=hidden + 1):
            self.shown.add(id(a))
            lines.append(f"Step {i}: {a.sub_goal or a.node}")
            if a.tool:
                lines.append(f"  tool: {a.tool}, input: {_cut(a.input or '', self.max_result_chars)}")
            if a.error:
                lines.append(f"  error: {_cut(a.error, self.max_result_chars)}")
            elif a.result is not None:
                lines.append(f"  result: {_cut(a.result, self.max_result_chars)}")
        return "\n".join(lines)

    def compact(self, keep: int, summary: str | None = None) -> None:
        """Drop all but the last `keep` actions, optionally recording a summary of the dropped ones."""
        if summary:
            self.notes.append(summary)
        self.actions = self.actions[-keep:] if keep else []


def _cut(text: str, limit: int) -> str:
    text = text.strip()
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    return f"{text[:head]} [...] {text[-(limit - head - 7):]}"
