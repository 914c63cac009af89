"""Incremental decoding of a batch of rows that share a cached prompt prefix: token ids, logprobs, finish reason."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from masgraph.backends.base import Request
from masgraph.backends.hf.batcher import Stopped
from masgraph.backends.hf.buckets import plan, run_passes
from masgraph.backends.hf.cascade import Cascade
from masgraph.backends.hf.layout import left_pad
from masgraph.threads import fit_threads


def decode(model: Any, cache: Any, prefix_len: int, suffixes: list[list[int]], requests: list[Request],
           generators: list[torch.Generator], pad_id: int, eos_ids: set[int], stop: threading.Event | None = None,
           on_token: Sequence[Callable[[int], None] | None] | None = None,
           past_mask: torch.Tensor | None = None, phases: dict[str, Any] | None = None,
           forward: dict[str, Any] | None = None, cascade: Cascade | None = None, pass_overhead: int | None = None,
           drop_finished: bool = True) -> list[tuple[list[int], list[float], str]]:
    """Decode each row's completion after its prompt, `cache` holding the KV of the shared prefix (already
    broadcast to the batch) or being empty; each row samples from its own generator (on the model's device) and
    stops at EOS or at its `max_tokens`. Returns (completion ids, their logprobs, "stop" | "length") per row.

    Every tensor lives on the model's device; each step copies its picks to the host once, the only
    device-to-host sync of the step. `stop` set (every caller gave up, or the backend is closing) ends the
    batch before its next step with `Stopped`, so a cancelled batch frees the thread within one step.
    `on_token[i]`, where given, is called with each token of row i as it is picked (from the host copy).
    `past_mask` (B, cached length), where given, says which cached positions each row attends (the cache then holds
    more than the shared prefix: a prompt part prefilled once for several rows, left-padded). `phases`, where given,
    has the seconds of the first step (the suffixes' prefill and the first pick) added to its "prefill_s" and those
    of the steps after to its "decode_s" (host clock; each step ends in a sync, so device time is included).
    `forward`: more arguments of every forward pass (PEFT's per-row `adapter_names`). `cascade`, where given, holds
    the rows' prefixes (masgraph/backends/hf/cascade.py): `cache` then has only the rows' own positions (empty, or a
    prompt part prefilled before, `cascade.row_mask` saying which are real), and `prefix_len`/`past_mask` are unused.
    `pass_overhead`, where given, runs the suffixes' prompt pass as passes over rows of similar length
    (masgraph/backends/hf/buckets.py; None: one pass, left-padded to the longest). `drop_finished`: a row that
    finished leaves the batch at the end of its step (off only to compare: the rows then ride along to the end)."""
    device = model.device
    B = len(suffixes)
    ids, mask, pos = new_positions(suffixes, pad_id, device, prefix_len, past_mask, cascade)
    limits = [r.sampling.max_tokens for r in requests]
    out = Completions(limits, eos_ids)
    temps = torch.tensor([r.sampling.temperature or 1.0 for r in requests], device=device)[:, None]  # (B, 1)
    attend = cascade.active if cascade is not None else contextlib.nullcontext
    ones = torch.ones((B, 1), dtype=mask.dtype, device=device)
    # the batch's rows: which request row each is, and its request, generator and token sink; a row that finished
    # leaves the batch at the end of its step (a finished row riding along costs a step as much as a live one)
    alive, reqs, gens = list(range(B)), list(requests), list(generators)
    emits = list(on_token) if on_token is not None else [None] * B
    extra = dict(forward or {})
    done = [False] * B  # per batch row: finished, still in the batch (a cache whose layers cannot drop rows)
    compact = False
    lengths = [len(x) for x in suffixes]
    passes = plan(lengths, pass_overhead)
    run = ids.numel()
    started = time.perf_counter()
    for step in range(max(limits)):
        check_stop(stop)
        fit_threads()  # one thread while other processes hold the cores (masgraph/threads.py)
        if cascade is not None:
            cascade.row_mask = mask
        if step == 0 and len(passes) > 1:
            logits, run = run_passes(model, cache, ids, mask, pos, lengths, passes, cascade, forward)
        else:
            with attend():
                logits = model(input_ids=ids, attention_mask=None if cascade is not None else mask, position_ids=pos,
                               past_key_values=cache, use_cache=True, logits_to_keep=1, **extra).logits[:, -1, :]
        toks, lps = sample(logits.float(), reqs, gens, done, temps)
        out.take(toks, lps, alive, done, emits)
        if step == 0:
            reserve(cache, max(limits))
            compact = drop_finished and all(type(layer) is Reserved for layer in getattr(cache, "layers", []))
            if phases is not None:
                phases["prompt_positions_run"] = phases.get("prompt_positions_run", 0) + run
                now = time.perf_counter()
                phases["prefill_s"] += now - started
                started = now
        if all(done):
            break
        ids = toks[:, None]  # (rows, 1); a finished row's next input is never read back
        mask = torch.cat([mask, ones[:len(alive)]], dim=1)
        pos = pos[:, -1:] + 1
        if compact and any(done):  # the finished rows leave the batch
            keep = [j for j in range(len(alive)) if not done[j]]
            pick = torch.tensor(keep, dtype=torch.long, device=device)
            ids, mask, pos, temps = (t.index_select(0, pick) for t in (ids, mask, pos, temps))
            for layer in getattr(cache, "layers", []):
                layer.keep(pick)
            if cascade is not None:
                cascade.select(keep)
            alive, reqs, gens, emits = ([x[j] for j in keep] for x in (alive, reqs, gens, emits))
            extra = {k: [v[j] for j in keep] for k, v in extra.items()}
            done = [False] * len(keep)
    if phases is not None:
        phases["decode_s"] += time.perf_counter() - started
    return out.rows()


def check_stop(stop: threading.Event | None) -> None:
    """Raise `Stopped` where `stop` is set (a host-side flag: no device sync)."""
    if stop is not None and stop.is_set():
        raise Stopped("the batch was stopped: every request of it was cancelled, or the backend closed")


class Completions:
    """Each request row's completion as it decodes: token ids, their logprobs, and why it finished ("stop" at one of
    `eos_ids`, "length" at its `limits[i]` tokens)."""

    def __init__(self, limits: list[int], eos_ids: set[int]):
        self.limits, self.eos_ids = limits, eos_ids
        self.ids: list[list[int]] = [[] for _ in limits]
        self.logprobs: list[list[float]] = [[] for _ in limits]
        self.finish = ["length"] * len(limits)

    def take(self, toks: torch.Tensor, lps: torch.Tensor, alive: Sequence[int], done: list[bool],
             emits: Sequence[Callable[[int], None] | None]) -> None:
        """A step's picks, (batch,) tensors: batch row j (request row `alive[j]`) gets its pick unless `done[j]`,
        which it sets when the row finishes; `emits[j]`, where given, is called with the pick. The step's one
        device-to-host copy (float64 holds every token id and float32 logprob exactly)."""
        picked_ids, picked_lps = torch.stack([toks.double(), lps.double()]).tolist()
        for j, (tok, lp) in enumerate(zip(picked_ids, picked_lps)):
            if done[j]:
                continue
            i, tok = alive[j], int(tok)
            self.ids[i].append(tok)
            self.logprobs[i].append(lp)
            if (emit := emits[j]) is not None:
                emit(tok)
            if tok in self.eos_ids:
                done[j], self.finish[i] = True, "stop"
            elif len(self.ids[i]) >= self.limits[i]:
                done[j] = True

    def rows(self) -> list[tuple[list[int], list[float], str]]:
        """(completion ids, their logprobs, finish reason) per request row."""
        return list(zip(self.ids, self.logprobs, self.finish))


def new_positions(rows: list[list[int]], pad_id: int, device: torch.device | str, prefix_len: int = 0,
                  past_mask: torch.Tensor | None = None, cascade: Cascade | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids (B, L), attention mask and position ids (B, L) of each row's new tokens `rows[i]`, left-padded,
    after what the cache holds: a shared prefix of `prefix_len` positions, or the positions `past_mask` says are
    real, or, with a `cascade`, the rows' own positions `cascade.row_mask` says are real (none yet where it is None),
    numbered on from each row's prefix length. The mask covers the cached positions and the new ones (bool with a
    cascade: its `row_mask` for the pass)."""
    if cascade is None and past_mask is None:
        return left_pad(prefix_len, rows, pad_id, device)
    ids, tail, _ = left_pad(0, rows, pad_id, device)
    if cascade is None:
        mask = torch.cat([past_mask, tail], dim=1)
        return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
    mask = tail.bool() if cascade.row_mask is None else torch.cat([cascade.row_mask, tail.bool()], dim=1)
    return ids, mask, (cascade.offsets[:, None] + mask.long().cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]


def prefill_shared(model: Any, cache: Any, past_mask: torch.Tensor | None, prefix_len: int,
                   middles: list[list[int]], cluster: list[int], pad_id: int, cascade: Cascade | None,
                   forward: dict[str, Any], pass_overhead: int | None) -> tuple[torch.Tensor | None, int]:
    """Prefill the prompt parts that several rows share, once per cluster (`middles`, one per row of `cache`), then
    give each batch row its cluster's KV (row i: `cluster[i]`), as `decode` then expects it. `past_mask`/`prefix_len`
    describe what `cache` holds as `decode` takes them. Returns the rows' `past_mask` (None with a `cascade`, which
    is narrowed to the rows itself) and the positions the passes ran."""
    device = model.device
    ids, mask, pos = new_positions(middles, pad_id, device, prefix_len, past_mask, cascade)
    if cascade is not None:
        cascade.row_mask = mask
    lengths = [len(m) for m in middles]
    passes = plan(lengths, pass_overhead)
    if len(passes) > 1:
        _, run = run_passes(model, cache, ids, mask, pos, lengths, passes, cascade, forward)
    else:
        run = ids.numel()
        with cascade.active() if cascade is not None else contextlib.nullcontext():
            model(input_ids=ids, attention_mask=None if cascade is not None else mask, position_ids=pos,
                  past_key_values=cache, use_cache=True, logits_to_keep=1, **forward)
    pick = torch.tensor(cluster, dtype=torch.long, device=device)
    cache.batch_select_indices(pick)
    if cascade is not None:
        cascade.select(cluster)
        return None, run
    return mask.index_select(0, pick), run


class Reserved(DynamicLayer):
    """A DynamicLayer whose keys and values are views of buffers with `room` more positions; `update` writes the new
    positions in place. transformers' DynamicLayer concatenates the whole cache with each new position instead (a
    copy of every layer's KV per step: 12 % of a 32-row decode step on this CPU)."""

    def __init__(self, layer: DynamicLayer, room: int):
        super().__init__()
        self.dtype, self.device, self.is_initialized = layer.dtype, layer.device, True
        self.filled = layer.keys.shape[-2]
        shape = (*layer.keys.shape[:-2], self.filled + room, layer.keys.shape[-1])
        self.key_room, self.value_room = layer.keys.new_empty(shape), layer.values.new_empty(shape)
        self.key_room[..., :self.filled, :] = layer.keys
        self.value_room[..., :self.filled, :] = layer.values
        self.keys, self.values = self.key_room[..., :self.filled, :], self.value_room[..., :self.filled, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.filled + key_states.shape[-2]
        if end > self.key_room.shape[-2]:
            raise RuntimeError("decode ran past the room reserved in its KV cache")
        self.key_room[..., self.filled:end, :] = key_states
        self.value_room[..., self.filled:end, :] = value_states
        self.filled = end
        self.keys, self.values = self.key_room[..., :end, :], self.value_room[..., :end, :]
        return self.keys, self.values

    def keep(self, rows: torch.Tensor) -> None:
        """Keep batch rows `rows` (their room too)."""
        self.key_room, self.value_room = self.key_room.index_select(0, rows), self.value_room.index_select(0, rows)
        self.keys, self.values = self.key_room[..., :self.filled, :], self.value_room[..., :self.filled, :]


def reserve(cache: Any, room: int) -> None:
    """Give each plain (full-attention) layer of a DynamicCache room for `room` more positions (`Reserved`);
    sliding-window and other layer kinds keep their own update. The cache is this decode's own (a copy or a stack of
    the cached prefixes), so its layers may be replaced."""
    layers = getattr(cache, "layers", [])
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4:
            layers[i] = Reserved(layer, room)


def sample(logits: torch.Tensor, requests: list[Request], generators: list[torch.Generator], done: list[bool],
           temps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row (argmax for greedy and finished rows) and its logprob under the temperature-scaled
    distribution (raw if greedy), both (B,) tensors on the logits' device; nothing is copied to the host.

    A sampling row draws one uniform number from its own generator and takes the token where the cumulative
    probability passes it (inverse CDF, in float64, all rows at once). `torch.multinomial` drew one exponential per
    vocabulary entry per row instead: ~1 ms a row and step on a CPU with a 49k vocabulary, 14 % of a decode step at
    32 rows. A row's draws depend on its own seed only, whatever the batch."""
    logp = torch.log_softmax(logits / temps, -1)  # (B, V)
    greedy = torch.argmax(logits, -1)  # (B,)
    sampling = [not done[i] and r.sampling.temperature != 0 for i, r in enumerate(requests)]
    if not any(sampling):
        return greedy, logp.gather(1, greedy[:, None])[:, 0]
    probs = logp.exp()
    for i, r in enumerate(requests):
        if sampling[i] and r.sampling.top_p < 1.0:
            sp, si = torch.sort(probs[i], descending=True)
            keep = (sp.cumsum(0) - sp) < r.sampling.top_p
            probs[i] = torch.zeros_like(probs[i]).scatter_(0, si, sp * keep)  # no boolean indexing: it would sync
    cdf = probs.double().cumsum(-1)  # (B, V)
    u = torch.cat([torch.rand(1, generator=g, device=logits.device, dtype=torch.float64) if s else
                   torch.zeros(1, device=logits.device, dtype=torch.float64) for g, s in zip(generators, sampling)])
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=logits.shape[-1] - 1)
    toks = torch.where(torch.tensor(sampling, device=logits.device), drawn, greedy)
    return toks, logp.gather(1, toks[:, None])[:, 0]
