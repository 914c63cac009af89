"""`masgraph init`: copy the example graphs masgraph ships into a folder, so a `pip install` has files to run."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from masgraph.errors import MasgraphError

HELP = "copy the example graphs (agentflow.yaml, router.yaml, ...) into a folder (default ./graphs)"


def add_arguments(i: argparse.ArgumentParser) -> None:
    i.add_argument("dir", nargs="?", default="graphs", help="where the graphs go (default %(default)s/)")
    i.add_argument("--force", action="store_true", help="overwrite graph files that are already there")
    i.set_defaults(fn=cmd_init)


def shipped_graphs() -> Path:
    """The folder of the example graphs: the installed package's `masgraph/graphs` (a wheel ships them as package
    data), else the source checkout's `graphs/` (an editable install made before they were package data)."""
    import importlib.util

    import masgraph

    spec = importlib.util.find_spec("masgraph.graphs")
    candidates = [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []
    candidates.append(Path(masgraph.__file__).resolve().parent.parent / "graphs")
    for folder in candidates:
        if any(folder.glob("*.yaml")):
            return folder
    raise MasgraphError("this masgraph install has no example graphs (masgraph/graphs); reinstall it from a wheel or "
                        "a source checkout")


def cmd_init(args: argparse.Namespace) -> int:
    source = shipped_graphs()
    out = Path(args.dir)
    if out.exists() and not out.is_dir():
        raise MasgraphError(f"{out} exists and is not a folder; name another one: masgraph init DIR")
    files = sorted(source.glob("*.yaml"))
    there = [f.name for f in files if (out / f.name).exists()]
    if there and not args.force:
        raise MasgraphError(f"{out} already holds {', '.join(there)}; pass --force to overwrite them, or name another "
                            "folder: masgraph init DIR")
    out.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, out / f.name)
    print(f"wrote {len(files)} graphs to {out}/: {', '.join(f.name for f in files)}")
    print(f"next: masgraph run {out / 'agentflow.yaml'} --task basic_arithmetic --n 8")
    return 0
