"""Harness rollouts: what a group's tree keeps of its sessions."""

from __future__ import annotations

import pytest

from agentrl.errors import ConfigError
from agentrl.proxy.rollouts import merge_sessions
from agentrl.types import Node, RolloutTree


def test_the_group_keeps_how_many_rewards_a_harness_posted_for_itself():
    """``run_harness_episode`` zeroes a reward the harness posted with its session key
    (``meta["dropped_rewards"]``): the group's tree says so, as it says why a session failed."""
    cheat = RolloutTree(meta={"session_id": "a", "dropped_rewards": 2})
    cheat.add(Node(action_ids=[1], reward=0.0, terminated=True))
    honest = RolloutTree(meta={"session_id": "b"})
    honest.add(Node(action_ids=[2], reward=1.0, terminated=True))
    group = merge_sessions([cheat, honest], {"task": 0})
    assert [s.get("dropped_rewards") for s in group.meta["sessions"]] == [2, None]


def test_an_episode_that_raises_leaves_no_session_open_on_the_proxy(tokenizer, monkeypatch):
    """A bug inside an episode fails it alone; its proxy session goes with it, or a long run fills
    the proxy's max_sessions with open sessions and every later episode is refused."""
    import agentrl.proxy.harness as harness
    from agentrl.config import Config
    from agentrl.policy import MockPolicy
    from agentrl.proxy.rollouts import HarnessRollouts

    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(harness, "run_harness_episode", broken)
    cfg = Config()
    policy = MockPolicy(tokenizer, ["x"])
    rollouts = HarnessRollouts("python -c pass", policy, cfg)
    try:
        with pytest.warns(UserWarning, match="a bug"), pytest.raises(ConfigError, match="every harness episode"):
            rollouts.collect("agentrl/GuessNumber-v0", policy, cfg, [0, 1])
        assert rollouts.proxy is not None and rollouts.proxy.app.proxy.sessions == {}
    finally:
        rollouts.close()


def test_the_env_server_keeps_an_idle_env_as_long_as_its_episode_may_run():
    """Its harness may not touch the env until it exits (submit=stdout): the env server must not
    reap it (then the answer has no env) before the episode's timeout."""
    from agentrl.proxy.rollouts import env_idle_s

    assert env_idle_s(1800.0) >= 3600.0
    assert env_idle_s(7200.0) > 7200.0
    assert env_idle_s(None) >= 365 * 24 * 3600  # no episode limit: no reaping that would fail one
