"""How a logprob pass lays out its rows so no token is computed twice: merged turns and shared prompts.

Rows of one adapter repeat each other's tokens in two ways. A node's next turn often extends its previous call's
prompt + completion token for token (a conversation, a tool loop): that call's completion is already inside the
next row's sequence, and causal attention gives it the same log-probs there (prime-rl's merged trajectories). And
the G samples of one question share their whole prompt, computed once per group instead of once per sample.

`plan_rows` is pure token-id arithmetic (no tensors); the hf learner runs the plan (`backends/hf/learner.py`) and
the trainer reports its counts (`PackPlan.stats`). Loss and advantages stay per row: only the computing is shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from masgraph.backends.base import TokenRow


@dataclass(frozen=True)
class PackPlan:
    """Which sequences a pass computes and where each row's completion sits in them.

    A pass computes `hosts` (row indices whose whole prompt + completion is run); every row's completion lies in its
    host's sequence (`host_of`). The host sequences share `prefix` leading tokens (their KV computed once), then a
    middle segment `[prefix, start)` shared by the hosts of one `group` (their KV computed once per group), then the
    host's own tail `[start, end)`, which holds every position the host's rows are scored at."""

    hosts: list[int]
    host_of: list[int]
    """Per row: the position in `hosts` of the row whose sequence contains it."""
    prefix: int
    start: list[int]
    """Per host: where its own tail begins (its shared middle segment ends)."""
    group: list[int]
    """Per host: its middle segment's index among the distinct ones (all 0 when there is no middle pass)."""
    groups: int
    """Distinct middle segments (0: no middle pass; the tails start right after the prefix)."""

    def positions(self, rows: Sequence[TokenRow]) -> int:
        """Positions a host's tail pass lays out: the prefix and left-padded middles, then the left-padded tails."""
        seqs = [len(rows[h].prompt_ids) + len(rows[h].completion_ids) for h in self.hosts]
        return max(self.start) + max(n - s for n, s in zip(seqs, self.start))

    def stats(self, rows: Sequence[TokenRow]) -> dict[str, int]:
        """Rows, sequences computed, and tokens received vs computed by this plan (prefix once, middles once per
        group, tails once per host)."""
        seqs = [len(rows[h].prompt_ids) + len(rows[h].completion_ids) for h in self.hosts]
        middles = {g: s - self.prefix for g, s in zip(self.group, self.start)} if self.groups else {}
        computed = self.prefix + sum(middles.values()) + sum(n - s for n, s in zip(seqs, self.start))
        received = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
        return {"rows": len(rows), "sequences": len(self.hosts), "tokens_received": received,
                "tokens_computed": computed}


def merge_hosts(seqs: Sequence[Sequence[int]]) -> list[int]:
    """Per sequence, the index of the longest sequence it is a token prefix of (itself when none is longer; among
    identical sequences the first). Transitive: a host is its own host."""
    order = sorted(range(len(seqs)), key=lambda i: (-len(seqs[i]), i))
    host = list(range(len(seqs)))
    for rank, i in enumerate(order):
        n = len(seqs[i])
        for j in order[:rank]:  # longer (or equal and earlier) sequences first: the first match is the longest
            if seqs[j][:n] == seqs[i]:
                host[i] = host[j]
                break
    return host


def common_prefix(seqs: Sequence[Sequence[int]], limit: int) -> int:
    """Length of the longest prefix common to all `seqs`, at most `limit`."""
    n = min([limit, *map(len, seqs)])
    first = seqs[0]
    for s in seqs[1:]:
        k = 0
        while k < n and s[k] == first[k]:
            k += 1
        n = k
    return max(n, 0)


def share_middles(middles: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Cluster the hosts' middle segments so each cluster's common prefix is computed once: per host its cluster and
    the length of that cluster's shared prefix. In sorted order a host joins the current cluster while that does not
    lower what the cluster saves ((members - 1) x shared length); a lone host's middle is its own whole segment."""
    order = sorted(range(len(middles)), key=lambda i: middles[i])
    clusters: list[tuple[list[int], int]] = []  # (members, their shared prefix length)
    for i in order:
        if clusters:
            members, lcp = clusters[-1]
            joined = common_prefix([middles[members[-1]], middles[i]], lcp)
            if joined >= 1 and len(members) * joined >= (len(members) - 1) * lcp:
                members.append(i)
                clusters[-1] = (members, joined)
                continue
        clusters.append(([i], len(middles[i])))
    cluster, shared = [0] * len(middles), [0] * len(middles)
    for c, (members, lcp) in enumerate(clusters):
        for m in members:
            cluster[m], shared[m] = c, lcp
    return cluster, shared


def plan_rows(rows: Sequence[TokenRow], share: bool = True, pack: bool = True, known: int = 0) -> PackPlan:
    """The layout of one logprob pass over `rows` (of one adapter). `share` computes the prefix common to all rows
    once (off when gradient checkpointing, which cannot recompute a cache); `pack` (off: that prefix alone, the layout
    before packing) also folds a row whose prompt + completion is a prefix of another row's sequence into that row,
    and computes the prompt prefix each cluster of rows shares beyond it once (`share_middles`). `known`: leading
    tokens every row shares whose KV is at hand (an earlier pass's, `hf/prefixes.py`): with `share`, the prefix is at
    least that long (up to a token before the first scored position), one host alone too."""
    seqs = [list(r.prompt_ids) + list(r.completion_ids) for r in rows]
    hosted = merge_hosts(seqs) if pack else list(range(len(rows)))
    hosts = sorted(set(hosted))
    slot = {h: k for k, h in enumerate(hosts)}
    host_of = [slot[h] for h in hosted]
    # a host's scored positions begin at the last prompt token of the earliest row it holds
    first = [len(seqs[h]) for h in hosts]
    for i, r in enumerate(rows):
        first[host_of[i]] = min(first[host_of[i]], len(r.prompt_ids) - 1)
    host_seqs = [seqs[h] for h in hosts]
    if not share or len(hosts) < 2:
        at = max(0, min(known, min(first) - 1)) if share else 0
        return PackPlan(hosts, host_of, at, [at] * len(hosts), [0] * len(hosts), 0)
    # the common prefix stops a token short of every scored position, so each middle segment holds a token or more
    prefix = common_prefix(host_seqs, min(first) - 1)
    if not pack or min(first) - prefix < 1:
        return PackPlan(hosts, host_of, prefix, [prefix] * len(hosts), [0] * len(hosts), 0)
    cluster, shared = share_middles([s[prefix:b] for s, b in zip(host_seqs, first)])
    groups = max(cluster) + 1
    if groups == len(hosts):  # nothing shared beyond the prefix: one pass, as before packing
        return PackPlan(hosts, host_of, prefix, [prefix] * len(hosts), [0] * len(hosts), 0)
    return PackPlan(hosts, host_of, prefix, [prefix + n for n in shared], cluster, groups)
