"""Peak memory and time of ONE learner update (`sequence_logprobs` + a PPO-style loss + backward, LoRA on, fp32, CPU)
through the chunked selected-token log-probs (`masgraph/backends/hf/logprobs.py`) vs the full-vocabulary path the
learner used before (kept below as the peer, `full_vocabulary_logprobs`: (rows x K+1 x V) logits, then a
(rows x K x V) fp32 log_softmax, then a gather), in the same run.

Each (shape, path) runs in its own fresh subprocess. Memory is the process's peak RSS (VmHWM) during the update,
after the model is loaded and its adapter attached (the peak is reset just before the update: `clear_refs` 5), so a
load-time peak cannot hide the update's; shown as the whole process's peak and as the update's increment over the
RSS it started from. The update's time is wall-clock for the same update, then for repeats (`--updates`).

    .venv/bin/python benchmarks/update_memory.py                      # both shapes, appends to results
    .venv/bin/python benchmarks/update_memory.py --shapes tiny49k --no-record
    .venv/bin/python benchmarks/update_memory.py --checkpointing both --updates 1   # also with gradient checkpointing

Shapes: `tiny49k` = `random:tiny` (hidden 64, 2 layers, SmolLM2's 49,152 vocabulary), 8 rows x 512 completion
tokens; `qwen0.5b` = `random:qwen2-0.5b` (151,936 vocabulary), 8 rows x 256 completion tokens (fits 24 GiB on the
old path). Prompts: a 32-token prefix shared by every row + 8 tokens of its own (the shared-prefix KV path runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SHAPES = {"tiny49k": ("random:tiny", 8, 512), "qwen0.5b": ("random:qwen2-0.5b", 8, 256)}
PATHS = ("old", "new")


@dataclass
class Row:
    prompt_ids: list[int]
    completion_ids: list[int]
    temperature: float = 1.0


def full_vocabulary_logprobs(model, rows, pad_id: int, share_prefix: bool = True):
    """The learner's logprob pass before issue 55 (the peer; not in the library any more)."""
    import torch

    from masgraph.backends.hf.layout import left_pad, prefill
    from masgraph.learn.packing import common_prefix as shared_prefix_len

    device = model.device
    seqs = [r.prompt_ids + r.completion_ids for r in rows]
    P = shared_prefix_len(seqs, min(len(r.prompt_ids) for r in rows) - 1) if len(rows) > 1 and share_prefix else 0
    B, K = len(seqs), max(len(r.completion_ids) for r in rows)
    ids, mask, pos = left_pad(P, [s[P:] for s in seqs], pad_id, device)
    cache = None
    if P:
        cache = prefill(model, seqs[0][:P])
        cache.batch_repeat_interleave(B)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                   use_cache=cache is not None, logits_to_keep=K + 1).logits  # (B, K+1, V)
    temps = torch.tensor([r.temperature for r in rows], device=device)[:, None, None]
    logp = torch.log_softmax(logits[:, :-1].float() / temps, -1)
    targets = torch.tensor([[0] * (K - len(r.completion_ids)) + list(r.completion_ids) for r in rows],
                           dtype=torch.long, device=device)
    picked = logp.gather(-1, targets[:, :, None])[:, :, 0]
    return [picked[i, K - len(r.completion_ids):] for i, r in enumerate(rows)]


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # no procfs: the lifetime peak


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def child(shape: str, path: str, updates: int, threads: int, checkpointing: bool) -> dict:
    """One (shape, path) in this process: load, attach a LoRA, run `updates` updates; peak RSS of the first.
    `checkpointing`: the learner's gradient checkpointing on (whole sequences then: no shared-prefix KV)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from models import resolve

    from masgraph.backends.hf.learner import HFLearner
    from masgraph.learn.learner import LoraConfigSpec

    torch.set_num_threads(threads)
    model_name, B, K = SHAPES[shape]
    learner = HFLearner(resolve(model_name), dtype="float32", device="cpu")
    torch.manual_seed(0)  # the LoRA init: the same in both paths' processes
    learner.add_adapter("pol", LoraConfigSpec(rank=8, alpha=16))
    learner.gradient_checkpointing(checkpointing)
    share = not learner.weights.gradient_checkpointing
    V = learner.weights.model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, V, (32,), generator=gen).tolist()
    rows = [Row(prefix + torch.randint(3, V, (8,), generator=gen).tolist(),
                torch.randint(3, V, (K,), generator=gen).tolist()) for _ in range(B)]
    adv = torch.randn(B, generator=gen)

    def update() -> float:
        learner.weights.model.zero_grad(set_to_none=True)
        learner.train()
        if path == "new":
            lps = learner.sequence_logprobs(rows, "pol")
        else:
            with learner.weights.use("pol"):
                lps = full_vocabulary_logprobs(learner.weights.model, rows, learner._pad_id, share_prefix=share)
        loss = sum(-(torch.exp(lp - lp.detach()) * a).mean() for lp, a in zip(lps, adv))  # PPO ratio at 1
        loss.backward()
        learner.train(False)
        return float(loss.detach())

    start_kib = _rss_kib("VmRSS")
    exact = _reset_peak()
    t0 = time.perf_counter()
    loss = update()
    seconds = [time.perf_counter() - t0]
    peak_kib = _rss_kib("VmHWM")
    for _ in range(updates - 1):
        t0 = time.perf_counter()
        update()
        seconds.append(time.perf_counter() - t0)
    grad = sum(float(p.grad.double().square().sum()) for p in learner.parameters("pol")) ** 0.5
    return {"shape": shape, "path": path, "checkpointing": checkpointing, "rows": B, "tokens": K, "vocab": V,
            "start_mib": start_kib / 1024,
            "peak_mib": peak_kib / 1024, "peak_reset": exact, "seconds": seconds, "loss": loss, "grad_norm": grad}


def run_child(shape: str, path: str, updates: int, threads: int, checkpointing: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", shape, path, "--updates", str(updates), "--threads", str(threads),
           *(["--checkpointing", "on"] if checkpointing else [])]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{shape}/{path} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--updates", type=int, default=2, help="updates per variant: the first is measured for "
                    "memory, all are timed (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per variant (default 1)")
    ap.add_argument("--checkpointing", choices=("off", "on", "both"), default="off",
                    help="the learner's gradient checkpointing in every variant: off (default), on, or both arms")
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to the results file")
    ap.add_argument("--child", nargs=2, metavar=("SHAPE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.updates, args.threads, args.checkpointing == "on")))
        return

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from models import resolve

    for shape in args.shapes:  # build random models here, not inside a measured process
        resolve(SHAPES[shape][0])
    arms = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
    results = {}
    for shape in args.shapes:
        for ckpt in arms:
            for path in PATHS:
                r = results[shape, ckpt, path] = run_child(shape, path, args.updates, args.threads, ckpt)
                print(f"{shape:9} ckpt {'on ' if ckpt else 'off'} {path}: start {r['start_mib']:.0f} MiB, peak "
                      f"{r['peak_mib']:.0f} MiB, update {', '.join(f'{s:.2f}' for s in r['seconds'])} s, loss "
                      f"{r['loss']:.6f}, grad norm {r['grad_norm']:.6e}", flush=True)
    lines = ["| shape | rows x tokens x V | grad. checkpointing | path | RSS before (MiB) | peak RSS (MiB) "
             "| update's increment (MiB) | s / update |", "|---|---|---|---|---|---|---|---|"]
    summary = []
    for shape in args.shapes:
        for ckpt in arms:
            old, new = results[shape, ckpt, "old"], results[shape, ckpt, "new"]
            for r in (old, new):
                lines.append(f"| {shape} | {r['rows']} x {r['tokens']} x {r['vocab']:,} | {'on' if ckpt else 'off'} "
                             f"| {r['path']} | {r['start_mib']:.0f} | {r['peak_mib']:.0f} | "
                             f"{r['peak_mib'] - r['start_mib']:.0f} | {', '.join(f'{s:.2f}' for s in r['seconds'])} |")
            peak = new["peak_mib"] / old["peak_mib"]
            inc = (new["peak_mib"] - new["start_mib"]) / (old["peak_mib"] - old["start_mib"])
            speed = min(new["seconds"]) / min(old["seconds"])
            same = abs(new["loss"] - old["loss"]) <= 1e-5 * max(1.0, abs(old["loss"])) and abs(
                new["grad_norm"] - old["grad_norm"]) <= 1e-4 * old["grad_norm"]
            summary.append(
                f"- {shape}, checkpointing {'on' if ckpt else 'off'}: peak RSS new/old **{peak:.3f}x**, the update's "
                f"increment new/old **{inc:.3f}x**; time new/old {speed:.2f}x (fastest update each); loss and LoRA "
                f"grad norm equal {'yes' if same else 'NO'} ({old['loss']:.6f} / {new['loss']:.6f}, "
                f"{old['grad_norm']:.6e} / {new['grad_norm']:.6e})")
    print("\n".join(lines + [""] + summary))
    if args.no_record:
        return
    from results_file import results_file

    load = os.getloadavg()[0]
    text = "\n".join([
        f"\n### One update's peak memory and time: chunked selected-token log-probs vs the full-vocabulary "
        f"log_softmax ({time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()}, {os.cpu_count()} cores, "
        f"load {load:.1f} at the end)",
        f"`{' '.join([Path(sys.executable).name, *sys.argv])}` — fp32, CPU, LoRA r=8 on q/v, {args.threads} torch "
        f"thread(s), each (shape, path) a fresh process; peak = VmHWM reset just before the update "
        f"({'clear_refs' if all(r['peak_reset'] for r in results.values()) else 'NOT reset: lifetime peak'}); "
        f"times on a machine shared with other work (noisy).", "", *lines, "", *summary, ""])
    with open(results_file("update_memory"), "a") as f:
        f.write(text)
    print(f"appended to {results_file('update_memory')}")


if __name__ == "__main__":
    main()
