"""Rollout throughput of a local model (default the embedded SmolLM2-135M; CPU or GPU), ratios from one run:

1. episodes/s of the AgentFlow graph at concurrency 16 vs 1 (dynamic batching across episodes; target >= 3x),
   and at 16 in deterministic mode (each row decodes alone: what bit-exact runs cost);
2. concurrency 1 in the scheduler vs the same backend's own `generate` called directly on the same requests,
   one at a time (like for like: same prefix KV cache, same decode loop; the scheduler and batcher must not
   add waiting; target >= 0.9x). For reference, also vs plain transformers `generate` on the same prompt
   ids, which has no prefix KV cache: that ratio includes the cache's gain and is named for it;
3. generated tokens/s inside the scheduler at concurrency 16 vs the same backend's raw batched
   `generate` on the same 16 requests in one batch (target >= 0.8x);
4. generated tokens/s of the AgentFlow graph at concurrency 16 (the figure to compare across devices) vs the
   same LLM calls replayed straight into the backend's batched decode: the calls of one node at one step of the
   episode, up to 16 at a time on the backend's cached static prompt prefix (same prompts, same token counts; no
   scheduler, no tools, no waiting; target >= 0.8x).

`--model random:qwen2-0.5b` (also random:qwen2-1.5b, random:smollm2-135m, random:tiny; benchmarks/models.py)
measures a random-weight model of that shape, where no real weights are at hand (speed does not depend on the
values); with a random model every call generates its full `max_tokens` on every side compared (no EOS).
`--device cuda` runs on the GPU (default auto: the GPU when torch sees one).

    .venv/bin/python benchmarks/rollout_throughput.py [--n 16] [--model random:qwen2-0.5b] [--device cuda]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch
from models import is_random, no_eos, resolve
from results_file import results_file

from masgraph.backends.base import Request
from masgraph.backends.hf import HFBackend
from masgraph.backends.hf.model import contiguous_head_input
from masgraph.device import describe
from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.runtime.runner import RunConfig, Runner
from masgraph.spec import GraphSpec, SamplingSpec
from masgraph.tasks import get_task

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run_graph(graph, backend, task, n, concurrency, profile: dict | None = None):
    """Run `n` episodes at `concurrency`; (result, seconds). `profile`, where given, gets where the time went: the
    backend's counters over the run (see HFBackend.stats) and the wall-clock."""
    before = dict(backend.stats)
    with tempfile.TemporaryDirectory() as runs:
        runner = Runner(graph, RunConfig(n=n, concurrency=concurrency, runs_dir=runs), backends={"hf": backend})
        t0 = time.perf_counter()
        result = asyncio.run(runner.run_task(task))
        took = time.perf_counter() - t0
    if profile is not None:
        profile.update({k: v - before[k] for k, v in backend.stats.items()}, wall_s=took)
    return result, took


PROFILE_HEAD = ("| run | wall s | in generate s | prompt prefill s | one-token steps s | outside generate s | "
                "batches | rows / batch | rows / decode loop | prompt tokens received | computed | with padding | "
                "generated tokens |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")


def profile_row(name: str, p: dict) -> str:
    """One run's profile: the backend's time split (prompt prefill, including each batch's first pick, vs the
    one-token decode steps after) and what ran outside the backend (scheduler, tools, waiting in the batcher)."""
    return (f"| {name} | {p['wall_s']:.1f} | {p['generate_s']:.1f} | {p['prefill_s']:.1f} | {p['decode_s']:.1f} | "
            f"{p['wall_s'] - p['generate_s']:.1f} | {p['batches']} | {p['rows'] / max(p['batches'], 1):.1f} | "
            f"{p['rows'] / max(p['decode_loops'], 1):.1f} | "
            f"{p['prompt_tokens']} | {p['prompt_tokens_computed']} | {p.get('prompt_positions_run', '')} | "
            f"{p['generated_tokens']} |\n")


def on(spec: GraphSpec, model: str, device: str) -> GraphSpec:
    """The graph with every hf policy on `model` (a name or directory) and `device`."""
    return spec.model_copy(update={"policies": {
        n: p.model_copy(update={"model": model, "device": device}) if p.backend == "hf" else p
        for n, p in spec.policies.items()}})


def plain_generate(backend: HFBackend, prompts: list[list[int]], max_new: int, fixed: bool) -> tuple[float, int]:
    """Sequential transformers generate (greedy) on the exact prompt ids; (seconds, generated tokens). `fixed`:
    every call generates `max_new` tokens (min_new_tokens), like the backend without EOS."""
    model = backend.model.get_base_model() if hasattr(backend.model, "get_base_model") else backend.model
    extra = {"min_new_tokens": max_new} if fixed else {}
    tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids], device=model.device),
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device),
                                 max_new_tokens=max_new, do_sample=False, pad_token_id=backend.pad_id, **extra)
            tokens += out.shape[1] - len(ids)
    return time.perf_counter() - t0, tokens


def replay_batched(backend: HFBackend, traces: list, batch: int) -> tuple[float, int]:
    """The episodes' LLM calls straight into the backend's batched decode, greedy, each call capped at the tokens
    it produced: the calls at the same step of the episode by the same node and adapter, `batch` at a time, each
    batch on the longest static prompt prefix the backend has cached for that adapter (what its `generate` reuses;
    none: whole prompts, as `generate` does then). The lockstep batching a graph rollout could at best reach on
    this work, with no scheduler, tools or waiting; (seconds, generated tokens)."""
    groups: dict[tuple, list] = {}
    for t in traces:
        for step in t.steps:
            for call in step.llm:
                groups.setdefault((step.index, step.node, call.adapter), []).append(call)
    cached = [(adapter, prefix) for adapter, _, prefix in backend._prefix_kv]
    tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for (_, _, adapter), calls in groups.items():
            for i in range(0, len(calls), batch):
                chunk = calls[i:i + batch]
                seqs = [c.prompt_ids for c in chunk]
                shortest = min(len(s) for s in seqs)
                prefix = max((p for a, p in cached if a == adapter and len(p) < shortest
                              and all(tuple(s[:len(p)]) == p for s in seqs)), key=len, default=())
                reqs = [Request([], adapter=adapter, sampling=SamplingSpec(temperature=0.0,
                                                                           max_tokens=max(1, len(c.completion_ids))))
                        for c in chunk]
                outs = backend._decode([prefix] * len(seqs), [s[len(prefix):] for s in seqs], reqs)
                tokens += sum(len(ids) for ids, _, _ in outs)
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--model", default="smollm2-135m",
                    help="a model name, a local HF directory, or random:qwen2-0.5b | random:qwen2-1.5b | "
                    "random:smollm2-135m | random:tiny (random weights of that shape; benchmarks/models.py)")
    ap.add_argument("--device", default="auto", help="auto (the GPU when torch sees one), cpu, cuda, cuda:N")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 where measured faster), float32, bfloat16")
    ap.add_argument("--fixed-length", action="store_true",
                    help="every call generates its full max_tokens (no EOS); always on for a random model")
    ap.add_argument("--max-new", type=int, default=48, help="answer cap of the single-call measures (default 48)")
    ap.add_argument("--record", type=Path, default=results_file("rollout_throughput"),
                    help="markdown file the results section is appended to (default results/rollout_throughput.md)")
    args = ap.parse_args()
    fixed = args.fixed_length or is_random(args.model)
    model = resolve(args.model, args.device)
    backend = HFBackend(model, dtype=args.dtype, max_batch_size=16, device=args.device)
    if fixed:
        no_eos(backend)
    where = describe(backend.device)
    print(f"model {args.model} ({model}), device {where}, dtype {backend.dtype}, torch threads "
          f"{torch.get_num_threads()}, fixed-length {fixed}", flush=True)

    # 1. AgentFlow episodes/s, c=16 vs c=1
    agentflow = compile_spec(on(load_spec(ROOT / "graphs" / "agentflow.yaml"), model, args.device))
    task = get_task("basic_arithmetic")
    run_graph(agentflow, backend, task, 2, 2)  # warm-up
    p1, p16 = {}, {}
    r1, t1 = run_graph(agentflow, backend, task, args.n, 1, p1)
    r16, t16 = run_graph(agentflow, backend, task, args.n, 16, p16)
    eps1, eps16 = args.n / t1, args.n / t16
    print(f"agentflow: c=1 {eps1:.3f} ep/s, c=16 {eps16:.3f} ep/s -> {eps16 / eps1:.2f}x "
          f"(acc {r1.summary['accuracy']:.2f} / {r16.summary['accuracy']:.2f})", flush=True)
    arms = {}  # the layouts before, same run: each change off alone, then both
    before = {"one left-padded prompt pass per batch": {"pass_overhead": None},
              "finished rows riding along": {"drop_finished": False},
              "both (the layout before)": {"pass_overhead": None, "drop_finished": False}}
    for label, settings in before.items():
        kept = {name: getattr(backend, name) for name in settings}
        for name, value in settings.items():
            setattr(backend, name, value)
        prof: dict = {}
        _, took = run_graph(agentflow, backend, task, args.n, 16, prof)
        for name, value in kept.items():
            setattr(backend, name, value)
        arms[label] = (args.n / took, prof)
        print(f"agentflow c=16, {label} {args.n / took:.3f} ep/s -> c=16 / c=1 {args.n / took / eps1:.2f}x",
              flush=True)
    # the output head on a strided input (before 8113b7a): both concurrencies change, so both run again without it
    weights = backend.weights
    weights.head_hook.remove()
    p1_head, p16_head = {}, {}
    _, t1_head = run_graph(agentflow, backend, task, args.n, 1, p1_head)
    _, t16_head = run_graph(agentflow, backend, task, args.n, 16, p16_head)
    weights.head_hook = contiguous_head_input(weights.model)
    head_ratio = t1_head / t16_head
    print(f"agentflow with the head on a strided input: c=1 {args.n / t1_head:.3f} ep/s, c=16 {args.n / t16_head:.3f} "
          f"ep/s -> {head_ratio:.2f}x", flush=True)
    profile = (PROFILE_HEAD + profile_row("agentflow c=1", p1) + profile_row("agentflow c=16", p16)
               + "".join(profile_row(f"agentflow {label if label.startswith('c=1') else 'c=16, ' + label}", prof)
                         for label, (_, prof) in arms.items())
               + profile_row("agentflow c=1, head on a strided input", p1_head)
               + profile_row("agentflow c=16, head on a strided input", p16_head))
    print(profile, flush=True)
    # 4. AgentFlow generated tokens/s at c=16 vs the same calls replayed into the batched decode
    tok_a16 = sum(t.completion_tokens for t in r16.traces)
    calls_a16 = sum(len(t.llm_calls) for t in r16.traces)
    replay_batched(backend, r16.traces, 16)  # warm-up
    trep, tok_rep = replay_batched(backend, r16.traces, 16)
    ratio_rep = (tok_a16 / t16) / (tok_rep / trep)
    print(f"agentflow c=16 {tok_a16 / t16:.1f} tok/s ({tok_a16} tokens, {calls_a16} calls) vs the same calls "
          f"replayed into the batched decode {tok_rep / trep:.1f} tok/s ({tok_rep} tokens) -> {ratio_rep:.2f}x",
          flush=True)
    backend.deterministic = True  # what --deterministic (and train.deterministic) costs: each row decodes alone
    _, tdet = run_graph(agentflow, backend, task, args.n, 16)
    backend.deterministic = False
    eps_det = args.n / tdet
    print(f"agentflow c=16 deterministic {eps_det:.3f} ep/s vs batched {eps16:.3f} -> {eps_det / eps16:.2f}x",
          flush=True)

    # 2 + 3. single-call graph with longer answers: scheduler vs plain generate vs raw batched generate
    spec = on(load_spec(ROOT / "graphs" / "single.yaml"), model, args.device)
    max_new = args.max_new
    pol = spec.policies["main"].model_copy(update={"sampling": SamplingSpec(temperature=0.0, max_tokens=max_new)})
    single = compile_spec(spec.model_copy(update={"policies": {"main": pol}}))
    gsm = get_task("gsm_symbolic")
    s1, ts1 = run_graph(single, backend, gsm, args.n, 1)
    tok_s1 = sum(t.completion_tokens for t in s1.traces)
    prompts = [t.llm_calls[0].prompt_ids for t in s1.traces]
    tg, tok_g = plain_generate(backend, prompts, max_new, fixed)
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

    with open(args.record, "a") as f:
        f.write(f"\n### Rollout throughput, {args.model} on {where} ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
                f"`{' '.join([Path(sys.executable).name, *sys.argv])}` — dtype {backend.dtype}, "
                f"{torch.get_num_threads()} threads, n={args.n}"
                + (", random weights / fixed-length generation (no EOS)" if fixed else "") + "\n\n"
                "| measure | masgraph | peer | ratio | target |\n|---|---|---|---|---|\n"
                f"| agentflow episodes/s, c=16 vs c=1 | {eps16:.3f} | {eps1:.3f} | **{eps16 / eps1:.2f}x** | ≥ 3x |\n"
                + "".join(f"| agentflow episodes/s, {label if label.startswith('c=1') else 'c=16 with ' + label} vs "
                          f"c=1 | {eps:.3f} | {eps1:.3f} | {eps / eps1:.2f}x | (layouts compared) |\n"
                          for label, (eps, _) in arms.items())
                + f"| agentflow episodes/s, c=16 vs c=1, both with the output head on a strided input (before "
                f"8113b7a) | {args.n / t16_head:.3f} | {args.n / t1_head:.3f} | {head_ratio:.2f}x | "
                "(layouts compared) |\n"
                + f"| agentflow episodes/s at c=16, deterministic (rows decode alone) vs batched | {eps_det:.3f} | "
                f"{eps16:.3f} | {eps_det / eps16:.2f}x | (the cost of determinism) |\n"
                f"| agentflow generated tokens/s at c=16 vs its calls replayed into the batched decode | "
                f"{tok_a16 / t16:.1f} | {tok_rep / trep:.1f} | **{ratio_rep:.2f}x** | ≥ 0.8x |\n"
                f"| tokens/s at c=1 vs the backend's `generate`, one request at a time | {tok_s1 / ts1:.1f} | "
                f"{tok_d / td:.1f} | **{ratio_direct:.2f}x** | ≥ 0.9x |\n"
                f"| tokens/s at c=1 (with prefix KV cache) vs plain HF `generate` (none) | {tok_s1 / ts1:.1f} | "
                f"{tok_g / tg:.1f} | {ratio_plain:.2f}x | (reference) |\n"
                f"| tokens/s at c=16 vs raw batched generate (batch {len(reqs)}) | {tok_s16 / ts16:.1f} | "
                f"{tok_raw / traw:.1f} | **{ratio_raw:.2f}x** | ≥ 0.8x |\n"
                "\nWhere the AgentFlow time went (the backend's counters over each run):\n\n" + profile)

if __name__ == "__main__":
    main()
