"""Joining a Ray cluster, and mapping Ray's errors onto agentrl's at that one boundary.

``connect(dist)`` imports Ray lazily (``pip install agentrl[ray]``) and joins
the cluster ``distributed.ray`` names, unless this process is connected
already (a test, a notebook or a driver script that called ``ray.init``
keeps its own settings). Nothing here runs at import time.

``ray_error(e)``: an exception a remote call raised becomes what it was on
the other side (``RayTaskError`` carries it as ``cause``), so a crashed env step
reads the same as under ``env_executor: thread``; a dead or unreachable actor
becomes the agentrl error of the caller's kind (``EnvError``, ``PolicyError``).
"""

from __future__ import annotations

from typing import Any

from ..config import DistributedConfig
from ..errors import AgentRLError, ConfigError

__all__ = ["connect", "ray_error", "ray_module"]


def ray_module() -> Any:
    """``import ray``, or a ``ConfigError`` that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"the distributed section needs Ray, which does not import here ({e}): "
                          "pip install 'agentrl[ray]'") from e
    return ray


def connect(dist: DistributedConfig) -> Any:
    """The ``ray`` module, connected to the cluster ``dist.ray`` names (see ``DistributedConfig.ray``)."""
    ray = ray_module()
    if ray.is_initialized():
        return ray
    if dist.ray != "auto":
        ray.init(address=dist.ray)
        return ray
    try:
        ray.init(address="auto")  # a running cluster: RAY_ADDRESS or `ray start` on this machine
    except ConnectionError:
        ray.init(include_dashboard=False)
    return ray


def ray_error(e: BaseException, kind: type[AgentRLError], what: str) -> BaseException:
    """The exception to raise for ``e``, raised by a remote call to ``what`` (an actor's name).

    The original exception of a failed remote method; ``kind(...)`` naming
    ``what`` when the actor itself died or cannot be reached.
    """
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(e, RayTaskError):
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            return cause
        return kind(f"{what} failed: {str(e).strip().splitlines()[-1]}")
    if isinstance(e, RayActorError):
        lines = str(e).strip().splitlines()
        return kind(f"{what} died or is unreachable ({type(e).__name__}: {lines[0] if lines else ''})")
    return e
