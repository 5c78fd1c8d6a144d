"""Joining a Ray cluster, and mapping Ray's errors onto agentrl's at that one boundary.

``connect(dist)`` imports Ray lazily (``pip install agentrl[ray]``) and joins
the cluster ``distributed.ray`` names, unless this process is connected
already (a test, a notebook or a driver script that called ``ray.init``
keeps its own settings). Nothing here runs at import time.

``ray: auto`` is resolved here, not by Ray's own ``address="auto"``, which
falls back to any GCS process it finds on the machine: that joins another
program's private ``ray.init()`` instance, whose actors die when that program
exits. ``auto`` is, in order (``cluster_address``): ``RAY_ADDRESS``; the
cluster ``ray start`` recorded on this machine (``ray_current_cluster`` in
Ray's temp folder, removed by ``ray stop``); else a private local instance
that ends with this process, whose workers run at normal priority
(``LOCAL_SYSTEM_CONFIG``). An address that does not answer is a
``ConfigError`` naming where it came from, within seconds: Ray itself would
retry for minutes.

``ray_error(e)``: an exception a remote call raised becomes what it was on
the other side (``RayTaskError`` carries it as ``cause``), so a crashed env step
reads the same as under ``env_executor: thread``; a dead or unreachable actor
becomes the agentrl error of the caller's kind (``EnvError``, ``PolicyError``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..config import DistributedConfig
from ..errors import AgentRLError, ConfigError

__all__ = ["LOCAL_SYSTEM_CONFIG", "cancel_call", "capacity", "check_placeable", "cluster_address", "connect", "free_per_node",
           "ray_error", "ray_module", "recorded_cluster_file", "restart_count", "wait_for_room"]

LOCAL = "local"  # Ray's own word for "start a new local instance", whatever else runs here
# Ray starts its workers at nice 15, so that a driver stays responsive. Here the workers do the
# run's work (generation, env steps): beside any busy process (a second run, a bench, the test
# suite) nice-15 workers get a few percent of a core; two rollout workers took 124 s to start
# beside two busy loops, against 5 s at nice 0. The private instance runs them at nice 0.
LOCAL_SYSTEM_CONFIG: dict[str, Any] = {"worker_niceness": 0}
_REACH_TIMEOUT_S = 5.0
ROOM_WAIT_S = 30.0  # how long new workers wait for free resources (wait_for_room) before the error
# connect() checks ray.is_initialized() and then inits: two threads at once (an env pool and the
# rollout workers being made together) would both init, the second failing or starting a second instance.
_CONNECT_LOCK = threading.Lock()


def ray_module() -> Any:
    """``import ray``, or a ``ConfigError`` that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"the distributed section needs Ray, which does not import here ({e}): "
                          "pip install 'agentrl[ray]'") from e
    return ray


def recorded_cluster_file(environ: Mapping[str, str] = os.environ) -> Path:
    """Where ``ray start`` records the GCS address of the cluster this machine runs or joined.

    Ray's ``get_ray_address_file`` (``ray/_common/utils.py``, 2.x): the folder
    ``ray`` in ``$RAY_TMPDIR``, else ``$TMPDIR`` on Linux, else ``/tmp``.
    """
    if "RAY_TMPDIR" in environ:
        tmp = environ["RAY_TMPDIR"]
    elif sys.platform.startswith("linux") and "TMPDIR" in environ:
        tmp = environ["TMPDIR"]
    else:
        tmp = "/tmp"
    return Path(tmp) / "ray" / "ray_current_cluster"


def cluster_address(setting: str, environ: Mapping[str, str], recorded: str | None) -> tuple[str, str]:
    """``(address, where it came from)`` for ``distributed.ray`` = ``setting``.

    ``recorded`` is what ``ray start`` wrote in ``recorded_cluster_file`` (None: nothing).
    ``auto`` never joins a cluster it merely finds running: ``LOCAL`` starts a private one.
    """
    if setting != "auto":
        return setting, f"distributed.ray={setting}"
    env = environ.get("RAY_ADDRESS", "").strip()
    if env and env != "auto":
        return env, f"distributed.ray=auto, from RAY_ADDRESS={env}"
    if recorded:
        return recorded, (f"distributed.ray=auto, from the cluster `ray start` recorded in "
                          f"{recorded_cluster_file(environ)} (`ray stop` clears it)")
    return LOCAL, "distributed.ray=auto: no RAY_ADDRESS and no `ray start` cluster here"


def _recorded(environ: Mapping[str, str]) -> str | None:
    try:
        return recorded_cluster_file(environ).read_text().strip() or None
    except OSError:
        return None


def _check_reachable(address: str, source: str) -> None:
    """Raise ``ConfigError`` unless ``host:port`` (of ``address``, ``ray://`` or not) accepts a
    connection: ``ray.init`` on an address nobody serves retries for minutes."""
    host, sep, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        return  # not host:port; Ray says what it makes of it
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_REACH_TIMEOUT_S):
            pass
    except OSError as e:
        raise ConfigError(f"cannot reach the Ray cluster at {address} ({source}): "
                          f"{e.strerror or e}; start it (`ray start --head`) or set distributed.ray "
                          "to a running cluster's address") from None


def connect(dist: DistributedConfig) -> Any:
    """The ``ray`` module, connected to the cluster ``dist.ray`` names (see the module docstring).
    Safe from several threads: one of them connects, the others find it connected."""
    ray = ray_module()
    if ray.is_initialized():
        return ray
    with _CONNECT_LOCK:
        if ray.is_initialized():  # another thread connected while this one waited
            return ray
        return _connect(ray, dist)


def _connect(ray: Any, dist: DistributedConfig) -> Any:
    recorded = _recorded(os.environ)
    address, source = cluster_address(dist.ray, os.environ, recorded)
    if address == LOCAL:
        ray.init(address=LOCAL, include_dashboard=False, _system_config=dict(LOCAL_SYSTEM_CONFIG))
        return ray
    _check_reachable(address, source)
    try:
        if dist.ray == "auto" and address == recorded:
            # Ray reads the same record for address=None, and only then uses the token that a
            # local cluster's auth needs (~/.ray/auth_token); "auto" in RAY_ADDRESS would
            # make it scan for any running GCS instead.
            with _without_env("RAY_ADDRESS"):
                ray.init()
        else:
            ray.init(address=address)
    except ConnectionError as e:
        raise ConfigError(f"cannot join the Ray cluster at {address} ({source}): {e}") from e
    return ray


@contextlib.contextmanager
def _without_env(name: str) -> Iterator[None]:
    old = os.environ.pop(name, None)
    try:
        yield
    finally:
        if old is not None:
            os.environ[name] = old


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


def capacity(nodes: list[dict[str, float]], need: dict[str, float]) -> int:
    """How many actors that each need ``need`` the ``nodes`` (each one's total resources) can
    host at once: an actor is placed on one node, so each node holds whole actors."""
    parts = {k: v for k, v in need.items() if v > 0}
    if not parts:
        return sys.maxsize
    # Ray counts resources in units of 1e-4: 2 CPUs hold 8 workers of 0.25 exactly
    return sum(min(int(res.get(k, 0.0) / v + 1e-6) for k, v in parts.items()) for res in nodes)


def check_placeable(ray: Any, need: dict[str, float], what: str = "env worker", count: int = 1,
                    keys: str = "distributed.num_env_workers, env_worker_cpus, and a sandbox_<backend> resource "
                                "a node advertises with `ray start --resources`") -> None:
    """Raise unless the live nodes can host ``count`` actors needing ``need`` each (each a
    ``what``, set by ``keys``): Ray would keep the others pending for good, and their episodes or
    requests would wait without a word."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    can = capacity(nodes, need)
    if can >= count:
        return
    have = sorted({k for res in nodes for k in res if not k.startswith("node:")})
    if can == 0:
        raise ConfigError(f"no node of the Ray cluster can host a {what} needing {need} ({keys}); "
                          f"the nodes have {have}")
    raise ConfigError(f"the Ray cluster can host {can} of the {count} {what}s needing {need} each ({keys}), "
                      f"never all: the others would wait for good. Its nodes have "
                      f"{_totals(nodes, need)} in all")


def wait_for_room(ray: Any, need: dict[str, float], what: str, count: int, keys: str) -> None:
    """Return once the cluster's free resources could hold ``count`` more actors (each a ``what``)
    needing ``need`` each; else, after ``ROOM_WAIT_S`` (what killed actors held comes back a moment after the
    kill), a ``ConfigError``: the other actors that hold the rest (this run's rollout or env
    workers, another job's) would keep the new ones pending without a word, their episodes
    waiting out ``rollout.episode_timeout_s``. Counted per node (``capacity``): an actor is
    placed on one node, so 2 free CPUs on each of two nodes hold no actor of 4."""
    want = {k: v * count for k, v in need.items() if v > 0}
    deadline = time.monotonic() + ROOM_WAIT_S
    while True:
        per_node = free_per_node(ray)
        if capacity(per_node, need) >= count:
            return
        if time.monotonic() >= deadline:
            nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
            free = _totals(per_node, need)
            raise ConfigError(f"the Ray cluster has {free} free of {_totals(nodes, need)} "
                              f"({[{k: res.get(k, 0.0) for k in want} for res in per_node]} per node), "
                              f"and {count} {what}s need {need} ({keys}) each, all of it on one node: other "
                              "actors hold the rest (this run's rollout or env workers, or another job's), "
                              "and Ray would keep the new ones waiting for them without a word")
        time.sleep(0.2)


def free_per_node(ray: Any) -> list[dict[str, float]]:
    """Each live node's free resources. Ray has no public call for it (2.x); where its private
    one is missing or cannot answer (through Ray Client, ``ray://``, this process holds no GCS
    connection), the cluster's sum as one node: a necessary condition only."""
    try:
        return list(ray._private.state.available_resources_per_node().values())
    except Exception:  # noqa: BLE001 - AttributeError (another Ray), RaySystemError (Ray Client)
        return [dict(ray.available_resources())]


def _totals(nodes: list[dict[str, float]], need: dict[str, float]) -> dict[str, float]:
    return {k: sum(res.get(k, 0.0) for res in nodes) for k in need}


def restart_count(actor: Any) -> int | None:
    """How many times Ray has restarted ``actor`` (GCS's actor table); None where Ray cannot
    say: its private state call is missing (another Ray) or cannot answer (Ray Client). A worker
    that crashes while it starts shows it: Ray answers "temporarily unavailable", never "died",
    under ``max_restarts=-1``, and only this count grows."""
    import ray

    try:
        return int(ray._private.state.actors(actor._actor_id.hex())["NumRestarts"])
    except Exception:  # noqa: BLE001 - AttributeError, KeyError, RaySystemError: unknown
        return None


def cancel_call(ref: Any) -> None:
    """Cancel a Ray call on the way out of a cancelled await; a failure here must not hide it."""
    if ref is None:
        return
    import ray

    try:
        ray.cancel(ref)
    except Exception:  # noqa: BLE001 - the call may have ended or its worker died meanwhile
        pass
