"""ConversationStores: fact stores that outlive an episode, one per (memory node, conversation) (Memory-R1's deployed
setting: a manager curates one memory across the turns of a dialogue, and each turn's reader answers from it).

A memory node with `scope: conversation` opens its episode's conversation (`meta["conversation"]`, e.g. the
`masgraph.conversation` field of a request to `masgraph serve`), applies the episode's new facts to the store the
conversation's earlier episodes left, and reads it. The memory steps of one conversation take turns (a lock per
store, waited for outside the node's work clock, as an LLM call's queue is), so two concurrent requests never
interleave their operations. A step edits a copy, which replaces the stored one when the step finishes (written
to disk first, when there is a directory): a memory step that fails, times out or is cancelled leaves the store as
it found it. What is kept is the memory step's work: a later node of the same episode that fails does not undo it
(a client that retries such a request adds its facts again; a trained manager may NOOP them). With a directory,
every committed store is a JSON file there (written atomically), so a restarted server continues each
conversation where it stopped; without one they live in memory, the least recently used dropped (with a warning)
beyond `max_open`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path

from masgraph.errors import MasgraphError
from masgraph.files import atomic_write
from masgraph.memory.store import FactStore

__all__ = ["ConversationStores"]

log = logging.getLogger(__name__)


class ConversationStores:
    """(memory node, conversation id) -> its FactStore.

    Example:
        >>> stores = ConversationStores()
        >>> async def turn(fact):
        ...     async with stores.open("memory", "c1") as store:
        ...         store.entries[store.next_id] = fact
        ...         store.next_id += 1
        >>> asyncio.run(turn("Kalo Mira lives in Rafeport."))
        >>> stores.peek("memory", "c1").render()
        '[1] Kalo Mira lives in Rafeport.'
    """

    def __init__(self, directory: str | Path | None = None, max_open: int = 1024):
        if max_open < 1:
            raise MasgraphError(f"max_open must be at least 1 (got {max_open})")
        self.directory = Path(directory) if directory is not None else None
        self.max_open = max_open
        self._open: OrderedDict[tuple[str, str], FactStore] = OrderedDict()  # least recently used first
        self._locks: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}  # the lock, and its holder + waiters
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise MasgraphError(f"cannot use {self.directory} for conversation memories: {exc}") from None

    @contextlib.asynccontextmanager
    async def open(self, node: str, conversation: str,
                   waiting: contextlib.AbstractContextManager[object] | None = None) -> AsyncIterator[FactStore]:
        """Node `node`'s store of `conversation`, to edit (a copy: committed when the block exits without an
        exception); waits, inside `waiting` (e.g. a node context's `waiting()`), while another step holds it."""
        key = _key(node, conversation)
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            with waiting or contextlib.nullcontext():
                await lock.acquire()
            try:
                start = self.peek(node, conversation)
                work = FactStore(dict(start.entries), start.next_id)
                yield work
                self._commit(key, work)
            finally:
                lock.release()
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    def peek(self, node: str, conversation: str) -> FactStore:
        """Node `node`'s committed store of `conversation` (empty when it has none); not a copy: do not edit it."""
        key = _key(node, conversation)
        if key in self._open:
            self._open.move_to_end(key)
            return self._open[key]
        store = self._load(key) or FactStore()
        self._remember(key, store)
        return store

    def path(self, node: str, conversation: str) -> Path | None:
        """Where the store is written (None without a directory): a hash of node and id, so any id is a safe file
        name."""
        if self.directory is None:
            return None
        digest = hashlib.sha256(f"{node}\0{conversation}".encode("utf-8", "surrogatepass")).hexdigest()
        return self.directory / f"{digest[:32]}.json"

    def _commit(self, key: tuple[str, str], store: FactStore) -> None:
        path = self.path(*key)
        if path is not None:  # disk first: a failed write leaves memory as it was, so the two never disagree
            body = {"node": key[0], "conversation": key[1], "next_id": store.next_id,
                    "entries": [[n, text] for n, text in sorted(store.entries.items())]}
            atomic_write(path, json.dumps(body))  # ASCII: any id (lone surrogates too) as \u escapes
        self._remember(key, store)

    def _remember(self, key: tuple[str, str], store: FactStore) -> None:
        self._open[key] = store
        self._open.move_to_end(key)
        while len(self._open) > self.max_open:
            (node, conversation), _ = self._open.popitem(last=False)
            if self.directory is None:
                log.warning("conversation memory of %r (node %r) dropped: more than %d conversations are open and "
                            "nothing keeps them on disk (masgraph serve --conversations DIR does)", conversation,
                            node, self.max_open)

    def _load(self, key: tuple[str, str]) -> FactStore | None:
        path = self.path(*key)
        if path is None or not path.exists():
            return None
        try:
            body = json.loads(path.read_text())
            if not isinstance(body, dict):
                raise ValueError(f"it holds a JSON {type(body).__name__}, not an object")
            if [body.get("node"), body.get("conversation")] != list(key):
                raise ValueError(f"it holds node {body.get('node')!r}, conversation {body.get('conversation')!r}")
            entries = {int(n): str(text) for n, text in body["entries"]}
            next_id = int(body["next_id"])
            if entries and next_id <= max(entries):
                raise ValueError(f"next_id {next_id} would reuse entry {max(entries)}")
            return FactStore(entries, next_id)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise MasgraphError(f"conversation memory {path} is unreadable ({exc}); move it away to start that "
                                "conversation afresh") from None


def _key(node: str, conversation: str) -> tuple[str, str]:
    if not isinstance(conversation, str) or not conversation:
        raise MasgraphError(f"a conversation id is a non-empty string (got {conversation!r})")
    return node, conversation
