"""A minimal multi-turn runner: episodes in lockstep, one batched generate per turn.

Each episode keeps a token-exact ``ChatContext``; every turn becomes a ``Node``
of the episode's ``RolloutTree`` (linear here; allocators grow real trees).
Failures are recorded, never raised: a crashed ``env.step`` (or an env that
reports ``info["error"]``) ends only its episode with ``node.error`` set, and an observation that overflows the context
budget, or fills it so no action fits, ends the episode as truncated with ``info["truncation_reason"]``.
Envs are closed however the run ends.

Every request draws from its own random stream, seeded from (run seed,
episode, turn), so episodes sample independently and a run is reproducible.

This runner is small on purpose; the async engine replaces it later.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .chat import ChatContext
from .config import Config
from .env import make_env
from .errors import ContextOverflowError
from .policy.base import GenerateRequest, Policy, SamplingParams, action_text, request_seed
from .types import Node, RolloutTree, write_trees

__all__ = ["episode_success", "run_episodes", "summarize", "write_run"]

_HEAVY_INFO = ("admissible_actions", "tools", "tools_prompt")
# Per-tree counts: prompt tokens the policy prefilled or took from its prefix cache.
_COUNTERS = ("generated_tokens", "prefilled_tokens", "reused_tokens", "env_steps")


@dataclass
class _Episode:
    index: int
    env: Any
    tree: RolloutTree
    ctx: ChatContext | None
    pending: list[int] = field(default_factory=list)
    parent: int | None = None
    turns: int = 0
    done: bool = False


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    """Info minus per-step lists, made JSON-safe so trees serialize."""
    kept = {k: v for k, v in info.items() if k not in _HEAVY_INFO}
    return json.loads(json.dumps(kept, default=str))


def _observation_messages(obs: str, info: dict[str, Any], cfg: Config) -> list[dict[str, Any]]:
    if info.get("tool_messages"):  # tool envs answer with role=tool messages
        return [{k: v for k, v in m.items() if v is not None} for m in info["tool_messages"]]
    text = obs
    if cfg.rollout.show_admissible and info.get("admissible_actions"):
        text += "\nValid actions: " + ", ".join(map(str, info["admissible_actions"]))
    return [{"role": "user", "content": text}]


def _start(env: Any, env_id: str, index: int, tokenizer: Any, cfg: Config) -> _Episode:
    seed = cfg.rollout.seed + index
    tree = RolloutTree(meta={"env": env_id, "seed": seed})
    try:
        obs, info = env.reset(seed=seed)
    except Exception as e:  # a crashed env fails only its episode
        tree.meta["error"] = f"env.reset raised {type(e).__name__}: {e}"
        return _Episode(index, env, tree, None, done=True)
    tree.meta["instruction"] = info.get("instruction", "")
    messages = []
    system = [p for p in (cfg.rollout.system_prompt, info.get("tools_prompt")) if p]
    if system:  # a tool env describes its tools for the system prompt
        messages.append({"role": "system", "content": "\n\n".join(system)})
    messages += _observation_messages(obs, info, cfg)
    try:
        ctx = ChatContext(tokenizer, messages, max_tokens=cfg.rollout.max_context_tokens)
    except ContextOverflowError as e:
        tree.meta["error"] = f"opening prompt over budget: {e}"
        return _Episode(index, env, tree, None, done=True)
    if len(ctx) >= cfg.rollout.max_context_tokens:
        tree.meta["error"] = f"opening prompt leaves no room for an action in {len(ctx)} tokens"
        return _Episode(index, env, tree, None, done=True)
    return _Episode(index, env, tree, ctx, pending=list(ctx.ids))


def _step(ep: _Episode, result: Any, tokenizer: Any, cfg: Config) -> None:
    """Apply one sampled action to its episode and record the turn."""
    assert ep.ctx is not None
    c = ep.tree.meta.setdefault("counters", dict.fromkeys(_COUNTERS, 0))
    c["generated_tokens"] += len(result.token_ids)
    c["prefilled_tokens"] += len(ep.ctx) - result.cached_tokens
    c["reused_tokens"] += result.cached_tokens
    c["env_steps"] += 1
    ep.ctx.append_action(result.token_ids, result.logprobs)
    text = action_text(tokenizer, result.token_ids, cfg.sampling.stop).strip()
    node = Node(context_ids=ep.pending, action_ids=list(result.token_ids),
                logprobs=list(result.logprobs), entropies=list(result.entropies),
                version=result.version, action_text=text, finish_reason=result.finish_reason)
    ep.turns += 1
    try:
        obs, reward, terminated, truncated, info = ep.env.step(text)
        node.observation, node.reward = obs, float(reward)
        node.terminated, node.truncated = bool(terminated), bool(truncated)
        node.info = _jsonable(info)
        if info.get("error"):  # the env failed the episode itself and said why
            node.error = str(info["error"])
    except Exception as e:
        node.error = f"env.step raised {type(e).__name__}: {e}"
        node.truncated, info = True, {}
    if not node.done and ep.turns >= cfg.rollout.max_turns:
        node.truncated = True
        node.info["truncation_reason"] = f"max_turns={cfg.rollout.max_turns}"
    if not node.done:
        try:
            ep.pending = ep.ctx.append_observation(_observation_messages(node.observation, info, cfg))
        except ContextOverflowError as e:
            node.truncated = True
            node.info["truncation_reason"] = f"context budget: {e}"
        else:
            if len(ep.ctx) >= cfg.rollout.max_context_tokens:  # full: no action fits
                node.truncated = True
                node.info["truncation_reason"] = (
                    f"context budget: {len(ep.ctx)} of {cfg.rollout.max_context_tokens} tokens used")
    ep.parent = ep.tree.add(node, ep.parent).id
    ep.done = node.done
    if cfg.rollout.keep_snapshots and not node.done:
        try:
            node.snapshot = f"n{node.id}"
            ep.tree.snapshots[node.snapshot] = ep.env.unwrapped.snapshot()
        except Exception as e:  # an env that cannot snapshot still rolls out
            node.snapshot = None
            node.info["snapshot_error"] = f"{type(e).__name__}: {e}"


def run_episodes(env_id: str, policy: Policy, cfg: Config,
                 on_episode_done: Callable[[RolloutTree], None] | None = None) -> list[RolloutTree]:
    """Run ``cfg.rollout.episodes`` episodes (env seeds ``seed, seed+1, ...``) to the end."""
    envs: list[Any] = []
    try:
        for _ in range(cfg.rollout.episodes):
            envs.append(make_env(env_id, **cfg.env.kwargs))
        return _run(env_id, envs, policy, cfg, on_episode_done)
    finally:  # a raising generate or callback must not leak sandboxes or containers
        _close_all(envs)


def _close_all(envs: list[Any]) -> None:
    """Close every env even when some ``close`` raises; warn about those, never mask the run's error."""
    for env in envs:
        try:
            env.close()
        except Exception as e:
            warnings.warn(f"env.close raised {type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)


def _run(env_id: str, envs: list[Any], policy: Policy, cfg: Config,
         on_episode_done: Callable[[RolloutTree], None] | None) -> list[RolloutTree]:
    tok, s = policy.tokenizer, cfg.sampling
    eps = [_start(env, env_id, i, tok, cfg) for i, env in enumerate(envs)]
    for ep in eps:
        if ep.done and on_episode_done:
            on_episode_done(ep.tree)
    turn = 0
    while active := [ep for ep in eps if not ep.done]:
        turn += 1
        requests = []
        for ep in active:
            assert ep.ctx is not None
            room = cfg.rollout.max_context_tokens - len(ep.ctx)
            requests.append(GenerateRequest(list(ep.ctx.ids), SamplingParams(
                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                max_new_tokens=min(s.max_new_tokens, room), stop=tuple(s.stop),
                seed=request_seed(cfg.rollout.seed, ep.index, turn))))
        results = policy.generate(requests)
        for ep, res in zip(active, results, strict=True):
            try:
                _step(ep, res, tok, cfg)
            except ContextOverflowError as e:  # the action itself did not fit
                ep.tree.meta["error"], ep.done = f"context budget: {e}", True
            if ep.done and on_episode_done:
                on_episode_done(ep.tree)
    return [ep.tree for ep in eps]


def episode_success(tree: RolloutTree) -> bool:
    """``info["success"]`` of the last turn if the env sets it, else terminated with reward > 0."""
    leaves = tree.leaves()
    if not leaves:
        return False
    last = leaves[-1]
    if "success" in last.info:
        return bool(last.info["success"])
    return last.terminated and last.reward > 0


def summarize(trees: list[RolloutTree], wall_s: float) -> dict[str, Any]:
    """Success rate, mean reward, turns, tokens and wall time of a set of linear rollouts."""
    episodes = [ep for t in trees for ep in t.episodes()]
    n = max(len(trees), 1)
    action_tokens = sum(sum(ep.loss_mask) for ep in episodes)
    context_tokens = sum(len(ep.input_ids) - sum(ep.loss_mask) for ep in episodes)
    failed = [t for t in trees if t.meta.get("error") or any(n.error for n in t.nodes.values())]
    nodes = [n for t in trees for n in t.nodes.values()]
    counts = {k: sum(t.meta.get("counters", {}).get(k, 0) for t in trees) for k in _COUNTERS}
    return {
        "episodes": len(trees),
        "success_rate": sum(episode_success(t) for t in trees) / n,
        "mean_reward": sum(ep.total_reward for ep in episodes) / max(len(episodes), 1),
        "mean_turns": sum(ep.num_turns for ep in episodes) / max(len(episodes), 1),
        "action_tokens": action_tokens,
        "context_tokens": context_tokens,
        "truncated_turns": sum(n.finish_reason == "length" for n in nodes),
        **counts,
        "failed_episodes": len(failed),
        "wall_s": round(wall_s, 3),
        "action_tokens_per_s": round(action_tokens / wall_s, 2) if wall_s > 0 else math.nan,
    }


def write_run(out_dir: str | Path, trees: list[RolloutTree], summary: dict[str, Any]) -> Path:
    """Write ``trajectories.jsonl`` and ``summary.json`` into ``out_dir``, each atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".trajectories.jsonl.tmp"
    write_trees(tmp, trees)
    os.replace(tmp, out / "trajectories.jsonl")
    tmp = out / ".summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, out / "summary.json")
    return out

