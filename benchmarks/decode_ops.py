"""Aten ops per decode step: masgraph's hf backend (cascade attention on and off) vs transformers' `generate` (what
TRL's GRPOTrainer samples with), at one shape, under a LoRA adapter, rows sampling at temperature 0.7.

On a GPU a small model's decode step can be bound by the host: each aten op is a Python call and a kernel launch,
whatever its size (tens of microseconds each: an estimate, not measured here). On the H200 a 64-row step of the
0.5B shape took ~0.2 s (results/gpu.md, 2026-12-04), far above its kernels' time; this counts the ops behind that
on a CPU, where the count is about the same (the CPU's oneDNN linear layers add a detach each).
The model is a random-weight model with the layer count, attention heads, key/value heads and vocabulary of
`--shape` (benchmarks/models.py) but hidden size heads × 8 and a 128-wide MLP, so its compute is near zero and its
ops are those of the full shape. Each arm generates `--tokens` and half that; the difference over the extra
tokens is the ops of one decode step (the prompt pass cancels out). Wall-clock per step is printed too: on a CPU
with the thin model, the host's per-op cost plus the sampling over the vocabulary (not a GPU figure); on a GPU
(`--device cuda`, bf16; `--full`: the shape's full random-weight model, benchmarks/models.py) the step's time itself,
with the cascade on and off (`benchmarks/gpu.sh`'s step o). `--captured` adds the captured step
(masgraph/backends/hf/captured.py: inductor's CUDA graph on a GPU, the traced step run eagerly on a CPU): its wall
time only.

    .venv/bin/python benchmarks/decode_ops.py [--shape qwen2-0.5b] [--rows 64] [--tokens 32] [--device cuda --full]
"""

# ruff: noqa: E402, I001  (`import masgraph` sets torch's thread wait policy, which libgomp reads when torch loads)
from __future__ import annotations

import masgraph  # noqa: F401

import argparse
import collections
import sys
import time
from datetime import datetime
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models import SHAPES, built, resolve
from results_file import results_file


class Ops(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def thin(shape: str) -> Path:
    """A random model with `shape`'s layers, heads, key/value heads and vocabulary, and near-zero compute."""
    fields = {**SHAPES[shape], "hidden_size": SHAPES[shape]["num_attention_heads"] * 8, "intermediate_size": 128,
              "head_dim": 8}
    return built(f"thin-{shape}", fields)


def per_step(run, tokens: int, count: bool = True) -> tuple[float, float, collections.Counter[str]]:  # noqa: ANN001
    """(ops per decode step, wall ms per decode step, ops per step by name) of `run(n)`, which generates n tokens
    per row: from `tokens` and `tokens // 2` (the prompt pass cancels out). `count` False: wall time only (a
    captured step's ops are one graph's replay; counting them would trace it again)."""
    half = tokens // 2
    for n in (half, tokens):  # warm-up (a captured step compiles once per cache length)
        run(n)
    walls, counts = {}, {}
    for n in (half, tokens):
        t0 = time.perf_counter()
        run(n)
        walls[n] = time.perf_counter() - t0
        counts[n] = collections.Counter()
        if count:
            with Ops() as ops:
                run(n)
            counts[n] = ops.counts
    steps = tokens - half
    diff = collections.Counter({k: (counts[tokens][k] - counts[half].get(k, 0)) / steps for k in counts[tokens]})
    return sum(diff.values()), (walls[tokens] - walls[half]) / steps * 1000, diff


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, default=64, help="rows decoding at once (8 prompts x rows/8 samples)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--device", default="cpu", help="cpu (float32) or cuda[:N] (bfloat16)")
    p.add_argument("--full", action="store_true", help="the shape's full random-weight model, not the thin one")
    p.add_argument("--prefixes", type=int, default=1, choices=range(1, 9), metavar="1..8",
                   help="distinct system prompts among the rows' 8 questions (a graph's nodes: the cascade's groups)")
    p.add_argument("--captured", action="store_true",
                   help="an arm more: the captured step (masgraph/backends/hf/captured.py; a CUDA graph on a GPU)")
    p.add_argument("--record", type=Path, default=results_file("decode_ops"))
    args = p.parse_args()
    from masgraph.backends.base import Request
    from masgraph.backends.hf import HFBackend
    from masgraph.backends.hf.backend import cascade_pays
    from masgraph.backends.hf.learner import HFLearner
    from masgraph.learn.learner import LoraConfigSpec, WeightSync
    from masgraph.spec import SamplingSpec

    path = resolve(f"random:{args.shape}", args.device) if args.full else thin(args.shape)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    learner = HFLearner(str(path), dtype=dtype, device=args.device)
    learner.add_adapter("main", LoraConfigSpec())
    backend = HFBackend(learner.weights, max_batch_size=args.rows)
    WeightSync(learner, [backend])()
    backend.layout.eos_ids.clear()  # every row runs to its max_tokens, as generate's min_new_tokens below
    systems = [f"You are agent {k} of a graph. Solve the arithmetic problem. Give the answer as: Answer: <number>."
               for k in range(args.prefixes)]
    messages = [[{"role": "system", "content": systems[q % args.prefixes]},
                 {"role": "user", "content": f"What is {q * 37} + {q * 91}?"}]
                for q in range(8) for _ in range(args.rows // 8)]

    captured = HFBackend(learner.weights, max_batch_size=args.rows) if args.captured else None
    if captured is not None:
        captured.capture_decode()
        captured.versions = backend.versions
        captured.layout.eos_ids.clear()

    def masgraph_run(cascade: bool, on: HFBackend = backend):  # noqa: ANN202
        def run(n: int) -> None:
            on.cascade = cascade and cascade_pays(learner.weights)  # only where the model can run it
            sampling = SamplingSpec(temperature=0.7, max_tokens=n)
            on.generate([Request(m, sampling=sampling, seed=i, adapter="main") for i, m in enumerate(messages)])
        return run

    tok = backend.tokenizer
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    batch = tok(texts, return_tensors="pt", padding=True).to(learner.weights.device)
    model = learner.weights.model

    def hf_run(n: int) -> None:
        with learner.weights.use("main"), torch.no_grad():
            model.generate(**batch, do_sample=True, temperature=0.7, top_p=1.0, top_k=0, max_new_tokens=n,
                           min_new_tokens=n, pad_token_id=tok.pad_token_id)

    peer = "transformers generate, same model (TRL's sampler)"
    arms = {"masgraph (cascade attention: the default)": masgraph_run(True),
            "masgraph (no cascade: a prefix copy per row)": masgraph_run(False), peer: hf_run}
    step_name = "masgraph (captured step: one CUDA graph on a GPU; ops not counted)"
    if captured is not None:
        arms = {**arms, step_name: masgraph_run(False, captured)}  # last: the others are measured if it fails
    results = {}
    for name, run in arms.items():
        results[name] = per_step(run, args.tokens, count=name != step_name)
        ops, ms, _ = results[name]
        print(f"{name}: {ops:.0f} aten ops per decode step, {ms:.1f} ms per step here", flush=True)
    rows = [f"| {name} | {f'{ops:.0f}' if ops else '—'} | {f'{ops / results[peer][0]:.2f}x' if ops else '—'} "
            f"| {ms:.1f} |" for name, (ops, ms, _) in results.items()]
    counted = [name for name in arms if name != step_name]
    top = "; ".join(f"{k} {v:.0f}" for k, v in results[counted[0]][2].most_common(8))
    with open(args.record, "a") as f:
        model_kind = ("full random-weight model" if args.full else
                      "thin random model of the shape's layers / heads / vocabulary (near-zero compute)")
        f.write(f"\n### Aten ops per decode step, {args.shape} shape, {args.rows} rows, {args.device} {dtype} "
                f"({datetime.now():%Y-%m-%d %H:%M})\n\n`{' '.join([Path(sys.executable).name, *sys.argv])}` — "
                f"{model_kind}, LoRA r16 q/v active, "
                f"T 0.7, {args.prefixes} distinct system prompt(s), ops of the last "
                f"{args.tokens - args.tokens // 2} of {args.tokens} tokens per step.\n\n"
                f"| arm | aten ops per decode step | vs generate | ms per step, {args.device} |\n"
                "|---|---|---|---|\n" + "\n".join(rows)
                + f"\n\nMost frequent in the first counted arm, per step: {top}.\n")
    print(f"recorded in {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
