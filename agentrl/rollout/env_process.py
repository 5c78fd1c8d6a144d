"""Envs in their own processes, for CPU-heavy env steps (``rollout.env_executor: process``).

A thread pool keeps the event loop free, but Python threads share one
interpreter lock, so envs whose ``step`` computes in Python (a PDDL planner, a
game engine) still run one at a time. ``ProcessEnv`` hosts one env in a child
process and forwards ``reset``/``step``/``snapshot``/``restore``/``close`` over a
pipe; the engine calls it from its thread pool like any env.

A hung or crashed child fails only its episode. The child leads its own
process group, so whatever it started goes with it: ``kill`` sends SIGKILL to
the group at once and reaps the child (the engine does this to an env whose
episode timed out: it is known to be hung), and ``close`` asks the child to
close its env and kills the group if it does not answer; a child that answered
ends its group itself (what its env started and did not stop). A child whose parent is
gone without closing it (killed hard: SIGKILL, the OOM killer) ends its group
itself within ``_WATCH_S``, hung in a step or not; a call on a child that died
answers so within ``_WATCH_S``, even where a process its env started holds the
pipe open (no EOF then), and that process is killed. Snapshots and ``info``
travel by pickle, so they must be picklable (the built-in envs' are).

Hand-written rather than ``concurrent.futures.ProcessPoolExecutor``: a pool
worker keeps no per-env state between calls, and an env's state is the point.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import warnings
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_ready
from multiprocessing.reduction import ForkingPickler
from typing import Any

import gymnasium as gym

from ..env import resolve_env_id
from ..errors import EnvError

__all__ = ["ProcessEnv"]

_METHODS = ("reset", "step", "snapshot", "restore", "close", "expert_action", "oracle_action")
_REAP_S = 30.0  # a SIGKILLed process is gone in milliseconds; this bounds a stuck kernel
_WATCH_S = 0.5  # how often a child checks that its parent lives


def _load(entry: Any) -> Any:
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        return getattr(importlib.import_module(module), name)
    return entry


def _end_group() -> None:
    """SIGKILL this child's process group (itself and what its env started); only itself
    when it could not lead a group of its own, so that no process of its parent's group dies."""
    pid = os.getpid()
    with contextlib.suppress(OSError):
        if os.getpgid(0) == pid:
            os.killpg(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)


def _watch_parent(parent: int) -> None:
    """End the group once the parent is gone (reparented): a parent killed hard (SIGKILL, the OOM
    killer) runs no cleanup, and a child hung in a step never reads the pipe to learn of it."""
    while os.getppid() == parent:
        time.sleep(_WATCH_S)
    _end_group()


def _portable(e: BaseException) -> BaseException:
    """``e``, or a ``RuntimeError`` naming it, where ``e`` does not come back from pickle as it went:
    an error class whose constructor takes more than its message unpickles to a TypeError of its
    own, which named neither the env's error nor what it said."""
    try:
        back = pickle.loads(ForkingPickler.dumps(e))  # as Connection.send and recv do
    except Exception:  # noqa: BLE001 - any failure to travel: send its words instead
        return RuntimeError(f"{type(e).__name__}: {e}")
    return e if type(back) is type(e) else RuntimeError(f"{type(e).__name__}: {e}")


def _serve(conn: Connection, entry: Any, kwargs: dict[str, Any]) -> None:
    """The child: build the env, then answer calls until ``close`` or a closed pipe (the parent
    gone). Either way the group ends with it, with what the env started and did not stop."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # a group of its own: ``kill`` reaches the processes the env starts
    # the parent that started it (with ``forkserver``, the server, which ends with the parent)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="agentrl-env-watch").start()
    try:
        try:
            env = _load(entry)(**kwargs)
            conn.send((True, None))
        except BaseException as e:  # report, then exit: the parent raises it
            conn.send((False, _portable(e)))
            return
        _answer_calls(conn, env)
    finally:
        _end_group()


def _answer_calls(conn: Connection, env: Any) -> None:
    """Answer the parent's calls on ``env`` until ``close`` or a closed pipe."""
    while True:
        try:
            method, args, kw = conn.recv()
        except (EOFError, OSError):  # the parent closed the pipe without ``close``: it is gone
            return
        try:
            answer = (True, getattr(env, method)(*args, **kw))
        except BaseException as e:
            answer = (False, _portable(e))
        try:
            conn.send(answer)
        except Exception as err:  # it does not pickle: say what it was, as text
            ok, value = answer
            conn.send((False, EnvError(
                f"env.{method} returned an answer that cannot travel from the env's process (pickle: "
                f"{type(err).__name__}: {err}); return plain data, or run it on rollout.env_executor thread")
                if ok else RuntimeError(f"{type(value).__name__}: {value}")))
        if method == "close":
            return


class ProcessEnv:
    """A registered env hosted in a child process; the same methods as the env."""

    def __init__(self, env_id: str, start_method: str = "spawn", start_timeout_s: float = 300.0,
                 **kwargs: Any):
        spec = gym.spec(resolve_env_id(env_id))
        self.env_id = spec.id
        ctx = mp.get_context(start_method)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, spec.entry_point, {**spec.kwargs, **kwargs}),
                                 daemon=True, name=f"agentrl-env {spec.id}")
        # Two threads may reap the child at once (a kill, and a step thread that got EOF):
        # multiprocessing's waitpid is not safe for that, and the loser of the race saw it alive.
        self._reap_lock = threading.Lock()
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        self._closed = False
        if not self._answered(start_timeout_s):
            self._kill()
            raise RuntimeError(f"env process {spec.id} did not start within {start_timeout_s:.0f} s")
        ok, err = self._recv()
        if not ok:
            self._kill()
            raise err

    @property
    def unwrapped(self) -> ProcessEnv:
        return self

    def _answered(self, timeout: float | None = None) -> bool:
        """Whether the child answered or ended within ``timeout`` (None: no limit). Its end is
        checked beside the pipe: a process its env started may hold the pipe (and the exit
        sentinel) open, and then the child's death brings no EOF (a call waited on that process)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = _WATCH_S if deadline is None else min(_WATCH_S, deadline - time.monotonic())
            if left <= 0:
                return False
            if wait_for_ready([self._conn, self._proc.sentinel], left) or self._ended():
                return True

    def _peek(self) -> str:
        """The child's state, without reaping it (its pid stays its own until reaped): "running",
        "ended" (not reaped yet) or "reaped". Without ``os.waitid``: multiprocessing's own view."""
        waitid = getattr(os, "waitid", None)
        if waitid is None or not hasattr(os, "WNOWAIT"):
            return "running" if self._proc.exitcode is None else "reaped"
        try:
            ended = waitid(os.P_PID, self._proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped already (a kill on another thread)
            return "reaped"
        return "running" if ended is None else "ended"

    def _unreaped(self) -> bool:
        """Whether the child's pid is still its own: it runs, or it ended and is not reaped yet."""
        return self._peek() != "reaped"

    def _ended(self) -> bool:
        """Whether the child has ended (reaped or not)."""
        return self._peek() != "running"

    def _recv(self) -> tuple[bool, Any]:
        try:
            self._answered()  # a pipe closed meanwhile (``close`` gave up on a hung call) raises OSError
            if self._conn.poll():  # what the child sent before it ended comes first
                return self._conn.recv()
        except (EOFError, OSError):
            pass
        # It died. Its group goes too, before it is reaped (its pid cannot be reused until then).
        with contextlib.suppress(OSError):
            os.killpg(self._proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        self._join(1)  # reap it, so the exit code is known
        code = self._proc.exitcode
        return False, RuntimeError(f"env process {self.env_id} died (exit code {code})")

    def _ask(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"env process {self.env_id} is closed")
            try:
                self._conn.send((method, args, kwargs))
            except (BrokenPipeError, OSError) as e:
                raise RuntimeError(f"env process {self.env_id} is gone: {e}") from None
            ok, value = self._recv()
        if not ok:
            raise value
        return value

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return self._ask("reset", seed=seed, options=options)

    def step(self, action: str) -> Any:
        return self._ask("step", action)

    def snapshot(self) -> Any:
        return self._ask("snapshot")

    def expert_action(self) -> str:
        """The hosted env's scripted expert's next action (AttributeError if it has none)."""
        return self._ask("expert_action")

    def oracle_action(self) -> str:
        """The hosted env's privileged oracle's next action (AttributeError if it has none)."""
        return self._ask("oracle_action")

    def restore(self, snapshot: Any) -> None:
        self._ask("restore", snapshot)

    def close(self) -> None:
        """Close the env in its process; a child busy or hung for 5 s is killed."""
        if self._closed:
            return
        if self._lock.acquire(timeout=5):
            try:
                self._conn.send(("close", (), {}))
                if self._conn.poll(5):
                    self._conn.recv()
            except (EOFError, OSError):
                pass
            finally:
                self._closed = True
                self._lock.release()
        self._closed = True
        self._kill()  # the child ends its group itself once it answered; this is for one that did not

    @property
    def child_alive(self) -> bool:
        """Whether the env's process can still answer: not closed, and not ended (the OOM killer
        may end an idle one between episodes)."""
        return not self._closed and not self._ended()

    def kill(self) -> None:
        """Kill the child's process group now (SIGKILL) and reap it; for an env known to be
        hung. A call waiting on it returns at once with the child's death as its error."""
        self._closed = True
        self._kill(close_pipe=False)  # a thread may still be reading it: it gets EOF

    def _join(self, timeout: float) -> None:
        with self._reap_lock:
            self._proc.join(timeout=timeout)

    def _kill(self, close_pipe: bool = True) -> None:
        pid = self._proc.pid
        if pid is not None and self._unreaped():
            # The group first, while the child's pid is still its own (until it is reaped), and also
            # when the child has died already: what its env started must not outlive it.
            with contextlib.suppress(OSError):  # no such group: it never got to setpgid
                os.killpg(pid, signal.SIGKILL)
            self._proc.kill()
            self._join(_REAP_S)
            if self._proc.is_alive():
                warnings.warn(f"env process {self.env_id} (pid {pid}) survived SIGKILL for {_REAP_S:.0f} s",
                              RuntimeWarning, stacklevel=3)
        if close_pipe:
            self._conn.close()
