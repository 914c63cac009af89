"""A decode step traced once and replayed: rows in fixed slots over a static KV cache, the model's forward compiled
with `fullgraph=True` and static shapes, so on a GPU inductor's `reduce-overhead` mode replays the whole step as one
CUDA graph. A small model's GPU decode step is set by launching its few thousand kernels one by one from Python
(~16 µs of host time per op on the H200: results/gpu.md, results/decode_ops.md), not by the GPU's work.

What the eager loop (masgraph/backends/hf/decode.py) does and this one does not, to keep every shape fixed: rows
never leave the batch (a finished row rides along, its picks dropped), the prompt is prefilled whole per row (no
cached static prefix, no cascade, no shared prompt parts), one adapter per batch. The batch's rows pad to a power of
two and its length to a multiple of `LENGTH_STEP`, so a run compiles a few shapes and replays them. The first `SHAPES`
shapes keep their caches for the decoder's life (a captured graph reads them where they are: a cache made again would
be recorded again); a batch of another shape decodes in the eager loop. Models with a sliding-window layer are
refused (their cache layers count positions in Python ints, which would retrace every step)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from masgraph.backends.base import Request
from masgraph.backends.hf.decode import Completions, check_stop, sample
from masgraph.threads import fit_threads

LENGTH_STEP = 128
"""A batch's cache length (prompt + completion) rounds up to this many positions."""
SHAPES = 4
"""Batch shapes (slots x length) a decoder captures; each keeps its static cache, so memory and compiles are bounded."""


def slots(rows: int) -> int:
    """Batch slots for `rows` rows: the next power of two."""
    return 1 << max(0, rows - 1).bit_length()


def _step(model: Any, cache: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
          cache_pos: torch.Tensor) -> torch.Tensor:
    """One token per slot: (slots, 1) ids after what the static cache holds -> (slots, vocab) logits. The cache writes
    at its own count of positions (transformers 5.23's StaticLayer; its Llama-family models do not read
    `cache_position`, passed for the models that do)."""
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, cache_position=cache_pos,
                 past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :]


class CapturedDecoder:
    """The compiled step and its static caches for one model. `backend`: torch.compile's ("inductor" on a GPU, with
    `reduce-overhead`, the CUDA-graph mode; "eager" traces the step and runs it as traced: what a CPU test checks)."""

    def __init__(self, model: Any, backend: str | None = None):
        from masgraph.backends.hf.cascade import windowed
        from masgraph.errors import MasgraphError

        if windowed(model.config):
            raise MasgraphError("the captured decode step needs every layer to attend the whole context; this model "
                                "has sliding-window layers (decode them in the eager loop: leave capture off)")
        self.model = model
        cuda = model.device.type == "cuda"
        self.backend = backend or ("inductor" if cuda else "eager")
        mode = "reduce-overhead" if cuda and self.backend == "inductor" else None
        import torch._dynamo

        # one graph per (adapter, training flag, batch shape), shapes bounded by `SHAPES`: past dynamo's default of 8
        # in a multi-adapter run (with fullgraph, one past the limit is an error, not a fallback)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        self.step = torch.compile(_step, backend=self.backend, mode=mode, fullgraph=True, dynamic=False)
        self.graphs = mode == "reduce-overhead"
        """CUDA graphs: each step is marked as a new one (a replay then overwrites the last step's logits, read by
        then), as torch documents for inference loops."""
        self._caches: dict[tuple[int, int], Any] = {}
        self.declined = 0
        """Batches of a shape past the first `SHAPES`, left to the eager loop."""

    @property
    def shapes(self) -> int:
        """Batch shapes captured (each a static cache; on a GPU a CUDA graph per adapter)."""
        return len(self._caches)

    def cache(self, rows: int, length: int) -> Any | None:
        """The static cache for `rows` slots x `length` positions, emptied; None past `SHAPES` shapes."""
        from transformers import StaticCache

        cache = self._caches.get((rows, length))
        if cache is not None:
            cache.reset()
        elif len(self._caches) < SHAPES:
            cache = self._caches[rows, length] = StaticCache(config=self.model.config, max_cache_len=length)
        return cache

    def decode(self, prompts: list[list[int]], requests: list[Request], generators: list[torch.Generator],
               pad_id: int, eos_ids: set[int], stop: threading.Event | None = None,
               on_token: Sequence[Callable[[int], None] | None] | None = None,
               phases: dict[str, Any] | None = None) -> list[tuple[list[int], list[float], str]] | None:
        """Decode each row's completion after its whole prompt, as `decode.decode` does (same sampling, stops,
        `stop`, `on_token` and `phases`); returns (completion ids, their logprobs, "stop" | "length") per row, or
        None for a batch of a shape past the first `SHAPES` (nothing done: the eager loop takes it)."""
        device = self.model.device
        B, S = len(prompts), slots(len(prompts))
        width = max(map(len, prompts))
        limits = [r.sampling.max_tokens for r in requests]
        length = -(-(width + max(limits)) // LENGTH_STEP) * LENGTH_STEP
        cache = self.cache(S, length)
        if cache is None:
            self.declined += 1
            return None
        check_stop(stop)  # before the prefill, as the eager loop checks before its first pass
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
        at = torch.arange(length, device=device)  # cache positions (views of one tensor: no copy from the host)
        started = time.perf_counter()
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                            cache_position=at[:width], past_key_values=cache,
                            use_cache=True, logits_to_keep=1).logits[:, -1, :]
        last, toks = pos[:, -1:], ids[:, -1]  # (the prompt's last ids: replaced by the first picks, never fed)
        for step in range(max(limits)):
            check_stop(stop)
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
