"""Cascade attention: rows that decode on a cached prompt prefix attend that prefix's KV where it is, once per
distinct prefix, instead of a copy per row.

Before, a batch's cached prefix KV was repeated per row (or stacked per row), so a decode step of 10 rows on
~1,300-token prefixes read ~600 MB of KV against ~60 MB for the prefix once: 257 vs 156 ms a step for SmolLM2-135M
on a 2-core CPU (benchmarks/results/rollout_throughput.md). Here the batch's cache holds only each row's own
positions (the rest of its prompt, then its completion); each attention layer attends the row's prefix (batch 1 per
distinct prefix, every row of it as extra queries: one read) and the row's own keys apart, and merges the two by
their log-sum-exp (exact up to rounding: softmax over the union of keys).

The model runs under the attention name `NAME` (registered with transformers; its mask is sdpa's), which is plain
sdpa attention (`gqa.sdpa_attention`) unless a `Cascade` is active on the calling thread (`with cascade.active():`)."""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from typing import Any

import torch

from masgraph.backends.hf.gqa import sdpa_attention

NAME = "masgraph_cascade"
_thread = threading.local()  # .state: the Cascade of the forward pass running on this thread, if any
_MAX_SCORES = 1 << 25  # score elements per matmul: a long prefill's queries go in chunks


class Cascade:
    """The shared prefixes of a decode batch and what each row attends.

    `prefix` is a cache of G rows (one per distinct prefix, left-padded; `prefix_mask` (G, longest) says which
    positions are real); `groups[g]` are the batch rows on prefix g; `offsets` (B,) each row's prefix length (its
    own positions continue from there); `row_mask` (B, n) which of the rows' own cached positions are real (left
    padding is not), set by the decode loop before each forward pass (the pass's new positions included)."""

    def __init__(self, prefix: Any, prefix_mask: torch.Tensor, groups: list[list[int]], offsets: list[int],
                 device: torch.device | str):
        self.prefix, self.prefix_mask = prefix, prefix_mask.bool()
        self.groups = list(groups)
        self.offsets = torch.tensor(offsets, dtype=torch.long, device=device)
        self.row_mask: torch.Tensor | None = None
        self._index = [torch.tensor(g, dtype=torch.long, device=device) for g in groups]
        self._own: tuple[Any, ...] = ()  # (row_mask, q, rep, the mask they give): the same for every layer of a pass
        self._prefix32: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> its prefix KV in float32, once

    def select(self, rows: list[int]) -> None:
        """Keep batch rows `rows` (repeats allowed), as the decode cache's `batch_select_indices` does."""
        where = {r: g for g, members in enumerate(self.groups) for r in members}
        device = self.offsets.device
        self.groups = [[i for i, r in enumerate(rows) if where[r] == g] for g in range(len(self.groups))]
        self._index = [torch.tensor(g, dtype=torch.long, device=device) for g in self.groups]
        pick = torch.tensor(rows, dtype=torch.long, device=device)
        self.offsets = self.offsets.index_select(0, pick)
        if self.row_mask is not None:
            self.row_mask = self.row_mask.index_select(0, pick)

    def subset(self, rows: list[int], row_mask: torch.Tensor) -> Cascade:
        """A cascade over batch rows `rows` only (a prompt pass over part of the batch), sharing this one's prefix
        and its float32 copies; `row_mask` (len(rows), n) says which of those rows' own positions are real."""
        part = copy.copy(self)
        part._own = ()
        part.select(rows)
        part.row_mask = row_mask
        return part

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Forward passes on this thread attend through this cascade."""
        before = getattr(_thread, "state", None)
        _thread.state = self
        try:
            yield
        finally:
            _thread.state = before

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
               ) -> torch.Tensor:
        """Attention output (B, q, H, D) of `query` (B, H, q, D) over each row's prefix and its own `key`/`value`
        (B, Hkv, n, D), the last q of which are the query tokens (causal among themselves)."""
        assert self.row_mask is not None and self.row_mask.shape == (query.shape[0], key.shape[2]), \
            "the decode loop sets row_mask (rows x own positions) before each forward pass"
        B, H, q, D = query.shape
        hkv = key.shape[1]
        rep = H // hkv
        # (B, Hkv, q * rep, D), query-major: head h = kv * rep + r, as transformers' repeat_kv orders them
        qs = query.reshape(B, hkv, rep, q, D).transpose(2, 3).reshape(B, hkv, q * rep, D)
        m_own, s_own, o_own = _partial(qs, key, value, self._own_mask(q, rep), scale)
        m_pre = torch.full_like(m_own, float("-inf"))
        s_pre, o_pre = torch.zeros_like(s_own), torch.zeros_like(o_own)
        if layer not in self._prefix32:  # (G, Hkv, P, D); a no-op for a float32 model
            self._prefix32[layer] = (self.prefix.layers[layer].keys.float(), self.prefix.layers[layer].values.float())
        k_pre, v_pre = self._prefix32[layer]
        for g, rows in enumerate(self._index):
            if not self.groups[g] or not k_pre.shape[2]:
                continue
            k = len(self.groups[g])
            # the rows of one prefix as one batch of queries against its keys, read once
            qg = qs.index_select(0, rows).transpose(0, 1).reshape(1, hkv, k * q * rep, D)
            m, s, o = _partial(qg, k_pre[g:g + 1], v_pre[g:g + 1], self.prefix_mask[g][None, None, None, :], scale)
            for into, part in ((m_pre, m), (s_pre, s), (o_pre, o)):
                into.index_copy_(0, rows, part.reshape(hkv, k, q * rep, part.shape[-1]).transpose(0, 1))
        m = torch.maximum(m_own, m_pre)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a padding query attends nothing: its output is 0
        w_own, w_pre = torch.exp(m_own - m), torch.exp(m_pre - m)
        total = s_own * w_own + s_pre * w_pre
        # never a NaN, even where nothing is attended: a padding position's keys and values are read (times 0) later
        out = (o_own * w_own + o_pre * w_pre) / torch.where(total > 0, total, torch.ones_like(total))
        return out.to(query.dtype).reshape(B, hkv, q, rep, D).transpose(1, 2).reshape(B, q, H, D)


    def _own_mask(self, q: int, rep: int) -> torch.Tensor:
        """(B, 1, q * rep, n): which of its own keys each query attends (real, not after the query token); built once
        per forward pass, not per layer."""
        mask = self.row_mask
        assert mask is not None
        if not self._own or self._own[0] is not mask or self._own[1:3] != (q, rep):
            B, n = mask.shape
            own = mask[:, None, :] & (
                torch.arange(n, device=mask.device)[None, :] <= torch.arange(n - q, n, device=mask.device)[:, None])
            self._own = (mask, q, rep, own[:, None, :, None].expand(B, 1, q, rep, n).reshape(B, 1, q * rep, n))
        return self._own[3]


def _partial(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, scale: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax attention of `query` (b, Hkv, Q, D) over `key`/`value` (b, Hkv, n, D) where `allowed` (broadcast to
    (b, Hkv, Q, n)), unnormalised: the scores' max m (-inf where nothing is allowed), sum s of exp(score - m), and
    the exp-weighted sum o of the values; in float32, `_MAX_SCORES` scores at a time (a long prefill's queries in
    chunks)."""
    query, key, value = query.float(), key.float(), value.float()  # bf16 scores would round before the softmax
    b, hkv, Q = query.shape[:3]
    n = key.shape[2]
    size = max(1, _MAX_SCORES // max(1, b * hkv * n))
    parts = []
    for start in range(0, Q, size):
        part = allowed if allowed.shape[2] == 1 else allowed[:, :, start:start + size]
        scores = torch.matmul(query[:, :, start:start + size], key.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~part, float("-inf"))
        m = scores.amax(-1, keepdim=True)
        p = torch.exp(scores - torch.where(torch.isinf(m), torch.zeros_like(m), m))
        parts.append((m, p.sum(-1, keepdim=True), torch.matmul(p, value)))
    if len(parts) == 1:
        return parts[0]
    m, s, o = zip(*parts)
    return torch.cat(m, 2), torch.cat(s, 2), torch.cat(o, 2)


def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function registered as `NAME`: cascade attention while a `Cascade` is active on this thread,
    sdpa attention otherwise (`masgraph/backends/hf/gqa.py`: transformers', with masked grouped-query passes on a CPU
    on the key/value heads)."""
    state = getattr(_thread, "state", None)
    if state is None:
        return sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return state.attend(module.layer_idx, query, key, value, scale), None


PLAIN = {"llama", "qwen2", "qwen3", "phi3", "mistral"}
"""Model types whose attention is plain scaled-dot-product (no sinks, soft-capping or biases) where it attends all."""


def windowed(config: Any) -> bool:
    """Whether some layer of the model attends a sliding window, not the whole context (its cache layers then
    differ from transformers' plain `DynamicLayer`)."""
    types = getattr(config, "layer_types", None)
    if types:
        return any(t != "full_attention" for t in types)
    return bool(getattr(config, "use_sliding_window", getattr(config, "sliding_window", None)))


def install(model: Any) -> bool:
    """Run `model` under `NAME` if it is of a `PLAIN` type, runs under sdpa now and every layer attends the whole
    context (no sliding window); returns whether it does. Registration with transformers happens once per process."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    config = model.config
    if getattr(config, "_attn_implementation", None) == NAME:
        return True
    if getattr(config, "model_type", None) not in PLAIN or config._attn_implementation != "sdpa" or windowed(config):
        return False
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation = NAME
    return True
