"""Search tool: BM25 keyword search over a local JSONL corpus ({"id", "title", "text"} per line)."""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections import Counter
from functools import lru_cache

from pydantic import Field, field_validator

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

    def search(self, query: str, k: int = 2) -> list[dict[str, str]]:
        q = _tokens(query)
        scores = []
        for i, tf in enumerate(self.tfs):
            s = sum(self.idf.get(t, 0.0) * tf[t] * 2.5 / (tf[t] + 1.5 * (0.25 + 0.75 * self.lens[i] / self.avg))
                    for t in q if t in tf)
            if s > 0:
                scores.append((s, i))
        return [self.docs[i] for _, i in sorted(scores, key=lambda x: (-x[0], x[1]))[:k]]


@lru_cache(maxsize=8)
def load_corpus(path: str) -> Corpus:
    """The index of a JSONL corpus file, read once per process; a ToolError saying what is wrong with the file."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block, a directory cannot be read
            raise ToolError(f"search corpus {path} is not a regular file")
        with open(path, encoding="utf-8") as f:
            return Corpus([_document(line, path, number) for number, line in enumerate(f, 1) if line.strip()])
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
    corpus: str | None = None
    """JSONL file of {"id", "title", "text"} documents, relative to the working directory (default: the shipped
    knowledge base). It is read when the graph is validated, so a missing or broken file is a spec error."""
    top_k: int = Field(2, ge=1, le=50)
    """Passages returned per query."""

    @field_validator("corpus")
    @classmethod
    def _corpus_loads(cls, path: str | None) -> str | None:
        """Load the corpus now (cached for the run): otherwise every search call of the run fails."""
        if path is not None:
            try:
                load_corpus(path)
            except ToolError as exc:
                raise ValueError(f"{exc}; give a JSONL file of {{\"id\", \"title\", \"text\"}} lines (a "
                                 "relative path is from the working directory), or drop `corpus:` for the shipped "
                                 "knowledge base") from None
        return path


@register_kind("search", "searches the local knowledge base and returns the best matching passages, "
                         "e.g. Input: Ilsa Varn",
               options=SearchOptions)
def make_search(options: SearchOptions):
    path, k = options.corpus or default_corpus_path(), options.top_k

    async def search(query: str) -> str:
        hits = load_corpus(path).search(query, k)
        return "\n".join(f"[{h.get('title', h['id'])}] {h['text']}" for h in hits) or "no results"
    return search
