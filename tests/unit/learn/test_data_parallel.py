"""Data-parallel Flow-GRPO (`masgraph.learn.data_parallel`): the token split is a pure function of the rows' lengths.
The multi-process checks (2 gloo ranks = 1 process, a killed or hung rank, `masgraph train --learners 2`) are in
tests/integration/test_data_parallel_ranks.py (minutes here, so in the slow tier)."""

from __future__ import annotations

from masgraph.learn.data_parallel import token_shards


def test_the_split_balances_tokens_and_depends_on_the_lengths_alone():
    lengths = [12, 3, 10, 9, 8]
    assert token_shards(lengths, 2) == [[0, 4], [1, 2, 3]]  # 20 and 22 tokens, longest first
    assert token_shards(lengths, 2) == token_shards(list(lengths), 2)
    assert token_shards([5], 3) == [[0], [], []]  # a rank may get no row (it still joins every collective)
    assert sorted(i for s in token_shards(lengths, 3) for i in s) == list(range(5))
    even = [7, 7, 7, 7, 1, 1]
    assert [sum(even[i] for i in s) for s in token_shards(even, 2)] == [15, 15]
