"""One job: run env calls (on a thread, in a child process, on a Ray env worker, or inline) and close the envs.

``rollout.env_executor`` picks the place: ``thread`` (a ``DaemonPool``
thread, so the event loop stays free), ``process`` (``ProcessEnv``, for env
steps that compute in Python), ``ray`` (env-worker actors,
``agentrl.distributed.env_workers``) or ``inline`` (on the loop, for
microsecond steps). A sandboxed tool env's coroutines are awaited on its own
loop whatever the setting.

Envs are reused between episodes while healthy. One that failed or timed out
may still be mid-step in a thread: it is never handed out again, and is closed
on a thread of its own; a hung process env is killed at once. At the end every
env is closed on a thread of its own too, and a ``close`` still running after
20 s is left to it with a warning: an env whose ``close`` hangs costs a thread,
not the run (its trees are written after this). An env that calls
``sys.exit`` fails its episode like one that raises.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from concurrent.futures import Future
from typing import Any

from ..config import Config
from ..env import EnvClosers, make_env
from ..errors import EnvError
from .pool import DaemonPool

__all__ = ["EnvExecutor"]

# How long ``close`` waits for the threads closing crashed envs (a hung process env
# is killed at once instead): a process env whose call failed answers ``close`` or
# is killed after 5 s for its lock and 5 s for an answer (ProcessEnv.close).
_CLOSE_WAIT_S = 20.0


class EnvExecutor:
    """Makes, lends, calls and closes the envs of one engine."""

    def __init__(self, cfg: Config, env_id: str):
        self.cfg, self.env_id = cfg, env_id
        self._pool = DaemonPool()
        self._idle: list[Any] = []
        self._all: list[Any] = []
        self._closers = EnvClosers()
        self._making: set[Future[Any]] = set()  # envs being made for episodes that may give up on them
        self._env_workers = None
        self._released = False  # the env-worker pool given back (close)
        if cfg.rollout.env_executor == "ray":  # Ray actors host the envs (agentrl.distributed)
            from ..distributed.env_workers import env_worker_pool

            self._env_workers = env_worker_pool(cfg, env_id)

    async def call(self, env: Any, method: str, *args: Any) -> Any:
        """Run an env method off the loop; a sandboxed tool env's coroutine is awaited directly.

        Methods are called on ``env.unwrapped``: a branch restores the inner env,
        which ``gymnasium.make``'s order-enforcing wrapper would not know about.
        """
        try:
            return await self._call(env, method, *args)
        except SystemExit as e:  # argparse or a library in the env exited: that ends its episode, not the run
            raise _exited(e) from None

    async def _call(self, env: Any, method: str, *args: Any) -> Any:
        inner = env.unwrapped
        remote = getattr(inner, "acall", None)  # hosted by a Ray env worker: await the call itself
        if remote is not None:
            return await remote(method, *args)
        on_env_loop = getattr(inner, "run_coroutine", None)  # ToolEnv: awaits a call on the env's loop
        native = getattr(inner, f"a{method}", None) if method in ("step", "reset") else None
        if native is not None and on_env_loop is not None:
            return await on_env_loop(native(seed=args[0]) if method == "reset" else native(*args))
        fn = getattr(inner, method)
        if self.cfg.rollout.env_executor == "inline":  # microsecond steps: a thread hop costs more
            return fn(seed=args[0]) if method == "reset" else fn(*args)
        loop = asyncio.get_running_loop()
        if method == "reset":
            return await loop.run_in_executor(self._pool, lambda: fn(seed=args[0]))
        return await loop.run_in_executor(self._pool, fn, *args)

    def _make_env(self) -> Any:
        if self._env_workers is not None:
            return self._env_workers.make_env()
        if self.cfg.rollout.env_executor == "process":
            from .env_process import ProcessEnv

            return ProcessEnv(self.env_id, **self.cfg.env.kwargs)
        return make_env(self.env_id, **self.cfg.env.kwargs)

    async def acquire(self) -> Any:
        """An idle env, or a new one made off the loop."""
        while self._idle:
            env = self._idle.pop()
            if self.cfg.rollout.env_executor != "process" or env.child_alive:
                return env
            self.release(env, healthy=False)  # its process ended while idle (the OOM killer): replace it
        made = self._pool.submit(self._make_env)
        self._making.add(made)
        try:
            env = await asyncio.wrap_future(made)
        except asyncio.CancelledError:  # timed out while the env starts: ``close`` closes what it makes
            raise
        except BaseException as e:
            self._making.discard(made)
            if isinstance(e, SystemExit):  # its constructor exited
                raise _exited(e) from None
            raise
        self._making.discard(made)
        self._all.append(env)
        return env

    def release(self, env: Any, healthy: bool, hung: bool = False) -> None:
        """Take an env back: a healthy one for the next episode; any other is closed (``hung``: killed)."""
        if healthy:
            self._idle.append(env)
            return
        self._all.remove(env)
        kill = getattr(env, "kill", None)
        if hung and kill is not None:  # a timed-out process env: its group is killed and reaped now
            kill()
            return
        # A timed-out or crashed env may still be mid-step in a thread: never
        # reuse it; close it on a thread of its own.
        self._closers.close(env)

    def close(self) -> None:
        """Close every env (each in its own try, on its own thread) and the step pool; wait
        at most ``_CLOSE_WAIT_S`` for them all."""
        envs, self._all, self._idle = self._all, [], []
        for env in envs:
            self._closers.close(env)
        deadline = time.monotonic() + _CLOSE_WAIT_S
        for made in list(self._making):  # its episode timed out while it started (a loaded machine)
            try:
                env = made.result(timeout=max(0.0, deadline - time.monotonic()))
            except BaseException:  # noqa: BLE001 - it failed to start, or still starts: nothing to close
                continue
            self._closers.close(env)
        self._making.clear()
        if hung := self._closers.wait(deadline):
            warnings.warn(f"{hung} env close() call(s) still running after {_CLOSE_WAIT_S:.0f} s: left to "
                          "their daemon threads", RuntimeWarning, stacklevel=2)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._env_workers is not None and not self._released:  # idle now: a later pool may shut it down
            from ..distributed.env_workers import release_env_worker_pool

            self._released = True
            release_env_worker_pool(self._env_workers)


def _exited(e: SystemExit) -> EnvError:
    # Raised past an asyncio task, a SystemExit would stop the event loop and the run with it.
    return EnvError(f"the env called sys.exit({e.code!r})")

