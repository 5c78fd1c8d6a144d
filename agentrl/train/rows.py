"""Row packing: how a minibatch's samples are laid into the rows of one forward pass.

One job: lay samples (their tokens and per-token values) into rows and cut a
row's outputs back into samples. Two layouts of the same minibatch loop
(``batch.minibatch_step``) and scoring pass (``batch.score_samples``):

- **episode rows** (``episode_rows``): episodes laid end to end in rows of at
  most ``micro_batch_tokens`` (``pack_sequences``), each restarting at
  position 0 under a block-diagonal causal mask (``block_causal_mask``), or
  padded one episode a row where that costs fewer FLOPs
  (``padding_is_cheaper``). transformers only infers the block mask from
  ``position_ids`` on some versions and kernels, so we build it and pass it as
  a 4D mask, which ``eager`` and ``sdpa`` take as it is;
- **tree rows** (``tree_rows``, ``train.tree_packing``): the episodes of one
  ``RolloutTree`` share their prompt and every turn above a branch point; a
  trie of their tokens (``prefix_tree``) goes through the model once. Each
  token attends to its ancestors only (``tree_attention_mask``), sits at
  position = its depth, and its logprob comes from its parent's logits, so it
  gets the same logprob as in an episode row.

Mapping per-token values onto tree tokens. A trie node is shared by the
member episodes whose prefixes agree up to it:

- a shared *context* token (the prompt, an observation) is in no loss;
- a shared *action* token (a turn above a branch point, the partial node of a
  segment fork) is one node with ``k`` member episodes that sampled it. It
  carries two advantages: the **sum** of its members' positive advantages and,
  apart, the sum of their negative ones (``advantages`` is ``[1, N, 2]``); old,
  behaviour and reference logprobs are the members' mean (they are equal: the
  same token in the same context), and its version is the oldest.

Why the sums, one per sign: PPO-clip (and its dual clip) is positively
homogeneous in the advantage, ``loss(r, A1) + loss(r, A2) = loss(r, A1 + A2)``
when A1 and A2 have the same sign, at any ratio. Across signs it is not: once
the ratio leaves the clip range the clip binds on one sign's copies only, so
one summed advantage would merge what the per-episode clip keeps apart
(measured: 17% off in the gradient of a fork with A = 0.5, -1 and 2).
``ppo_clip_token_loss`` clips each of the two sums and adds them, which is the
sum of the ``k`` copies' losses in episode rows, whatever the signs and the
ratio. The minibatch's token-mean over episode tokens is kept by weighting
each tree row with ``(its distinct action tokens) / (the minibatch's episode
action tokens)``, and the tokens a staleness bound drops leave the
denominator of the whole minibatch (``batch.Minibatch``). So the loss and its
gradient equal episode packing's (up to float rounding).

A turn sampled under ``rollout.constrain: admissible`` carries its tokens'
allowed ids (``Sample.allowed``); both layouts lay them into the row's
``allowed`` ``[n, T, A]`` (-1 padding), which the scoring passes hand to
``token_scores``. A shared tree token takes its first member's list: the same
prefix is the same state, and so the same admissible actions.

Limits (checked once, when the config loads, ``TrainConfig``): ``loss.agg``
must be ``token-mean``, the KL and entropy terms off, no M2PO (its mask drops
single episode tokens, which a shared node cannot follow) and no top-k
distillation signal. The saving needs a tree's episodes in the same
minibatch; the 4D mask is dense, ``N^2`` booleans a row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..policy.prefix_cache import common_prefix

if TYPE_CHECKING:
    from .batch import Minibatch, Sample

__all__ = [
    "LAYOUTS",
    "ROW_FIELDS",
    "PackedRow",
    "PrefixTree",
    "Row",
    "TreeRow",
    "block_causal_mask",
    "lay_allowed",
    "collate_packed",
    "episode_rows",
    "forced_layout",
    "pack_sequences",
    "padding_is_cheaper",
    "prefix_tree",
    "row_fields",
    "tree_attention_mask",
    "tree_groups",
    "tree_row",
    "tree_rows",
    "tree_token_savings",
]


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



# --------------------------------------------------------------------------- prefix trees


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

# --------------------------------------------------------------------------- episode rows


@dataclass(slots=True)
class Row:
    """One forward pass's tensors, ``[n, T]`` each: one packed row, or one padded row a sample.

    ``where[k] = (r, start, end)``: the packed row's k-th sequence, sample
    ``seq_index[k]``, sits in tensor row r, columns ``[start, end)``. ``values``
    holds the per-token fields the loss reads. In the minibatch loop ``share`` is
    the weight the row's loss gets, ``rate_share`` the weight of its rates in the
    minibatch's stats, ``tokens`` the tokens it runs and ``minibatch`` the
    minibatch it is part of.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor
    seq_ids: torch.Tensor
    values: dict[str, torch.Tensor]
    where: list[tuple[int, int, int]] = field(default_factory=list)
    seq_index: list[int] = field(default_factory=list)
    tokens: int = 0
    share: float = 1.0
    rate_share: float = 1.0
    minibatch: Minibatch | None = None
    parents: torch.Tensor | None = None  # none: a token's source is the one before it
    allowed: torch.Tensor | None = None  # [n, T, A] ids a constrained token may take, -1 padding

    def lay_samples(self, per_sample: dict[int, torch.Tensor]) -> torch.Tensor:
        """Per-sample boolean ``[T_i]`` tensors laid onto the row's layout (False elsewhere)."""
        out = torch.zeros(self.mask.shape, dtype=torch.bool)
        for (r, start, end), i in zip(self.where, self.seq_index, strict=True):
            out[r, start:end] = per_sample[i]
        return out.to(self.mask.device)

    def per_sample(self, values: torch.Tensor | None) -> list[Any] | None:
        """``values`` ``[n, T, ...]`` cut back into one list per sample, in ``seq_index`` order."""
        if values is None:
            return None
        values = values.detach().cpu()
        flat = (values if values.dtype == torch.long else values.float()).tolist()
        return [flat[r][start:end] for r, start, end in self.where]


# The per-token values a loss can read from a row, by name: (getter, fill off the sample, dtype).
ROW_FIELDS: dict[str, tuple[Callable[[Sample], Any], float, torch.dtype]] = {
    "advantages": (lambda s: s.advantages, 0.0, torch.float32),
    "behaviour": (lambda s: s.behaviour, 0.0, torch.float32),
    "versions": (lambda s: s.versions, -1, torch.long),
    "old": (lambda s: s.old, 0.0, torch.float32),
    "ref": (lambda s: s.ref, 0.0, torch.float32),
    "old_top": (lambda s: s.old_top, -1, torch.long),
    "support": (lambda s: s.distill.support, -1, torch.long),
    "support_teacher": (lambda s: s.distill.support_teacher, 0.0, torch.float32),
    "distill_weights": (lambda s: s.distill.weights, 0.0, torch.float32),
}


def row_fields(name: str) -> tuple[Callable[[Sample], Any], float, torch.dtype]:
    """How ``name`` is laid into rows; a ``KeyError`` lists the known names."""
    try:
        return ROW_FIELDS[name]
    except KeyError:
        raise KeyError(f"no row field {name!r}; known: {', '.join(ROW_FIELDS)}") from None


def lay_allowed(samples: list[Sample], members: list[int], places: list[list[int]], shape: tuple[int, int],
                device: torch.device) -> torch.Tensor | None:
    """Members' ``Sample.allowed`` laid into ``[n, T, A]`` ids, -1 padding; None when none is constrained.

    ``places[j][t]`` is the flat index (``r * T + column``) where token t of
    sample ``members[j]`` sits; a place two members share keeps the first's list.
    """
    lists: dict[int, list[int]] = {}
    for i, where in zip(members, places, strict=True):
        for t, ids in (samples[i].allowed or {}).items():
            lists.setdefault(where[t], ids)
    if not lists:
        return None
    out = torch.full((shape[0] * shape[1], max(map(len, lists.values()))), -1, dtype=torch.long)
    for k, ids in lists.items():
        out[k, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out.view(shape[0], shape[1], -1).to(device)


def padding_is_cheaper(lengths: list[int], config: Any) -> bool:
    """Whether ``len(lengths)`` padded rows cost fewer FLOPs than one packed row of the same tokens.

    A packed row needs a dense block-causal mask, and attention kernels run
    every query-key pair of it: ``L**2`` pairs for ``L`` tokens, most of them
    masked. Padded rows run ``n * T**2`` pairs but ``n * T`` tokens through
    the linear layers, ``T`` the longest. Estimate per layer: ``2 * d * (2d +
    2 kv + 3 ffn)`` FLOPs a token for the projections and MLP, ``4 * d`` a
    query-key pair. The vocabulary head runs on the kept tokens' hidden states
    only, in either layout (``logprobs.token_scores``), so it costs the same in
    both and is left out. Measured on SmolLM2-135M, 16 episodes of 78 tokens:
    forward+backward 9.8 s padded, 14.0 s packed (before the head ran on kept
    tokens only). Not taken: one sequence a call (no padding at all), and groups of
    similar lengths, each padded to its own longest: on make run's SFT rows (8
    episodes of 240-400 tokens, a fifth of a padded row's tokens padding) neither beat
    one padded row in fp32, since a call of its own costs about what its padding saves
    (bench/row_layout.json).
    """
    d = int(getattr(config, "hidden_size", 0) or 0)
    if d == 0 or len(lengths) == 1:
        return len(lengths) == 1
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv = d // heads * int(getattr(config, "num_key_value_heads", heads) or heads)
    ffn = int(getattr(config, "intermediate_size", 4 * d) or 4 * d)
    layers = int(getattr(config, "num_hidden_layers", 1) or 1)
    per_token, per_pair = layers * 2 * d * (2 * d + 2 * kv + 3 * ffn), layers * 4 * d
    total, n, width = sum(lengths), len(lengths), max(lengths)
    packed = total * per_token + total**2 * per_pair
    padded = n * width * per_token + n * width**2 * per_pair
    return padded < packed


def _row(samples: list[Sample], row: PackedRow, pad_id: int, device: torch.device,
         fields: tuple[str, ...], padded: bool = False) -> Row:
    """The tensors of ``row``'s samples: packed under a block-causal mask, or ``padded`` one a row."""
    if padded:
        lengths = [end - start for start, end in row.spans]
        width = max(lengths)
        where = [(r, 0, n) for r, n in enumerate(lengths)]
        n_rows = len(lengths)
        ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
        for (r, _, n), i in zip(where, row.seq_index, strict=True):
            ids[r, :n] = torch.tensor(samples[i].input_ids)
        attn = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        pos = torch.arange(width).expand(n_rows, width).clone()
    else:
        ids, pos, attn = collate_packed([row], pad_id)
        width, n_rows = ids.shape[1], 1
        where = [(0, start, end) for start, end in row.spans]

    def lay(get: Callable[[Sample], Any], fill: float, dtype: torch.dtype) -> torch.Tensor:
        first = get(samples[row.seq_index[0]])
        extra = (len(first[0]),) if first and isinstance(first[0], list) else ()  # [T, K] per sample
        out = torch.full((n_rows, width, *extra), fill, dtype=dtype)
        for (r, start, end), i in zip(where, row.seq_index, strict=True):
            out[r, start:end] = torch.tensor(get(samples[i]), dtype=dtype)
        return out.to(device)

    values = {f: lay(*row_fields(f)) for f in fields}
    seq = torch.full((n_rows, width), -1, dtype=torch.long)
    for (r, start, end), i in zip(where, row.seq_index, strict=True):
        seq[r, start:end] = i
    places = [list(range(r * width + start, r * width + end)) for r, start, end in where]
    allowed = lay_allowed(samples, list(row.seq_index), places, (n_rows, width), device)
    return Row(ids.to(device), pos.to(device), attn.to(device),
               lay(lambda s: s.mask, 0, torch.bool), seq.to(device), values, where, list(row.seq_index),
               tokens=len(row.input_ids), allowed=allowed)


LAYOUTS = ("packed", "padded", "singles")
_FORCED: ContextVar[str | None] = ContextVar("agentrl_row_layout", default=None)


@contextlib.contextmanager
def forced_layout(name: str | None) -> Iterator[None]:
    """Within this block every episode row runs ``name``: ``packed``, ``padded`` (one a row, to
    the longest) or ``singles`` (a forward and backward each), not what ``padding_is_cheaper``
    picks; ``None``: the pick. For benches and tests (bench/row_layout.py)."""
    if name not in (None, *LAYOUTS):
        raise ValueError(f"layout must be one of {LAYOUTS}, got {name!r}")
    token = _FORCED.set(name)
    try:
        yield
    finally:
        _FORCED.reset(token)


def _one_each(row: PackedRow) -> list[PackedRow]:
    """``row``'s sequences, each in a row of its own."""
    out = []
    for (start, end), i in zip(row.spans, row.seq_index, strict=True):
        one = PackedRow()
        one.input_ids, one.position_ids = row.input_ids[start:end], list(range(end - start))
        one.spans, one.seq_index = [(0, end - start)], [i]
        out.append(one)
    return out


def episode_rows(net: torch.nn.Module, samples: list[Sample], idx: list[int], max_tokens: int, pad_id: int,
                 fields: tuple[str, ...], per_token: bool = True) -> Iterator[Row]:
    """Samples ``idx`` packed into rows of at most ``max_tokens`` (or padded, where cheaper), one at a time.

    Each row's ``share`` is its part of the minibatch's action tokens (``per_token``,
    the token-mean aggregations) or episodes, so that row means add up to the minibatch's.
    """
    layout = _FORCED.get()
    total = sum(samples[i].n_action for i in idx) if per_token else len(idx)
    packed_rows = pack_sequences([samples[i].input_ids for i in idx], max_tokens)
    for packed in packed_rows:
        packed.seq_index = [idx[j] for j in packed.seq_index]
    device = next(net.parameters()).device
    for packed in packed_rows:
        padded = layout != "packed" and (layout is not None or padding_is_cheaper(
            [end - start for start, end in packed.spans], net.config))
        for part in _one_each(packed) if layout == "singles" else [packed]:
            row = _row(samples, part, pad_id, device, fields, padded)
            row.share = (int(row.mask.sum()) if per_token else len(part.spans)) / max(total, 1)
            row.rate_share = row.share
            yield row


# --------------------------------------------------------------------------- tree rows


def tree_groups(seqs: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Indices of ``seqs`` grouped so that each group's prefix tree has at most ``max_tokens`` nodes.

    Sequences are taken in lexicographic order, so the ones that share a
    prefix are neighbours; in that order the nodes a sequence adds to the trie
    are its length minus its common prefix with the previous one (the longest
    common prefix with any earlier sequence is with the previous one). A group
    closes when the next sequence would not fit.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    groups: list[list[int]] = []
    size, prev = 0, None
    for i in sorted(range(len(seqs)), key=lambda i: seqs[i]):
        s = seqs[i]
        if not s or len(s) > max_tokens:
            raise ValueError(f"seqs[{i}] has {len(s)} tokens; it must have 1 to max_tokens={max_tokens}")
        new = len(s) - (common_prefix(prev, s) if prev is not None else 0)
        if not groups or size + new > max_tokens:
            groups.append([])
            size, new = 0, len(s)
        groups[-1].append(i)
        size, prev = size + new, s
    return groups



@dataclass(slots=True)
class TreeRow:
    """One prefix tree's tensors, ``[1, N]`` each (``attn`` ``[1, 1, N, N]``), as the loss sees a row.

    ``seq_index[j]`` is a sample index and ``trie.index[j]`` the node of each of its tokens.
    ``tokens``, ``share``, ``rate_share`` and ``minibatch`` as in ``Row``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attn: torch.Tensor
    parents: torch.Tensor
    mask: torch.Tensor
    seq_ids: torch.Tensor
    values: dict[str, torch.Tensor]
    seq_index: list[int]
    trie: PrefixTree
    sample_masks: list[torch.Tensor]
    tokens: int = 0
    share: float = 1.0
    rate_share: float = 1.0
    minibatch: Minibatch | None = None
    allowed: torch.Tensor | None = None  # [1, N, A] ids a constrained token may take, -1 padding

    def lay_samples(self, per_sample: dict[int, torch.Tensor]) -> torch.Tensor:
        """Per-sample boolean ``[T_i]`` tensors on the tree's nodes: a node is True when one of its members is."""
        out = torch.zeros(len(self.trie.input_ids), dtype=torch.long)
        for i, nodes in zip(self.seq_index, self.trie.index, strict=True):
            out.scatter_reduce_(0, torch.tensor(nodes), per_sample[i].long(), "amax")
        return out.bool()[None].to(self.mask.device)

    def per_sample(self, values: torch.Tensor | None) -> list[Any] | None:
        """Per-node ``values`` ``[1, N]`` read back in each member's layout, 0 off its action tokens."""
        if values is None:
            return None
        flat = values[0].detach().float().cpu()
        return [(flat[torch.tensor(nodes)] * mask).tolist()
                for nodes, mask in zip(self.trie.index, self.sample_masks, strict=True)]


def _node_values(samples: list[Sample], members: list[int], trie: PrefixTree, field: str,
                 counts: torch.Tensor) -> torch.Tensor:
    """Per-node ``field`` over the members that sampled the node (see the module docstring)."""
    n = len(trie.input_ids)
    get = row_fields(field)[0]
    if field == "versions":
        out = torch.full((n,), torch.iinfo(torch.long).max, dtype=torch.long)
        for i, nodes in zip(members, trie.index, strict=True):
            s = samples[i]
            idx = torch.tensor(nodes)[torch.tensor(s.mask, dtype=torch.bool)]
            v = torch.tensor(s.versions, dtype=torch.long)[torch.tensor(s.mask, dtype=torch.bool)]
            out.scatter_reduce_(0, idx, v, "amin")
        return torch.where(counts > 0, out, torch.full_like(out, -1))
    total = torch.zeros(n, 2) if field == "advantages" else torch.zeros(n)
    for i, nodes in zip(members, trie.index, strict=True):
        s = samples[i]
        v = torch.tensor(get(s), dtype=torch.float32) * torch.tensor(s.mask)
        if field == "advantages":  # [N, 2]: each sign summed apart, PPO-clip is homogeneous within one sign
            v = torch.stack([v.clamp(min=0.0), v.clamp(max=0.0)], -1)
        total.index_add_(0, torch.tensor(nodes), v)
    if field == "advantages":
        return total
    return total / counts.clamp(min=1)



def tree_row(samples: list[Sample], members: list[int], device: torch.device,
             fields: tuple[str, ...]) -> TreeRow:
    """The prefix tree of ``samples[members]`` with per-node mask counts and ``fields`` mapped on."""
    trie = prefix_tree([samples[i].input_ids for i in members])
    n = len(trie.input_ids)
    counts = torch.zeros(n)
    for i, nodes in zip(members, trie.index, strict=True):
        counts.index_add_(0, torch.tensor(nodes), torch.tensor(samples[i].mask, dtype=torch.float32))
    attn, depth = tree_attention_mask(trie.parents)
    values = {f: _node_values(samples, members, trie, f, counts).to(device)[None] for f in fields}
    return TreeRow(torch.tensor([trie.input_ids], device=device), depth[None].to(device),
                   attn[None, None].to(device), torch.tensor([trie.parents], device=device),
                   (counts > 0)[None].to(device), torch.zeros(1, n, dtype=torch.long, device=device),
                   values, members, trie, [torch.tensor(samples[i].mask, dtype=torch.float32) for i in members],
                   tokens=n, allowed=lay_allowed(samples, members, trie.index, (1, n), device))


def tree_rows(net: torch.nn.Module, samples: list[Sample], idx: list[int], max_tokens: int, pad_id: int,
              fields: tuple[str, ...], per_token: bool = True) -> list[TreeRow]:
    """Samples ``idx`` as prefix trees of at most ``max_tokens`` nodes; ``episode_rows``' signature.

    A row's ``share`` is its distinct action tokens over the minibatch's episode action
    tokens (advantages carry the rest); its rates are weighted per distinct token.
    """
    del pad_id, per_token  # a tree row has no padding; token-mean is checked with the config
    dev = next(net.parameters()).device
    total = sum(samples[i].n_action for i in idx)
    rows = [tree_row(samples, [idx[j] for j in g], dev, fields)
            for g in tree_groups([samples[i].input_ids for i in idx], max_tokens)]
    distinct = sum(int(r.mask.sum()) for r in rows)
    for row in rows:
        row.share = int(row.mask.sum()) / max(total, 1)
        row.rate_share = int(row.mask.sum()) / max(distinct, 1)
    return rows
