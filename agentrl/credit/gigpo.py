"""GiGPO: group-in-group advantages, episode level plus anchor-state step level.

Feng, Xue, Liu & An 2025, "Group-in-Group Policy Optimization for LLM Agent
Training" (arXiv 2505.10978), Sec. 4:

1. Episode relative advantage (Sec. 4.1), GRPO over the group's total returns:
   ``A_E(tau_i) = (R(tau_i) - mean_j R(tau_j)) / F_norm``.
2. Step relative advantage (Sec. 4.2). An *anchor state* ``s~`` is an env
   state that recurs across the group's episodes. All steps taken in it form
   the step-level group ``G_S(s~) = {(a_t^i, R_t^i) | s_t^i = s~}``, where
   ``R_t^i = sum_{k>=t} gamma**(k-t) * r_k^i`` is the discounted return from
   that step. Then ``A_S(a_t^i) = (R_t^i - mean_{G_S} R) / F_norm``.
3. Combined: ``A(a_t^i) = A_E(tau_i) + omega * A_S(a_t^i)``.

``F_norm`` is the group's std (``scale="std"``; the sample std, as in
``group.py``) or 1 (``scale="none"``); the paper allows both. Defaults follow
the paper: ``gamma=0.95``, ``omega=1``. A step whose state occurs once has no
step-level peers: its ``A_S`` is 0, so it gets the episode advantage only.

State keys. A step's key names the state its action was taken *in*. The env
reports it after the step that led there, so for turn ``k > 0`` it is the
previous turn's ``info["state_key"]`` (ALFWorld-v0 and WebShop-v0 set it),
else a hash of that turn's observation, normalised (lowercase, whitespace
collapsed). For turn 0 it is ``tree.meta["state_key"]`` when the rollout
engine stored the reset info's key and every root of the tree opens with the
same prompt (the engine resets every root to the tree's seed; one reset's key
cannot name roots that open differently), else a hash of the episode's own
opening prompt tokens (its root's: roots of other seeds open elsewhere), else
of ``tree.meta["instruction"]``.

Near-duplicates. With ``similarity=0.95`` (verl-agent's threshold), keys
whose ``difflib.SequenceMatcher`` ratio with a group's first key reaches the
threshold join that group (greedy, in order of first appearance). This only
means something on observation text, so ``episode_state_keys(..., hashed=False)``
gives the normalised text where it would hash it. An env's ``state_key`` is an
exact identity, and a hash is no text: ``episode_state_keys`` returns both as
``ExactKey``s, which only an equal key matches (two 44-character env keys one
character apart have a ratio of 0.977, yet name different states).
"""

from __future__ import annotations

import difflib
import hashlib
import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from agentrl.types import Episode, EpisodeGroup, RolloutTree

from .group import _array, _center_scale, _scaled, _unscaled
from .returns import discounted_returns

__all__ = [
    "ExactKey",
    "anchor_group_stats",
    "anchor_groups",
    "episode_state_keys",
    "gigpo_advantages",
    "gigpo_episode_advantages",
    "normalize_observation",
    "text_key",
]


class ExactKey(str):
    """A state key that ``similarity`` never merges with another: an env's ``state_key``
    or a hash. It equals (and hashes as) the plain string."""

    __slots__ = ()


def normalize_observation(text: str) -> str:
    """Lowercase, with every whitespace run collapsed to one space."""
    return " ".join(text.lower().split())


def text_key(text: str) -> str:
    """A short stable hash of the normalised ``text``."""
    return hashlib.blake2b(normalize_observation(text).encode(), digest_size=8).hexdigest()


def _env_key(value: Any) -> ExactKey | None:
    """An env's ``state_key`` as a key, or None when it reported none (missing, None or "").

    Not a truth test: 0 or False is a state (room 0), as the rollout engine, which
    stores the reset key when it ``is not None``, takes it."""
    return None if value is None or (isinstance(value, str) and not value) else ExactKey(value)


def _one_opening(tree: RolloutTree) -> bool:
    """Whether every root of ``tree`` opens with the same prompt tokens."""
    openings = [tree.nodes[r].context_ids for r in tree.roots]
    return all(ids == openings[0] for ids in openings[1:])


def _opening_key(episode: Episode, tree: RolloutTree) -> ExactKey:
    """The key of the state ``episode``'s first action was taken in (see the module docstring)."""
    key = _env_key(tree.meta.get("state_key"))
    if key is not None and _one_opening(tree):
        return key
    # the tokens before the first action: the episode's own root's opening prompt
    opening = episode.input_ids[: episode.turn_spans[0][0]] if episode.turn_spans else []
    if opening:
        ids = np.asarray(opening, dtype=np.int64).tobytes()
        return ExactKey("ctx:" + hashlib.blake2b(ids, digest_size=8).hexdigest())
    return ExactKey("instr:" + text_key(str(tree.meta.get("instruction", ""))))


def episode_state_keys(episode: Episode, tree: RolloutTree, hashed: bool = True) -> list[str]:
    """The state key of every turn of ``episode`` (see the module docstring).

    ``hashed=False`` gives the normalised observation text instead of its
    hash where no env key exists, for ``similarity`` grouping. Every other key
    (an env's, a hash) is an ``ExactKey``.
    """
    keys = [_opening_key(episode, tree)]
    for prev in episode.nodes[:-1]:
        key = _env_key(prev.info.get("state_key"))
        if key is not None:
            keys.append(key)
        elif hashed:
            keys.append(ExactKey("obs:" + text_key(prev.observation)))
        else:
            keys.append(normalize_observation(prev.observation))
    return keys[: episode.num_turns]


def _merge_similar(keys: list[Hashable], threshold: float) -> dict[Hashable, Hashable]:
    """Map each key to the first earlier key it is at least ``threshold`` similar to.

    An ``ExactKey`` is an identity, not text: it maps to itself and is no one's representative."""
    reps: list[Hashable] = []
    out: dict[Hashable, Hashable] = {}
    for k in keys:
        if isinstance(k, ExactKey):
            out[k] = k
            continue
        for rep in reps:
            m = difflib.SequenceMatcher(None, str(rep), str(k), autojunk=False)
            # the quick upper bounds skip most pairs before the quadratic ratio()
            if m.real_quick_ratio() >= threshold and m.quick_ratio() >= threshold \
                    and m.ratio() >= threshold:
                out[k] = rep
                break
        else:
            reps.append(k)
            out[k] = k
    return out


def anchor_groups(
    episodes: Sequence[Sequence[Any]],
    state_keys: Sequence[Sequence[Hashable]],
    similarity: float | None = None,
) -> dict[Hashable, list[tuple[int, int]]]:
    """Steps grouped by anchor state: ``{key: [(episode_idx, step_idx), ...]}``.

    ``episodes[i]`` is anything with one entry per step (its rewards, say);
    ``state_keys[i][t]`` is the key of the state step ``t`` of episode ``i``
    acted in. With ``similarity`` set, near-identical keys share the group of
    the first one (see the module docstring); an ``ExactKey`` only its own. Groups are in order of first
    appearance; a group may hold two steps of one episode (a revisited state).
    """
    if len(state_keys) != len(episodes):
        raise ValueError(f"state_keys has {len(state_keys)} episodes, episodes has {len(episodes)}")
    for i, (steps, keys) in enumerate(zip(episodes, state_keys, strict=True)):
        if len(keys) != len(steps):
            raise ValueError(f"state_keys[{i}] has {len(keys)} keys for {len(steps)} steps")
    if similarity is not None and not 0.0 < similarity <= 1.0:
        raise ValueError(f"similarity must be in (0, 1], got {similarity}")
    canon: dict[Hashable, Hashable] | None = None
    if similarity is not None and similarity < 1.0:
        distinct = list(dict.fromkeys(k for keys in state_keys for k in keys))
        canon = _merge_similar(distinct, similarity)
    groups: dict[Hashable, list[tuple[int, int]]] = {}
    for i, keys in enumerate(state_keys):
        for t, k in enumerate(keys):
            groups.setdefault(canon[k] if canon else k, []).append((i, t))
    return groups


def gigpo_advantages(
    episodes: Sequence[Sequence[float]],
    state_keys: Sequence[Sequence[Hashable]],
    gamma: float = 0.95,
    omega: float = 1.0,
    scale: str = "std",
    eps: float = 1e-6,
    similarity: float | None = None,
) -> list[list[float]]:
    """GiGPO's per-step advantage ``A_E + omega * A_S`` for one group.

    ``episodes[i][t]`` is the reward of step ``t`` of episode ``i``;
    ``state_keys`` as in ``anchor_groups``. Returns ``out[i][t]``.
    """
    raw = [_array(r, f"episodes[{i}]") for i, r in enumerate(episodes)]
    groups = anchor_groups(raw, state_keys, similarity)
    # Rewards near 1e308 would overflow their sums: work on them divided by a power of two
    # (exact, see group._scaled), below 1 each, so an episode's return stays below its length.
    flat = np.concatenate(raw) if raw else np.zeros(0)
    _, e = _scaled(flat)
    rewards, eps = [np.ldexp(r, -e) for r in raw], math.ldexp(eps, -e)
    # Episode level: GRPO over the undiscounted total returns.
    totals = np.array([r.sum() for r in rewards])
    a_e = _center_scale(totals, scale, eps)
    # Step level: discounted return from each step, normalised in its anchor group.
    step_return = [discounted_returns(r, gamma) for r in rewards]
    a_s = [np.zeros_like(r) for r in rewards]
    for members in groups.values():
        g = np.array([step_return[i][t] for i, t in members])
        for (i, t), a in zip(members, _center_scale(g, scale, eps), strict=True):
            a_s[i][t] = a
    out = [a_e[i] + omega * a_s[i] for i in range(len(rewards))]
    if scale == "none":  # advantages in the rewards' units: back from the scaled ones
        out = [_unscaled(a, e, flat) for a in out]
    return [a.tolist() for a in out]


def gigpo_episode_advantages(
    episodes: Sequence[Episode],
    tree: RolloutTree,
    gamma: float = 0.95,
    omega: float = 1.0,
    scale: str = "std",
    eps: float = 1e-6,
    similarity: float | None = None,
) -> list[list[float]]:
    """``gigpo_advantages`` on ``Episode``s of one ``tree`` (one group), per turn."""
    keys = [episode_state_keys(e, tree, hashed=similarity is None) for e in episodes]
    return gigpo_advantages(
        [e.rewards for e in episodes], keys, gamma, omega, scale, eps, similarity
    )


def anchor_group_stats(trees: Sequence[RolloutTree | EpisodeGroup],
                       similarity: float | None = None) -> dict[str, float]:
    """How many steps of a batch fell into anchor groups of two or more (GiGPO's step level).

    Every episode of a group acts first in the same opening state, so the first
    steps always share one; ``anchor/later_*`` counts the rest, the revisited
    states that give GiGPO's step-level advantage something to compare.
    Failed episodes (with an error) are left out, as ``assign`` leaves them out.
    """
    steps = shared = later = later_shared = 0
    largest = 0
    for group in map(EpisodeGroup.of, trees):
        tree = group.tree
        episodes = [e for e in group.episodes if not e.error and e.num_turns]
        if not episodes:
            continue
        keys = [episode_state_keys(e, tree, hashed=similarity is None) for e in episodes]
        for members in anchor_groups([e.rewards for e in episodes], keys, similarity).values():
            size = len(members)
            largest = max(largest, size)
            late = sum(1 for _, t in members if t > 0)
            steps, later = steps + size, later + late
            if size >= 2:
                shared, later_shared = shared + size, later_shared + late
    return {"anchor/steps": steps, "anchor/steps_in_groups_of_2plus": shared,
            "anchor/later_steps": later, "anchor/later_steps_in_groups_of_2plus": later_shared,
            "anchor/later_frac_in_groups_of_2plus": later_shared / later if later else 0.0,
            "anchor/largest_group": largest}
