"""A memory that learns (issue 27, Memory-R1): does an RL-trained memory manager beat the rule-based memories?

`graphs/memory.yaml` on `memory_updates` (a stream of facts with a move, visits and small talk, then "where does X
live now?", people held out from training). Arms, each scored greedy on the same held-out items per seed, with the
same frozen reader and the same recall (the reader sees the `recall` entries that share most words with the question:
2 in the shipped graph, `--recall` sets it for every arm):

    append     the memory node keeps every fact (`mode: append`)
    last_k     it keeps the newest --keep facts (`mode: last_k`)
    untrained  the manager's policy as shipped (`mode: manager`, base model, no adapter training)
    trained    the same after Flow-GRPO on the manager's adapter for --minutes of this process's CPU time
    oracle     reference only: the store a perfect manager keeps (homes added, the move an update, the rest
               skipped), built by rule from the item's lines: what the reader can do with an ideal memory
    skip_visits, update_moves   (--rules) reference only: append without the visits / append with the move
               replacing the home: what learning one part of the oracle's behaviour is worth

Training is `benchmarks/learns.py`'s run (its step-0 evaluation is the `untrained` arm, on the same items). It
checkpoints every step, so a run stopped between steps (Ctrl-C, kill, the end of a session) loses at most the step
under way: `--resume RUN ... --minutes M` continues it, on its own graph, knobs and seed, until its CPU time in all is
M minutes, and scores the arms again (a longer budget for a finished run is the same command).

    .venv/bin/python benchmarks/memory.py --seeds 0 1 2 --minutes 30 [--set credit.advantage=episode+step]
    .venv/bin/python benchmarks/memory.py --resume runs/bench-learns-memory-memory_updates-s0-... --minutes 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

from learns import knob_overrides, train
from results_file import results_file

from masgraph.backends.hf import HFBackend
from masgraph.errors import MasgraphError
from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.rundir.checkpoint import resolve_checkpoint
from masgraph.runtime.runner import RunConfig, Runner
from masgraph.spec import GraphSpec
from masgraph.tasks import Item, Task, get_task
from masgraph.trainers.checkpoints import read_train_state
from masgraph.trainers.config import SECTIONS, FlowGRPOConfig, migrate_flow_grpo

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TASK = "memory_updates"


class RuleStore(Task):
    """The task's items with the facts a rule-following manager keeps (reference arms, built from the item's lines):
    the oracle keeps each home and makes the move replace it, skipping the rest; `skip_visits` adds every fact but
    the visits; `update_moves` adds every fact but makes the move replace the mover's home. Each says what learning
    one part of the oracle's behaviour is worth to this reader."""

    def __init__(self, base: Task, skip_visits: bool, update_moves: bool, skip_talk: bool, name: str):
        self.base, self.skip_visits, self.update_moves, self.skip_talk = base, skip_visits, update_moves, skip_talk
        self.name = f"memory_updates_{name}"

    def items(self, split: str, n: int, seed: int = 0) -> list[Item]:
        out = []
        for it in self.base.items(split, n, seed):
            *facts, question = it.question.splitlines()
            kept: list[str] = []
            for fact in facts:
                visit, home, move = " visited " in fact, " lives in " in fact, re.match(r"(.+) moved to ", fact)
                talk = not (visit or home or move)
                if move and self.update_moves:
                    kept[next(k for k, x in enumerate(kept) if x.startswith(move.group(1) + " lives in"))] = fact
                elif not (visit and self.skip_visits or talk and self.skip_talk):
                    kept.append(fact)
            out.append(Item(it.id, "\n".join([*kept, question]), it.answer, it.meta))
        return out

    def score(self, item: Item, answer: str) -> float:
        return self.base.score(item, answer)


def OracleStore(base: Task) -> RuleStore:  # noqa: N802 (a Task, named as one)
    """The store a perfect manager keeps: each home, the move replacing its entry, nothing else."""
    return RuleStore(base, skip_visits=True, update_moves=True, skip_talk=True, name="oracle")


RULES = {"skip_visits": {"skip_visits": True, "update_moves": False, "skip_talk": False},
         "update_moves": {"skip_visits": False, "update_moves": True, "skip_talk": False}}
"""Reference arms of `--rules`: one part each of the oracle's behaviour, the rest as append."""


def with_memory(spec: GraphSpec, **update: object) -> GraphSpec:
    """The graph with its memory node's fields changed (`mode`, `keep`, `recall`)."""
    node = spec.nodes["memory"].model_copy(update=update)
    return spec.model_copy(update={"nodes": {**spec.nodes, "memory": node}})


def evaluate(spec: GraphSpec, task: Task, seed: int, n: int, backend: HFBackend, split: str = "test") -> float:
    """Greedy accuracy on `split` (held-out: test), deterministic decoding (as the training loop evaluates)."""
    with tempfile.TemporaryDirectory() as runs:
        runner = Runner(compile_spec(spec), RunConfig(split=split, n=n, seed=seed, deterministic=True,
                                                      concurrency=32, runs_dir=runs), backends={"hf": backend})
        result = asyncio.run(runner.run_task(task))
    return sum(t.reward or 0.0 for t in result.traces) / len(result.traces)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graph", default=None, help="default graphs/memory.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2")
    p.add_argument("--minutes", type=float, default=30.0,
                   help="training budget per seed, CPU minutes (with --resume: in all, the resumed run's included)")
    p.add_argument("--eval-n", type=int, default=60)
    p.add_argument("--keep", type=int, default=4, help="last_k's k")
    p.add_argument("--recall", type=int, default=None,
                   help="how many entries the reader is shown, in every arm (default: as the graph says)")
    p.add_argument("--set", nargs="*", default=[], metavar="KNOB=VALUE", help="flow_grpo knobs for the trained arm")
    p.add_argument("--no-train", action="store_true", help="the rule-based arms and the oracle only")
    p.add_argument("--rules", action="store_true", help="also the reference arms skip_visits (append without "
                   "the visits) and update_moves (append with the move replacing the home)")
    p.add_argument("--split", choices=("test", "train"), default="test",
                   help="the items the rule arms are scored on (train: is the gap there to learn from?); "
                   "needs --no-train")
    p.add_argument("--resume", type=Path, nargs="+", metavar="RUN",
                   help="continue these training runs of this script (one a seed) from their latest checkpoints to "
                   "--minutes in all, each with the graph, knobs and seed it was started with")
    p.add_argument("--record", type=Path, default=results_file("memory"))
    args = p.parse_args()
    if args.split != "test" and not args.no_train:
        p.error("--split train scores the rule arms only; add --no-train")
    if args.recall is not None and args.recall < 1:
        p.error(f"--recall must be 1 or more (got {args.recall})")
    if args.resume:
        clash = [o for o, v in (("--graph", args.graph), ("--seeds", args.seeds), ("--recall", args.recall),
                                ("--set", args.set), ("--no-train", args.no_train)) if v]
        if clash:
            p.error(f"--resume continues each run as it was started; drop {', '.join(clash)}")
        try:
            jobs = [resumable(run, args.minutes, args.eval_n) for run in args.resume]
        except (MasgraphError, ValueError) as e:
            p.exit(1, f"error: {e}\n")
        if len({j.knobs for j in jobs}) > 1:
            p.exit(1, "error: the runs to resume were trained with different knobs; resume them one at a time\n")
    else:
        edit = partial(with_memory, recall=args.recall) if args.recall is not None else None
        jobs = [Job(seed, args.graph or "graphs/memory.yaml", knob_overrides(args.set), tuple(args.set), edit)
                for seed in args.seeds or [0, 1, 2]]
    spec = load_spec(jobs[0].graph)
    spec = jobs[0].edit(spec) if jobs[0].edit else spec
    task = get_task(TASK)
    hf = next(pol for pol in spec.policies.values() if pol.backend == "hf")
    append, last_k = with_memory(spec, mode="append", keep=args.keep), with_memory(spec, mode="last_k", keep=args.keep)
    rows = []
    for job in jobs:
        seed = job.seed
        t0 = time.perf_counter()
        backend = HFBackend(hf.model, seed=seed, device=hf.device)
        score = partial(evaluate, seed=seed, n=args.eval_n, backend=backend, split=args.split)
        row = {"seed": seed, "append": score(append, task), "last_k": score(last_k, task),
               "oracle": score(append, OracleStore(task))}
        for name, rule in RULES.items() if args.rules else ():
            row[name] = score(append, RuleStore(task, **rule, name=name))
        del backend, score
        print(f"[seed {seed}] append {row['append']:.3f}  last_k {row['last_k']:.3f}  oracle {row['oracle']:.3f}  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if not args.no_train:
            # a checkpoint every step: a run stopped (or killed) between steps continues with --resume
            r = train(job.graph, TASK, seed, args.minutes, args.eval_n, check_rule=False, flow_grpo=job.overrides,
                      clock="cpu", edit=job.edit, checkpoint_every=1, resume=job.resume)
            row |= {"untrained": r["base"], "trained": r["trained"], "steps": r["steps"], "run": r["run_dir"]}
            print(f"[seed {seed}] untrained {r['base']:.3f}  trained {r['trained']:.3f} after {r['steps']} steps",
                  flush=True)
        rows.append(row)
    arms = (["append", "last_k", "oracle"] + (list(RULES) if args.rules else [])
            + ([] if args.no_train else ["untrained", "trained"]))
    lines = ["| seed | " + " | ".join(arms) + (" | trained − best rule | steps | run |" if not args.no_train else " |"),
             "|---" * (len(arms) + 1 + (3 if not args.no_train else 0)) + "|"]
    for r in rows:
        cells = [f"{r[a]:.1%}" for a in arms]
        if not args.no_train:
            gain = 100 * (r["trained"] - max(r["append"], r["last_k"]))
            cells += [f"**{gain:+.1f}**", str(r["steps"]), f"`{r['run']}`"]
        lines.append(f"| {r['seed']} | " + " | ".join(cells) + " |")
    means = [statistics.mean(r[a] for r in rows) for a in arms]
    sds = [statistics.stdev(r[a] for r in rows) if len(rows) > 1 else 0.0 for a in arms]
    lines.append("| mean (sd) | " + " | ".join(f"{m:.1%} ({100 * s:.1f})" for m, s in zip(means, sds)) + " |"
                 + (" | | |" if not args.no_train else ""))
    table = "\n".join(lines)
    print(table)
    knobs = jobs[0].knobs
    with open(args.record, "a") as f:
        f.write(f"\n### Memory: an RL-trained manager vs rule-based memories ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
                f"`{' '.join([Path(sys.executable).name, *sys.argv])}` — `{jobs[0].graph}` on `{TASK}`, {args.eval_n} "
                + ("held-out" if args.split == "test" else "**training-split**")
                + f" items per seed (greedy, deterministic), last_k keeps {args.keep}, the reader shown "
                + f"{spec.nodes['memory'].recall} entries"
                + ("" if args.no_train else f"; trained {args.minutes:g} CPU-min per seed"
                   + (" in all (resumed runs: the CPU time before the resume included)" if args.resume else "")
                   + (f" with {', '.join(knobs)}" if knobs else "")) + ".\n\n" + table + "\n")
    return 0


class Job(NamedTuple):
    """One seed's training run: a new one (`resume` None) or a stopped one continued."""

    seed: int
    graph: str
    overrides: dict
    knobs: tuple[str, ...]  # as the record names them: KNOB=VALUE
    edit: Callable[[GraphSpec], GraphSpec] | None = None
    resume: Path | None = None


def changed_knobs(flow_grpo: dict) -> tuple[str, ...]:
    """The knobs of a run's `flow_grpo` (an older run's flat keys moved to their sections) that differ from the
    defaults, as `--set` takes them: `lr=0.0003`, `ppo.num_mini_batches=12`."""
    def paths(d: dict, prefix: str = "") -> dict[str, object]:
        return {k: v for key, value in d.items() for k, v in (
            paths(value, f"{prefix}{key}.") if key in SECTIONS and isinstance(value, dict)
            else {prefix + key: value}).items()}

    shipped = paths(FlowGRPOConfig().model_dump())
    return tuple(f"{k}={v if isinstance(v, str) else json.dumps(v)}"
                 for k, v in paths(migrate_flow_grpo(flow_grpo)[0]).items() if v != shipped.get(k))


def resumable(run: Path, minutes: float, eval_n: int) -> Job:
    """The job that continues `run` (a run directory this script trained), or a ValueError / MasgraphError saying
    why it cannot: not such a run, no complete checkpoint, its budget already spent, or scored on other items."""
    config = run / "config.json"
    if not config.is_file() or not (run / "spec.yaml").is_file():
        raise ValueError(f"{run} is not a training run directory (no config.json and spec.yaml)")
    cfg = json.loads(config.read_text())["config"]
    if cfg.get("task") != TASK:
        raise ValueError(f"{run} trained on {cfg.get('task')!r}, not {TASK}")
    train_cfg = cfg["train"]
    if train_cfg.get("budget_clock") != "cpu":
        raise ValueError(f"{run} counted its budget on the {train_cfg.get('budget_clock')} clock, not the CPU's")
    if (n := train_cfg.get("eval_n")) != eval_n:
        raise ValueError(f"{run} was scored on {n} held-out items, not {eval_n}; pass --eval-n {n}")
    spent = read_train_state(resolve_checkpoint(run)).train_seconds / 60
    if spent >= minutes:
        raise ValueError(f"{run} has spent {spent:.1f} CPU-min already; --minutes {minutes:g} leaves nothing to train "
                         "(--minutes is the whole budget)")
    knobs = changed_knobs(train_cfg["flow_grpo"])
    return Job(train_cfg["seed"], str(run / "spec.yaml"), {}, knobs, resume=run)


if __name__ == "__main__":
    sys.exit(main())
