"""An episode's outcome: the one number per episode that the group and tree methods compare.

``outcome`` names it everywhere in ``agentrl.credit``:

- ``"return"``: the sum of the episode's rewards;
- ``"success"``: 1.0 when it succeeded, else 0.0 (``Episode.success``: the
  env's ``info["success"]`` when it reports one, else terminated with a last
  reward of at least ``agentrl.types.SUCCESS_REWARD``);
- a callable: any number computed from the ``Episode``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from agentrl.types import Episode

__all__ = ["Outcome", "episode_outcome"]

Outcome = str | Callable[[Episode], float]


def episode_outcome(episode: Episode, outcome: Outcome = "return") -> float:
    """The outcome of ``episode``, as named by ``outcome`` (see the module docstring)."""
    if callable(outcome):
        return float(outcome(episode))
    if outcome == "return":
        total = episode.total_reward
        if math.isinf(total) and all(map(math.isfinite, episode.rewards)):
            raise ValueError(f"the return of rewards {episode.rewards} overflows float64: scale the rewards down")
        return total
    if outcome == "success":
        return float(episode.success)
    raise ValueError(f"outcome must be 'return', 'success' or a callable, not {outcome!r}")
