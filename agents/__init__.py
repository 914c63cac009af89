"""Agent roles, prompt templates and tools; installed as masgraph.agents (a `masgraph.plugins` entry point)."""

if __name__ != "masgraph.agents":  # the repo root is on sys.path (e.g. `python` started there)
    raise ImportError("this directory installs as `masgraph.agents`; import that name instead of `agents`")

from masgraph.agents.registry import register_agent  # noqa: E402
from masgraph.agents.tools.registry import register_tool  # noqa: E402

__all__ = ["register", "register_agent", "register_tool"]


def register(registry) -> None:
    """Entry point: the built-in role agents and tool kinds."""
    # importing a built-in module registers it (the registries never import the modules that import them)
    from masgraph.agents import executor, generator, memory, planner, verifier  # noqa: F401
    from masgraph.agents.prompting import judge_messages, prompt_names
    from masgraph.agents.registry import BUILTIN_AGENTS
    from masgraph.agents.tools import calculator, mcp_tool, python, search, web_search  # noqa: F401
    from masgraph.agents.tools.registry import BUILTIN_TOOLS

    registry.agents.update(BUILTIN_AGENTS)
    registry.tools.update(BUILTIN_TOOLS)
    registry.prompts.update(prompt_names() - {"judge"})  # the judge's prompt is not a node's
    registry.judge_prompts["judge"] = judge_messages
