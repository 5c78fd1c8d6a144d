"""Prefix KV cache for the ``hf`` backend: an episode's keys and values live across turns.

A multi-turn context only grows, token-exactly, so the keys and values computed
for turn t's context are exactly the first part of turn t+1's. After each
``generate`` the backend stores, per sequence, every layer's keys and values
together with the token ids they cover. A new prompt takes the entry that shares
its longest common prefix, so the branches of a tree share their common context
too, and prefills only the rest. Entries are evicted least recently used once
their bytes pass a budget.

Why our own: transformers' cache classes hold the batch of one forward loop; they
neither outlive it per sequence nor match prefixes across calls. vLLM's automatic
prefix caching does, and the ``vllm`` backend uses that instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["CacheStats", "PrefixCache", "PrefixEntry"]

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values as [heads, tokens, head_dim]


@dataclass(slots=True)
class CacheStats:
    """Counts since the cache was made. ``hits`` and ``misses`` count requests."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0


@dataclass(slots=True, eq=False)
class PrefixEntry:
    """The keys and values of every layer for the token ids ``ids``."""

    ids: np.ndarray
    kv: KV
    nbytes: int


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if differ.size else m


class PrefixCache:
    """Per-sequence KV entries, matched by longest common token prefix, LRU under ``max_bytes``."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._bytes = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: Sequence[int]) -> tuple[PrefixEntry | None, int]:
        """The entry to reuse for ``prompt`` and how many of its tokens to reuse.

        At most ``len(prompt) - 1`` tokens are reused: the last prompt token is
        always run, since its logits give the first new token. Counts the hit or
        miss; the caller counts what it really reused (``count``).
        """
        ids = np.asarray(prompt, dtype=np.int64)
        best, n = None, 0
        for entry in self._entries.values():
            k = _common_prefix(entry.ids, ids)
            if k > n:
                best, n = entry, k
        n = min(n, len(ids) - 1)
        if best is None or n <= 0:
            self.stats.misses += 1
            return None, 0
        self._entries.move_to_end(id(best))
        self.stats.hits += 1
        return best, n

    def count(self, reused: int, prefilled: int) -> None:
        """Add prompt tokens taken from the cache and prompt tokens run through the model."""
        self.stats.reused_tokens += reused
        self.stats.prefilled_tokens += prefilled

    def insert(self, ids: Sequence[int], kv: KV) -> None:
        """Store ``kv`` for ``ids`` (most recently used), then evict down to the budget.

        ``kv`` may be views of a larger buffer; the budget counts the views' bytes.
        """
        key = np.asarray(ids, dtype=np.int64)
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        if nbytes > self.max_bytes:
            return
        for old in [e for e in self._entries.values() if np.array_equal(e.ids, key)]:
            self._drop(old)
        entry = PrefixEntry(key, kv, nbytes)
        self._entries[id(entry)] = entry
        self._bytes += nbytes
        while self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries.values())))
            self.stats.evictions += 1
        self.stats.entries, self.stats.bytes = len(self._entries), self._bytes

    def _drop(self, entry: PrefixEntry) -> None:
        del self._entries[id(entry)]
        self._bytes -= entry.nbytes
        self.stats.entries, self.stats.bytes = len(self._entries), self._bytes

    def clear(self) -> None:
        """Forget every entry (new weights make every cached key and value stale)."""
        self._entries.clear()
        self._bytes = 0
        self.stats.entries = self.stats.bytes = 0
