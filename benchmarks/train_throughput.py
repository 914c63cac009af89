"""Training throughput: masgraph Flow-GRPO vs TRL `GRPOTrainer`, same model, LoRA, dtype, prompts, lengths.

Single-turn task both can run: the one-node `graphs/single.yaml` graph on `long_arithmetic`. TRL gets
the exact prompt text masgraph renders for each item (decoded from the recorded prompt ids), the same
items in the same order, the same reward (masgraph's answer parser + the task's scorer), group size,
queries per step, completion cap, temperature, LoRA (r, alpha, q/v), learning rate, clip range, KL
coefficient and dtype (pinned for both sides with --dtype: fp32 on a CPU, bf16 on a GPU by default; masgraph's
own dtype probe is not used), and gradient checkpointing on both sides or on neither (--gradient-checkpointing;
off by default, though TRL's GRPOConfig turns it on by default). Every setting of both sides is printed and
recorded. One optimizer step = rollouts of 4 queries (--queries) × 8 completions + one update, on both sides.
Tokens are counted the same way on both: completion tokens generated per step (EOS included) divided by the
step's wall-clock. The first step of each side is warm-up and not counted.

On a GPU (--device, default auto: the GPU when torch sees one) each side's peak device memory per training step
is reported too (torch.cuda.max_memory_allocated, reset at the start of each step: rollouts + update); each side
runs in its own process, so neither sees the other's memory. `--model random:qwen2-0.5b` (random:qwen2-1.5b,
random:smollm2-135m, random:tiny; benchmarks/models.py) trains a random-weight model of that shape, where the
real weights are not at hand; then every completion runs to its full length on both sides (masgraph: no EOS;
TRL: min_new_tokens), so both generate the same number of tokens. `--no-trl` runs masgraph alone.

    .venv/bin/python benchmarks/train_throughput.py [--steps 5] [--dtype float32] [--model random:qwen2-0.5b]
        [--device cuda] [--max-tokens 128] [--gradient-checkpointing] [--no-trl]
"""

# ruff: noqa: E402  (the environment is read before any import: `import masgraph` changes it)
from __future__ import annotations

import os

STARTED_WITH = dict(os.environ)
"""This process's environment before `import masgraph` added its thread settings (masgraph/threads.py): TRL's side
runs in it, so each side has its own library's default thread environment."""

import argparse
import asyncio
import json
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from models import is_random, no_eos, resolve
from results_file import results_file

from masgraph.agents.formats import parse_answer
from masgraph.device import describe, resolve_device
from masgraph.events import Event, ListSink, TrainStep
from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.model import resolve_model
from masgraph.rundir.store import read_traces
from masgraph.tasks import get_task
from masgraph.trainers.config import with_overrides
from masgraph.trainers.loop import TrainLoop

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TASK = "long_arithmetic"


class PeakMemory:
    """Peak device memory of each training step (rollouts + update), from one TrainStep event to the next; nothing
    on a CPU. `start()` once the model is loaded, so the first step's peak leaves the loading out."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.steps: list[float] = []  # GiB, one per step

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.steps.append(torch.cuda.max_memory_allocated(self.device) / 2**30)

    def emit(self, event: Event) -> None:
        if isinstance(event, TrainStep):
            self.stop()
            self.start()


def resident(device: torch.device) -> float | None:
    """Device memory allocated now (GiB): the weights and what else stays between steps; None on a CPU."""
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None


def linear_kernel(device: torch.device, dtype: str) -> str:
    """The kernel masgraph's side ran its frozen linear layers on: on a CPU in fp32, BLAS or oneDNN, whichever this
    machine measured faster (masgraph/backends/hf/onednn.py); elsewhere torch's default."""
    from masgraph.backends.hf import onednn

    return onednn.kernel() if device.type == "cpu" and dtype == "float32" else "default"


def traced_graphs() -> int:
    """Graphs torch.compile traced in this process (each a compile; the captured decode step's count)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_masgraph(args: argparse.Namespace, model: str, dtype: str) -> tuple[dict, list[dict], list[str], list]:
    """Flow-GRPO through TrainLoop (rollouts via the Runner); returns config, per-step records, prompts, items."""
    spec = load_spec(ROOT / "graphs" / "single.yaml")
    # zero_variance: keep — train on every row, as TRL does (skipping all-equal groups would do less work)
    fg = with_overrides(spec.train.flow_grpo, {"batching": {"zero_variance": "keep",
                                                            "micro_batch_tokens": args.micro_batch_tokens}})
    queries = args.queries or spec.train.queries_per_step
    # every rollout of a step in flight and decoding in one batch, as TRL generates a step's rows in one `generate`
    concurrency = max(spec.train.concurrency, queries * spec.train.flow_grpo.group_size)
    cfg = spec.train.model_copy(update={"steps": args.steps, "queries_per_step": queries, "eval_every": 0,
                                        "concurrency": concurrency,
                                        "eval_n": 1, "checkpoint_every": 10_000,
                                        "flow_grpo": fg, "gradient_checkpointing": args.gradient_checkpointing})
    main = spec.policies["main"]
    sampling = main.sampling.model_copy(update={"max_tokens": args.max_tokens or main.sampling.max_tokens})
    policy = main.model_copy(update={"model": model, "device": args.device, "sampling": sampling})
    graph = compile_spec(spec.model_copy(update={"train": cfg, "policies": {"main": policy}}))
    device = resolve_device(args.device)
    records: list[dict] = []
    peak = PeakMemory(device)
    with tempfile.TemporaryDirectory() as run_dir:
        steps_sink = ListSink()
        loop = TrainLoop(graph, get_task(TASK), Path(run_dir), dtype=dtype, sinks=[steps_sink, peak])
        if args.fixed:
            no_eos(loop.backend, loop.eval_backend)
        if args.captured:  # rollouts through the captured step (a CUDA graph on a GPU); it compiles in step 0
            for b in {id(b): b for b in (loop.backend, loop.eval_backend)}.values():
                b.capture_decode()
        loaded = resident(device)
        peak.start()
        asyncio.run(loop.run())
        records += [{"step": e.step, **e.metrics} for e in steps_sink.events if isinstance(e, TrainStep)]
        traces = [t.model_dump() for t in read_traces(run_dir)]
    for r, gib in zip(records, peak.steps):
        r["peak_gib"] = gib
    tok = loop.backend.tokenizer
    prompts = {}
    for t in traces:  # the exact prompt each item was rendered to
        prompts.setdefault(t["item_id"], tok.decode(t["steps"][0]["llm"][0]["prompt_ids"]))
    items = loop.items[:args.steps * cfg.queries_per_step]
    config = {"model": args.model, "path": str(resolve_model(model)), "device": describe(device),
              "dtype": loop.learner.dtype, "fixed_length": args.fixed,
              "lora": [cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets], "lr": cfg.flow_grpo.lr,
              "group_size": cfg.flow_grpo.group_size, "queries_per_step": cfg.queries_per_step,
              "max_completion_tokens": sampling.max_tokens,
              "temperature": cfg.flow_grpo.temperature,
              "clip": [cfg.flow_grpo.ppo.clip_eps_low, cfg.flow_grpo.ppo.clip_eps_high],
              "kl_coef": cfg.flow_grpo.ppo.kl_coef, "micro_batch": cfg.flow_grpo.batching.micro_batch,
              "micro_batch_tokens": cfg.flow_grpo.batching.micro_batch_tokens,
              "gradient_checkpointing": cfg.gradient_checkpointing,
              "zero_variance": cfg.flow_grpo.batching.zero_variance, "concurrency": cfg.concurrency,
              # the captured step's static caches made, and the graphs dynamo traced (more than the shapes x adapters:
              # something recompiled between steps)
              "captured_decode": args.captured and {"shapes": loop.backend.captured.shapes,
                                                    "graphs": traced_graphs()},
              "resident_gib": loaded,
              "threads": thread_env(), "linear_kernel": linear_kernel(device, loop.learner.dtype)}
    return config, [r for r in records if r["step"] > 0], [prompts[it.id] for it in items], items


def run_trl(steps: int, mg: dict, prompts: list[str], items: list, device: torch.device, micro_batch: int | None = None
            ) -> tuple[dict, list[float], list[int], list[float], list[float]]:
    """TRL GRPOTrainer on the same prompts/items/reward; returns config, step times, completion tokens per step,
    peak device memory per step (GiB; empty on a CPU) and the seconds of each step in TRL's `_generate` (its
    rollouts; the rest of the step is its scoring, reference pass and update). `micro_batch`: rows per forward /
    backward pass, the step's rows accumulated over passes (TRL's `per_device_train_batch_size` with
    `gradient_accumulation_steps`; one generation batch and one optimizer step per step either way); default all of
    a step's rows in one pass."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task = get_task(TASK)
    by_q = {p: it for p, it in zip(prompts, items)}
    tokens: list[int] = []

    def reward(prompts, completions, completion_ids, **_) -> list[float]:
        tokens.append(sum(len(c) for c in completion_ids))
        return [task.score(by_q[p], parse_answer(c)[0]) for p, c in zip(prompts, completions)]

    times: list[float] = []
    generating: list[float] = []
    peak = PeakMemory(device)

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            peak.start()
            generating.append(0.0)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            peak.stop()
            times.append(time.perf_counter() - self.t0)
            print(f"[TRL] step {len(times)} of {steps}: {times[-1]:.1f} s (generation {generating[-1]:.1f} s)",
                  flush=True)  # a cut-off run keeps these

    path = mg["path"]
    dtype = getattr(torch, mg["dtype"].removeprefix("torch."))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    cpu = device.type == "cpu"
    rows = mg["group_size"] * mg["queries_per_step"]
    gen = {"min_new_tokens": mg["max_completion_tokens"]} if mg["fixed_length"] else None
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, use_cpu=cpu, bf16=dtype == torch.bfloat16, fp16=False, max_steps=steps,
            learning_rate=mg["lr"],
            per_device_train_batch_size=micro_batch or rows, gradient_accumulation_steps=rows // (micro_batch or rows),
            num_generations=mg["group_size"], max_completion_length=mg["max_completion_tokens"],
            temperature=mg["temperature"], top_p=1.0, top_k=0, epsilon=mg["clip"][0], epsilon_high=mg["clip"][1],
            beta=mg["kl_coef"], num_iterations=1, lr_scheduler_type="constant", shuffle_dataset=False, report_to=[],
            logging_steps=1, generation_kwargs=gen,
            save_strategy="no", disable_dropout=True, seed=0, dataloader_num_workers=0,
            gradient_checkpointing=mg["gradient_checkpointing"],
            gradient_checkpointing_kwargs={"use_reentrant": False} if mg["gradient_checkpointing"] else None)
        lora = LoraConfig(r=mg["lora"][0], lora_alpha=mg["lora"][1], target_modules=mg["lora"][2], lora_dropout=0.0,
                          task_type="CAUSAL_LM")
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": prompts}), peft_config=lora,
                              callbacks=[Timer()])
        generate = trainer._generate

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return generate(*a, **kw)
            finally:
                generating[-1] += time.perf_counter() - t0

        trainer._generate = timed
        loaded = resident(device)
        trainer.train()
    trl_config = {k: getattr(args, k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                                "generation_batch_size", "num_generations",
                                                "max_completion_length", "temperature", "learning_rate", "epsilon",
                                                "epsilon_high", "beta", "loss_type", "lr_scheduler_type", "use_cpu",
                                                "bf16",
                                                "fp16", "gradient_checkpointing", "num_iterations", "top_p", "top_k",
                                                "generation_kwargs")}
    trl_config["model_dtype"] = str(model.dtype)
    trl_config["device"] = str(trainer.args.device)
    trl_config["resident_gib"] = loaded
    trl_config["threads"] = thread_env()
    return trl_config, times, tokens, peak.steps, generating


def gib(values: list[float]) -> str:
    """Peak memory over the counted steps (the first is warm-up), and every step's: `12.34 (12.30, 12.34)`."""
    if not values:
        return "n/a"
    counted = values[1:] or values
    return f"{max(counted):.2f} ({', '.join(f'{v:.2f}' for v in values)})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="one dtype for both sides (default auto: float32 on a CPU, bfloat16 on a GPU)")
    p.add_argument("--model", default="smollm2-135m",
                   help="a model name, a local HF directory, or random:qwen2-0.5b | random:qwen2-1.5b | "
                   "random:smollm2-135m | random:tiny (random weights of that shape; benchmarks/models.py)")
    p.add_argument("--device", default="auto", help="auto (the GPU when torch sees one), cpu, cuda, cuda:N")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="completion cap of both sides (default: graphs/single.yaml's, 32)")
    p.add_argument("--queries", type=int, default=None,
                   help="queries per step on both sides, each a group of 8 completions (default: single.yaml's, 4)")
    p.add_argument("--fixed-length", action="store_true",
                   help="every completion runs to --max-tokens on both sides (always on for a random model)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute activations in the backward pass, on both sides (train.gradient_checkpointing "
                   "for masgraph, GRPOConfig.gradient_checkpointing for TRL)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="masgraph's train.flow_grpo.micro_batch_tokens (TRL has no such knob; default none)")
    p.add_argument("--trl-micro-batch", type=int, default=None,
                   help="TRL's rows per forward / backward pass (per_device_train_batch_size, the step's rows "
                   "accumulated: gradient_accumulation_steps); must divide the step's rows; default all in one pass")
    p.add_argument("--no-trl", action="store_true", help="run masgraph alone (its tokens/s and memory)")
    p.add_argument("--captured", action="store_true",
                   help="masgraph's rollouts through the captured decode step (masgraph/backends/hf/captured.py)")
    p.add_argument("--record", type=Path, default=results_file("train_throughput"),
                   help="markdown file the results section is appended to (default results/train_throughput.md)")
    p.add_argument("--side", choices=["masgraph", "trl"], help=argparse.SUPPRESS)  # one side, in its own process
    p.add_argument("--io", type=Path, help=argparse.SUPPRESS)  # that side's input / output (a pickle)
    args = p.parse_args()
    device = resolve_device(args.device)
    args.device = str(device)
    if args.dtype == "auto":
        args.dtype = "float32" if device.type == "cpu" else "bfloat16"
    args.fixed = args.fixed_length or is_random(args.model)
    if args.side:
        return run_side(args)
    resolve(args.model, args.device)  # a random model is built once here, not by each side
    train = load_spec(ROOT / "graphs" / "single.yaml").train
    # checked before the masgraph side's minutes, not after
    step_rows = train.flow_grpo.group_size * (args.queries or train.queries_per_step)
    if args.trl_micro_batch is not None and (args.trl_micro_batch < 1 or step_rows % args.trl_micro_batch):
        p.error(f"--trl-micro-batch must divide a step's {step_rows} rows (e.g. 8 or 16)")

    print(f"[masgraph] Flow-GRPO, {args.model} on {describe(device)}, {args.dtype}, {args.steps} steps", flush=True)
    tr, failed = None, None
    with tempfile.TemporaryDirectory() as tmp:
        io = Path(tmp) / "side.pkl"
        side(args, "masgraph", io)
        mg = pickle.loads(io.read_bytes())
        mg_config, records = mg["config"], mg["records"]
        mg_tok = sum(r["tokens"] for r in records[1:])
        mg_s = sum(r["time/step_s"] for r in records[1:])
        mg_peak = [r["peak_gib"] for r in records if "peak_gib" in r]
        split = ", ".join(f"{r.get('time/rollout_s', 0):.1f} + {r.get('time/update_s', 0):.1f}" for r in records[1:])
        print("masgraph config:", json.dumps(mg_config))
        print(f"masgraph: {mg_tok:.0f} completion tokens in {mg_s:.1f} s = {mg_tok / mg_s:.2f} tok/s "
              f"({mg_s / (len(records) - 1):.1f} s/step), peak device memory per step GiB {gib(mg_peak)}")
        print(f"masgraph seconds per counted step, rollouts + update: {split}", flush=True)
        if not args.no_trl:
            print(f"[TRL] GRPOTrainer, same settings, {args.steps} steps", flush=True)
            try:
                side(args, "trl", io)
                tr = pickle.loads(io.read_bytes())
            except subprocess.CalledProcessError as exc:  # masgraph's side is still recorded, with the reason
                killed = exc.returncode < 0 and -exc.returncode == 9
                failed = f"exit {exc.returncode}" + (" (SIGKILL: the kernel's out-of-memory killer?)" if killed else "")
                print(f"error: TRL's side failed: {failed}", file=sys.stderr)
    rows = [f"| masgraph Flow-GRPO | {mg_tok:.0f} | {mg_s:.1f} | {mg_tok / mg_s:.2f} | "
            f"{mg_s / (len(records) - 1):.1f} | {gib(mg_peak)} |"]
    lines = [f"- masgraph config: `{json.dumps(mg_config)}`",
             f"- masgraph seconds per counted step, rollouts + update: {split}"]
    if failed:
        lines.append(f"- TRL's side failed: {failed}; no ratio")
    ratio = None
    if tr is not None:
        trl_config, times, tokens, trl_peak = tr["config"], tr["times"], tr["tokens"], tr["peak"]
        trl_tok, trl_s = sum(tokens[1:]), sum(times[1:])
        print(f"TRL {tr['version']} config:", json.dumps(trl_config))
        print(f"TRL:      {trl_tok:.0f} completion tokens in {trl_s:.1f} s = {trl_tok / trl_s:.2f} tok/s "
              f"({trl_s / (len(times) - 1):.1f} s/step), peak device memory per step GiB {gib(trl_peak)}")
        ratio = (mg_tok / mg_s) / (trl_tok / trl_s)
        print(f"ratio {ratio:.2f}x (target on a CPU ≥ 2.0x; on a GPU ≥ 1.5x)")
        rows.append(f"| TRL GRPOTrainer | {trl_tok} | {trl_s:.1f} | {trl_tok / trl_s:.2f} | "
                    f"{trl_s / (len(times) - 1):.1f} | {gib(trl_peak)} |")
        lines.append(f"- TRL config: `{json.dumps(trl_config)}`")
        gen = tr.get("generating", [])[1:len(times)]
        if gen:
            trl_split = ", ".join(f"{g:.1f} + {t - g:.1f}" for g, t in zip(gen, times[1:]))
            print(f"TRL seconds per counted step, generation + the rest: {trl_split}")
            lines.append(f"- TRL seconds per counted step, generation (`_generate`) + the rest: {trl_split}")
    with open(args.record, "a") as f:
        stamp = time.strftime('%Y-%m-%d %H:%M')
        peer = "" if tr is None else f" vs TRL {tr['version']} GRPOTrainer"
        f.write(f"\n### Training throughput{peer}, {args.model} on {describe(device)} ({stamp})\n\n"
                f"`{' '.join([Path(sys.executable).name, *sys.argv])}` — single-turn `{TASK}` on graphs/single.yaml, "
                f"{args.steps} steps each, first step of each side not counted"
                + (", random weights / fixed-length completions" if is_random(args.model) else
                   ", fixed-length completions (no EOS on either side)" if args.fixed else "") + ".\n\n"
                + "\n".join(lines) + "\n\n"
                "| side | completion tokens | seconds | tokens/s | s/step | peak GiB per step: max counted (each) |\n"
                "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
                + (f"\nRatio of training tokens/s: **{ratio:.2f}x** (target on a CPU ≥ 2.0x; on a GPU ≥ 1.5x)\n"
                   if ratio is not None else ""))
    return 1 if failed else 0


def side(args: argparse.Namespace, name: str, io: Path) -> None:
    """Run one side in a fresh process (its memory is its own: no leftovers from the other side's model), in its own
    library's thread environment: masgraph's side with what `import masgraph` sets, TRL's with what this script was
    started with (libgomp reads it once, when torch loads: the side imports torch before masgraph)."""
    argv = [a for a in sys.argv[1:] if a != "--no-trl"]
    env = os.environ if name == "masgraph" else STARTED_WITH
    subprocess.run([sys.executable, __file__, *argv, "--side", name, "--io", str(io)], check=True,
                   env={**env, "PYTHONUNBUFFERED": "1"})


THREAD_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MASGRAPH_THREADS")


def thread_env() -> dict:
    """The thread settings this side's torch started with, and its thread count (recorded with each side)."""
    return {"env": {k: STARTED_WITH[k] for k in THREAD_ENV if k in STARTED_WITH}, "threads": torch.get_num_threads()}


def run_side(args: argparse.Namespace) -> int:
    """One side (`--side`), in this process: the masgraph side writes its config, records, prompts and items;
    the TRL side reads them and writes its own results (a pickle, between two processes of this script)."""
    model = resolve(args.model, args.device)
    if args.side == "masgraph":
        config, records, prompts, items = run_masgraph(args, model, args.dtype)
        args.io.write_bytes(pickle.dumps({"config": config, "records": records, "prompts": prompts, "items": items}))
        return 0
    import trl

    mg = pickle.loads(args.io.read_bytes())
    config, times, tokens, peak, generating = run_trl(args.steps, mg["config"], mg["prompts"], mg["items"],
                                                      resolve_device(args.device), args.trl_micro_batch)
    config = json.loads(json.dumps(config, default=str))
    args.io.write_bytes(pickle.dumps({"config": config, "times": times, "tokens": tokens, "peak": peak,
                                      "generating": generating,
                                      "version": trl.__version__}))
    return 0

if __name__ == "__main__":
    sys.exit(main())
