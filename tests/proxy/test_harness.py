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
