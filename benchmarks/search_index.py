"""Search over a user's own large collection vs today's search, measured as task accuracy.

Today's search indexes the shipped knowledge base (~180 documents) in memory. A user's collection is larger: here
the knowledge base hidden among `--distractors` (default 10,000) documents in its style (masgraph/distractors.py),
written as a JSONL corpus and searched through the on-disk BM25 index (`index:`, SQLite FTS5). The same graph
(`--graph`, default graphs/agentflow.yaml) runs the same held-out items of each task, deterministically: its
search tool as written, and pointed at the big corpus through the index. Reported per task: accuracy both ways,
the items whose verdict differs, and how often the two searches returned the same first passage for the same query;
and a third run through the index with `min_score_ratio` (`--ratio`), which keeps near-misses (passages sharing
one word of the query) out of the context.

    .venv/bin/python benchmarks/search_index.py [--tasks lookup mixed_routes] [--n 60] [--distractors 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from results_file import results_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graph", default=str(ROOT / "graphs" / "agentflow.yaml"))
    ap.add_argument("--tasks", nargs="+", default=["lookup", "mixed_routes"])
    ap.add_argument("--n", type=int, default=60, help="held-out items per task (default 60)")
    ap.add_argument("--distractors", type=int, default=10_000)
    ap.add_argument("--ratio", type=float, default=0.5, help="min_score_ratio of the third arm (default 0.5)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    from masgraph.agents.tools.search import default_corpus_path, read_documents
    from masgraph.graph import compile_spec
    from masgraph.loader import load_spec
    from masgraph.runtime.runner import RunConfig, Runner
    from masgraph.tasks import get_task, is_correct
    from masgraph.tasks.distractors import write_corpus

    work = ROOT / "runs" / "bench-search"
    t0 = time.perf_counter()
    corpus = write_corpus(work / "docs.jsonl", read_documents(default_corpus_path()), args.distractors)
    spec = load_spec(args.graph)
    searches = [name for name, tool in spec.tools.items() if tool.kind == "search"]
    if not searches:
        print(f"error: {args.graph} has no search tool", file=sys.stderr)
        return 2
    big, cut = spec.model_copy(deep=True), spec.model_copy(deep=True)
    for name in searches:
        big.tools[name].options.update(corpus=str(corpus), index=str(work / "docs.fts"))
        cut.tools[name].options.update(corpus=str(corpus), index=str(work / "docs.fts"), min_score_ratio=args.ratio)
    t_build = time.perf_counter()
    graphs = {"today": compile_spec(spec, args.graph), "index": compile_spec(big, args.graph)}  # builds the index
    built_s = time.perf_counter() - t_build
    graphs["cut"] = compile_spec(cut, args.graph)
    rows = ["| task | items | today's search (KB in memory) | index over KB + "
            f"{args.distractors:,} docs | verdicts that differ | same first passage | index, min_score_ratio "
            f"{args.ratio} | verdicts that differ |", "|---|---|---|---|---|---|---|---|"]
    engine = None
    for name in args.tasks:
        task = get_task(name)
        items = task.items("test", args.n, 0)
        out = {}
        for which, graph in graphs.items():
            config = RunConfig(n=len(items), concurrency=args.concurrency, deterministic=True,
                               runs_dir=str(work / "runs"))
            runner = Runner(graph, config, backends={"hf": engine.backends[next(iter(engine.backends))]}
                            if engine else None)
            engine = engine or runner.engine
            out[which] = asyncio.run(runner.run_items(task, items))
        a, b, c = out["today"], out["index"], out["cut"]
        differ = sum(is_correct(x) != is_correct(y) for x, y in zip(a.traces, b.traces))
        differ_cut = sum(is_correct(x) != is_correct(y) for x, y in zip(a.traces, c.traces))
        same, searched = _same_first_passage(a.traces, b.traces, set(searches))
        rows.append(f"| {name} | {len(items)} | {a.summary['accuracy']:.1%} | **{b.summary['accuracy']:.1%}** | "
                    f"{differ} | {same}/{searched} | **{c.summary['accuracy']:.1%}** | {differ_cut} |")
        print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n"
    print(text)
    if not args.no_record:
        with open(results_file("search_index"), "a") as f:
            f.write(f"\n### Search over a large collection: on-disk index vs today's search "
                    f"({time.strftime('%Y-%m-%d %H:%M')})\n\n`python benchmarks/search_index.py --tasks "
                    f"{' '.join(args.tasks)} --n {args.n} --distractors {args.distractors} --ratio {args.ratio}` — "
                    f"`{args.graph}`, "
                    f"deterministic decoding, the embedded model on this CPU; index built in {built_s:.1f} s; "
                    f"{(time.perf_counter() - t0) / 60:.0f} min in all.\n\n{text}")
    return 0


def _same_first_passage(a: list, b: list, tools: set[str]) -> tuple[int, int]:
    """Search calls made with the same input in both runs (same episode, same step), and how many of them returned
    the same first passage."""
    same = total = 0
    for x, y in zip(a, b):
        for s, t in zip(x.steps, y.steps):
            if s.tool and t.tool and s.tool.tool in tools and s.tool.input == t.tool.input:
                total += 1
                same += (s.tool.output or "").split("\n")[0] == (t.tool.output or "").split("\n")[0]
    return same, total


if __name__ == "__main__":
    sys.exit(main())
