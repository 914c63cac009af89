"""Incremental decoding of a batch of rows that share a cached prompt prefix: token ids, logprobs, finish reason."""

from __future__ import annotations

from typing import Any

import torch

from masgraph.backends.base import Request
from masgraph.backends.hf_layout import left_pad


def decode(model: Any, cache: Any, prefix_len: int, suffixes: list[list[int]], requests: list[Request],
           generators: list[torch.Generator], pad_id: int, eos_ids: set[int]
           ) -> list[tuple[list[int], list[float], str]]:
    """Decode each row's completion after its prompt, `cache` holding the KV of the shared prefix (already
    broadcast to the batch) or being empty; each row samples from its own generator and stops at EOS or at its
    `max_tokens`. Returns (completion ids, their logprobs, "stop" | "length") per row."""
    B = len(suffixes)
    ids, mask, pos = left_pad(prefix_len, suffixes, pad_id)
    limits = [r.sampling.max_tokens for r in requests]
    out_ids: list[list[int]] = [[] for _ in range(B)]
    out_lp: list[list[float]] = [[] for _ in range(B)]
    done, finish = [False] * B, ["length"] * B
    for _ in range(max(limits)):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1, :]  # (B, V)
        picked = sample(logits.float(), requests, generators, done)
        for i, pick in enumerate(picked):
            if pick is None:
                continue
            out_ids[i].append(pick[0])
            out_lp[i].append(pick[1])
            if pick[0] in eos_ids:
                done[i], finish[i] = True, "stop"
            elif len(out_ids[i]) >= limits[i]:
                done[i] = True
        if all(done):
            break
        ids = torch.tensor([[p[0] if p else pad_id] for p in picked])  # (B, 1)
        mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long)], dim=1)
        pos = pos[:, -1:] + 1
    return list(zip(out_ids, out_lp, finish))


def sample(logits: torch.Tensor, requests: list[Request], generators: list[torch.Generator],
           done: list[bool]) -> list[tuple[int, float] | None]:
    """Pick one token per live row; logprob under the temperature-scaled distribution (raw if greedy)."""
    temps = torch.tensor([r.sampling.temperature or 1.0 for r in requests])[:, None]
    logp = torch.log_softmax(logits / temps, -1)  # (B, V)
    toks = torch.argmax(logits, -1).tolist()
    for i, r in enumerate(requests):
        if done[i] or r.sampling.temperature == 0:
            continue
        probs = logp[i].exp()
        if r.sampling.top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            keep = (sp.cumsum(0) - sp) < r.sampling.top_p
            probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
        toks[i] = int(torch.multinomial(probs, 1, generator=generators[i]))
    picked = logp.gather(1, torch.tensor(toks)[:, None])[:, 0].tolist()
    return [None if done[i] else (toks[i], picked[i]) for i in range(len(requests))]
