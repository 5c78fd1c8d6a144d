"""Per-token log-probabilities of a token sequence under the model being trained.

One job: turn ``input_ids`` into ``logprobs[:, t] = log p(input_ids[:, t] | what t attends to)``
and the entropy of that next-token distribution, with gradients, as cheaply as
the model allows. Three layouts of the same tokens (laid out by ``rows``) go
through the same function:

- **rows** ``[B, T]``, one episode a row, optionally padded (a 2D ``attention_mask``);
- **packed rows**: several episodes one after another in a row, each starting
  again at position 0, kept apart by a boolean 4D block-causal mask, which the
  ``eager`` and ``sdpa`` kernels take as it is (flash-attention takes none: a
  clear error);
- **prefix trees**: each token attends to its ancestors only (a 4D tree mask)
  and its logits come from its parent (``parents``), so it sees exactly the
  context it had in its own episode.

In every layout a token's logits come from its *source* position: the token
before it in a row, its parent in a tree, none for the first token of a
sequence (whose logprob is 0). Only the hidden states of kept tokens' sources
(``positions_to_keep``, usually the loss mask) go through the vocabulary head:
the decoder runs once, ``hidden[rows, sources]`` picks ``[N, H]`` of its output,
and the head, log-softmax, gather and entropy run ``chunk_size`` tokens at a
time, with the log-softmax's gradient written out (``_ChunkScores``). So the only
vocabulary-sized tensors are one ``[chunk, V]`` log-softmax a chunk, kept for the
backward, and one chunk's temporaries. With SmolLM2's 49,152-token head,
running the head on kept positions only was measured to cut forward+backward on
2k tokens from 18.3 s to 10.6 s; picking the hidden states (not slicing
``[B, n, V]`` logits, whose backward scattered into a zero tensor of that size)
is the bf16 update's largest saving on CPU (profile in docs/benchmark-notes.md,
precision). The head stays fp32 in its backward too: running that backward in
bf16 bought no SFT speed and cost learning (``fp32_head``).

A turn sampled under ``rollout.constrain: admissible`` is scored under the
same constraint: ``allowed`` lists each such token's allowed ids (the
sampler's trie, rebuilt by ``policy.constrain.episode_allowed``), and the
logits outside them are set to -inf before the log-softmax, as the sampler
did, so log-probs, entropies and KL are those of the constrained distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ..policy.constrain import mask_logits
from ..precision import fp32_head
from .compiled import compiled_decoder

__all__ = ["TokenScores", "fp32_head", "token_logprobs", "token_scores"]


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
                 top_k: int = 0, allowed: torch.Tensor | None = None) -> TokenScores:
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

    The vocabulary head runs on each kept token's source only, whatever the
    layout (padded rows no longer pay for the union of their positions), in
    chunks of ``chunk_size`` tokens.

    Distribution-level distillation needs more than the sampled token: with
    ``candidates`` (``[B, T, C]`` token ids, -1 for none) each kept token also
    gets the log-probs of its C candidate next tokens, and with ``top_k`` the
    ids and log-probs of its K most likely ones, from the same log-softmax.

    ``allowed`` (``[B, T, A]`` token ids, -1 padding): a token with ids there
    is scored over those ids only (its other logits -inf: a constrained turn,
    ``policy.constrain``); a token with none over the whole vocabulary.
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, length = input_ids.shape
    device = input_ids.device
    if allowed is not None and allowed.shape[:2] != (batch, length):
        raise ValueError(f"allowed must be [B, T, A] with [B, T] = {(batch, length)}, got {tuple(allowed.shape)}")
    if candidates is not None and candidates.shape[:2] != (batch, length):
        raise ValueError(f"candidates must be [B, T, C] with [B, T] = {(batch, length)}, "
                         f"got {tuple(candidates.shape)}")
    with compiled_decoder(model, batch, length):  # train.compile; its attention decides the mask's form
        model_mask, position_ids, valid = _model_inputs(model, input_ids, attention_mask, position_ids)
        src = _source_positions(batch, length, device, valid, position_ids, parents)
        keep = src >= 0
        if positions_to_keep is not None:
            keep &= positions_to_keep.to(device=device, dtype=torch.bool)
        rows, cols = keep.nonzero(as_tuple=True)
        # Only the hidden states of kept tokens' sources go through the vocabulary head, a chunk at a time.
        hidden = (_hidden_states(model, input_ids, model_mask, position_ids)[rows, src[rows, cols]]  # [N, H]
                  if rows.numel() else None)

    out = TokenScores(torch.zeros(batch, length, device=device), torch.zeros(batch, length, device=device))
    if candidates is not None:
        out.candidates = torch.zeros(batch, length, candidates.shape[2], device=device)
    if top_k:
        out.top_ids = torch.full((batch, length, top_k), -1, dtype=torch.long, device=device)
        out.top_logprobs = torch.zeros(batch, length, top_k, device=device)
    if hidden is None:
        return out
    targets = input_ids[rows, cols]

    # A target's own id leads its candidate list, so one gather serves both.
    wanted = targets[:, None]
    if candidates is not None:
        wanted = torch.cat([wanted, candidates.to(device)[rows, cols].clamp(min=0)], dim=1)
    per_token = allowed.to(device)[rows, cols] if allowed is not None else None  # [N, A]
    head = model.get_output_embeddings()
    parts: list[tuple[torch.Tensor, ...]] = []
    with fp32_head(model):
        for start in range(0, rows.numel(), chunk_size):
            part = slice(start, start + chunk_size)
            logits = head(hidden[part])  # [chunk, V]: the only vocabulary-sized tensor kept for backward
            mask = per_token[part] if per_token is not None else None
            if torch.is_grad_enabled() and logits.requires_grad and not top_k:
                parts.append(_ChunkScores.apply(logits, wanted[part], temperature, mask))
            elif torch.is_grad_enabled() and logits.requires_grad:
                parts.append(checkpoint(_gather_logprobs, logits, wanted[part], temperature, top_k, mask,
                                        use_reentrant=False))
            else:
                parts.append(_gather_logprobs(logits, wanted[part], temperature, top_k, mask))
    gathered, entropy = torch.cat([p[0] for p in parts]).float(), torch.cat([p[1] for p in parts]).float()
    out.logprobs = out.logprobs.index_put((rows, cols), gathered[:, 0])
    out.entropies = out.entropies.index_put((rows, cols), entropy)
    if out.candidates is not None:
        out.candidates = out.candidates.index_put((rows, cols), gathered[:, 1:])
    if top_k:
        out.top_logprobs = out.top_logprobs.index_put((rows, cols), torch.cat([p[2] for p in parts]).float())
        out.top_ids = out.top_ids.index_put((rows, cols), torch.cat([p[3] for p in parts]))
    return out


def _log_softmax_entropy(logits: torch.Tensor, temperature: float, allowed: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits / temperature)`` over one chunk ``[n, V]`` (``allowed`` ``[n, A]``
    masks constrained tokens to -inf) and its entropy ``[n]``."""
    logits = logits.float()
    if temperature != 1.0:  # a vocabulary-sized division: skip it when exact
        logits = logits / temperature
    if allowed is None:
        logp = torch.log_softmax(logits, dim=-1)
        p = logp.exp()
        entropy = -(p * logp).sum(-1)  # p == 0 gives 0 * -inf only for -inf logits, not here
    else:
        logp = torch.log_softmax(mask_logits(logits, allowed), dim=-1)
        p = logp.exp()
        # masked tokens: p = 0 and log p = -inf; their 0 * -inf must not be nan
        entropy = -(p * logp.masked_fill(torch.isinf(logp), 0.0)).sum(-1)
    return logp, entropy


def _gather_logprobs(logits: torch.Tensor, wanted: torch.Tensor, temperature: float,
                     top_k: int = 0, allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """For one chunk of tokens' logits ``[n, V]``: the log-probs of the ``wanted`` ids ``[n, C]``,
    the entropy, and (``top_k``) the top-k log-probs and ids; ``allowed`` ``[n, A]`` masks
    constrained tokens. The scoring passes' path (no gradient); the update's is ``_ChunkScores``."""
    logp, entropy = _log_softmax_entropy(logits, temperature, allowed)
    if not top_k:
        return logp.gather(-1, wanted), entropy
    top = torch.topk(logp.detach(), top_k, dim=-1)
    return logp.gather(-1, wanted), entropy, top.values, top.indices


class _ChunkScores(torch.autograd.Function):
    """``_gather_logprobs`` without top-k, for the update: the same forward, and its gradient
    written out, so that the backward reads one saved ``[n, V]`` log-softmax.

    With ``z = logits / T``, ``l = log_softmax(z)``, ``p = exp(l)`` and ``H = -sum p l``
    (the softmax Jacobian, as in any derivation of the cross-entropy gradient):
    ``d l_w / d z = onehot(w) - p`` and ``d H / d z = -p (l + H)``. So for upstream
    gradients ``g_c`` on the gathered columns and ``g_H`` on the entropy,
    ``d/dz = -p (g_H (l + H) + sum_c g_c) + sum_c g_c onehot(w_c)``, then ``/ T``.
    Masked tokens (``allowed``) have p = 0 and get 0. Autograd through a
    checkpointed ``_gather_logprobs`` ran the forward again and then the backward
    of each vocabulary-sized op: a 256-token chunk's forward and backward took
    0.55 s against 0.35 s now, on 2 AVX2 cores (bench/train_throughput_avx2.json,
    ``chunk_scores``; a few percent of an update, where action tokens are many).
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, wanted: torch.Tensor, temperature: float,
                allowed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        logp, entropy = _log_softmax_entropy(logits, temperature, allowed)
        ctx.save_for_backward(logp, wanted, entropy)
        ctx.temperature, ctx.dtype, ctx.masked = temperature, logits.dtype, allowed is not None
        return logp.gather(-1, wanted), entropy

    @staticmethod
    def backward(ctx: Any, grad_gathered: torch.Tensor, grad_entropy: torch.Tensor
                 ) -> tuple[torch.Tensor | None, ...]:
        logp, wanted, entropy = ctx.saved_tensors
        p = logp.exp()
        term = (logp.masked_fill(torch.isinf(logp), 0.0) if ctx.masked else logp) + entropy[:, None]
        term.mul_(grad_entropy[:, None]).add_(grad_gathered.sum(-1, keepdim=True))
        grad = term.mul_(p).neg_().scatter_add_(-1, wanted, grad_gathered)
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(ctx.dtype), None, None, None


_HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _hidden_states(model: Any, input_ids: torch.Tensor, model_mask: torch.Tensor | None,
                   position_ids: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states ``[B, T, H]``, which the vocabulary head maps to logits.

    ``token_scores`` applies the head itself, to the kept tokens only, so it needs
    a model whose logits are ``head(hidden)``: one that rescales or caps them
    (Gemma 2's soft-capping, Cohere's and Granite's scales) is refused, not
    scored wrongly.
    """
    for key in _HEAD_TRANSFORMS:
        if getattr(model.config, key, None) not in (None, 1, 1.0):
            raise ValueError(f"token_scores applies the vocabulary head itself and does not support "
                             f"config.{key}={getattr(model.config, key)!r} of {type(model).__name__}")
    return model.get_decoder()(input_ids=input_ids, attention_mask=model_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state


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
