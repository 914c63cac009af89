"""Prompt prefixes computed once per update phase and read by every logprob pass of it.

A trainer cuts an update's rows into passes (`micro_batch` rows each); every pass of one adapter starts with the
same node's system prompt, which `sequence_logprobs` computed once per pass: on `graphs/mixed_router.yaml` 2,629 of
the 8,908 tokens a step's gradient passes ran were those repeats. Within a `PrefixStore` the first pass's prefix KV
is kept (per adapter) and later passes read it, sliced to what they share and extended by what they do not.

With a gradient the kept KV is a detached leaf: each pass's backward adds into its `.grad`, and `backward()` sends
the sum back through the prefix's one forward, so the adapter gets the same gradient as from one forward per pass
(the sum of the passes' terms, in another order: fp32 rounding apart).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from masgraph.backends.base import TokenRow
from masgraph.backends.hf.layout import prefill
from masgraph.learn.packing import common_prefix


@dataclass
class _Kept:
    tokens: list[int]
    computed: list[torch.Tensor]
    """The prefill's keys and values per layer (with the forward's graph when the pass had a gradient)."""
    leaves: list[torch.Tensor]
    """The same tensors detached: what passes read (and, with a gradient, add their KV gradient into)."""


class PrefixStore:
    """Prefix KV caches of one update phase, per adapter (None: the reference), shared by its passes.

    Use it within one adapter version: a kept prefix is the adapter's as it was when computed. Call `backward()` per
    adapter after the phase's last backward pass and before the optimizer steps."""

    def __init__(self) -> None:
        self._kept: dict[str | None, list[_Kept]] = {}
        self.reused = 0
        """Prefix tokens passes read here instead of computing them (what `pack_stats` no longer counts)."""

    def known(self, adapter: str | None, rows: Sequence[TokenRow]) -> int:
        """How many leading tokens every row's prompt + completion shares with one kept prefix of `adapter` (0:
        none)."""
        seqs = [list(r.prompt_ids) + list(r.completion_ids) for r in rows]
        return max((min(_common(k.tokens, s) for s in seqs) for k in self._kept.get(adapter, [])), default=0)

    def cache(self, model: Any, adapter: str | None, prefix: list[int]) -> Any:
        """A batch-1 DynamicCache of `prefix` under the active adapter (`adapter`'s): the longest kept prefix it
        shares, sliced, plus the rest computed on top of it (a prefix sharing nothing is computed and kept)."""
        from transformers import DynamicCache

        kept = self._kept.setdefault(adapter, [])
        best, n = max(((k, _common(k.tokens, prefix)) for k in kept), key=lambda kn: kn[1], default=(None, 0))
        if best is None or n == 0:
            computed = [t for layer in prefill(model, prefix).layers for t in (layer.keys, layer.values)]
            grad = torch.is_grad_enabled()
            best, n = _Kept(list(prefix), computed, [t.detach().requires_grad_(grad) for t in computed]), len(prefix)
            kept.append(best)
        else:
            self.reused += n
        pairs = zip(best.leaves[0::2], best.leaves[1::2])
        cache = DynamicCache(ddp_cache_data=[(k[:, :, :n], v[:, :, :n]) for k, v in pairs])
        return prefill(model, prefix[n:], cache) if n < len(prefix) else cache

    def adapters(self) -> list[str | None]:
        """The adapters (None: the reference) with kept prefixes."""
        return list(self._kept)

    def backward(self, adapter: str | None) -> None:
        """Send `adapter`'s kept prefixes' summed KV gradients back through their forwards (once each), then forget
        them. Run it with `adapter` active: PEFT's `set_adapter` turns the other adapters' `requires_grad` off, and
        autograd drops a gradient for a parameter that no longer requires one."""
        outs, grads = [], []
        for computed, leaf in ((c, x) for k in self._kept.pop(adapter, []) for c, x in zip(k.computed, k.leaves)):
            if leaf.grad is not None and computed.requires_grad:
                outs.append(computed)
                grads.append(leaf.grad)
        if outs:
            torch.autograd.backward(outs, grads)


def _common(a: list[int], b: list[int]) -> int:
    return common_prefix([a, b], len(a))
