"""Harness episodes at their edges: what one episode shares with another, what outlives the
trainer, and the proxy's count endpoints under bodies too long to fit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import sys
from typing import Any

import httpx
import pytest

from agentrl.env import TextEnv, register_env
from agentrl.proxy import RunningServer
from agentrl.proxy.envserver import EnvServerConfig, create_env_app
from agentrl.proxy.harness import EnvServer, anchored_argv, open_session, run_harness_episode


@pytest.mark.parametrize("path, body", [
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "a" * 2_000_000}]}),
    ("/v1/responses/input_tokens", {"model": "m", "input": "a" * 2_000_000}),
])
def test_a_count_of_a_prompt_too_long_to_fit_is_refused_before_it_is_rendered(mock_policy, serve, monkeypatch,
                                                                              path, body):
    """The count endpoints rendered and tokenized any body up to the 8 MB limit (a thread held for
    seconds per call) without the check the sampling endpoints make first: 2,000,000 characters
    are at least 2,000,000 / (most bytes a token holds) tokens, far over a budget of 4096."""
    import agentrl.proxy.handlers as handlers

    def never(*a, **kw):
        raise AssertionError("rendered a prompt that cannot fit")

    monkeypatch.setattr(handlers, "_render_whole", never)
    server = serve(mock_policy(), max_context_tokens=4096)
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "the prompt is at least" in error["message"] and "over the context budget of 4096" in error["message"]


def test_a_count_that_fits_is_still_counted(mock_policy, serve):
    server = serve(mock_policy(), max_context_tokens=4096)
    r = httpx.post(f"{server.url}/v1/messages/count_tokens",
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


# -- each episode in its own working directory ---------------------------------------------

# Leaves a file named after its session, waits for the other episode to leave its own, then
# prints where it ran and what it saw there.
LOOKS_AROUND = '''
import json, os, time
open(os.environ["AGENTRL_SESSION_ID"], "w").write("mine")
time.sleep(1.0)
print(json.dumps({"cwd": os.getcwd(), "seen": sorted(os.listdir("."))}))
'''


def _sessions_run(proxy, *episodes):
    """Run ``(cmd, kwargs)`` episodes concurrently, each in a session of its own; their trees."""
    async def run():
        sessions = [await open_session(proxy.url) for _ in episodes]
        return await asyncio.gather(*(run_harness_episode(cmd, s, timeout=30, **kw)
                                      for s, (cmd, kw) in zip(sessions, episodes, strict=True)))
    return asyncio.run(run())


def _printed(tree) -> dict:
    return json.loads(tree.meta["harness"]["stdout_tail"])


def test_concurrent_episodes_each_run_in_a_fresh_directory_removed_afterwards(mock_policy, serve, tmp_path,
                                                                            monkeypatch):
    """Every episode ran in the trainer's own directory: one harness read and overwrote what
    another wrote there (and the trainer's files). Now each runs in a new empty directory,
    removed once it ends."""
    monkeypatch.chdir(tmp_path)
    proxy = serve(mock_policy())
    cmd = [sys.executable, "-c", LOOKS_AROUND]
    trees = _sessions_run(proxy, (cmd, {}), (cmd, {}))
    seen = [_printed(t) for t in trees]
    sids = [t.meta["session_id"] for t in trees]
    assert [s["seen"] for s in seen] == [[sids[0]], [sids[1]]]  # its own file, and nothing else
    assert seen[0]["cwd"] != seen[1]["cwd"]
    assert str(tmp_path) not in (seen[0]["cwd"], seen[1]["cwd"])
    assert not any(os.path.exists(s["cwd"]) for s in seen)  # removed
    assert os.listdir(tmp_path) == []  # nothing left where the trainer runs


def test_a_configured_directory_is_used_as_it_is_and_kept(mock_policy, serve, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "given.txt").write_text("the user's")
    proxy = serve(mock_policy())
    (tree,) = _sessions_run(proxy, ([sys.executable, "-c", LOOKS_AROUND], {"cwd": str(work)}))
    sid = tree.meta["session_id"]
    assert _printed(tree) == {"cwd": str(work), "seen": sorted(["given.txt", sid])}
    assert sorted(os.listdir(work)) == sorted(["given.txt", sid])


def test_a_relative_script_still_runs_from_a_fresh_directory(mock_policy, serve, tmp_path, monkeypatch):
    """``python examples/harness/react_agent.py`` names its script from where the trainer runs:
    the script's path is made absolute, so it is found from the episode's own directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "agent.py").write_text("import os; print(os.getcwd())\n")
    proxy = serve(mock_policy())
    (tree,) = _sessions_run(proxy, ("python agents/agent.py", {}))
    run = tree.meta["harness"]
    assert run["returncode"] == 0, run
    assert run["cmd"] == [sys.executable, str(tmp_path / "agents" / "agent.py")]
    assert run["stdout_tail"].strip() != str(tmp_path)


def test_a_relative_path_in_the_harness_env_still_names_the_trainer_s_file(mock_policy, serve, tmp_path,
                                                                           monkeypatch):
    """``CODEX_HOME=runs/codex-home`` (a folder where the trainer runs) pointed nowhere once each
    episode ran in its own folder, and Codex exited 1 ("that path does not exist"): a relative
    value that names a file or folder there is made absolute; other values, and the session's
    own variables, are as given."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "home").mkdir(parents=True)
    proxy = serve(mock_policy())
    prints = "import json, os; print(json.dumps({k: os.environ.get(k) for k in ('H', 'N', 'W', 'OPENAI_BASE_URL')}))"
    given = {"H": "runs/home", "N": "1", "W": "no/such", "OPENAI_BASE_URL": "runs"}
    (tree,) = _sessions_run(proxy, ([sys.executable, "-c", prints], {"extra_env": given}))
    got = _printed(tree)
    assert got["H"] == str(tmp_path / "runs" / "home")
    assert (got["N"], got["W"]) == ("1", "no/such")
    assert got["OPENAI_BASE_URL"].startswith("http")  # the session's, not the given one


def test_anchored_argv_makes_only_paths_to_files_absolute(tmp_path):
    (tmp_path / "agent.py").write_text("")
    (tmp_path / "data").mkdir()
    argv = ["bin/run", "agent.py", "-c", "agent.py is good", ".", "data", "--x=agent.py", "/abs/y", "missing.py"]
    assert anchored_argv(argv, str(tmp_path)) == [
        str(tmp_path / "bin" / "run"), str(tmp_path / "agent.py"), "-c", "agent.py is good", ".", "data",
        "--x=agent.py", "/abs/y", "missing.py"]
    assert anchored_argv(["claude", "-p", "hi"], str(tmp_path)) == ["claude", "-p", "hi"]  # found on PATH


# -- harnesses die with the trainer ---------------------------------------------------------

# A harness that starts a child in its process group and one in a session of its own (out of
# the group, as a Node CLI's detached child), writes where it runs and the three pids, then hangs.
SPAWNS = '''
import os, subprocess, sys, time
sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
kids = [subprocess.Popen(sleep), subprocess.Popen(sleep, start_new_session=True)]
pids = " ".join(str(p) for p in [os.getpid()] + [k.pid for k in kids])
open(sys.argv[1] + ".tmp", "w").write(os.getcwd() + "\\n" + pids)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(60)
'''

# A trainer that runs one episode of SPAWNS (no proxy is called before the harness exits).
TRAINER = '''
import asyncio, sys
from agentrl.proxy.harness import SessionHandle, run_harness_episode
session = SessionHandle("http://127.0.0.1:9", sys.argv[2], "key")
asyncio.run(run_harness_episode([sys.executable, "-c", sys.argv[3], sys.argv[1]], session, timeout=60))
'''


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    """Whether ``pid`` stops running within ``seconds``."""
    import time

    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_harness_and_its_children_die_when_the_trainer_is_killed(tmp_path):
    """A SIGKILLed trainer cleans nothing up: its harness, the harness's children and one that
    left the process group all lived on (and held their GPU, ports and files). Now the
    harness's guard kills them all, and removes the episode's directory."""
    import secrets
    import signal
    import subprocess
    import time

    pidfile = tmp_path / "pids"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(pidfile), f"edge-{secrets.token_hex(6)}", SPAWNS],
                               cwd=tmp_path)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists():
            assert trainer.poll() is None and time.monotonic() < deadline, "the harness never started"
            time.sleep(0.05)
        workdir, line = pidfile.read_text().split("\n")
        pids = [int(p) for p in line.split()]
        assert all(_alive(p) for p in pids)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in pids if _alive(p)] == []
        assert not os.path.exists(workdir)
    finally:
        for p in pids:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        if trainer.poll() is None:
            trainer.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard runs on Linux")
def test_a_sigterm_to_its_own_group_while_the_trainer_lives_is_no_teardown(mock_policy, serve):
    """The guard tears the episode down on the death signal, a SIGTERM; one the harness sends to
    its own group (``kill 0``) while the trainer lives leaves the guard waiting for it."""
    proxy = serve(mock_policy())
    survives = "import os, signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); os.killpg(0, signal.SIGTERM); print('on')"
    (tree,) = _sessions_run(proxy, ([sys.executable, "-c", survives], {}))
    assert tree.meta["harness"]["returncode"] == 0 and tree.meta["harness"]["stdout_tail"] == "on\n"


def test_a_command_the_guard_cannot_start_fails_its_episode_saying_so(mock_policy, serve):
    proxy = serve(mock_policy())
    (tree,) = _sessions_run(proxy, (["no-such-harness-here", "-p", "x"], {}))
    assert tree.meta["error"].startswith("the harness command could not start: ")
    assert "no-such-harness-here" in tree.meta["error"]


# Starts a child in a session of its own with an environment of its own (``env -i setsid CMD &``:
# no AGENTRL_SESSION_ID to find it by), writes its pid, and exits at once.
UNMARKED = '''
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                         env={}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
open(sys.argv[1], "w").write(str(child.pid))
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard runs on Linux")
def test_a_child_that_left_the_group_and_dropped_the_marker_is_killed_with_the_episode(mock_policy, serve,
                                                                                      tmp_path):
    """A process the harness started outside its group, with an environment of its own, was
    found neither by the group's kill nor by ``AGENTRL_SESSION_ID``, and outlived the episode.
    The guard is the harness's subreaper: every descendant, orphaned or not, is its to kill."""
    import signal

    pidfile = tmp_path / "pid"
    proxy = serve(mock_policy())
    _sessions_run(proxy, ([sys.executable, "-c", UNMARKED, str(pidfile)], {}))
    pid = int(pidfile.read_text())
    try:
        assert _gone_within(pid, 5.0)
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("cmd", ["", "   ", []])
def test_an_empty_command_fails_its_episode_saying_so(mock_policy, serve, cmd):
    """An empty command reached the guard (an IndexError's traceback as the harness's exit 1)
    or asyncio (a TypeError, as a bug of the runner's); it is the command's fault, named."""
    proxy = serve(mock_policy())
    (tree,) = _sessions_run(proxy, (cmd, {}))
    assert tree.meta["error"] == "the harness command is empty" and not tree.nodes


def test_the_scan_for_marked_processes_runs_off_the_event_loop(mock_policy, serve, monkeypatch):
    """Every episode's end read ``/proc/*/environ`` of every process on the event loop that
    runs all the episodes (14 ms for 141 processes here, more on a busy node, and a read
    blocks while its process holds its memory map's lock): every other episode's output,
    timeout and kill waited. A scan slowed to 1 s must leave the loop ticking."""
    import time

    import agentrl.proxy.harness as harness

    monkeypatch.setattr(harness, "kill_marked", lambda marker: time.sleep(1.0))
    proxy = serve(mock_policy())

    async def run():
        session = await open_session(proxy.url)
        gaps, last, done = [], time.monotonic(), False

        async def tick():
            nonlocal last
            while not done:
                await asyncio.sleep(0.02)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        ticking = asyncio.create_task(tick())
        await run_harness_episode([sys.executable, "-c", "pass"], session, timeout=30)
        done = True
        await ticking
        return max(gaps)

    assert asyncio.run(run()) < 0.5


# -- the env server takes every action the runner submits ----------------------------------

class _CountsChars(TextEnv):
    """One step; its info holds how many characters the action had."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return "Answer.", {}

    def step(self, action: str):
        return "done", 1.0, True, False, {"got_chars": len(action)}


register_env("edges/CountsChars-v0", entry_point=_CountsChars)

# One model call, then an answer of argv[1] characters "é" on stdout.
LONG_ANSWER = '''
import sys
from openai import OpenAI
OpenAI().chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
sys.stdout.write("\\u00e9" * int(sys.argv[1]))
'''


def test_an_answer_within_the_character_limit_reaches_the_env_whatever_its_bytes(mock_policy, serve):
    """The runner submits an answer of up to 1,000,000 characters, and the env server's action
    takes as many, but its bodies were capped at 1 MiB: 600,000 "é" (1,200,000 bytes of
    UTF-8) were a 413, and the episode failed, though its answer was within every limit said."""
    proxy = serve(mock_policy(["ok"]))
    with RunningServer(create_env_app(EnvServerConfig(token="t"))) as envs:
        async def run():
            session = await open_session(proxy.url)
            return await run_harness_episode([sys.executable, "-c", LONG_ANSWER, "600000"], session,
                                             EnvServer(envs.url, "t", "edges/CountsChars-v0"), timeout=60,
                                             submit="stdout")
        tree = asyncio.run(run())
    assert "error" not in tree.meta, tree.meta["error"]
    assert tree.meta["env"]["reward"] == 1.0 and tree.meta["env"]["steps"] == 1


class _NulTask(_CountsChars):
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return "a\x00b", {}


register_env("edges/NulTask-v0", entry_point=_NulTask)

READS_TASK_FILE = '''
import os
import shlex
from openai import OpenAI
OpenAI().chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
print(repr(open(os.environ["AGENTRL_TASK_FILE"]).read()), "AGENTRL_TASK" in os.environ)
'''


def _nul_episode(proxy, cmd):
    with RunningServer(create_env_app(EnvServerConfig(token="t"))) as envs:
        async def run():
            session = await open_session(proxy.url)
            return await run_harness_episode(cmd, session, EnvServer(envs.url, "t", "edges/NulTask-v0"), timeout=60)
        return asyncio.run(run())


def test_a_task_with_a_nul_is_passed_in_its_file_alone(mock_policy, serve):
    """A task holding a NUL (an env may return one) went into AGENTRL_TASK, which no
    environment variable can hold: every episode of it failed to start, though the harness
    read the task's file. Now the variable is unset, as for a task over 128 KiB."""
    proxy = serve(mock_policy(["ok"]))
    tree = _nul_episode(proxy, [sys.executable, "-c", READS_TASK_FILE])
    assert "error" not in tree.meta, tree.meta["error"]
    assert tree.meta["harness"]["stdout_tail"] == "'a\\x00b' False\n"


def test_a_command_that_names_a_task_with_a_nul_fails_saying_why(mock_policy, serve):
    proxy = serve(mock_policy(["ok"]))
    tree = _nul_episode(proxy, [sys.executable, "-c", "pass", "$AGENTRL_TASK"])
    assert "the task holds a NUL character" in tree.meta["error"] and "$AGENTRL_TASK_FILE" in tree.meta["error"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard runs on Linux")
def test_a_guard_whose_trainer_is_already_gone_kills_only_its_own_group(tmp_path):
    """Started outside a session of its own (by hand, or by a caller other than the runner),
    the guard's teardown killed its caller's process group, its caller with it. It makes a
    group of its own first."""
    import subprocess

    from agentrl.proxy import harness

    # Pid 1 is never the shell that starts the guard: its trainer is "already gone".
    script = f"{shlex.quote(sys.executable)} -I -S {shlex.quote(harness._GUARD)} 1 -- true; echo survived"
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30, start_new_session=True)
    assert out.stdout == "survived\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard runs on Linux")
def test_an_unmarked_child_outside_the_group_is_killed_when_its_harness_times_out(mock_policy, serve, tmp_path):
    """On a timeout the runner killed the guard's group, the guard with it, before the guard
    could kill what the harness left outside the group: an unmarked child lived on. Now the
    runner kills everything below the guard first."""
    import signal

    pidfile = tmp_path / "pid"
    proxy = serve(mock_policy())
    hangs = UNMARKED + "import time; time.sleep(60)\n"

    async def run():
        session = await open_session(proxy.url)
        return await run_harness_episode([sys.executable, "-c", hangs, str(pidfile)], session, timeout=3)

    tree = asyncio.run(run())
    pid = int(pidfile.read_text())
    try:
        assert tree.meta["error"].startswith("harness timed out")
        assert _gone_within(pid, 5.0)
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def test_a_harness_run_s_raising_episode_callback_loses_no_episode_and_harness_cwd_is_where_it_runs(
        tokenizer, tmp_path):
    """A progress callback that raised went up through the harness batch's gather, and the whole
    step's episodes were lost (the native engine already warned and went on). train.harness_cwd
    is where every episode's harness runs, shared and kept."""
    from agentrl.policy import MockPolicy
    from agentrl.proxy.rollouts import harness_rollouts
    from agentrl.train.config import load_train_config

    work = tmp_path / "work"
    work.mkdir()
    writes = ("import httpx, os; e = os.environ; open(f'ran-{os.getpid()}', 'w').write('x'); "
              "httpx.post(e['OPENAI_BASE_URL'] + '/chat/completions', headers={'Authorization': 'Bearer ' + "
              "e['OPENAI_API_KEY']}, json={'model': 'm', 'messages': [{'role': 'user', 'content': 'hi'}]}, "
              "timeout=60).raise_for_status()")
    cfg = load_train_config(None, ["rollout.group_size=3", f"train.harness=python -c {shlex.quote(writes)}",
                                   f"train.harness_cwd={work}", "train.harness_submit=stdout"])
    policy = MockPolicy(tokenizer, ["1"])
    source = harness_rollouts(policy, cfg)
    calls = []

    def bar(tree):
        calls.append(tree)
        raise ValueError("bar closed")

    try:
        with pytest.warns(RuntimeWarning, match="on_episode_done.*ValueError: bar closed"):
            [tree] = source.collect(cfg.env.id, policy, cfg, [0], on_episode_done=bar)
    finally:
        source.close()
    assert len(calls) == 1 and len(tree.meta["sessions"]) == 3
    assert len(list(work.glob("ran-*"))) == 3  # each episode ran there, and the folder is kept
