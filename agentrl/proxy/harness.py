"""Run an unmodified agent harness as one episode: its proxy session becomes the tree.

``run_harness_episode`` makes the env on the env server (when one is given),
starts the harness command with these environment variables::

    OPENAI_BASE_URL      the session's /v1 URL on the proxy (Chat Completions, Responses)
    OPENAI_API_KEY       the session's own key (opens only this session)
    ANTHROPIC_BASE_URL   the session's root on the proxy (Anthropic SDKs add /v1/messages)
    ANTHROPIC_API_KEY    the session's key again
    AGENTRL_SESSION_ID   the session id
    AGENTRL_ENV_URL      the env server; AGENTRL_ENV_TOKEN a bearer key that opens only this env
    AGENTRL_ENV_INSTANCE the env made for this episode (GET /envs/{id} shows it)
    AGENTRL_ENV_ID       its registered id
    AGENTRL_TASK         the env's first observation: the task, for a CLI's prompt (unset
                         where it is over 128 KiB, or holds a NUL: Linux refuses either in a variable)
    AGENTRL_TASK_FILE    a file that holds the task, whatever its length

Each episode runs in a new empty directory of its own (``cwd=None``), removed once it ends
(with every process the harness started): concurrent harnesses write their files there, and
not where the trainer or another episode runs. So that a command names its files from where the
trainer runs (``python examples/harness/react_agent.py``), a relative path in it that names a
file there, and a relative program path (``./agent``), are made absolute (``anchored_argv``), as
is an ``extra_env`` value that names a file or folder there (``anchored_env``); a path inside a
shell string (``sh -c 'python agent.py'``) is not: give ``cwd``. A ``cwd`` given
is used as it is, shared by the episodes that run in it, and kept.

The rest of the harness's environment is the trainer's, less its credentials
(``harness_environ``: ``HF_TOKEN``, cloud keys, ``SSH_AUTH_SOCK``): the model
writes the commands a harness runs. ``extra_env`` passes what it needs.

``$NAME`` and ``${NAME}`` in the command's arguments are replaced by these
(and by ``extra_env``), so a CLI that never reads the environment takes the
task and the URLs as arguments: ``claude -p "$AGENTRL_TASK"``. With
``submit="stdout"``, the harness's whole standard output (at most 1,000,000
characters), once it exits, is the env's next action (the answer of an agent
program that never calls the env server). Then it waits for it, reads the
reward and closes the session into a ``RolloutTree``. Outcomes sort in two
columns:

- the harness finished (exit code 0): the reward is the env's summed reward
  (or the ``verifier``'s, given the tree), put on the session's last call, and
  the last node is ``terminated`` if the env says so, else ``truncated``.
  With an env or a verifier, these are the tree's only rewards: a proxy
  with a token refuses a reward posted with the session key, and without a
  token one the harness posted is zeroed (``meta["dropped_rewards"]``
  counts them), since it is no outcome;
- the episode failed, outside what training should score: the harness
  crashed (non-zero exit), hung past ``timeout`` (its process group is
  killed; so, whatever the outcome, is every process the harness started
  outside its group: found by its ``AGENTRL_SESSION_ID``, and on Linux, by
  its guard, below), the env could not be made, or its reward could not be read (or
  was not finite). The env and the session are closed whatever failed. The tree comes back with
  ``meta["error"]`` (and the last node's ``error``) holding the reason, and the
  output tails in ``meta["harness"]``. Nothing is raised, so the run goes on.

Only a proxy that cannot be reached raises (``ProxyError``): then there is no
tree to return.

On Linux the harness runs under a guard (``harness_guard``) that the kernel
signals when the trainer dies: a trainer SIGKILLed (the OOM killer, a
scheduler) cannot clean up, so the guard kills the harness and every process
it started, and removes the episode's own directory.

**Limitation: episodes are not isolated from one another.** Every harness runs
as the trainer's user, and that user may read any of its processes'
``/proc/<pid>/environ`` (and ``cmdline``): a harness, or a command the model
has it run, can read a concurrent episode's ``OPENAI_API_KEY`` (its session)
and ``AGENTRL_ENV_TOKEN`` (its env, which it could then read and step), open
that episode's directory (mode 0700, but the same owner), and signal its
processes. No variable or file mode can hide them from the same user: the
kernel makes an ``execve``d program dumpable again, so ``PR_SET_DUMPABLE``
does not carry over to the harness. A run that trains on untrusted model
actions should run each harness as a user of its own, or in a sandbox with a
PID namespace of its own (the command's prefix
``bwrap --dev-bind / / --unshare-pid --proc /proc``), where the others'
``/proc`` entries do not exist.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import math
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from agentrl.errors import ProxyError
from agentrl.types import RolloutTree

from .harness_guard import START_FAILED, kill_descendants, kill_marked

__all__ = ["EnvServer", "SessionHandle", "anchored_argv", "anchored_env", "drop_session", "expand_argv",
           "harness_argv", "open_session", "run_harness_episode"]

_TAIL = 4000  # characters of stdout/stderr kept for the record
_ANSWER_CHARS = 1_000_000  # the longest answer on stdout (the env server's limit on an action)
_STRING_BYTES = 131072  # Linux's MAX_ARG_STRLEN: one argument or NAME=value, with its NUL
_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
_GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness_guard.py")


def expand_argv(argv: list[str], env: dict[str, str]) -> list[str]:
    """``$NAME`` and ``${NAME}`` in each argument replaced by ``env[NAME]``; unknown names stay."""
    def sub(m: re.Match[str]) -> str:
        return env.get(m.group(1) or m.group(2), m.group(0))
    return [_VAR.sub(sub, a) for a in argv]


def harness_argv(cmd: str | Sequence[str]) -> list[str]:
    """The command's argv; a leading ``python``/``python3`` is this interpreter (``sys.executable``),
    so the harness sees the packages agentrl runs with, not whatever ``python`` is first on PATH."""
    argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def anchored_argv(argv: list[str], base: str) -> list[str]:
    """``argv`` to run from another directory as it runs from ``base``: a relative program path
    (``./agent``, ``bin/agent``), and every other relative argument that names an existing file
    under ``base`` (``python agents/agent.py``'s script), made absolute. Options (``-x``) and
    what names no file there (a prompt, ``.``) stay as they are."""
    out = list(argv)
    for i, arg in enumerate(out):
        if not arg or arg.startswith("-") or os.path.isabs(arg):
            continue
        if (i == 0 and os.sep in arg) or (i > 0 and os.path.isfile(os.path.join(base, arg))):
            out[i] = os.path.normpath(os.path.join(base, arg))
    return out


def anchored_env(extra: dict[str, str], base: str) -> dict[str, str]:
    """``extra`` (the variables a run gives its harness) to run from another directory as from
    ``base``: a relative value that names an existing file or folder under ``base``
    (``CODEX_HOME=runs/codex-home``, ``PYTHONPATH=.``) made absolute; the rest as it is."""
    return {k: os.path.normpath(os.path.join(base, v))
            if v and not os.path.isabs(v) and not v.startswith("-") and os.path.exists(os.path.join(base, v))
            else v for k, v in extra.items()}


def _remove_dir(path: str) -> None:
    """Remove an episode's directory, also where the harness left parts of it unwritable
    (``rmtree`` never follows a link out of it)."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)
    for root, dirs, _ in os.walk(path):  # top-down: each directory is opened up before it is entered
        for d in dirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(root, d), 0o700, follow_symlinks=False)
    shutil.rmtree(path, ignore_errors=True)


@dataclass(slots=True)
class SessionHandle:
    """A proxy session a harness runs in."""

    proxy_url: str
    session_id: str
    api_key: str
    token: str | None = None  # the proxy's admin token, if it has one

    @property
    def base_url(self) -> str:
        return f"{self.proxy_url}/sessions/{self.session_id}/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token or self.api_key}"}


@dataclass(slots=True)
class EnvServer:
    """Where the episode's env is made: the env server, its token, the env and its seed."""

    url: str
    token: str
    env_id: str
    seed: int | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


async def open_session(proxy_url: str, token: str | None = None, meta: dict[str, Any] | None = None,
                       session_id: str | None = None, seed: int | None = None) -> SessionHandle:
    """Create a session on the proxy at ``proxy_url``; ``seed`` seeds the calls that carry none."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body: dict[str, Any] = {"meta": meta or {}}
    if session_id:
        body["session_id"] = session_id
    if seed is not None:
        body["seed"] = seed
    data = await _call("POST", f"{proxy_url}/sessions", headers, body)
    return SessionHandle(proxy_url, data["session_id"], data["api_key"], token)


async def drop_session(session: SessionHandle) -> None:
    """Delete a (closed) session on the proxy, so a long run does not keep every tree twice."""
    await _call("DELETE", f"{session.proxy_url}/sessions/{session.session_id}", session.headers())


async def _call(method: str, url: str, headers: dict[str, str], body: Any = None) -> Any:
    try:
        async with httpx.AsyncClient(timeout=60.0) as client:
            r = await client.request(method, url, headers=headers, json=body)
    except httpx.HTTPError as e:
        raise ProxyError(f"{method} {url}: {type(e).__name__}: {e}") from e
    if r.status_code >= 400:
        raise ProxyError(f"{method} {url}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


@dataclass(slots=True)
class _Captured:
    """A stream's text, decoded as UTF-8 across reads (a character split between two reads is
    kept whole): all of it while it holds at most ``keep`` characters, then only the last
    ``_TAIL`` (``whole`` False)."""

    keep: int = _TAIL
    text: str = ""
    whole: bool = True

    def add(self, text: str) -> None:
        self.text += text
        if len(self.text) > self.keep:
            self.text, self.whole = self.text[-_TAIL:], False


async def _capture(stream: asyncio.StreamReader | None, out: _Captured) -> None:
    if stream is None:
        return
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    while chunk := await stream.read(65536):
        out.add(decoder.decode(chunk))
    out.add(decoder.decode(b"", final=True))


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _guarded(argv: list[str], remove_cwd: bool) -> list[str]:
    """``argv`` under the guard (``harness_guard``) that kills it, and all it started, with this
    process, on Linux; as it is elsewhere."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-I", "-S", _GUARD, str(os.getpid()), *(["--remove-cwd"] if remove_cwd else []),
            "--", *argv]


async def _run(argv: list[str], env: dict[str, str], timeout: float | None, cwd: str | None,
               out: _Captured, own_cwd: bool = False) -> dict[str, Any]:
    """Run the harness, under its guard (``own_cwd``: the guard removes ``cwd`` if this process
    dies); its exit code (None on timeout), output tails and wall time. Its standard output goes
    to ``out`` (which keeps what it was asked to)."""
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *_guarded(argv, own_cwd), env=env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, start_new_session=True)
    err = _Captured()
    readers = asyncio.gather(_capture(proc.stdout, out), _capture(proc.stderr, err))
    code: int | None
    try:
        code = await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        code = None
    finally:  # a timeout or our own cancellation: the harness and its children go
        if proc.returncode is None:  # the guard lives (its pid is no other's): first all below it,
            await asyncio.to_thread(kill_descendants, proc.pid)  # which its group's kill would orphan
        _kill_group(proc)
        if sid := env.get("AGENTRL_SESSION_ID"):  # on a thread: it reads every process's environ
            await asyncio.to_thread(kill_marked, f"AGENTRL_SESSION_ID={sid}".encode())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 10)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(readers, 5)
    return {"cmd": argv, "returncode": code, "wall_s": time.monotonic() - t0,
            "stdout_tail": out.text[-_TAIL:], "stderr_tail": err.text[-_TAIL:]}


# Words of an environment variable's name that mark a credential of the trainer's own.
_CREDENTIAL_WORDS = frozenset({"TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL",
                               "CREDENTIALS", "AUTH"})


def harness_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The trainer's environment less its credentials, for a harness: every variable whose name
    has a word (split at ``_``) such as TOKEN, SECRET, PASSWORD, KEY or AUTH (``HF_TOKEN``,
    ``AWS_SECRET_ACCESS_KEY``, ``SSH_AUTH_SOCK``). A harness runs commands the model writes,
    so what it can read, the model can print; pass what it needs in ``extra_env``."""
    return {k: v for k, v in environ.items()
            if not _CREDENTIAL_WORDS.intersection(k.upper().split("_"))}


async def run_harness_episode(
    cmd: str | Sequence[str],
    session: SessionHandle,
    env_server: EnvServer | None = None,
    timeout: float | None = 600.0,
    verifier: Callable[[RolloutTree], float] | None = None,
    extra_env: dict[str, str] | None = None,
    cwd: str | None = None,
    submit: str | None = None,
) -> RolloutTree:
    """One episode of the harness ``cmd`` in ``session``; see the module docstring.

    ``timeout`` is in seconds (None: no limit). ``submit="stdout"``: the harness's
    output is the env's next action once it exits. ``cwd``: where the harness runs (None: a new
    directory of the episode's own, removed once it ends).
    """
    argv = harness_argv(cmd)
    session_root = f"{session.proxy_url}/sessions/{session.session_id}"
    env = {**harness_environ(os.environ), **(extra_env or {}), "OPENAI_BASE_URL": session.base_url,
           "OPENAI_API_KEY": session.api_key, "ANTHROPIC_BASE_URL": session_root,
           "ANTHROPIC_API_KEY": session.api_key, "AGENTRL_SESSION_ID": session.session_id}
    error: str | None = None
    instance: str | None = None
    task = ""
    env_headers: dict[str, str] = {}
    if env_server is not None:
        env_headers = {"Authorization": f"Bearer {env_server.token}"}
        try:
            made = await _call("POST", f"{env_server.url}/envs", env_headers,
                               {"env_id": env_server.env_id, "seed": env_server.seed,
                                "kwargs": env_server.kwargs})
            instance = made["id"]
            # The env's own key, which opens no other env (a server without keys: its token).
            env.update(AGENTRL_ENV_URL=env_server.url, AGENTRL_ENV_TOKEN=made.get("key") or env_server.token,
                       AGENTRL_ENV_INSTANCE=instance, AGENTRL_ENV_ID=env_server.env_id)
            task = str(made.get("observation", ""))
        except ProxyError as e:
            error = f"env could not be made: {e}"
    run: dict[str, Any] = {"cmd": argv, "returncode": None}
    stdout = _Captured(_ANSWER_CHARS if submit == "stdout" else _TAIL)  # the answer is all of it
    task_file = workdir = None
    try:  # whatever fails in here, the env and the session below are still closed
        if cwd is None:  # one episode's files are no other's (see the module docstring)
            workdir = cwd = tempfile.mkdtemp(prefix="agentrl-episode-")
            argv = anchored_argv(argv, os.getcwd())
            given = extra_env or {}
            env.update({k: v for k, v in anchored_env(given, os.getcwd()).items()
                        if env.get(k) == given[k]})  # not one the session's own variables replaced
        if instance is not None:
            task_file = _task_file(task)
            error = error or _pass_task(task, task_file, argv, env)
        argv = run["cmd"] = expand_argv(argv, env)
        if error is None:
            run, error = await _play(argv, env, timeout, cwd, stdout, workdir is not None)
        if error is None and submit == "stdout" and instance is not None and env_server is not None:
            error = await _submit(env_server, instance, env_headers, stdout)
    except Exception as e:  # a bug of ours: this episode fails, loudly, and the run goes on
        error = f"harness runner error {type(e).__name__}: {e}"
    finally:
        if task_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(task_file)
        if workdir is not None:  # the harness and its processes are gone (``_run``)
            await asyncio.to_thread(_remove_dir, workdir)
    state = None
    if instance is not None and env_server is not None:
        try:
            state = await _call("POST", f"{env_server.url}/envs/{instance}/close", env_headers)
        except ProxyError as e:  # no reward to read: a failure, never a silent 0
            if error is None and verifier is None:
                error = f"the env's reward could not be read: {e}"
    sess_url = f"{session.proxy_url}/sessions/{session.session_id}"
    headers = session.headers()
    rewarded: list[int] = []
    if error is None:
        try:
            error, rewarded = await _reward(sess_url, headers, state, verifier)
        except ProxyError as e:  # the session is closed below all the same
            error = f"the reward could not be posted: {e}"
    tree = RolloutTree.from_dict(await _call("POST", f"{sess_url}/close", headers))
    # The env or the verifier scores, not the harness: their reward is the only one kept.
    scored = env_server is not None or verifier is not None
    return _recorded(tree, run, state, error, set(rewarded) if scored else None)


def _recorded(tree: RolloutTree, run: dict[str, Any], state: dict[str, Any] | None, error: str | None,
              rewarded: set[int] | None) -> RolloutTree:
    """The closed session's tree with the episode's record: the harness's run, the env's final
    state, the failure (also on the last node), and, where ``rewarded`` names the nodes the
    runner rewarded, every other reward zeroed (``_drop_rewards_but``)."""
    tree.meta["harness"] = run
    if rewarded is not None and (dropped := _drop_rewards_but(tree, rewarded)):
        tree.meta["dropped_rewards"] = dropped
    if state is not None:
        tree.meta["env"] = {k: state[k] for k in ("env_id", "reward", "terminated", "truncated", "steps")}
    if error is not None:
        tree.meta["error"] = error
        if tree.nodes:
            last = tree.nodes[max(tree.nodes)]
            last.error, last.truncated = error, not last.terminated
    return tree


def _pass_task(task: str, task_file: str, argv: list[str], env: dict[str, str]) -> str | None:
    """Put the task in ``env``: its file always, its text where one variable may hold it (Linux
    refuses a string over 128 KiB, or one with a NUL). Why the episode cannot start (its command
    names a task it cannot pass), or None."""
    env["AGENTRL_TASK_FILE"] = task_file
    if "\0" in task:
        why = "the task holds a NUL character, which no argument or variable may hold"
    elif len(f"AGENTRL_TASK={task}".encode()) >= _STRING_BYTES:
        why = f"the task is {len(task)} characters, over the 128 KiB one argument may hold"
    else:
        env["AGENTRL_TASK"] = task
        return None
    if "AGENTRL_TASK" in {m.group(1) or m.group(2) for a in argv for m in _VAR.finditer(a)}:
        return f"{why}: let the harness read it from $AGENTRL_TASK_FILE"
    return None


def _task_file(task: str) -> str:
    """A new file (only its owner may read it) that holds ``task``; its path."""
    fd, path = tempfile.mkstemp(prefix="agentrl-task-", suffix=".txt")
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(task)
    return path


async def _play(argv: list[str], env: dict[str, str], timeout: float | None, cwd: str | None,
                stdout: _Captured, own_cwd: bool = False) -> tuple[dict[str, Any], str | None]:
    """Run the harness: its record (``_run``) and why its episode failed, or None."""
    if not argv:
        return {"cmd": argv, "returncode": None, "stdout_tail": "", "stderr_tail": ""}, "the harness command is empty"
    try:
        run = await _run(argv, env, timeout, cwd, stdout, own_cwd)
    except (OSError, ValueError) as e:  # not found, not executable, a NUL byte: this episode fails
        run = {"cmd": argv, "returncode": None, "stdout_tail": "", "stderr_tail": str(e)}
        return run, f"the harness command could not start: {e}"
    if run["returncode"] == 127 and run["stderr_tail"].startswith(START_FAILED):  # said by its guard
        return run, f"the harness command could not start: {run['stderr_tail'][len(START_FAILED):].strip()}"
    if run["returncode"] is None:
        return run, f"harness timed out after {timeout:g}s"
    if run["returncode"] != 0:
        said = run["stderr_tail"].strip() or run["stdout_tail"].strip()  # CLIs print errors to either
        return run, f"harness exited with code {run['returncode']}: {said[-500:]}"
    return run, None


def _drop_rewards_but(tree: RolloutTree, kept: set[int]) -> int:
    """Zero every reward but those on ``kept`` (the runner's own); how many were zeroed.

    The harness holds its session's key, which may post rewards: where the env or a
    verifier scores the episode, a reward the harness put on its own calls is not
    the episode's outcome, and training on it would teach the model to post one."""
    dropped = 0
    for node in tree.nodes.values():
        if node.id not in kept and node.reward != 0.0:
            node.reward, dropped = 0.0, dropped + 1
    return dropped


async def _submit(env_server: EnvServer, instance: str, headers: dict[str, str], stdout: _Captured) -> str | None:
    """Step the env with the harness's answer (its whole standard output), unless its episode
    already ended; a failure reason, or None."""
    if not stdout.whole:
        return f"the harness's answer on stdout is over {_ANSWER_CHARS} characters; it was not submitted"
    try:
        state = await _call("GET", f"{env_server.url}/envs/{instance}", headers)
        if not (state["terminated"] or state["truncated"]):
            await _call("POST", f"{env_server.url}/envs/{instance}/step", headers, {"action": stdout.text.strip()})
    except ProxyError as e:
        return f"the harness's answer could not be submitted to the env: {e}"
    return None


async def _reward(sess_url: str, headers: dict[str, str], state: dict[str, Any] | None,
                  verifier: Callable[[RolloutTree], float] | None) -> tuple[str | None, list[int]]:
    """Post the episode's reward to the session: a failure reason (or None), and the nodes
    the reward went to."""
    summary = await _call("GET", sess_url, headers)
    if not summary["calls"]:
        return "the harness made no model call", []
    if verifier is not None:
        try:
            tree = RolloutTree.from_dict(await _call("GET", f"{sess_url}/tree", headers))
            # On a thread: episodes share this event loop, and a verifier may take seconds (a test
            # suite); here it would hold every other episode's output, timeout and kill.
            reward = float(await asyncio.to_thread(verifier, tree))
        except Exception as e:  # fails this episode, not the run; the traceback says where
            return f"verifier failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-8)}", []
        terminated = True
    elif state is not None:
        reward, terminated = float(state["reward"]), bool(state["terminated"])
    else:
        return None, []
    if not math.isfinite(reward):  # it would reach every advantage of its group
        by = "verifier" if verifier is not None else "env"
        return f"the {by} returned a reward of {reward}: rewards are finite", []
    posted = await _call("POST", f"{sess_url}/reward", headers, {"reward": reward, "terminated": terminated})
    return None, list(posted["nodes"])
