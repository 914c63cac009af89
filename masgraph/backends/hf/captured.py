"""A decode step traced once and replayed: rows in fixed slots over a static KV cache, the model's forward compiled
with `fullgraph=True` and static shapes, so on a GPU inductor's `reduce-overhead` mode replays the whole step as one
CUDA graph. A small model's GPU decode step is set by launching its few thousand kernels one by one from Python
(~16 µs of host time per op on the H200: results/gpu.md, results/decode_ops.md), not by the GPU's work.

What the eager loop (masgraph/backends/hf/decode.py) does and this one does not, to keep every shape fixed: rows
never leave the batch (a finished row rides along, its picks dropped), the prompt is prefilled whole per row (no
cached static prefix, no cascade, no shared prompt parts), one adapter per batch. The batch's rows pad to a power of
two and its length to a multiple of `LENGTH_STEP`, so a run compiles a few shapes and replays them; the caches of
the last `KEEP` shapes stay allocated (a captured graph reads them where they are)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from masgraph.backends.base import Request
from masgraph.backends.hf.batcher import Stopped
from masgraph.backends.hf.decode import Completions, sample
from masgraph.threads import fit_threads

LENGTH_STEP = 128
"""A batch's cache length (prompt + completion) rounds up to this many positions."""
KEEP = 4
"""Static caches (one per batch shape) kept between batches."""


def slots(rows: int) -> int:
    """Batch slots for `rows` rows: the next power of two."""
    return 1 << max(0, rows - 1).bit_length()


def _step(model: Any, cache: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
          cache_pos: torch.Tensor) -> torch.Tensor:
    """One token per slot: (slots, 1) ids at position `cache_pos` of the static cache -> (slots, vocab) logits."""
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, cache_position=cache_pos,
                 past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :]


class CapturedDecoder:
    """The compiled step and its static caches for one model. `backend`: torch.compile's ("inductor" on a GPU, with
    `reduce-overhead`, the CUDA-graph mode; "eager" traces the step and runs it as traced: what a CPU test checks)."""

    def __init__(self, model: Any, backend: str | None = None):
        self.model = model
        cuda = model.device.type == "cuda"
        self.backend = backend or ("inductor" if cuda else "eager")
        mode = "reduce-overhead" if cuda and self.backend == "inductor" else None
        import torch._dynamo

        # one graph per (adapter, training flag, batch shape): more than dynamo's default of 8 in a multi-adapter run
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        self.step = torch.compile(_step, backend=self.backend, mode=mode, fullgraph=True, dynamic=False)
        self.graphs = mode == "reduce-overhead"
        """CUDA graphs: each step is marked as a new one (a replay then overwrites the last step's logits, read by
        then), as torch documents for inference loops."""
        self._caches: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self.shapes = 0
        """Static caches made: a batch shape first seen, or seen again after its cache was dropped (on a GPU each
        is a new CUDA graph, per adapter)."""

    def cache(self, rows: int, length: int) -> Any:
        """The static cache for `rows` slots x `length` positions, emptied (one kept per shape, `KEEP` shapes)."""
        from transformers import StaticCache

        key = (rows, length)
        cache = self._caches.pop(key, None)
        if cache is None:
            self.shapes += 1
            cache = StaticCache(config=self.model.config, max_cache_len=length)
        else:
            cache.reset()
        self._caches[key] = cache
        while len(self._caches) > KEEP:
            self._caches.popitem(last=False)
        return cache

    def decode(self, prompts: list[list[int]], requests: list[Request], generators: list[torch.Generator],
               pad_id: int, eos_ids: set[int], stop: threading.Event | None = None,
               on_token: Sequence[Callable[[int], None] | None] | None = None,
               phases: dict[str, Any] | None = None) -> list[tuple[list[int], list[float], str]]:
        """Decode each row's completion after its whole prompt, as `decode.decode` does (same sampling, stops,
        `stop`, `on_token` and `phases`); returns (completion ids, their logprobs, "stop" | "length") per row."""
        device = self.model.device
        B, S = len(prompts), slots(len(prompts))
        width = max(map(len, prompts))
        limits = [r.sampling.max_tokens for r in requests]
        length = -(-(width + max(limits)) // LENGTH_STEP) * LENGTH_STEP
        cache = self.cache(S, length)
        # the spare slots repeat row 0 (a slot of padding alone would attend nothing); their picks are dropped
        rows = list(prompts) + [prompts[0]] * (S - B)
        reqs, gens = list(requests) + [requests[0]] * (S - B), list(generators) + [generators[0]] * (S - B)
        ids = torch.full((S, width), pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((S, length), dtype=torch.long, device=device)
        for i, row in enumerate(rows):  # left-padded: every row's last prompt token at position width - 1
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long, device=device)
            mask[i, width - len(row):width] = 1
        pos = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
        temps = torch.tensor([r.sampling.temperature or 1.0 for r in reqs], device=device)[:, None]
        emits = (list(on_token) if on_token is not None else [None] * B) + [None] * (S - B)
        out = Completions(limits, eos_ids)
        done = [False] * B + [True] * (S - B)  # a spare slot samples greedily and is never read back
        at = torch.arange(length, device=device)  # cache positions: a step takes a view, no copy from the host
        started = time.perf_counter()
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                            cache_position=at[:width], past_key_values=cache,
                            use_cache=True, logits_to_keep=1).logits[:, -1, :]
        last, toks = pos[:, -1:], ids[:, -1]  # (the prompt's last ids: replaced by the first picks, never fed)
        for step in range(max(limits)):
            if stop is not None and stop.is_set():
                raise Stopped("the batch was stopped: every request of it was cancelled, or the backend closed")
            fit_threads()  # one thread while other processes hold the cores (masgraph/threads.py; a CPU's concern)
            if step:
                write = width + step - 1  # the cache position the previous pick is written to
                mask[:, write] = 1
                last = last + 1
                if self.graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                logits = self.step(self.model, cache, toks[:, None], mask, last, at[write:write + 1])
            toks, lps = sample(logits.float(), reqs, gens, done, temps)
            out.take(toks, lps, range(S), done, emits)  # the step's one sync; spare slots are done from the start
            if step == 0 and phases is not None:
                phases["prompt_positions_run"] = phases.get("prompt_positions_run", 0) + ids.numel()
                now = time.perf_counter()
                phases["prefill_s"] += now - started
                started = now
            if all(done):
                break
        if phases is not None:
            phases["decode_s"] += time.perf_counter() - started
        return out.rows()
