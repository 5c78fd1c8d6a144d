"""The training batch: samples, the scoring passes and the optimizer loop over minibatches.

One job: turn samples with advantages into gradients. ``Sample`` is one
episode as training rows (its tokens, loss mask and per-token values, and a
reference to its ``Episode``); ``samples_from_credit`` builds them from
``credit.assign``. ``score_samples`` is a no-grad pass that returns each
sample's token scores (old, reference or teacher logprobs, with top-k ids and
candidate log-probs for distribution-level distillation);
``minibatch_step`` accumulates one minibatch's gradient over its rows, calling
``loss.row_loss`` on each (each row's loss sees the whole minibatch through
``Minibatch``, so the loss does not depend on the packing), and
``train_on_samples`` runs shuffled epochs of optimizer steps. Both passes lay
the samples into episode rows or, with ``tree``, prefix-tree rows (``rows``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..policy.constrain import episode_allowed
from ..types import Episode
from .logprobs import token_scores
from .loss import PolicyLossConfig, StepLoss, TokenMasks, row_loss, token_masks, weight_negatives
from .metrics import merge_stat
from .model import autocast, base_model
from .rows import episode_rows, tree_rows

__all__ = [
    "DistillFields",
    "Minibatch",
    "Sample",
    "SampleScores",
    "constrain_samples",
    "minibatch_step",
    "minibatches",
    "samples_from_credit",
    "score_old",
    "score_samples",
    "shuffled_orders",
    "train_on_samples",
]


# --------------------------------------------------------------------------- samples


@dataclass(slots=True)
class DistillFields:
    """What on-policy distillation (``agentrl.train.distill``) adds to a sample, per token.

    Top-k lists are ``[T, K]`` (ids -1 and log-probs 0 where a token has none).
    """

    teacher: list[float] | None = None  # the teacher's log-prob of each token (0 off action tokens)
    teacher_top: list[list[int]] | None = None  # the teacher's K most likely next ids ...
    teacher_top_logprobs: list[list[float]] | None = None  # ... and their log-probs
    teacher_at_student_top: list[list[float]] | None = None  # the teacher's log-probs of Sample.old_top
    support: list[list[int]] | None = None  # the ids a distribution-level loss compares on (-1: none)
    support_teacher: list[list[float]] | None = None  # the teacher's log-probs of those ids
    weights: list[float] | None = None  # per-token weight of the distribution-level loss term
    privileged: str | None = None  # the env's privileged text, read by a privileged teacher
    expert_turns: list[tuple[int, int, str | None, bool]] | None = None  # (start, end, action, stopped)
    action_mask: list[int] | None = None  # the loss mask before TIP dropped tokens from it


@dataclass(slots=True)
class Sample:
    """One episode as training rows: tokens, loss mask and per-token values.

    ``old``, ``old_entropy`` and ``old_top`` come from the student's own scoring
    pass (PPO's anchor), ``ref`` from the KL reference, ``distill`` from a
    distillation teacher. ``turn_spans`` are the episode's action spans.
    ``allowed`` maps each token of a constrained turn (``rollout.constrain``)
    to the ids it was sampled among (``constrain_samples``); None: none.
    ``trained`` is set by the update: the tokens its loss kept in at least one
    epoch (``mask`` less those staleness or M2PO left out), for the viewer.
    """

    input_ids: list[int]
    mask: list[int]
    behaviour: list[float]
    advantages: list[float]
    versions: list[int]
    episode: Episode | None = None
    old: list[float] | None = None
    old_entropy: list[float] | None = None
    old_top: list[list[int]] | None = None
    ref: list[float] | None = None
    turn_spans: list[tuple[int, int]] | None = None
    distill: DistillFields = field(default_factory=DistillFields)
    allowed: dict[int, list[int]] | None = None
    trained: list[int] | None = None

    @property
    def n_action(self) -> int:
        return sum(self.mask)


def samples_from_credit(items: list[tuple[Episode, list[float]]],
                        skip_zero_advantage: bool = False) -> list[Sample]:
    """Training samples from ``credit.assign``'s (episode, per-token advantages) pairs.

    Episodes with no action token (one failed before its first turn) are left
    out, and with ``skip_zero_advantage`` those whose action tokens all have
    advantage 0 (no policy gradient). Each sample keeps its ``episode``.
    """
    out = []
    for ep, adv in items:
        if len(adv) != len(ep.input_ids):
            raise ValueError(f"advantages ({len(adv)}) not aligned with input_ids ({len(ep.input_ids)})")
        if not any(ep.loss_mask):
            continue
        if skip_zero_advantage and not any(a != 0.0 for a, m in zip(adv, ep.loss_mask, strict=True) if m):
            continue
        out.append(Sample(list(ep.input_ids), list(ep.loss_mask), list(ep.logprobs), list(adv),
                          list(ep.versions), episode=ep, turn_spans=list(ep.turn_spans)))
    return out


def constrain_samples(samples: list[Sample], tokenizer: Any) -> int:
    """Fill ``Sample.allowed`` of the samples whose episode has constrained turns, from the
    admissible actions their nodes recorded (``policy.constrain.episode_allowed``, the
    sampler's own trie); returns how many tokens are constrained."""
    tries: dict[tuple[str, ...], Any] = {}
    n = 0
    for s in samples:
        if s.episode is None or all(node.admissible is None for node in s.episode.nodes):
            continue
        s.allowed = episode_allowed(tokenizer, s.episode, tries) or None
        n += len(s.allowed or ())
    return n


@dataclass(slots=True)
class SampleScores:
    """One model's scores of one sample's tokens; 0 (ids -1) off the sample's action tokens."""

    logprobs: list[float]
    entropies: list[float]
    top_ids: list[list[int]] | None = None  # with top_k: the K most likely next ids ...
    top_logprobs: list[list[float]] | None = None  # ... and their log-probs
    candidates: list[list[float]] | None = None  # the log-probs of the candidate ids asked for



# --------------------------------------------------------------------------- minibatches


@dataclass(slots=True)
class Minibatch:
    """The minibatch a row belongs to, for what a row's loss decides over all of its tokens.

    ``samples[i]`` for ``i`` in ``idx`` are the minibatch's samples. A loss whose
    means leave tokens out (staleness) must divide by what the whole minibatch
    keeps, and M2PO's second moment is a statistic of every token of the
    minibatch: ``token_masks`` decides both once over the minibatch and cuts them
    to a row. The trained policy's logprobs that M2PO reads come from a no-grad
    pass over the minibatch (``score``), run on the first call that needs them and
    counted in ``tokens``: a loss that does not ask does not pay for it.
    """

    samples: list[Sample]
    idx: list[int]
    score: Callable[[list[Sample]], tuple[list[SampleScores], int]]
    tokens: int = 0
    _logprobs: list[list[float]] | None = None
    _masks: dict[tuple[PolicyLossConfig, int], tuple[Any, ...]] = field(default_factory=dict)

    def logprobs(self) -> list[list[float]]:
        """Each sample's logprobs under the weights being trained (no gradient), in ``idx`` order."""
        if self._logprobs is None:
            scores, self.tokens = self.score([self.samples[i] for i in self.idx])
            self._logprobs = [sc.logprobs for sc in scores]
        return self._logprobs

    def token_masks(self, cfg: PolicyLossConfig, current_version: int, row: Any) -> TokenMasks:
        """``loss.token_masks`` over the minibatch, cut to ``row`` (a ``Row`` or a tree row).

        The denominator is the row's part of the minibatch's, ``denominator * row.share``:
        ``minibatch_step`` multiplies the row's loss by ``share``, so the rows' losses add up
        to the minibatch's sums divided by the minibatch's denominator.
        """
        key = (cfg, current_version)
        if key not in self._masks:
            ss = [self.samples[i] for i in self.idx]

            def flat(per_sample: list[list[Any]], dtype: torch.dtype) -> torch.Tensor:
                return torch.tensor([x for xs in per_sample for x in xs], dtype=dtype)[None]

            m = token_masks(cfg, flat([s.mask for s in ss], torch.bool),
                            versions=flat([s.versions for s in ss], torch.long), current_version=current_version,
                            logprobs=flat(self.logprobs(), torch.float32) if cfg.m2po_tau is not None else None,
                            behaviour_logprobs=flat([s.behaviour for s in ss], torch.float32),
                            advantages=weight_negatives(flat([s.advantages for s in ss], torch.float32),
                                                        cfg.negative_weight),  # the loss's (M2PO's region)
                            seq_ids=flat([[k] * len(s.mask) for k, s in enumerate(ss)], torch.long))
            cuts = torch.tensor([0] + [len(s.mask) for s in ss]).cumsum(0).tolist()
            count = {i: m.count[0, a:b] for i, a, b in zip(self.idx, cuts[:-1], cuts[1:], strict=True)}
            keep = {i: m.keep[0, a:b] for i, a, b in zip(self.idx, cuts[:-1], cuts[1:], strict=True)}
            for i, k in keep.items():  # what any epoch trained on, for the saved trees
                was = self.samples[i].trained or [0] * len(k)
                self.samples[i].trained = [int(a or b) for a, b in zip(k.tolist(), was, strict=True)]
            self._masks[key] = (count, keep, m.denominator, m.stats)
        count, keep, denominator, stats = self._masks[key]
        return TokenMasks(row.lay_samples(count), row.lay_samples(keep), denominator * row.share, stats)



# --------------------------------------------------------------------------- scoring and the update


def _rows(tree: bool) -> Callable[..., Any]:
    """The row layout: prefix trees (``train.tree_packing``) or packed episodes."""
    return tree_rows if tree else episode_rows


@torch.no_grad()
def score_samples(net: torch.nn.Module, samples: list[Sample], max_tokens: int, pad_id: int,
                  temperature: float, *, top_k: int = 0, candidates: str | None = None,
                  tree: bool = False, groups: list[list[int]] | None = None) -> tuple[list[SampleScores], int]:
    """Each sample's token scores under ``net`` (no gradient), and the tokens run.

    With ``top_k`` each action token also gets its K most likely next ids and
    their log-probs; with ``candidates`` (a row field of ids, ``"old_top"``)
    the log-probs of those ids (distribution-level distillation). ``tree``: in
    prefix-tree rows (logprobs and entropies only). ``groups`` (indices covering
    ``samples``) packs each group into its own rows, as the update packs its
    minibatches: in bf16 a token's score depends on the row it shares, so only
    the same rows give the update's numbers.
    """
    dev = next(net.parameters()).device
    out: list[SampleScores | None] = [None] * len(samples)
    tokens = 0
    fields = (candidates,) if candidates else ()
    groups = [list(range(len(samples)))] if groups is None else groups
    if sorted(i for g in groups for i in g) != list(range(len(samples))):
        raise ValueError(f"groups must cover the {len(samples)} samples once each")
    rows = (row for g in groups for row in _rows(tree)(net, samples, g, max_tokens, pad_id, fields))
    for row in rows:
        with autocast(dev):
            sc = token_scores(net, row.input_ids, row.attn, row.mask, temperature, position_ids=row.position_ids,
                              parents=row.parents, candidates=row.values[candidates] if candidates else None,
                              top_k=top_k, allowed=row.allowed)
        cols = [row.per_sample(x) for x in (sc.logprobs, sc.entropies, sc.top_ids, sc.top_logprobs,
                                            sc.candidates)]
        for k, i in enumerate(row.seq_index):
            out[i] = SampleScores(*(c[k] if c is not None else None for c in cols))  # type: ignore[arg-type]
        tokens += row.tokens
    return out, tokens  # type: ignore[return-value]


def score_old(net: torch.nn.Module, samples: list[Sample], max_tokens: int, pad_id: int, temperature: float,
              *, top_k: int = 0, tree: bool = False, groups: list[list[int]] | None = None) -> int:
    """The student's own scoring pass: fills each sample's ``old`` (PPO's anchor), ``old_entropy``
    and, with ``top_k``, ``old_top``; returns the tokens run. ``groups``: the update's first
    minibatches, so that its first ratio is exactly 1 (``score_samples``)."""
    scores, tokens = score_samples(net, samples, max_tokens, pad_id, temperature, top_k=top_k, tree=tree,
                                   groups=groups)
    for s, sc in zip(samples, scores, strict=True):
        s.old, s.old_entropy, s.old_top = sc.logprobs, sc.entropies, sc.top_ids
    return tokens


def shuffled_orders(n: int, epochs: int, generator: torch.Generator) -> list[list[int]]:
    """Each epoch's order of the ``n`` samples, a permutation from ``generator``."""
    return [torch.randperm(n, generator=generator).tolist() for _ in range(epochs)]


def minibatches(order: list[int], size: int) -> list[list[int]]:
    """``order`` cut into minibatches of ``size`` samples (the last one may be smaller)."""
    return [order[s:s + size] for s in range(0, len(order), size)]


def minibatch_step(net: torch.nn.Module, samples: list[Sample], idx: list[int], loss: StepLoss, *,
                   fields: tuple[str, ...], per_token: bool, max_tokens: int, pad_id: int,
                   temperature: float, tree: bool = False, anchor: bool = False) -> tuple[dict[str, float], int]:
    """Accumulate the gradient of one minibatch over its rows; weighted stats, tokens run.

    ``anchor``: no scoring pass ran for this minibatch, the update's first (its weights are
    still the ones a pass would score): PPO's old logprobs are this forward's own, detached
    (ratio exactly 1), and they fill ``Sample.old`` and ``old_entropy``. A scoring pass that
    packs the same rows gives the same numbers (``score_samples``' ``groups``).

    Each row's loss (``loss.row_loss``) is weighted by ``Row.share``, its share of the
    minibatch's action tokens (``per_token``, the token-mean aggregations) or
    episodes, so that a loss that is a mean over its row's tokens sums to the
    minibatch's mean. A loss whose means leave tokens out, or that needs a
    statistic of the whole minibatch, reads ``Row.minibatch`` instead
    (``Minibatch.token_masks``): its rows then add up to the minibatch's loss
    whatever ``max_tokens`` puts in a row. The tokens run include the no-grad
    pass that ``Minibatch.logprobs`` may add. A row with no action token (TIP may drop all of
    a sample's) has no loss and is not run.
    """
    dev = next(net.parameters()).device
    mb = Minibatch(samples, idx, lambda ss: score_samples(net, ss, max_tokens, pad_id, temperature))
    stats: dict[str, float] = {}
    tokens = 0
    if anchor:
        fields = tuple(f for f in fields if f != "old")
    for row in _rows(tree)(net, samples, idx, max_tokens, pad_id, fields, per_token):
        if not bool(row.mask.any()):  # no action token left (TIP may drop them all): no loss, no graph
            if anchor:  # what the forward would have given them: 0 off the kept tokens
                for i in row.seq_index:
                    n = len(samples[i].input_ids)
                    samples[i].old, samples[i].old_entropy = [0.0] * n, [0.0] * n
            continue
        row.minibatch = mb
        with autocast(dev):
            out = token_scores(net, row.input_ids, row.attn, row.mask, temperature, position_ids=row.position_ids,
                               parents=row.parents, candidates=row.values.get("support"), allowed=row.allowed)
        if anchor:  # row_loss then anchors to logprobs.detach(): the same numbers
            for i, lp, ent in zip(row.seq_index, row.per_sample(out.logprobs), row.per_sample(out.entropies),
                                  strict=True):
                samples[i].old, samples[i].old_entropy = lp, ent
        if out.candidates is not None:  # the student's log-probs on the distillation support
            row.values["support_student"] = out.candidates
        value, st = row_loss(out.logprobs, out.entropies, row, loss)
        (value * row.share).backward()
        st["loss/entropy_mean"] = float((out.entropies.detach() * row.mask).sum() / row.mask.sum().clamp(min=1))
        for k, v in st.items():  # losses add up by share; rates are per token the row ran
            merge_stat(stats, k, v, row.share if k.startswith("loss/") and k != "loss/entropy_mean"
                       else row.rate_share)
        tokens += row.tokens
    return stats, tokens + mb.tokens


def train_on_samples(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                     samples: list[Sample], loss: StepLoss, *, fields: tuple[str, ...],
                     epochs: int, minibatch_size: int, max_tokens: int, max_grad_norm: float | None,
                     per_token: bool, pad_id: int, temperature: float, generator: torch.Generator | None = None,
                     on_minibatch: Callable[[], None] | None = None, tree: bool = False,
                     orders: list[list[int]] | None = None, anchor_first: bool = False) -> dict[str, float]:
    """``epochs`` shuffled passes of minibatches, one optimizer step each; mean stats.

    Each epoch's order is ``orders[epoch]`` where given (``shuffled_orders``, drawn
    before a scoring pass that packs like the update), else drawn from ``generator``.
    ``anchor_first``: the first minibatch's samples have no ``old`` yet; it anchors to its
    own forward and fills them (``minibatch_step``'s ``anchor``), so a scoring pass need
    only cover the others.
    """
    if orders is None:
        if generator is None:
            raise ValueError("train_on_samples needs a generator or the epochs' orders")
        if anchor_first:  # the caller scored all but the first minibatch: it must know which that is
            raise ValueError("train_on_samples with anchor_first needs the epochs' orders")
        orders = shuffled_orders(len(samples), epochs, generator)
    if len(orders) != epochs or any(sorted(o) != list(range(len(samples))) for o in orders):
        raise ValueError(f"orders must be {epochs} permutations of the {len(samples)} samples")
    net = base_model(model)
    params = [p for p in model.parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    n_steps, tokens, skipped, first = 0, 0, 0, True
    net.train()
    try:
        for order in orders:
            for idx in minibatches(order, minibatch_size):
                st, n = minibatch_step(net, samples, idx, loss, fields=fields,
                                       per_token=per_token, max_tokens=max_tokens, pad_id=pad_id,
                                       temperature=temperature, tree=tree, anchor=anchor_first and first)
                first = False
                if max_grad_norm is not None:
                    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
                else:
                    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
                stepped = bool(torch.isfinite(norm))
                if stepped:
                    optimizer.step()
                    if max_grad_norm is not None:
                        st["grad/norm"] = float(norm)
                    for k, v in st.items():
                        merge_stat(sums, k, v, 1.0)
                    n_steps, tokens = n_steps + 1, tokens + n
                else:  # AdamW would write NaN into every weight and its moments for good
                    skipped += 1
                if scheduler is not None:  # the schedule keeps its plan either way
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                if on_minibatch:
                    on_minibatch()
    finally:
        net.eval()
    out = {k: v if "/max_" in k else v / max(n_steps, 1) for k, v in sums.items()}
    out.update({"train/optimizer_steps": n_steps, "train/tokens": tokens})
    if skipped:
        out["train/nonfinite_grad_steps"] = skipped
        warnings.warn(f"{skipped} minibatch(es) had a gradient that is not finite: their optimizer "
                      "steps were skipped (train/nonfinite_grad_steps)", RuntimeWarning, stacklevel=2)
    return out
