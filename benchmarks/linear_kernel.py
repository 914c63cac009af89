"""The CPU's fp32 linear kernel: torch's default (a BLAS sgemm) vs oneDNN (`masgraph/backends/hf/onednn.py`).

Part 1, the kernels: every linear shape of the embedded model (SmolLM2-135M: q/o 576x576, k/v 576x192, gate/up
576x1536, down 1536x576, the output head 576x49152) at a decode step's rows (8 and 32) and an update pass's (2560),
forward and the input's gradient (the only backward a frozen LoRA base layer runs); arms alternate, best of
`--trials`. The forward runs oneDNN twice: with the plain weight, and with the weight packed in oneDNN's blocked
layout once beforehand (`onednn.packed`, what a decode step's products read). In bf16 (decode rows, forward):
`F.linear` (oneDNN with the plain weight) vs the packed weight, whose products are the same bit for bit.
Part 2 (`--steps N`), a training step: `benchmarks/train_throughput.py --no-trl` in a fresh process per arm with
`MASGRAPH_LINEAR=blas` and `=onednn`, arms alternating `--runs` times; seconds per counted step, rollouts + update.

    .venv/bin/python benchmarks/linear_kernel.py [--trials 5] [--steps 3 --max-tokens 64 --runs 2]
"""

# ruff: noqa: E402, I001  (`import masgraph` sets torch's thread wait policy, which libgomp reads when torch loads)
from __future__ import annotations

import masgraph  # noqa: F401

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch
from torch.nn import functional as F

from masgraph.backends.hf import onednn
from results_file import results_file

HERE = Path(__file__).resolve().parent
SHAPES = {"q/o": (576, 576), "k/v": (576, 192), "gate/up": (576, 1536), "down": (1536, 576), "head": (576, 49152)}
"""(in, out) features of SmolLM2-135M's linear layers."""
ROWS = {"decode-8": 8, "decode": 32, "update": 2560}


def best(fn, trials: int, seconds: float = 0.15) -> float:
    """Seconds per call: the best of `trials` timed loops of ~`seconds` each (one warm-up call first)."""
    fn()
    out = float("inf")
    for _ in range(trials):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            n += 1
        out = min(out, (time.perf_counter() - t0) / n)
    return out


def kernels(trials: int) -> list[dict]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for phase, m in ROWS.items():
        for name, (k, n) in SHAPES.items():
            if name == "head" and phase == "update":
                continue  # the update runs the head in chunks of 341 tokens (selected log-probs), not 2560
            x, w, g = (torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen),
                       torch.randn(m, n, generator=gen))
            flop = 2 * m * k * n
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            arms = {("forward", "blas"): lambda x=x, w=w: F.linear(x, w),
                    ("forward", "onednn"): lambda x=x, w=w: onednn._onednn(x, w, None),
                    ("forward", "packed"): lambda x=x, w=packed: onednn._onednn(x, w, None),
                    ("input grad", "blas"): lambda g=g, w=w: g @ w,
                    ("input grad", "onednn"): lambda g=g, w=w: onednn._onednn(g, w.t(), None)}
            for what in ("forward", "input grad"):
                if phase.startswith("decode") and what == "input grad":
                    continue  # decoding has no backward
                t = {kern: best(arms[(what, kern)], trials) for kern in ("blas", "onednn", "packed")
                     if (what, kern) in arms}
                rows.append({"phase": phase, "rows": m, "layer": name, "pass": what,
                             "blas": flop / t["blas"] / 1e9, "onednn": flop / t["onednn"] / 1e9,
                             "ratio": t["blas"] / t["onednn"],
                             "packed": flop / t["packed"] / 1e9 if "packed" in t else None,
                             "packed_ratio": t["onednn"] / t["packed"] if "packed" in t else None})
    return rows


def bf16_rows(trials: int) -> list[dict]:
    """bf16 forward at decode rows: `F.linear` vs oneDNN with the weight packed (what masgraph runs)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for phase, m in ROWS.items():
        if not phase.startswith("decode"):
            continue
        for name, (k, n) in SHAPES.items():
            x = torch.randn(m, k, generator=gen).bfloat16()
            w = torch.randn(n, k, generator=gen).bfloat16()
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            t_f = best(lambda x=x, w=w: F.linear(x, w), trials)
            t_p = best(lambda x=x, w=packed: onednn._onednn(x, w, None), trials)
            rows.append({"phase": phase, "rows": m, "layer": name, "ratio": t_f / t_p,
                         "same": torch.equal(F.linear(x, w), onednn._onednn(x, packed, None))})
    return rows


def step_arm(kernel: str, args: argparse.Namespace) -> list[tuple[float, float]]:
    """(rollout s, update s) per counted step of one `train_throughput.py --no-trl` run under `kernel`."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(HERE / "train_throughput.py"), "--no-trl", "--steps", str(args.steps),
               "--max-tokens", str(args.max_tokens), "--fixed-length", "--record", str(Path(tmp) / "r.md")]
        proc = subprocess.run(cmd, env={**os.environ, onednn.ENV: kernel}, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: the {kernel} arm failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("masgraph seconds per counted step"))
    return [(float(a), float(b)) for a, b in re.findall(r"([\d.]+) \+ ([\d.]+)", line)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--steps", type=int, default=0, help="also time training steps (train_throughput.py --no-trl)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=2, help="alternating runs per arm of the training steps")
    p.add_argument("--record", type=Path, default=results_file("linear_kernel"))
    args = p.parse_args()
    if not onednn.available():
        sys.exit("error: this torch build has no oneDNN linear op")
    rows = kernels(args.trials)
    table = ["| phase | rows | layer | pass | BLAS GFLOPS | oneDNN GFLOPS | oneDNN speed-up | oneDNN packed GFLOPS "
             "| packed / plain speed-up |", "|---|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['phase']} | {r['rows']} | {r['layer']} | {r['pass']} | {r['blas']:.1f} | {r['onednn']:.1f} | "
              f"{r['ratio']:.2f}x | " + (f"{r['packed']:.1f} | {r['packed_ratio']:.2f}x |" if r["packed"] else
                                         "— | — |") for r in rows]
    print("\n".join(table), flush=True)
    lines = []
    for phase in ROWS:
        mean = statistics.geometric_mean(r["ratio"] for r in rows if r["phase"] == phase)
        lines.append(f"- {phase} shapes: oneDNN {mean:.2f}x BLAS's speed (geometric mean)")
        packs = [r["packed_ratio"] for r in rows if r["phase"] == phase and r["packed_ratio"]]
        lines.append(f"- {phase} shapes, forward: oneDNN with the weight packed "
                     f"{statistics.geometric_mean(packs):.2f}x its speed with the plain weight "
                     f"(geometric mean; {min(packs):.2f}-{max(packs):.2f}x)")
    bf16 = bf16_rows(args.trials) if onednn.bf16_through_onednn() else []
    if bf16:
        table += ["", "| bf16 phase | rows | layer | packed / F.linear speed-up | same numbers |",
                  "|---|---|---|---|---|"]
        table += [f"| {r['phase']} | {r['rows']} | {r['layer']} | {r['ratio']:.2f}x | {r['same']} |" for r in bf16]
        print("\n".join(table[-len(bf16) - 2:]), flush=True)
        for phase in dict.fromkeys(r["phase"] for r in bf16):
            got = [r["ratio"] for r in bf16 if r["phase"] == phase]
            lines.append(f"- bf16 {phase} shapes, forward: the packed weight {statistics.geometric_mean(got):.2f}x "
                         f"F.linear's speed (geometric mean; {min(got):.2f}-{max(got):.2f}x)")
    if args.steps:
        steps: dict[str, list[tuple[float, float]]] = {"blas": [], "onednn": []}
        for run in range(args.runs):
            for kern in steps:
                got = step_arm(kern, args)
                steps[kern] += got
                split = ", ".join(f"{a:.1f} + {b:.1f}" for a, b in got)
                print(f"{kern} run {run + 1}: rollouts + update s/step {split}", flush=True)
        mean = {k: statistics.mean(a + b for a, b in v) for k, v in steps.items()}
        for kern, got in steps.items():
            lines.append(f"- training step, {kern}: " + ", ".join(f"{a:.1f} + {b:.1f}" for a, b in got)
                         + f" s (rollouts + update; mean {mean[kern]:.1f} s)")
        lines.append(f"- training step time oneDNN / BLAS: **{mean['onednn'] / mean['blas']:.2f}x**")
    print("\n".join(lines))
    cmd = "python benchmarks/linear_kernel.py " + " ".join(sys.argv[1:])
    where = (f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
             f"measured choice on this machine: {json.dumps(onednn.kernel())}")
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M")
    with args.record.open("a") as f:
        f.write(f"\n### fp32 linear kernel: BLAS vs oneDNN ({stamp}, {where})\n\n`{cmd.strip()}`\n\n"
                + "\n".join(table) + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
