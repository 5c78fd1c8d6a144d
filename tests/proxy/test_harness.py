"""run_harness_episode: the example ReAct agent, unmodified, on the mock backend and the env server."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest

from agentrl.proxy import RunningServer
from agentrl.proxy.envserver import EnvServerConfig, create_env_app
from agentrl.proxy.harness import EnvServer, open_session, run_harness_episode

pytest.importorskip("openai", reason="the example harness uses the openai client")

AGENT = Path(__file__).resolve().parents[2] / "examples" / "harness" / "react_agent.py"
TOKEN = "t0k"


def _bisect(prompt: str) -> str:
    """A scripted policy that plays GuessNumber by bisection from the observations it is shown."""
    lo, hi = 1, 8
    guesses = re.findall(r"Action: (\d+)", prompt)
    hints = re.findall(r"Observation: [^<]*?(higher|lower)", prompt)
    for g, h in zip(guesses, hints, strict=False):
        lo, hi = (int(g) + 1, hi) if h == "higher" else (lo, int(g) - 1)
    return f"Thought: bisect {lo}..{hi}\nAction: {(lo + hi) // 2}"


@pytest.fixture
def servers(mock_policy, serve):
    proxy = serve(mock_policy(_bisect))
    with RunningServer(create_env_app(EnvServerConfig(token=TOKEN))) as envs:
        yield proxy.url, envs.url


def test_example_agent_episode_becomes_a_rewarded_tree(servers):
    proxy_url, env_url = servers
    env = EnvServer(env_url, TOKEN, "agentrl/GuessNumber-v0", seed=3, kwargs={"high": 8})

    async def run():
        session = await open_session(proxy_url, meta={"task": 3})
        return await run_harness_episode([sys.executable, str(AGENT)], session, env, timeout=60)

    tree = asyncio.run(run())
    assert "error" not in tree.meta, tree.meta
    [episode] = list(tree.episodes())
    assert tree.meta["env"]["terminated"] and tree.meta["env"]["reward"] == 1.0
    assert episode.nodes[-1].reward == 1.0 and episode.nodes[-1].terminated
    assert episode.num_turns == tree.meta["env"]["steps"] <= 4
    assert tree.meta["harness"]["returncode"] == 0 and tree.meta["task"] == 3


@pytest.mark.parametrize(("cmd", "reason"), [
    ("import sys; sys.exit(3)", "exited with code 3"),
    ("import time; time.sleep(60)", "timed out"),
])
def test_crash_or_hang_fails_only_the_episode(servers, cmd, reason):
    proxy_url, env_url = servers
    env = EnvServer(env_url, TOKEN, "agentrl/GuessNumber-v0", seed=0)

    async def run():
        session = await open_session(proxy_url)
        return await run_harness_episode([sys.executable, "-c", cmd], session, env, timeout=2)

    tree = asyncio.run(run())
    assert reason in tree.meta["error"] and not tree.nodes


CLI_LIKE = '''
import os, sys
from anthropic import Anthropic
# The task arrives as an argument ($AGENTRL_TASK expanded per episode), the session through
# ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY; the answer leaves on stdout.
assert sys.argv[1] == os.environ["AGENTRL_TASK"] != "" and "$" not in sys.argv[1]
assert os.environ["ANTHROPIC_BASE_URL"].endswith("/sessions/" + os.environ["AGENTRL_SESSION_ID"])
Anthropic().messages.create(model="claude-test", max_tokens=8, messages=[{"role": "user", "content": sys.argv[1]}])
print("My answer is 1.")
'''


@pytest.mark.parametrize("submit", [None, "stdout"])
def test_a_cli_harness_answers_on_stdout(servers, tmp_path, submit):
    pytest.importorskip("anthropic", reason="the harness uses the anthropic client")
    proxy_url, env_url = servers
    script = tmp_path / "cli_like.py"
    script.write_text(CLI_LIKE)
    env = EnvServer(env_url, TOKEN, "agentrl/GuessNumber-v0", seed=0, kwargs={"high": 1})  # the secret is 1

    async def run():
        session = await open_session(proxy_url)
        return await run_harness_episode([sys.executable, str(script), "$AGENTRL_TASK"], session, env,
                                         timeout=60, submit=submit)

    tree = asyncio.run(run())
    assert "error" not in tree.meta, tree.meta
    [node] = tree.nodes.values()
    assert node.info["api"] == "messages" and node.info["model"] == "claude-test"
    if submit == "stdout":  # the printed answer was the env's action: found
        assert tree.meta["env"]["reward"] == 1.0 and tree.meta["env"]["terminated"] and node.reward == 1.0
    else:  # the env never heard from the harness
        assert tree.meta["env"]["steps"] == 0 and node.reward == 0.0 and not node.terminated


def test_a_command_that_cannot_start_fails_only_its_episode(servers):
    proxy_url, env_url = servers
    env = EnvServer(env_url, TOKEN, "agentrl/GuessNumber-v0", seed=0)

    async def run():
        session = await open_session(proxy_url)
        return await run_harness_episode(["no-such-harness-here", "-p", "x"], session, env, timeout=10)

    tree = asyncio.run(run())
    assert tree.meta["error"].startswith("the harness command could not start") and not tree.nodes


def test_expand_argv_replaces_known_names_only():
    from agentrl.proxy.harness import expand_argv

    env = {"A": "1", "TASK": "say $A"}
    assert expand_argv(["$A", "${A}x", "$TASK", "$NOPE", "a$Ab"], env) == ["1", "1x", "say $A", "$NOPE", "a$Ab"]
