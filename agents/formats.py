"""The output formats the model must emit, specified once, with lenient parsers.

Planner:   `Sub-goal: <next step>` and `Tool: <tool name>`   (or `Tool: none` when ready to answer)
Executor:  `Input: <the tool's input>`                        (JSON {"input": ...}, a fenced block, or
                                                                `tool(...)` are accepted too)
Verifier:  `Conclusion: STOP` or `Conclusion: CONTINUE`       (STOP = memory already answers the query)
Generator: `Answer: <final answer>`                           (`<answer>..</answer>`, `\\boxed{..}`,
                                                                `the answer is ..` are accepted too)
Each parser returns (value, error): error is None when the format was followed, else it says what was
missing and the value is the documented fallback."""

from __future__ import annotations

import json
import re

_FIELD = r"(?im)^\s*(?:\*\*|#+\s*)?{name}\s*(?:\*\*)?\s*[:=]\s*(?:\*\*)?\s*(.+?)\s*$"


def _field(text: str, *names: str) -> str | None:
    for name in names:
        m = re.search(_FIELD.format(name=name), text)
        if m:
            return m.group(1).strip().strip("`*\"'").strip()
    return None


def normalize_tool(name: str) -> str:
    return re.sub(r"[\s_\-]+", "_", name.strip().lower()).strip("_.`*")


def parse_plan(text: str, tools: list[str]) -> tuple[str, str | None, str | None]:
    """(sub_goal, tool or None for 'answer now', error). Fallback tool: the first tool named in the text, else the
    first tool. A `Tool:` line naming a tool not in `tools` is reported as such, with the tools there are."""
    goal = _field(text, r"sub[\s_-]?goal", "next step", "goal", "step") or text.strip().split("\n")[0][:200]
    raw = _field(text, r"tool(?:\s+name)?", "next tool", "action")
    by_norm = {normalize_tool(t): t for t in tools}
    if raw is not None:
        norm = normalize_tool(raw.split()[0] if raw.split() else raw)
        if norm in by_norm:
            return goal, by_norm[norm], None
        if norm in {"none", "no", "no_tool", "answer", "finish", "n/a", "na"}:
            return goal, None, None
        for n, t in by_norm.items():
            if n in normalize_tool(raw):
                return goal, t, None
    for n, t in by_norm.items():
        if re.search(rf"\b{re.escape(t)}\b", text, re.I) or n in normalize_tool(text):
            return goal, t, _undeclared(raw, tools, t) if raw else "no `Tool:` line; used the tool named in the text"
    fallback = tools[0] if tools else None
    return goal, fallback, _undeclared(raw, tools, fallback) if raw else "no tool named; fell back to the first tool"


def _undeclared(raw: str, tools: list[str], used: str | None) -> str:
    """The note for a `Tool:` line naming a tool the node does not have (models copy tools from examples)."""
    name = raw if len(raw) <= 40 else raw[:37] + "..."
    return (f"named {name!r}, which this node does not have (tools: {', '.join(tools) or 'none'}); "
            f"used {used or 'none'}")


def parse_tool_input(text: str, tool: str) -> tuple[str, str | None]:
    """(input, error). Accepts `Input:` lines, JSON, fenced code and `tool(...)`; falls back to the first line."""
    fenced = re.search(r"```[a-zA-Z0-9]*\n(.*?)```", text, re.S)
    if tool == "python" and fenced:
        return fenced.group(1).strip(), None
    val = _field(text, "input", "command", "query", "expression", "code", "search")
    if val:
        return val, None
    try:
        obj = json.loads(text[text.index("{"): text.rindex("}") + 1])
        for k in ("input", "command", "query", "expression", "code"):
            if isinstance(obj.get(k), str):
                return obj[k], None
    except (ValueError, AttributeError):
        pass
    call = re.search(rf"{re.escape(tool)}\s*\((.+)\)", text, re.I | re.S)
    if call:
        return call.group(1).strip().strip("'\""), None
    if fenced:
        return fenced.group(1).strip(), None
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return first, "no `Input:` line; used the first line"


def parse_verdict(text: str) -> tuple[str, str | None]:
    """('stop' | 'continue', error). Fallback: 'continue' (the turn bound still ends the loop)."""
    val = _field(text, "conclusion", "verdict", "decision")
    for candidate in ([val] if val else []) + [text]:
        words = re.findall(r"\b(stop|continue|done|finished|complete|sufficient|insufficient|incomplete|more)\b",
                           candidate, re.I)
        if words:
            last = words[-1 if candidate is text else 0].lower()
            return ("stop" if last in {"stop", "done", "finished", "complete", "sufficient"} else "continue"), (
                None if candidate is val else "no `Conclusion:` line; used the last verdict word")
    return "continue", "no verdict found; continuing"


def parse_answer(text: str) -> tuple[str, str | None]:
    """(answer, error). Fallback: the last non-empty line."""
    for pat in (r"<answer>(.*?)</answer>", r"\\boxed\{([^{}]*)\}"):
        m = re.search(pat, text, re.S)
        if m:
            return m.group(1).strip(), None
    val = _field(text, "final answer", "answer")
    if val:
        return val, None
    m = re.search(r"(?i)(?:final answer|the answer) is[:\s]*([^\n]+?)\.?\s*$", text, re.M)
    if m:
        return m.group(1).strip(), None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[-1] if lines else ""), "no `Answer:` line; used the last line"
