"""The policy a run's config asks for: a backend in this process, or ``RayPolicy`` over rollout workers.

``policy_for_run`` is how ``train``, ``rollout``, ``eval`` and ``proxy serve``
get their policy, so each honours the ``distributed`` section the same way;
``open_policy`` is the same for a command, closed on the way out. Ray is
imported only when the config asks for rollout workers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..config import Config
from .base import Policy

__all__ = ["open_policy", "policy_for_run"]


@contextlib.contextmanager
def open_policy(cfg: Config) -> Iterator[Policy]:
    """``policy_for_run(cfg)`` for a command (rollout, eval, the proxy), closed on the way out:
    rollout workers are killed, an in-process backend stops its threads and frees its caches."""
    policy = policy_for_run(cfg)
    try:
        yield policy
    finally:
        close = getattr(policy, "close", None)
        if close is not None:
            close()


def policy_for_run(cfg: Config, trainable: bool = False) -> Policy:
    """The policy a run's config asks for: ``RayPolicy`` over rollout workers when
    ``distributed.num_rollout_workers`` > 0 (with an in-process ``model`` to train when
    ``trainable``), else ``make_policy(cfg.policy)`` in this process."""
    from ..models import load_model, load_tokenizer
    from .registry import make_policy

    dist = cfg.distributed
    if dist is None or dist.num_rollout_workers == 0:
        return make_policy(cfg.policy)
    from ..distributed.rollout_workers import RayPolicy

    p = cfg.policy
    if trainable:
        model, tokenizer = load_model(p.model, dtype=p.dtype, device=p.device)
    else:
        model, tokenizer = None, load_tokenizer(p.model)
    return RayPolicy(p, dist, tokenizer, model)
