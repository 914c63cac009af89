"""Rollout throughput on the real embedded model (SmolLM2-135M, CPU), three ratios from one run:

1. episodes/s of the AgentFlow graph at concurrency 16 vs 1 (dynamic batching across episodes; target >= 4x),
   and at 16 in deterministic mode (each row decodes alone: what bit-exact runs cost);
2. concurrency 1 in the scheduler vs the same backend's own `generate` called directly on the same requests,
   one at a time (like for like: same prefix KV cache, same decode loop; the scheduler and batcher must not
   add waiting; target >= 0.9x). For reference, also vs plain transformers `generate` on the same prompt
   ids, which has no prefix KV cache: that ratio includes the cache's gain and is named for it;
3. generated tokens/s inside the scheduler at concurrency 16 vs the same backend's raw batched
   `generate` on the same 16 requests in one batch (target >= 0.8x).

    .venv/bin/python benchmarks/rollout_throughput.py [--n 16]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

from masgraph.backends.base import Request
from masgraph.backends.hf import HFBackend
from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.runner import RunConfig, Runner
from masgraph.spec import SamplingSpec
from masgraph.tasks import get_task

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run_graph(graph, backend, task, n, concurrency):
    with tempfile.TemporaryDirectory() as runs:
        runner = Runner(graph, RunConfig(n=n, concurrency=concurrency, runs_dir=runs), backends={"hf": backend})
        t0 = time.perf_counter()
        result = asyncio.run(runner.run_task(task))
        return result, time.perf_counter() - t0


def plain_generate(backend: HFBackend, prompts: list[list[int]], max_new: int) -> tuple[float, int]:
    """Sequential transformers generate (greedy) on the exact prompt ids; (seconds, generated tokens)."""
    model = backend.model.get_base_model() if hasattr(backend.model, "get_base_model") else backend.model
    tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new, do_sample=False, pad_token_id=backend.pad_id)
            tokens += out.shape[1] - len(ids)
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    args = ap.parse_args()
    backend = HFBackend(max_batch_size=16)
    print(f"backend dtype {backend.dtype}, torch threads {torch.get_num_threads()}", flush=True)

    # 1. AgentFlow episodes/s, c=16 vs c=1
    agentflow = compile_spec(load_spec(ROOT / "graphs" / "agentflow.yaml"))
    task = get_task("basic_arithmetic")
    run_graph(agentflow, backend, task, 2, 2)  # warm-up
    r1, t1 = run_graph(agentflow, backend, task, args.n, 1)
    r16, t16 = run_graph(agentflow, backend, task, args.n, 16)
    eps1, eps16 = args.n / t1, args.n / t16
    print(f"agentflow: c=1 {eps1:.3f} ep/s, c=16 {eps16:.3f} ep/s -> {eps16 / eps1:.2f}x "
          f"(acc {r1.summary['accuracy']:.2f} / {r16.summary['accuracy']:.2f})", flush=True)
    backend.deterministic = True  # what --deterministic (and train.deterministic) costs: each row decodes alone
    _, tdet = run_graph(agentflow, backend, task, args.n, 16)
    backend.deterministic = False
    eps_det = args.n / tdet
    print(f"agentflow c=16 deterministic {eps_det:.3f} ep/s vs batched {eps16:.3f} -> {eps_det / eps16:.2f}x",
          flush=True)

    # 2 + 3. single-call graph with longer answers: scheduler vs plain generate vs raw batched generate
    spec = load_spec(ROOT / "graphs" / "single.yaml")
    max_new = 48
    pol = spec.policies["main"].model_copy(update={"sampling": SamplingSpec(temperature=0.0, max_tokens=max_new)})
    single = compile_spec(spec.model_copy(update={"policies": {"main": pol}}))
    gsm = get_task("gsm_symbolic")
    s1, ts1 = run_graph(single, backend, gsm, args.n, 1)
    tok_s1 = sum(t.completion_tokens for t in s1.traces)
    prompts = [t.llm_calls[0].prompt_ids for t in s1.traces]
    tg, tok_g = plain_generate(backend, prompts, max_new)
    ratio_plain = (tok_s1 / ts1) / (tok_g / tg)
    print(f"c=1 in scheduler {tok_s1 / ts1:.1f} tok/s vs plain HF generate (no prefix cache) {tok_g / tg:.1f} tok/s "
          f"-> {ratio_plain:.2f}x", flush=True)
    items = gsm.items("test", args.n)
    from masgraph.agents.prompting import load_template
    turns = load_template("direct")
    reqs = [Request([{"role": r, "content": t.safe_substitute(query=it.question)} for r, t in turns],
                    sampling=pol.sampling) for it in items]
    t0 = time.perf_counter()
    direct = [backend.generate([r])[0] for r in reqs]  # same backend, same cache, no scheduler, one at a time
    td = time.perf_counter() - t0
    tok_d = sum(len(c.completion_ids) for c in direct)
    ratio_direct = (tok_s1 / ts1) / (tok_d / td)
    print(f"c=1 in scheduler {tok_s1 / ts1:.1f} tok/s vs the backend's generate one request at a time "
          f"{tok_d / td:.1f} tok/s -> {ratio_direct:.2f}x", flush=True)

    s16, ts16 = run_graph(single, backend, gsm, args.n, 16)
    tok_s16 = sum(t.completion_tokens for t in s16.traces)
    assert [backend.encode(r.messages, max_new)[0] for r in reqs] == [t.llm_calls[0].prompt_ids for t in
                                                                      sorted(s16.traces, key=lambda t: t.episode_id)]
    t0 = time.perf_counter()
    raw = backend.generate(reqs)
    traw = time.perf_counter() - t0
    tok_raw = sum(len(c.completion_ids) for c in raw)
    ratio_raw = (tok_s16 / ts16) / (tok_raw / traw)
    print(f"c=16 in scheduler {tok_s16 / ts16:.1f} tok/s vs raw batched generate (batch {len(reqs)}) "
          f"{tok_raw / traw:.1f} tok/s -> {ratio_raw:.2f}x", flush=True)

    with open(HERE / "RESULTS.md", "a") as f:
        f.write(f"\n### Rollout throughput, SmolLM2-135M on CPU ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
                f"`{' '.join([Path(sys.executable).name, *sys.argv])}` — dtype {backend.dtype}, "
                f"{torch.get_num_threads()} threads, n={args.n}\n\n"
                "| measure | masgraph | peer | ratio | target |\n|---|---|---|---|---|\n"
                f"| agentflow episodes/s, c=16 vs c=1 | {eps16:.3f} | {eps1:.3f} | **{eps16 / eps1:.2f}x** | ≥ 4x |\n"
                f"| agentflow episodes/s at c=16, deterministic (rows decode alone) vs batched | {eps_det:.3f} | "
                f"{eps16:.3f} | {eps_det / eps16:.2f}x | (the cost of determinism) |\n"
                f"| tokens/s at c=1 vs the backend's `generate`, one request at a time | {tok_s1 / ts1:.1f} | "
                f"{tok_d / td:.1f} | **{ratio_direct:.2f}x** | ≥ 0.9x |\n"
                f"| tokens/s at c=1 (with prefix KV cache) vs plain HF `generate` (none) | {tok_s1 / ts1:.1f} | "
                f"{tok_g / tg:.1f} | {ratio_plain:.2f}x | (reference) |\n"
                f"| tokens/s at c=16 vs raw batched generate (batch {len(reqs)}) | {tok_s16 / ts16:.1f} | "
                f"{tok_raw / traw:.1f} | **{ratio_raw:.2f}x** | ≥ 0.8x |\n")


if __name__ == "__main__":
    main()
