"""Rollouts that share a prompt beyond the static prefix (a question's G samples, an episode's next turn) prefill
that part once per batch (`HFBackend.share_prompts`, learn/packing.share_middles): the completions are those of the
layout before (greedy tokens equal, logprobs to fp32 summation order), and the shared prompt tokens are counted."""

from __future__ import annotations

import pytest

from masgraph.backends.base import Request
from masgraph.backends.hf import HFBackend
from masgraph.spec import SamplingSpec

SYSTEM = "1 + 2 = 3 . 4 + 5 = 9 . 6 * 2 = 12 . 8 - 3 = 5 . 7 + 7 = 14 ."


def _requests(temperature: float) -> list[Request]:
    out = []
    for q, question in enumerate(["3 + 4 ?", "9 * 2 ?", "12 - 5 = ?"]):
        for sample in range(3):  # a group: the same prompt three times
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            out.append(Request(messages, sampling=SamplingSpec(temperature=temperature, max_tokens=6),
                               seed=100 * q + sample, key=(q, sample)))
    # a second turn that extends a first one's prompt: shares the whole first prompt
    turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "3 + 4 ?"},
            {"role": "assistant", "content": "7"}, {"role": "user", "content": "Answer: ?"}]
    out.append(Request(turn, sampling=SamplingSpec(temperature=temperature, max_tokens=6), seed=7, key=(9, 0)))
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prompts_decode_what_the_layout_before_decodes(tiny, temperature):
    backend = HFBackend(str(tiny), dtype="float32")
    requests = _requests(temperature)
    backend.share_prompts = False
    before = backend.generate(requests)
    assert backend.stats["prompt_tokens_shared"] == 0
    backend.share_prompts = True
    after = backend.generate(requests)
    assert backend.stats["prompt_tokens_shared"] > 0  # the groups' prompts were prefilled once
    for b, a in zip(before, after, strict=True):
        assert a.prompt_ids == b.prompt_ids and a.completion_ids == b.completion_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-4


def test_the_counters_say_which_prompt_tokens_were_computed_and_where_the_time_went(tiny):
    """`prompt_tokens` received vs `prompt_tokens_computed`: each static prefix once (then from its cache), every row's
    suffix, a shared prompt part once per batch; `prefill_s` / `decode_s` split the time (the rollout profile)."""
    backend = HFBackend(str(tiny), dtype="float32")
    requests = _requests(0.0)
    backend.share_prompts = False
    done = backend.generate(requests)
    first = dict(backend.stats)
    prefixes = [backend.layout.static_prefix(r.messages, c.prompt_ids) for r, c in zip(requests, done)]
    distinct = {p for p in prefixes if p}
    assert len(distinct) == 2 and first["prefix_misses"] == 2  # the system prompt; the second turn's history
    assert first["decode_loops"] == 1  # one adapter: one decode loop, both prefixes in it
    assert first["prompt_tokens"] == sum(len(c.prompt_ids) for c in done)
    suffixes = sum(len(c.prompt_ids) - len(p) for c, p in zip(done, prefixes))
    assert first["prompt_tokens_computed"] == sum(map(len, distinct)) + suffixes
    assert first["prefill_s"] > 0 and first["decode_s"] > 0
    assert first["prefill_s"] + first["decode_s"] <= first["generate_s"]

    backend.share_prompts = True
    backend.generate(requests)  # the prefixes come from their cache now; the groups' prompts are prefilled once each
    again = {k: backend.stats[k] - first[k] for k in first}
    assert again["prefix_hits"] == 2 and again["prompt_tokens"] == first["prompt_tokens"]
    assert again["prompt_tokens_shared"] > 0
    assert again["prompt_tokens_computed"] == suffixes - again["prompt_tokens_shared"]
