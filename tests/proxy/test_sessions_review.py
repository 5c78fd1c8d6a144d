"""Sessions under hostile or unlucky harnesses: rewards that are no numbers, side conversations retried."""

from __future__ import annotations

import math

import httpx
import pytest

from agentrl.types import RolloutTree

openai = pytest.importorskip("openai", reason="the session tests drive the proxy with the openai client")


def _session(url: str) -> tuple[str, openai.OpenAI]:
    data = httpx.post(f"{url}/sessions", json={}).raise_for_status().json()
    return data["session_id"], openai.OpenAI(base_url=data["base_url"], api_key=data["api_key"], max_retries=0)


def _reply(out) -> dict:
    return out.choices[0].message.model_dump(exclude_none=True)


def test_a_reward_past_the_float_range_is_refused_not_recorded(mock_policy, serve):
    """``1e999`` is valid JSON that Python reads as inf: it would reach every advantage of the group."""
    server = serve(mock_policy(["a"]))
    sid, client = _session(server.url)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    url = f"{server.url}/sessions/{sid}"
    r = httpx.post(f"{url}/reward", content=b'{"reward": 1e999}', headers={"content-type": "application/json"})
    assert r.status_code >= 400 and "reward" in r.text
    tree = RolloutTree.from_dict(httpx.get(f"{url}/tree").json())
    assert all(math.isfinite(n.reward) for n in tree.nodes.values())
    assert tree.meta["reward"] is None


def test_a_retried_side_conversation_call_is_abandoned_not_rewarded(mock_policy, serve):
    """A sub-agent (its own system prompt) whose first call the harness retried: the retry is the
    side conversation's outcome; the reply it replaced is a path the harness left."""
    server = serve(mock_policy(["m1", "s1", "s2", "m2"]))
    sid, client = _session(server.url)
    main = [{"role": "system", "content": "Main."}, {"role": "user", "content": "task"}]
    first = client.chat.completions.create(model="m", messages=main)
    sub = [{"role": "system", "content": "Sub-agent."}, {"role": "user", "content": "help"}]
    client.chat.completions.create(model="m", messages=sub)
    client.chat.completions.create(model="m", messages=sub)  # retried: its first reply was dropped
    client.chat.completions.create(model="m", messages=main + [_reply(first), {"role": "user", "content": "go"}])
    url = f"{server.url}/sessions/{sid}"
    httpx.post(f"{url}/reward", json={"reward": 1.0}).raise_for_status()
    tree = RolloutTree.from_dict(httpx.post(f"{url}/close").json())
    by_text = {n.action_text: n for n in tree.nodes.values()}
    assert by_text["s2"].info.get("side_conversation") and by_text["s2"].reward == 1.0
    assert by_text["s1"].info.get("abandoned") and by_text["s1"].reward == 0.0
    assert by_text["m2"].reward == 1.0 and by_text["m1"].children


def test_an_unpicked_choice_of_a_side_conversation_is_abandoned(mock_policy, serve):
    server = serve(mock_policy(["m1", "s1", "s2", "s3", "m2"]))
    sid, client = _session(server.url)
    main = [{"role": "system", "content": "Main."}, {"role": "user", "content": "task"}]
    first = client.chat.completions.create(model="m", messages=main)
    sub = [{"role": "system", "content": "Sub-agent."}, {"role": "user", "content": "help"}]
    two = client.chat.completions.create(model="m", messages=sub, n=2)  # s1, s2: it goes on with s2
    client.chat.completions.create(model="m", messages=sub + [two.choices[1].message.model_dump(exclude_none=True),
                                                              {"role": "user", "content": "more"}])
    client.chat.completions.create(model="m", messages=main + [_reply(first), {"role": "user", "content": "go"}])
    url = f"{server.url}/sessions/{sid}"
    httpx.post(f"{url}/reward", json={"reward": 1.0}).raise_for_status()
    tree = RolloutTree.from_dict(httpx.post(f"{url}/close").json())
    by_text = {n.action_text: n for n in tree.nodes.values()}
    assert by_text["s3"].info.get("side_conversation") and by_text["s3"].reward == 1.0
    assert by_text["s1"].info.get("abandoned") and by_text["s1"].reward == 0.0


def test_sub_agents_started_alike_in_parallel_are_each_an_outcome(mock_policy, serve):
    """Two sub-agents with one first prompt, each going on from its own reply: both are parts of
    the episode, not one retried call."""
    server = serve(mock_policy(["m1", "a1", "b1", "a2", "b2", "m2"]))
    sid, client = _session(server.url)
    main = [{"role": "system", "content": "Main."}, {"role": "user", "content": "task"}]
    first = client.chat.completions.create(model="m", messages=main)
    sub = [{"role": "system", "content": "Sub-agent."}, {"role": "user", "content": "search"}]
    a = client.chat.completions.create(model="m", messages=sub)
    b = client.chat.completions.create(model="m", messages=sub)
    for out in (a, b):
        client.chat.completions.create(model="m", messages=sub + [_reply(out), {"role": "user", "content": "go on"}])
    client.chat.completions.create(model="m", messages=main + [_reply(first), {"role": "user", "content": "go"}])
    url = f"{server.url}/sessions/{sid}"
    httpx.post(f"{url}/reward", json={"reward": 1.0}).raise_for_status()
    tree = RolloutTree.from_dict(httpx.post(f"{url}/close").json())
    by_text = {n.action_text: n for n in tree.nodes.values()}
    for text in ("a2", "b2", "m2"):
        assert by_text[text].reward == 1.0 and not by_text[text].info.get("abandoned"), text


def test_a_leaf_marked_abandoned_by_an_early_look_is_unmarked_once_the_harness_goes_on_from_it(mock_policy, serve):
    """GET /tree assembles the tree (a viewer, a verifier, a curious harness): a leaf abandoned
    then, which the harness later goes on from, is no abandoned path in the final tree."""
    server = serve(mock_policy(["a", "b", "c"]))
    sid, client = _session(server.url)
    msgs = [{"role": "user", "content": "q"}]
    first = client.chat.completions.create(model="m", messages=msgs)
    client.chat.completions.create(model="m", messages=msgs)  # the same call again: "b" beside "a"
    url = f"{server.url}/sessions/{sid}"
    early = RolloutTree.from_dict(httpx.get(f"{url}/tree").json())
    assert early.nodes[0].info.get("abandoned")  # "a", then
    client.chat.completions.create(model="m", messages=msgs + [_reply(first), {"role": "user", "content": "on"}])
    tree = RolloutTree.from_dict(httpx.post(f"{url}/close").json())
    a, b, c = (tree.nodes[i] for i in (0, 1, 2))
    assert c.parent == a.id and not a.info.get("abandoned") and not a.truncated
    assert b.info.get("abandoned") and b.truncated
