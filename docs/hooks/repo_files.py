"""MkDocs hook: put files that live outside docs/ into the site without copying them into the repository.

- benchmarks/results/<name>.md becomes the page results/<name>.md (the docs quote and link the results files);
- tests/snapshots/watch/*.svg becomes snapshots/watch/*.svg (the TUI screenshots are the snapshot tests' own)."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
FROM_REPO = {"benchmarks/results": ("results", "*.md"), "tests/snapshots/watch": ("snapshots/watch", "*.svg")}


def on_files(files: Files, config) -> Files:
    for src, (dest, pattern) in FROM_REPO.items():
        for path in sorted((ROOT / src).glob(pattern)):
            files.append(File.generated(config, f"{dest}/{path.name}", abs_src_path=str(path)))
    return files
