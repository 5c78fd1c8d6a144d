"""What asynchronous training's producer samples with when the policy is ``RayPolicy``.

The rollout workers already hold their own copy of the weights, so the
producer needs a view of the same workers, not a snapshot: ``RaySampler``
sends its requests through the ``RayPolicy`` (tracked, so ``close`` can
cancel them) and checks after each sync that the workers report the synced
version (``lagging_workers``).
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import PolicyError
from ..policy.base import GenerateRequest, GenerateResult
from .cluster import cancel_call

__all__ = ["RaySampler", "lagging_workers"]


def lagging_workers(reported: dict[int, int], version: int) -> dict[int, int]:
    """The workers (index -> version) whose reported version is not ``version``."""
    return {w: v for w, v in sorted(reported.items()) if v != version}


class RaySampler:
    """What asynchronous training's producer samples with over a ``RayPolicy``.

    The rollout workers hold their own copy of the weights already, so there
    is nothing to snapshot: the trainer's sync (``sync_policy``, then
    ``weights_updated``) pushes the new weights, and ``refresh`` checks that
    every ready worker reports the synced version (a stale one, restarting,
    loads it before it serves again). ``close`` stops this view alone (the trainer's
    evaluations keep the workers): later requests fail at once and running ones
    are cancelled on their workers, so their episodes fail with the reason.
    """

    def __init__(self, policy: Any):
        self.policy, self.tokenizer = policy, policy.tokenizer
        self.closed = False
        self._refs: set[Any] = set()
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        return self.policy.version

    @property
    def deterministic(self) -> bool:
        return self.policy.deterministic

    @deterministic.setter
    def deterministic(self, on: bool) -> None:
        self.policy.deterministic = on

    @property
    def deterministic_by_default(self) -> bool:
        return self.policy.deterministic_by_default

    async def agenerate(self, request: GenerateRequest) -> GenerateResult:
        if self.closed:
            raise PolicyError("sampling stopped: the rollout producer is closing")
        return await self.policy.agenerate(request, sampler=self)

    def workers_gone(self) -> str | None:
        """Why the rollout workers can serve no more requests (all lost); else None."""
        return self.policy.workers_gone()

    def track(self, ref: Any) -> None:
        with self._lock:
            self._refs.add(ref)
        if self.closed:  # closed between the check and the dispatch
            cancel_call(ref)

    def untrack(self, ref: Any) -> None:
        with self._lock:
            self._refs.discard(ref)

    def refresh(self, net: Any, version: int) -> None:
        """The trainer synced ``version``: raise unless each ready worker says it holds it."""
        if self.policy.version != version:
            raise PolicyError(f"the rollout workers were pushed version {self.policy.version}, the trainer "
                              f"synced {version}: sync through the RayPolicy (weights_updated)")
        behind = lagging_workers(self.policy.worker_versions(), version)
        if behind:
            raise PolicyError(f"after the sync to version {version}, rollout workers report other versions "
                              f"({', '.join(f'worker {w}: {v}' for w, v in behind.items())}): their tokens "
                              "would be stamped with versions they were not sampled by")

    def close(self) -> None:
        self.closed = True
        with self._lock:
            refs = list(self._refs)
        for ref in refs:
            cancel_call(ref)
