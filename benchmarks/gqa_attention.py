"""Masked grouped-query attention on a CPU: transformers' sdpa path (key/value heads repeated per query head) vs
masgraph's (`masgraph/backends/hf/gqa.py`: the heads as they are).

Part 1, the kernel: forward + backward of one attention layer at shapes a `mixed_router` update runs (SmolLM2-135M:
9 query heads, 3 key/value heads, head dim 64; rows x new positions x attended positions, a boolean mask), arms
alternating, best of `--trials`. Part 2 (`--updates N`): one Flow-GRPO update on the same `mixed_router` rollouts
(rolled out once, `--queries` x 8) in a fresh process per arm, arms alternating N times; the update's seconds.

    .venv/bin/python benchmarks/gqa_attention.py [--trials 5] [--updates 2 --queries 6]
"""

# ruff: noqa: E402, I001  (`import masgraph` sets torch's thread wait policy, which libgomp reads when torch loads)
from __future__ import annotations

import masgraph  # noqa: F401

import argparse
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from linear_kernel import best  # the same time-boxed best-of-trials loop
from masgraph.backends.hf import gqa
from results_file import results_file

HERE = Path(__file__).resolve().parent
SHAPES = [(6, 75, 410), (5, 78, 488), (9, 34, 407), (7, 41, 451), (4, 75, 396), (1, 137, 547)]
"""(rows, new positions, attended positions) of the `mixed_router` update's largest attention calls (profiled)."""
MODULE = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)


def kernels(trials: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b, q, k in SHAPES:
        query = torch.randn(b, 9, q, 64, generator=gen, requires_grad=True)
        key, value = (torch.randn(b, 3, k, 64, generator=gen, requires_grad=True) for _ in range(2))
        mask = torch.ones(b, 1, q, k, dtype=torch.bool).tril(k - q)
        grad = torch.randn(b, q, 9, 64, generator=gen)

        def step(attend, query=query, key=key, value=value, mask=mask, grad=grad):
            out, _ = attend(MODULE, query, key, value, mask, scaling=0.125)
            out.backward(grad)
            for x in (query, key, value):
                x.grad = None
        t = {name: best(lambda a=attend: step(a), trials, seconds=0.3)
             for name, attend in (("transformers", sdpa_attention_forward), ("masgraph", gqa.sdpa_attention))}
        rows.append({"shape": (b, q, k), "transformers": t["transformers"], "masgraph": t["masgraph"],
                     "ratio": t["masgraph"] / t["transformers"]})
    return rows


def _update_then_now():
    spec = importlib.util.spec_from_file_location("update_then_now", HERE / "update_then_now.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def update_arm(io: Path, arm: str) -> float:
    """One update in a fresh process with the GQA path on or off; its seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.pt"
        proc = subprocess.run([sys.executable, __file__, "--side", str(io), "--arm", arm, "--out", str(out)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"error: the {arm} arm failed:\n{proc.stderr[-3000:]}")
        return torch.load(out, weights_only=False)["seconds"]


def side(io: Path, arm: str, out: Path) -> None:
    if arm == "off":  # transformers' path: repeat the key/value heads
        gqa._on_kv_heads = lambda *a, **k: False
    _update_then_now().side(io, "graphs/mixed_router.yaml", out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--updates", type=int, default=0, help="also time whole updates, alternating arms N times")
    p.add_argument("--queries", type=int, default=6, help="mixed_routes queries (x 8 samples) to update on")
    p.add_argument("--record", type=Path, default=results_file("gqa_attention"))
    p.add_argument("--side", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        return side(args.side, args.arm, args.out)
    rows = kernels(args.trials)
    table = ["| rows x new x attended | transformers ms | masgraph ms | masgraph / transformers |", "|---|---|---|---|"]
    table += [f"| {'x'.join(map(str, r['shape']))} | {r['transformers'] * 1e3:.2f} | {r['masgraph'] * 1e3:.2f} | "
              f"{r['ratio']:.2f}x |" for r in rows]
    print("\n".join(table), flush=True)
    lines = [f"- forward + backward, time masgraph / transformers: "
             f"{statistics.geometric_mean(r['ratio'] for r in rows):.2f}x (geometric mean)"]
    if args.updates:
        with tempfile.TemporaryDirectory() as tmp:
            io = Path(tmp)
            spent = _update_then_now().rollouts(io, "graphs/mixed_router.yaml", "mixed_routes", args.queries, 8)
            print(f"rollouts: {spent:.0f} s", flush=True)
            times: dict[str, list[float]] = {"off": [], "on": []}
            for run in range(args.updates):
                for arm in times:
                    times[arm].append(update_arm(io, arm))
                    print(f"run {run + 1}, heads {'repeated' if arm == 'off' else 'as they are'}: "
                          f"{times[arm][-1]:.1f} s", flush=True)
        for arm, name in (("off", "repeated (transformers)"), ("on", "as they are (masgraph)")):
            lines.append(f"- one update, key/value heads {name}: " + ", ".join(f"{t:.1f}" for t in times[arm])
                         + f" s (median {statistics.median(times[arm]):.1f})")
        lines.append(f"- update time masgraph / transformers: "
                     f"**{statistics.median(times['on']) / statistics.median(times['off']):.2f}x** (medians)")
    print("\n".join(lines))
    cmd = "python benchmarks/gqa_attention.py " + " ".join(sys.argv[1:])
    where = f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M")
    with args.record.open("a") as f:
        f.write(f"\n### Masked GQA attention: repeated vs shared key/value heads ({stamp}, {where})\n\n`{cmd.strip()}`"
                "\n\n" + "\n".join(table) + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
