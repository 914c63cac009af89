"""How many plain supervised updates does the memory manager's LoRA need to skip visits and keep homes, on the
labels its own counterfactual scores gave? A diagnostic for issue 27's memory rounds, no claim.

Reads `benchmarks/memory.py` runs trained with `counterfactual` (ADD / NOOP alternatives): every manager decision
whose ADD and NOOP scores differed is a labelled row (the call's recorded prompt, the better operation). A fresh
LoRA of the manager's shape is fitted to the rows of the `--train` runs by cross-entropy (Adam, the RL runs' lr and
rows per update), and after every few updates each decision of the `--eval` run is classified by which of the two
completions the adapter gives the higher logprob (a two-way stand-in for greedy decoding). It prints, per update
count, the NOOP share on visits and on homes and the label accuracy: how far the labels alone move this model in
the number of updates an RL round makes (6-10 steps x 4 = 24-40).

    .venv/bin/python benchmarks/memory_fit.py --train runs/...-s0-* runs/...-s1-* --eval runs/...-s2-*
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from masgraph.backends.hf.learner import HFLearner
from masgraph.learn.learner import LoraConfigSpec
from masgraph.rundir.store import read_traces
from masgraph.trainers.credit import counterfactual_scores

sys.path.insert(0, str(Path(__file__).parent))
from memory_signal import credit_lines, kind, scored  # noqa: E402

OPS = ("Operation: ADD", "Operation: NOOP")
MANAGER = "memory"  # the manager node of graphs/memory.yaml


@dataclass
class Decision:
    prompt_ids: list[int]
    label: str  # one of OPS
    kind: str  # home | move | visit | talk
    stop: list[int]


@dataclass
class Row:
    prompt_ids: list[int]
    completion_ids: list[int]
    temperature: float = 1.0


def decisions(run: Path) -> list[Decision]:
    """The run's manager decisions whose ADD and NOOP scores differed, labelled with the better one; the scores
    as the trainer reads them (`credit.counterfactual_scores` on the trace with its credit line's records)."""
    traces = {t.episode_id: t for t in read_traces(run / "events.jsonl")}
    out: list[Decision] = []
    for e in credit_lines(run):
        trace = traces.get(e["episode_id"])
        if trace is None:
            continue
        trace = scored(trace, e)
        steps = {s.index: s for s in trace.steps}
        for (index, c), (_, q) in counterfactual_scores(trace, {MANAGER: list(OPS)}).items():
            if q[0] == q[1]:
                continue
            call, op = steps[index].llm[c], steps[index].memory_ops[c]
            stop = call.completion_ids[-1:] if call.finish_reason == "stop" else []
            out.append(Decision(call.prompt_ids, OPS[int(q[1] > q[0])], kind(op.fact), stop))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", nargs="+", type=Path, required=True, help="runs whose decisions are fitted")
    p.add_argument("--eval", nargs="+", type=Path, required=True, help="runs whose decisions are classified")
    p.add_argument("--updates", type=int, default=64)
    p.add_argument("--every", type=int, default=8, help="classify after every this many updates")
    p.add_argument("--batch", type=int, default=75, help="rows per update (the RL rounds: ~300 rows / 4)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eval-n", type=int, default=240, help="eval decisions classified (a fixed sample)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for run in args.train + args.eval:
        if not (run / "events.jsonl").exists():
            print(f"error: {run} has no events.jsonl (not a run directory)", file=sys.stderr)
            return 1
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    train = [d for r in args.train for d in decisions(r)]
    held = [d for r in args.eval for d in decisions(r)]
    held = rng.sample(held, min(args.eval_n, len(held)))
    if not train or not held:
        print("error: no decisions with differing ADD / NOOP scores (were the runs trained with counterfactual?)",
              file=sys.stderr)
        return 1
    learner = HFLearner("smollm2-135m", threads=torch.get_num_threads())
    tok = learner.weights.tokenizer
    enc = {o: tok.encode(o, add_special_tokens=False) for o in OPS}
    learner.add_adapter("memory", LoraConfigSpec())
    opt = torch.optim.Adam(learner.parameters("memory"), lr=args.lr)

    def count(ds: list[Decision]) -> str:
        by = {k: sum(d.label == OPS[1] for d in ds if d.kind == k) / max(1, sum(d.kind == k for d in ds))
              for k in ("visit", "home", "move")}
        return "  ".join(f"{k} {v:.0%} NOOP" for k, v in by.items())

    print(f"train: {len(train)} decisions ({count(train)} best)   eval: {len(held)} ({count(held)} best)")
    print("updates | eval NOOP share: visits  homes  moves | label accuracy | CPU-s")
    start = time.process_time()
    for n in range(args.updates + 1):
        if n % args.every == 0:
            learner.train(False)
            with torch.no_grad():
                picks = []
                for i in range(0, len(held), 32):
                    chunk = held[i:i + 32]
                    lp = {o: learner.sequence_logprobs([Row(d.prompt_ids, enc[o] + d.stop) for d in chunk], "memory")
                          for o in OPS}
                    picks += [OPS[int(noop.sum() > add.sum())] for add, noop in zip(lp[OPS[0]], lp[OPS[1]])]
            share = {k: [pk == OPS[1] for pk, d in zip(picks, held) if d.kind == k] for k in ("visit", "home", "move")}
            acc = sum(pk == d.label for pk, d in zip(picks, held)) / len(held)
            print(f"{n:7d} | " + "  ".join(f"{sum(v) / max(1, len(v)):6.0%}" for v in share.values())
                  + f" | {acc:.0%} | {time.process_time() - start:.0f}", flush=True)
        if n == args.updates:
            break
        learner.train(True)
        batch = rng.sample(train, min(args.batch, len(train)))
        opt.zero_grad(set_to_none=True)
        lps = learner.sequence_logprobs([Row(d.prompt_ids, enc[d.label] + d.stop) for d in batch], "memory")
        loss = -torch.stack([x.sum() for x in lps]).mean()
        loss.backward()
        opt.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
