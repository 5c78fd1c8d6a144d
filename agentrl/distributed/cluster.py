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

__all__ = ["cancel_call", "check_placeable", "connect", "ray_error", "ray_module"]


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


def check_placeable(ray: Any, need: dict[str, float], what: str = "an env worker") -> None:
    """Raise unless some live node has ``need``: Ray would keep such an actor pending, and its
    episodes would wait for ``rollout.episode_timeout_s`` without a word."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if any(all(res.get(k, 0.0) >= v for k, v in need.items()) for res in nodes):
        return
    have = sorted({k for res in nodes for k in res if not k.startswith("node:")})
    raise ConfigError(f"no node of the Ray cluster can host {what} needing {need} "
                      f"(distributed.env_worker_cpus or rollout_worker_cpus, and a sandbox_<backend> resource a node "
                      f"advertises with `ray start --resources`); the nodes have {have}")


def cancel_call(ref: Any) -> None:
    """Cancel a Ray call on the way out of a cancelled await; a failure here must not hide it."""
    if ref is None:
        return
    import ray

    try:
        ray.cancel(ref)
    except Exception:  # noqa: BLE001 - the call may have ended or its worker died meanwhile
        pass
