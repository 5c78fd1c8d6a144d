"""Batch-invariant decoding: the ``hf`` backend's deterministic mode.

A request is sampled from its own seeded stream (``policy.base``), so its
tokens depend on its batch only through its logits. Those move in their last
bits with the batch, for four reasons:

1. **Rows of a GEMM.** MKL picks its algorithm by the number of rows: a row's
   product with a weight matrix has other bits at 1, 2 or 16 rows (measured
   here; with a fixed row count, every position gives the same bits).
2. **The slab's width.** Attention reduces over the whole KV slab, as wide as
   the batch's longest context, padding masked: the reduction's length, and so
   its blocking, follows the batch.
3. **Chunks.** A row's new tokens are prefilled in a group whose shape its
   mates set (re-running cached tokens), or a prefix shared with its mates is
   prefilled once for all; and keys and values built by a prefill of N tokens
   differ from those of N - 1 tokens then a one-token step.
4. **Cache hits.** Which cached entry a prompt reuses, and so how its keys and
   values were chunked, depends on what ran before it.

Deterministic mode takes each cause away:

1. **Row blocks.** In decode steps and short prefills every linear layer
   runs as a batch of GEMMs of exactly ``STEP_ROWS`` rows (``torch.bmm`` over
   the token rows, the last block padded with zeros): a token's product then
   has the same bits whatever the number of tokens in the forward and its
   place among them (measured here: at a fixed row count every position gives
   the same bits, and ``bmm``'s blocks give those of a lone GEMM). A prompt
   with ``ALONE_TOKENS`` new tokens or more is prefilled alone instead, with
   plain GEMMs: its row count is its own, and there the blocks would cost more
   (up to twice a plain GEMM) than reading the weights once more.
2. **Attention per row.** ``row_attention`` attends each row's real queries
   over that row's own keys only (the slab's padding columns cut off), with a
   causal mask it builds itself, so a row's call has the shape it would have
   alone. Padding queries (a row with fewer new tokens than its prefill group)
   write no keys or values (``RowSlabLayer``): a row never re-runs a cached
   token.
3. **One chunk a prompt.** A prompt's new tokens are prefilled in one chunk
   that starts where its reused keys and values end; nothing is shared with
   another row (rows with the same prompt and reuse in one batch are prefilled
   once and copied: the same computation). With 1. and 2. a one-token chunk is
   computed as a decode step is, so a segment fork continues a cached action
   with the bits its parent decoded.
4. **Reuse at boundaries.** Every cached entry keeps where the chunks that
   computed it ended (``BoundaryCache``). A prompt reuses the longest cached
   prefix that ends at such a boundary, one token short of the prompt at
   most: that is where the episode's own previous call ended, whatever ran
   meanwhile, and the same tokens chunked the same way hold the same bits.

What it does not cover: another machine, BLAS or thread count (the GEMM
blocking changes); GPUs (not checked); an entry evicted from the prefix cache
before its episode's next turn (that turn then prefills from an older
boundary: ``BoundaryCache.bounded_evictions`` counts such evictions, and
raising ``policy.prefix_cache_mb`` avoids them).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import PolicyError
from .prefix_cache import PrefixCache, PrefixEntry, common_prefix

__all__ = ["ALONE_TOKENS", "ROW_ATTENTION", "STEP_ROWS", "BoundaryCache", "install_row_invariance", "real_columns_cache",
           "row_attention", "row_blocks", "row_invariant"]

STEP_ROWS = 16  # rows of every GEMM block
ALONE_TOKENS = 128  # a prompt with this many new tokens or more is prefilled alone, with plain GEMMs
ROW_ATTENTION = "agentrl_row_sdpa"

_local = threading.local()  # the running forward's (row starts, real query tokens), on this thread
_base_attention: dict[int, str] = {}  # id(model config) -> its attention before (configs are unhashable)


@contextlib.contextmanager
def row_invariant(starts: Sequence[int], real: Sequence[int] | None = None, blocks: bool = True) -> Iterator[None]:
    """Forwards on this thread, inside, run row-invariant: row b's keys begin at column
    ``starts[b]`` of the cache, and its last ``real[b]`` query tokens are its own (None:
    all of them); the others are padding, whose outputs are zeros. ``blocks``: linear
    layers run in ``STEP_ROWS``-row blocks (else as they are: a single row's own prefill)."""
    previous = getattr(_local, "ctx", None)
    _local.ctx = (list(starts), None if real is None else list(real), blocks)
    try:
        yield
    finally:
        _local.ctx = previous


def row_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of each row's real queries over its own keys (inside ``row_invariant``);
    elsewhere the model's own attention, so that training the same model is unchanged."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        # A copy of the model (a frozen reference) has a config of its own: sdpa, as use_gqa_sdpa sets it.
        default = "agentrl_gqa_sdpa" if query.device.type == "cpu" else "sdpa"
        base = ALL_ATTENTION_FUNCTIONS[_base_attention.get(id(module.config), default)]
        return base(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                    is_causal=is_causal, **kwargs)
    starts, real, _ = ctx
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    out = query.new_zeros(batch, heads, q_len, dim)
    for b in range(batch):
        r = q_len if real is None else real[b]
        k, v = key[b:b + 1, :, starts[b]:], value[b:b + 1, :, starts[b]:]
        n = k.shape[2]
        q = query[b:b + 1, :, q_len - r:]
        mask = torch.ones(r, n, dtype=torch.bool, device=query.device).tril(n - r)[None, None]
        if r == 1 and groups > 1:  # one query token: its heads become a query axis per key head
            o = F.scaled_dot_product_attention(q.reshape(1, kv_heads, groups, dim), k, v, attn_mask=mask,
                                               scale=scaling).reshape(1, heads, 1, dim)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)
        out[b:b + 1, :, q_len - r:] = o
    return out.transpose(1, 2).contiguous(), None


def _take_input(module: torch.nn.Linear, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Forward pre-hook: inside ``row_invariant``, keep the input for ``_block_output`` and let
    the layer's own GEMM run on no rows."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None or not ctx[2]:
        return None
    _local.x = args[0]
    return (args[0].new_empty(0, args[0].shape[-1]),)


def _block_output(module: torch.nn.Linear, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
    """Forward hook: the layer's output, as GEMMs of ``STEP_ROWS`` rows (``row_blocks``)."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None or not ctx[2]:
        return None
    x, _local.x = _local.x, None
    return row_blocks(x, module.weight, module.bias)


def row_blocks(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed in blocks of ``STEP_ROWS`` token rows (one
    ``bmm``), so that each row's bits do not depend on how many rows there are."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    blocks = -(-rows // STEP_ROWS)
    if blocks * STEP_ROWS != rows:
        flat = torch.cat([flat, flat.new_zeros(blocks * STEP_ROWS - rows, flat.shape[-1])])
    w = weight.t().expand(blocks, *weight.t().shape)
    out = torch.bmm(flat.view(blocks, STEP_ROWS, -1), w).reshape(blocks * STEP_ROWS, -1)[:rows]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def install_row_invariance(model: torch.nn.Module) -> None:
    """Route ``model``'s attention through ``row_attention`` and hook its linear layers
    (idempotent; new layers, such as LoRA adapters added since, are hooked too)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = model.config
    impl = getattr(config, "_attn_implementation", None)
    if impl != ROW_ATTENTION:
        if impl not in ("sdpa", "agentrl_gqa_sdpa"):
            raise PolicyError(f"deterministic mode needs sdpa attention, the model uses {impl!r}: "
                              "load it with attn_implementation='sdpa', or set rollout.deterministic=false")
        AttentionInterface.register(ROW_ATTENTION, row_attention)
        AttentionMaskInterface.register(ROW_ATTENTION, sdpa_mask)
        _base_attention[id(config)] = impl
        weakref.finalize(config, _base_attention.pop, id(config), None)
        model.set_attn_implementation(ROW_ATTENTION)
    for m in model.modules():
        if type(m) is torch.nn.Linear and not getattr(m, "_agentrl_row_blocks", False):
            m.register_forward_pre_hook(_take_input)
            m.register_forward_hook(_block_output)
            m._agentrl_row_blocks = True


def real_columns_cache(keys: list[torch.Tensor], values: list[torch.Tensor], length: int,
                       real: Sequence[int], window: int) -> Any:
    """A cache over slab rows (``keys[l]``, ``values[l]``: ``[rows, heads, cols, dim]``) of
    ``length`` columns, whose next ``window``-token update writes only row b's last
    ``real[b]`` columns: a padding query never overwrites a cached token."""
    from transformers import DynamicCache

    keep = torch.zeros(len(real), 1, window, 1, dtype=torch.bool, device=keys[0].device)
    for b, r in enumerate(real):
        keep[b, :, window - r:] = True
    layer = _real_columns_layer()
    cache = DynamicCache()
    cache.layers = [layer(k, v, length, keep) for k, v in zip(keys, values, strict=True)]
    return cache


_REAL_COLUMNS_LAYER: type | None = None


def _real_columns_layer() -> type:
    """The slab layer that keeps what a padding query would overwrite (made on first use:
    importing this module does not import transformers)."""
    global _REAL_COLUMNS_LAYER
    if _REAL_COLUMNS_LAYER is None:
        from .kv_slab import _slab_layer

        class RealColumnsLayer(_slab_layer()):  # type: ignore[misc]
            def __init__(self, keys: torch.Tensor, values: torch.Tensor, n: int, keep: torch.Tensor):
                super().__init__(keys, values, n)
                self.keep = keep

            def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
                cols = slice(self.n, self.n + key_states.shape[-2])
                key_states = torch.where(self.keep, key_states, self._k[:, :, cols])
                value_states = torch.where(self.keep, value_states, self._v[:, :, cols])
                return super().update(key_states, value_states)

        _REAL_COLUMNS_LAYER = RealColumnsLayer
    return _REAL_COLUMNS_LAYER


class BoundaryCache(PrefixCache):
    """A ``PrefixCache`` whose entries (those inserted with ``bounds``) remember where the
    chunks that computed them ended: ``bounds`` is sorted, and ends at the entry's length."""

    def __init__(self, max_bytes: int):
        super().__init__(max_bytes)
        self._bounds: dict[int, np.ndarray] = {}
        self.bounded_evictions = 0  # entries with boundaries evicted: a later turn may re-chunk

    def match_boundary(self, prompt: Sequence[int]) -> tuple[PrefixEntry | None, int, np.ndarray]:
        """The entry, the tokens to reuse (a boundary of it, at most ``len(prompt) - 1``), and
        its boundaries up to there; ``(None, 0, [])`` when no boundary fits."""
        ids = np.asarray(prompt, dtype=np.int64)
        best, reuse, below = None, 0, np.zeros(0, dtype=np.int64)
        for key, entry in self._entries.items():
            bounds = self._bounds.get(key)
            if bounds is None:
                continue
            shared = min(common_prefix(entry.ids, ids), len(ids) - 1)
            i = int(np.searchsorted(bounds, shared, side="right")) - 1
            if i >= 0 and bounds[i] > reuse:
                best, reuse, below = entry, int(bounds[i]), bounds[:i + 1]
        if best is not None:
            self._entries.move_to_end(id(best))
        return best, reuse, below

    def insert(self, ids: Sequence[int], kv: Any, storage: object | None = None, storage_bytes: int = 0,
               bounds: np.ndarray | None = None) -> PrefixEntry | None:
        bounded = {k: self._entries[k] for k in self._bounds}
        entry = super().insert(ids, kv, storage, storage_bytes)
        new = np.asarray(ids, dtype=np.int64)
        for k, e in bounded.items():  # gone, and not because the new entry extends it: evicted
            if self._entries.get(k) is not e and not (len(e.ids) <= len(new)
                                                       and common_prefix(e.ids, new) == len(e.ids)):
                self.bounded_evictions += 1
        # By the entry itself: a dropped entry's id may be the new one's (the same address)
        if bounds is not None and entry is not None:
            self._bounds[id(entry)] = bounds
        return entry

    def _drop(self, entry: PrefixEntry) -> None:
        super()._drop(entry)
        self._bounds.pop(id(entry), None)

    def clear(self) -> None:
        super().clear()
        self._bounds.clear()
