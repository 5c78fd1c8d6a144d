"""The RL loop: rollouts, credit, loss, optimizer step, weight sync, eval, checkpoint.

One step of ``Trainer.run`` (step k trains on the task seeds of step k, so the
step *is* the data position and a resumed run sees the same data):

1. **rollout**: ``collect`` grows one tree per task seed, ``rollout.group_size``
   episodes each, under the policy's current weights;
2. **credit**: ``agentrl.credit.assign`` turns trees into per-token advantages;
3. **old logprobs**: the trainer scores every action token under its own
   weights, without gradient. These are PPO's anchor; the rollout's behaviour
   logprobs are compared with them (mismatch KL and max |Δlogprob|, logged
   every step) and TIS reweights by their ratio;
4. **update**: ``epochs`` passes over the batch in minibatches of
   ``minibatch_size`` episodes, one AdamW step each. A minibatch is packed
   into rows of at most ``micro_batch_tokens`` tokens (each episode restarts at
   position 0 under a block-causal mask) and gradients accumulate over the
   rows, each row's loss weighted by its share of the minibatch's tokens (or
   episodes, for the sequence-mean aggregations) so the sum is the
   minibatch's loss;
5. **sync**: with the ``hf`` backend in this process the policy holds the very
   model being trained, so the weights are already there: only the version
   increments and the prefix cache (keys and values of the old weights) is
   dropped. Any other backend gets ``update_weights(state_dict)``;
6. **eval** on held-out task seeds every ``eval_every`` steps, and
   **checkpoint** every ``checkpoint_every`` steps.

Precision: fp32 on CPU; bf16 autocast when the model sits on a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import math
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from ..errors import ConfigError
from ..policy.base import request_seed
from ..types import Episode, RolloutTree
from .checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_trainable,
    restore_rng,
    save_checkpoint,
)
from .config import TrainConfig, TrainRunConfig
from .logprobs import PackedRow, collate_packed, pack_sequences, token_scores
from .loss import mismatch_stats, policy_loss
from .metrics import MetricsLogger, PeakMemory, merge_stat, plot_learning_curve

__all__ = [
    "Sample",
    "Trainer",
    "eval_seeds",
    "evaluate",
    "make_optimizer",
    "make_scheduler",
    "make_trainable",
    "samples_from_credit",
    "step_task_seeds",
    "sync_policy",
    "train",
    "train_on_samples",
]


# --------------------------------------------------------------------------- data


@dataclass(slots=True)
class Sample:
    """One episode as training tensors' rows: tokens, loss mask and per-token values."""

    input_ids: list[int]
    mask: list[int]
    behaviour: list[float]
    advantages: list[float]
    versions: list[int]
    old: list[float] | None = None
    ref: list[float] | None = None
    teacher: list[float] | None = None
    privileged: str | None = None  # the env's privileged text, for a distillation teacher
    expert_turns: list[tuple[int, int, str | None, bool]] | None = None  # for teacher: expert
    turn_spans: list[tuple[int, int]] | None = None  # the episode's, for per-turn distillation weights
    old_entropy: list[float] | None = None  # the student's entropies, filled with ``old``
    # Distribution-level distillation (opd.py): per token, K or C ids / log-probs.
    old_top: list[list[int]] | None = None  # the student's top-K ids, from its scoring pass
    teacher_top: list[list[int]] | None = None  # the teacher's top-K ids ...
    teacher_top_lp: list[list[float]] | None = None  # ... and their log-probs
    teacher_cand: list[list[float]] | None = None  # the teacher's log-probs of old_top
    cand_ids: list[list[int]] | None = None  # the support the loss compares on (-1: left out)
    cand_teacher: list[list[float]] | None = None  # the teacher's log-probs there
    distill_w: list[float] | None = None  # per-token weight of the distillation loss term

    @property
    def n_action(self) -> int:
        return sum(self.mask)


def samples_from_credit(items: list[tuple[Episode, list[float]]],
                        skip_zero_advantage: bool = False) -> list[Sample]:
    """Training samples from ``credit.assign``'s (episode, per-token advantages) pairs."""
    out = []
    for ep, adv in items:
        if len(adv) != len(ep.input_ids):
            raise ValueError(f"advantages ({len(adv)}) not aligned with input_ids ({len(ep.input_ids)})")
        if not any(ep.loss_mask):
            continue  # no action token (an episode failed before its first turn)
        if skip_zero_advantage and not any(a != 0.0 for a, m in zip(adv, ep.loss_mask, strict=True) if m):
            continue
        out.append(Sample(list(ep.input_ids), list(ep.loss_mask), list(ep.logprobs), list(adv),
                          list(ep.versions)))
    return out


def step_task_seeds(cfg: TrainConfig, step: int) -> list[int]:
    """The task seeds step ``step`` (0-based) trains on: the data position is the step."""
    n = cfg.tasks_per_step
    if cfg.task_seeds is not None:
        pool = cfg.task_seeds
        return [pool[(step * n + j) % len(pool)] for j in range(n)]
    return [cfg.task_seed_start + step * n + j for j in range(n)]


@dataclass(slots=True)
class _Row:
    """One forward pass's tensors, ``[n, T]`` each: one packed row, or one padded row a sample.

    ``where[k] = (r, start, end)``: the packed row's k-th sequence sits in tensor row r,
    columns ``[start, end)``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor
    seq_ids: torch.Tensor
    values: dict[str, torch.Tensor]
    where: list[tuple[int, int, int]] = field(default_factory=list)


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
         fields: tuple[str, ...], padded: bool = False) -> _Row:
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

    def lay(get: Callable[[Sample], list[Any]], fill: float, dtype: torch.dtype) -> torch.Tensor:
        first = get(samples[row.seq_index[0]])
        extra = (len(first[0]),) if first and isinstance(first[0], list) else ()  # [T, K] per sample
        out = torch.full((n_rows, width, *extra), fill, dtype=dtype)
        for (r, start, end), i in zip(where, row.seq_index, strict=True):
            out[r, start:end] = torch.tensor(get(samples[i]), dtype=dtype)
        return out.to(device)

    values = {f: lay(lambda s, f=f: getattr(s, f), -1 if f in _ID_FIELDS else 0.0,
                     torch.long if f in _ID_FIELDS else torch.float32) for f in fields}
    seq = torch.full((n_rows, width), -1, dtype=torch.long)
    for (r, start, end), i in zip(where, row.seq_index, strict=True):
        seq[r, start:end] = i
    return _Row(ids.to(device), pos.to(device), attn.to(device),
                lay(lambda s: s.mask, 0, torch.bool), seq.to(device), values, where)


_ID_FIELDS = ("versions", "old_top", "cand_ids")  # laid as integers, -1 where a sample has none


def _rows(samples: list[Sample], idx: list[int], max_tokens: int) -> list[PackedRow]:
    """Pack samples ``idx`` into rows; ``seq_index`` then points into ``samples``."""
    rows = pack_sequences([samples[i].input_ids for i in idx], max_tokens)
    for r in rows:
        r.seq_index = [idx[j] for j in r.seq_index]
    return rows


def _padded(net: torch.nn.Module, row: PackedRow, samples: list[Sample]) -> bool:
    heads = [{t - 1 for t, m in enumerate(samples[i].mask) if m and t > 0} for i in row.seq_index]
    return padding_is_cheaper([end - start for start, end in row.spans], net.config, heads)


def _autocast(device: torch.device) -> contextlib.AbstractContextManager:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _unpack(values: torch.Tensor, row: _Row, samples: list[Sample], seq_index: list[int], attr: str) -> None:
    values = values.detach().cpu()
    flat = (values if values.dtype == torch.long else values.float()).tolist()
    for (r, start, end), i in zip(row.where, seq_index, strict=True):
        setattr(samples[i], attr, flat[r][start:end])


# --------------------------------------------------------------------------- model and optimizer


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (adapters injected), else the model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    n = getattr(model.config, "num_hidden_layers", None)
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n:
            return m
    raise ConfigError("train.trainable=top_k: cannot find the model's list of decoder layers")


def make_trainable(model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
    """Set what trains; returns the module whose parameters the optimizer and checkpoints see.

    ``full``: every parameter. ``top_k``: the top ``top_k_layers`` decoder
    layers and the final norm (the embeddings and the tied head stay frozen;
    measured 3-4x faster per step than full fine-tuning on CPU for
    SmolLM2-135M). ``lora``: adapters injected into ``model`` in place, so a
    policy holding ``model`` samples with them.
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


def make_optimizer(model: torch.nn.Module, lr: float, cfg: TrainConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("nothing to train: no parameter requires grad")
    return torch.optim.AdamW(params, lr=lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig,
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
    """Give the policy the trained weights and a new version (see the module docstring, step 5)."""
    net = _base(model)
    if getattr(policy, "model", None) is net:
        if hasattr(policy, "weights_updated"):
            policy.weights_updated()
        else:  # the same object: nothing to copy, only stale keys and values to drop
            policy.version += 1
            if getattr(policy, "prefix_cache", None) is not None:
                policy.prefix_cache.clear()
        return
    if model is not net:  # another process's copy of a LoRA model needs merged weights
        net = copy.deepcopy(model).merge_and_unload()
    policy.update_weights({k: v.detach() for k, v in net.state_dict().items()})


# --------------------------------------------------------------------------- the update


LossFn = Callable[[torch.Tensor, torch.Tensor, _Row], tuple[torch.Tensor, dict[str, float]]]


@torch.no_grad()
def score_samples(net: torch.nn.Module, samples: list[Sample], attr: str, max_tokens: int,
                  pad_id: int, temperature: float, top_k: int = 0, candidates: str | None = None) -> int:
    """Fill ``sample.<attr>`` with each token's logprob under ``net`` (no gradient); returns tokens run.

    For distribution-level distillation: ``top_k`` also fills ``<attr>_top``
    (the K most likely ids; for the teacher, ``teacher_top_lp`` too), and
    ``candidates`` (``"old_top"``) fills ``<attr>_cand`` with the log-probs of
    those ids.
    """
    dev = next(net.parameters()).device
    tokens = 0
    fields = (candidates,) if candidates else ()
    for row in _rows(samples, list(range(len(samples))), max_tokens):
        t = _row(samples, row, pad_id, dev, fields, _padded(net, row, samples))
        with _autocast(dev):
            out = token_scores(net, t.input_ids, t.attn, t.mask, temperature, position_ids=t.position_ids,
                               candidates=t.values[candidates] if candidates else None, top_k=top_k)
        _unpack(out.logprobs, t, samples, row.seq_index, attr)
        if attr == "old":  # the student's own pass: its entropies come free (TIP reads them)
            _unpack(out.entropies, t, samples, row.seq_index, "old_entropy")
        if top_k:
            _unpack(out.top_ids, t, samples, row.seq_index, f"{attr}_top")
            if attr == "teacher":
                _unpack(out.top_logprobs, t, samples, row.seq_index, "teacher_top_lp")
        if candidates:
            _unpack(out.candidates, t, samples, row.seq_index, f"{attr}_cand")
        tokens += len(row.input_ids)
    return tokens


def _minibatch(net: torch.nn.Module, samples: list[Sample], idx: list[int], loss_fn: LossFn,
               fields: tuple[str, ...], per_token: bool, max_tokens: int, pad_id: int,
               temperature: float) -> tuple[dict[str, float], int]:
    """Accumulate the gradient of one minibatch over its packed rows; weighted stats, tokens run."""
    dev = next(net.parameters()).device
    total = sum(samples[i].n_action for i in idx) if per_token else len(idx)
    stats: dict[str, float] = {}
    tokens = 0
    for row in _rows(samples, idx, max_tokens):
        t = _row(samples, row, pad_id, dev, fields, _padded(net, row, samples))
        with _autocast(dev):
            out = token_scores(net, t.input_ids, t.attn, t.mask, temperature, position_ids=t.position_ids,
                               candidates=t.values.get("cand_ids"))
        lp, ent = out.logprobs, out.entropies
        if out.candidates is not None:  # the student's log-probs on the distillation support
            t.values["cand_student"] = out.candidates
        loss, st = loss_fn(lp, ent, t)
        share = (int(t.mask.sum()) if per_token else len(row.spans)) / max(total, 1)
        (loss * share).backward()
        st["loss/entropy_mean"] = float((ent.detach() * t.mask).sum() / t.mask.sum().clamp(min=1))
        for k, v in st.items():
            merge_stat(stats, k, v, share)
        tokens += len(row.input_ids)
    return stats, tokens


def train_on_samples(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                     samples: list[Sample], loss_fn: LossFn, *, fields: tuple[str, ...],
                     epochs: int, minibatch_size: int, max_tokens: int, max_grad_norm: float | None,
                     per_token: bool, pad_id: int, temperature: float, generator: torch.Generator,
                     on_minibatch: Callable[[], None] | None = None,
                     minibatch: Callable[..., tuple[dict[str, float], int]] | None = None
                     ) -> dict[str, float]:
    """``epochs`` shuffled passes of minibatches, one optimizer step each; mean stats."""
    net = _base(model)
    params = [p for p in model.parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    n_steps, tokens = 0, 0
    net.train()
    try:
        for _ in range(epochs):
            order = torch.randperm(len(samples), generator=generator).tolist()
            for s in range(0, len(order), minibatch_size):
                st, n = (minibatch or _minibatch)(net, samples, order[s:s + minibatch_size], loss_fn,
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


# --------------------------------------------------------------------------- eval


def eval_seeds(cfg: TrainConfig) -> list[int]:
    """Held-out task seeds: the explicit list, else ``eval_episodes`` from ``eval_seed_start``."""
    if cfg.eval_task_seeds:
        return list(cfg.eval_task_seeds)
    return [cfg.eval_seed_start + i for i in range(cfg.eval_episodes)]


def evaluate(policy: Any, cfg: TrainRunConfig, on_episode_done: Callable | None = None,
             collect_fn: Callable[..., list[RolloutTree]] | None = None) -> dict[str, Any]:
    """Success and reward on ``eval_episodes`` held-out task seeds, one episode each.

    ``collect_fn`` replaces ``agentrl.rollout.collect`` (a harness's rollouts).
    """
    from ..rollout import collect, summarize

    t = cfg.train
    ev = cfg.model_copy(deep=True)
    ev.rollout.group_size = 1
    ev.rollout.allocator, ev.rollout.allocator_options, ev.rollout.budget = "independent", {}, None
    if t.eval_temperature is not None:
        ev.sampling.temperature = t.eval_temperature
    ev.env.kwargs = {**ev.env.kwargs, **t.eval_env_kwargs}
    seeds = eval_seeds(t)
    t0 = time.perf_counter()
    trees = (collect_fn or collect)(ev.env.id, policy, ev, seeds, on_episode_done=on_episode_done)
    s = summarize(trees, time.perf_counter() - t0)
    return {"eval/success": s["success_rate"], "eval/reward": s["mean_reward"],
            "eval/turns": s["mean_turns"], "eval/failed": s["failed_episodes"],
            "time/eval_s": s["wall_s"]}


# --------------------------------------------------------------------------- the loop


class _Bars:
    """Rich progress bars, one per phase, reset every step."""

    def __init__(self, console: Console, enabled: bool):
        self.progress = Progress("[progress.description]{task.description}", BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                                 disable=not enabled)
        self.tasks: dict[str, Any] = {}

    def start(self, phase: str, total: int, label: str = "") -> Callable[..., None]:
        desc = f"{phase:<8} {label}"
        if phase not in self.tasks:
            self.tasks[phase] = self.progress.add_task(desc, total=total)
        else:
            self.progress.reset(self.tasks[phase], total=total, description=desc)
        task = self.tasks[phase]
        return lambda *_: self.progress.advance(task)

    def __enter__(self) -> _Bars:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)


class Trainer:
    """Holds the policy, the trained model, the optimizer and the run state; ``run()`` trains."""

    def __init__(self, cfg: TrainRunConfig, policy: Any = None, console: Console | None = None,
                 progress: bool = True):
        from ..policy import make_policy

        t = cfg.train
        if t.micro_batch_tokens < cfg.rollout.max_context_tokens:
            raise ConfigError(f"train.micro_batch_tokens={t.micro_batch_tokens} is below "
                              f"rollout.max_context_tokens={cfg.rollout.max_context_tokens}: "
                              "an episode must fit one forward pass")
        if t.harness is not None and t.distill is not None and (
                t.distill.privileged or t.distill.teacher in ("expert", "oracle")):
            raise ConfigError("train.harness runs episodes through the env server, which keeps the privileged "
                              "text and expert actions from agents: train.distill.privileged and "
                              "train.distill.teacher='expert' need the native engine (no train.harness)")
        if t.distill is not None and t.distill.teacher in ("expert", "oracle"):  # the engine records its actions
            cfg = cfg.model_copy(deep=True)
            cfg.rollout.record_expert_actions = t.distill.teacher
        if t.value_head is not None:  # episodes cut at max_turns keep the next state, to bootstrap V from
            cfg = cfg.model_copy(deep=True)
            cfg.rollout.record_next_context = True
        self.cfg = cfg
        self.console = console or Console()
        self.progress = progress
        torch.manual_seed(t.seed)
        self.policy = policy if policy is not None else make_policy(cfg.policy)
        net = getattr(self.policy, "model", None)
        if not isinstance(net, torch.nn.Module):
            raise ConfigError(f"policy.backend={cfg.policy.backend!r} holds no torch model to train; "
                              "use backend=hf")
        self.model = make_trainable(net, t)
        self.net = _base(self.model)
        self.device = next(self.net.parameters()).device
        self.temperature = cfg.sampling.temperature if cfg.sampling.temperature > 0 else 1.0
        tok = self.policy.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.ref = self._reference()
        self.score, self.minibatch = score_samples, _minibatch  # episode packing
        if t.tree_packing:  # each tree's shared tokens once (tree_pack.py)
            from .tree_pack import check_tree_packing, score_samples_tree, tree_minibatch
            check_tree_packing(t.loss)
            self.score, self.minibatch = score_samples_tree, tree_minibatch
        self.value_head = None  # credit: gae's V(s), a probe on the policy's features (value.py)
        if t.value_head is not None:
            from .value import ValueHead
            text = self.net.config.get_text_config() if hasattr(self.net.config, "get_text_config") else self.net.config
            self.value_head = ValueHead(text.hidden_size, t.value_head)
        self.distiller = None
        if t.distill is not None:
            from .opd import Distiller
            self.distiller = Distiller(t.distill, tok, self.device, t.steps, student=self.net,
                                       max_len=cfg.rollout.max_context_tokens + 2048)  # + a privileged prefix
            if t.tree_packing and self.distiller.top_k:
                raise ConfigError("train.tree_packing does not carry top-k distributions yet: use "
                                  "train.distill.signal='reverse_kl' without overlap_threshold, "
                                  "or train.tree_packing=false")
        self.harness = None  # rollouts by an agent program instead of the engine (harness.py)
        if t.harness is not None:
            from .harness import HarnessRollouts

            self.harness = HarnessRollouts(t.harness, self.policy, cfg, t.harness_env)
        self.optimizer = make_optimizer(self.model, t.lr, t)
        minibatches = math.ceil(t.tasks_per_step * cfg.rollout.group_size / t.minibatch_size)
        self.scheduler = make_scheduler(self.optimizer, t, t.steps * t.epochs * minibatches)
        self.step = 0
        self.sft_done = False
        self.phases: dict[str, float] = {}  # success rate at start, after SFT, at the end
        self.bars: _Bars | None = None
        self.out = Path(t.out_dir)

    def _reference(self) -> torch.nn.Module | None:
        """A frozen copy of the starting weights for the KL term (LoRA: the adapters switched off)."""
        if self.cfg.train.loss.kl_coef == 0 or self.model is not self.net:
            return None
        return copy.deepcopy(self.net).requires_grad_(False).eval()

    @contextlib.contextmanager
    def _ref_net(self) -> Iterator[torch.nn.Module]:
        if self.ref is not None:
            yield self.ref
        else:
            with self.model.disable_adapter():
                yield self.net

    # -- state ---------------------------------------------------------------------------
    def save(self, export_hf: bool = False) -> Path:
        state = {"version": self.policy.version, "sft_done": self.sft_done, "phases": self.phases,
                 "config": self.cfg.model_dump(mode="json")}
        if self.value_head is not None:
            state["value_head"] = self.value_head.state()
        if self.distiller is not None and self.distiller.turn_mass:  # TurnOPD's depth statistics
            state["distill_turn_mass"] = self.distiller.turn_mass
        return save_checkpoint(self.out, self.step, self.model, self.optimizer, self.scheduler, state,
                               export_hf=export_hf, tokenizer=self.policy.tokenizer,
                               keep=self.cfg.train.keep_checkpoints)

    def resume(self, path: str | Path | None = None) -> bool:
        """Load the newest checkpoint under ``out_dir`` (or ``path``); False when there is none."""
        path = path or latest_checkpoint(self.out)
        if path is None:
            return False
        ck = load_checkpoint(path)
        load_trainable(self.model, ck.trainable)
        if ck.optimizer is not None:
            self.optimizer.load_state_dict(ck.optimizer)
        if ck.scheduler is not None:
            self.scheduler.load_state_dict(ck.scheduler)
        if ck.rng is not None:
            restore_rng(ck.rng)
        self.step = ck.step
        self.sft_done = bool(ck.state.get("sft_done", False))
        self.phases = dict(ck.state.get("phases", {}))
        if self.value_head is not None and "value_head" in ck.state:
            self.value_head.load(ck.state["value_head"])
        if self.distiller is not None and ck.state.get("distill_turn_mass"):
            self.distiller.set_turn_mass(ck.state["distill_turn_mass"])
        sync_policy(self.policy, self.model)  # drop keys and values of the weights before loading
        self.policy.version = int(ck.state.get("version", self.policy.version))
        return True

    # -- one step ----------------------------------------------------------------------------
    def rollout(self, step: int, bars: _Bars) -> tuple[list[RolloutTree], dict[str, Any]]:
        from ..rollout import collect, summarize

        cfg = self.cfg.model_copy(deep=True)
        cfg.rollout.seed = request_seed(self.cfg.train.seed, step)  # fresh sampling streams per step
        if self.distiller is not None and self.distiller.depth_budget is not None:  # TurnOPD's depth budget
            cfg.rollout.max_turns = min(cfg.rollout.max_turns, self.distiller.depth_budget)
        seeds = step_task_seeds(self.cfg.train, step)
        advance = bars.start("rollout", len(seeds) * cfg.rollout.group_size, f"step {step + 1}")
        t0 = time.perf_counter()
        trees = (self.harness.collect if self.harness else collect)(
            cfg.env.id, self.policy, cfg, seeds, on_episode_done=advance)
        s = summarize(trees, time.perf_counter() - t0)
        extra = self.harness.stats if self.harness else {}
        return trees, {**extra, "rollout/success": s["success_rate"], "rollout/reward": s["mean_reward"],
                       "rollout/turns": s["mean_turns"], "rollout/episodes": s["episodes"],
                       "rollout/failed": s["failed_episodes"],
                       "rollout/action_tokens": s["action_tokens"], "time/rollout_s": s["wall_s"],
                       "rollout/env_steps": s["env_steps"],
                       "rollout/generated_tokens": s["generated_tokens"],
                       "data/first_task_seed": seeds[0]}

    def _rl_loss(self, lp: torch.Tensor, ent: torch.Tensor, t: _Row) -> tuple[torch.Tensor, dict]:
        v = t.values
        extra, d_stats = None, {}
        if "cand_student" in v:  # distribution-level distillation: a per-token loss term (opd.py)
            from .opd import distribution_loss
            assert self.distiller is not None
            extra, d_stats = distribution_loss(v["cand_student"], v["cand_teacher"], v["cand_ids"] >= 0,
                                               v["distill_w"], t.mask, self.distiller.cfg)
        loss, stats = policy_loss(lp, v["advantages"], t.mask, self.cfg.train.loss, old_logprobs=v.get("old"),
                                  behaviour_logprobs=v["behaviour"], versions=v["versions"],
                                  current_version=self.policy.version, ref_logprobs=v.get("ref"),
                                  entropies=ent, seq_ids=t.seq_ids, extra_per_token=extra)
        return loss, {**stats, **d_stats}

    def needs_scoring_pass(self, n_samples: int) -> bool:
        """Whether old logprobs need their own no-grad pass before the update.

        With one optimizer step per batch (one epoch, one minibatch) the weights
        the update differentiates are the weights PPO's ratio anchors to, so the
        update's own logprobs, detached, are the old ones (ratio 1; TRL's GRPO
        skips the pass the same way when it makes one update per generation).
        A distillation teacher reads ``Sample.old`` before the update, so it
        keeps the pass.
        """
        t = self.cfg.train
        return t.epochs > 1 or n_samples > t.minibatch_size or self.distiller is not None

    def learn(self, trees: list[RolloutTree], step: int, bars: _Bars) -> dict[str, Any]:
        """Credit, old logprobs and the update on one rollout batch."""
        from ..credit import assign

        t = self.cfg.train
        stats: dict[str, Any] = {}
        t0 = time.perf_counter()
        if t.credit == "none":
            from .opd import no_credit
            items = no_credit(trees)
        else:
            options = {"failed": self.cfg.rollout.failed_episodes, **t.credit_options}
            feats: dict[tuple[int, ...], tuple[torch.Tensor, Episode]] = {}
            if self.value_head is not None:
                from .value import turn_features

                def value_fn(ep: Episode) -> list[float]:
                    key = tuple(id(n) for n in ep.nodes)
                    if key not in feats:
                        feats[key] = (turn_features(self.net, ep), ep)
                    return self.value_head(feats[key][0]).tolist()

                options["value_fn"] = value_fn
            items = assign(trees, t.credit, **options)
            if t.credit == "gigpo":  # how often states recur: GiGPO's step level needs them
                from ..credit import anchor_group_stats
                stats.update(anchor_group_stats(trees, t.credit_options.get("similarity")))
            if self.value_head is not None and feats:  # refit V on this batch, after it was used
                stats.update(self.value_head.fit([f for f, _ in feats.values()], [e for _, e in feats.values()],
                                                 t.credit_options.get("gamma", 1.0), t.credit_options.get("lam", 1.0)))
        skip = (t.skip_zero_advantage and t.loss.kl_coef == 0 and t.loss.entropy_coef == 0
                and self.distiller is None)
        samples = samples_from_credit(items, skip_zero_advantage=skip)
        if self.distiller is not None:  # what the teacher needs of each sample's episode
            from .opd import hindsight_summary
            tree_of = {id(n): tree for tree in trees for n in tree.nodes.values()}
            kept = [ep for ep, _ in items if any(ep.loss_mask)]  # samples_from_credit's order (no skip)
            if self.distiller.cfg.privileged_source == "hindsight":  # one text per task's group
                text = {id(tree): hindsight_summary(tree, self.policy.tokenizer) for tree in trees}
            else:
                text = {id(tree): tree.meta.get("privileged") for tree in trees}
            for s, ep in zip(samples, kept, strict=True):
                s.turn_spans = list(ep.turn_spans)
                s.privileged = text[id(tree_of[id(ep.nodes[0])])] if ep.nodes else None
                s.expert_turns = [(a, b, n.info.get("expert_action"), n.finish_reason in ("stop", "stop_string"))
                                  for (a, b), n in zip(ep.turn_spans, ep.nodes, strict=True)]
        stats["train/episodes"] = len(samples)
        stats["time/credit_s"] = time.perf_counter() - t0
        if not samples:
            return stats
        t0 = time.perf_counter()
        one_step = not self.needs_scoring_pass(len(samples))
        tokens = 0
        fields: tuple[str, ...] = ("advantages", "behaviour", "versions")
        if not one_step:
            top_k = {"top_k": self.distiller.top_k} if self.distiller is not None and self.distiller.top_k else {}
            tokens = self.score(self.net, samples, "old", t.micro_batch_tokens, self.pad_id,
                                self.temperature, **top_k)
            fields += ("old",)
        if t.loss.kl_coef > 0:
            with self._ref_net() as ref:
                tokens += score_samples(ref, samples, "ref", t.micro_batch_tokens, self.pad_id,
                                        self.temperature)
            fields += ("ref",)
        if self.distiller is not None:  # the teacher scores the same tokens; A += w * A_distill
            # A privileged prefix lengthens the teacher's sequences past what one forward pass was sized for.
            stats.update(self.distiller.apply(samples, step, lambda net, ss, attr, temp, **kw: self.score(
                net, ss, attr, max(t.micro_batch_tokens, max(len(x.input_ids) for x in ss)), self.pad_id,
                temp, **kw), [s.privileged for s in samples]))
            tokens += stats["distill/teacher_tokens"]
            if self.distiller.distribution:
                fields += ("cand_ids", "cand_teacher", "distill_w")
        stats["time/old_logprobs_s"] = time.perf_counter() - t0
        stats["train/scoring_pass"] = int(not one_step)
        n_mb = t.epochs * math.ceil(len(samples) / t.minibatch_size)
        advance = bars.start("train", n_mb, f"step {step + 1}")
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(request_seed(t.seed, step, 1))
        st = train_on_samples(self.model, self.optimizer, self.scheduler, samples, self._rl_loss,
                              fields=fields, epochs=t.epochs, minibatch_size=t.minibatch_size,
                              max_tokens=t.micro_batch_tokens, max_grad_norm=t.max_grad_norm,
                              per_token=t.loss.agg == "token-mean", pad_id=self.pad_id,
                              temperature=self.temperature, generator=gen, on_minibatch=advance,
                              minibatch=self.minibatch)
        wall = time.perf_counter() - t0
        stats.update(st)
        if one_step:  # the loss compared its own detached logprobs with the behaviour ones
            stats["mismatch/kl"] = st.get("mismatch/mismatch_kl", 0.0)
        else:
            flat = lambda attr: torch.tensor([x for s in samples for x in getattr(s, attr)])  # noqa: E731
            mm = mismatch_stats(flat("old"), flat("behaviour"), flat("mask").bool())
            stats["mismatch/kl"], stats["mismatch/max_abs_dlogprob"] = mm["mismatch_kl"], mm["max_abs_dlogprob"]
        stats["time/train_s"] = wall
        stats["train/tokens_per_s"] = (st["train/tokens"] + tokens) / max(wall + stats["time/old_logprobs_s"], 1e-9)
        stats["train/lr"] = self.scheduler.get_last_lr()[0]
        return stats

    # -- the run -------------------------------------------------------------------------------
    def _eval(self, label: str, bars: _Bars) -> dict[str, Any]:
        n = len(eval_seeds(self.cfg.train))
        if n == 0:
            return {}
        advance = bars.start("eval", n, label)
        return evaluate(self.policy, self.cfg, on_episode_done=advance,
                        collect_fn=self.harness.collect if self.harness else None)

    def _phase(self, name: str, ev: dict[str, Any]) -> None:
        if "eval/success" in ev:
            self.phases[name] = ev["eval/success"]
            self.console.print(f"[bold]{name}[/]: held-out success {ev['eval/success']:.3f} "
                               f"({len(eval_seeds(self.cfg.train))} episodes), "
                               f"reward {ev['eval/reward']:.3f}")

    def run(self, sft: Callable[[Trainer], dict[str, Any]] | None = None) -> dict[str, Any]:
        """Train to ``train.steps``; ``sft`` (the warm start) runs first unless already done."""
        t = self.cfg.train
        resumed = bool(self.step or self.phases)
        log = MetricsLogger(self.out, tensorboard=t.tensorboard,
                            resume_step=self.step if resumed else -1)
        mem = PeakMemory()  # each logged row carries its phase's (or step's) peak memory
        try:
            with _Bars(self.console, self.progress) as bars:
                self.bars = bars
                if "start" not in self.phases:
                    mem.start()
                    ev = self._eval("start", bars)
                    self._phase("start", ev)
                    log.log(0, {"phase": "start", **ev, **mem.read()})
                if sft is not None and not self.sft_done:
                    mem.start()
                    st = sft(self)
                    self.sft_done = True
                    ev = self._eval("after SFT", bars)
                    self._phase("after_sft", ev)
                    log.log(0, {"phase": "sft", **st, **ev, **mem.read()})
                    self.save()
                overall = bars.start("steps", t.steps)
                for _ in range(self.step):
                    overall()
                ran = self.step < t.steps
                while self.step < t.steps:
                    mem.start()
                    row = self._one_step(bars)
                    log.log(self.step, {"phase": "rl", **row, **mem.read()})
                    overall()
                ev = {}
                mem.start()
                if not ran and "after_sft" in self.phases:  # nothing changed since that eval
                    self.phases.setdefault("end", self.phases["after_sft"])
                elif ran or "end" not in self.phases:
                    ev = self._eval("end", bars)
                    self._phase("end", ev)
            t0 = time.perf_counter()
            final = self.save(export_hf=t.export_hf)
            log.log(self.step, {"phase": "end", **ev, "time/checkpoint_s": time.perf_counter() - t0,
                                **mem.read()})
        finally:
            self.bars = None
            if self.harness is not None:
                self.harness.close()
            log.close()
        png = None
        if t.plot:
            png = plot_learning_curve(log.path, self.out / "learning_curve.png",
                                      title=f"{self.cfg.env.id} / {self.cfg.policy.model}")
        return {"phases": dict(self.phases), "checkpoint": str(final),
                "learning_curve": str(png) if png else None, "metrics": str(log.path)}

    def _one_step(self, bars: _Bars) -> dict[str, Any]:
        t, k = self.cfg.train, self.step
        trees, stats = self.rollout(k, bars)
        stats.update(self.learn(trees, k, bars))
        t0 = time.perf_counter()
        sync_policy(self.policy, self.model)
        stats["time/sync_s"] = time.perf_counter() - t0
        stats["policy/version"] = self.policy.version
        self.step = k + 1
        if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps:
            stats.update(self._eval(f"step {self.step}", bars))
        if t.checkpoint_every and self.step % t.checkpoint_every == 0 and self.step < t.steps:
            t0 = time.perf_counter()
            self.save()
            stats["time/checkpoint_s"] = time.perf_counter() - t0
        return stats


def train(cfg: TrainRunConfig, *, resume: bool = False, overwrite: bool = False, policy: Any = None,
          progress: bool = True, console: Console | None = None) -> dict[str, Any]:
    """Run ``agentrl train``: optional SFT warm start, then the RL loop; returns a summary.

    ``resume`` continues from the newest checkpoint in ``train.out_dir``. A
    fresh run refuses an ``out_dir`` that holds checkpoints unless ``overwrite``.
    """
    from .sft import sft_phase

    out = Path(cfg.train.out_dir)
    if not resume and latest_checkpoint(out) is not None:
        if not overwrite:
            raise ConfigError(f"train.out_dir={out} already holds checkpoints: pass --resume to "
                              "continue that run, or --overwrite to start over")
        shutil.rmtree(out / "checkpoints")
    trainer = Trainer(cfg, policy=policy, console=console, progress=progress)
    if resume and trainer.resume():
        trainer.console.print(f"resumed from step {trainer.step} ({out / 'checkpoints'})")
    warm = sft_phase if cfg.sft.episodes > 0 or cfg.sft.task_seeds else None
    return trainer.run(sft=warm)
