"""One job: write a turn down: an env's answer as chat messages, and an env step as a tree ``Node``.

The rollout engine (``agentrl.rollout.episodes``) and SFT's expert episodes
(``agentrl.train.sft.expert_tree``) both go through ``step_node``, so an
expert episode and a policy episode of the same actions are the same tree,
token for token.
"""

from __future__ import annotations

import math
from typing import Any

from ..chat import ChatContext
from ..config import Config
from ..env import answer_problem, jsonable
from ..errors import ContextOverflowError, EnvError
from ..types import Node

__all__ = ["jsonable_info", "listed_actions", "observation_messages", "opening_messages", "record_next_context", "step_node", "top1"]

_HEAVY_INFO = ("admissible_actions", "tools", "tools_prompt")
# Written by the engine on a turn's node: an env's info that held them would pass for the
# engine's (a value head bootstraps from next_context_ids: token ids of the env's choosing).
_ENGINE_INFO = ("next_context_ids", "next_context_error")


def observation_messages(obs: str, info: dict[str, Any], cfg: Config) -> list[dict[str, Any]]:
    """The chat messages an env answer becomes: tool messages, or one user message
    (with the admissible actions listed when ``rollout.show_admissible``)."""
    if info.get("tool_messages"):  # tool envs answer with role=tool messages
        return [{k: v for k, v in m.items() if v is not None} for m in info["tool_messages"]]
    text = obs
    if cfg.rollout.show_admissible and info.get("admissible_actions"):
        text += "\nValid actions: " + ", ".join(map(str, info["admissible_actions"]))
    return [{"role": "user", "content": text}]


def opening_messages(obs: str, info: dict[str, Any], cfg: Config) -> list[dict[str, Any]]:
    """The opening conversation: the system prompt plus a tool env's tool list, then the first observation."""
    messages = []
    system = [p for p in (cfg.rollout.system_prompt, info.get("tools_prompt")) if p]
    if system:
        messages.append({"role": "system", "content": "\n\n".join(system)})
    return messages + observation_messages(obs, info, cfg)


def jsonable_info(info: dict[str, Any]) -> dict[str, Any]:
    """Info minus per-step lists and the keys the engine writes, made strict JSON
    (``agentrl.env.jsonable``) so trees serialize."""
    kept = {k: v for k, v in info.items() if k not in _HEAVY_INFO and k not in _ENGINE_INFO}
    if all(type(k) is str and k.isascii() and _plain_scalar(v) for k, v in kept.items()):
        return kept  # what ``jsonable`` would give back: skip it (the usual info)
    return jsonable(kept)


def _plain_scalar(v: Any) -> bool:
    t = type(v)
    return t in (int, bool, type(None)) or (t is str and v.isascii()) or (t is float and math.isfinite(v))


def step_node(node: Node, step: tuple[Any, Any, Any, Any, dict[str, Any]], ctx: ChatContext, cfg: Config,
              turns: int, max_turns: int) -> list[int] | None:
    """Write an env step's five-tuple onto ``node`` (the turn that acted) and grow ``ctx`` by its answer.

    ``turns`` counts this turn; at ``max_turns`` an unfinished episode is truncated.
    Returns the context delta the next turn's node carries, or None when the
    episode ends at ``node`` (done, cut by ``max_turns``, or its answer overflows
    the context; the reason is in ``node.info["truncation_reason"]``). Raises
    ``EnvError`` when the step's answer breaks the env contract (``answer_problem``;
    the engine checks it first, SFT's expert episodes here).
    """
    if problem := answer_problem("step", step):
        raise EnvError(problem)
    obs, reward, terminated, truncated, info = step
    node.observation, node.reward = obs, float(reward)
    node.terminated, node.truncated = bool(terminated), bool(truncated)
    node.info.update(jsonable_info(info))
    if not node.done and turns >= max_turns:
        node.truncated = True
        node.info["truncation_reason"] = f"max_turns={max_turns}"
    if node.done:
        return None
    try:
        return ctx.append_observation(observation_messages(obs, info, cfg))
    except ContextOverflowError as e:
        node.truncated = True
        node.info["truncation_reason"] = f"context budget: {e}"
        return None


def record_next_context(node: Node, ctx: ChatContext, messages: list[dict[str, Any]], max_context_tokens: int) -> None:
    """Keep the ids the next turn would have read, the state a value head bootstraps GAE
    from, if that turn could have run: it fits the context budget and renders."""
    try:
        ids = ctx.observation_ids(messages)
    except Exception as e:  # the cut turn is kept either way; it only bootstraps with 0
        node.info["next_context_error"] = f"{type(e).__name__}: {e}"
        return
    if len(ctx) + len(ids) < max_context_tokens:
        node.info["next_context_ids"] = ids


def listed_actions(info: dict[str, Any]) -> list[str] | None:
    """The admissible actions an env listed in ``info`` (``rollout.constrain``), as strings; None
    when it listed none. Rollouts and SFT read the list through this one function."""
    actions = info.get("admissible_actions")
    return [str(a) for a in actions] if actions else None


def top1(alternatives: list[tuple[int, float]]) -> float:
    """The probability of the likeliest token among a sampled token's top logprobs."""
    return math.exp(max(lp for _, lp in alternatives)) if alternatives else 0.0
