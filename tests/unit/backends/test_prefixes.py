"""One update phase's passes share their prompt prefix (masgraph/backends/hf/prefixes.py): cut into several passes
under one `PrefixStore`, the rows get the same log-probs and LoRA gradients as each pass computing its own prefix,
with the prefix run once; one row alone reads it too. Tolerances as in test_packing.py (fp32 summation order: the
prefix's gradient is summed over the passes before its backward instead of after)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from masgraph.backends.hf.learner import sequence_logprobs
from masgraph.backends.hf.prefixes import PrefixStore
from masgraph.learn.packing import plan_rows
from tests.unit.learn.test_packing import GRAD_RTOL, VALUE_ATOL, TRow, _rows, _tiny_peft


def _passes() -> list[list[TRow]]:
    """`_rows()` (one system prompt, two questions) cut as a trainer's micro-batches would: the last pass one row."""
    rows = _rows()
    return [rows[:3], rows[3:6], rows[6:]]


def _run(model, passes, store: PrefixStore | None):
    """Log-probs and LoRA gradients of `passes` (one backward each, as the update), and the positions the backbone
    ran."""
    from masgraph.backends.hf.logprobs import model_head

    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    positions: list[int] = []
    hook = model_head(model).backbone.register_forward_pre_hook(
        lambda module, args, kwargs: positions.append(kwargs["input_ids"].numel()), with_kwargs=True)
    gen = torch.Generator().manual_seed(3)
    model.zero_grad(set_to_none=True)
    values = []
    try:
        for rows in passes:
            out = sequence_logprobs(model, rows, 0, prefixes=store, adapter="pol")
            upstream = torch.randn(sum(len(r.completion_ids) for r in rows), generator=gen)
            (torch.cat(out) * upstream).sum().backward()
            values += [o.detach() for o in out]
        if store is not None:
            store.backward("pol")
    finally:
        hook.remove()
    return values, [p.grad.clone() for p in lora], sum(positions)


def test_passes_sharing_a_kept_prefix_equal_passes_computing_their_own():
    model = _tiny_peft()
    passes = _passes()
    assert plan_rows(passes[-1]).prefix == 0  # one row alone: no prefix of its own without the store
    want, want_grads, alone = _run(model, passes, None)
    got, got_grads, shared = _run(model, passes, PrefixStore())
    system = 9  # _rows()'s system prompt: the second pass reads it, and the last (one row) reads it too
    assert alone - shared == 2 * system
    assert max((g - w).abs().max().item() for g, w in zip(got, want, strict=True)) <= VALUE_ATOL
    for g, w in zip(got_grads, want_grads, strict=True):
        assert (g - w).abs().max().item() <= GRAD_RTOL * w.abs().max().item()


def test_without_the_deferred_backward_the_prefix_gradient_is_missing():
    """The check above can fail: the kept prefix's gradient reaches the adapter only through `backward()`."""
    model = _tiny_peft()
    passes = _passes()
    _, want_grads, _ = _run(model, passes, None)

    class NoBackward(PrefixStore):
        def backward(self, adapter) -> None:
            self._kept.clear()

    _, got_grads, _ = _run(model, passes, NoBackward())
    assert any((g - w).abs().max().item() > GRAD_RTOL * w.abs().max().item()
               for g, w in zip(got_grads, want_grads, strict=True))


def test_a_kept_prefix_is_sliced_to_what_a_later_pass_shares():
    """The first pass keeps system + question 1 (all its rows share both); a pass of question 2 reads the system part
    alone and computes its question on top; without a gradient nothing is kept for a backward."""
    model = _tiny_peft()
    rows = _rows()
    q1, q2 = rows[:4], [r for r in rows if r.prompt_ids[:13] != rows[0].prompt_ids[:13]]
    assert q2 and plan_rows(q1).prefix > 9
    store = PrefixStore()
    with torch.no_grad():
        want = [o for group in (q1, q2) for o in sequence_logprobs(model, group, 0)]
        got = [o for group in (q1, q2) for o in sequence_logprobs(model, group, 0, prefixes=store, adapter="pol")]
    assert store.reused == 9
    assert all(not t.requires_grad for kept in store._kept.values() for k in kept for t in k.leaves)
    assert max((g - w).abs().max().item() for g, w in zip(got, want, strict=True)) <= VALUE_ATOL


@pytest.mark.parametrize("adapter", ["pol", None])
def test_prefixes_are_kept_per_adapter(adapter):
    """A prefix kept under one adapter is not read under another (the reference's KV differs from the policy's)."""
    model = _tiny_peft()
    rows = _rows()[:3]
    store = PrefixStore()
    with torch.no_grad():
        sequence_logprobs(model, rows, 0, prefixes=store, adapter="pol")
        sequence_logprobs(model, rows, 0, prefixes=store, adapter=adapter)
    assert store.reused == (plan_rows(rows).prefix if adapter == "pol" else 0)


def test_two_adapters_in_one_scope_get_their_prefix_gradients(tiny):
    """`HFLearner.shared_prefixes` around passes of two adapters (as one optimizer step of a two-node graph): each
    adapter's LoRA gradients equal those of passes computing their own prefix, and one adapter's prefix is held at a
    time. The first adapter's prefix gradient goes back once the second adapter is active (here before its first
    pass, as when a backend decodes with it), and PEFT has turned the first's `requires_grad` off: sent back without
    the first adapter active again, autograd drops it."""
    from masgraph.backends.base import LoraConfigSpec
    from masgraph.backends.hf.learner import HFLearner

    torch.manual_seed(0)
    learner = HFLearner(str(tiny), dtype="float32")
    for name in ("a", "b"):
        learner.add_adapter(name, LoraConfigSpec())
        with torch.no_grad():  # non-zero B: gradients reach both LoRA matrices
            for p in learner.parameters(name):
                p.add_(0.1 * torch.randn_like(p))
    rows = {"a": _rows(30), "b": [TRow([7, 3, *r.prompt_ids], r.completion_ids, r.temperature) for r in _rows(30)]}
    everything = [p for name in rows for p in learner.parameters(name)]

    held: list[list[str | None]] = []  # the adapters with a kept prefix after each pass

    def grads(scope) -> list[torch.Tensor]:
        for p in everything:
            p.grad = None
        learner.train()
        with scope:
            for name, own in rows.items():
                learner.weights.use(name)  # active before its first pass (as when a backend decodes with it)
                for chunk in (own[:4], own[4:]):
                    torch.cat(learner.sequence_logprobs(chunk, name)).sum().backward()
                    held.append(learner._prefixes.adapters() if learner._prefixes else [])
        learner.train(False)
        return [p.grad.clone() for p in everything]

    want = grads(contextlib.nullcontext())
    held.clear()
    got = grads(learner.shared_prefixes())
    assert held == [["a"], ["a"], ["b"], ["b"]]  # a's prefix (and its graph) released when b's passes begin
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() <= GRAD_RTOL * w.abs().max().item()
