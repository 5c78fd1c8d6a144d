"""Env-worker actors: envs hosted in a Ray cluster (``rollout.env_executor: ray``).

The rollout engine calls an env through one executor interface (``reset``,
``step``, ``snapshot``, ``restore``, ``expert_action``, ``close``). Here each
call goes to an ``EnvWorker`` actor that hosts the env instance (and, for a
tool env, the sandboxes it leases: they live where the env lives). The engine
holds a ``RayEnv``, an env-shaped handle on one hosted instance, and awaits its
``acall`` on the event loop (a Ray object ref is awaitable), so no thread
waits on a remote step. Ray schedules the actors and moves the arguments; we
add no scheduler or RPC of our own.

Placement: an env worker reserves ``distributed.env_worker_cpus`` CPUs and,
when its env names a sandbox backend tied to the node, one unit of the custom
resource ``sandbox_<backend>`` (``env_resources``). A node that can run
docker containers advertises it when it joins the cluster, e.g.
``ray start --resources='{"sandbox_docker": 64}'``; an env that needs docker
is then never placed on a node without it. ``sandbox: local``, ``remote`` and
``auto`` ask for nothing more. Workers Ray could only keep pending are refused
with a ``ConfigError`` naming the keys, where Ray would say nothing: more than
the cluster's nodes can ever hold (``check_placeable``), or more than its free
resources hold after a short wait (``wait_for_room``: other actors, this run's
rollout workers say, hold the rest).

Failures, in the engine's two columns:

- an env method that raises on the worker raises the same exception here,
  and the engine fails the episode as it does for an env in a thread;
- a worker that dies (killed, out of memory, its node lost) fails the
  episodes whose envs it hosted: an in-flight call raises ``EnvError``, and a
  call that reaches the restarted worker finds the env gone and raises
  ``EnvError`` too, with that reason. Ray restarts the worker
  (``distributed.max_restarts``); the next episodes make fresh envs on it
  (an episode's first call, a reset, waits for the restart, up to
  ``RESTART_WAIT_S``, and makes the env anew where the dead incarnation held it).
  A worker Ray will not restart (``max_restarts`` used up), or one Ray restarts
  ``MAX_FAILED_STARTS`` times while a call waits for it (it crashes while it
  starts: ``max_restarts=-1`` would restart it for ever), is lost: the pool
  deals it no more envs, and an episode whose first call finds it dead moves
  to a live worker; with every worker lost, each episode fails saying so,
  and the next engine cannot take the pool (``env_worker_pool`` raises once and
  forgets it, so a later one starts new workers; the asynchronous producer asks
  ``lost_env_workers``): the run stops with the reason;
- an env that calls ``sys.exit`` (argparse on bad input) fails its episode
  with ``EnvError``, as in a thread: Ray would end the worker's process, and
  every episode it hosted with it;
- a call still running when its episode gave up on it (``rollout.episode_timeout_s``)
  keeps its thread until it returns: Ray cancels a call that has not started,
  but cannot interrupt a running thread. Its env is closed after it returns,
  never under it. A worker whose envs hang for good runs out of its
  ``MAX_CALLS_PER_WORKER`` threads: the pool deals it no more envs (it counts
  the calls given up on that still run), and with every live worker so, making
  an env fails saying why; ``ray.kill`` such a worker and Ray restarts it.

Workers are made once per process, cluster and env configuration
(``env_worker_pool``), and reused by every engine after it: a trainer makes
an engine for each batch, and starting actors each time would cost seconds.
A finished training run shuts its env's pools down
(``shutdown_env_worker_pools``, from ``Trainer.close``), so runs in one
process do not pile up actors on the cluster; a shutdown first has the workers
close the envs they still host (``SHUTDOWN_CLOSE_WAIT_S``), as a kill skips
``env.close``. Within a run, each env
configuration has its pool (a curriculum stage, the evaluation's
``env_kwargs``); an engine holds its pool while it runs (``users``) and gives
it back on close (``release_env_worker_pool``). Making a new pool first kills
the idle pools of the same env but the most recently used one (all of them
where the cluster has no free room for the new workers): a run
alternates between its training level and its evaluation, and each stage
would otherwise keep its workers' CPUs reserved until the run ends, so a
later stage's workers could wait for CPUs that no one gives back. A pool in
use is never killed. When a curriculum moves to its next stage, the trainer
retires the finished stage's pool (``retire_env_worker_pool``): the next
stage's new pool shuts it down, and the idle pool it keeps is the
evaluation's, not the one no engine will ask for again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import threading
import time
import uuid
from typing import Any

from ..config import Config, DistributedConfig
from ..env import close_quietly, import_env_modules, make_env, resolve_env_id
from ..errors import EnvError
from .cluster import (
    cancel_call,
    capacity,
    check_placeable,
    connect,
    free_per_node,
    ray_error,
    restart_count,
    wait_for_room,
)

__all__ = ["NODE_SANDBOX_BACKENDS", "EnvWorker", "EnvWorkerPool", "RayEnv", "env_resources",
           "env_worker_options", "env_worker_pool", "lost_env_workers", "release_env_worker_pool", "retire_env_worker_pool",
           "shutdown_env_worker_pools"]

# Sandbox backends that need something installed on the node itself; each becomes a
# custom Ray resource ``sandbox_<name>`` that the nodes which have it advertise.
NODE_SANDBOX_BACKENDS = ("docker", "gvisor", "bwrap")
# How long an episode's first call waits for its restarting worker (Ray answers "temporarily
# unavailable" until the new process is up) before its episode fails.
RESTART_WAIT_S = 120.0
# Restarts Ray makes of a worker while one call waits for it: each a start that failed (it crashes
# while it starts); at this many it is lost, as max_restarts=-1 would restart it for ever.
MAX_FAILED_STARTS = 3
# Calls one env worker runs at once (threads of a threaded actor): its envs step concurrently.
MAX_CALLS_PER_WORKER = 64
# How long a pool's shutdown waits for its workers to close the envs they host before it kills them.
SHUTDOWN_CLOSE_WAIT_S = 20.0


def env_resources(env_id: str, kwargs: dict[str, Any], imports: list[str] | tuple[str, ...] = ()
                  ) -> dict[str, float]:
    """Custom Ray resources an env worker for this env needs: ``{"sandbox_docker": 1.0}`` when
    the env's ``sandbox`` argument (from ``env.kwargs``, else the env's registration) names a
    backend tied to the node; ``{}`` otherwise."""
    import gymnasium as gym

    spec = gym.spec(resolve_env_id(env_id, imports))
    backend = {**spec.kwargs, **kwargs}.get("sandbox")
    if isinstance(backend, str) and backend in NODE_SANDBOX_BACKENDS:
        return {f"sandbox_{backend}": 1.0}
    return {}


def env_worker_options(env_id: str, kwargs: dict[str, Any], dist: DistributedConfig,
                       imports: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The Ray actor options of an env worker: CPUs, custom resources, restarts, concurrency."""
    return {"num_cpus": dist.env_worker_cpus, "resources": env_resources(env_id, kwargs, imports),
            "max_restarts": dist.max_restarts, "max_task_retries": 0,
            "max_concurrency": MAX_CALLS_PER_WORKER}


class EnvWorker:
    """The actor: env instances by handle, each made on its first call.

    A handle is chosen by the caller (``RayEnv``), so that after a restart a
    handle of the dead incarnation is simply unknown: the call fails with the
    reason instead of reaching another episode's env.
    """

    def __init__(self, env_id: str, kwargs: dict[str, Any], imports: list[str]):
        import_env_modules(imports)
        self.env_id, self.kwargs = resolve_env_id(env_id), kwargs
        self._envs: dict[str, Any] = {}
        self._busy: dict[str, int] = {}  # calls running on each env
        self._closing: set[str] = set()  # closed while a call ran on it: closed when that call ends
        self._lock = threading.Lock()
        self._shut = False  # close_all ran: the worker is about to be killed
        self.made = 0  # env instances this incarnation has made

    def pid(self) -> int:
        """This incarnation's process id (a restart changes it)."""
        return os.getpid()

    def call(self, handle: str, create: bool, method: str, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        """``env.unwrapped.<method>(*args, **kwargs)`` on the env ``handle``; ``create``: make it
        first if this worker does not host it yet."""
        with self._lock:
            if self._shut:
                raise EnvError("the env worker is shutting down (its pool's run ended)")
            env = self._envs.get(handle)
            if env is None and not create:
                raise EnvError(f"env worker restarted (now pid {os.getpid()}): the env's state "
                               "was lost with the process that hosted it")
            self._busy[handle] = self._busy.get(handle, 0) + 1  # busy while it is made, too
        try:
            if env is None:
                env = make_env(self.env_id, **self.kwargs)
                with self._lock:
                    self._envs[handle] = env
                    self.made += 1
            return getattr(env.unwrapped, method)(*args, **kwargs)
        except SystemExit as e:  # argparse on bad input: Ray would end this process, every env's
            raise EnvError(f"the env called sys.exit({e.code!r})") from None
        finally:
            with self._lock:
                self._busy[handle] -= 1
                last = not self._busy[handle]
                if last:
                    del self._busy[handle]
                late = last and (handle in self._closing or self._shut)  # made after close_all: close it too
            if late:
                self.close(handle)

    def close(self, handle: str) -> None:
        """Drop the env ``handle``; if a call still runs on it (one its episode gave up on, a
        timeout), the env is closed when that call returns, never under it."""
        with self._lock:
            if self._busy.get(handle):
                self._closing.add(handle)
                return
            self._closing.discard(handle)
            env = self._envs.pop(handle, None)
        if env is not None:
            env.close()

    def close_all(self) -> int:
        """Close every env this incarnation hosts, those a call still runs on too (the worker is
        about to be killed, which skips ``env.close``); how many. A close that raises is a
        warning: the others are closed all the same."""
        with self._lock:
            envs, self._envs = list(self._envs.values()), {}
            self._closing.clear()
            self._shut = True  # an env a call still makes is closed when that call ends (call)
        for env in envs:
            close_quietly(env)
        return len(envs)

    def hosted(self) -> int:
        """How many env instances this incarnation hosts."""
        return len(self._envs)

    def made_envs(self) -> int:
        """How many env instances this incarnation has made."""
        return self.made


class RayEnv:
    """An env hosted by an ``EnvWorker``: the engine awaits ``acall``; the sync methods
    (``reset``, ``step``, ...) block on the same calls, for scripts. ``pool`` (and the
    worker's ``index`` in it): told when the worker is lost, and asked for another."""

    def __init__(self, actor: Any, env_id: str, pool: EnvWorkerPool | None = None, index: int = 0):
        self._actor, self.env_id = actor, env_id
        self._pool, self._index = pool, index
        self.handle = uuid.uuid4().hex
        self._made = False
        self._closed = False

    @property
    def unwrapped(self) -> RayEnv:
        return self

    def _fresh(self, method: str) -> bool:
        """Whether the call needs no state of an earlier call: the env's first, or a reset (an
        episode's first call), which may make the env anew where its worker restarted."""
        return not self._made or method == "reset"

    def _ref(self, method: str, args: tuple[Any, ...]) -> Any:
        if self._closed:
            raise EnvError(f"env {self.env_id} ({self.handle}) is closed")
        kwargs: dict[str, Any] = {}
        if method == "reset":  # the engine passes the seed alone
            args, kwargs = (), {"seed": args[0] if args else None}
        return self._actor.call.remote(self.handle, self._fresh(method), method, args, kwargs)

    def _restarting(self, e: BaseException, wait: list[Any], method: str) -> bool:
        """Whether to send the call again: the worker is restarting and the call needs no
        state the dead incarnation held (``_fresh``), so it can run on the next one. ``wait``:
        the deadline and Ray's restart count when this call began waiting; once Ray has
        restarted it ``MAX_FAILED_STARTS`` more times (each start crashed), it is lost and the
        call goes to another worker (``_crash_looped``)."""
        from ray.exceptions import ActorUnavailableError

        if not self._fresh(method) or not isinstance(e, ActorUnavailableError):
            return False
        if not wait:
            wait += [time.monotonic() + RESTART_WAIT_S, restart_count(self._actor)]
        restarts = restart_count(self._actor) if wait[1] is not None else None
        if restarts is not None and restarts - wait[1] >= MAX_FAILED_STARTS:
            failed = restarts - wait[1]
            del wait[:]  # the next worker's wait begins anew
            return self._crash_looped(e, failed, restarts)
        return time.monotonic() < wait[0]

    def _crash_looped(self, e: BaseException, failed: int, restarts: int) -> bool:
        """The worker failed to start ``failed`` times in a row: kill it (Ray would restart it
        for ever, holding its CPUs), tell the pool it is lost, and move to a live worker (True);
        with none left, or no pool, ``EnvError`` saying why."""
        import ray

        why = (f"env worker {self._index} failed to start {failed} times in a row (Ray restarted it {restarts} "
               f"times; MAX_FAILED_STARTS={MAX_FAILED_STARTS}): it crashes while it starts")
        with contextlib.suppress(Exception):  # already dead, or the cluster is gone
            ray.kill(self._actor, no_restart=True)
        if self._pool is None:
            raise EnvError(why) from e
        nxt = self._pool.lost(self._index, why)
        if nxt is None:
            raise EnvError(self._pool.gone() or why) from e
        self._index, self._actor = nxt
        return True

    def _moved(self, e: BaseException, method: str) -> bool:
        """Whether to send the call again, to another worker: this one is lost for good
        (``ActorDiedError``: Ray will not restart it) and the call needs no state it held. The
        pool is told of the loss either way; with no live worker left, ``EnvError``."""
        from ray.exceptions import ActorDiedError

        if self._pool is None or not isinstance(e, ActorDiedError):
            return False
        nxt = self._pool.lost(self._index, str(ray_error(e, EnvError, f"env worker {self._index}")))
        if not self._fresh(method):
            return False  # the env's state died with it: the episode fails
        if nxt is None:
            raise EnvError(self._pool.gone() or f"every env worker of {self.env_id} is lost") from e
        self._index, self._actor = nxt
        return True

    async def acall(self, method: str, *args: Any) -> Any:
        """``method`` of the hosted env, awaited on the caller's loop."""
        wait: list[Any] = []
        while True:
            ref = self._ref(method, args)
            try:
                value = await ref
            except asyncio.CancelledError:  # an episode timeout: drop the call if it has not started
                cancel_call(ref)
                if self._pool is not None:  # one that has keeps a thread of the worker until it returns
                    self._pool.abandoned(self._index, ref)
                raise
            except Exception as e:
                if self._restarting(e, wait, method):
                    await asyncio.sleep(0.1)
                    continue
                if self._moved(e, method):
                    continue
                raise ray_error(e, EnvError, f"env worker of {self.env_id}") from e
            self._made = True
            return value

    def _get(self, method: str, *args: Any) -> Any:
        import ray

        wait: list[Any] = []
        while True:
            try:
                value = ray.get(self._ref(method, args))
            except Exception as e:
                if self._restarting(e, wait, method):
                    time.sleep(0.1)
                    continue
                if self._moved(e, method):
                    continue
                raise ray_error(e, EnvError, f"env worker of {self.env_id}") from e
            self._made = True
            return value

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        if options is not None:
            raise EnvError("RayEnv.reset passes a seed only")
        return self._get("reset", seed)

    def step(self, action: str) -> Any:
        return self._get("step", action)

    def snapshot(self) -> Any:
        return self._get("snapshot")

    def restore(self, snapshot: Any) -> None:
        self._get("restore", snapshot)

    def expert_action(self) -> str:
        return self._get("expert_action")

    def oracle_action(self) -> str:
        return self._get("oracle_action")

    def close(self) -> None:
        """Drop the hosted env; never waits (its worker may be dead or busy)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._actor.close.remote(self.handle)
        except Exception:  # a dead worker took the env with it
            pass


class EnvWorkerPool:
    """``dist.num_env_workers`` env-worker actors for one env; ``make_env`` deals envs out
    round-robin over the workers not lost (``lost``)."""

    def __init__(self, env_id: str, kwargs: dict[str, Any], dist: DistributedConfig,
                 imports: list[str] | tuple[str, ...] = ()):
        ray = connect(dist)
        self.env_id = resolve_env_id(env_id, imports)
        self.options = env_worker_options(self.env_id, kwargs, dist, imports)
        need = {"CPU": float(self.options["num_cpus"]), **self.options["resources"]}
        check_placeable(ray, need, count=dist.num_env_workers)
        wait_for_room(ray, need, "env worker", dist.num_env_workers,
                      "distributed.num_env_workers, env_worker_cpus")
        actor = ray.remote(EnvWorker).options(**self.options)
        self.workers = [actor.remote(self.env_id, dict(kwargs), list(imports))
                        for _ in range(dist.num_env_workers)]
        self._next = 0
        self._lost: set[int] = set()  # workers Ray will not restart: dealt no more envs
        self._lost_reason = ""  # how the last of them died, as Ray said
        # calls their episodes gave up on, per worker, that may still hold one of its threads
        self._abandoned: list[list[Any]] = [[] for _ in self.workers]
        self._lock = threading.Lock()
        self.users = 0  # engines holding it now (env_worker_pool, release_env_worker_pool)
        self.last_used = 0  # when it was last taken or given back, in _TICKS
        self.retired = False  # the first to go when a new pool is made (retire_env_worker_pool)
        self.key: tuple[str, ...] = ()  # its key in _POOLS

    def make_env(self) -> RayEnv:
        with self._lock:
            i, worker = self._deal()
        return RayEnv(worker, self.env_id, self, i)

    def _deal(self) -> tuple[int, Any]:
        """The next worker not lost with a free thread, round-robin (call with the lock held);
        every worker lost: the next one anyway, whose first call then fails saying so. Every
        live worker's threads held by calls their episodes gave up on: ``EnvError``, as such a
        worker runs no call until one returns."""
        n = len(self.workers)
        full = 0
        for _ in range(n):
            i = self._next % n
            self._next += 1
            if i in self._lost:
                continue
            if self._free_threads(i) > 0:
                return i, self.workers[i]
            full += 1
        if not full:  # every worker lost
            return i, self.workers[i]
        raise EnvError(f"all {self.options['max_concurrency']} threads of each live env worker of {self.env_id} "
                       f"run calls their episodes gave up on (env calls that hang past "
                       f"rollout.episode_timeout_s): no call can run until one returns. Find what hangs in "
                       f"the env; `ray.kill` a worker and Ray restarts it (distributed.max_restarts)")

    def abandoned(self, index: int, ref: Any) -> None:
        """The call ``ref`` on worker ``index`` was given up on (its episode timed out): until it
        returns it may hold one of the worker's threads (Ray cannot stop a running one)."""
        with self._lock:
            self._abandoned[index].append(ref)

    def _free_threads(self, index: int) -> int:
        """Threads of worker ``index`` not held by abandoned calls still running (lock held)."""
        refs = self._abandoned[index]
        if refs:
            import ray

            _, running = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            self._abandoned[index] = refs = running
        return self.options["max_concurrency"] - len(refs)

    def lost(self, index: int, reason: str = "") -> tuple[int, Any] | None:
        """Worker ``index`` died for good (``reason``: how, if known): deal it no more envs.
        Another live worker (index, actor) for an env not made yet, or None when none is left."""
        with self._lock:
            self._lost.add(index)
            self._lost_reason = reason or self._lost_reason
            if len(self._lost) == len(self.workers):
                return None
            return self._deal()

    def gone(self) -> str | None:
        """Why no env can run here any more, when every worker is lost; else None."""
        if len(self._lost) < len(self.workers):
            return None
        why = f"; last: {self._lost_reason}" if self._lost_reason else ""
        return (f"every env worker of {self.env_id} is lost ({len(self.workers)} of them; Ray restarts a "
                f"worker distributed.max_restarts={self.options['max_restarts']} times){why}")

    def shutdown(self, close_wait_s: float = SHUTDOWN_CLOSE_WAIT_S) -> None:
        """Close the envs the workers host (waiting at most ``close_wait_s``), then kill the
        workers: a kill skips ``env.close``, and what an env holds outside the worker's process
        (a docker sandbox's container) would outlive it."""
        import ray

        refs = []
        for w in self.workers:
            with contextlib.suppress(Exception):  # a dead worker took its envs with it
                refs.append(w.close_all.remote())
        with contextlib.suppress(Exception):
            ray.wait(refs, num_returns=len(refs), timeout=close_wait_s)
        failed: list[Exception] = []
        for w in self.workers:  # each one: a kill that fails must not leave the others running
            try:
                ray.kill(w)
            except Exception as e:  # noqa: BLE001 - raised below, once the rest are killed
                failed.append(e)
        if failed:
            raise failed[0]


_POOLS: dict[tuple[str, ...], EnvWorkerPool] = {}
_POOLS_LOCK = threading.Lock()
_MAKING: dict[tuple[str, ...], threading.Event] = {}  # pools being made, outside the lock: set once made
_TICKS = itertools.count(1)
KEEP_IDLE = 1  # idle pools of one env kept besides the one being made: a run's other level (its evaluation)


def env_worker_pool(cfg: Config, env_id: str | None = None) -> EnvWorkerPool:
    """The env workers for ``cfg``'s env (or ``env_id``) on the connected cluster, taken for one
    more user (give it back with ``release_env_worker_pool``); made on the first call in this
    process and reused after (see the module docstring). Making one (which may wait for room,
    ``wait_for_room``, and shut idle pools down) holds no lock: other callers go on; one that
    wants the same pool waits for it and shares it, and one that makes another pool of the same
    env waits until it is made (which idle pools to free depends on the room it took)."""
    dist = cfg.distributed
    if dist is None:
        raise EnvError("rollout.env_executor=ray needs the distributed section")
    ray = connect(dist)
    key = _pool_key(ray, cfg, env_id)
    while True:
        with _POOLS_LOCK:
            making = next((ev for k, ev in _MAKING.items() if _same_env(k, key)), None)
            if making is None:
                pool = _POOLS.get(key)
                if pool is not None and (why := pool.gone()):  # each episode would fail, step after step
                    del _POOLS[key]  # said once: the next call (a new run, a notebook's next cell) starts new workers
                    break
                if pool is not None:
                    return _taken(pool)
                stale = _idle_pools_to_free(ray, cfg, key, env_id)
                made = _MAKING[key] = threading.Event()
        if making is None:  # this caller makes it, with no lock held
            return _made_pool(cfg, key, env_id, stale, made)
        making.wait()  # another caller is making this pool (take it) or one of this env (then count the room)
    _shutdown_quietly([pool])  # outside the lock: it waits for the (dead) workers' close_all
    raise EnvError(f"{why}: no episode can run, so the run stops (the next pool of this env starts new workers)")


def _taken(pool: EnvWorkerPool) -> EnvWorkerPool:
    """``pool``, counted as taken by one more user (call with ``_POOLS_LOCK`` held)."""
    pool.users += 1
    pool.last_used = next(_TICKS)
    pool.retired = False  # taken again: wanted after all
    return pool


def _idle_pools_to_free(ray: Any, cfg: Config, key: tuple[str, ...], env_id: str | None) -> list[EnvWorkerPool]:
    """The idle pools of ``key``'s env a new pool shuts down first, taken out of ``_POOLS`` (call
    with ``_POOLS_LOCK`` held): the retired ones, and the others but the most recent, or all of
    them where the cluster has no room for the new pool's workers beside that one."""
    idle = sorted((k for k, p in _POOLS.items() if p.users == 0 and _same_env(k, key)),
                  key=lambda k: _POOLS[k].last_used, reverse=True)
    keep = [k for k in idle if not _POOLS[k].retired][:KEEP_IDLE]
    if not _room_for(ray, cfg.distributed, env_id or cfg.env.id, cfg.env.kwargs, cfg.env.imports,
                     freed=[_POOLS[k] for k in idle if k not in keep]):
        keep = []
    return [_POOLS.pop(k) for k in idle if k not in keep]


def _same_env(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Whether two pool keys are pools of one env (any env kwargs) on one node, job and
    distributed section: the pools a new one may shut down to make room."""
    return a[:3] == b[:3] and a[5] == b[5]


def _made_pool(cfg: Config, key: tuple[str, ...], env_id: str | None, stale: list[EnvWorkerPool],
               made: threading.Event) -> EnvWorkerPool:
    """Shut ``stale`` down, then make ``key``'s pool and take it, with no lock held (a shutdown
    waits for the workers to close their envs; new workers wait for room); ``made`` is set once
    it is in ``_POOLS``, or once making it failed, for the callers waiting on it."""
    try:
        _shutdown_quietly(stale)
        pool = EnvWorkerPool(env_id or cfg.env.id, cfg.env.kwargs, cfg.distributed, cfg.env.imports)
        pool.key = key
        with _POOLS_LOCK:
            _POOLS[key] = pool
            return _taken(pool)
    finally:
        with _POOLS_LOCK:
            _MAKING.pop(key, None)
        made.set()


def lost_env_workers() -> str | None:
    """Why this process's env workers can run no more episodes, when every worker of one of
    its pools is lost (see ``EnvWorkerPool.gone``); else None."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
    return next((why for p in pools if (why := p.gone())), None)


def release_env_worker_pool(pool: EnvWorkerPool) -> None:
    """Give back a pool ``env_worker_pool`` lent: it stays up for the next engine, until a new
    pool of the same env finds it idle and retired, or idle and not the most recently used."""
    with _POOLS_LOCK:
        pool.users = max(0, pool.users - 1)
        pool.last_used = next(_TICKS)


def retire_env_worker_pool(cfg: Config, env_id: str | None = None) -> bool:
    """Say that no engine will ask for ``cfg``'s env workers again (a finished curriculum stage):
    the next new pool of the env shuts it down first, once it is idle, and keeps another idle pool
    (the evaluation's) instead. Whether such a pool existed. Without it the stage's pool, the most
    recently used, would be the one kept, and the evaluation's would be shut down and made again.
    Nothing is killed here: the new pool counts the CPUs it frees by killing (``_room_for``), as
    Ray gives a killed actor's CPUs back only a moment later."""
    if cfg.distributed is None or cfg.rollout.env_executor != "ray":
        return False
    ray = connect(cfg.distributed)
    with _POOLS_LOCK:
        pool = _POOLS.get(_pool_key(ray, cfg, env_id))
        if pool is not None:
            pool.retired = True
    return pool is not None


def _pool_key(ray: Any, cfg: Config, env_id: str | None) -> tuple[str, ...]:
    """One pool per node, job, env, env configuration and distributed section."""
    ctx = ray.get_runtime_context()
    return (ctx.get_node_id(), ctx.get_job_id(), env_id or cfg.env.id,
            json.dumps(cfg.env.kwargs, sort_keys=True, default=str), json.dumps(cfg.env.imports),
            cfg.distributed.model_dump_json())


def _room_for(ray: Any, dist: DistributedConfig, env_id: str, kwargs: dict[str, Any], imports: list[str],
              freed: list[EnvWorkerPool] = ()) -> bool:
    """Whether the cluster has free resources for a new pool's workers once the ``freed`` pools
    are shut down (their reservations counted as free: they are still held now): where it has
    not, an idle pool kept for later would leave the new workers waiting for good. Counted per
    node, as a worker is placed on one (``capacity``); a freed worker gives back its whole
    reservation on its own node, which holds this many new ones at least."""
    opts = env_worker_options(resolve_env_id(env_id, imports), kwargs, dist, imports)
    need = {"CPU": float(opts["num_cpus"]), **opts["resources"]}
    room = capacity(free_per_node(ray), need)
    for pool in freed:
        held = {"CPU": float(pool.options["num_cpus"]), **pool.options["resources"]}
        room += capacity([held], need) * len(pool.workers)
    return room >= dist.num_env_workers


def _shutdown_quietly(pools: list[EnvWorkerPool]) -> None:
    for pool in pools:
        try:
            pool.shutdown()
        except Exception:  # noqa: BLE001 - the cluster may be gone already: nothing left to kill
            pass


def shutdown_env_worker_pools(env_id: str) -> int:
    """Kill and forget the env workers this process made for ``env_id`` (every env kwargs and
    cluster); how many pools. The next ``env_worker_pool`` for it starts new ones."""
    with _POOLS_LOCK:
        keys = [k for k in _POOLS if k[2] == env_id]
        pools = [_POOLS.pop(k) for k in keys]
    _shutdown_quietly(pools)
    return len(pools)
