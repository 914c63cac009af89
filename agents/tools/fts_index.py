"""An on-disk BM25 index of a JSONL corpus, on SQLite's FTS5 (in every CPython's sqlite3: no extra install).

Built once: the index file records the corpus's size, modification time and sha256; a later run whose corpus is
unchanged opens it as it is, and one whose corpus changed rebuilds it. A build writes a temporary file beside the
index and renames it into place, so a build killed halfway leaves the old index (or none), never a broken one.
Ranking is FTS5's `bm25()` (k1 = 1.2, b = 0.75) over title and text; ties go to the earlier document.
"""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from masgraph.agents.tools.registry import ToolError

__all__ = ["FtsIndex", "open_index"]

SCHEMA = 1
"""Bumped when the table layout changes (an index of another schema is rebuilt)."""


def _fingerprint(corpus: Path) -> dict[str, str]:
    st = corpus.stat()
    digest = hashlib.sha256()
    with open(corpus, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"schema": str(SCHEMA), "size": str(st.st_size), "mtime_ns": str(st.st_mtime_ns),
            "sha256": digest.hexdigest()}


def _match(query: str) -> str | None:
    """The FTS5 query for free text: each word quoted (no operator of the user's text is interpreted), any may match."""
    words = re.findall(r"\w+", query.lower())
    return " OR ".join(f'"{w}"' for w in dict.fromkeys(words)) if words else None


class FtsIndex:
    """A built index, opened read-only; `search` returns the top-k documents of a query."""

    def __init__(self, path: Path):
        self.path = path
        self._db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)

    def __len__(self) -> int:
        return self._db.execute("SELECT count(*) FROM docs").fetchone()[0]

    def search(self, query: str, k: int = 2, min_ratio: float | None = None) -> list[dict[str, str]]:
        """The best `k` documents for `query` by BM25; with `min_ratio`, only those scoring at least that fraction
        of the best one's score."""
        match = _match(query)
        if match is None:
            return []
        rows = self._db.execute("SELECT doc_id, title, text, -bm25(docs) FROM docs WHERE docs MATCH ? "
                                "ORDER BY bm25(docs), rowid LIMIT ?", (match, k)).fetchall()
        if min_ratio is not None and rows:
            rows = [r for r in rows if r[3] >= min_ratio * rows[0][3]]
        return [{"id": i, "title": t, "text": x} for i, t, x, _ in rows]

    def close(self) -> None:
        self._db.close()


def build(corpus: Path, path: Path, docs: Iterable[dict[str, str]], fingerprint: dict[str, str]) -> None:
    """Write the index of `docs` to `path` (atomically: a temporary file renamed into place)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.building")
    tmp.unlink(missing_ok=True)
    try:
        db = sqlite3.connect(tmp)
        with db:
            db.execute("CREATE VIRTUAL TABLE docs USING fts5(doc_id UNINDEXED, title, text, "
                       "tokenize = 'unicode61 remove_diacritics 2')")
            db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
            db.executemany("INSERT INTO docs (doc_id, title, text) VALUES (?, ?, ?)",
                           ((d.get("id", d.get("title", "")), d.get("title", ""), d["text"]) for d in docs))
            db.executemany("INSERT INTO meta VALUES (?, ?)", [*fingerprint.items(), ("corpus", str(corpus))])
            db.execute("INSERT INTO docs(docs) VALUES ('optimize')")
        db.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _built_for(path: Path, fingerprint: dict[str, str]) -> bool:
    """Whether `path` is an index of this corpus as it is now."""
    if not path.is_file():
        return False
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        finally:
            db.close()
    except sqlite3.Error:
        return False  # not an index (or a foreign file): rebuilt
    return all(meta.get(k) == v for k, v in fingerprint.items())


def open_index(corpus: str, index: str, read_docs) -> FtsIndex:
    """The index at `index` of the JSONL `corpus`, built first when it is missing or the corpus changed.
    `read_docs(path)` parses the corpus (the search tool's checked reader)."""
    src, path = Path(corpus), Path(index)
    try:
        fingerprint = _fingerprint(src)
        if not _built_for(path, fingerprint):
            path.parent.mkdir(parents=True, exist_ok=True)
            build(src, path, read_docs(corpus), fingerprint)
        return FtsIndex(path)
    except OSError as exc:
        raise ToolError(f"cannot build or open the search index {index} of {corpus}: {exc.strerror or exc}") from None
    except sqlite3.Error as exc:
        raise ToolError(f"search index {index}: {exc}; delete it to rebuild") from None
