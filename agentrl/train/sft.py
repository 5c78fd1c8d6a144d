"""Supervised fine-tuning on an env's scripted expert, with RL's exact token layout.

Expert trajectories are built as ``RolloutTree``s, the very objects rollouts
produce: the opening prompt and every observation are rendered by
``ChatContext`` exactly as the rollout engine renders them (same system
prompt, same observation messages), and each expert action becomes the
action tokens a policy would have sampled: the action text's tokens followed
by the end-of-turn token (EOS). So an SFT episode and an RL episode of the same
actions have identical ``input_ids`` and loss masks, and SFT trains with the
same packing and micro-batching as RL.

The loss is the negative log-likelihood of the action tokens, averaged over
tokens (``token-mean``; ``loss.row_loss`` with ``StepLoss()``): behaviour
cloning on the expert's turns only, never on the observations.

Under ``rollout.constrain: admissible`` (or ``sft.constrain: true``) each
expert turn records the actions the env listed for it, as a rollout's turn
does, and is scored as the constrained sampler would draw it: the NLL of the
expert's action among the admissible ones (``policy.constrain``). A token
with one allowed id scores 0 and carries no gradient, but it stays in the
token mean, as in a constrained RL step, so the loss and ``sft/nll_*`` are
smaller than a free run's and not comparable with them. A turn whose expert
action is not in the list (or whose env listed none) stays free; the run
warns and counts them (``sft/free_turns``).

With ``sft.levels`` the expert plays several env levels (``agentrl.train.curriculum``),
each on its own consecutive seeds, and the episodes of all levels are one dataset.

Envs with ``expert_action()``: ALFWorld-v0, WebShop-v0, TextWorld-v0 and
GuessNumber-v0.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

from ..chat import ChatContext
from ..config import Config
from ..env import answer_problem, make_env
from ..errors import ConfigError, ContextOverflowError, EnvError
from ..policy.base import request_seed
from ..rollout.turns import listed_actions, opening_messages, step_node
from ..types import Node, RolloutTree
from .batch import Sample, constrain_samples, samples_from_credit, score_old, train_on_samples
from .compiled import compile_mode
from .curriculum import at_level
from .loss import StepLoss
from .model import free_before_update, make_optimizer, make_scheduler, precision, sync_policy

if TYPE_CHECKING:
    from .step import Learner, StartBar

__all__ = ["expert_tree", "expert_trees", "sft_constrains", "sft_level_seeds", "sft_phase", "sft_seeds"]


def _expert(env: Any, which: str = "observable") -> str:
    """The env's expert action: ``expert_action()``, which acts on what was observed, or
    ``oracle_action()``, which reads hidden state, when ``which == "oracle"``."""
    name = "oracle_action" if which == "oracle" else "expert_action"
    try:
        return getattr(env.unwrapped, name)()
    except NotImplementedError as e:
        env_id = env.spec.id if env.spec else type(env.unwrapped).__name__
        hint = ""
        if name == "expert_action" and _overrides(env, "oracle_action"):
            hint = "; its only expert is privileged: set sft.expert=oracle to clone it anyway"
        raise ConfigError(f"env {env_id} has no {name}(){hint}. SFT needs an env with a "
                          "scripted expert") from e


def _overrides(env: Any, name: str) -> bool:
    """Whether the env's class implements ``name`` (not only ``TextEnv``'s stub)."""
    from ..env import TextEnv

    return getattr(type(env.unwrapped), name, None) is not getattr(TextEnv, name)


def expert_tree(env_id: str, tokenizer: Any, cfg: Config, seed: int,
                max_turns: int | None = None, expert: str = "observable") -> RolloutTree:
    """One expert episode on task ``seed`` as a linear tree, token-exact as a rollout.

    The episode ends when the env ends it, after ``max_turns`` (default
    ``rollout.max_turns``) or when the context budget is full; the tree's
    ``meta["expert_success"]`` says whether the expert won, and
    ``meta["context_cut"]`` whether the budget ended it.
    """
    max_turns = max_turns or cfg.rollout.max_turns
    eos = tokenizer.eos_token_id
    constrain = sft_constrains(cfg)
    env = make_env(env_id, **cfg.env.kwargs)
    try:
        answer = env.reset(seed=seed)
        if problem := answer_problem("reset", answer):  # as a rollout checks it
            raise EnvError(problem)
        obs, info = answer
        tree = RolloutTree(meta={"env": env_id, "seed": seed, "expert": expert,
                                 "instruction": info.get("instruction", "")})
        ctx = ChatContext(tokenizer, opening_messages(obs, info, cfg),
                          max_tokens=cfg.rollout.max_context_tokens)
        pending, parent, cut = list(ctx.ids), None, False
        for turn in range(max_turns):
            action = _expert(env, expert)
            ids = tokenizer.encode(action, add_special_tokens=False) + [eos]
            try:
                ctx.append_action(ids)
            except ContextOverflowError:
                cut = True
                break  # the expert's next action no longer fits: keep what did
            node = Node(context_ids=pending, action_ids=ids, logprobs=[0.0] * len(ids),
                        entropies=[0.0] * len(ids), version=0, action_text=action, finish_reason="stop")
            listed = listed_actions(info) if constrain else None
            if listed and action in listed:  # the sampler's trie spells it with exactly these ids
                node.admissible = listed
            result = env.step(action)
            info = result[4]
            pending = step_node(node, result, ctx, cfg, turn + 1, max_turns)
            parent = tree.add(node, parent).id
            if pending is None:
                cut = str(node.info.get("truncation_reason", "")).startswith("context budget")
                break
        last = tree.nodes[parent] if parent is not None else None
        tree.meta["expert_success"] = bool(last and last.success)
        tree.meta["context_cut"] = cut
        return tree
    finally:
        env.close()


def sft_constrains(cfg: Any) -> bool:
    """Whether SFT scores expert turns under the admissible-action constraint (``sft.constrain``:
    false by default; null follows ``rollout.constrain``)."""
    want = cfg.sft.constrain if getattr(cfg, "sft", None) is not None else None
    return cfg.rollout.constrain == "admissible" if want is None else bool(want)


def sft_seeds(cfg: Any) -> list[int]:
    """The expert task seeds of ``cfg.sft``: its list, or its episodes' seeds from ``seed_start``
    (with ``levels``, all levels' in order: they are consecutive)."""
    s = cfg.sft
    if s.task_seeds:
        return list(s.task_seeds)
    n = sum(lv.episodes for lv in s.levels) if s.levels else s.episodes
    return [s.seed_start + i for i in range(n)]


def sft_level_seeds(cfg: Any) -> list[tuple[Any, list[int]]]:
    """``(config at the level, its seeds)`` for each of ``sft.levels``; one pair of ``cfg`` and
    ``sft_seeds`` without levels (``agentrl.train.curriculum``)."""
    seeds = sft_seeds(cfg)
    if not cfg.sft.levels:
        return [(cfg, seeds)]
    out, start = [], 0
    for lv in cfg.sft.levels:
        level_cfg = at_level(cfg, lv)
        if lv.max_turns is not None:  # the level's cap before sft.max_turns
            level_cfg.sft.max_turns = lv.max_turns
        out.append((level_cfg, seeds[start:start + lv.episodes]))
        start += lv.episodes
    return out


def expert_trees(env_id: str, tokenizer: Any, cfg: Any, seeds: list[int],
                 only_successful: bool = True) -> list[RolloutTree]:
    """Expert trees for ``seeds``; episodes the expert did not win are left out by default."""
    trees = [expert_tree(env_id, tokenizer, cfg, s, cfg.sft.max_turns, cfg.sft.expert) for s in seeds]
    return [t for t in trees if t.meta["expert_success"] or not only_successful]


def sft_phase(learner: Learner, start_bar: StartBar | None = None) -> dict[str, Any]:
    """SFT of the learner's model on the expert trees of ``cfg.sft``, with its own AdamW.

    Returns stats (``sft/*``, ``time/sft_s``); the policy gets the new weights. Its passes
    run at ``train.precision``; ``start_bar`` makes its progress bar.
    """
    with precision(learner.cfg.train.precision), compile_mode(learner.cfg.train.compile):
        return _sft(learner, start_bar)


def _sft(learner: Learner, start_bar: StartBar | None) -> dict[str, Any]:
    cfg, s = learner.cfg, learner.cfg.sft
    t0 = time.perf_counter()
    seeds = sft_seeds(cfg)
    played = [t for level_cfg, level_seeds in sft_level_seeds(cfg)
              for t in expert_trees(cfg.env.id, learner.policy.tokenizer, level_cfg, level_seeds,
                                    only_successful=False)]
    trees = [t for t in played if t.meta["expert_success"]]
    cut = sum(bool(t.meta.get("context_cut")) and not t.meta["expert_success"] for t in played)
    budget = (f"{cut} of the {len(seeds)} tasks ran out of the context budget before the expert "
              f"finished (rollout.max_context_tokens={cfg.rollout.max_context_tokens})")
    if not trees:  # the budget, not the expert, is what to fix then
        raise ConfigError(f"sft: the expert won none of the {len(seeds)} tasks"
                          + (f"; {budget}: raise it" if cut else "") + "; nothing to imitate")
    if cut:  # left out as losses, so the data leans to the episodes short enough to fit
        learner.console.print(f"[yellow]warning:[/] sft: {budget}; they are left out (sft/context_cut)",
                              highlight=False)
    # An episode's advantages are its loss mask, so SFT samples are RL samples with A = 1.
    items = [(ep, [float(m) for m in ep.loss_mask]) for tree in trees for ep in tree.episodes()]
    samples = samples_from_credit(items)
    constrain, constrained_tokens, free_turns = sft_constrains(cfg), 0, 0
    if constrain:
        constrained_tokens = constrain_samples(samples, learner.policy.tokenizer)
        free_turns = sum(node.admissible is None for tree in trees for node in tree.nodes.values())
        if free_turns:
            learner.console.print(f"[yellow]warning:[/] sft: {free_turns} expert turn(s) took an action "
                                  "the env did not list (or it listed none); they train over the whole "
                                  "vocabulary (sft/free_turns)", highlight=False)
    build_s = time.perf_counter() - t0
    free_before_update(learner.policy, learner.model)  # the evaluation's keys and values, stale after SFT
    optimizer = make_optimizer(learner.model, s.lr, cfg.train.optimizer)
    n_steps = s.epochs * math.ceil(len(samples) / s.minibatch_size)
    scheduler = make_scheduler(optimizer, cfg.train.optimizer, n_steps)
    advance = start_bar("sft", n_steps, "") if start_bar is not None else None
    n = min(s.nll_episodes, len(samples))  # evenly spaced, so every level is in it
    probe = [samples[i * len(samples) // n] for i in range(n)] if n else []
    nll_before = _mean_nll(learner, probe)
    t1 = time.perf_counter()
    st = train_on_samples(learner.model, optimizer, scheduler, samples, StepLoss(), fields=(),
                          epochs=s.epochs, minibatch_size=s.minibatch_size,
                          max_tokens=cfg.train.micro_batch_tokens,
                          max_grad_norm=cfg.train.optimizer.max_grad_norm, per_token=True,
                          pad_id=learner.pad_id, temperature=1.0,
                          generator=torch.Generator().manual_seed(request_seed(cfg.train.seed, -1)),
                          on_minibatch=advance)
    wall = time.perf_counter() - t1
    sync_policy(learner.policy, learner.model)
    return {"sft/episodes": len(samples), "sft/tasks": len(seeds), "sft/context_cut": cut,
            "sft/action_tokens": sum(x.n_action for x in samples),
            **({"sft/constrained_tokens": constrained_tokens, "sft/free_turns": free_turns}
               if constrain else {}),
            **({"sft/nll_before": nll_before, "sft/nll_after": _mean_nll(learner, probe)} if probe else {}),
            "sft/optimizer_steps": st["train/optimizer_steps"],
            "sft/tokens_per_s": st["train/tokens"] / max(wall, 1e-9),
            "time/sft_build_s": build_s, "time/sft_s": wall}


def _mean_nll(learner: Learner, samples: list[Sample]) -> float:
    """Token-mean NLL of the expert's action tokens under the current weights."""
    score_old(learner.net, samples, learner.cfg.train.micro_batch_tokens, learner.pad_id, 1.0)
    lps = [lp for s in samples for lp, m in zip(s.old, s.mask, strict=True) if m]
    return -sum(lps) / max(len(lps), 1)
