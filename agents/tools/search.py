"""Search tool: BM25 keyword search over a local JSONL corpus ({"id", "title", "text"} per line): in memory by
default, or through an on-disk index (`index:`, SQLite FTS5, built once: agents/tools/fts_index.py)."""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections import Counter
from functools import lru_cache

from pydantic import Field, ValidationInfo, field_validator

from masgraph.agents.tools.fts_index import FtsIndex, open_index
from masgraph.agents.tools.registry import ToolError, ToolOptions, register_kind


def _tokens(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


class Corpus:
    """An in-memory BM25 index (k1=1.5, b=0.75) over a list of documents."""

    def __init__(self, docs: list[dict[str, str]]):
        self.docs = docs
        self.tfs = [Counter(_tokens(d.get("title", "") + " " + d["text"])) for d in docs]
        self.lens = [sum(tf.values()) for tf in self.tfs]
        self.avg = sum(self.lens) / max(len(docs), 1)
        df = Counter(t for tf in self.tfs for t in tf)
        n = len(docs)
        self.idf = {t: math.log(1 + (n - c + 0.5) / (c + 0.5)) for t, c in df.items()}

    def search(self, query: str, k: int = 2, min_ratio: float | None = None) -> list[dict[str, str]]:
        """The best `k` documents for `query`; with `min_ratio`, only those scoring at least that fraction of the
        best one's score."""
        q = _tokens(query)
        scores = []
        for i, tf in enumerate(self.tfs):
            s = sum(self.idf.get(t, 0.0) * tf[t] * 2.5 / (tf[t] + 1.5 * (0.25 + 0.75 * self.lens[i] / self.avg))
                    for t in q if t in tf)
            if s > 0:
                scores.append((s, i))
        best = sorted(scores, key=lambda x: (-x[0], x[1]))[:k]
        if min_ratio is not None and best:
            best = [(s, i) for s, i in best if s >= min_ratio * best[0][0]]
        return [self.docs[i] for _, i in best]


@lru_cache(maxsize=8)
def load_corpus(path: str) -> Corpus:
    """The in-memory index of a JSONL corpus file, read once per process; a ToolError saying what is wrong."""
    return Corpus(read_documents(path))


@lru_cache(maxsize=8)
def load_index(path: str, index: str) -> FtsIndex:
    """The on-disk index `index` of the corpus `path`, built when missing or stale, opened once per process."""
    return open_index(path, index, read_documents)


def read_documents(path: str) -> list[dict[str, str]]:
    """The documents of a JSONL corpus file; a ToolError saying what is wrong with the file."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block, a directory cannot be read
            raise ToolError(f"search corpus {path} is not a regular file")
        with open(path, encoding="utf-8") as f:
            return [_document(line, path, number) for number, line in enumerate(f, 1) if line.strip()]
    except OSError as exc:
        raise ToolError(f"cannot read search corpus {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ToolError(f"search corpus {path} is not UTF-8 text") from None


def _document(line: str, path: str, number: int) -> dict[str, str]:
    """One corpus line: a JSON object with a string `text` and a string `id` or `title` (what a hit shows)."""
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ToolError(f"search corpus {path} line {number} is not JSON ({exc.msg})") from None
    if not (isinstance(doc, dict) and isinstance(doc.get("text"), str)
            and any(isinstance(doc.get(k), str) for k in ("id", "title"))):
        raise ToolError(f'search corpus {path} line {number} is not an object with a string "text" and a '
                        'string "id" or "title"')
    return doc


def default_corpus_path() -> str:
    from importlib.resources import files
    return str(files("masgraph.data") / "kb.jsonl")


class SearchOptions(ToolOptions):
    index: str | None = None
    """An on-disk BM25 index of the corpus (SQLite FTS5) at this path, built once and rebuilt only when the corpus
    changes: for large collections (no full read per process, no in-memory index). None: the corpus is indexed in
    memory."""
    corpus: str | None = Field(None, validate_default=True)
    """JSONL file of {"id", "title", "text"} documents, relative to the working directory (default: the shipped
    knowledge base). It is read when the graph is validated, so a missing or broken file is a spec error."""
    top_k: int = Field(2, ge=1, le=50)
    """Passages returned per query."""
    snippet_chars: int | None = Field(None, ge=20, le=100_000)
    """Cut each passage's text to this many characters (None: whole)."""
    min_score_ratio: float | None = Field(None, gt=0, le=1)
    """Return a passage only when its BM25 score is at least this fraction of the best passage's (e.g. 0.5): in a
    large collection, near-misses that share one word of the query stay out of the answer's context. None: the
    best `top_k`, whatever their scores."""

    @field_validator("corpus")
    @classmethod
    def _corpus_loads(cls, path: str | None, info: ValidationInfo) -> str | None:
        """Load the corpus now (cached for the run; through its on-disk index, built now if needed, when `index:`
        names one): otherwise every search call of the run fails."""
        index = info.data.get("index")
        if path is not None or index is not None:
            try:
                load_index(path or default_corpus_path(), index) if index is not None else load_corpus(path)
            except ToolError as exc:
                raise ValueError(f"{exc}; give a JSONL file of {{\"id\", \"title\", \"text\"}} lines (a "
                                 "relative path is from the working directory), or drop `corpus:` for the shipped "
                                 "knowledge base") from None
        return path


@register_kind("search", "searches the local knowledge base and returns the best matching passages, "
                         "e.g. Input: Ilsa Varn",
               options=SearchOptions)
def make_search(options: SearchOptions):
    path, k, cut, index = options.corpus or default_corpus_path(), options.top_k, options.snippet_chars, options.index
    ratio = options.min_score_ratio

    async def search(query: str) -> str:
        hits = (load_index(path, index) if index else load_corpus(path)).search(query, k, ratio)
        return "\n".join(f"[{h.get('title') or h['id']}] {_cut(h['text'], cut)}" for h in hits) or "no results"
    return search


def _cut(text: str, chars: int | None) -> str:
    return text if chars is None or len(text) <= chars else text[:chars].rstrip() + "…"
