"""The search tool over a user's own collection: an on-disk BM25 index (SQLite FTS5) of a JSONL corpus, built
once, rebuilt when the corpus changes, never left half-written; on the shipped knowledge base hidden among 10,000
distractors it finds what the in-memory search finds on the knowledge base alone."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from masgraph.agents.tools import fts_index
from masgraph.agents.tools.registry import ToolError
from masgraph.agents.tools.search import SearchOptions, load_corpus, load_index, make_search
from masgraph.tasks import load_kb
from masgraph.tasks.distractors import write_corpus


@pytest.fixture(autouse=True)
def _fresh_caches():
    load_index.cache_clear()
    yield
    load_index.cache_clear()


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "docs.jsonl", load_kb()["docs"], 10_000)


def test_the_index_finds_every_kb_person_among_10k_distractors_as_the_kb_search_does(big_corpus, tmp_path):
    from masgraph.agents.tools.search import default_corpus_path

    opts = SearchOptions(corpus=str(big_corpus), index=str(tmp_path / "docs.fts"), top_k=1)
    index = load_index(opts.corpus, opts.index)
    assert len(index) == 10_000 + len(load_kb()["docs"])
    kb = load_corpus(default_corpus_path())  # today's search: the knowledge base alone, in memory
    people = load_kb()["people"]
    for p in people:
        for query in (p["name"], f"In which city does {p['name']} live?"):
            [hit] = index.search(query, 1)
            assert hit["title"] == kb.search(query, 1)[0]["title"] == p["name"], query


def test_built_once_rebuilt_when_the_corpus_changes(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "a", "title": "Alpha", "text": "alpha is first"}) + "\n")
    where = tmp_path / "sub" / "c.fts"
    assert load_index(str(corpus), str(where)).search("first", 2)[0]["id"] == "a"
    stamp = where.stat().st_mtime_ns
    load_index.cache_clear()
    load_index(str(corpus), str(where))  # unchanged corpus: opened as it is
    assert where.stat().st_mtime_ns == stamp
    with open(corpus, "a") as f:
        f.write(json.dumps({"id": "b", "title": "Beta", "text": "beta comes second"}) + "\n")
    load_index.cache_clear()
    assert load_index(str(corpus), str(where)).search("second", 2)[0]["id"] == "b"  # rebuilt
    assert where.stat().st_mtime_ns != stamp and sorted(p.name for p in where.parent.iterdir()) == ["c.fts"]


def test_a_build_that_fails_halfway_leaves_the_old_index(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "a", "title": "Alpha", "text": "alpha"}) + "\n")
    where = tmp_path / "c.fts"
    load_index(str(corpus), str(where))

    def broken(docs):
        yield from docs
        raise KeyboardInterrupt  # Ctrl-C in the middle of writing

    with pytest.raises(KeyboardInterrupt):
        fts_index.build(corpus, where, broken([{"id": "z", "title": "Z", "text": "zulu"}] * 50), {"schema": "x"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.fts", "c.jsonl"]  # no temporary file left
    load_index.cache_clear()
    assert load_index(str(corpus), str(where)).search("alpha", 1)[0]["id"] == "a"


def test_a_foreign_file_at_the_index_path_is_rebuilt_and_hostile_queries_are_text(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "a", "title": "Near", "text": 'the word NEAR and "quotes" OR stars*'}) + "\n")
    where = tmp_path / "c.fts"
    where.write_text("not a database")
    index = load_index(str(corpus), str(where))
    for query in ['NEAR("x" OR', '"', "*", "title:near", "a AND OR NOT", "", "   ", "\x00"]:
        index.search(query, 3)  # FTS5 syntax in a query is never interpreted: no error
    assert index.search('NEAR(quotes', 1)[0]["id"] == "a" and index.search("!!!", 1) == []


def test_the_tool_cuts_snippets_and_reports_a_bad_corpus_at_validation(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "a", "title": "Long", "text": "word " * 100}) + "\n")
    tool = make_search(SearchOptions(corpus=str(corpus), index=str(tmp_path / "i.fts"), snippet_chars=30))
    out = asyncio.run(tool("word"))
    assert out.startswith("[Long] word") and out.endswith("…") and len(out) < 50
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        SearchOptions(corpus=str(tmp_path / "bad.jsonl"), index=str(tmp_path / "b.fts"))
    with pytest.raises(ToolError, match="cannot build or open the search index"):
        fts_index.open_index(str(corpus), str(tmp_path / "c.jsonl" / "x.fts"), lambda p: [])


@pytest.mark.parametrize("where", ["memory", "index"])
def test_min_score_ratio_keeps_near_misses_out(tmp_path, where):
    """A query for a full name also matches a document sharing one of its words: returned by plain top-k, dropped
    when it scores under the ratio of the best passage (in memory and through the index alike)."""
    corpus = tmp_path / "c.jsonl"
    docs = [{"id": "a", "title": "Brabra Fera", "text": "Brabra Fera is a weaver who lives in Milomere."},
            {"id": "b", "title": "Fera Wyquenten", "text": "Fera Wyquenten is a singer who lives in Fezanport."},
            {"id": "c", "title": "Other", "text": "Nothing to see."}]
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    opts = {"corpus": str(corpus), "top_k": 2} | ({"index": str(tmp_path / "c.fts")} if where == "index" else {})
    plain = asyncio.run(make_search(SearchOptions(**opts))("Brabra Fera"))
    assert [line.split("]")[0] for line in plain.splitlines()] == ["[Brabra Fera", "[Fera Wyquenten"]
    cut = asyncio.run(make_search(SearchOptions(**opts, min_score_ratio=0.5))("Brabra Fera"))
    assert cut == "[Brabra Fera] Brabra Fera is a weaver who lives in Milomere."
    both = asyncio.run(make_search(SearchOptions(**opts, min_score_ratio=0.5))("Fera"))
    assert len(both.splitlines()) == 2  # equally good matches both stay
