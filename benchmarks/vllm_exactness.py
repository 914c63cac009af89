"""Token exactness of the vLLM backend against the trainer, per dtype (one vLLM server started per dtype):

1. rollout logprobs vs the learner's recomputation on the same ids: sampled at the training temperature (1.0) with
   a LoRA adapter published through the weight-sync step (its weights perturbed, as after training), mean / p99 /
   max |Δ| per token, and the PPO clip fraction this mismatch alone causes at ratio ≈ 1 (Flow-GRPO's clip
   [1 - 0.2, 1 + 0.3]: the fraction of tokens whose ratio exp(Δ) falls outside before any update); the peer is
   the in-process hf backend's batched rollouts against the same learner (what training uses without vLLM);
2. greedy agreement with the hf backend (deterministic, same dtype) on the same prompts: identical completion ids,
   and identical answer text.

Prompts: `--n` questions of basic_arithmetic and long_arithmetic (half each) under a short system prompt.

    .venv/bin/python benchmarks/vllm_exactness.py [--n 128] [--dtypes float32 bfloat16]    # needs `make vllm`
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

from masgraph.backends.base import Request
from masgraph.backends.hf import HFBackend
from masgraph.backends.hf.learner import HFLearner
from masgraph.backends.vllm import VLLMBackend
from masgraph.learn.learner import LoraConfigSpec
from masgraph.spec import SamplingSpec
from masgraph.tasks import get_task

SYSTEM = "You are a careful assistant. Work the question out, then give the final number."
CLIP_LOW, CLIP_HIGH = 0.2, 0.3


def prompts(n: int) -> list[list[dict[str, str]]]:
    items = (get_task("basic_arithmetic").items("test", n // 2, 0)
             + get_task("long_arithmetic").items("test", n - n // 2, 0))
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": it.question}] for it in items]


def perturbed_learner(dtype: str) -> HFLearner:
    learner = HFLearner("smollm2-135m", dtype=dtype)
    learner.add_adapter("planner", LoraConfigSpec(rank=16))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in learner.parameters("planner"):
            p.add_(torch.randn_like(p) * 0.02)
    learner.new_version("planner")
    return learner


def logprob_gap(backend, learner: HFLearner, msgs: list, max_tokens: int) -> dict[str, float]:
    sampling = SamplingSpec(temperature=1.0, max_tokens=max_tokens)
    reqs = [Request(m, adapter="planner", sampling=sampling, seed=i) for i, m in enumerate(msgs)]
    done = asyncio.run(backend.complete(reqs))
    assert all(c.policy_version == learner.version("planner") for c in done)
    rows = [SimpleNamespace(prompt_ids=c.prompt_ids, completion_ids=c.completion_ids, temperature=1.0) for c in done]
    deltas = []
    with torch.no_grad():
        for i in range(0, len(rows), 16):
            lps = learner.sequence_logprobs(rows[i:i + 16], "planner")
            deltas += [lp.float() - torch.tensor(c.logprobs) for lp, c in zip(lps, done[i:i + 16])]
    d = torch.cat(deltas)
    ratio = d.exp()
    clipped = ((ratio < 1 - CLIP_LOW) | (ratio > 1 + CLIP_HIGH)).float().mean().item()
    a = d.abs()
    return {"tokens": len(d), "mean_abs": a.mean().item(), "p99_abs": a.quantile(0.99).item(),
            "max_abs": a.max().item(), "clip_fraction": clipped}


def greedy_agreement(backend: VLLMBackend, learner: HFLearner, msgs: list, max_tokens: int) -> dict[str, float]:
    sampling = SamplingSpec(temperature=0.0, max_tokens=max_tokens)
    reqs = [Request(m, sampling=sampling, seed=i, key=(i,)) for i, m in enumerate(msgs)]
    v = asyncio.run(backend.complete(reqs))
    hf = HFBackend(learner.weights, deterministic=True)
    h = asyncio.run(hf.complete(reqs))
    asyncio.run(hf.aclose())
    same_ids = sum(a.completion_ids == b.completion_ids for a, b in zip(v, h))
    same_text = sum(a.text.strip() == b.text.strip() for a, b in zip(v, h))
    prefix = [next((k for k, (x, y) in enumerate(zip(a.completion_ids, b.completion_ids)) if x != y), None)
              for a, b in zip(v, h)]
    first = sorted(k for k in prefix if k is not None)
    return {"prompts": len(msgs), "same_ids": same_ids, "same_text": same_text,
            "first_divergence_median": first[len(first) // 2] if first else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    msgs = prompts(args.n)
    print(f"vllm exactness: {len(msgs)} prompts, max_tokens {args.max_tokens}, torch {torch.__version__}")
    for dtype in args.dtypes:
        learner = perturbed_learner(dtype)
        with tempfile.TemporaryDirectory() as logs:
            t0 = time.perf_counter()
            backend = VLLMBackend("smollm2-135m", dtype=dtype, log_dir=logs)
            started = time.perf_counter() - t0
            backend.publish("planner", learner.version("planner"), learner.source("planner"))
            try:
                gap = logprob_gap(backend, learner, msgs, args.max_tokens)
                agree = greedy_agreement(backend, learner, msgs, args.max_tokens)
            finally:
                asyncio.run(backend.aclose())
        print(f"{dtype:9s} server start {started:.0f} s")
        print(f"  logprobs (T=1, adapter v{learner.version('planner')}), {gap['tokens']} tokens: mean |Δ| "
              f"{gap['mean_abs']:.2e}  p99 {gap['p99_abs']:.2e}  max {gap['max_abs']:.2e}  clip fraction at ratio≈1 "
              f"{gap['clip_fraction']:.4f}")
        print(f"  greedy vs hf (base): identical ids {agree['same_ids']}/{agree['prompts']}, identical text "
              f"{agree['same_text']}/{agree['prompts']}, median first divergence at token "
              f"{agree['first_divergence_median']}", flush=True)
        # the peer: the in-process hf backend's rollouts (batched, as in training) against the same learner, the
        # adapter served as the weight-sync step serves it in training
        hf = HFBackend(learner.weights, seed=0)
        hf.publish("planner", learner.version("planner"), learner.source("planner"))
        hf_gap = logprob_gap(hf, learner, msgs, args.max_tokens)
        asyncio.run(hf.aclose())
        print(f"  peer, hf backend batched rollouts, {hf_gap['tokens']} tokens: mean |Δ| {hf_gap['mean_abs']:.2e}  "
              f"p99 {hf_gap['p99_abs']:.2e}  max {hf_gap['max_abs']:.2e}  clip fraction {hf_gap['clip_fraction']:.4f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
