"""FactStore: an episode's memory of entries that a memory manager edits with operations (Memory-R1, arXiv 2508.19828).

A manager reads one new fact at a time, sees the entries so far, and answers with one operation:

    ADD [: text]         keep the fact (or `text`) as a new entry
    UPDATE [n] [: text]  entry n is out of date: replace it by the fact (or `text`)
    DELETE [n]           entry n is no longer true: remove it
    NOOP                 nothing worth keeping

Without a number, UPDATE and DELETE act on the entry that shares the most words with the fact (the newest of
equals): a small model picks the operation far more reliably than it copies an entry's number.
The runtime applies it (`FactStore.apply`) and later nodes read `render()`. An output that does not parse, or that
names an entry that does not exist, falls back to ADD (the append-only log's behaviour: a fact is never lost to a
format slip) and the operation carries the error, so the step counts a parse failure. The two rule-based managers,
`append` (every fact added) and `last_k` (every fact added, only the last k kept), are the baselines a trained
manager must beat.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from masgraph.trace import MemoryOp

__all__ = ["FactStore", "parse_op"]

_OP = re.compile(r"^\s*(?:operation\s*:\s*)?(ADD|UPDATE|DELETE|NOOP)\b[ \t]*\[?(\d+)?\]?[ \t]*(?::[ \t]*(.*\S))?",
                 re.I)


def parse_op(output: str, fact: str) -> MemoryOp:
    """The operation in a manager's output (its first line), with `fact` as the entry text unless it wrote one.
    Raises ValueError (a located message) when there is none."""
    first = next((line for line in output.splitlines() if line.strip()), "")
    m = _OP.match(first)
    if m is None:
        raise ValueError(f"no operation (ADD, UPDATE [n], DELETE [n], NOOP) in {first[:80]!r}")
    op, target, text = m.group(1).upper(), m.group(2), m.group(3)
    return MemoryOp(fact=fact, op=op, target=int(target) if target and op in ("UPDATE", "DELETE") else None,
                    text=None if op in ("DELETE", "NOOP") else (text or fact), output=output)


@dataclass
class FactStore:
    """Numbered entries (numbers are never reused, so an operation names one entry for the whole episode).

    Example:
        >>> s = FactStore()
        >>> s.apply(parse_op("ADD", "Kalo Mira lives in Rafeport.")).op
        'ADD'
        >>> s.apply(parse_op("Operation: UPDATE 1", "Kalo Mira moved to Sadport.")).op
        'UPDATE'
        >>> print(s.render())
        [1] Kalo Mira moved to Sadport.
    """

    entries: dict[int, str] = field(default_factory=dict)
    next_id: int = 1

    def apply(self, op: MemoryOp) -> MemoryOp:
        """Apply `op` and return what was applied (with its entry number): an UPDATE / DELETE without a number acts on
        the entry most like the fact; one of a missing entry (or of an empty store) becomes an ADD of the fact, with
        the error recorded on it."""
        if op.op in ("UPDATE", "DELETE") and op.target is None:
            op = op.model_copy(update={"target": self.closest(op.fact)})
        if op.op in ("UPDATE", "DELETE") and op.target not in self.entries:
            missing = f"no entry {op.target}" if op.target is not None else "the memory is empty"
            op = op.model_copy(update={"op": "ADD", "target": None, "text": op.fact,
                                       "error": f"{op.op}: {missing} (the fact was added)"})
        if op.op == "ADD":
            op = op.model_copy(update={"target": self.next_id})
            self.entries[self.next_id] = op.text or op.fact
            self.next_id += 1
        elif op.op == "UPDATE":
            self.entries[op.target] = op.text or op.fact
        elif op.op == "DELETE":
            del self.entries[op.target]
        return op

    def closest(self, fact: str) -> int | None:
        """The entry sharing the most words with `fact` (the newest of equals; any entry when none shares a word)."""
        words = _words(fact)
        return max(self.entries, key=lambda n: (len(words & _words(self.entries[n])), n), default=None)

    def trim(self, keep: int) -> None:
        """Keep only the `keep` newest entries (the keep-last-k baseline)."""
        for k in sorted(self.entries)[:-keep] if len(self.entries) > keep else []:
            del self.entries[k]

    def recall(self, question: str, k: int) -> FactStore:
        """The `k` entries that share the most words with `question` (words of 3+ letters, any case; ties: the newer
        entry), none sharing no word: what a reader is shown of a large store (Memory-R1's answer agent reads
        retrieved entries). Numbers are kept."""
        words = _words(question)
        scored = [(len(words & _words(text)), n) for n, text in self.entries.items()]
        top = sorted(((s, n) for s, n in scored if s > 0), reverse=True)[:k]
        return FactStore({n: self.entries[n] for _, n in sorted(top, key=lambda t: t[1])}, self.next_id)

    def render(self) -> str:
        """The entries as the prompt shows them: `[n] text`, one per line (`(empty)` when none)."""
        return "\n".join(f"[{k}] {v}" for k, v in sorted(self.entries.items())) or "(empty)"


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) >= 3}
