"""Attention for the ``hf`` backend: grouped keys and values read in place on CPU, and
no cuDNN attention on CUDA.

**CUDA.** PyTorch picks its cuDNN attention kernel first on Hopper GPUs. cuDNN builds an
execution graph per set of shapes, and decoding changes the key length at every token,
so every step builds graphs again: on an H200 (torch 2.11, cu130) ``sdpa`` with a mask
took 8 ms of host time per call against 8 us on the GPU, most of a decode step
(bench/gpu_check.json: ``decode_profile``, and ``cudnn_attention`` for the speedups). ``avoid_cudnn_attention`` turns that
backend off for the process, so PyTorch uses its flash and memory-efficient kernels,
which need no graph; ``AGENTRL_CUDNN_ATTENTION=1`` keeps it.

**CPU.**
transformers' ``sdpa`` attention copies the keys and values of a
grouped-query model once per query head (``repeat_kv``) whenever a mask is
given and more than one token is queried: on CPU it never passes
``enable_gqa``. A turn's prefill always has a mask (rows of different
lengths) and a cache of thousands of tokens, so that copy costs more than the
attention itself (measured here: 123 ms against 70 ms per layer for 150 new
tokens after 2,000 cached, batch 8, SmolLM2-135M's 9 query and 3 key heads).
This function is the same attention with ``enable_gqa``; a single query token
folds the query heads onto their key head instead, which was faster still.
It is registered under its own name with transformers' ``sdpa`` mask, so the
masks are built exactly as for ``sdpa``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ConfigError

__all__ = ["GQA_SDPA", "avoid_cudnn_attention", "gqa_sdpa_attention", "use_gqa_sdpa"]

GQA_SDPA = "agentrl_gqa_sdpa"


def gqa_sdpa_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0,
                       scaling: float | None = None, is_causal: bool | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``scaled_dot_product_attention`` over grouped heads; returns ``[batch, tokens, heads, dim]``."""
    b, heads, q_len, dim = query.shape
    groups = heads // key.shape[1]
    causal = bool(attention_mask is None and q_len > 1 and (True if is_causal is None else is_causal))
    if causal and key.shape[2] > q_len:  # as transformers does: only an empty static cache gets here
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if groups > 1 and q_len == 1:  # one query token: its heads become a query axis per key head
        out = F.scaled_dot_product_attention(query.reshape(b, key.shape[1], groups, dim), key, value,
                                             attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
        out = out.reshape(b, heads, 1, dim)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, is_causal=causal, enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous(), None


def avoid_cudnn_attention(device: torch.device | str) -> bool:
    """On CUDA, turn PyTorch's cuDNN attention backend off (process-wide; see the module
    docstring) unless ``AGENTRL_CUDNN_ATTENTION=1``. True if it is off after the call."""
    if torch.device(device).type != "cuda":
        return False
    keep = os.environ.get("AGENTRL_CUDNN_ATTENTION", "").strip() or "0"  # set but empty: unset
    if keep not in ("0", "1"):
        raise ConfigError(f"AGENTRL_CUDNN_ATTENTION must be 0 or 1, not {keep!r}")
    if keep == "1":
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def use_gqa_sdpa(model: Any) -> bool:
    """Switch a CPU model that uses ``sdpa`` to ``gqa_sdpa_attention``; True if it was switched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa" or next(model.parameters()).device.type != "cpu":
        return False
    AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(GQA_SDPA)
    return True
