"""Data shipped with masgraph (the knowledge base of the multi-hop lookup task)."""
