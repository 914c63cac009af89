"""Cascade attention: rows that decode on a cached prompt prefix attend that prefix's KV where it is, once per
distinct prefix, instead of a copy per row.

Before, a batch's cached prefix KV was repeated per row (or stacked per row), so a decode step of 10 rows on
~1,300-token prefixes read ~600 MB of KV against ~60 MB for the prefix once: 257 vs 156 ms a step for SmolLM2-135M
on a 2-core CPU (benchmarks/results/rollout_throughput.md). Here the batch's cache holds only each row's own
positions (the rest of its prompt, then its completion); each attention layer scores the row's prefix (one batch
entry per distinct prefix, every row of it as extra queries: one read) and the row's own keys apart, and takes one
softmax over both side by side (the softmax over the union of keys).

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
        self._layout: _Layout | None = None  # built on first use after each select
        self._masks: tuple[Any, ...] = ()  # (row_mask, q, P, the keys blocked): the same for every layer
        self._prefix32: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> its prefix KV in float32, once

    def select(self, rows: list[int]) -> None:
        """Keep batch rows `rows` (repeats allowed), as the decode cache's `batch_select_indices` does."""
        where = {r: g for g, members in enumerate(self.groups) for r in members}
        self.groups = [[i for i, r in enumerate(rows) if where[r] == g] for g in range(len(self.groups))]
        pick = torch.tensor(rows, dtype=torch.long, device=self.offsets.device)
        self.offsets = self.offsets.index_select(0, pick)
        self._layout = None
        if self.row_mask is not None:
            self.row_mask = self.row_mask.index_select(0, pick)

    def subset(self, rows: list[int], row_mask: torch.Tensor) -> Cascade:
        """A cascade over batch rows `rows` only (a prompt pass over part of the batch), sharing this one's prefix
        and its float32 copies; `row_mask` (len(rows), n) says which of those rows' own positions are real."""
        part = copy.copy(self)
        part._masks = ()
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
        (B, Hkv, n, D), the last q of which are the query tokens (causal among themselves): one softmax over the
        row's prefix keys and its own keys side by side, in float32 (bf16 scores would round before the softmax).

        A row's prefix scores come from one batched matmul of every group's rows against its prefix (`_Layout`):
        the prefix is read once per group, and the ops per layer do not grow with the number of groups."""
        assert self.row_mask is not None and self.row_mask.shape == (query.shape[0], key.shape[2]), \
            "the decode loop sets row_mask (rows x own positions) before each forward pass"
        B, H, q, D = query.shape
        hkv = key.shape[1]
        rep = H // hkv
        # (B, Hkv, q * rep, D), query-major: head h = kv * rep + r, as transformers' repeat_kv orders them
        qs = query.reshape(B, hkv, rep, q, D).transpose(2, 3).reshape(B, hkv, q * rep, D).float() * scale
        key, value = key.float(), value.float()
        if layer not in self._prefix32:  # (G, Hkv, P, D); a no-op for a float32 model
            self._prefix32[layer] = (self.prefix.layers[layer].keys.float(), self.prefix.layers[layer].values.float())
        layout = self._rows()
        k_pre, v_pre = layout.live_prefix(layer, self._prefix32[layer])
        blocked = self._blocked(q, rep, k_pre.shape[2])
        # a long prefill's query positions in chunks of at most `_MAX_SCORES` scores (the group layout's rows count)
        size = max(1, _MAX_SCORES // max(1, layout.slots * hkv * rep * blocked.shape[-1]))
        parts = [_chunk(layout, qs[:, :, s * rep:(s + size) * rep], key, value, k_pre, v_pre, blocked[:, :, s:s + size])
                 for s in range(0, q, size)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, 2)
        return out.to(query.dtype).reshape(B, hkv, q, rep, D).transpose(1, 2).reshape(B, q, H, D)

    def _rows(self) -> _Layout:
        if self._layout is None:
            self._layout = _Layout(self.groups, len(self.offsets), self.offsets.device)
        return self._layout

    def _blocked(self, q: int, rep: int, P: int) -> torch.Tensor:
        """(B, 1, q, 1, P + n): the keys each query position does not attend: its row's prefix padding, then its own
        padding and the keys after it; the same for the rep query heads of a key/value head (broadcast, not copied),
        built once per forward pass, not per layer."""
        mask = self.row_mask
        assert mask is not None
        if not self._masks or self._masks[0] is not mask or self._masks[1:3] != (q, P):
            B, n = mask.shape
            own = mask[:, None, :] & (
                torch.arange(n, device=mask.device)[None, :] <= torch.arange(n - q, n, device=mask.device)[:, None])
            pre = self.prefix_mask[:, -P:] if P else self.prefix_mask[:, :0]
            pre = pre.index_select(0, self._rows().group_of)[:, None, :].expand(B, q, P)
            self._masks = (mask, q, P, ~torch.cat([pre, own], -1)[:, None, :, None, :])
        return self._masks[3]


class _Layout:
    """The batch rows laid out by prefix group, R slots a group (R: the largest group; a short group's spare slots
    compute on row 0 and are never read back; a group with no rows left gets none): `to_groups` takes (B, Hkv, c, X)
    to (G, Hkv, R * c, X), a batch of one query set per prefix; `to_rows` takes the result back. With one group
    holding every row in order, no index is read at all."""

    def __init__(self, groups: list[list[int]], rows: int, device: torch.device | str):
        live = [g for g, members in enumerate(groups) if members]
        self.live = None if len(live) == len(groups) else torch.tensor(live, dtype=torch.long, device=device)
        """The prefix groups with rows, where some have none (their prefixes are left out of the matmuls)."""
        groups = [groups[g] for g in live]
        self.G, self.R = len(groups), max([1, *map(len, groups)])
        self.slots = self.G * self.R
        self.plain = self.G == 1 and groups[0] == list(range(rows))
        slot = {r: g * self.R + i for g, members in enumerate(groups) for i, r in enumerate(members)}
        self.gather = torch.tensor([members[i] if i < len(members) else 0 for members in groups for i in range(self.R)],
                                   dtype=torch.long, device=device)
        self.scatter = torch.tensor([slot[r] for r in range(rows)], dtype=torch.long, device=device)
        self.group_of = torch.tensor([live[slot[r] // self.R] for r in range(rows)], dtype=torch.long, device=device)
        """Each row's prefix group, as `Cascade.groups` numbers them."""
        self._live_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def live_prefix(self, layer: int, kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's prefix keys and values (G, Hkv, P, D) of the groups with rows: `kv` itself when every group has
        rows, else the live groups' copy, made once per layout (per `select`), not per step."""
        if self.live is None:
            return kv
        if layer not in self._live_kv:
            self._live_kv[layer] = (kv[0].index_select(0, self.live), kv[1].index_select(0, self.live))
        return self._live_kv[layer]

    def to_groups(self, x: torch.Tensor) -> torch.Tensor:
        c, X = x.shape[2:]
        if self.plain:
            return x.transpose(0, 1).reshape(1, x.shape[1], -1, X)
        x = x.index_select(0, self.gather).reshape(self.G, self.R, x.shape[1], c, X)
        return x.transpose(1, 2).reshape(self.G, x.shape[2], self.R * c, X)

    def to_rows(self, y: torch.Tensor) -> torch.Tensor:
        G, hkv, Rc, X = y.shape
        y = y.reshape(G, hkv, self.R, Rc // self.R, X).transpose(1, 2)
        if self.plain:
            return y.reshape(self.R, hkv, Rc // self.R, X)
        return y.reshape(G * self.R, hkv, Rc // self.R, X).index_select(0, self.scatter)


def _chunk(layout: _Layout, qs: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pre: torch.Tensor,
           v_pre: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, c * rep, D) for the queries `qs` (B, Hkv, c * rep, D), scaled, of c query positions: prefix keys
    first, then the row's own; `blocked` (B, 1, c, 1, P + n) the keys they do not attend."""
    P = k_pre.shape[2]
    scores = torch.matmul(qs, key.transpose(-1, -2))  # (B, Hkv, c * rep, n)
    if P:
        scores = torch.cat([layout.to_rows(torch.matmul(layout.to_groups(qs), k_pre.transpose(-1, -2))), scores],
                           -1)
    B, hkv, c_rep, keys = scores.shape
    # the lowest finite score, not -inf: a query with nothing to attend (left padding) gets the mean of its values,
    # never NaN (its own keys and values are read later, times 0), and a NaN from the model is not hidden
    scores = scores.view(B, hkv, blocked.shape[2], -1, keys).masked_fill(blocked, torch.finfo(scores.dtype).min)
    p = torch.softmax(scores.view(B, hkv, c_rep, keys), -1)
    out = torch.matmul(p[..., P:], value)
    if P:
        out = out + layout.to_rows(torch.matmul(layout.to_groups(p[..., :P]), v_pre))
    return out


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


def gaps_fit(config: Any, length: int) -> bool:
    """Whether rows laid out over `length` positions (the longest row: cached prefix, left-padded middle and suffix,
    completion) may hold pad gaps between their real tokens and still attend what each would attend alone: every
    layer attends the whole context, or `length` fits the sliding window. transformers' window mask and window cache
    count positions, pads included, so a gap inside the window pushes a row's earliest real tokens out of it."""
    if not windowed(config):
        return True
    window = getattr(config, "sliding_window", None)
    return isinstance(window, int) and length <= window


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
