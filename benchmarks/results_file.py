"""Where a benchmark records its results: `benchmarks/results/<name>.md`, one markdown file per benchmark.

Each benchmark appends a `### title (date)` section with its command to its own file and never rewrites what is
there, so the file is that benchmark's whole history; the docs quote the latest entry and link the file."""

from __future__ import annotations

from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def results_file(name: str) -> Path:
    """The results file of benchmark `name` (e.g. "scheduler_overhead"); created with a title if it is new."""
    path = RESULTS_DIR / f"{name}.md"
    if not path.exists():
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        title = name.replace("_", " ").capitalize()
        path.write_text(f"# {title}\n\nEntries appended by the benchmark, oldest first.\n")
    return path
