"""Does compiling the model help batched decoding on this machine? transformers `generate` on the same prompts,
eager vs `torch.compile` of the model's forward with a static KV cache (transformers' documented fast path: fixed
shapes, fused elementwise kernels), arms alternating, fixed-length sampled completions, one process.

The question behind it (issue 55): a 32-row decode step of SmolLM2-135M in fp32 spends ~2/3 of its time in matrix
multiplies at 32 rows, the rest in attention, norms, rotary and the sampler; fusing the rest is what compiling buys.

    .venv/bin/python benchmarks/decode_compile.py [--rows 32] [--tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from datetime import datetime

import torch
from results_file import results_file

from masgraph.model import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=57, help="prompt tokens per row (the long_arithmetic prompt's)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per row (no EOS stop)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    path = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(100, 1000, (args.rows, args.prompt), generator=torch.Generator().manual_seed(0))

    def run(**kw) -> float:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                           min_new_tokens=args.tokens, do_sample=True, temperature=0.7, pad_token_id=0, **kw)
        return time.perf_counter() - t0

    eager_forward = model.forward
    compiled_forward = torch.compile(model.forward, dynamic=False)
    arms = {"eager": ({}, eager_forward), "compiled, static cache": ({"cache_implementation": "static"},
                                                                    compiled_forward)}
    walls: dict[str, list[float]] = {a: [] for a in arms}
    warm: dict[str, float] = {}
    for name, (kw, forward) in arms.items():  # warm-up (the compiled arm's includes compiling)
        model.forward = forward
        warm[name] = run(**kw)
        print(f"{name}: warm-up {warm[name]:.1f} s", flush=True)
    for _ in range(args.repeats):
        for name, (kw, forward) in arms.items():
            model.forward = forward
            walls[name].append(run(**kw))
            print(f"{name}: {walls[name][-1]:.1f} s", flush=True)
    eager, compiled = statistics.median(walls["eager"]), statistics.median(walls["compiled, static cache"])
    tokens = args.rows * args.tokens
    ratio = eager / compiled
    print(f"decode tokens/s: eager {tokens / eager:.1f}, compiled {tokens / compiled:.1f} -> compiled / eager "
          f"{ratio:.2f}x")
    command = "python benchmarks/decode_compile.py" + "".join(
        f" --{k} {v}" for k, v in (("rows", args.rows), ("tokens", args.tokens), ("repeats", args.repeats)))
    when = datetime.now().strftime("%Y-%m-%d %H:%M")
    entry = (f"\n### Decode eager vs compiled, {args.model} fp32 on cpu ({when}, {platform.machine()}, "
             f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads)\n\n"
             f"`{command}` — transformers `generate`, {args.rows} rows x {args.prompt} prompt tokens, "
             f"{args.tokens} sampled tokens each (no EOS stop), arms alternating, median of {args.repeats}.\n\n"
             "| arm | warm-up s | seconds (each) | tokens/s |\n|---|---|---|---|\n"
             + "".join(f"| {n} | {warm[n]:.1f} | {statistics.median(w):.1f} ({', '.join(f'{x:.1f}' for x in w)}) | "
                       f"{tokens / statistics.median(w):.1f} |\n" for n, w in walls.items())
             + f"\nCompiled / eager decode tokens/s: **{ratio:.2f}x**\n")
    with results_file("decode_compile").open("a") as f:
        f.write(entry)


if __name__ == "__main__":
    main()
