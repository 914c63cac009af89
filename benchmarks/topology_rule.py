"""Does routing matter on a task? The rule for choosing the topology benchmarks' task, checked BEFORE any
topology training: on held-out items, the oracle router (the best fixed route per query type, chosen on train
items) must beat the best single fixed route (chosen on train items) by >= 10 points, and the routes must differ
>= 2x in completion tokens per episode.

Every distinct route of the supergraph (`graphs/mixed_router.yaml`: straight to the generator, or the planner
to one of three tool executors with or without the verifier loop: 7) runs the same train and held-out items of
`--task` with the graph's own greedy sampling on the embedded model, untrained. Prints per route and query type
the accuracy and tokens, the rule's verdict, and appends the table to results/topology.md; the whole measurement
(per route, split and query type) goes to runs/bench-topology/rule-TASK.json, where benchmarks/topology.py reads
the best fixed route and the oracle router.

    .venv/bin/python benchmarks/topology_rule.py --n-train 60 --n-test 210
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from results_file import results_file

from masgraph.backends.hf import HFBackend
from masgraph.graph import Topology, compile_spec
from masgraph.graph.space import DecisionSpace
from masgraph.loader import load_spec
from masgraph.runtime.runner import RunConfig, Runner
from masgraph.tasks import get_task, is_correct
from masgraph.trace import TopologyChoice, Trace

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GAIN_MIN, TOKENS_RATIO_MIN = 0.10, 2.0


class Fixed:
    """A topology 'policy' that always picks the same route (what the rule compares)."""

    def __init__(self, topology: Topology, decisions: dict[str, str]):
        self.topology, self.choice = topology, TopologyChoice(decisions=decisions, mode="greedy")

    def sample(self, query: str, seed: int | None = None, greedy: bool = False) -> Fixed:
        return self


def routes(graph) -> dict[str, Fixed]:
    """One fixed route per distinct sub-graph the topology can give (named by the nodes it runs)."""
    space = DecisionSpace(graph)
    out: dict[str, Fixed] = {}
    seen = set()
    for config in itertools.product(*(range(len(d.options)) for d in space.decisions)):
        top = space.topology(config)
        if graph.problems_of(top):
            continue
        view = graph.view(top)
        key = tuple(sorted((e.source, e.target, e.when) for edges in view.out_edges.values() for e in edges))
        if key in seen:
            continue
        seen.add(key)
        ran = [n for n in graph.spec.nodes if n in view.out_edges]
        out["→".join(ran)] = Fixed(top, {d.name: d.options[o] for d, o in zip(space.decisions, config)})
    return out


def run_route(graph, backend, route: Fixed, task, split: str, n: int, seed: int) -> list[Trace]:
    runner = Runner(graph, RunConfig(n=n, split=split, concurrency=16, seed=seed, topology="greedy"),
                    backends={"hf": backend}, topology=route)
    return asyncio.run(runner.run_task(task, store=False)).traces


def by_type(traces: list[Trace]) -> dict[str, list[Trace]]:
    """Episodes per query type, and all of them under "all"."""
    groups: dict[str, list[Trace]] = defaultdict(list)
    for t in traces:
        groups["all"].append(t)
        if "type" in t.meta:
            groups[t.meta["type"]].append(t)
    return groups


def stats(traces: list[Trace]) -> tuple[float, float, int, float]:
    """(accuracy, mean completion tokens, items, share of episodes with a step whose output failed to parse)."""
    n = len(traces)
    return (sum(map(is_correct, traces)) / n, sum(t.completion_tokens for t in traces) / n, n,
            sum(any(s.parse_error for s in t.steps) for t in traces) / n)


def per_type(traces: list[Trace]) -> dict[str, tuple[float, float, int, float]]:
    """type -> `stats` of its episodes."""
    return {k: stats(v) for k, v in by_type(traces).items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graph", default="graphs/mixed_router.yaml")
    p.add_argument("--task", default="mixed_routes")
    p.add_argument("--n-train", type=int, default=60)
    p.add_argument("--n-test", type=int, default=210)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gain-min", type=float, default=GAIN_MIN * 100,
                   help=f"points the oracle router must gain over the best single route (default {GAIN_MIN * 100:g})")
    p.add_argument("--no-record", action="store_true", help="print only (a smoke run), do not record")
    args = p.parse_args()
    graph = compile_spec(load_spec(ROOT / args.graph), str(ROOT / args.graph))
    task = get_task(args.task)
    backend = HFBackend("smollm2-135m", dtype="float32")
    rows = {}
    t0 = time.perf_counter()
    fixed = routes(graph)
    for name, route in fixed.items():
        t1 = time.perf_counter()
        train = per_type(run_route(graph, backend, route, task, "train", args.n_train, args.seed))
        test = per_type(run_route(graph, backend, route, task, "test", args.n_test, args.seed))
        rows[name] = (train, test)
        print(f"{name:45s} train " + "  ".join(f"{k} {v[0]:.2f}" for k, v in sorted(train.items()))
              + " | test " + "  ".join(f"{k} {v[0]:.2f}" for k, v in sorted(test.items()))
              + f"  tokens {test['all'][1]:.0f}  ({time.perf_counter() - t1:.0f} s)",
              flush=True)
    types = sorted(k for k in next(iter(rows.values()))[0] if k != "all")
    best_single = max(rows, key=lambda r: (rows[r][0]["all"][0], -rows[r][0]["all"][1]))
    oracle = {k: max(rows, key=lambda r: (rows[r][0][k][0], -rows[r][0][k][1])) for k in types}
    n_test = sum(rows[best_single][1][k][2] for k in types)
    oracle_acc = sum(rows[oracle[k]][1][k][0] * rows[oracle[k]][1][k][2] for k in types) / n_test
    single_acc = rows[best_single][1]["all"][0]
    tokens = [v[1]["all"][1] for v in rows.values()]
    ratio = max(tokens) / max(min(tokens), 1e-9)
    gain_min = args.gain_min / 100
    ok = oracle_acc - single_acc >= gain_min and ratio >= TOKENS_RATIO_MIN
    verdict = (f"oracle router {oracle_acc:.3f} vs best single route ({best_single}) {single_acc:.3f} on {n_test} "
               f"held-out items: {100 * (oracle_acc - single_acc):+.1f} points (rule ≥ +{100 * gain_min:.0f}); "
               f"tokens per episode differ {ratio:.1f}x across routes (rule ≥ {TOKENS_RATIO_MIN:g}x): "
               f"{'QUALIFIES' if ok else 'DOES NOT QUALIFY'}")
    print(verdict)
    lines = [f"\n### Topology task rule: `{args.task}` on `{args.graph}` ({time.strftime('%Y-%m-%d %H:%M')})\n",
             f"`{' '.join([Path(sys.executable).name, *sys.argv])}` — untrained embedded model, greedy, "
             f"{(time.perf_counter() - t0) / 60:.0f} min.\n\n",
             "| route | " + " | ".join(f"train {k}" for k in types) + " | test acc | test tokens/episode |\n",
             "|---|" + "---|" * (len(types) + 2) + "\n"]
    lines += [f"| {r} | " + " | ".join(f"{rows[r][0][k][0]:.2f}" for k in types)
              + f" | {rows[r][1]['all'][0]:.3f} | {rows[r][1]['all'][1]:.0f} |\n" for r in rows]
    lines.append(f"\nOracle per type (chosen on train): {oracle}. {verdict}\n")
    if not args.no_record:
        with open(results_file("topology"), "a") as f:
            f.writelines(lines)
        out = ROOT / "runs" / "bench-topology"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rule-{args.task}.json").write_text(json.dumps({
            "task": args.task, "graph": args.graph, "n_train": args.n_train, "n_test": args.n_test, "seed": args.seed,
            "routes": {r: {"decisions": fixed[r].choice.decisions, "train": rows[r][0], "test": rows[r][1]}
                       for r in rows},
            "best_single": best_single, "oracle": oracle, "oracle_acc": oracle_acc, "single_acc": single_acc,
            "tokens_ratio": ratio, "qualifies": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
