"""The training batch: samples, their rows in a forward pass, scoring and the minibatch step.

One job: turn episodes with advantages into gradients. ``Sample`` is one
episode as training rows (its tokens, loss mask and per-token values, and a
reference to its ``Episode``); ``samples_from_credit`` builds them from
``credit.assign``. A minibatch is packed into rows of at most
``micro_batch_tokens`` tokens (each episode restarts at position 0 under a
block-causal mask), or padded one episode a row where that costs fewer FLOPs
(``padding_is_cheaper``). ``score_samples`` is a no-grad pass that returns
each sample's token scores (old, reference or teacher logprobs, with top-k ids
and candidate log-probs for distribution-level distillation);
``minibatch_step`` accumulates one minibatch's gradient over its rows (each
row's loss sees the whole minibatch through ``Minibatch``, so the loss does
not depend on the packing), and ``train_on_samples`` runs shuffled epochs of
optimizer steps.

The model side lives here too: what trains (``make_trainable``), the
optimizer and LR schedule, and ``sync_policy``, which hands the trained
weights to the policy that samples.

Precision (``train.precision``): ``auto`` is bf16 autocast when the model sits
on a GPU and fp32 on CPU; ``bf16`` autocasts on CPU too (on a CPU with AMX it
trains SmolLM2-135M about 1.8x faster than fp32: bench in
examples/train_alfworld_easy.yaml); ``fp32`` never autocasts. The trainer sets
it around its passes with ``precision``; the weights and optimizer stay fp32.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError
from ..types import Episode
from .logprobs import PackedRow, collate_packed, pack_sequences, token_scores
from .loss import PolicyLossConfig, TokenMasks, token_masks
from .metrics import merge_stat

__all__ = [
    "DistillFields",
    "LossFn",
    "Minibatch",
    "Row",
    "Sample",
    "SampleScores",
    "autocast",
    "precision",
    "base_model",
    "make_optimizer",
    "make_scheduler",
    "make_trainable",
    "minibatch_step",
    "padding_is_cheaper",
    "row_fields",
    "samples_from_credit",
    "score_old",
    "score_samples",
    "sync_policy",
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


@dataclass(slots=True)
class Sample:
    """One episode as training rows: tokens, loss mask and per-token values.

    ``old``, ``old_entropy`` and ``old_top`` come from the student's own scoring
    pass (PPO's anchor), ``ref`` from the KL reference, ``distill`` from a
    distillation teacher. ``turn_spans`` are the episode's action spans.
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


@dataclass(slots=True)
class SampleScores:
    """One model's scores of one sample's tokens; 0 (ids -1) off the sample's action tokens."""

    logprobs: list[float]
    entropies: list[float]
    top_ids: list[list[int]] | None = None  # with top_k: the K most likely next ids ...
    top_logprobs: list[list[float]] | None = None  # ... and their log-probs
    candidates: list[list[float]] | None = None  # the log-probs of the candidate ids asked for


# --------------------------------------------------------------------------- rows


@dataclass(slots=True)
class Row:
    """One forward pass's tensors, ``[n, T]`` each: one packed row, or one padded row a sample.

    ``where[k] = (r, start, end)``: the packed row's k-th sequence, sample
    ``seq_index[k]``, sits in tensor row r, columns ``[start, end)``. ``values``
    holds the per-token fields the loss reads. In ``minibatch_step``, ``share`` is
    the weight the row's loss gets and ``minibatch`` the minibatch it is part of.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor
    seq_ids: torch.Tensor
    values: dict[str, torch.Tensor]
    where: list[tuple[int, int, int]] = field(default_factory=list)
    seq_index: list[int] = field(default_factory=list)
    share: float = 1.0
    minibatch: Minibatch | None = None

    def lay_samples(self, per_sample: dict[int, torch.Tensor]) -> torch.Tensor:
        """Per-sample boolean ``[T_i]`` tensors laid onto the row's layout (False elsewhere)."""
        out = torch.zeros(self.mask.shape, dtype=torch.bool)
        for (r, start, end), i in zip(self.where, self.seq_index, strict=True):
            out[r, start:end] = per_sample[i]
        return out.to(self.mask.device)


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
                            advantages=flat([s.advantages for s in ss], torch.float32),
                            seq_ids=flat([[k] * len(s.mask) for k, s in enumerate(ss)], torch.long))
            cuts = torch.tensor([0] + [len(s.mask) for s in ss]).cumsum(0).tolist()
            count = {i: m.count[0, a:b] for i, a, b in zip(self.idx, cuts[:-1], cuts[1:], strict=True)}
            keep = {i: m.keep[0, a:b] for i, a, b in zip(self.idx, cuts[:-1], cuts[1:], strict=True)}
            self._masks[key] = (count, keep, m.denominator, m.stats)
        count, keep, denominator, stats = self._masks[key]
        return TokenMasks(row.lay_samples(count), row.lay_samples(keep), denominator * row.share, stats)


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


def padding_is_cheaper(lengths: list[int], config: Any, head_positions: list[set[int]] | None = None) -> bool:
    """Whether ``len(lengths)`` padded rows cost fewer FLOPs than one packed row of the same tokens.

    A packed row needs a dense block-causal mask, and attention kernels run
    every query-key pair of it: ``L**2`` pairs for ``L`` tokens, most of them
    masked. Padded rows run ``n * T**2`` pairs but ``n * T`` tokens through
    the linear layers, ``T`` the longest. Estimate per layer: ``2 * d * (2d +
    2 kv + 3 ffn)`` FLOPs a token for the projections and MLP, ``4 * d`` a
    query-key pair. The vocabulary head (``2 * d * V`` a position) runs on one
    set of positions for all rows (``token_logprobs``): packed, each sample's
    own ``head_positions``; padded, their union in every row. Measured on
    SmolLM2-135M, 16 episodes of 78 tokens: forward+backward 9.8 s padded,
    14.0 s packed.
    """
    d = int(getattr(config, "hidden_size", 0) or 0)
    if d == 0 or len(lengths) == 1:
        return len(lengths) == 1
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv = d // heads * int(getattr(config, "num_key_value_heads", heads) or heads)
    ffn = int(getattr(config, "intermediate_size", 4 * d) or 4 * d)
    layers = int(getattr(config, "num_hidden_layers", 1) or 1)
    per_token, per_pair = layers * 2 * d * (2 * d + 2 * kv + 3 * ffn), layers * 4 * d
    per_head = 2 * d * int(getattr(config, "vocab_size", 0) or 0)
    total, n, width = sum(lengths), len(lengths), max(lengths)
    packed = total * per_token + total**2 * per_pair
    padded = n * width * per_token + n * width**2 * per_pair
    if head_positions is not None:
        packed += per_head * sum(len(p) for p in head_positions)
        padded += per_head * n * len(set().union(*head_positions))
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
    return Row(ids.to(device), pos.to(device), attn.to(device),
               lay(lambda s: s.mask, 0, torch.bool), seq.to(device), values, where, list(row.seq_index))


def _rows(samples: list[Sample], idx: list[int], max_tokens: int) -> list[PackedRow]:
    """Pack samples ``idx`` into rows; ``seq_index`` then points into ``samples``."""
    rows = pack_sequences([samples[i].input_ids for i in idx], max_tokens)
    for r in rows:
        r.seq_index = [idx[j] for j in r.seq_index]
    return rows


def _padded(net: torch.nn.Module, row: PackedRow, samples: list[Sample]) -> bool:
    heads = [{t - 1 for t, m in enumerate(samples[i].mask) if m and t > 0} for i in row.seq_index]
    return padding_is_cheaper([end - start for start, end in row.spans], net.config, heads)


_PRECISION: ContextVar[str] = ContextVar("agentrl_precision", default="auto")


@contextlib.contextmanager
def precision(name: str) -> Iterator[None]:
    """Within this block ``autocast`` follows ``name`` (``auto``, ``bf16`` or ``fp32``)."""
    if name not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"train.precision={name!r}: use auto, bf16 or fp32")
    token = _PRECISION.set(name)
    try:
        yield
    finally:
        _PRECISION.reset(token)


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on a GPU, or anywhere under ``precision("bf16")``; else nothing (fp32)."""
    name = _PRECISION.get()
    if name == "bf16" or (name == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _per_sample(values: torch.Tensor | None, row: Row) -> list[Any] | None:
    """``values`` ``[n, T, ...]`` cut back into one list per sample of ``row``."""
    if values is None:
        return None
    values = values.detach().cpu()
    flat = (values if values.dtype == torch.long else values.float()).tolist()
    return [flat[r][start:end] for r, start, end in row.where]


# --------------------------------------------------------------------------- model and optimizer


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (adapters injected), else the model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    n = getattr(model.config, "num_hidden_layers", None)
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n:
            return m
    raise ConfigError("train.trainable=top_k: cannot find the model's list of decoder layers")


def make_trainable(model: torch.nn.Module, cfg: Any) -> torch.nn.Module:
    """Set what trains; returns the module whose parameters the optimizer and checkpoints see.

    ``full``: every parameter. ``top_k``: the top ``top_k_layers`` decoder
    layers and the final norm (the embeddings and the tied head stay frozen;
    measured 3-4x faster per step than full fine-tuning on CPU for
    SmolLM2-135M). ``lora``: adapters injected into ``model`` in place, so a
    policy holding ``model`` samples with them. ``cfg`` is a ``TrainConfig``.
    """
    if cfg.trainable == "full":
        model.requires_grad_(True)
        return model
    if cfg.trainable == "top_k":
        layers = _decoder_layers(model)
        if cfg.top_k_layers > len(layers):
            raise ConfigError(f"train.top_k_layers={cfg.top_k_layers} but the model has "
                              f"{len(layers)} layers")
        model.requires_grad_(False)
        for layer in list(layers)[-cfg.top_k_layers:]:
            layer.requires_grad_(True)
        norm = getattr(getattr(model, "model", model), "norm", None)
        if norm is not None:
            norm.requires_grad_(True)
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise ConfigError("train.trainable=lora needs the peft package: pip install peft") from e
    lc = cfg.lora
    return get_peft_model(model, LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                                            target_modules=lc.target_modules, task_type="CAUSAL_LM"))


def make_optimizer(model: torch.nn.Module, lr: float, cfg: Any) -> torch.optim.AdamW:
    """AdamW over the parameters that require grad (``cfg``: a ``TrainConfig``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("nothing to train: no parameter requires grad")
    return torch.optim.AdamW(params, lr=lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: Any,
                   total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_steps`` optimizer steps, then constant, cosine or linear to 0."""
    warm, total = cfg.warmup_steps, max(total_steps, 1)

    def factor(t: int) -> float:
        if t < warm:
            return (t + 1) / warm
        if cfg.lr_schedule == "constant":
            return 1.0
        frac = min((t - warm) / max(total - warm, 1), 1.0)
        return 0.5 * (1 + math.cos(math.pi * frac)) if cfg.lr_schedule == "cosine" else 1 - frac

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def sync_policy(policy: Any, model: torch.nn.Module) -> None:
    """Give the policy the trained weights and a new version.

    With the ``hf`` backend in this process the policy holds the very model
    being trained, so the weights are already there: ``weights_updated()``
    bumps its version and drops its prefix cache (keys and values of the old
    weights). Any other backend gets ``update_weights(state_dict)``.
    """
    net = base_model(model)
    if getattr(policy, "model", None) is net:
        if not hasattr(policy, "weights_updated"):
            raise TypeError(f"{type(policy).__name__} holds the trained model but has no weights_updated()")
        policy.weights_updated()
        return
    if model is not net:  # another process's copy of a LoRA model needs merged weights
        net = copy.deepcopy(model).merge_and_unload()
    policy.update_weights({k: v.detach() for k, v in net.state_dict().items()})


# --------------------------------------------------------------------------- scoring and the update


LossFn = Callable[[torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, dict[str, float]]]


@torch.no_grad()
def score_samples(net: torch.nn.Module, samples: list[Sample], max_tokens: int, pad_id: int,
                  temperature: float, *, top_k: int = 0,
                  candidates: str | None = None) -> tuple[list[SampleScores], int]:
    """Each sample's token scores under ``net`` (no gradient), and the tokens run.

    With ``top_k`` each action token also gets its K most likely next ids and
    their log-probs; with ``candidates`` (a row field of ids, ``"old_top"``)
    the log-probs of those ids (distribution-level distillation).
    """
    dev = next(net.parameters()).device
    out: list[SampleScores | None] = [None] * len(samples)
    tokens = 0
    fields = (candidates,) if candidates else ()
    for packed in _rows(samples, list(range(len(samples))), max_tokens):
        t = _row(samples, packed, pad_id, dev, fields, _padded(net, packed, samples))
        with autocast(dev):
            sc = token_scores(net, t.input_ids, t.attn, t.mask, temperature, position_ids=t.position_ids,
                              candidates=t.values[candidates] if candidates else None, top_k=top_k)
        cols = [_per_sample(x, t) for x in (sc.logprobs, sc.entropies, sc.top_ids, sc.top_logprobs,
                                            sc.candidates)]
        for k, i in enumerate(packed.seq_index):
            out[i] = SampleScores(*(c[k] if c is not None else None for c in cols))  # type: ignore[arg-type]
        tokens += len(packed.input_ids)
    return out, tokens  # type: ignore[return-value]


def score_old(net: torch.nn.Module, samples: list[Sample], max_tokens: int, pad_id: int, temperature: float,
              *, top_k: int = 0, score: Callable[..., tuple[list[SampleScores], int]] = score_samples) -> int:
    """The student's own scoring pass: fills each sample's ``old`` (PPO's anchor), ``old_entropy``
    and, with ``top_k``, ``old_top``; returns the tokens run. ``score``: ``score_samples`` or
    tree packing's ``score_samples_tree``."""
    scores, tokens = score(net, samples, max_tokens, pad_id, temperature, top_k=top_k)
    for s, sc in zip(samples, scores, strict=True):
        s.old, s.old_entropy, s.old_top = sc.logprobs, sc.entropies, sc.top_ids
    return tokens


def minibatch_step(net: torch.nn.Module, samples: list[Sample], idx: list[int], loss_fn: LossFn,
                   fields: tuple[str, ...], per_token: bool, max_tokens: int, pad_id: int,
                   temperature: float) -> tuple[dict[str, float], int]:
    """Accumulate the gradient of one minibatch over its rows; weighted stats, tokens run.

    Each row's loss is weighted by ``Row.share``, its share of the minibatch's
    action tokens (``per_token``, the token-mean aggregations) or episodes, so
    that a loss that is a mean over its row's tokens sums to the minibatch's
    mean. A loss whose means leave tokens out, or that needs a statistic of the
    whole minibatch, reads ``Row.minibatch`` instead (``Minibatch.token_masks``,
    which ``Trainer._rl_loss`` passes to ``policy_loss``): its rows then add up to
    the minibatch's loss whatever ``max_tokens`` puts in a row. The tokens run
    include the no-grad pass that ``Minibatch.logprobs`` may add.
    """
    dev = next(net.parameters()).device
    total = sum(samples[i].n_action for i in idx) if per_token else len(idx)
    mb = Minibatch(samples, idx, lambda ss: score_samples(net, ss, max_tokens, pad_id, temperature))
    stats: dict[str, float] = {}
    tokens = 0
    for packed in _rows(samples, idx, max_tokens):
        t = _row(samples, packed, pad_id, dev, fields, _padded(net, packed, samples))
        t.share = (int(t.mask.sum()) if per_token else len(packed.spans)) / max(total, 1)
        t.minibatch = mb
        with autocast(dev):
            out = token_scores(net, t.input_ids, t.attn, t.mask, temperature, position_ids=t.position_ids,
                               candidates=t.values.get("support"))
        lp, ent = out.logprobs, out.entropies
        if out.candidates is not None:  # the student's log-probs on the distillation support
            t.values["support_student"] = out.candidates
        loss, st = loss_fn(lp, ent, t)
        (loss * t.share).backward()
        st["loss/entropy_mean"] = float((ent.detach() * t.mask).sum() / t.mask.sum().clamp(min=1))
        for k, v in st.items():
            merge_stat(stats, k, v, t.share)
        tokens += len(packed.input_ids)
    return stats, tokens + mb.tokens


def train_on_samples(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                     samples: list[Sample], loss_fn: LossFn, *, fields: tuple[str, ...],
                     epochs: int, minibatch_size: int, max_tokens: int, max_grad_norm: float | None,
                     per_token: bool, pad_id: int, temperature: float, generator: torch.Generator,
                     on_minibatch: Callable[[], None] | None = None,
                     minibatch: Callable[..., tuple[dict[str, float], int]] | None = None
                     ) -> dict[str, float]:
    """``epochs`` shuffled passes of minibatches, one optimizer step each; mean stats.

    ``minibatch`` replaces ``minibatch_step`` (tree packing's ``tree_minibatch``).
    """
    net = base_model(model)
    params = [p for p in model.parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    n_steps, tokens = 0, 0
    net.train()
    try:
        for _ in range(epochs):
            order = torch.randperm(len(samples), generator=generator).tolist()
            for s in range(0, len(order), minibatch_size):
                st, n = (minibatch or minibatch_step)(net, samples, order[s:s + minibatch_size], loss_fn,
                                                      fields, per_token, max_tokens, pad_id, temperature)
                if max_grad_norm is not None:
                    st["grad/norm"] = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                for k, v in st.items():
                    merge_stat(sums, k, v, 1.0)
                n_steps, tokens = n_steps + 1, tokens + n
                if on_minibatch:
                    on_minibatch()
    finally:
        net.eval()
    out = {k: v if "/max_" in k else v / max(n_steps, 1) for k, v in sums.items()}
    out.update({"train/optimizer_steps": n_steps, "train/tokens": tokens})
    return out
