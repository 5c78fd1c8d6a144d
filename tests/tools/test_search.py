"""The BM25 search tool on a tiny corpus."""

from __future__ import annotations

import asyncio

from agentrl.tools import Document, SearchTool

CORPUS = [
    Document(title="Paris", text="Paris is the capital and largest city of France.", id="paris"),
    Document(title="Berlin", text="Berlin is the capital of Germany.", id="berlin"),
    Document(
        title="Python",
        text="Python is a programming language created by Guido van Rossum.",
        id="py",
    ),
    Document(title="Cats", text="Cats are small domesticated carnivorous mammals.", id="cats"),
    "The Seine is a river that flows through Paris.",
]


def search(tool, **args):
    return asyncio.run(tool.invoke(args, None))


def test_search_ranks_the_relevant_document_first():
    tool = SearchTool(CORPUS)
    res = search(tool, query="capital of France", k=3)
    assert not res.is_error
    assert res.metadata["ids"][0] == "paris"
    assert res.content.startswith("[1] Paris (score ")
    res = search(tool, query="programming language Guido")
    assert res.metadata["ids"] == ["py"]
    res = search(tool, query="river Seine")
    assert "flows through Paris" in res.content.split("\n\n")[0]


def test_search_k_limits_results_and_zero_scores_are_dropped():
    tool = SearchTool(CORPUS)
    res = search(tool, query="capital", k=1)
    assert len(res.metadata["ids"]) == 1
    assert len(search(tool, query="capital", k=10).metadata["ids"]) == 2


def test_search_without_matches_or_corpus_says_so():
    assert "no documents match" in search(SearchTool(CORPUS), query="zebra quantum").content
    assert "no documents match" in search(SearchTool(CORPUS), query="the and of").content
    empty = search(SearchTool(), query="x")
    assert empty.is_error and "empty" in empty.content
    bad = search(SearchTool(CORPUS), query="x", k=0)
    assert bad.is_error and "- k:" in bad.content


def test_search_index_is_built_lazily():
    tool = SearchTool(CORPUS)
    assert tool.index._retriever is None
    search(tool, query="cats")
    assert tool.index._retriever is not None


def test_a_corpus_with_no_word_to_index_answers_like_an_empty_one():
    # Every document was a stopword or one letter: bm25s raised "max() arg is an empty
    # sequence" at the first search (after a RuntimeWarning), failing every episode.
    for corpus in (["x", "y"], ["the", "a", ""]):
        res = search(SearchTool(corpus), query="x")
        assert res.is_error and "no words to search" in res.content
