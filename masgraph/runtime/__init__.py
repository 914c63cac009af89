"""Running graphs: `engine` builds a graph's parts once, `scheduler` runs episodes as supersteps, `runner` runs a
task's items through an engine and stores them; `ray_engine` runs the episodes on Ray workers instead."""
