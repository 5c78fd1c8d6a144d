"""Prefix KV cache for the ``hf`` backend: an episode's keys and values live across turns.

A multi-turn context only grows, token-exactly, so the keys and values computed
for turn t's context are exactly the first part of turn t+1's. After each
``generate`` the backend stores, per sequence, every layer's keys and values
together with the token ids they cover. A new prompt takes the entry that shares
its longest common prefix, so the branches of a tree share their common context
too, and prefills only the rest. An entry that a newer one extends is dropped:
the newer one serves every prompt the older could. Entries are evicted least
recently used once their bytes pass a budget. Entries may be views of a
larger buffer (a batch's ``KVSlab``); the budget charges that whole buffer,
once, for as long as any entry keeps it alive.

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

from ..errors import PolicyError

__all__ = ["CacheStats", "PrefixCache", "PrefixEntry", "common_prefix"]

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values as [heads, tokens, head_dim]


@dataclass(slots=True)
class CacheStats:
    """Counts since the cache was made. ``hits`` and ``misses`` count requests that did or
    did not reuse a token; ``bytes`` is what the live entries keep allocated."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0


@dataclass(slots=True, eq=False)
class PrefixEntry:
    """The keys and values of every layer for the token ids ``ids``, held in ``storage``."""

    ids: np.ndarray
    kv: KV
    storage: object


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """How many leading token ids ``a`` and ``b`` share."""
    m = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:m]) != np.asarray(b[:m]))
    return int(differ[0]) if differ.size else m


class PrefixCache:
    """Per-sequence KV entries, matched by longest common token prefix, LRU under ``max_bytes``."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._storage: dict[int, list[int]] = {}  # id(storage) -> [bytes, entries holding it]
        self._bytes = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: Sequence[int]) -> tuple[PrefixEntry | None, int]:
        """The entry to reuse for ``prompt`` and how many of its tokens it can serve.

        At most ``len(prompt) - 1`` tokens: the last prompt token is always run,
        since its logits give the first new token. The caller says what it
        really reused with ``record``.
        """
        ids = np.asarray(prompt, dtype=np.int64)
        best, n = None, 0
        for entry in self._entries.values():
            k = common_prefix(entry.ids, ids)
            if k > n:
                best, n = entry, k
        n = min(n, len(ids) - 1)
        if best is None or n <= 0:
            return None, 0
        self._entries.move_to_end(id(best))
        return best, n

    def record(self, reused: Sequence[int], prompt_lens: Sequence[int], extra_prefilled: int = 0) -> None:
        """Count one batch: per request, prompt tokens taken from the cache and prompt length.

        ``extra_prefilled``: tokens run beyond the prompts' own (a shared prefix
        whose rows re-ran their cached tokens anyway)."""
        self.stats.hits += sum(r > 0 for r in reused)
        self.stats.misses += sum(r == 0 for r in reused)
        self.stats.reused_tokens += sum(reused)
        self.stats.prefilled_tokens += sum(prompt_lens) - sum(reused) + extra_prefilled

    def insert(self, ids: Sequence[int], kv: KV, storage: object | None = None,
               storage_bytes: int = 0) -> PrefixEntry | None:
        """Store ``kv`` for ``ids`` (most recently used), then evict down to the budget; the new
        entry, or None when it does not fit the budget at all.

        ``kv`` may be views of ``storage`` (``storage_bytes`` in all), which is
        charged in full while any entry holds it; without it the entry owns ``kv``.
        """
        key = np.asarray(ids, dtype=np.int64)
        if storage is None:
            storage, storage_bytes = kv, sum(k.nbytes + v.nbytes for k, v in kv)
        elif storage_bytes <= 0:  # charged nothing, buffers would pile up past any budget
            raise PolicyError(f"storage_bytes={storage_bytes}: a shared storage must say its size in bytes")
        if storage_bytes > self.max_bytes:
            return None
        for old in [e for e in self._entries.values()
                    if len(e.ids) <= len(key) and common_prefix(e.ids, key) == len(e.ids)]:
            self._drop(old)  # the new entry extends it: it serves whatever the old one could
        entry = PrefixEntry(key, kv, storage)
        self._entries[id(entry)] = entry
        held = self._storage.setdefault(id(storage), [storage_bytes, 0])
        if held[1] == 0:
            self._bytes += storage_bytes
        held[1] += 1
        while self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries.values())))
            self.stats.evictions += 1
        self._sync()
        return entry

    def _drop(self, entry: PrefixEntry) -> None:
        del self._entries[id(entry)]
        held = self._storage[id(entry.storage)]
        held[1] -= 1
        if held[1] == 0:
            self._bytes -= held[0]
            del self._storage[id(entry.storage)]
        self._sync()

    def _sync(self) -> None:
        self.stats.entries, self.stats.bytes = len(self._entries), self._bytes

    def clear(self) -> None:
        """Forget every entry (new weights make every cached key and value stale)."""
        self._entries.clear()
        self._storage.clear()
        self._bytes = 0
        self._sync()
