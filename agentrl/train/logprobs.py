"""Per-token log-probabilities of a token sequence under the model being trained.

One job: turn ``input_ids`` into ``logprobs[:, t] = log p(input_ids[:, t] | what t attends to)``
and the entropy of that next-token distribution, with gradients, as cheaply as
the model allows. Three layouts of the same tokens go through the same function:

- **rows** ``[B, T]``, one episode a row, optionally padded (a 2D ``attention_mask``);
- **packed rows**: several episodes one after another in a row, each starting
  again at position 0 (``pack_sequences``). A block-diagonal causal mask
  (``block_causal_mask``) keeps them apart. transformers only infers that mask
  from ``position_ids`` on some versions and attention kernels, so we build it
  ourselves and pass it as a 4D mask, which the ``eager`` and ``sdpa``
  kernels take as it is (flash-attention takes none: a clear error);
- **prefix trees**: the episodes of a ``RolloutTree`` share their prefixes. A
  trie of their tokens (``prefix_tree``) goes through the model once: each
  token attends to its ancestors only (``tree_attention_mask``) and sits at
  position = its depth, so each token sees exactly the context it had in its
  own episode. Shared tokens are computed once (``tree_token_savings``).

In every layout a token's logits come from its *source* position: the token
before it in a row, its parent in a tree, none for the first token of a
sequence (whose logprob is 0). Only source positions whose next token is wanted
(``positions_to_keep``, usually the loss mask) go through the vocabulary head:
the model is called with ``logits_to_keep`` as a 1D index tensor (transformers
slices the hidden states with it before ``lm_head``; tensors are accepted since
early 2025, huggingface/transformers#35757, before our floor of 4.56). With SmolLM2's
49,152-token head this was measured to cut forward+backward on 2k tokens from
18.3 s to 10.6 s. Log-softmax, gather and entropy then run in chunks of
positions under activation checkpointing, so only one chunk's
``[chunk, vocab]`` temporaries exist at a time, in the forward and in the backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = [
    "PackedRow",
    "PrefixTree",
    "TokenScores",
    "block_causal_mask",
    "collate_packed",
    "fp32_head",
    "pack_sequences",
    "prefix_tree",
    "token_logprobs",
    "token_scores",
    "tree_attention_mask",
    "tree_token_savings",
]


# --------------------------------------------------------------------------- forward


@dataclass(slots=True)
class TokenScores:
    """What ``token_scores`` returns; 0 (ids: -1) wherever a token is not kept.

    ``candidates``: ``[B, T, C]`` log-probs of the ids asked for per token (None
    if none were asked); ``top_ids`` / ``top_logprobs``: ``[B, T, K]``, the K
    most likely next tokens, most likely first (None for ``top_k=0``).
    """

    logprobs: torch.Tensor
    entropies: torch.Tensor
    candidates: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def token_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   positions_to_keep: torch.Tensor | None = None, temperature: float = 1.0, *,
                   position_ids: torch.Tensor | None = None, parents: torch.Tensor | None = None,
                   chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, entropies)``, both ``[B, T]``: ``token_scores`` without candidates or top-k."""
    out = token_scores(model, input_ids, attention_mask, positions_to_keep, temperature,
                       position_ids=position_ids, parents=parents, chunk_size=chunk_size)
    return out.logprobs, out.entropies


def token_scores(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 positions_to_keep: torch.Tensor | None = None, temperature: float = 1.0, *,
                 position_ids: torch.Tensor | None = None, parents: torch.Tensor | None = None,
                 chunk_size: int = 1024, candidates: torch.Tensor | None = None,
                 top_k: int = 0) -> TokenScores:
    """Token t's log-prob and the entropy it was drawn from, both ``[B, T]``; optionally more of its distribution.

    ``logprobs[b, t] = log p(input_ids[b, t] | context)`` where the context is
    what token t attends to; the logits come from t's source position (``t - 1``
    in a row, ``parents[b, t]`` in a tree). Tokens with no source (position 0, the
    first token of each packed sequence, padding) and tokens outside
    ``positions_to_keep`` get 0 in both outputs.

    ``attention_mask``: ``None``; a 2D ``[B, T]`` padding mask (1 = real token;
    positions then count real tokens, so left padding is fine); or a boolean 4D
    ``[B, 1, T, T]`` mask from ``block_causal_mask`` / ``tree_attention_mask``
    (True = may attend), given to ``sdpa`` as it is and to ``eager`` as an
    additive float mask. ``temperature`` divides the logits, as the
    sampler did (``sampling_logprobs`` in ``agentrl.policy.hf``); top-k/top-p are
    not applied: the trainer scores the untruncated distribution.

    The vocabulary head runs on one set of positions for the whole batch (a
    1D ``logits_to_keep``; per-row 2D index tensors only exist in newer
    transformers releases): with several rows it is
    the union of their source positions, so pack one long row when the
    saving matters. Its ``[B, n, V]`` logits are materialised once; the
    log-softmax over them runs ``chunk_size`` tokens at a time.

    Distribution-level distillation needs more than the sampled token: with
    ``candidates`` (``[B, T, C]`` token ids, -1 for none) each kept token also
    gets the log-probs of its C candidate next tokens, and with ``top_k`` the
    ids and log-probs of its K most likely ones, from the same log-softmax.
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, length = input_ids.shape
    device = input_ids.device
    model_mask, position_ids, valid = _model_inputs(model, input_ids, attention_mask, position_ids)
    src = _source_positions(batch, length, device, valid, position_ids, parents)

    if candidates is not None and candidates.shape[:2] != (batch, length):
        raise ValueError(f"candidates must be [B, T, C] with [B, T] = {(batch, length)}, "
                         f"got {tuple(candidates.shape)}")
    keep = src >= 0
    if positions_to_keep is not None:
        keep &= positions_to_keep.to(device=device, dtype=torch.bool)
    out = TokenScores(torch.zeros(batch, length, device=device), torch.zeros(batch, length, device=device))
    if candidates is not None:
        out.candidates = torch.zeros(batch, length, candidates.shape[2], device=device)
    if top_k:
        out.top_ids = torch.full((batch, length, top_k), -1, dtype=torch.long, device=device)
        out.top_logprobs = torch.zeros(batch, length, top_k, device=device)
    if not keep.any():
        return out

    # Only the source positions some kept token needs go through the vocabulary head.
    rows, cols = keep.nonzero(as_tuple=True)
    sources = src[rows, cols]
    head_positions = torch.unique(sources)  # sorted
    with fp32_head(model):
        logits = model(input_ids=input_ids, attention_mask=model_mask, position_ids=position_ids,
                       logits_to_keep=head_positions, use_cache=False).logits  # [B, n, V]
    column = torch.searchsorted(head_positions, sources)  # where each kept token's source went
    targets = input_ids[rows, cols]

    # A target's own id leads its candidate list, so one gather serves both.
    wanted = targets[:, None]
    if candidates is not None:
        wanted = torch.cat([wanted, candidates.to(device)[rows, cols].clamp(min=0)], dim=1)
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, rows.numel(), chunk_size):
        part = slice(start, start + chunk_size)
        args = (logits, rows[part], column[part], wanted[part], temperature, top_k)
        if torch.is_grad_enabled() and logits.requires_grad:
            parts.append(checkpoint(_gather_logprobs, *args, use_reentrant=False))
        else:
            parts.append(_gather_logprobs(*args))
    gathered, entropy = torch.cat([p[0] for p in parts]).float(), torch.cat([p[1] for p in parts]).float()
    out.logprobs = out.logprobs.index_put((rows, cols), gathered[:, 0])
    out.entropies = out.entropies.index_put((rows, cols), entropy)
    if out.candidates is not None:
        out.candidates = out.candidates.index_put((rows, cols), gathered[:, 1:])
    if top_k:
        out.top_logprobs = out.top_logprobs.index_put((rows, cols), torch.cat([p[2] for p in parts]).float())
        out.top_ids = out.top_ids.index_put((rows, cols), torch.cat([p[3] for p in parts]))
    return out


@contextlib.contextmanager
def fp32_head(model: Any) -> Iterator[None]:
    """Within this block, under bf16 autocast, the vocabulary head runs in fp32 on fp32 inputs.

    bf16 logits carry 8 bits of mantissa: a logit near 16 moves in steps of
    0.125, so the trainer's log-probs of the sampled tokens drift from the
    sampler's (fp32) by up to a few hundredths of a nat, and PPO's ratio at step
    0 is no longer 1 (``bench/precision.json``). The body keeps its bf16
    matmuls; the head, one matmul of the whole model, goes back to fp32. Outside
    autocast (sampling, fp32 training) this changes nothing.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    device = next(model.parameters()).device.type
    if head is None or not torch.is_autocast_enabled(device):
        yield
        return
    plain = type(head).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return plain(head, x.float())

    head.forward = forward  # an instance attribute, removed on the way out
    try:
        yield
    finally:
        del head.forward


def _gather_logprobs(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                     wanted: torch.Tensor, temperature: float, top_k: int = 0) -> tuple[torch.Tensor, ...]:
    """For one chunk of tokens: the log-probs of the ``wanted`` ids ``[n, C]``, the entropy,
    and (``top_k``) the top-k log-probs and ids."""
    logp = torch.log_softmax(logits[rows, cols].float() / temperature, dim=-1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1)  # p == 0 gives 0 * -inf only for -inf logits, not here
    if not top_k:
        return logp.gather(-1, wanted), entropy
    top = torch.topk(logp.detach(), top_k, dim=-1)
    return logp.gather(-1, wanted), entropy, top.values, top.indices


def _model_inputs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  position_ids: torch.Tensor | None
                  ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The mask and position ids the model gets, and which tokens are real (not padding)."""
    batch, length = input_ids.shape
    device = input_ids.device
    valid = torch.ones(batch, length, dtype=torch.bool, device=device)
    if attention_mask is None:
        model_mask = None
        if position_ids is None:
            position_ids = torch.arange(length, device=device).expand(batch, length)
    elif attention_mask.ndim == 2:
        valid = attention_mask.to(device=device, dtype=torch.bool)
        model_mask = attention_mask.to(device)
        if position_ids is None:  # positions count real tokens, so left padding works
            position_ids = (valid.long().cumsum(-1) - 1).clamp(min=0)
    elif attention_mask.ndim == 4:
        if attention_mask.dtype != torch.bool:
            raise ValueError("a 4D attention_mask must be boolean (True = may attend); "
                             "build it with block_causal_mask or tree_attention_mask")
        if position_ids is None:
            raise ValueError("a 4D attention_mask needs position_ids (packed rows and trees "
                             "restart or branch their positions)")
        model_mask = _kernel_mask(model, attention_mask.to(device))
    else:
        raise ValueError(f"attention_mask must be 2D or 4D, got shape {tuple(attention_mask.shape)}")
    return model_mask, position_ids.to(device), valid


def _kernel_mask(model: Any, allowed: torch.Tensor) -> torch.Tensor:
    """A boolean 4D mask in the form the model's attention kernel takes as it is.

    ``sdpa`` (and kernels built on it) get booleans, the form transformers'
    own sdpa masks take, whatever dtype autocast gives the queries; ``eager``
    adds the mask to its scores, so it gets 0 / the dtype's minimum.
    flash-attention and flex-attention take no dense 4D mask at all.
    """
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl.startswith(("flash", "flex")):
        raise ValueError(f"a 4D attention_mask (packed rows, trees) needs attn_implementation "
                         f"'sdpa' or 'eager', the model uses {impl!r}")
    if impl != "eager":
        return allowed
    dtype = next(model.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


def _source_positions(batch: int, length: int, device: torch.device, valid: torch.Tensor,
                      position_ids: torch.Tensor, parents: torch.Tensor | None) -> torch.Tensor:
    """``[B, T]`` index of the position whose logits predict each token; -1 for none."""
    if parents is not None:
        if parents.shape != (batch, length):
            raise ValueError(f"parents must be [B, T] = {(batch, length)}, got {tuple(parents.shape)}")
        parents = parents.to(device=device, dtype=torch.long)
        if ((parents < -1) | (parents >= length)).any():
            raise ValueError(f"parents must hold -1 or a position in [0, {length})")
        return parents
    src = (torch.arange(length, device=device) - 1).expand(batch, length).clone()
    src[position_ids == 0] = -1  # the first token of every (packed) sequence
    src[~valid] = -1
    prev_valid = torch.cat([torch.zeros_like(valid[:, :1]), valid[:, :-1]], dim=1)
    src[~prev_valid] = -1  # the first real token after left padding
    return src


# --------------------------------------------------------------------------- packing


@dataclass(slots=True)
class PackedRow:
    """Several sequences laid end to end in one row.

    ``spans[i]`` is the half-open ``(start, end)`` of the ``i``-th sequence in
    the row and ``seq_index[i]`` its index in the list given to ``pack_sequences``.
    """

    input_ids: list[int] = field(default_factory=list)
    position_ids: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    seq_index: list[int] = field(default_factory=list)


def pack_sequences(seqs: list[list[int]], max_len: int) -> list[PackedRow]:
    """Pack sequences into rows of at most ``max_len`` tokens, first-fit decreasing.

    Longest sequences are placed first, each into the first row with room
    (first-fit decreasing bin packing, Johnson 1973: within 11/9 of the
    optimal number of rows plus a constant). Each sequence's positions restart at 0.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    for i, s in enumerate(seqs):
        if not s:
            raise ValueError(f"seqs[{i}] is empty")
        if len(s) > max_len:
            raise ValueError(f"seqs[{i}] has {len(s)} tokens, more than max_len={max_len}")
    rows: list[PackedRow] = []
    for i in sorted(range(len(seqs)), key=lambda i: -len(seqs[i])):
        row = next((r for r in rows if len(r.input_ids) + len(seqs[i]) <= max_len), None)
        if row is None:
            row = PackedRow()
            rows.append(row)
        start = len(row.input_ids)
        row.input_ids += seqs[i]
        row.position_ids += list(range(len(seqs[i])))
        row.spans.append((start, len(row.input_ids)))
        row.seq_index.append(i)
    return rows


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, 1, T, T]`` mask: token i may attend to j iff j <= i in the same sequence.

    A sequence starts wherever ``position_ids`` is 0, the packing convention.
    Padding given position 0 becomes a one-token sequence that attends only to
    itself, which keeps its softmax finite.
    """
    if position_ids.ndim != 2:
        raise ValueError(f"position_ids must be [B, T], got shape {tuple(position_ids.shape)}")
    seq = (position_ids == 0).long().cumsum(-1)  # [B, T]: which sequence each token is in
    same = seq[:, :, None] == seq[:, None, :]
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]


def collate_packed(rows: list[PackedRow], pad_id: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids, mask)`` of packed rows, right-padded to the longest.

    Pads sit at position 0, so ``block_causal_mask`` gives each its own block and
    ``token_logprobs`` gives them no source.
    """
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r.input_ids)] = torch.tensor(r.input_ids)
        pos[i, :len(r.position_ids)] = torch.tensor(r.position_ids)
    return ids, pos, block_causal_mask(pos)


# --------------------------------------------------------------------------- trees


@dataclass(slots=True)
class PrefixTree:
    """The tokens of several sequences with shared prefixes stored once.

    ``input_ids[i]`` is node i's token and ``parents[i]`` its parent node (-1
    for a first token); parents come before children. ``index[s][t]`` is the
    node holding token t of sequence s: gather with it to read a per-node
    tensor back in each sequence's own layout.
    """

    input_ids: list[int]
    parents: list[int]
    index: list[list[int]]


def prefix_tree(seqs: list[list[int]]) -> PrefixTree:
    """The trie of ``seqs``: a token shares a node with every sequence that has the same prefix up to it.

    Two tokens are merged only when their whole prefixes are equal, so a merged
    token has the same context, and so the same logprob, in every sequence.
    """
    ids: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    index = []
    for s in seqs:
        parent, nodes = -1, []
        for tok in s:
            node = children.get((parent, tok))
            if node is None:
                node = len(ids)
                ids.append(tok)
                parents.append(parent)
                children[(parent, tok)] = node
            nodes.append(node)
            parent = node
        index.append(nodes)
    return PrefixTree(ids, parents, index)


def tree_attention_mask(parents: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask [T, T], position_ids [T])`` for running a token tree as one row.

    Token i attends to itself and its ancestors (the tree attention of
    SpecInfer, Miao et al. 2024, used here for training rather than
    verification): ``mask[i, j] = j is i or an ancestor of i``. Its position
    id is its depth, the position it had in its own
    sequence. Add the batch and head axes with ``mask[None, None]``. The mask is
    dense, O(T^2) booleans, like any 4D mask.
    """
    parents = torch.as_tensor(parents, dtype=torch.long)
    n = parents.numel()
    if parents.ndim != 1:
        raise ValueError(f"parents must be 1D, got shape {tuple(parents.shape)}")
    if n and ((parents >= torch.arange(n)) | (parents < -1)).any():
        raise ValueError("parents[i] must be -1 or an earlier index (< i) for every token i")
    mask = torch.eye(n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:  # a token sees what its parent sees, plus the parent itself (already in that row)
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    return mask, depth


def tree_token_savings(seqs: list[list[int]]) -> int:
    """Tokens a prefix tree saves over running each sequence on its own.

    That is ``sum(len(s)) - (number of trie nodes)``: for every node, one
    fewer than the number of sequences passing through it. Two 100-token
    episodes that share a 60-token prompt save 60; eight branches from one
    node at token 500 save 7 * 500 = 3,500.
    """
    return sum(len(s) for s in seqs) - len(prefix_tree(seqs).input_ids)
