"""Topology benchmarks on the mixed task (issue 10): what learning the topology buys, alone and jointly.

Arms (each trained from the untrained embedded model for `--minutes` of training time — rollouts and updates,
evaluation not counted, on `--clock` (`cpu`: the process's CPU time, robust to a busy machine; `wall`) — then
evaluated greedy on the same `--eval-n` held-out items, seed 0's test split):

- `topology`  HRPO on `graphs/mixed_router.yaml`'s query-conditioned topology policy, node policies frozen
- `gptswarm`  the same with the GPTSwarm-style estimator (`algorithm: reinforce`)
- `cost`      the same as `topology` with an accuracy-vs-cost reward, `hrpo.cost_lambda: --cost-lambda`
- `joint`     HRPO and Flow-GRPO (planner and verifier adapters) from the same rollouts, `simultaneous`
- `policy`    Flow-GRPO alone on the best fixed route (the plain graph of the rule's best single route)
- `staged`    joint, `schedule: staged`: HRPO alone on greedy-node rollouts for `--topology-steps` steps, then
              Flow-GRPO alone with the topology held (`hrpo.no_signal: skip` for any later joint step)

Every HRPO arm uses `hrpo.lr: --hrpo-lr`.

The fixed-route references (best single route, oracle router) come from `benchmarks/topology_rule.py`, which must
have run first on the same task (it writes runs/bench-topology/rule-TASK.json); both use the same held-out items
and greedy decoding. `--task` picks the mixed task (`mixed_routes`, `mixed_skills`); runs go under
runs/bench-topology/TASK/[TAG/].

    .venv/bin/python benchmarks/topology.py all --minutes 10     # every arm, three seeds, then the report
    .venv/bin/python benchmarks/topology.py run topology --seed 0 --minutes 10
    .venv/bin/python benchmarks/topology.py report [--tag T] [--longer T2] [--no-record]

`--longer T2` adds the policy arm of tag T2 (the same arm run on a longer budget) and the verdict "policy-only keeps
its gains": T2's mean ≥ T's mean − the larger of the two sds.

`all` runs the seeds of an arm side by side, one CPU thread each (the same contention for every arm), arm
after arm. Each run writes runs/bench-topology/<task>/[<tag>/]<arm>-s<seed>.json; `report` prints the four
comparisons for one tag and appends them to benchmarks/results/topology.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import yaml
from results_file import results_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = ROOT / "runs" / "bench-topology"
GRAPH = "graphs/mixed_router.yaml"
TASK = "mixed_routes"  # --task sets it (main)
ARMS = ("topology", "gptswarm", "cost", "joint", "staged", "policy")
TEST_SEED = 0  # every arm and seed is evaluated on the same held-out items (those of the rule's test split)


def rule_path() -> Path:
    """The rule's measurement of the task (benchmarks/topology_rule.py --task TASK writes it)."""
    return OUT / f"rule-{TASK}.json"


def train_section(arm: str, seed: int, s: argparse.Namespace) -> dict[str, Any]:
    """The `train:` section of one arm (validated by the registry's algorithm model, as in a YAML file)."""
    # eval_n 1: the loop's own end-of-run evaluation is a token one; `evaluate` below measures every arm alike
    common = {"task": TASK, "seed": seed, "max_minutes": s.minutes, "budget_clock": s.clock, "steps": 100_000,
              "queries_per_step": 4, "eval_every": 0, "eval_n": 1, "checkpoint_every": 100_000}
    nodes = {"flow_grpo": {"group_size": 8, "lr": 0.001, "temperature": 0.7,
                           "credit": {"format_weight": s.format_weight}}}
    hrpo = {"lr": s.hrpo_lr, "omega": 0.5}
    return {"topology": {"algorithm": "hrpo", "hrpo": hrpo},
            "gptswarm": {"algorithm": "reinforce", "reinforce": {"lr": s.hrpo_lr}},
            "cost": {"algorithm": "hrpo", "hrpo": {**hrpo, "cost_lambda": s.cost_lambda}},
            "joint": {"algorithm": "joint", "hrpo": hrpo, "schedule": "simultaneous", **nodes},
            "staged": {"algorithm": "joint", "hrpo": {**hrpo, "no_signal": "skip"}, "schedule": "staged",
                       "stages": {"topology_steps": s.topology_steps, "node_topology": s.node_topology}, **nodes},
            "policy": {"algorithm": "flow_grpo", **nodes}}[arm] | common


def fixed_route_yaml(raw: dict[str, Any], decisions: dict[str, str]) -> dict[str, Any]:
    """The supergraph with its decisions taken: the route's nodes and the edges its view keeps, no topology."""
    from masgraph.graph import compile_spec
    from masgraph.graph.space import DecisionSpace
    from masgraph.loader import parse_spec

    graph = compile_spec(parse_spec(yaml.safe_dump(raw, sort_keys=False)), GRAPH)
    space = DecisionSpace(graph)
    view = graph.view(space.topology(space.config_of(decisions)))
    kept = {(e.source, e.target, e.when) for edges in view.out_edges.values() for e in edges}
    nodes = {n for edge in kept for n in edge[:2]}
    return {**{k: v for k, v in raw.items() if k != "topology"},
            "nodes": {n: s for n, s in raw["nodes"].items() if n in nodes},
            "edges": [e for e in raw["edges"] if (e["source"], e["target"], e.get("when")) in kept]}


def route_of(trace: Any, order: list[str]) -> str:
    """The route an episode took, named like the rule's routes (its nodes in spec order)."""
    ran = {s.node for s in trace.steps}
    return "→".join(n for n in order if n in ran)


def evaluate(graph: Any, backend: Any, topology: Any, n: int) -> dict[str, Any]:
    """Greedy held-out evaluation: per query type accuracy, completion tokens per episode, parse-failed episodes
    and the routes taken."""
    from topology_rule import by_type, run_route, stats  # the rule's fixed routes are measured the same way

    from masgraph.tasks import get_task

    traces = run_route(graph, backend, topology, get_task(TASK), "test", n, TEST_SEED)
    order = list(graph.spec.nodes)
    return {k: {**dict(zip(("acc", "tokens", "n", "parse_failed"), stats(v))),
                "errors": sum(t.status != "ok" for t in v),
                "routes": dict(Counter(route_of(t, order) for t in v).most_common())}
            for k, v in by_type(traces).items()}


def run_arm(arm: str, seed: int, s: argparse.Namespace) -> dict[str, Any]:
    """Train one arm for `s.minutes` and evaluate it; returns (and writes) its record."""
    from masgraph.backends.hf import HFBackend
    from masgraph.events import TrainStep
    from masgraph.graph import compile_spec
    from masgraph.loader import parse_spec
    from masgraph.tasks import get_task
    from masgraph.trainers.loop import TrainLoop

    raw = yaml.safe_load((ROOT / GRAPH).read_text())
    if arm == "policy":
        rule = json.loads(rule_path().read_text())
        raw = fixed_route_yaml(raw, rule["routes"][rule["best_single"]]["decisions"])
    raw["train"] = train_section(arm, seed, s)
    graph = compile_spec(parse_spec(yaml.safe_dump(raw, sort_keys=False), GRAPH), GRAPH)
    rows: list[dict[str, Any]] = []

    class Keep:
        def emit(self, event: Any) -> None:
            if isinstance(event, TrainStep):
                rows.append({"step": event.step, **event.metrics})
                m = event.metrics
                print(f"[{arm} s{seed}] step {event.step}  acc(train) {m.get('accuracy/train', 0):.3f}  "
                      f"tokens {m.get('tokens', 0):.0f}  {m.get('time/train_s', 0) / 60:.1f} min", flush=True)

    out = OUT / TASK / s.tag
    run_dir = out / f"{arm}-s{seed}"
    loop = TrainLoop(graph, get_task(TASK), run_dir, sinks=[Keep()])
    t0 = time.perf_counter()
    asyncio.run(loop.run())
    wall = time.perf_counter() - t0
    backend = loop.eval_backend
    if isinstance(backend, HFBackend):
        backend.deterministic = False  # batched greedy, as the rule's fixed routes were measured
    t1 = time.perf_counter()
    result = evaluate(graph, backend, loop.topology, s.eval_n)
    record = {"arm": arm, "seed": seed, "minutes": s.minutes, "clock": s.clock, "steps": loop.step,
              "train_s": loop.train_seconds, "hrpo_lr": s.hrpo_lr if arm != "policy" else None,
              "wall_s": wall, "eval_s": time.perf_counter() - t1, "eval": result, "curve": rows,
              "cost_lambda": s.cost_lambda if arm == "cost" else 0.0, "threads": _threads(),
              "topology_steps": s.topology_steps if arm == "staged" else None,
              "format_weight": s.format_weight if arm in ("staged", "joint", "policy") else None,
              "node_topology": s.node_topology if arm == "staged" else None,
              "policy_probabilities": _per_type_probabilities(rows)}
    (out / f"{arm}-s{seed}.json").write_text(json.dumps(record, indent=1))
    a = result["all"]
    print(f"[{arm} s{seed}] {loop.step} steps in {loop.train_seconds / 60:.1f} min: held-out acc {a['acc']:.3f} "
          f"tokens/episode {a['tokens']:.0f} parse-failed {a['parse_failed']:.3f}", flush=True)
    return record


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _per_type_probabilities(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The last step's topology probabilities (per query type when the task has types)."""
    return {k: v for k, v in (rows[-1] if rows else {}).items() if k.startswith("topology/")}


# ---- the report ---------------------------------------------------------------------------------------------------
def steps_to(curve: list[dict[str, Any]], frac: float = 0.9, window: int = 5) -> tuple[int | None, float]:
    """First step at which the training accuracy (mean over the last `window` steps) reaches `frac` of its final
    windowed value; and that final value."""
    acc = [r["accuracy/train"] for r in curve if "accuracy/train" in r]
    if not acc:
        return None, 0.0
    smooth = [sum(acc[max(0, i - window + 1):i + 1]) / len(acc[max(0, i - window + 1):i + 1]) for i in range(len(acc))]
    final = smooth[-1]
    return next((i + 1 for i, v in enumerate(smooth) if v >= frac * final), None), final


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _sd(xs: list[float]) -> float:
    """Sample standard deviation (0 for one value)."""
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _runs(tag: str) -> dict[str, list[dict[str, Any]]]:
    """arm -> the finished runs' records under runs/bench-topology/TASK/TAG/."""
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in sorted((OUT / TASK / tag).glob("*-s*.json")):
        r = json.loads(path.read_text())
        runs[r["arm"]].append(r)
    if not runs:
        raise SystemExit(f"error: no finished runs under {OUT / TASK / tag}")
    return runs


def _longer_verdict(short: list[dict[str, Any]], long: list[dict[str, Any]]) -> str:
    """Issue 25's 'policy-only keeps its gains': the longer budget's mean ≥ the shorter's, within the spread (the
    larger of the two arms' sd)."""
    a, b = [r["eval"]["all"]["acc"] for r in short], [r["eval"]["all"]["acc"] for r in long]
    (m1,), (m2,) = {r["minutes"] for r in short}, {r["minutes"] for r in long}
    slack = max(_sd(a), _sd(b))
    return (f"5. policy-only at {m2:g} min {_mean(b):.1%} ({', '.join(f'{x:.1%}' for x in b)}) vs at {m1:g} min "
            f"{_mean(a):.1%} ({', '.join(f'{x:.1%}' for x in a)}): {100 * (_mean(b) - _mean(a)):+.1f} points; target "
            f"longer ≥ shorter − the larger sd ({100 * slack:.1f} points): "
            f"{'MET' if _mean(b) >= _mean(a) - slack else 'MISSED'}.")


def report(record: bool, tag: str = "", longer: str | None = None) -> str:
    rule = json.loads(rule_path().read_text()) if rule_path().exists() else None
    runs = _runs(tag)
    long_runs = _runs(longer)["policy"] if longer is not None else []
    if longer is not None and not (long_runs and runs["policy"]):
        raise SystemExit(f"error: --longer compares the policy arm of two tags; {tag!r} and {longer!r} need one each")
    first = next(iter(runs.values()))[0]["eval"]
    types = sorted(k for k in first if k != "all")
    if rule is not None:
        single, oracle = rule["single_acc"], rule["oracle_acc"]
        best = rule["routes"][rule["best_single"]]["test"]["all"]
        head = (f"Held-out: {best[2]} items of `{TASK}` ({', '.join(types)}), greedy, batched decoding. Fixed routes "
                f"from {rule_path().relative_to(ROOT)}: best single route `{rule['best_single']}` {single:.1%} "
                f"({best[1]:.0f} tokens/episode); oracle router {oracle:.1%} (per type: {rule['oracle']}).\n")
    else:
        head = (f"Held-out: {first['all']['n']} items of `{TASK}` ({', '.join(types)}), greedy, batched decoding. "
                f"No fixed-route references ({rule_path().relative_to(ROOT)} absent: benchmarks/topology_rule.py not "
                "run for this task).\n")
    out = [head,
           "| arm | seed | steps | train min | held-out acc | " + " | ".join(types)
           + " | tokens/episode | parse-failed episodes | route taken per type (share) |",
           "|---|---|---|---|---|" + "---|" * len(types) + "---|---|---|"]
    long_arm = f"policy {long_runs[0]['minutes']:g} min" if long_runs else ""
    rows = [(arm, r) for arm in ARMS for r in sorted(runs.get(arm, []), key=lambda r: r["seed"])]
    rows += [(long_arm, r) for r in sorted(long_runs, key=lambda r: r["seed"])]
    for arm, r in rows:
        e = r["eval"]
        routes = "; ".join(f"{k}: " + ", ".join(f"{rt} {c / e[k]['n']:.0%}"
                                                for rt, c in list(e[k]["routes"].items())[:2]) for k in types)
        out.append(f"| {arm}{' λ=' + str(r['cost_lambda']) if r['cost_lambda'] else ''} | {r['seed']} | "
                   f"{r['steps']} | {r['train_s'] / 60:.1f} | **{e['all']['acc']:.1%}** | "
                   + " | ".join(f"{e[k]['acc']:.0%}" for k in types)
                   + f" | {e['all']['tokens']:.0f} | {e['all']['parse_failed']:.1%} | {routes} |")
    acc = {arm: [r["eval"]["all"]["acc"] for r in runs.get(arm, [])] for arm in ARMS}
    out += ["", "| arm | seeds | mean held-out acc | sd | min | max |", "|---|---|---|---|---|---|"]
    shown = acc | {long_arm: [r["eval"]["all"]["acc"] for r in long_runs]}
    out += [f"| {arm} | {len(a)} | **{_mean(a):.1%}** | {100 * _sd(a):.1f} points | {min(a):.1%} | {max(a):.1%} |"
            for arm, a in shown.items() if a]
    verdicts = []
    if acc["topology"] and rule is not None:
        rec = [(a - single) / (oracle - single) if oracle > single else float("nan") for a in acc["topology"]]
        verdicts.append(f"1. Topology-only recovers {', '.join(f'{x:.0%}' for x in rec)} of the oracle's headroom "
                        f"({100 * (oracle - single):+.1f} points over the best single route) per seed; target ≥ 50 %: "
                        f"{'MET' if min(rec) >= 0.5 else 'MISSED'}.")
    for arm in ("joint", "staged"):
        if not (acc[arm] and acc["topology"]):
            continue
        j, t = _mean(acc[arm]), _mean(acc["topology"])
        parts = [("topology-only", t)] + ([("policy-only", _mean(acc["policy"]))] if acc["policy"] else [])
        top = max(v for _, v in parts)
        worst = min(acc[arm]) - t
        verdicts.append(f"2. {arm} {j:.1%} vs " + " vs ".join(f"{n} {v:.1%}" for n, v in parts) + " (means over "
                        f"seeds); target ≥ max + 3 points: {'MET' if j >= top + 0.03 else 'MISSED'} "
                        f"({100 * (j - top):+.1f} points"
                        + ("" if acc["policy"] else "; policy-only not measured in this tag") + "); no seed more "
                        f"than 3 points below topology-only's mean: {'MET' if worst >= -0.03 else 'MISSED'} "
                        f"(worst seed {100 * worst:+.1f} points).")
    if acc["gptswarm"] and acc["topology"]:
        parts = []
        for arm in ("topology", "gptswarm"):
            st = [steps_to(r["curve"]) for r in sorted(runs[arm], key=lambda r: r["seed"])]
            parts.append(f"{'HRPO' if arm == 'topology' else 'GPTSwarm-style'}: steps to 90 % of final training "
                         f"accuracy {[s for s, _ in st]} (final windowed train acc "
                         f"{', '.join(f'{f:.1%}' for _, f in st)}), held-out {', '.join(f'{a:.1%}' for a in acc[arm])}")
        verdicts.append("3. " + "; ".join(parts) + ".")
    if acc["cost"] and acc["topology"] and rule is not None:
        tok = {arm: _mean([r["eval"]["all"]["tokens"] for r in runs[arm]]) for arm in ("cost", "topology")}
        most = max(rule["routes"].values(), key=lambda v: v["test"]["all"][1])["test"]["all"]
        ratio, loss = tok["cost"] / tok["topology"], _mean(acc["topology"]) - _mean(acc["cost"])
        ok_most, ok_zero = tok["cost"] / most[1] <= 0.7 and loss <= 0.02, ratio <= 0.7 and loss <= 0.02
        per_seed = ", ".join(f"{r['eval']['all']['acc']:.1%} at {r['eval']['all']['tokens']:.0f} tokens"
                             for r in sorted(runs["cost"], key=lambda r: r["seed"]))
        verdicts.append(f"4. Cost-aware (λ={runs['cost'][0]['cost_lambda']}; seeds: {per_seed}): {tok['cost']:.0f} "
                        f"tokens/episode vs {tok['topology']:.0f} for λ=0 ({ratio:.2f}x) at {100 * loss:+.1f} points "
                        f"accuracy loss; the most expensive fixed route (every optional node on one route) spends "
                        f"{most[1]:.0f} ({tok['cost'] / most[1]:.2f}x) at {most[0]:.1%}; target ≤ 0.7x of it at ≤ 2 "
                        f"points loss against λ=0: {'MET' if ok_most else 'MISSED'}"
                        f"; ≤ 0.7x of λ=0's tokens at ≤ 2 points: {'MET' if ok_zero else 'MISSED'}.")
    if long_runs:
        verdicts.append(_longer_verdict(runs["policy"], long_runs))
    text = "\n".join(out) + "\n\n" + "\n".join(verdicts) + "\n"
    print(text)
    if record:
        rs = [r for rs in runs.values() for r in rs]
        minutes, clock = sorted({r["minutes"] for r in rs}), sorted({r.get("clock", "wall") for r in rs})
        lrs = sorted({r.get("hrpo_lr") or 0.1 for r in rs if r["arm"] != "policy"})
        lams = sorted({r["cost_lambda"] for r in runs.get("cost", [])})
        flags = (f"--minutes {minutes[0] if len(minutes) == 1 else minutes} --clock {'/'.join(clock)} --hrpo-lr "
                 f"{'/'.join(map(str, lrs))}" + (f" --cost-lambda {'/'.join(map(str, lams))}" if lams else "")
                 + (f" --topology-steps {runs['staged'][0]['topology_steps']}" if runs.get("staged") else "")
                 + "".join(f" --{k.replace('_', '-')} {'/'.join(map(str, sorted({r[k] for r in rs if r.get(k)})))}"
                           for k in ("format_weight", "node_topology")
                           if any(r.get(k) not in (None, 0.0, "sample") for r in rs))
                 + (f" --tag {tag}" if tag else "") + (f" (and `--longer {longer}`)" if longer else ""))
        with open(results_file("topology"), "a") as f:
            f.write(f"\n### Topology + joint training on `{TASK}` ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
                    f"`python benchmarks/topology.py all --task {TASK} --arms "
                    f"{' '.join(a for a in ARMS if a in runs)} {flags}` — "
                    f"each arm {minutes} min of training ({'/'.join(clock)} clock) per seed, its seeds side by side, "
                    f"one CPU thread each. {text}")
    return text


def run_all(args: argparse.Namespace) -> int:
    """Each arm's seeds as side-by-side processes with one thread each, arm after arm; then the report."""
    out = OUT / TASK / args.tag
    out.mkdir(parents=True, exist_ok=True)
    if "policy" in args.arms and not rule_path().exists():
        print(f"error: the policy arm trains the rule's best single route, but {rule_path().relative_to(ROOT)} is "
              f"missing; run benchmarks/topology_rule.py --task {TASK} first", file=sys.stderr)
        return 2
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for arm in args.arms:
        procs = []
        for seed in args.seeds:
            log = open(out / f"{arm}-s{seed}.log", "w")
            cmd = [sys.executable, __file__, "run", arm, "--seed", str(seed), "--minutes", str(args.minutes),
                   "--eval-n", str(args.eval_n), "--cost-lambda", str(args.cost_lambda), "--clock", args.clock,
                   "--hrpo-lr", str(args.hrpo_lr), "--topology-steps", str(args.topology_steps), "--tag", args.tag,
                   "--task", TASK, "--format-weight", str(args.format_weight),
                   "--node-topology", args.node_topology]
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        print(f"{arm}: seeds {args.seeds} running (logs in {out.relative_to(ROOT)}/{arm}-s*.log)", flush=True)
        codes = [p.wait() for p, _ in procs]
        for _, log in procs:
            log.close()
        if any(codes):
            print(f"error: arm {arm} failed (exit codes {codes}); see its logs", file=sys.stderr)
            return 1
    report(not args.no_record, args.tag)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "all"):
        s = sub.add_parser(name)
        if name == "run":
            s.add_argument("arm", choices=ARMS)
            s.add_argument("--seed", type=int, default=0)
        else:
            s.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
            s.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
            s.add_argument("--no-record", action="store_true")
        s.add_argument("--minutes", type=float, default=10.0)
        s.add_argument("--eval-n", type=int, default=210)
        s.add_argument("--cost-lambda", type=float, default=2.0,
                       help="λ of the `cost` arm: reward = accuracy − λ · completion tokens / 1000")
        s.add_argument("--hrpo-lr", type=float, default=0.1, help="`hrpo.lr` of every topology arm")
        s.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                       help="what --minutes counts: the process's CPU time (default) or wall-clock")
        s.add_argument("--topology-steps", type=int, default=20,
                       help="`stages.topology_steps` of the `staged` arm (HRPO alone first, for this many steps)")
        s.add_argument("--format-weight", type=float, default=0.0,
                       help="`flow_grpo.credit.format_weight` of the arms that train nodes (each node's own format "
                       "advantage)")
        s.add_argument("--node-topology", choices=("sample", "greedy"), default="sample",
                       help="`stages.node_topology` of the `staged` arm (how its node stage rolls out the held "
                            "topology)")
        s.add_argument("--tag", default="", help="write (and report) runs under runs/bench-topology/TASK/TAG/")
    r = sub.add_parser("report")
    r.add_argument("--no-record", action="store_true")
    r.add_argument("--tag", default="")
    r.add_argument("--longer", metavar="TAG", help="a tag whose policy arm ran a longer budget: adds the 'policy-only "
                   "keeps its gains' verdict (issue 25) against this tag's policy arm")
    for q in (*sub.choices.values(),):
        q.add_argument("--task", default="mixed_routes", choices=("mixed_routes", "mixed_skills"),
                       help="the mixed task (default mixed_routes)")
    args = p.parse_args()
    global TASK
    TASK = args.task
    OUT.mkdir(parents=True, exist_ok=True)
    if args.cmd == "run":
        (OUT / TASK / args.tag).mkdir(parents=True, exist_ok=True)
        run_arm(args.arm, args.seed, args)
        return 0
    if args.cmd == "all":
        return run_all(args)
    report(not args.no_record, args.tag, args.longer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
