"""Training throughput: masgraph Flow-GRPO vs TRL `GRPOTrainer`, same model, LoRA, dtype, prompts, lengths.

Single-turn task both can run: the one-node `graphs/single.yaml` graph on `long_arithmetic`. TRL gets
the exact prompt text masgraph renders for each item (decoded from the recorded prompt ids), the same
items in the same order, the same reward (masgraph's answer parser + the task's scorer), group size,
queries per step, completion cap, temperature, LoRA (r, alpha, q/v), learning rate, clip range, KL
coefficient and dtype (pinned for both sides with --dtype, fp32 by default; masgraph's own dtype probe is
not used), and no gradient checkpointing on either side (TRL's GRPOConfig turns it on by default; masgraph
has none). Every setting of both sides is printed and recorded. One optimizer step = rollouts of 4 queries × 8
completions + one update, on both sides. Tokens are counted the same way on both: completion tokens generated per
step (EOS included) divided by the step's wall-clock. The first step of each side is warm-up and not counted.

    .venv/bin/python benchmarks/train_throughput.py [--steps 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from masgraph.agents.formats import parse_answer
from masgraph.events import ListSink, TrainStep
from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.model import resolve_model
from masgraph.store import read_traces
from masgraph.tasks import get_task
from masgraph.trainers.loop import TrainLoop

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TASK = "long_arithmetic"


def run_masgraph(steps: int, dtype: str) -> tuple[dict, list[dict], list[str], list]:
    """Flow-GRPO through TrainLoop (rollouts via the Runner); returns config, per-step records, prompts, items."""
    spec = load_spec(ROOT / "graphs" / "single.yaml")
    # zero_variance: keep — train on every row, as TRL does (skipping all-equal groups would do less work)
    fg = spec.train.flow_grpo.model_copy(update={"zero_variance": "keep"})
    cfg = spec.train.model_copy(update={"steps": steps, "eval_every": 0, "eval_n": 1, "checkpoint_every": 10_000,
                                        "flow_grpo": fg})
    graph = compile_spec(spec.model_copy(update={"train": cfg}))
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as run_dir:
        steps_sink = ListSink()
        loop = TrainLoop(graph, get_task(TASK), Path(run_dir), dtype=dtype, sinks=[steps_sink])
        asyncio.run(loop.run())
        records += [{"step": e.step, **e.metrics} for e in steps_sink.events if isinstance(e, TrainStep)]
        traces = [t.model_dump() for t in read_traces(run_dir)]
    tok = loop.backend.tokenizer
    prompts = {}
    for t in traces:  # the exact prompt each item was rendered to
        prompts.setdefault(t["item_id"], tok.decode(t["steps"][0]["llm"][0]["prompt_ids"]))
    items = loop.items[:steps * cfg.queries_per_step]
    config = {"model": str(resolve_model(spec.policies["main"].model)), "dtype": loop.learner.dtype,
              "lora": [cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets], "lr": cfg.flow_grpo.lr,
              "group_size": cfg.flow_grpo.group_size, "queries_per_step": cfg.queries_per_step,
              "max_completion_tokens": spec.policies["main"].sampling.max_tokens,
              "temperature": cfg.flow_grpo.temperature,
              "clip": [cfg.flow_grpo.clip_eps_low, cfg.flow_grpo.clip_eps_high],
              "kl_coef": cfg.flow_grpo.kl_coef, "micro_batch": cfg.flow_grpo.micro_batch,
              "zero_variance": cfg.flow_grpo.zero_variance,
              "threads": torch.get_num_threads()}
    return config, [r for r in records if r["step"] > 0], [prompts[it.id] for it in items], items


def run_trl(steps: int, mg: dict, prompts: list[str], items: list) -> tuple[dict, list[float], list[int]]:
    """TRL GRPOTrainer on the same prompts/items/reward; returns config, step times, completion tokens per step."""
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

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    path = mg["model"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, mg["dtype"].removeprefix("torch.")))
    tokenizer = AutoTokenizer.from_pretrained(path)
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=False, fp16=False, max_steps=steps, learning_rate=mg["lr"],
            per_device_train_batch_size=mg["group_size"] * mg["queries_per_step"], gradient_accumulation_steps=1,
            num_generations=mg["group_size"], max_completion_length=mg["max_completion_tokens"],
            temperature=mg["temperature"], top_p=1.0, top_k=0, epsilon=mg["clip"][0], epsilon_high=mg["clip"][1],
            beta=mg["kl_coef"], num_iterations=1, lr_scheduler_type="constant", shuffle_dataset=False, report_to=[],
            logging_steps=1,
            save_strategy="no", disable_dropout=True, seed=0, dataloader_num_workers=0,
            gradient_checkpointing=False)
        lora = LoraConfig(r=mg["lora"][0], lora_alpha=mg["lora"][1], target_modules=mg["lora"][2], lora_dropout=0.0,
                          task_type="CAUSAL_LM")
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": prompts}), peft_config=lora,
                              callbacks=[Timer()])
        trainer.train()
    trl_config = {k: getattr(args, k) for k in ("per_device_train_batch_size", "num_generations",
                                                "max_completion_length", "temperature", "learning_rate", "epsilon",
                                                "epsilon_high", "beta", "loss_type", "lr_scheduler_type", "use_cpu",
                                                "bf16",
                                                "fp16", "gradient_checkpointing", "num_iterations", "top_p", "top_k")}
    trl_config["model_dtype"] = str(model.dtype)
    return trl_config, times, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="one dtype for both sides (default float32)")
    args = p.parse_args()
    import trl

    mg_config, records, prompts, items = run_masgraph(args.steps, args.dtype)
    mg_tok = sum(r["tokens"] for r in records[1:])
    mg_s = sum(r["time/step_s"] for r in records[1:])
    trl_config, times, tokens = run_trl(args.steps, mg_config, prompts, items)
    trl_tok, trl_s = sum(tokens[1:]), sum(times[1:])
    print("masgraph config:", json.dumps(mg_config))
    print(f"TRL {trl.__version__} config:", json.dumps(trl_config))
    print(f"masgraph: {mg_tok:.0f} completion tokens in {mg_s:.1f} s = {mg_tok / mg_s:.2f} tok/s "
          f"({mg_s / (len(records) - 1):.1f} s/step)")
    print(f"TRL:      {trl_tok:.0f} completion tokens in {trl_s:.1f} s = {trl_tok / trl_s:.2f} tok/s "
          f"({trl_s / (len(times) - 1):.1f} s/step)")
    ratio = (mg_tok / mg_s) / (trl_tok / trl_s)
    print(f"ratio {ratio:.2f}x (target ≥ 1.0x)")
    with open(HERE / "RESULTS.md", "a") as f:
        stamp = time.strftime('%Y-%m-%d %H:%M')
        f.write(f"\n### Training throughput vs TRL {trl.__version__} GRPOTrainer ({stamp})\n\n"
                f"`{' '.join([Path(sys.executable).name, *sys.argv])}` — single-turn `{TASK}` on graphs/single.yaml, "
                f"{args.steps} steps each, first step of each side not counted.\n\n"
                f"- masgraph config: `{json.dumps(mg_config)}`\n- TRL config: `{json.dumps(trl_config)}`\n\n"
                "| side | completion tokens | seconds | tokens/s | s/step |\n|---|---|---|---|---|\n"
                f"| masgraph Flow-GRPO | {mg_tok:.0f} | {mg_s:.1f} | {mg_tok / mg_s:.2f} | "
                f"{mg_s / (len(records) - 1):.1f} |\n"
                f"| TRL GRPOTrainer | {trl_tok} | {trl_s:.1f} | {trl_tok / trl_s:.2f} | "
                f"{trl_s / (len(times) - 1):.1f} |\n\n"
                f"Ratio of training tokens/s: **{ratio:.2f}x** (target ≥ 1.0x)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
