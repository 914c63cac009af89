"""AgentFlow's ten held-out sets through a graph, in AgentFlow's table layout: accuracy, turns, tokens and failures
per set, with the scorer named.

Each set is read from its released file (`--data`, default ../shared/benchmarks/agentflow: the sets are not copied
into the project) as a data task (masgraph/datatask.py): the question is the set's `query` (the prompt AgentFlow
sends), every item held out, and scored by the scorer that fits its answers: `game24` (Game of 24, checked
exactly), `number` (AIME, AMC), `choice` (GPQA, MedQA), `contains` for the open QA sets (AgentFlow scores those
with an LLM judge; a judge scorer is not built yet, so `contains` is the stand-in and the table says so). One
engine serves every set, so the model loads once; the first `--n` items of each set, in file order.

    .venv/bin/python benchmarks/agentflow_sets.py graphs/agentflow.yaml [--sets gameof24 bamboogle] [--n 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SETS = {"gameof24": "game24", "aime24": "number", "amc23": "number", "bamboogle": "contains", "2wiki": "contains",
        "hotpotqa": "contains", "musique": "contains", "gaia": "contains", "gpqa": "choice", "medqa": "choice"}
"""Set -> the scorer its answers take (AgentFlow judges the `contains` ones with an LLM)."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("graph")
    ap.add_argument("--sets", nargs="+", choices=list(SETS), default=list(SETS))
    ap.add_argument("--n", type=int, default=10, help="items per set (the first N, in file order; default 10)")
    ap.add_argument("--data", default=os.environ.get("MASGRAPH_AGENTFLOW_DATA",
                                                     str(ROOT.parent / "shared" / "benchmarks" / "agentflow")),
                    help="folder holding <set>/data.json (default ../shared/benchmarks/agentflow)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    from masgraph.datatask import DataTask, DataTaskSpec
    from masgraph.errors import MasgraphError
    from masgraph.graph import compile_spec
    from masgraph.loader import load_spec
    from masgraph.runner import RunConfig, Runner

    data = Path(args.data)
    missing = [s for s in args.sets if not (data / s / "data.json").is_file()]
    if missing:
        print(f"error: no {', '.join(f'{s}/data.json' for s in missing)} under {data}; pass --data DIR",
              file=sys.stderr)
        return 2
    try:
        graph = compile_spec(load_spec(args.graph), args.graph)
    except MasgraphError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = ["| set | scorer | items | accuracy | accuracy of finished | turns | completion tokens | failures |",
            "|---|---|---|---|---|---|---|---|"]
    runner = None
    t0 = time.perf_counter()
    for name in args.sets:
        task = DataTask(DataTaskSpec(name=name, file=f"{name}/data.json", question="query", scorer=SETS[name],
                                     split="test"), data)
        items = task.items("test", args.n, 0)
        config = RunConfig(n=len(items), concurrency=args.concurrency, deterministic=True,
                           runs_dir=str(ROOT / "runs" / "bench-agentflow"))
        runner = Runner(graph, config, engine=runner.engine if runner else None)
        s = asyncio.run(runner.run_items(task, items)).summary
        fails = ", ".join(f"{k} {v}" for k, v in s["failures"].items() if v) or "none"
        finished = "—" if s.get("accuracy_finished") is None else f"{s['accuracy_finished']:.1%}"
        rows.append(f"| {name} | {SETS[name]}{' (AgentFlow: LLM judge)' if SETS[name] == 'contains' else ''} | "
                    f"{s['episodes']} | **{s.get('accuracy', 0):.1%}** | {finished} | {s.get('turns_mean', 0):.2f} | "
                    f"{s.get('completion_tokens_mean', 0):.0f} | {fails} |")
        print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n"
    print(text)
    if not args.no_record:
        with open(HERE / "RESULTS.md", "a") as f:
            f.write(f"\n### AgentFlow's sets through `{args.graph}` ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
                    f"`python benchmarks/agentflow_sets.py {args.graph} --sets {' '.join(args.sets)} --n {args.n}` — "
                    f"the first {args.n} items of each released set, deterministic decoding, the embedded model "
                    f"(SmolLM2-135M) on this CPU, {(time.perf_counter() - t0) / 60:.0f} min.\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
