"""The decode loop's sampler (`hf/decode.sample`): inverse CDF on one uniform draw per row. Its tokens follow the
temperature-scaled (and top-p cut) distribution, a row's tokens depend on its own seed only, and greedy or finished
rows take the argmax without drawing."""

from __future__ import annotations

from collections import Counter

import torch

from masgraph.backends.base import Request
from masgraph.backends.hf.decode import sample
from masgraph.spec import SamplingSpec

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0])


def _draw(n: int, temperature: float, top_p: float = 1.0) -> Counter:
    """`n` rows of the same logits, each on its own generator, one step."""
    reqs = [Request([], sampling=SamplingSpec(temperature=temperature, top_p=top_p)) for _ in range(n)]
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    temps = torch.full((n, 1), temperature)
    toks, lps = sample(LOGITS.repeat(n, 1), reqs, gens, [False] * n, temps)
    expected = torch.log_softmax(LOGITS / temperature, -1)
    assert torch.allclose(lps, expected[toks])  # each pick's logprob under the scaled distribution
    return Counter(toks.tolist())


def test_the_tokens_follow_the_temperature_scaled_distribution():
    n = 20_000
    for temperature in (1.0, 0.5):
        counts = _draw(n, temperature)
        p = torch.softmax(LOGITS / temperature, -1)
        for tok in range(len(LOGITS)):
            sd = (n * p[tok] * (1 - p[tok])).sqrt().item()
            assert abs(counts[tok] - n * p[tok].item()) <= 5 * sd + 1, (temperature, tok, counts)
        assert counts[5] == 0  # probability ~1e-14: never drawn


def test_top_p_keeps_only_the_nucleus_in_its_proportions():
    n = 20_000
    p = torch.softmax(LOGITS, -1)  # 0.56, 0.21, 0.13, ...: top_p 0.75 keeps the first two (0.56 < 0.75 <= 0.77)
    counts = _draw(n, 1.0, top_p=0.75)
    assert set(counts) == {0, 1}
    share = (p[0] / (p[0] + p[1])).item()
    assert abs(counts[0] / n - share) < 0.02


def test_a_rows_tokens_depend_on_its_own_seed_whatever_the_batch():
    spec = SamplingSpec(temperature=1.0)

    def run(seeds: list[int], greedy_rows: set[int]) -> list[int]:
        reqs = [Request([], sampling=SamplingSpec(temperature=0.0) if i in greedy_rows else spec)
                for i in range(len(seeds))]
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        out = []
        for _ in range(5):  # five steps, each generator drawing as it goes
            toks, _ = sample(LOGITS.repeat(len(seeds), 1), reqs, gens, [False] * len(seeds),
                             torch.ones(len(seeds), 1))
            out.append(toks.tolist())
        return [list(col) for col in zip(*out)]

    alone = run([7], set())[0]
    assert run([3, 7, 9], set())[1] == alone
    assert run([7, 3], {1})[0] == alone  # a greedy row beside it draws nothing from anyone's generator
    assert run([3, 7], {0})[0] == [0] * 5  # greedy: the argmax


def test_finished_rows_take_the_argmax_and_draw_nothing():
    gen = torch.Generator().manual_seed(1)
    state = gen.get_state()
    reqs = [Request([], sampling=SamplingSpec(temperature=1.0))]
    toks, _ = sample(LOGITS[None], reqs, [gen], [True], torch.ones(1, 1))
    assert toks.tolist() == [0] and torch.equal(gen.get_state(), state)
