"""Masked grouped-query attention on its key/value heads on a CPU (`masgraph/backends/hf/gqa.py`): transformers'
numbers, without the repeated heads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from masgraph.backends.hf import cascade
from masgraph.backends.hf.gqa import _on_kv_heads, sdpa_attention
from masgraph.backends.hf.model import HFModel

MODULE = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)


class _KeyHeads(TorchDispatchMode):
    """The head counts of the keys each attention kernel was given."""

    def __init__(self) -> None:
        super().__init__()
        self.heads: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func.overloadpacket) and "backward" not in str(func.overloadpacket):
            self.heads.append(args[1].shape[1])
        return func(*args, **(kwargs or {}))


def _inputs(rows: int = 2, q: int = 5, k: int = 12):
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(rows, h, n, 16, generator=gen, requires_grad=True)
                         for h, n in ((6, q), (2, k), (2, k)))
    mask = torch.ones(rows, 1, q, k, dtype=torch.bool).tril(k - q)
    mask[0, :, :, :3] = False  # a left-padded row
    return query, key, value, mask


def test_a_masked_pass_gives_transformers_outputs_and_gradients_on_the_kv_heads():
    grads = []
    for attend in (sdpa_attention_forward, sdpa_attention):
        query, key, value, mask = _inputs()
        with _KeyHeads() as seen:
            out, _ = attend(MODULE, query, key, value, mask, scaling=0.25)
        out.pow(2).sum().backward()
        grads.append((out.detach(), *(x.grad for x in (query, key, value))))
        heads = seen.heads
    assert heads == [2]  # the key/value heads as they are (transformers repeated them to 6)
    assert torch.equal(grads[0][0], grads[1][0])  # same outputs, bit for bit
    for want, got in zip(grads[0][1:], grads[1][1:], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # summation order only


def test_what_it_leaves_to_transformers():
    query, key, value, mask = _inputs()
    assert _on_kv_heads(MODULE, query, key, mask, {})
    assert not _on_kv_heads(MODULE, query, key, None, {})  # transformers passes the heads as they are itself
    assert not _on_kv_heads(MODULE, query[:, :, :1], key, mask[:, :, :1], {})  # one position: its head packing
    assert not _on_kv_heads(SimpleNamespace(num_key_value_groups=1), query, key.repeat(1, 3, 1, 1), mask, {})
    assert not _on_kv_heads(MODULE, query, key, mask, {"softcap": 30.0})
    assert not _on_kv_heads(MODULE, query, key, mask, {"position_bias": torch.zeros(1)})


def test_a_loaded_model_runs_under_it_and_scores_as_under_sdpa(tiny):
    weights = HFModel(str(tiny), dtype="float32", device="cpu")
    model = weights.model
    assert weights.attention and model.config._attn_implementation == cascade.NAME
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with _KeyHeads() as seen, torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask).logits
    model.config._attn_implementation = "sdpa"
    try:
        with torch.no_grad():
            theirs = model(input_ids=ids, attention_mask=mask).logits
    finally:
        model.config._attn_implementation = cascade.NAME
    assert set(seen.heads) == {model.config.num_key_value_heads} and len(seen.heads) == model.config.num_hidden_layers
    torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours[0, 2:], theirs[0, 2:], rtol=0, atol=1e-6)  # the padded positions aside


@pytest.mark.parametrize("device", ["meta"])
def test_another_device_goes_to_transformers(device):
    query, key, value, mask = (x.detach().to(device) for x in _inputs())
    assert not _on_kv_heads(MODULE, query, key, mask, {})
