"""The ``search`` tool: BM25 retrieval over a local corpus, with the ``bm25s`` package.

The index is built on the first search (not at construction), in a worker
thread. Documents are strings or ``Document``s with a title; a result shows the
title and the start of the text.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from agentrl.errors import ToolError

from .base import Tool, ToolResult, positive_setting

__all__ = ["Document", "SearchArgs", "SearchIndex", "SearchTool"]


@dataclass(slots=True, frozen=True)
class Document:
    """One searchable document."""

    text: str
    title: str = ""
    id: str = ""


class SearchIndex:
    """A BM25 index (``bm25s``) over documents; thread-safe, built once on first use."""

    def __init__(self, documents: Sequence[Document | str], stopwords: str | None = "en"):
        self.documents = [
            d if isinstance(d, Document) else Document(text=str(d)) for d in documents
        ]
        self.stopwords = stopwords
        self._retriever: Any = None  # False once built: no document holds a word to index
        self._lock = threading.Lock()

    @property
    def wordless(self) -> bool:
        """True when the index is built and no document held a word to index (all
        stopwords, one letter or empty): bm25s cannot score such a corpus."""
        return self._retriever is False

    def _build(self) -> Any:
        with self._lock:
            if self._retriever is None:
                try:
                    import bm25s
                except ImportError as err:
                    raise ToolError("the search tool needs bm25s: pip install bm25s") from err
                texts = [f"{d.title}\n{d.text}" if d.title else d.text for d in self.documents]
                tokens = bm25s.tokenize(texts, stopwords=self.stopwords, show_progress=False)
                if not tokens.vocab:  # bm25s would divide by a mean length of 0, then raise
                    self._retriever = False
                    return False
                retriever = bm25s.BM25()
                retriever.index(tokens, show_progress=False)
                self._retriever = retriever
        return self._retriever

    def search(self, query: str, k: int = 5) -> list[tuple[Document, float]]:
        """Up to ``k`` documents with a positive BM25 score, best first."""
        if not self.documents:
            return []
        import bm25s

        retriever = self._build()
        if retriever is False:
            return []
        q = bm25s.tokenize([query], stopwords=self.stopwords, show_progress=False, return_ids=False)
        if not q or not q[0]:
            return []
        k = min(k, len(self.documents))
        ids, scores = retriever.retrieve(q, k=k, show_progress=False)
        return [
            (self.documents[int(i)], float(s))
            for i, s in zip(ids[0], scores[0], strict=True)
            if s > 0
        ]


class SearchArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=1000, description="Keywords to search for.")
    k: int = Field(5, ge=1, le=20, description="How many results to return.")


class SearchTool(Tool):
    """BM25 search over the corpus given at construction; no sandbox needed."""

    name: ClassVar[str] = "search"
    description: ClassVar[str] = (
        "Search a document collection by keywords (BM25). Returns the best matching documents."
    )
    Args: ClassVar[type[BaseModel]] = SearchArgs

    def __init__(
        self,
        corpus: Sequence[Document | str] | SearchIndex = (),
        snippet_chars: int = 500,
    ):
        self.index = corpus if isinstance(corpus, SearchIndex) else SearchIndex(corpus)
        self.snippet_chars = positive_setting("SearchTool", "snippet_chars", snippet_chars, whole=True)

    async def __call__(self, args: SearchArgs, sandbox: Any = None) -> ToolResult:
        if not self.index.documents:
            return ToolResult.error("the search corpus is empty; nothing can be found")
        hits = await asyncio.to_thread(self.index.search, args.query, args.k)
        if not hits and self.index.wordless:
            return ToolResult.error("the search corpus holds no words to search (every document "
                                    "is empty, stopwords or single letters); nothing can be found")
        if not hits:
            return ToolResult(content=f"no documents match {args.query!r}; try other keywords")
        lines = []
        for rank, (doc, score) in enumerate(hits, start=1):
            head = f"[{rank}] {doc.title}" if doc.title else f"[{rank}]"
            text = (
                doc.text
                if len(doc.text) <= self.snippet_chars
                else doc.text[: self.snippet_chars] + " ..."
            )
            lines.append(f"{head} (score {score:.2f})\n{text}")
        return ToolResult(content="\n\n".join(lines), metadata={"ids": [d.id for d, _ in hits]})
