"""The policy a run's config asks for: a backend in this process, or ``RayPolicy`` over rollout workers.

``policy_for_run`` is how ``train``, ``rollout``, ``eval`` and ``proxy serve``
get their policy, so each honours the ``distributed`` section the same way;
``open_policy`` is the same for a command, closed on the way out, and
``settle_for_command`` fixes in a command's config what that policy will be.
Ray is imported only when the config asks for rollout workers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..config import Config
from .base import Policy

__all__ = ["open_policy", "policy_for_run", "settle_for_command"]


def settle_for_command(cfg: Config) -> str:
    """Fix in ``cfg``, before a command (rollout, eval, the proxy) loads its policy, what that
    policy will be: the export a run or checkpoint folder means (``exact_model``), the backend
    ``auto`` picks, and for ``hf`` the precision it samples in (``command_precision``: a
    training config's ``train.precision``). Returns the line the command prints about it."""
    from ..distributed import placement
    from ..models import exact_model
    from ..precision import command_precision
    from .registry import resolve_backend

    cfg.policy.model = exact_model(cfg.policy.model)
    picked, why = resolve_backend(cfg.policy.backend)
    cfg.policy.backend = picked  # type: ignore[assignment]
    sampled_in = ""
    if picked == "hf":
        cfg.policy.precision, followed = command_precision(cfg)  # type: ignore[assignment]
        sampled_in = f", sampling in [bold]{cfg.policy.precision}[/]" + (" (its run's train.precision)"
                                                                          if followed else "")
    return f"loading model [bold]{cfg.policy.model}[/] on backend [bold]{picked}[/] ({why}){sampled_in}{placement(cfg)}"


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
    return RayPolicy(p, dist, tokenizer, model, call_timeout_s=dist.call_timeout_s,
                     max_failed_starts=dist.max_failed_starts)
