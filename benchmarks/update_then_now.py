"""One Flow-GRPO update on the same rollouts, with today's code and with an earlier commit's (default 016c8eb, where
issue 55 measured the `mixed_router` update: ~6.6 CPU-minutes for 92 rows, 7.9 GB peak RSS).

Rolls out the graph once with today's code (queries x samples episodes, the trainable adapters at a fixed random
start so the update has something to push) and saves the traces and the adapters' starting weights; then each side
runs one update on them in its own fresh process, arms alternating: "now" with this checkout, "then" with the
earlier commit's files (exported by `git archive` into a temporary directory and put first on the path). Each side
builds its rows from the same traces with its own graph file's `train.flow_grpo` (every row kept: zero_variance
keep), in the thread environment its own `import masgraph` chooses. Prints wall and CPU seconds, peak RSS and
the rows per side, and the ratio now / then.

    .venv/bin/python benchmarks/update_then_now.py        # mixed_router.yaml, mixed_routes, 4 x 8, then = 016c8eb
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def validate_leniently(cls, data: dict):
    """`cls.model_validate(data)` after dropping the fields `cls` (an older trace model, extra fields forbidden)
    does not know: the traces were written by today's code."""
    from pydantic import ValidationError

    for _ in range(10_000):
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            extra = [e["loc"] for e in exc.errors() if e["type"] == "extra_forbidden"]
            if not extra or len(extra) < len(exc.errors()):
                raise
            for loc in extra:
                node = data
                for key in loc[:-1]:
                    node = node[key]
                node.pop(loc[-1], None)
    raise RuntimeError("too many unknown fields")


def _installed_plugins_only() -> None:
    """The installed package's plugin entry points name today's modules; the earlier commit's registry loads only
    those of them its own files have."""
    from importlib.util import find_spec

    import masgraph.registry as registry

    every = getattr(registry, "entry_points", None)
    if every is None:
        return

    def present(**kw):
        out = []
        for ep in every(**kw):
            try:
                if find_spec(ep.module) is not None:
                    out.append(ep)
            except ModuleNotFoundError:
                pass
        return out

    registry.entry_points = present


def side(io: Path, graph: str, out_path: Path) -> None:
    """One update in this process (today's modules or the earlier commit's, whichever the path gives)."""
    import torch

    from masgraph.loader import load_spec
    from masgraph.trace import Trace
    try:
        from masgraph.backends.hf.learner import HFLearner
    except ImportError:  # the flat layout before the house moves
        from masgraph.backends.hf_learner import HFLearner
    try:
        from masgraph.backends.base import LoraConfigSpec
    except ImportError:
        from masgraph.learner import LoraConfigSpec
    from masgraph.trainers.flow_grpo import FlowGRPO

    _installed_plugins_only()
    spec = load_spec(graph)
    trainable, train = spec.trainable_adapters(), spec.train
    fg = train.flow_grpo
    if hasattr(fg, "batching"):
        config = fg.model_copy(update={"batching": fg.batching.model_copy(update={"zero_variance": "keep"})})
    else:
        config = fg.model_copy(update={"zero_variance": "keep"})
    traces = [validate_leniently(Trace, json.loads(line)) for line in (io / "traces.jsonl").open()]
    start = torch.load(io / "start.pt", weights_only=True)
    learner = HFLearner("smollm2-135m", dtype="float32")
    for adapter in sorted(start):
        learner.add_adapter(adapter, LoraConfigSpec(train.lora_rank, train.lora_alpha, tuple(train.lora_targets)))
        with torch.no_grad():
            for p, s in zip(learner.parameters(adapter), start[adapter], strict=True):
                p.copy_(s)
    algo = FlowGRPO(learner, trainable, config)
    cpu0, t0 = time.process_time(), time.perf_counter()
    metrics = algo.update(traces, seed=0)
    out = {"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0,
           "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
           "rows": metrics.get("rows/trained", metrics.get("rows", 0.0)), "loss": metrics.get("loss/total"),
           "weights": {a: [p.detach().clone() for p in learner.parameters(a)] for a in start},
           "tokens": {k.removeprefix("rows/"): v for k, v in metrics.items() if k.startswith("rows/tokens")}}
    torch.save(out, out_path)
    print(json.dumps({k: v for k, v in out.items() if k != "weights"}))


def rollouts(io: Path, graph: str, task: str, queries: int, samples: int) -> float:
    """Today's code rolls the graph out; traces and the adapters' starting weights go to `io`."""
    import torch

    from masgraph.backends.base import LoraConfigSpec
    from masgraph.backends.hf import HFBackend
    from masgraph.backends.hf.learner import HFLearner
    from masgraph.graph import compile_spec
    from masgraph.learn.learner import WeightSync
    from masgraph.loader import load_spec
    from masgraph.runtime.runner import RunConfig, Runner
    from masgraph.tasks import get_task
    from masgraph.trainers.flow_grpo import FlowGRPO

    spec = load_spec(graph)
    trainable, train = spec.trainable_adapters(), spec.train
    torch.manual_seed(0)
    learner = HFLearner("smollm2-135m", dtype="float32")
    for adapter in sorted(set(trainable.values())):
        learner.add_adapter(adapter, LoraConfigSpec(train.lora_rank, train.lora_alpha, tuple(train.lora_targets)))
        with torch.no_grad():  # a non-zero adapter: its own policy, not the base
            for p in learner.parameters(adapter):
                p.add_(0.02 * torch.randn_like(p))
    torch.save({a: [p.detach().clone() for p in learner.parameters(a)] for a in set(trainable.values())},
               io / "start.pt")
    graph_ = compile_spec(FlowGRPO(learner, trainable, train.flow_grpo).rollout_spec(spec))
    backend = HFBackend(learner.weights, seed=1)
    WeightSync(learner, [backend])()
    runner = Runner(graph_, RunConfig(n=queries, split="train", samples=samples, concurrency=16),
                    backends={"hf": backend})
    t0 = time.perf_counter()
    traces = asyncio.run(runner.run_task(get_task(task), store=False)).traces
    with (io / "traces.jsonl").open("w") as f:
        f.writelines(t.model_dump_json() + "\n" for t in traces)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph", default="graphs/mixed_router.yaml", help="relative to the repository (both sides)")
    ap.add_argument("--task", default="mixed_routes")
    ap.add_argument("--queries", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--then", default="016c8eb", help="the earlier commit")
    ap.add_argument("--repeats", type=int, default=1, help="updates per side, alternating")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--side", type=Path, help=argparse.SUPPRESS)  # one update in this process: its io directory
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)  # ... and where its result goes
    args = ap.parse_args()
    if args.side:
        return side(args.side, args.graph, args.out)
    # what `import masgraph` sets (this process imports today's): each side starts without them and takes its own
    from masgraph.threads import AUTO, USER_SETTINGS

    thread_vars = (*USER_SETTINGS, AUTO)

    with tempfile.TemporaryDirectory(prefix="masgraph-then-now-") as tmp:
        io, then = Path(tmp) / "io", Path(tmp) / "then"
        io.mkdir()
        then.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.then], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(then)], input=archive.stdout, check=True)
        for sub in ("trainers", "agents"):  # shipped as masgraph.<sub>: first on the path, not the editable install's
            if (then / sub).is_dir() and not (then / "masgraph" / sub).exists():
                (then / "masgraph" / sub).symlink_to(then / sub)
        rollout_s = rollouts(io, str(ROOT / args.graph), args.task, args.queries, args.samples)
        print(f"rollouts: {rollout_s:.0f} s", flush=True)
        results: dict[str, list[dict]] = {"then": [], "now": []}
        import torch

        for _ in range(args.repeats):
            for name in ("then", "now"):
                home = then if name == "then" else ROOT
                env = {k: v for k, v in os.environ.items() if k not in thread_vars}
                if name == "then":
                    env["PYTHONPATH"] = str(then)
                out = io / f"{name}-{len(results[name])}.pt"
                proc = subprocess.run([sys.executable, str(HERE / "update_then_now.py"), "--side", str(io),
                                       "--out", str(out), "--graph", str(home / args.graph)], cwd=home, env=env,
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.exit(f"error: the {name} side failed:\n{proc.stderr[-3000:]}")
                r = torch.load(out, weights_only=True)
                results[name].append(r)
                print(f"{name}: {r['seconds']:.1f} s wall, {r['cpu_s']:.0f} CPU-s, peak RSS {r['peak_rss_gib']:.2f} "
                      f"GiB, rows {r['rows']:.0f}, loss {r['loss']:.6f}, tokens {r['tokens'] or 'not counted'}",
                      flush=True)
    then_s = statistics.median(r["seconds"] for r in results["then"])
    now_s = statistics.median(r["seconds"] for r in results["now"])
    a, b = results["then"][0]["weights"], results["now"][0]["weights"]
    diff = max((x - y).abs().max().item() for ad in a for x, y in zip(a[ad], b[ad]))
    print(f"update time now / then: {now_s / then_s:.2f}x; adapters after the update max |diff| {diff:.1e}")
    if args.no_record:
        return
    from results_file import results_file

    rows = "".join(f"| {name} | {r['rows']:.0f} | {r['seconds']:.1f} | {r['cpu_s']:.0f} | {r['peak_rss_gib']:.2f} | "
                   f"{r['loss']:.6f} |\n" for name in ("then", "now") for r in results[name])
    entry = (f"\n### Update now vs {args.then}: {Path(args.graph).name}, {args.task}, {args.queries} x {args.samples} "
             f"({datetime.now():%Y-%m-%d %H:%M}, {platform.machine()}, {os.cpu_count()} cores, load "
             f"{os.getloadavg()[0]:.1f})\n\n`python benchmarks/update_then_now.py --graph {args.graph} --task "
             f"{args.task} --queries {args.queries} --samples {args.samples} --then {args.then} --repeats "
             f"{args.repeats}` — smollm2-135m fp32, CPU; the same {args.queries * args.samples} rollouts "
             f"({rollout_s:.0f} s, today's code); {args.repeats} update(s) per side, each in a fresh process, sides "
             "alternating.\n\n"
             "| side | rows | wall s | CPU s | peak RSS GiB | loss |\n|---|---|---|---|---|---|\n" + rows +
             f"\n- update time now / then: **{now_s / then_s:.2f}x**; adapters after the update max |diff| "
             f"{diff:.1e}\n")
    with results_file("update_packing").open("a") as f:
        f.write(entry)


if __name__ == "__main__":
    main()
