"""The run directory, with one owner per file: `layout` names every file, `store` writes a run as it goes,
`read` reads traces and events back (live or finished, crash-tolerant), `metrics` writes metrics.jsonl,
`checkpoint` finds and reads checkpoints (trainers/checkpoints.py writes them)."""
