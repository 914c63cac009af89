"""`masgraph export`: write a trained graph as a self-contained, deployable bundle."""

from __future__ import annotations

import argparse

HELP = "write a trained graph as a self-contained, deployable bundle"


def add_arguments(ex: argparse.ArgumentParser) -> None:
    ex.add_argument("source", help="a training run dir (its latest checkpoint), RUN/checkpoints/step-N, or a graph "
                                   "YAML file")
    ex.add_argument("--out", required=True, help="bundle directory to create (must not exist or be empty)")
    ex.add_argument("--archive", action="store_true", help="write OUT.tar.gz instead of a directory")
    ex.set_defaults(fn=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from masgraph.serve.bundle import export_bundle, load_bundle

    out = export_bundle(args.source, args.out, archive=args.archive)
    bundle = load_bundle(out)  # what was written loads (and the manifest matches)
    m = bundle.manifest
    ev = m.get("evaluation")
    print(f"exported {m['name']} to {out}")
    print(f"  adapters {sorted(m['adapters']) or 'none'}; topology "
          f"{'learned v' + str(m['topology']['version']) if m['topology'] else 'none'}; "
          f"base {', '.join(m['models']) or 'none'}")
    if ev:
        print(f"  held-out accuracy at step {ev['step']}: {ev['accuracy']:.3f} on {ev['n']} {ev['task']} items")
    print(f"serve it: masgraph serve {out}")
    return 0
