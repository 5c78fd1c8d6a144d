"""Tree packing: a minibatch's episodes go through the model as prefix trees, each shared token once.

One job: the ``train.tree_packing`` layout of the trainer's two forward
passes (the no-grad scoring of old, reference or teacher logprobs, and the
loss forward). The episodes of one ``RolloutTree`` share their opening prompt
and every turn above a branch point; episode packing (``pack_sequences``) runs
those tokens once per episode, a prefix tree (``prefix_tree``) runs them once.
Each tree row is one ``[1, N]`` row: token i attends to its ancestors
(``tree_attention_mask``), sits at position = its depth, and its logprob comes
from its parent's logits, so every token sees exactly the context it had in
its own episode and gets the same logprob as in episode packing.

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
the ratio leaves the clip range the clip binds on one sign's copies only (r >
1 + clip_high removes the gradient of A > 0, not of A < 0), so one summed
advantage would merge what the per-episode clip keeps apart (measured: 17% off
in the gradient of a fork with A = 0.5, -1 and 2). ``ppo_clip_token_loss``
clips each of the two sums and adds them, which is the sum of the ``k`` copies'
losses in episode packing, whatever the signs and the ratio. The
minibatch's token-mean over episode tokens is kept by weighting each row with
``(its distinct action tokens) / (the minibatch's episode action tokens)``, and
the tokens a staleness bound drops leave the denominator of the whole
minibatch (``batch.Minibatch``). So the loss and its gradient equal episode
packing's (up to float rounding), with turn-level tree credit (every member of
a shared token has the same advantage) and with episode-level group credit on
trees that branch between turns alike.

Limits (checked when the config loads, ``TrainConfig``): ``loss.agg`` must be
``token-mean`` (the sequence means need per-episode sums, which a shared token
does not split into), and the KL and entropy terms must be off (they have no
advantage to carry the multiplicity; ``policy_loss`` would count each distinct
token once). M2PO (``loss.m2po_tau``) cannot be used either: its mask drops
single episode tokens (ties included), which a node shared by several episodes
cannot follow; ``tree_minibatch`` raises at the first row. The saving needs a
tree's episodes in the same minibatch: with
``minibatch_size`` at least the batch's episodes, every tree is one row (when
it fits ``micro_batch_tokens``). The 4D mask is dense, ``N^2`` booleans a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..policy.prefix_cache import common_prefix
from .batch import LossFn, Minibatch, Sample, SampleScores, autocast, row_fields
from .logprobs import PrefixTree, prefix_tree, token_logprobs, tree_attention_mask
from .metrics import merge_stat

__all__ = [
    "TreeRow",
    "score_samples_tree",
    "tree_groups",
    "tree_minibatch",
    "tree_row",
]


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

    ``members[j]`` is a sample index and ``trie.index[j]`` the node of each of its tokens.
    ``share`` and ``minibatch`` as in ``batch.Row``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attn: torch.Tensor
    parents: torch.Tensor
    mask: torch.Tensor
    seq_ids: torch.Tensor
    values: dict[str, torch.Tensor]
    members: list[int]
    trie: PrefixTree
    share: float = 1.0
    minibatch: Minibatch | None = None

    def lay_samples(self, per_sample: dict[int, torch.Tensor]) -> torch.Tensor:
        """Per-sample boolean ``[T_i]`` tensors on the tree's nodes: a node is True when one of its members is."""
        out = torch.zeros(len(self.trie.input_ids), dtype=torch.long)
        for i, nodes in zip(self.members, self.trie.index, strict=True):
            out.scatter_reduce_(0, torch.tensor(nodes), per_sample[i].long(), "amax")
        return out.bool()[None].to(self.mask.device)


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
                   values, members, trie)


def _forward(net: torch.nn.Module, row: TreeRow, temperature: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    with autocast(row.input_ids.device):
        return token_logprobs(net, row.input_ids, row.attn, row.mask, temperature,
                              position_ids=row.position_ids, parents=row.parents)


@torch.no_grad()
def score_samples_tree(net: torch.nn.Module, samples: list[Sample], max_tokens: int, pad_id: int,
                       temperature: float, *, top_k: int = 0,
                       candidates: str | None = None) -> tuple[list[SampleScores], int]:
    """``score_samples`` in tree rows: each sample's logprobs and entropies (0 off its action
    tokens), and the tokens run. No top-k or candidates (the config refuses them)."""
    del pad_id  # a tree row has no padding
    if top_k or candidates:
        raise ConfigError("train.tree_packing does not carry top-k distributions")
    dev = next(net.parameters()).device
    out: list[SampleScores | None] = [None] * len(samples)
    tokens = 0
    for group in tree_groups([s.input_ids for s in samples], max_tokens):
        row = tree_row(samples, group, dev, ())
        lp, ent = _forward(net, row, temperature)
        flat, flat_ent = lp[0].detach().float().cpu(), ent[0].detach().float().cpu()
        for i, nodes in zip(row.members, row.trie.index, strict=True):
            mask = torch.tensor(samples[i].mask, dtype=torch.float32)
            at = torch.tensor(nodes)
            out[i] = SampleScores((flat[at] * mask).tolist(), (flat_ent[at] * mask).tolist())
        tokens += row.input_ids.shape[1]
    return out, tokens  # type: ignore[return-value]


def _no_m2po(samples: list[Sample]) -> tuple[list[SampleScores], int]:
    """The minibatch's logprobs, asked for by M2PO's mask only, which tree rows cannot carry."""
    raise ConfigError("train.tree_packing cannot carry M2PO's mask (it drops single episode tokens, "
                      "and a tree node is shared by several): set loss.m2po_tau=null or tree_packing=false")


def tree_minibatch(net: torch.nn.Module, samples: list[Sample], idx: list[int], loss_fn: LossFn,
                   fields: tuple[str, ...], per_token: bool, max_tokens: int, pad_id: int,
                   temperature: float) -> tuple[dict[str, float], int]:
    """``batch.minibatch_step`` in tree rows: accumulate one minibatch's gradient; weighted stats, tokens run."""
    if not per_token:
        raise ConfigError("train.tree_packing needs train.loss.agg='token-mean'")
    del pad_id
    dev = next(net.parameters()).device
    total = sum(samples[i].n_action for i in idx)
    groups = tree_groups([samples[i].input_ids for i in idx], max_tokens)
    rows = [tree_row(samples, [idx[j] for j in g], dev, fields) for g in groups]
    distinct = sum(int(r.mask.sum()) for r in rows)
    mb = Minibatch(samples, idx, _no_m2po)
    stats: dict[str, float] = {}
    tokens = 0
    for row in rows:
        row.share = int(row.mask.sum()) / max(total, 1)  # distinct action tokens; A carries the rest
        row.minibatch = mb
        lp, ent = _forward(net, row, temperature)
        loss, st = loss_fn(lp, ent, row)
        share = row.share
        (loss * share).backward()
        st["loss/entropy_mean"] = float((ent.detach() * row.mask).sum() / row.mask.sum().clamp(min=1))
        for k, v in st.items():  # losses add up as in episode packing; rates are per distinct token
            w = share if k.startswith("loss/") and k != "loss/entropy_mean" else int(row.mask.sum()) / max(distinct, 1)
            merge_stat(stats, k, v, w)
        tokens += row.input_ids.shape[1]
    return stats, tokens + mb.tokens
