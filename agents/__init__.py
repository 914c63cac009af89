"""Agent roles, prompt templates and tools; installed as masgraph.agents (a `masgraph.plugins` entry point)."""

if __name__ != "masgraph.agents":  # the repo root is on sys.path (e.g. `python` started there)
    raise ImportError("this directory installs as `masgraph.agents`; import that name instead of `agents`")

from masgraph.agents.registry import register_agent  # noqa: E402
from masgraph.agents.tools.registry import register_tool  # noqa: E402

__all__ = ["register", "register_agent", "register_tool"]


def register(registry) -> None:
    """Entry point: the built-in role agents and tool kinds."""
    from masgraph.agents.prompting import judge_messages, prompt_names
    from masgraph.agents.registry import load_builtin_agents
    from masgraph.agents.tools.registry import load_builtin_tools

    registry.agents.update(load_builtin_agents())
    registry.tools.update(load_builtin_tools())
    registry.prompts.update(prompt_names() - {"judge"})  # the judge's prompt is not a node's
    registry.judge_prompts["judge"] = judge_messages
