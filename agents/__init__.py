"""Agent roles, prompt templates and tools; installed as masgraph.agents."""

if __name__ != "masgraph.agents":  # the repo root is on sys.path (e.g. `python` started there)
    raise ImportError("this directory installs as `masgraph.agents`; import that name instead of `agents`")
