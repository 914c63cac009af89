"""The decode loop writes each new position into KV buffers with room reserved up front (`hf/decode.reserve`)
instead of transformers' concatenation of the whole cache per step: the same completions, the keys and values read
as views of the buffers, and a step past the room is an error rather than a silent reallocation."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import masgraph.backends.hf.decode as decode_module
from masgraph.backends.base import Request
from masgraph.backends.hf import HFBackend
from masgraph.spec import SamplingSpec


def _requests() -> list[Request]:
    system = {"role": "system", "content": "You are a careful assistant. " * 4}
    return [Request([system, {"role": "user", "content": f"What is {i} + {i}?"}],
                    sampling=SamplingSpec(temperature=1.0 if i % 2 else 0.0, max_tokens=6 + i), seed=i)
            for i in range(4)]


def test_reserved_buffers_decode_what_concatenation_decodes(tiny, monkeypatch):
    backend = HFBackend(str(tiny), dtype="float32")
    writes = []
    update = decode_module.Reserved.update

    def counted(self, *args, **kwargs):
        writes.append(1)
        return update(self, *args, **kwargs)

    monkeypatch.setattr(decode_module.Reserved, "update", counted)
    reserved = backend.generate(_requests())
    assert writes  # the decode steps wrote into reserved buffers
    monkeypatch.setattr(decode_module, "reserve", lambda cache, room: None)  # transformers' own growth
    grown = backend.generate(_requests())
    for r, g in zip(reserved, grown, strict=True):
        assert r.completion_ids == g.completion_ids
        assert max(abs(a - b) for a, b in zip(r.logprobs, g.logprobs)) <= 1e-5


def test_updates_write_into_the_buffers_in_place():
    cache = DynamicCache()
    k = torch.randn(2, 3, 5, 4)
    cache.update(k, k + 1, 0)
    decode_module.reserve(cache, room=3)
    layer = cache.layers[0]
    assert isinstance(layer, decode_module.Reserved) and torch.equal(layer.keys, k)
    for step in range(3):
        new = torch.full((2, 3, 1, 4), float(step))
        keys, values = cache.update(new, new + 1, 0)
        assert keys.data_ptr() == layer.key_room.data_ptr()  # a view of the buffer: nothing was copied
        assert keys.shape[-2] == 6 + step and torch.equal(keys[..., -1:, :], new)
        assert torch.equal(values[..., :5, :], k + 1)
    assert cache.get_seq_length() == 8
    with pytest.raises(RuntimeError, match="past the room"):
        cache.update(new, new, 0)


def test_other_layer_kinds_keep_their_own_growth():
    class Sliding(DynamicLayer):
        pass

    cache = DynamicCache()
    cache.layers.append(Sliding())
    cache.update(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), 0)
    decode_module.reserve(cache, room=4)
    assert type(cache.layers[0]) is Sliding
