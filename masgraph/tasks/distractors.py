"""Distractor documents in the knowledge base's style, to try retrieval at a realistic size: the shipped KB hidden
among thousands of other people, places and notes whose names share syllables (and often a word) with the real
ones, so ranking has to work. Used by the search-index tests and benchmarks/search_index.py."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

__all__ = ["distractors", "write_corpus"]

_SYLLABLES = ["ka", "lo", "mi", "ra", "ten", "vor", "sa", "dul", "quen", "ix", "bra", "nol", "fe", "zan", "tor", "wy"]


def distractors(n: int, names: set[str], seed: int = 1) -> list[dict[str, str]]:
    """`n` documents `{"id", "title", "text"}` about made-up people, villages and notes, none titled by a name in
    `names` (deterministic for a seed)."""
    rng = random.Random(seed)

    def word(k: int) -> str:
        return "".join(rng.choice(_SYLLABLES) for _ in range(k)).capitalize()

    out: list[dict[str, str]] = []
    while len(out) < n:
        name = f"{word(2)} {word(3)}" if rng.random() < 0.5 else f"{word(3)} {word(2)}"
        if name in names:
            continue
        kind, job = rng.choice(["person", "note", "place"]), rng.choice(["singer", "cook", "sailor", "clerk"])
        text = {"person": f"{name} is a {job} who lives in {word(2)}port.",
                "note": f"A note about {name}: the harvest in {word(2)}ville was late this year.",
                "place": f"{name} is a village near the river {word(2)}."}[kind]
        out.append({"id": f"x-{len(out)}", "title": name, "text": text})
    return out


def write_corpus(path: str | Path, docs: list[dict[str, Any]], n_distractors: int, seed: int = 1) -> Path:
    """`docs` and `n_distractors` distractors, shuffled, as a JSONL corpus at `path` (the search tool's format)."""
    mixed = [{k: d[k] for k in ("id", "title", "text") if k in d} for d in docs]
    mixed += distractors(n_distractors, {d.get("title", "") for d in docs}, seed)
    random.Random(seed + 1).shuffle(mixed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(d) + "\n" for d in mixed))
    return path
