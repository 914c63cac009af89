"""`Cascade.attend` against attention written out by hand: each row's prefix keys and values put in front of its
own, one masked softmax per query, in float64. The batch shapes the backend builds: one prefix for all rows, prefix
groups of different sizes with left-padded prefixes (one all padding), rows left after `select` (repeats, a group
emptied), a `subset`, no prefix at all, a long pass in chunks, a query with nothing to attend, bf16."""

from __future__ import annotations

import types

import pytest
import torch

import masgraph.backends.hf.cascade as cascade_module
from masgraph.backends.hf.cascade import Cascade

D, LAYER = 8, 1


def prefix_cache(G: int, hkv: int, P: int, dtype: torch.dtype) -> types.SimpleNamespace:
    layers = [types.SimpleNamespace(keys=torch.randn(G, hkv, P, D, dtype=dtype),
                                    values=torch.randn(G, hkv, P, D, dtype=dtype)) for _ in range(LAYER + 1)]
    return types.SimpleNamespace(layers=layers)


def by_hand(query, key, value, prefix, prefix_mask, groups, row_mask, scale):
    """(B, q, H, D) float64; a query with nothing to attend: None in `skip` (its output is not used)."""
    B, H, q, _ = query.shape
    hkv, n = key.shape[1], key.shape[2]
    kp, vp = prefix.layers[LAYER].keys.double(), prefix.layers[LAYER].values.double()
    group = {r: g for g, members in enumerate(groups) for r in members}
    out, skip = torch.zeros(B, q, H, D, dtype=torch.float64), set()
    for b in range(B):
        g = group[b]
        keys, values = torch.cat([kp[g], key[b].double()], 1), torch.cat([vp[g], value[b].double()], 1)
        for i in range(q):
            allowed = torch.cat([prefix_mask[g].bool(), row_mask[b] & (torch.arange(n) <= n - q + i)])
            if not allowed.any():
                skip.add((b, i))
                continue
            for h in range(H):
                s = (keys[h // (H // hkv)] @ query[b, h, i].double() * scale).masked_fill(~allowed, float("-inf"))
                out[b, i, h] = torch.softmax(s, -1) @ values[h // (H // hkv)]
    return out, skip


PADDED = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])  # group 2: no prefix at all
OWN = torch.ones(5, 7, dtype=torch.bool)
OWN[0, :3] = False  # left padding
OWN[4, :7] = False  # nothing of its own: with group 2's empty prefix, nothing to attend

CASES = {
    "one prefix, every row in order": dict(groups=[[0, 1, 2]], H=4, hkv=2, q=1),
    "one prefix, a pass of 4 tokens": dict(groups=[[0, 1, 2]], H=4, hkv=2, q=4),
    "three groups, padded prefixes": dict(groups=[[1, 3], [0], [2, 4]], H=6, hkv=2, q=3, mask=PADDED, own=OWN),
    "in chunks of one position": dict(groups=[[1, 3], [0], [2, 4]], H=6, hkv=2, q=3, mask=PADDED, own=OWN, chunk=1),
    "in chunks of two positions": dict(groups=[[1, 3], [0], [2, 4]], H=6, hkv=2, q=3, mask=PADDED, own=OWN,
                                       chunk=5 * 2 * 3 * 13 * 2),
    "select: repeats, a group emptied": dict(groups=[[1, 3], [0], [2, 4]], H=6, hkv=2, q=1, mask=PADDED, own=OWN,
                                             select=[3, 3, 2, 1]),
    "select: the middle group emptied": dict(groups=[[1, 3], [0], [2, 4]], H=6, hkv=2, q=1, select=[3, 2, 4]),
    "select: one group, out of order": dict(groups=[[1, 3], [0, 2, 4]], H=4, hkv=2, q=1, mask=PADDED[:2], own=OWN,
                                            select=[3, 1]),
    "subset": dict(groups=[[1, 3], [0], [2, 4]], H=6, hkv=2, q=2, mask=PADDED, subset=[4, 0, 3]),
    "no prefix positions": dict(groups=[[0, 2], [1]], H=4, hkv=2, q=2, mask=torch.ones(2, 0, dtype=torch.long)),
    "no grouped heads": dict(groups=[[3, 0], [1, 2]], H=2, hkv=2, q=3),
    "bf16": dict(groups=[[0, 2], [1]], H=4, hkv=2, q=1, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_attend_is_attention_over_the_rows_prefix_then_its_own_keys(name, monkeypatch):
    torch.manual_seed(0)
    c = CASES[name]
    groups, H, hkv, q, dtype = c["groups"], c["H"], c["hkv"], c["q"], c.get("dtype", torch.float32)
    rows = sum(map(len, groups))
    mask = c.get("mask", torch.ones(len(groups), 6, dtype=torch.long))
    own = c.get("own", torch.ones(rows, 7, dtype=torch.bool))[:rows]
    prefix = prefix_cache(len(groups), hkv, mask.shape[1], dtype)
    cascade = Cascade(prefix, mask, groups, [mask.shape[1]] * rows, "cpu")
    if "select" in c:
        cascade.select(c["select"])
        own = own.index_select(0, torch.tensor(c["select"]))
    if "subset" in c:
        own = own.index_select(0, torch.tensor(c["subset"]))
        cascade = cascade.subset(c["subset"], own)
    if "chunk" in c:
        monkeypatch.setattr(cascade_module, "_MAX_SCORES", c["chunk"])
    cascade.row_mask = own
    B, n = own.shape
    query = torch.randn(B, H, q, D, dtype=dtype)
    key, value = (torch.randn(B, hkv, n, D, dtype=dtype) for _ in range(2))
    got = cascade.attend(LAYER, query, key, value, D ** -0.5)
    want, skip = by_hand(query, key, value, prefix, mask, cascade.groups, own, D ** -0.5)
    assert got.dtype == dtype and got.shape == (B, q, H, D) and torch.isfinite(got).all()
    for b, i in skip:  # nothing to attend: not compared (the backend never reads it), but finite
        want[b, i] = got[b, i].double()
    assert (got.double() - want).abs().max() <= (2e-2 if dtype == torch.bfloat16 else 1e-5)
