"""AgentFlow's ten held-out sets through a graph, in AgentFlow's table layout: accuracy, turns, tokens and failures
per set, with the scorer named.

Each set is read from its released file (`--data`, default ../shared/benchmarks/agentflow: the sets are not copied
into the project) as a data task (masgraph/datatask.py): the question is the set's `query` (the prompt AgentFlow
sends), every item held out, and scored by the scorer that fits its answers: `game24` (Game of 24, checked
exactly), `number` (AIME, AMC), `choice` (GPQA, MedQA), and for the open QA sets `contains`, or with `--judge` an
LLM judge (masgraph/judge.py, as AgentFlow scores them), with `contains` computed beside it on the same answers and
their agreement reported. `--judge` also checks the judge itself: on each judged set's items it is asked about the
reference answer (a correct response) and about another item's reference answer (a wrong one), so its own accuracy
is measured, not assumed. One engine serves every set, so the model loads once; the first `--n` items of each set,
in file order.

    .venv/bin/python benchmarks/agentflow_sets.py graphs/agentflow.yaml [--sets gameof24 bamboogle] [--n 10] \
        [--judge [--judge-model M --judge-backend litellm --judge-api-base URL]]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from results_file import results_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SETS = {"gameof24": "game24", "aime24": "number", "amc23": "number", "bamboogle": "contains", "2wiki": "contains",
        "hotpotqa": "contains", "musique": "contains", "gaia": "contains", "gpqa": "choice", "medqa": "choice"}
"""Set -> the scorer its answers take (AgentFlow judges the `contains` ones with an LLM: `--judge`)."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("graph")
    ap.add_argument("--sets", nargs="+", choices=list(SETS), default=list(SETS))
    ap.add_argument("--n", type=int, default=10, help="items per set (the first N, in file order; default 10)")
    ap.add_argument("--data", default=os.environ.get("MASGRAPH_AGENTFLOW_DATA",
                                                     str(ROOT.parent / "shared" / "benchmarks" / "agentflow")),
                    help="folder holding <set>/data.json (default ../shared/benchmarks/agentflow)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--judge", action="store_true", help="score the open QA sets with an LLM judge (and contains)")
    ap.add_argument("--judge-backend", default="hf")
    ap.add_argument("--judge-model", default="smollm2-135m")
    ap.add_argument("--judge-api-base", default=None)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    from masgraph.errors import MasgraphError
    from masgraph.graph import compile_spec
    from masgraph.loader import load_spec
    from masgraph.runtime.runner import RunConfig, Runner
    from masgraph.tasks.data import DataTask, DataTaskSpec

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
    judge = None
    if args.judge:
        from masgraph.tasks.judge import JudgeSpec

        judge = JudgeSpec.model_validate({"policy": {"backend": args.judge_backend, "model": args.judge_model,
                                                     "api_base": args.judge_api_base,
                                                     "sampling": {"temperature": 0.0, "max_tokens": 4}}})
    rows = ["| set | scorer | items | accuracy | accuracy of finished | turns | completion tokens | failures |"
            + (" contains | judge = contains |" if judge else ""),
            "|---|---|---|---|---|---|---|---|" + ("---|---|" if judge else "")]
    checks: list[str] = []
    runner = None
    t0 = time.perf_counter()
    for name in args.sets:
        judged = judge is not None and SETS[name] == "contains"
        task = DataTask(DataTaskSpec(name=name, file=f"{name}/data.json", question="query",
                                     scorer="judge" if judged else SETS[name], judge=judge if judged else None,
                                     split="test"), data)
        items = task.items("test", args.n, 0)
        config = RunConfig(n=len(items), concurrency=args.concurrency, deterministic=True,
                           runs_dir=str(ROOT / "runs" / "bench-agentflow"))
        runner = Runner(graph, config, engine=runner.engine if runner else None)
        result = asyncio.run(runner.run_items(task, items))
        s = result.summary
        fails = ", ".join(f"{k} {v}" for k, v in s["failures"].items() if v) or "none"
        finished = "—" if s.get("accuracy_finished") is None else f"{s['accuracy_finished']:.1%}"
        scorer = ("LLM judge" if judged else SETS[name]) + (" (AgentFlow: LLM judge)" if SETS[name] == "contains"
                                                            and not judged else "")
        row = (f"| {name} | {scorer} | {s['episodes']} | **{s.get('accuracy', 0):.1%}** | {finished} | "
               f"{s.get('turns_mean', 0):.2f} | {s.get('completion_tokens_mean', 0):.0f} | {fails} |")
        if judge:
            row += (" {} | {} |".format(*_agreement(result.traces, items)) if judged else " — | — |")
        rows.append(row)
        print(rows[-1], flush=True)
        if judged:
            checks.append(_judge_check(runner.judge(task.judge), name, items))
            print(checks[-1], flush=True)
    text = "\n".join(rows) + "\n"
    if checks:
        text += ("\nThe judge checked (`--judge`): asked about each item's reference answer (a correct response) and "
                 "about the next item's reference answer (a wrong one).\n\n| set | pairs | judge says yes to the "
                 "reference | judge says no to another's | judge accuracy | contains accuracy | unparsed |\n"
                 "|---|---|---|---|---|---|---|\n" + "\n".join(checks) + "\n")
    print(text)
    if not args.no_record:
        with open(results_file("agentflow_sets"), "a") as f:
            f.write(f"\n### AgentFlow's sets through `{args.graph}` ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
                    f"`python benchmarks/agentflow_sets.py {args.graph} --sets {' '.join(args.sets)} --n {args.n}"
                    f"{' --judge' if judge else ''}` — "
                    f"the first {args.n} items of each released set, deterministic decoding, the embedded model "
                    f"(SmolLM2-135M) on this CPU, {(time.perf_counter() - t0) / 60:.0f} min.\n\n{text}")
    return 0


def _agreement(traces: list, items: list) -> tuple[str, str]:
    """contains' accuracy on the same answers the judge scored, and how often the two agree on correct."""
    from masgraph.tasks import is_correct
    from masgraph.tasks.scorers import contains

    gold = {it.id: it.meta["gold"] for it in items}
    by_contains = [t.status == "ok" and contains(t.answer or "", gold[t.item_id], {}) == 1.0 for t in traces]
    same = sum(c == is_correct(t) for c, t in zip(by_contains, traces))
    return f"{sum(by_contains) / len(traces):.1%}", f"{same / len(traces):.1%} ({same}/{len(traces)})"


def _judge_check(judge, name: str, items: list) -> str:
    """The judge on known answers: each item's reference (should be yes) and the next item's (should be no)."""
    from masgraph.tasks.scorers import contains

    async def verdicts():
        pairs = [(it, it.meta["gold"][0]) for it in items] + [
            (it, items[(i + 1) % len(items)].meta["gold"][0]) for i, it in enumerate(items)]
        return pairs, await asyncio.gather(*[judge.verdict(it.question, it.meta["gold"], said) for it, said in pairs])
    pairs, out = asyncio.run(verdicts())
    n = len(items)
    yes = sum(v.score == 1.0 for v in out[:n])
    no = sum(v.score == 0.0 for v in out[n:])
    truth = [1.0] * n + [0.0] * n
    by_contains = sum(contains(said, it.meta["gold"], {}) == t for (it, said), t in zip(pairs, truth))
    unparsed = sum(v.unparsed for v in out)
    return (f"| {name} | {n} + {n} | {yes}/{n} | {no}/{n} | {(yes + no) / (2 * n):.1%} | "
            f"{by_contains / (2 * n):.1%} | {unparsed} |")


if __name__ == "__main__":
    sys.exit(main())
