"""What a `memory_updates` training run's manager did, and what its counterfactual scores said, by kind of fact.

Reads a run directory of `benchmarks/memory.py` (or `masgraph train graphs/memory.yaml`): the stored rollouts and
the credit lines of each training step. Prints, per step, the operations the manager applied to each kind of fact
(home, move, visit, small talk; ERR: no operation parsed, the fact added) and the share of each that was NOOP (does
the manager skip visits more often than homes?); then, over the decisions whose scores differed (the run trained
with `counterfactual`), which operation scored best, by kind; then the visits on which ADD beat NOOP, by whom they
were about (the asked person? the mover?) and where the visit stood against the move.

With `--rows`: what each step's update pushed. The step's training rows are rebuilt from the stored rollouts and
credit lines with the run's own knobs (`flow_grpo.build_rows`), and per kind of fact the mean advantage of the
sampled calls by operation is printed (NOOP above ADD on visits and below it on homes is the signal to learn),
then the shares of the step's token-weighted |advantage| (the loss is a token mean) that the format term, the
decision term (the counterfactual advantage and the alternatives' rows) and the outcome and step terms carry: where
the update's direction comes from.

    .venv/bin/python benchmarks/memory_signal.py runs/bench-learns-memory-memory_updates-s0-*
    .venv/bin/python benchmarks/memory_signal.py --rows runs/bench-learns-memory-memory_updates-s1-*
    .venv/bin/python benchmarks/memory_signal.py --rows --set counterfactual.norm=true RUN  # what-if, same rollouts

Analysis only (no model is loaded); the numbers of results/memory.md's memory round 7 and 8 readings come from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

from learns import knob_overrides
from pydantic import ValidationError

from masgraph.learn.counterfactual import META
from masgraph.rundir.store import read_jsonl, read_traces
from masgraph.trace import MemoryOp, Trace
from masgraph.trainers.config import FlowGRPOConfig, with_overrides
from masgraph.trainers.flow_grpo import build_rows


def kind(fact: str) -> str:
    """The kind of a `memory_updates` fact: home, move, visit, or talk."""
    return ("home" if " lives in " in fact else "move" if " moved to " in fact
            else "visit" if " visited " in fact else "talk")


def applied(op: MemoryOp) -> str:
    """The operation as written, or ERR when none could be parsed (the fact was added)."""
    return "ERR" if op.error and "no operation" in op.error else op.op


def credit_lines(run: Path) -> list[dict]:
    """The run's credit lines (one per trained episode: its step and counterfactual scores), by step. A step killed
    after some of its credit lines were written is redone on resume (`memory.py --resume`) with new rollouts: each
    step keeps only the block of its last attempt (a block ends where the next attempt's episodes start)."""
    blocks: dict[int, list[dict]] = {}
    current = None  # the step whose block is being read
    for e in read_jsonl(run / "events.jsonl"):
        if e.get("kind") == "episode_started":
            current = None
        elif e.get("kind") == "credit":
            if e["step"] != current:
                current, blocks[e["step"]] = e["step"], []
            blocks[current].append(e)
    return [e for step in sorted(blocks) for e in blocks[step]]


def visit_place(trace: Trace, fact: str) -> str:
    """Whom a visit was about (the asked person or another; a mover or a stayer) and where it stood to the move."""
    name = fact.split(" visited ")[0]
    lines = trace.query.splitlines()
    asked = "asked" if name in lines[-1] else "other"
    moved = [i for i, x in enumerate(lines) if x.startswith(name + " moved to ")]
    if not moved:
        return f"{asked}, stayer"
    here = next(i for i, x in enumerate(lines) if x == fact)
    return f"{asked}, mover, visit {'before' if here < moved[0] else 'after'} the move"


def scored(trace: Trace, line: dict) -> Trace:
    """`trace` with its credit line's counterfactual records under META, as the update read them."""
    return trace.model_copy(update={"meta": {**trace.meta, META: line.get("counterfactual", [])}})


def step_batches(run: Path) -> dict[int, list[Trace]]:
    """Training step -> the step's rollouts, each with its credit line's counterfactual scores (`scored`), in the
    order they were credited."""
    traces = {t.episode_id: t for t in read_traces(run / "events.jsonl")}
    out: dict[int, list[Trace]] = defaultdict(list)
    for e in credit_lines(run):
        if e["episode_id"] in traces:
            out[e["step"]].append(scored(traces[e["episode_id"]], e))
    return out


def print_rows(run: Path, overrides: dict | None = None) -> None:
    """Per step: the sampled calls' mean advantage by kind of fact and operation, and each credit term's share of
    the token-weighted |advantage| (see the module docstring); with `overrides` (flow_grpo knobs) what the same
    rollouts and scores would have given under them. A term's part of a row is what the row loses when the rows
    are built again with that term's weight at 0 (`build_rows` itself, so the split follows the trainer's rules)."""
    knobs = json.loads((run / "config.json").read_text())["config"]["train"]["flow_grpo"]
    config = with_overrides(knobs, overrides or {})  # an older run's flat knobs too
    without_format = with_overrides(config, {"credit": {"format_weight": 0.0}})
    without_decision = with_overrides(config, {"counterfactual": {"weight": 0.0}})
    batches = step_batches(run)
    lengths = {c.text.strip(): len(c.completion_ids) for trs in batches.values() for t in trs for s in t.steps
               for c in s.llm if c.completion_ids}  # the tokens of an alternative's row, from a call that wrote it
    trainable = {"memory": "memory"}

    def encode(text: str) -> list[int]:
        return [0] * (lengths.get(text.strip(), 5) - 1)

    def advantages(trs: list[Trace], cfg: FlowGRPOConfig) -> dict[tuple, float]:
        return {(r.traj, r.step, r.call, r.alternative): r.advantage for r in build_rows(trs, trainable, cfg, encode)}

    print(f"== {run}: per step, each credit term's share of |A| x tokens; by kind of fact, each operation's mean "
          "advantage (its rows)")
    for step, trs in sorted(batches.items()):
        rows = build_rows(trs, trainable, config, encode)
        no_format, no_decision = advantages(trs, without_format), advantages(trs, without_decision)
        pushed: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        fmt_mass = decision_mass = outcome_mass = 0.0
        for r in rows:
            n, key = len(r.completion_ids), (r.traj, r.step, r.call, r.alternative)
            f, d = r.advantage - no_format.get(key, 0.0), r.advantage - no_decision.get(key, 0.0)
            fmt_mass, decision_mass = fmt_mass + abs(f) * n, decision_mass + abs(d) * n
            outcome_mass += abs(r.advantage - f - d) * n  # the episode and step terms (none for a replaced call)
            if r.alternative is not None:
                continue
            s = next(s for s in trs[r.traj].steps if s.index == r.step)
            if r.call < len(s.memory_ops):
                op = s.memory_ops[r.call]
                pushed[kind(op.fact)][applied(op)].append(r.advantage)
        total = max(fmt_mass + decision_mass + outcome_mass, 1e-12)
        print(f"  step {step}: {len(rows)} rows; share of |A| x tokens: format {fmt_mass / total:.0%}, decision "
              f"{decision_mass / total:.0%}, outcome and step {outcome_mass / total:.0%}")
        for k, by_op in sorted(pushed.items()):
            print(f"    {k}: " + "  ".join(f"{o} {statistics.mean(v):+.2f} ({len(v)})"
                                           for o, v in sorted(by_op.items())))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories")
    p.add_argument("--rows", action="store_true",
                   help="per step: each credit term's share of the update, the mean advantage by kind of fact and op")
    p.add_argument("--set", nargs="*", default=[], metavar="KNOB=VALUE",
                   help="with --rows: flow_grpo knobs in place of the run's (what the same rollouts would have given)")
    args = p.parse_args()
    if args.rows:
        for run in args.runs:
            if not (run / "config.json").exists():
                print(f"error: {run} has no config.json (not a run directory)", file=sys.stderr)
                return 1
            try:
                print_rows(run, knob_overrides(args.set))
            except ValidationError as exc:  # a --set knob that is not one, or a value it does not take
                print(f"error: --set {' '.join(args.set)}: {exc}", file=sys.stderr)
                return 1
        return 0
    winners: dict[str, Counter] = defaultdict(Counter)
    add_wins: Counter = Counter()
    for run in args.runs:
        if not (run / "events.jsonl").exists():
            print(f"error: {run} has no events.jsonl (not a run directory)", file=sys.stderr)
            return 1
        traces = {t.episode_id: t for t in read_traces(run / "events.jsonl")}
        ops: dict[int, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
        for e in credit_lines(run):
            trace = traces.get(e["episode_id"])
            if trace is None:
                continue
            scores: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
            for step_index, call, alternative, reward in e.get("counterfactual", []):
                scores[(step_index, call)][alternative.strip()] = reward
            for s in trace.steps:
                for c, op in enumerate(s.memory_ops):
                    fact_kind, written = kind(op.fact), applied(op)
                    ops[e["step"]][fact_kind][written] += 1
                    scored = scores.get((s.index, c))
                    if not scored or trace.reward is None:
                        continue
                    # with probe questions the call's own score is recorded under its own text: the operation applied
                    own = s.llm[c].text.strip() if c < len(s.llm) else None
                    q = {written if alt == own else alt.rsplit(": ", 1)[-1]: v for alt, v in scored.items()}
                    q.setdefault(written, trace.reward)
                    if len(set(q.values())) > 1:
                        best = max(q.values())
                        winners[fact_kind]["+".join(sorted(a for a, v in q.items() if v == best))] += 1
                    if fact_kind == "visit" and q.get("ADD") == 1.0 and q.get("NOOP") == 0.0:
                        add_wins[visit_place(trace, op.fact)] += 1
        print(f"== {run}")
        for step in sorted(ops):
            print(f"  step {step}: " + "  ".join(f"{k}: " + ", ".join(f"{o} {n}" for o, n in v.most_common())
                                                for k, v in sorted(ops[step].items())))
            print("    NOOP share: " + "  ".join(f"{k} {v['NOOP'] / max(1, v.total()):.0%}"
                                                for k, v in sorted(ops[step].items())))
    print("decisions whose counterfactual scores differed, the best operation(s) by kind of fact (all runs):")
    for k, c in sorted(winners.items()):
        print(f"  {k}: " + ", ".join(f"{w} {n}" for w, n in c.most_common()))
    print("visits on which ADD scored 1 and NOOP 0, by whom and where:")
    for place, n in add_wins.most_common():
        print(f"  {place}: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
