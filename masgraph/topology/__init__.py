"""Topology learning's core parts: the decision space of a graph's `topology:` section, the policy that samples
valid topologies from it, and query features. The trainer (HRPO) lives in `masgraph.trainers`."""
