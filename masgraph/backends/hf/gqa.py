"""Grouped-query attention on its key/value heads for masked passes on a CPU.

transformers' sdpa attention hands torch's SDPA the key/value heads as they are (`enable_gqa`) only where no mask is
given; with a mask (a batch of padded, packed or prefix-sharing rows: every training pass here) it first repeats each
key/value head once per query head of its group (`repeat_kv`: SmolLM2's 3 heads become 9 copies), and the backward
sums the copies' gradients again. torch's CPU flash-attention kernel takes the heads as they are, mask or not: the
same outputs bit for bit, the gradients equal up to summation order (6e-8 at the update's shapes), and a masked
forward + backward at 0.54-0.79x the time on the `mixed_router` update's shapes (2-core EPYC; 0.99x where a row is
alone: benchmarks/results/gqa_attention.md). On a GPU a masked GQA call would leave the flash kernels, so there
nothing changes."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

_OTHER_TERMS = ("softcap", "position_bias", "s_aux", "sinks", "cache")
"""Attention extras this path does not apply: a call carrying one goes to transformers' own function."""


def sdpa_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa_attention_forward`, except that a masked pass of several query positions of a
    grouped-query model on a CPU attends the key/value heads without repeating them. Same signature and output
    layout (batch, positions, heads, head dim)."""
    if _on_kv_heads(module, query, key, attention_mask, kwargs):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, is_causal=False, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _on_kv_heads(module: Any, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                 kwargs: dict[str, Any]) -> bool:
    """Where transformers would repeat the key/value heads and the CPU kernel can do without: a mask (with none,
    transformers already passes the heads as they are), more than one query position (one decodes through
    transformers' own head packing), grouped heads, nothing but the plain attention terms."""
    return (attention_mask is not None and query.device.type == "cpu" and query.shape[2] > 1
            and getattr(module, "num_key_value_groups", 1) > 1 and query.shape[1] != key.shape[1]
            and not any(kwargs.get(name) is not None for name in _OTHER_TERMS)
            and not kwargs.get("output_attentions", False))
