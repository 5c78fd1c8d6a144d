"""run_harness_episode under hostile or unlucky harnesses: what it submits, what it leaks, what it trusts."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import httpx
import pytest

from agentrl.env import TextEnv, register_env
from agentrl.proxy import RunningServer
from agentrl.proxy.envserver import EnvServerConfig, create_env_app
from agentrl.proxy.harness import EnvServer, open_session, run_harness_episode

TOKEN = "env-t0k"
ADMIN = "proxy-admin"


class ExactAnswerEnv(TextEnv):
    """Reward 1 when the action is exactly ``answer`` (as given), else 0; one step ends it."""

    def __init__(self, answer: str = "42"):
        super().__init__()
        self.answer = answer

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return "Answer.", {"instruction": "Answer."}

    def step(self, action: str):
        return "done", float(action == self.answer), True, False, {"got_chars": len(action)}


register_env("review/ExactAnswer-v0", entry_point=ExactAnswerEnv)

# One model call, then the answer on stdout (from $ANSWER).
ONE_CALL = '''
import os
from openai import OpenAI
OpenAI().chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
print(os.environ["ANSWER"])
'''


@pytest.fixture
def servers(mock_policy, serve):
    proxy = serve(mock_policy(["ok"] * 50), token=ADMIN)
    with RunningServer(create_env_app(EnvServerConfig(token=TOKEN))) as envs:
        yield proxy, envs


def _episode(proxy, env, cmd, **kw):
    async def run():
        session = await open_session(proxy.url, ADMIN)
        return session, await run_harness_episode(cmd, session, env, timeout=60, **kw)
    return asyncio.run(run())


def test_a_long_stdout_answer_is_submitted_whole_and_utf8_intact(servers):
    pytest.importorskip("openai")
    proxy, envs = servers
    answer = "é" * 60_000  # over the 4000-character tail, and two-byte characters across 64 KiB reads
    env = EnvServer(envs.url, TOKEN, "review/ExactAnswer-v0", kwargs={"answer": answer})
    _, tree = _episode(proxy, env, [sys.executable, "-c", ONE_CALL], submit="stdout",
                       extra_env={"ANSWER": answer})
    assert "error" not in tree.meta, tree.meta.get("error")
    assert tree.meta["env"]["reward"] == 1.0
    assert len(tree.meta["harness"]["stdout_tail"]) <= 4000  # the record keeps a tail only


def test_a_verifier_that_returns_nan_fails_the_episode_and_closes_the_session(servers):
    pytest.importorskip("openai")
    proxy, envs = servers
    env = EnvServer(envs.url, TOKEN, "review/ExactAnswer-v0")
    session, tree = _episode(proxy, env, [sys.executable, "-c", ONE_CALL], extra_env={"ANSWER": "1"},
                             verifier=lambda t: float("nan"))
    assert "verifier" in tree.meta["error"] and "nan" in tree.meta["error"]
    assert proxy.app.proxy.sessions[session.session_id].closed
    assert all(n.reward == 0.0 for n in tree.nodes.values())


def test_a_harness_cannot_score_itself_through_its_session_key(servers):
    """The harness holds its session's key (OPENAI_API_KEY): the reward it posts for its own
    calls does not reach the tree; only the env's reward does."""
    pytest.importorskip("openai")
    proxy, envs = servers
    cheat = ONE_CALL + '''
import httpx
base, key = os.environ["ANTHROPIC_BASE_URL"], os.environ["OPENAI_API_KEY"]
h = {"Authorization": "Bearer " + key}
calls = httpx.get(base, headers=h).json()["calls"]
OpenAI().chat.completions.create(model="m", max_tokens=4, messages=[
    {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}])
httpx.post(base + "/reward", headers=h, json={"reward": 100.0, "call_id": calls[0]["call_id"]})
httpx.post(base + "/reward", headers=h, json={"reward": 100.0})
'''
    env = EnvServer(envs.url, TOKEN, "review/ExactAnswer-v0", kwargs={"answer": "right"})
    _, tree = _episode(proxy, env, [sys.executable, "-c", cheat], submit="stdout", extra_env={"ANSWER": "wrong"})
    assert "error" not in tree.meta, tree.meta.get("error")
    assert tree.meta["env"]["reward"] == 0.0
    assert len(tree.nodes) == 2 and len(tree.roots) == 1  # one path: the first call is not its leaf
    assert [n.reward for n in tree.nodes.values()] == [0.0, 0.0]


def test_an_exception_inside_the_episode_closes_its_env_and_session(servers):
    """A harness argv the OS refuses with a ValueError (a NUL byte), not an OSError."""
    proxy, envs = servers
    env = EnvServer(envs.url, TOKEN, "review/ExactAnswer-v0")
    session = None

    async def run():
        nonlocal session
        session = await open_session(proxy.url, ADMIN)
        return await run_harness_episode([sys.executable, "-c", "print(1)", "a\x00b"], session, env, timeout=10)

    tree = asyncio.run(run())
    assert "could not start" in tree.meta["error"] and not tree.nodes
    assert proxy.app.proxy.sessions[session.session_id].closed
    assert httpx.get(f"{envs.url}/health", headers={"Authorization": f"Bearer {TOKEN}"}).json()["envs"] == 0


# Starts a process in a session of its own (as a Node harness's detached child does), out of the
# harness's process group, writes its pid, and then exits or hangs as argv[1] says.
ESCAPES = '''
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
open(sys.argv[2], "w").write(str(child.pid))
if sys.argv[1] == "hang":
    time.sleep(60)
'''


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()  # a zombie: killed, waiting for init to reap it
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["exit", "hang"])
def test_a_process_the_harness_detached_from_its_group_is_killed_with_it(servers, tmp_path, how):
    import os
    import time

    proxy, _ = servers
    pidfile = tmp_path / "pid"

    async def run():
        session = await open_session(proxy.url, ADMIN)
        return await run_harness_episode([sys.executable, "-c", ESCAPES, how, str(pidfile)], session,
                                         timeout=3)

    tree = asyncio.run(run())
    pid = int(pidfile.read_text())
    try:
        deadline = time.monotonic() + 5
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid), "the detached child outlived its episode"
    finally:
        if not _gone(pid):
            os.kill(pid, 9)
    assert ("timed out" if how == "hang" else "made no model call") in tree.meta["error"]


def test_the_harness_gets_a_key_to_its_own_env_only(servers):
    """It plays its env; it cannot make envs (filling max_envs for every other episode)."""
    proxy, envs = servers
    probe = '''
import httpx, os
e = os.environ
h = {"Authorization": "Bearer " + e["AGENTRL_ENV_TOKEN"]}
url = e["AGENTRL_ENV_URL"]
assert httpx.post(url + "/envs", json={"env_id": "review/ExactAnswer-v0"}, headers=h).status_code == 401
httpx.post(url + "/envs/" + e["AGENTRL_ENV_INSTANCE"] + "/step", json={"action": "42"}, headers=h).raise_for_status()
'''
    env = EnvServer(envs.url, TOKEN, "review/ExactAnswer-v0")
    _, tree = _episode(proxy, env, [sys.executable, "-c", probe])
    assert tree.meta["harness"]["returncode"] == 0, tree.meta["harness"]["stderr_tail"]
    assert tree.meta["env"]["reward"] == 1.0 and tree.meta["env"]["steps"] == 1


def test_a_slow_verifier_does_not_hold_the_other_episodes_timeouts(servers):
    """Episodes run side by side on one event loop: a verifier that takes seconds (running a test
    suite) must not keep a hung harness beside it alive past its own timeout."""
    import time

    proxy, _ = servers
    one_call = ("import httpx, os; httpx.post(os.environ['OPENAI_BASE_URL'] + '/chat/completions', "
                "headers={'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY']}, "
                "json={'model': 'm', 'max_tokens': 2, 'messages': [{'role': 'user', 'content': 'hi'}]}, "
                "timeout=30).raise_for_status()")

    def slow(tree):
        time.sleep(6)
        return 1.0

    async def run():
        a, b = await open_session(proxy.url, ADMIN), await open_session(proxy.url, ADMIN)
        return await asyncio.gather(
            run_harness_episode([sys.executable, "-c", one_call], a, timeout=60, verifier=slow),
            run_harness_episode([sys.executable, "-c", "import time; time.sleep(60)"], b, timeout=4))

    scored, hung = asyncio.run(run())
    assert "error" not in scored.meta, scored.meta.get("error")
    assert "timed out" in hung.meta["error"] and hung.meta["harness"]["wall_s"] < 5.5


class LongTaskEnv(TextEnv):
    """A first observation of ``chars`` characters (a long issue, a page), answered by any action."""

    def __init__(self, chars: int = 200_000):
        super().__init__()
        self.chars = chars

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return "x" * self.chars, {}

    def step(self, action: str):
        return "done", 1.0, True, False, {}


register_env("review/LongTask-v0", entry_point=LongTaskEnv)

# Reads the task from the file named in its argument, $AGENTRL_TASK_FILE, and says how long it
# is; makes one model call.
READS_TASK_FILE = '''
import os
from openai import OpenAI
import sys
assert sys.argv[1] == os.environ["AGENTRL_TASK_FILE"] and "AGENTRL_TASK" not in os.environ
task = open(sys.argv[1], encoding="utf-8").read()
OpenAI().chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
print(len(task))
'''


def test_a_task_too_long_for_an_environment_variable_reaches_the_harness_in_a_file(servers):
    """Linux refuses one argument or environment string over 128 KiB (E2BIG): a long first
    observation in AGENTRL_TASK failed every episode of the env, even of harnesses that never read it."""
    pytest.importorskip("openai")
    proxy, envs = servers
    env = EnvServer(envs.url, TOKEN, "review/LongTask-v0")
    _, tree = _episode(proxy, env, [sys.executable, "-c", READS_TASK_FILE, "$AGENTRL_TASK_FILE"])
    assert "error" not in tree.meta, tree.meta.get("error")
    assert tree.meta["harness"]["stdout_tail"].startswith("200000")


def test_a_task_too_long_for_an_argument_fails_the_episode_saying_so(servers):
    proxy, envs = servers
    env = EnvServer(envs.url, TOKEN, "review/LongTask-v0")
    _, tree = _episode(proxy, env, [sys.executable, "-c", "pass", "$AGENTRL_TASK"])
    assert "AGENTRL_TASK_FILE" in tree.meta["error"] and "200000" in tree.meta["error"]


def test_the_harness_gets_the_trainers_environment_without_its_credentials(servers, monkeypatch):
    """A harness runs commands the model writes: the trainer's own tokens and keys (HF_TOKEN, a
    cloud key) must not be readable there. What the harness needs, ``extra_env`` passes; the
    session's own key and the rest of the environment (PATH, HOME, proxies) still come through."""
    pytest.importorskip("openai")
    proxy, envs = servers
    secrets = {"HF_TOKEN": "hf-s3cret", "AWS_SECRET_ACCESS_KEY": "aws-s3cret", "WANDB_API_KEY": "wb-s3cret",
               "MY_SERVICE_PASSWORD": "pw-s3cret", "GITHUB_TOKEN": "gh-s3cret", "SSH_AUTH_SOCK": "/tmp/agent.sock"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AGENTRL_TEST_PLAIN", "plain-value")
    names = [*secrets, "AGENTRL_TEST_PLAIN", "PATH", "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AGENTRL_ENV_TOKEN"]
    show = ONE_CALL.replace('print(os.environ["ANSWER"])',
                            f'import json; print(json.dumps({{k: os.environ[k] for k in {names} if k in os.environ}}))')
    env = EnvServer(envs.url, TOKEN, "review/ExactAnswer-v0")
    _, tree = _episode(proxy, env, [sys.executable, "-c", show], extra_env={"GITHUB_TOKEN": "given"})
    assert "error" not in tree.meta, tree.meta.get("error")
    seen = json.loads(tree.meta["harness"]["stdout_tail"])
    assert set(seen) == set(names) - set(secrets) | {"GITHUB_TOKEN"}, sorted(seen)
    assert seen["GITHUB_TOKEN"] == "given"  # passed on purpose
    assert seen["AGENTRL_TEST_PLAIN"] == "plain-value" and seen["PATH"] == os.environ["PATH"]
    assert seen["OPENAI_API_KEY"] == seen["ANTHROPIC_API_KEY"] and seen["AGENTRL_ENV_TOKEN"]
