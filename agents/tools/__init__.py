"""Tools agents call; installed as masgraph.agents.tools."""
