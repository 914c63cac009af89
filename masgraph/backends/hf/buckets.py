"""Length-bucketed prompt passes: a batch's prompt parts of different lengths run as a few passes over rows of
similar length instead of one pass left-padded to the longest; their KVs go back into the one left-padded batch cache
the decode steps read, so nothing after the pass changes.

Why: on the AgentFlow graph at 16 episodes at once, 35 % of the positions the prompt passes ran were left padding
(5,159 run for 3,360 prompt tokens; results/rollout_throughput.md, 2026-12-03), and on a CPU a pass costs in
proportion to the positions it runs. A pass also has a fixed cost (every layer's kernels launch once), so rows are
grouped to minimise `passes × overhead + positions run`: one pass where the lengths are close, rows alone where they
are far apart."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from masgraph.backends.hf.cascade import Cascade, windowed
from masgraph.backends.hf.layout import picked_rows

PASS_COST = {"cpu": 32}
"""What one more pass costs, in prompt positions, per device type: on a CPU a pass of SmolLM2-135M costs about what
16-32 more positions cost (a one-token step ~60 ms against ~3 ms a prompt position; rollout_throughput.md). On other
devices (a GPU runs a few thousand positions in about the time of one) the batch keeps one pass."""


def pass_cost(model: Any) -> int | None:
    """The overhead `plan` weighs for `model`'s device, or None where the batch keeps one pass: another device type,
    or a model with windowed attention (its cache layers are not plain, so their KV cannot be regrouped here)."""
    return None if windowed(model.config) else PASS_COST.get(model.device.type)


def plan(lengths: list[int], overhead: int | None) -> list[list[int]]:
    """The rows (indices into `lengths`) of each pass, minimising the sum over passes of `overhead` + rows × the
    pass's longest length; None: one pass. Each pass is a run of rows adjacent in length order (some optimum always
    is: swapping a longer row into the pass of longer rows never raises a pass's longest), found by dynamic
    programming over that order; the passes and their rows come in row order."""
    n = len(lengths)
    if overhead is None or n < 2:
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: -lengths[i])
    best, cut = [0] + [None] * n, [0] * (n + 1)
    for j in range(1, n + 1):  # the j longest rows, the last pass being order[i:j] (its longest: order[i])
        for i in range(j):
            cost = best[i] + overhead + (j - i) * lengths[order[i]]
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    passes, j = [], n
    while j:
        passes.append(sorted(order[cut[j]:j]))
        j = cut[j]
    return sorted(passes)


def run_passes(model: Any, cache: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
               lengths: list[int], passes: list[list[int]], cascade: Cascade | None = None,
               forward: dict[str, Any] | None = None) -> tuple[torch.Tensor, int]:
    """Run the prompt pass of a left-padded batch as `passes` (`plan`'s rows). `ids`/`pos` (B, L) are the new
    positions, `lengths` each row's real ones among them (the rest left padding); `mask` (B, n + L) covers the
    cache's n positions and the new ones (with a `cascade`, which own positions are real: it becomes each pass's
    `row_mask`). `cache` ends as one pass would leave it: B rows of n + L positions, a row's padding positions zero
    (masked out, as padding always is). Returns the last position's logits (B, V) (zero for a row with nothing new)
    and the positions the passes ran."""
    B, L = ids.shape
    n = mask.shape[1] - L
    old = [(layer.keys, layer.values) for layer in cache.layers if layer.is_initialized and layer.keys.numel()]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    logits: torch.Tensor | None = None
    run = 0
    for rows in passes:
        width = max(lengths[i] for i in rows)
        if not width:
            continue  # nothing new for these rows: their positions stay padding
        pick = torch.tensor(rows, dtype=torch.long, device=ids.device)
        sub = picked_rows(cache, rows)
        sub_mask = torch.cat([mask[:, :n], mask[:, n + L - width:]], dim=1).index_select(0, pick)
        attend = cascade.subset(rows, sub_mask).active if cascade is not None else nullcontext
        extra = {k: [v[i] for i in rows] for k, v in (forward or {}).items()}
        with attend():
            out = model(input_ids=ids.index_select(0, pick)[:, L - width:],
                        attention_mask=None if cascade is not None else sub_mask,
                        position_ids=pos.index_select(0, pick)[:, L - width:], past_key_values=sub, use_cache=True,
                        logits_to_keep=1, **extra).logits[:, -1, :]
        run += len(rows) * width
        if logits is None:
            logits = out.new_zeros((B, out.shape[-1]))
        logits.index_copy_(0, pick, out)
        for index, layer in enumerate(sub.layers):
            if len(keys) <= index:  # the batch's layer: its old positions, then zeros for the new ones
                for into, part_kv in ((keys, layer.keys), (values, layer.values)):
                    full = part_kv.new_zeros((B, part_kv.shape[1], n + L, part_kv.shape[3]))
                    if old:
                        full[:, :, :n] = old[index][0 if into is keys else 1]
                    into.append(full)
            keys[index][:, :, n + L - width:].index_copy_(0, pick, layer.keys[:, :, n:])
            values[index][:, :, n + L - width:].index_copy_(0, pick, layer.values[:, :, n:])
    for index, (k, v) in enumerate(zip(keys, values)):
        if index < len(cache.layers) and cache.layers[index].is_initialized:
            cache.layers[index].keys, cache.layers[index].values = k, v
        else:
            cache.update(k, v, index)
    assert logits is not None, "a prompt pass has at least one row with a new position"
    return logits, run
