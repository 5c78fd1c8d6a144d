"""``ToolEnv``: a tool-calling ``TextEnv`` around another ``TextEnv`` or a ``Task``.

Each action is read for tool calls (Hermes ``<tool_call>`` blocks or bare
OpenAI-style JSON, see ``agentrl.tools.parse``):

- **The action calls tools** (it holds a call, or a broken attempt at one): the
  calls run concurrently in the episode's sandbox, and the observation is their
  results, rendered as ``<tool_response>`` blocks (or JSON lines with
  ``style="json"``). Reward 0; the episode goes on.
- **The action calls no tool**: it is the final answer (for a ``Task``, scored by
  ``task.score``, and the episode terminates) or the wrapped env's action (passed
  to its ``step`` as it is, after the reasoning below).

The ``<think>...</think>`` block an action opens with (to the end of the action
when it is left open) is reasoning: a call drafted there is not run, and neither
the final answer (``strip_thinking``) nor the wrapped env's action holds it.

Model mistakes never raise. Invalid JSON, an unknown tool, arguments that fail
validation and calls over ``max_calls_per_turn`` each answer with an error
message in the observation. Each call's output is capped at
``max_output_chars``, and the whole observation at ``max_observation_chars``.
The episode is truncated after ``max_turns`` steps. A step after the episode
ended pays nothing and repeats how it ended (``terminated`` or ``truncated``), and
from the last step on ``info["admissible_actions"]`` is empty, as in every env.

Failures outside the model's control end the episode: a dead sandbox, a tool
that raised, a crash of the wrapped env or the verifier (a ``SystemExit`` too:
argparse exits on bad input), or a reward that is not a finite number. The step then returns ``truncated=True``, reward 0, and
the reason in ``info["error"]``.

The sandbox comes from ``sandbox=``: a ``Sandbox``, a factory or a pool (see
``agentrl.tools.sandbox_source``). It is leased on the first call that needs one
(or at reset when the task has files) and given back when the episode ends.

Settings (``ToolEnvConfig``'s fields, as keywords or ``config=``) are checked as
every env checks its own: a bad or unknown one is an ``EnvError`` naming it and
the value; ``"3"``, ``3.0`` and ``True`` are not whole numbers, nor a str a flag.

``reset``/``step`` are sync (the gymnasium API) and run on one process-wide
event-loop thread (``shared_loop``), so they also work inside a running loop, and
envs that share a pool share its loop. ``areset``/``astep`` are the
async versions. Use one kind per episode: asyncio objects, such as an
interpreter's pipes, belong to the loop that made them. Code on another loop
(the rollout engine) awaits ``env.run_coroutine(env.astep(action))``, which
runs the call on the env's loop.

``info`` carries ``tools`` (spec dicts), ``tools_prompt`` (their rendering for a
system prompt), ``turn``, and on tool turns
``tool_calls`` and ``tool_messages`` (``Message`` dicts with ``role="tool"``),
so a chat context can render the results with the model's own template. Around a
``TextEnv``, a tool turn's ``info`` also repeats the wrapped env's latest info (its
admissible actions and state key), since a tool turn does not step it.
"""

from __future__ import annotations

import asyncio
import copy
import difflib
import functools
import inspect
import math
import numbers
import queue
import random
import re
import threading
import traceback
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrl.env import TextEnv
from agentrl.errors import AgentRLError, ConfigError, EnvError, SandboxError, ToolError
from agentrl.loopthread import shared_loop
from agentrl.sandboxes.base import Sandbox
from agentrl.sandboxes.tar_filter import restore_filter
from agentrl.types import Message, ToolCall

from .base import Tool, ToolResult, run_and_settle, tool_problem, truncate_middle
from .parse import (
    MAX_CALLS,
    ParseResult,
    parse_tool_calls,
    render_tool_results,
    render_tools_prompt,
)
from .registry import get_tool
from .sandbox_source import SandboxSource, as_sandbox_source
from .task import Task

__all__ = ["ToolEnv", "ToolEnvConfig", "strip_thinking"]

_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)
# The reasoning a thinking model (Qwen3) opens its reply with; a "<think>" later on is text
# (a call's argument may hold one, and read as thinking it cut the call off).
_LEADING_THINK = re.compile(r"\A\s*<think>.*?(?:</think>|\Z)", re.DOTALL)

TaskSource = Task | Sequence[Task] | Callable[[np.random.Generator], Task]
T = TypeVar("T")

# Run inside the sandbox, in its workdir, with a tar archive of the workdir on stdin:
# make the workdir exactly the archive's files without killing any process (so the
# python tool's rebuilt interpreter lives on). Entries the archive lacks, or holds
# as another kind, are removed; regular files are rewritten in place, so a file the
# interpreter holds open stays the file others see. Dirs and files are made
# writable first, as a snippet's chmod must not block the sweep; the archive then
# sets every mode back. The filter is the one ``LocalSandbox.restore`` uses: its
# source, as the sandbox's Python cannot import agentrl. A Python before 3.11.4
# there has no extraction filters: the filter then only picks the kinds kept.
_PUT_BACK_SWEEP = r"""from __future__ import annotations
import io, os, stat, sys, tarfile
tar = tarfile.open(fileobj=io.BytesIO(sys.stdin.buffer.read()))
members = tar.getmembers()
kind = lambda m: "d" if m.isdir() else "l" if m.issym() else "f" if m.isreg() else "?"
want = {os.path.normpath(m.name): kind(m) for m in members}
for top, _, files in os.walk("."):
    os.chmod(top, os.lstat(top).st_mode & 0o7777 | 0o700)
    for f in files:
        st = os.lstat(os.path.join(top, f))
        if stat.S_ISREG(st.st_mode):
            os.chmod(os.path.join(top, f), st.st_mode & 0o7777 | 0o600)
for top, dirs, files in os.walk(".", topdown=False):
    for name in dirs + files:
        p = os.path.normpath(os.path.join(top, name))
        mode = os.lstat(p).st_mode
        if stat.S_ISDIR(mode):
            if want.get(p) != "d":
                os.rmdir(p)
        elif not (stat.S_ISREG(mode) and want.get(p) == "f"):
            os.unlink(p)
filters = hasattr(tarfile, "tar_filter")
if not filters:
    tarfile.tar_filter = lambda member, dest: member
"""
_PUT_BACK_EXTRACT = r"""
if filters:
    tar.extractall(".", members, filter=restore_filter)
else:
    tar.extractall(".", [m for m in members if restore_filter(m, ".")])
"""


@functools.cache
def _put_back_script() -> str:
    """The sweep, ``restore_filter``'s source, the extraction (read on first use, not at import)."""
    return _PUT_BACK_SWEEP + inspect.getsource(restore_filter) + _PUT_BACK_EXTRACT


async def _put_back_files(box: Sandbox, archive: Any, timeout: float) -> None:
    """Make ``box``'s workdir exactly the tar ``archive`` (a ``box.snapshot()``), leaving
    its processes running (``box.restore`` would kill them).

    Every backend here snapshots as a tar archive; for one that does not, the
    files are left as they are.
    """
    if not isinstance(archive, bytes | bytearray):
        return
    res = await box.run([box.python, "-I", "-c", _put_back_script()], stdin=bytes(archive), timeout=timeout)
    if not res.ok:
        why = "timed out" if res.timed_out else f"exit {res.exit_code}: {res.stderr[-600:]}"
        raise SandboxError(f"could not put the snapshot's files back ({why})")


_PARSE_ERROR = "parse_error"  # the name a call that could not be read is answered under


@dataclass(slots=True)
class _Pending:
    """Tool state that a restore set aside, rebuilt just before one of those tools runs."""

    states: dict[str, Any]  # tool name -> its ``snapshot_state``
    files: Any = None  # the sandbox's files, while no call has changed them since the restore


class ToolEnvConfig(BaseModel):
    """Limits and formats of a ``ToolEnv``. Strict: ``max_turns="3"``, ``3.0`` or ``True``
    is refused, not read as 3, 3 and 1 (a str is not a flag either)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    style: Literal["hermes", "json"] = Field(
        "hermes", description="Format of the tools prompt and of tool results (parsing reads both)."
    )
    max_calls_per_turn: int = Field(
        4, ge=1, le=MAX_CALLS,
        description=f"Calls run per turn; extra ones get an error (the parser reads {MAX_CALLS}).",
    )
    max_output_chars: int = Field(4_000, ge=64, description="Cap on one call's output, in chars.")
    max_observation_chars: int = Field(
        16_000, ge=256, description="Cap on a whole tool observation, in chars."
    )
    max_turns: int = Field(16, ge=1, description="Steps before the episode is truncated.")
    call_timeout_s: float = Field(
        180.0, gt=0, allow_inf_nan=False, description="Wall-clock limit of one call, on top of the tools' own timeouts."
    )
    tools_in_observation: bool = Field(
        False,
        description="Prepend the rendered tools prompt to the first observation, for models "
        "whose chat template does not take tools.",
    )


def _settings(config: Any, overrides: dict[str, Any]) -> ToolEnvConfig:
    """``config`` (a ``ToolEnvConfig`` or None) with ``overrides`` set, or an ``EnvError``
    naming the setting and the value, as every env's settings are checked
    (``agentrl.envs._settings``). Numpy scalars count as the Python ones."""
    if config is not None and not isinstance(config, ToolEnvConfig):
        raise EnvError(f"config must be a ToolEnvConfig or None, not {config!r:.80}; "
                       "or pass the settings as keywords: ToolEnv(..., max_turns=8)")
    known = list(ToolEnvConfig.model_fields)
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise EnvError(f"unknown ToolEnv setting {key!r}{hint} Settings: {', '.join(known)}")
    plain = {k: v.item() if isinstance(v, np.generic) else v for k, v in overrides.items()}
    try:
        return ToolEnvConfig.model_validate({**(config or ToolEnvConfig()).model_dump(), **plain})
    except ValidationError as err:
        e = err.errors(include_url=False)[0]
        name = ".".join(map(str, e["loc"]))
        why = e["msg"][:1].lower() + e["msg"][1:]
        raise EnvError(f"ToolEnv setting {name}: {why}, not {e['input']!r:.80}") from err


def _reset_options(options: Any, wraps_env: bool) -> dict[str, Any]:
    """``options`` of ``reset`` (None: none) as a dict, or an ``EnvError`` saying what is
    wrong, as every env checks them: around a task source the one option is ``task``, a
    ``Task`` (a misspelt one was ignored, and another task played); a wrapped env checks its own."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise EnvError(f"reset options must be a dict, not {options!r:.80}")
    if not wraps_env:
        if unknown := sorted(set(options) - {"task"}, key=repr):
            raise EnvError(f"unknown reset option {', '.join(f'options[{k!r}]' for k in unknown)}: "
                           "this env takes 'task'")
        task = options.get("task")
        if task is not None and not isinstance(task, Task):
            raise EnvError(f"options['task'] must be a Task, not {task!r:.80}")
    return dict(options)


def _as_reward(value: Any) -> float:
    """``value`` as a float, or a ``ValueError`` naming it: a NaN or infinite reward
    would reach every advantage of its group, and a str or None is a verifier bug."""
    if isinstance(value, numbers.Real | np.bool_) and math.isfinite(value):
        return float(value)
    raise ValueError(f"the reward must be a finite number, got {value!r}")


def _tool_failure(name: str, err: BaseException) -> str:
    """Why a tool call failed the episode. A bug in the tool's own code gets the
    traceback, to say where it broke; agentrl's errors (a dead sandbox) say it already."""
    why = f"tool {name!r} failed: {type(err).__name__}: {err}"
    if isinstance(err, AgentRLError):
        return why
    return why + "\n" + "".join(traceback.format_exception(err, limit=-8))


class _InnerThread:
    """One daemon thread that runs the wrapped env's ``reset`` and ``step``, in call order.

    Off the shared loop, where a slow step held every other env's tool calls;
    always the same thread, so an env may keep thread-bound state (a sqlite
    connection). Not a one-worker ``ThreadPoolExecutor``: Python joins those
    threads at exit, so a step hung for ever would keep the process alive.
    """

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="agentrl-wrapped-env", daemon=True)
            self._thread.start()
        self._calls.put((fn, args, kwargs, loop, done))
        return await done

    def stop(self) -> None:
        if self._thread is not None:
            self._calls.put(None)
            self._thread = None

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, args, kwargs, loop, done = item
            run_and_settle(loop, done, fn, *args, **kwargs)


# Caught where user code runs (a tool, a verifier, a wrapped env's step) as any failure.
# A SystemExit (argparse on bad input calls exit) that leaves a task of the loop every
# env shares stops the loop's thread: that step, and every later call of every env, then
# waits forever. A KeyboardInterrupt is left alone: Ctrl-C must still stop the program.
_FAILURES = (Exception, SystemExit)


async def _exit_as_error(coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro``; a ``SystemExit`` from code the env runs becomes an ``EnvError``,
    where it would stop the shared loop's thread (see ``_FAILURES``)."""
    try:
        return await coro
    except SystemExit as err:
        raise EnvError(f"code this env ran called exit({err.code!r})") from err


async def _invoke(tool: Tool, arguments: dict[str, Any], box: Sandbox | None) -> ToolResult:
    """``tool.invoke``, with a ``SystemExit`` as a ``ToolError`` (see ``_FAILURES``)."""
    try:
        return await tool.invoke(arguments, box)
    except SystemExit as err:
        raise ToolError(f"it called exit({err.code!r})") from err


@functools.lru_cache(maxsize=4)
def _order(n: int, epoch: int) -> list[int]:
    """The tasks of a list of ``n``, in the order seeds ``epoch * n ..`` play them."""
    order = list(range(n))
    random.Random(epoch).shuffle(order)
    return order


def _shuffled(n: int, seed: int) -> int:
    """The index of the task ``seed`` plays in a list of ``n``: each run of ``n`` seeds
    from a multiple of ``n`` plays every task once, in an order of its own."""
    seed = int(seed)  # a numpy int too: random.Random takes no other
    return _order(n, seed // n)[seed % n]


def _after_reasoning(action: str) -> str:
    """``action`` without the ``<think>`` block it opens with, nor the blank after it."""
    m = _LEADING_THINK.match(action)
    return action[m.end():].lstrip() if m else action


def strip_thinking(text: str) -> str:
    """``text`` without ``<think>...</think>`` blocks, stripped."""
    return _THINK.sub("", text).strip()


@dataclass(slots=True)
class _Outcome:
    observation: str
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] | None = None
    error: str | None = None


class ToolEnv(TextEnv):
    """Wraps a ``TextEnv`` or a task source into a tool-calling ``TextEnv``.

    ``source`` is a ``TextEnv``, a ``Task``, a sequence of tasks (seeds ``0 .. n-1`` play
    each once in a shuffled order, as each later run of ``n`` seeds does; an unseeded
    reset draws one) or a function ``rng -> Task``. ``tools`` are ``Tool`` instances or built-in tool names.
    ``reset(options={"task": Task(...)})`` plays a given task.
    """

    def __init__(
        self,
        source: TextEnv | TaskSource,
        tools: Sequence[Tool | str] = (),
        sandbox: Any = None,
        config: ToolEnvConfig | None = None,
        render_mode: str | None = None,
        **overrides: Any,
    ):
        super().__init__(render_mode=render_mode)
        self.config = _settings(config, overrides)
        self.inner = source if isinstance(source, TextEnv) else None
        self._tasks = None if self.inner is not None else source
        if isinstance(tools, str | Tool):  # a str is a sequence too: of letters
            raise ConfigError(f"tools takes a list, e.g. tools=[{tools!r}]")
        self.tools: dict[str, Tool] = {}
        self._made_tools: list[Tool] = []  # made here from names: closed with the env
        for t in tools:
            if isinstance(t, str):
                t = get_tool(t)
                self._made_tools.append(t)
            if problem := tool_problem(t):
                raise ConfigError(f"bad tool: {problem}")
            if t.name in self.tools:
                raise EnvError(f"two tools are named {t.name!r}; tool names must be unique")
            if t.name == _PARSE_ERROR:
                raise ConfigError(f"a tool is named {_PARSE_ERROR!r}, the name the env answers "
                                  "unreadable calls under; rename it")
            self.tools[t.name] = t
        self._source: SandboxSource | None = as_sandbox_source(sandbox)
        needy = [t.name for t in self.tools.values() if t.needs_sandbox]
        if needy and self._source is None:
            raise ConfigError(
                f"tools {needy} run in a sandbox; pass ToolEnv(sandbox=...) with a Sandbox, "
                "a factory or a pool, e.g. sandbox=lambda: make_sandbox(\"auto\") (agentrl.sandboxes: "
                "the strongest backend this machine has); the built-in tool envs take sandbox=\"auto\""
            )
        self._loop = shared_loop()
        self._inner_thread = _InnerThread() if self.inner is not None else None
        self.sandbox: Sandbox | None = None
        self.task: Task | None = None
        self._turn = 0
        self._ended: tuple[bool, bool] | None = None  # (terminated, truncated) once over
        self._started = False
        self._base_info: dict[str, Any] = {}
        self._release_error: str | None = None
        self._replay_log: dict[str, Any] = {"seed": None, "options": {}, "actions": []}
        self._pending: _Pending | None = None  # see ``restore``

    # -- public API --------------------------------------------------------------
    @property
    def num_tasks(self) -> int | None:
        """For a list of tasks, how many it holds: seeds ``0 .. num_tasks - 1`` play each once
        (``agentrl eval`` plays them). None for other sources."""
        src = self._tasks
        if isinstance(src, Sequence) and not isinstance(src, str) and len(src) > 0:
            return len(src)
        return None

    def tool_specs(self) -> list[dict[str, Any]]:
        """The spec dicts of this env's tools (``ToolSpec.model_dump()``)."""
        return [t.spec().model_dump() for t in self.tools.values()]

    def tools_prompt(self) -> str:
        """The system-prompt text that lists the tools in this env's style."""
        return render_tools_prompt(self.tool_specs(), style=self.config.style)

    async def run_coroutine(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` (an ``areset``/``astep`` call of this env) on this env's event loop,
        from any running loop: the loop its sync API uses, where its sandbox's asyncio
        objects live. Cancelling the awaiting task cancels the call."""
        return await self._loop.arun(_exit_as_error(coro))

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on this env's loop, blocking; see ``_exit_as_error``."""
        try:
            return self._loop.run(_exit_as_error(coro))
        finally:
            if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
                coro.close()  # never run (called from its own loop): not "never awaited"

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        return self._run(self.areset(seed=seed, options=options))

    def step(self, action: str):
        return self._run(self.astep(action))

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Async ``reset``: end the previous episode, start a new one."""
        options = _reset_options(options, wraps_env=self.inner is not None)
        TextEnv.reset(self, seed=seed)
        await self._end_episode()
        self._turn, self._ended, self._started = 0, None, True
        if self.inner is not None:
            if seed is None:  # an explicit seed lets the episode be replayed
                seed = int(self.np_random.integers(2**31 - 1))
            assert self._inner_thread is not None
            obs, info = await self._inner_thread.call(self.inner.reset, seed=seed, options=options or None)
            info = dict(info)
            self._replay_log = {"seed": seed, "options": options, "actions": []}
        else:
            self.task = options.get("task") or self._draw_task(seed)
            self._replay_log = {"seed": None, "options": {"task": self.task}, "actions": []}
            obs = self.task.prompt
            info = {"instruction": self.task.prompt, **self.task.info}
        info["tools"] = list(info.get("tools") or []) + self.tool_specs()
        if self.tools:  # runners put this in the system prompt (see agentrl.rollout)
            info["tools_prompt"] = self.tools_prompt()
        self._base_info = dict(info)
        if self._release_error:
            info["release_error"], self._release_error = self._release_error, None
        if self.task is not None and self.task.needs_sandbox and self.inner is None:
            try:
                await self.task.setup(await self._ensure_sandbox())
            except _FAILURES as err:  # the episode fails; the reason is recorded
                self._ended = (False, True)
                info["error"] = f"task setup failed: {type(err).__name__}: {err}"
                await self._end_episode()
        if self.config.tools_in_observation and self.tools:
            obs = self.tools_prompt() + "\n\n" + obs
        self._last_obs = obs
        return obs, info

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Async ``step``: run the tool calls in ``action`` or take it as the final answer."""
        if not self._started:
            raise EnvError("step() before reset(); call reset() first")
        info = {k: v for k, v in self._base_info.items() if k != "error"}
        if self._ended is not None:  # pays nothing and repeats how the episode ended
            info["admissible_actions"] = []
            self._last_obs = "The episode is over. Call reset() to start a new one."
            return self._last_obs, 0.0, *self._ended, info
        self._turn += 1
        self._replay_log["actions"].append(action)
        # Calls are read after the reasoning: one drafted while thinking is not made, and the
        # final answer (which leaves the thinking out too) is scored instead of lost.
        parsed = parse_tool_calls(_after_reasoning(action) if isinstance(action, str) else action)
        if parsed.attempted:
            out = await self._tool_turn(parsed)
        else:
            out = await self._final_turn(action if isinstance(action, str) else str(action))
        if out.info:
            info.update(out.info)
        info["tools"] = self._base_info["tools"]
        info["turn"] = self._turn
        terminated = out.terminated and out.error is None
        truncated = not terminated and (
            out.truncated or out.error is not None or self._turn >= self.config.max_turns
        )
        if out.error is not None:
            info["error"] = out.error
        if terminated or truncated:
            self._ended = (terminated, truncated)
            info["admissible_actions"] = []  # no action is taken any more
            await self._end_episode()
            if self._release_error:
                info["release_error"], self._release_error = self._release_error, None
        self._last_obs = out.observation
        return out.observation, float(out.reward), terminated, truncated, info

    def close(self) -> None:
        try:
            self._run(self._end_episode())
        finally:
            if self.inner is not None:
                self.inner.close()
            if self._inner_thread is not None:
                self._inner_thread.stop()
            # Tools given as instances belong to the caller, who may share them with other envs.
            for t in self._made_tools:  # the calculator's worker outlived close() until gc
                t.close()
        super().close()

    # -- branching ---------------------------------------------------------------
    def snapshot(self) -> Any:
        """A branch point: this env's state plus the sandbox's snapshot.

        When a sandbox is in use and its backend cannot snapshot, the snapshot
        is the episode's reset arguments and action log instead, and ``restore``
        replays them in a reset sandbox (tools must then be deterministic).
        State a tool keeps outside the sandbox's files (the ``python`` tool's
        interpreter) is captured by ``Tool.snapshot_state``; see ``restore``.
        """
        box, tools = None, {}
        if self.sandbox is not None:
            try:
                box = self._run(self.sandbox.snapshot())
            except NotImplementedError:
                return {"replay": copy.deepcopy(self._replay_log)}
            pending = self._pending.states if self._pending else {}
            tools = {**self._run(self._tool_states(self.sandbox)), **pending}
        inner = self._on_inner_thread(self.inner.snapshot) if self.inner is not None else None
        own = (
            self.task, self._turn, self._ended, self._started, self._base_info,
            self._last_obs, self._replay_log,
        )  # fmt: skip
        return {"inner": inner, "own": copy.deepcopy(own), "sandbox": box, "tools": tools}

    def restore(self, snapshot: Any) -> None:
        """Go back to ``snapshot``: the sandbox's files, the tools' state, this env's state.

        Right after ``restore`` the sandbox holds exactly the snapshot's files. A
        tool's state is rebuilt only when the tool is next called (a branch that
        never calls ``python`` pays nothing): ``Tool.restore_state`` runs first
        (the ``python`` tool re-runs its snippets, which may write files again),
        then the files are put back as they were just before that call, without
        killing the rebuilt interpreter. So the workdir never shows a replay's
        side effects. Side effects outside the workdir are replayed: network
        calls, files under /tmp (bwrap's /tmp is wiped by the restore, then
        refilled by the replay), processes the snippets started. Variables that a
        snippet computed from files see the files as they are at the rebuild,
        not as they were when the snippet first ran.
        """
        if "replay" in snapshot:
            self._run(self._replay(copy.deepcopy(snapshot["replay"])))
            return
        if snapshot["sandbox"] is not None:
            self._run(self._restore_sandbox(snapshot["sandbox"]))
            tools = copy.deepcopy(snapshot.get("tools") or {})
            self._pending = _Pending(tools, snapshot["sandbox"]) if tools else None
        elif self.sandbox is not None:  # the branch point had no sandbox state yet
            self._run(self._end_episode())
        if self.inner is not None:
            self._on_inner_thread(self.inner.restore, snapshot["inner"])
        own = copy.deepcopy(snapshot["own"])
        (
            self.task, self._turn, self._ended, self._started, self._base_info,
            self._last_obs, self._replay_log,
        ) = own  # fmt: skip

    def _on_inner_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (the wrapped env's) on the thread its reset and step run on."""
        assert self._inner_thread is not None
        return self._run(self._inner_thread.call(fn, *args))

    async def _tool_states(self, box: Sandbox) -> dict[str, Any]:
        states = {name: await t.snapshot_state(box) for name, t in self.tools.items()}
        return {name: state for name, state in states.items() if state is not None}

    async def _restore_sandbox(self, snap: Any) -> None:
        box = await self._ensure_sandbox()
        self._pending = None
        for t in self.tools.values():
            await t.release(box)
        await box.restore(snap)

    async def _rebuild_tools(self, box: Sandbox, called: set[str]) -> None:
        """Before a turn's calls run: rebuild the state a restore set aside, if the
        turn calls one of those tools, then put the files back as they were."""
        pending = self._pending
        if pending is None:
            return
        if not called & pending.states.keys():
            pending.files = None  # this turn's calls may change the files
            return
        self._pending = None
        files = pending.files if pending.files is not None else await box.snapshot()
        for name, state in pending.states.items():
            await self.tools[name].restore_state(box, state)
        await _put_back_files(box, files, self.config.call_timeout_s)

    async def _replay(self, log: dict[str, Any]) -> None:
        await self.areset(seed=log["seed"], options=log["options"])
        for action in log["actions"]:
            await self.astep(action)

    # -- internals ---------------------------------------------------------------
    def _draw_task(self, seed: int | None) -> Task:
        src = self._tasks
        if isinstance(src, Task):
            return src
        if callable(src):
            task = src(self.np_random)
        elif isinstance(src, Sequence) and len(src) > 0:
            # Seeds kn..kn+n-1 play each task once (an evaluation's 0..n-1 the whole list), in
            # a shuffled order: training's consecutive seeds would walk a sorted list in order.
            # Drawn from the seeded generator, seeds 0..9 played 5 of 10 tasks, some twice.
            index = _shuffled(len(src), seed) if seed is not None else int(self.np_random.integers(len(src)))
            task = src[index]
        else:
            raise EnvError(
                "ToolEnv needs a TextEnv, a Task, a non-empty list of tasks or a task function"
            )
        if not isinstance(task, Task):
            raise EnvError(f"the task source returned {type(task).__name__}, not a Task")
        return task

    async def _ensure_sandbox(self) -> Sandbox:
        if self.sandbox is None:
            if self._source is None:
                raise EnvError("this env's tools or task need a sandbox; pass ToolEnv(sandbox=...)")
            self.sandbox = await self._source.acquire()
        return self.sandbox

    async def _end_episode(self) -> None:
        """Drop the tools' per-sandbox state and give the sandbox back."""
        box, self.sandbox = self.sandbox, None
        self._pending = None
        if box is None or self._source is None:
            return
        problems = []
        for t in self.tools.values():
            try:
                await t.release(box)
            except Exception as err:  # recorded on the next info, not raised
                problems.append(f"{t.name}: {type(err).__name__}: {err}")
        try:
            await self._source.release(box)
        except Exception as err:
            problems.append(f"sandbox release: {type(err).__name__}: {err}")
        if problems:
            self._release_error = "; ".join(problems)

    async def _final_turn(self, action: str) -> _Outcome:
        if self.inner is not None:
            try:
                assert self._inner_thread is not None
                # without its reasoning: GuessNumber read "<think>not 3</think>5" as a guess of 3
                obs, reward, term, trunc, info = await self._inner_thread.call(
                    self.inner.step, _after_reasoning(action))
                reward = _as_reward(reward)
                if not isinstance(obs, str):
                    raise TypeError(f"the observation must be a str, got {type(obs).__name__}")
                if not isinstance(info, dict):
                    raise TypeError(f"the info must be a dict, got {type(info).__name__}")
            except _FAILURES as err:
                return _Outcome(
                    "The environment failed.", error=f"env step failed: {type(err).__name__}: {err}"
                )
            info = {k: v for k, v in info.items() if k not in ("tools", "tools_prompt")}  # this env's own
            # The wrapped env's state is now this step's: later tool turns report its
            # admissible actions and state key, not the reset's.
            self._base_info.update(info)
            return _Outcome(obs, reward, bool(term), bool(trunc), info)
        assert self.task is not None
        answer = strip_thinking(action)
        try:
            reward = _as_reward(await self.task.score(answer, self.sandbox))
            extra = {"answer": answer, **(self.task.report(answer) if self.task.report else {})}
        except _FAILURES as err:  # the traceback says where in the verifier it broke
            return _Outcome(
                "Scoring failed.",
                error=f"verifier failed: {type(err).__name__}: {err}\n{traceback.format_exc(limit=-8)}",
            )
        return _Outcome(f"Final answer received. Reward: {reward:g}", reward, True, info=extra)

    async def _tool_turn(self, parsed: ParseResult) -> _Outcome:
        limit = self.config.max_calls_per_turn
        runnable = [(i, c) for i, c in enumerate(parsed.calls[:limit]) if c.name in self.tools]
        replies: dict[int, tuple[ToolCall, ToolResult]] = {}
        for i, call in enumerate(parsed.calls):
            if i >= limit:
                msg = (
                    f"Error: at most {limit} tool calls are run per turn; this call "
                    f"({call.name}) was not run. Make fewer calls per turn."
                )
                replies[i] = (call, ToolResult.error(msg))
            elif call.name not in self.tools:
                replies[i] = (call, ToolResult.error(self._unknown_tool_message(call.name)))
        error = None
        if runnable:
            outcomes, error = await self._run_calls([c for _, c in runnable])
            for (i, call), res in zip(runnable, outcomes, strict=False):
                if isinstance(res, BaseException):
                    error = error or _tool_failure(call.name, res)
                    res = ToolResult.error(f"Error: the tool {call.name!r} failed.")
                replies[i] = (call, res)
        results = [replies[i] for i in sorted(replies)]
        results += [
            (ToolCall(id="", name=_PARSE_ERROR), ToolResult.error(f"Error: {e}"))
            for e in parsed.errors
        ]
        obs, messages = self._render(results)
        extra = {
            "tool_calls": [c.model_dump() for c in parsed.calls],
            "tool_messages": [m.model_dump() for m in messages],
            "parse_errors": list(parsed.errors),
        }
        return _Outcome(obs, info=extra, error=error)

    async def _run_calls(self, calls: list[ToolCall]) -> tuple[list[Any], str | None]:
        """Run ``calls`` concurrently: (results or exceptions, an episode-ending error)."""
        if any(self.tools[c.name].needs_sandbox for c in calls):
            try:
                box = await self._ensure_sandbox()
            except Exception as err:
                return [], f"sandbox unavailable: {type(err).__name__}: {err}"
            try:  # before any call runs, so that none sees the rebuild's side effects
                await self._rebuild_tools(box, {c.name for c in calls})
            except Exception as err:
                return [], f"restoring the tools' state failed: {type(err).__name__}: {err}"
        outcomes = await asyncio.gather(*(self._run_call(c) for c in calls), return_exceptions=True)
        return list(outcomes), None

    async def _run_call(self, call: ToolCall) -> ToolResult:
        tool = self.tools[call.name]
        box = self.sandbox if tool.needs_sandbox else None
        try:
            return await asyncio.wait_for(_invoke(tool, call.arguments, box), self.config.call_timeout_s)
        except TimeoutError:
            return ToolResult.error(
                f"Error: the call took longer than {self.config.call_timeout_s:g} s and was stopped."
            )

    def _unknown_tool_message(self, name: str) -> str:
        close = difflib.get_close_matches(name, list(self.tools), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        avail = ", ".join(self.tools) or "(none)"
        return f"Error: unknown tool {name[:100]!r}.{hint} Available tools: {avail}."

    def _render(self, results: list[tuple[ToolCall, ToolResult]]) -> tuple[str, list[Message]]:
        per_call = min(
            self.config.max_output_chars,
            max(64, self.config.max_observation_chars // max(1, len(results))),
        )
        triples, messages = [], []
        for call, res in results:
            content = truncate_middle(res.content, per_call)
            triples.append((call.id, call.name, content))
            messages.append(
                Message(role="tool", content=content, tool_call_id=call.id, name=call.name)
            )
        obs = render_tool_results(triples, style=self.config.style)
        return truncate_middle(obs, self.config.max_observation_chars), messages
