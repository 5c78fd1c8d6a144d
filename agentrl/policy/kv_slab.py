"""The keys and values of one batch, preallocated, with each row's tokens right-aligned.

A ``KVSlab`` holds, per layer, keys and values shaped ``[batch, kv_heads,
width + room, head_dim]``. Row b's prompt of ``p_b`` tokens sits in the columns
``[width - p_b, width)``; the columns before it are padding, zeroed and masked.
Decoding appends every row's next token at the same column, so each row's
tokens stay contiguous and a row's keys and values can be kept afterwards as a
view, without a copy.

``cache(rows, length)`` wraps some rows (a contiguous range, so a view) as a
transformers ``DynamicCache`` whose layers write new tokens in place. Why not
transformers' own layers: ``DynamicLayer`` concatenates, copying the whole cache
for every decoded token, and ``StaticLayer`` cannot view a range of rows of a
shared buffer or start at a given length.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["KVSlab"]

_LAYER_CLASS: type | None = None


def _slab_layer() -> type:
    """The layer class, made on first use: importing this module does not import transformers."""
    global _LAYER_CLASS
    if _LAYER_CLASS is not None:
        return _LAYER_CLASS
    from transformers.cache_utils import DynamicLayer

    class SlabLayer(DynamicLayer):
        """A ``DynamicLayer`` over preallocated buffers: ``update`` writes at column ``n``."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, n: int):
            super().__init__()
            self._k, self._v, self.n = keys, values, n
            self.keys, self.values = keys[:, :, :n], values[:, :, :n]
            self.device, self.dtype, self.is_initialized = keys.device, keys.dtype, True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            t = key_states.shape[-2]
            if self.n + t > self._k.shape[-2]:
                raise RuntimeError(f"KV slab full: {self.n} + {t} columns > {self._k.shape[-2]}")
            self._k[:, :, self.n:self.n + t] = key_states
            self._v[:, :, self.n:self.n + t] = value_states
            self.n += t
            self.keys, self.values = self._k[:, :, :self.n], self._v[:, :, :self.n]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.n

    _LAYER_CLASS = SlabLayer
    return SlabLayer


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder config with full attention in every layer."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        raise ValueError(f"the hf backend's KV slab needs full attention in every layer, not {sorted(types)}")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim


class KVSlab:
    """Per-layer key and value buffers for ``batch`` rows of ``width + room`` columns."""

    def __init__(self, config: Any, batch: int, width: int, room: int,
                 dtype: torch.dtype, device: torch.device):
        layers, heads, head_dim = kv_shape(config)
        shape = (batch, heads, width + room, head_dim)
        self.width = width
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.nbytes = 2 * layers * self.keys[0].nbytes

    def place(self, row: int, length: int, kv: list[tuple[torch.Tensor, torch.Tensor]] | None,
              copy: int) -> None:
        """Zero row ``row``'s padding before its ``length`` tokens and copy in ``copy`` cached ones.

        Zeros, not garbage: padded columns are masked, but 0 * NaN would still be NaN.
        """
        start = self.width - length
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            k[row, :, :start].zero_()
            v[row, :, :start].zero_()
            if copy:
                assert kv is not None
                k[row, :, start:start + copy] = kv[i][0][:, :copy]
                v[row, :, start:start + copy] = kv[i][1][:, :copy]

    def cache(self, rows: slice, length: int) -> Any:
        """Rows ``rows`` as a ``DynamicCache`` of ``length`` columns that appends in place."""
        from transformers import DynamicCache

        layer = _slab_layer()
        cache = DynamicCache()
        cache.layers = [layer(k[rows], v[rows], length) for k, v in zip(self.keys, self.values, strict=True)]
        return cache

    def row(self, row: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of row ``row``'s columns ``[start, end)`` in every layer (no copy)."""
        return [(k[row, :, start:end], v[row, :, start:end]) for k, v in zip(self.keys, self.values, strict=True)]
