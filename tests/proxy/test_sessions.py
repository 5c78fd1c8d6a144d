"""Sessions: token-exact recording, prefix reuse, branches with their reasons, rewards, export."""

from __future__ import annotations

import httpx
import pytest
import torch

from agentrl.types import RolloutTree, read_trees

openai = pytest.importorskip("openai", reason="the session tests drive the proxy with the openai client")


def _session(url: str, **body) -> tuple[str, openai.OpenAI]:
    data = httpx.post(f"{url}/sessions", json=body).raise_for_status().json()
    client = openai.OpenAI(base_url=data["base_url"], api_key=data["api_key"], max_retries=0)
    return data["session_id"], client


def _tree(url: str, sid: str) -> RolloutTree:
    return RolloutTree.from_dict(httpx.get(f"{url}/sessions/{sid}/tree").raise_for_status().json())


def _reply(out) -> dict:
    return out.choices[0].message.model_dump(exclude_none=True)


def test_recorded_tokens_are_the_sampled_tokens_over_turns(hf_server, tiny_model, tokenizer):
    sid, client = _session(hf_server.url)
    msgs = [{"role": "system", "content": "Count."}, {"role": "user", "content": "one"}]
    outs = []
    for turn in range(3):
        out = client.chat.completions.create(model="m", messages=msgs, max_tokens=6, seed=turn,
                                             extra_body={"return_token_ids": True}).model_dump()
        outs.append(out)
        msgs += [{"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                 {"role": "user", "content": f"turn {turn + 2}"}]
    tree = _tree(hf_server.url, sid)
    [episode] = list(tree.episodes())
    assert len(episode.nodes) == 3
    for node, out in zip(episode.nodes, outs, strict=True):
        assert node.action_ids == out["choices"][0]["token_ids"]
    last = outs[-1]
    assert episode.input_ids == last["prompt_token_ids"] + last["choices"][0]["token_ids"]
    # each later prompt extends the earlier one: nothing recorded was re-tokenized
    for a, b in zip(outs, outs[1:], strict=False):
        seen = a["prompt_token_ids"] + a["choices"][0]["token_ids"]
        assert b["prompt_token_ids"][:len(seen)] == seen
    summary = httpx.get(f"{hf_server.url}/sessions/{sid}").json()
    assert [c["reused_tokens"] for c in summary["calls"]][1:] == [
        len(o["prompt_token_ids"]) + len(o["choices"][0]["token_ids"]) for o in outs[:-1]]
    # behaviour logprobs (temperature 1) match a recomputation by a plain forward pass
    ids = torch.tensor([episode.input_ids])
    with torch.no_grad():
        logp = torch.log_softmax(tiny_model(ids).logits[0].float(), -1)
    for start, end in episode.turn_spans:
        recomputed = [logp[t - 1, episode.input_ids[t]].item() for t in range(start, end)]
        assert recomputed == pytest.approx(episode.logprobs[start:end], abs=2e-3)


def _three_turns(url: str, client) -> list[dict]:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}]
    for k in (2, 3):
        out = client.chat.completions.create(model="m", messages=msgs)
        msgs += [_reply(out), {"role": "user", "content": f"u{k}"}]
    client.chat.completions.create(model="m", messages=msgs)
    return msgs


def test_delta_is_the_template_rendering_of_the_new_messages(mock_policy, serve, tokenizer):
    server = serve(mock_policy(["first", "second", "third"]))
    sid, client = _session(server.url)
    msgs = _three_turns(server.url, client)
    tree = _tree(server.url, sid)
    [episode] = list(tree.episodes())
    full = msgs + [{"role": "assistant", "content": "third"}]
    assert tokenizer.decode(episode.input_ids) == tokenizer.apply_chat_template(full, tokenize=False)[:-1]
    assert [n.action_text for n in episode.nodes] == ["first", "second", "third"]
    assert tree.meta["branches"] == [] and tree.meta["template_mismatches"] == 0


def test_retry_makes_siblings_that_share_the_context(mock_policy, serve):
    server = serve(mock_policy(["a", "b", "c"]))
    sid, client = _session(server.url)
    msgs = [{"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model="m", messages=msgs)
    msgs += [_reply(first), {"role": "user", "content": "again"}]
    client.chat.completions.create(model="m", messages=msgs)
    client.chat.completions.create(model="m", messages=msgs)  # the harness retries the call
    tree = _tree(server.url, sid)
    root = tree.nodes[tree.roots[0]]
    assert len(root.children) == 2
    b, c = (tree.nodes[i] for i in root.children)
    assert b.context_ids == c.context_ids and [b.action_text, c.action_text] == ["b", "c"]
    branch = c.info["branch"]
    assert branch["reason"] == "retry" and branch["parent_node"] == root.id
    assert branch["at_token"] == len(root.context_ids) + len(root.action_ids)
    assert tree.to_dict()["nodes"][c.id]["context_from"] == b.id  # written once
    tree = RolloutTree.from_dict(httpx.post(f"{server.url}/sessions/{sid}/close").json())
    assert tree.nodes[b.id].info.get("abandoned") and not tree.nodes[c.id].info.get("abandoned")


def test_edit_of_the_last_message_branches_at_it(mock_policy, serve):
    server = serve(mock_policy(["r1", "r2", "r3"]))
    sid, client = _session(server.url)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}]
    out = client.chat.completions.create(model="m", messages=msgs)
    msgs += [_reply(out), {"role": "user", "content": "u2"}]
    client.chat.completions.create(model="m", messages=msgs)
    msgs[-1] = {"role": "user", "content": "u2, said better"}
    client.chat.completions.create(model="m", messages=msgs)
    tree = _tree(server.url, sid)
    [branch] = tree.meta["branches"]
    assert branch["reason"] == "edit" and branch["at_message"] == 3 and branch["parent_node"] == 0
    assert sorted(len(e.nodes) for e in tree.episodes()) == [2, 2]


def test_edit_of_an_early_message_and_compaction_start_new_roots(mock_policy, serve):
    server = serve(mock_policy(["x"]))
    sid, client = _session(server.url)
    msgs = _three_turns(server.url, client)
    edited = [msgs[0], {"role": "user", "content": "u1 edited"}] + msgs[2:]
    client.chat.completions.create(model="m", messages=edited)
    compacted = [msgs[0], {"role": "user", "content": "Summary: u1, u2 done."}, msgs[-1]]
    client.chat.completions.create(model="m", messages=compacted)
    client.chat.completions.create(model="m", messages=[{"role": "system", "content": "Sub-agent."},
                                                        {"role": "user", "content": "help"}])
    tree = _tree(server.url, sid)
    reasons = [(b["reason"], b["at_message"], b["parent_node"]) for b in tree.meta["branches"]]
    assert reasons == [("edit", 1, None), ("compaction", 1, None), ("divergence", 0, None)]
    assert len(tree.roots) == 4


def test_n_choices_are_siblings_and_the_picked_one_is_extended(mock_policy, serve):
    server = serve(mock_policy(["c0", "c1"]))
    sid, client = _session(server.url)
    msgs = [{"role": "user", "content": "pick"}]
    out = client.chat.completions.create(model="m", messages=msgs, n=2)
    picked = out.choices[1].message.model_dump(exclude_none=True)
    client.chat.completions.create(model="m", messages=msgs + [picked, {"role": "user", "content": "go"}])
    tree = _tree(server.url, sid)
    assert tree.roots == [0, 1] and tree.nodes[0].context_ids == tree.nodes[1].context_ids
    assert tree.nodes[2].parent == 1 and not tree.meta["branches"]


def test_token_prompts_hang_under_the_path_they_extend(mock_policy, serve, tokenizer):
    server = serve(mock_policy(["alpha", "beta"]))
    sid, client = _session(server.url)
    prompt = tokenizer.encode("start")
    first = client.completions.create(model="m", prompt=prompt, max_tokens=8,
                                      extra_body={"return_token_ids": True}).model_dump()
    extra = tokenizer.encode(" more")
    follow = prompt + first["choices"][0]["token_ids"] + extra
    client.completions.create(model="m", prompt=follow, max_tokens=8)
    client.completions.create(model="m", prompt=prompt + extra, max_tokens=8)  # leaves the path
    tree = _tree(server.url, sid)
    assert tree.nodes[1].parent == 0 and tree.nodes[1].context_ids == extra
    assert tree.nodes[2].parent is None and tree.meta["branches"][0]["reason"] == "divergence"


def test_rewards_close_and_export(mock_policy, serve, tmp_path):
    out_file = tmp_path / "trees.jsonl"
    server = serve(mock_policy(["a", "b"]), out=str(out_file))
    sid, client = _session(server.url, meta={"task": 7})
    msgs = [{"role": "user", "content": "q"}]
    first = client.chat.completions.create(model="m", messages=msgs)
    client.chat.completions.create(model="m", messages=msgs + [_reply(first), {"role": "user", "content": "r"}])
    url = f"{server.url}/sessions/{sid}"
    assert httpx.post(f"{url}/reward", json={"reward": 0.25, "call_id": first.id}).json()["nodes"] == [0]
    assert httpx.post(f"{url}/reward", json={"reward": 1.0}).json()["nodes"] == [1]
    bad = httpx.post(f"{url}/reward", json={"reward": 1.0, "call_id": "nope"})
    assert bad.status_code == 404 and "call_id" in bad.json()["error"]["message"]
    closed = RolloutTree.from_dict(httpx.post(f"{url}/close").json())
    [episode] = list(closed.episodes())
    assert episode.rewards == [0.25, 1.0] and episode.nodes[-1].terminated
    assert closed.meta["task"] == 7 and closed.meta["reward"] == 1.0
    [saved] = read_trees(out_file)
    assert saved.to_dict() == closed.to_dict()
    again = httpx.post(f"{server.url}/sessions/{sid}/v1/chat/completions",
                       json={"model": "m", "messages": msgs})
    assert again.status_code == 409


def test_session_named_by_header_or_by_its_key(mock_policy, serve):
    server = serve(mock_policy(["a"]))
    sid, _ = _session(server.url)
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"X-Session-Id": sid}).raise_for_status()
    key = httpx.post(f"{server.url}/sessions", json={}).json()
    httpx.post(f"{server.url}/v1/chat/completions", json=body,
               headers={"Authorization": f"Bearer {key['api_key']}"}).raise_for_status()
    httpx.post(f"{server.url}/v1/chat/completions", json=body).raise_for_status()  # no session: not recorded
    assert len(_tree(server.url, sid).nodes) == 1
    assert len(_tree(server.url, key["session_id"]).nodes) == 1


def test_a_seeded_session_repeats_calls_that_carry_no_seed(hf_server):
    """A harness that sends no seed still repeats: each call samples from the session's next stream."""
    msgs = [{"role": "user", "content": "Say something."}]

    def run(**body) -> list[list[int]]:
        _, client = _session(hf_server.url, **body)
        return [client.chat.completions.create(model="m", messages=msgs, max_tokens=10, temperature=1.0,
                                               extra_body={"return_token_ids": True}
                                               ).model_dump()["choices"][0]["token_ids"] for _ in range(2)]

    first, again, other = run(seed=7), run(seed=7), run(seed=8)
    assert first == again  # same session seed: the same two calls
    assert first[0] != first[1]  # the same prompt twice in one session: two streams
    assert other != first
    # At once, the two calls still take the two streams (in either order).
    from concurrent.futures import ThreadPoolExecutor

    _, client = _session(hf_server.url, seed=7)
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: client.chat.completions.create(
            model="m", messages=msgs, max_tokens=10, temperature=1.0, extra_body={"return_token_ids": True}
        ).model_dump()["choices"][0]["token_ids"], range(2)))
    assert sorted(both) == sorted(first)
    with pytest.raises(httpx.HTTPStatusError):  # the seed is an integer
        _session(hf_server.url, seed="x")


class _SeedLog:
    """A mock policy that logs each request's seed, holds every call until ``together`` have
    arrived (so they overlap for sure), and fails the calls numbered in ``fail`` (from 1)."""

    def __init__(self, tokenizer, together: int = 1, fail: tuple[int, ...] = ()):
        from agentrl.policy import MockPolicy

        self.inner, self.together, self.fail, self.seeds = MockPolicy(tokenizer, ["ok"]), together, fail, []
        self.tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def agenerate(self, request):
        import asyncio

        from agentrl.errors import PolicyError

        self.seeds.append(request.params.seed)
        k = len(self.seeds)
        for _ in range(500):  # at most 5 s: past that the test fails on its assert, it does not hang
            if len(self.seeds) >= self.together:
                break
            await asyncio.sleep(0.01)
        if k in self.fail:
            raise PolicyError("the backend fell over")
        return await self.inner.agenerate(request)


def test_a_seeded_session_holds_a_stream_for_each_call_until_it_is_recorded_or_ends(serve, tokenizer):
    msgs = [{"role": "user", "content": "q"}]
    body = {"model": "m", "messages": msgs, "max_tokens": 4}

    def post(url: str, key: str, path: str = "chat/completions", **extra) -> httpx.Response:
        return httpx.post(f"{url}/v1/{path}", json={**body, **extra}, headers={"Authorization": f"Bearer {key}"},
                          timeout=30)

    def key(url: str) -> str:
        return httpx.post(f"{url}/sessions", json={"seed": 3}).raise_for_status().json()["api_key"]

    # Two calls in flight together with one prompt: two streams, not one twice.
    together = _SeedLog(tokenizer, together=2)
    server = serve(together)
    k = key(server.url)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        codes = [r.status_code for r in pool.map(lambda _: post(server.url, k), range(2))]
    assert codes == [200, 200] and len(set(together.seeds)) == 2
    # A call the backend failed (503) frees its stream: the retry samples the same one, and the
    # call after that takes the next, as in a session where nothing failed.
    flaky = _SeedLog(tokenizer, fail=(1,))
    server = serve(flaky)
    k = key(server.url)
    assert [post(server.url, k).status_code for _ in range(3)] == [503, 200, 200]
    assert flaky.seeds[0] == flaky.seeds[1] and sorted(flaky.seeds[1:]) == sorted(together.seeds)
    # A request refused after its first prompt took a stream (the second prompt is over the
    # context budget) frees it too.
    plain = _SeedLog(tokenizer)
    server = serve(plain, max_context_tokens=64)
    k = key(server.url)
    refused = post(server.url, k, "completions", prompt=[[5, 6, 7], [5] * 100])
    assert refused.status_code == 400
    post(server.url, k, "completions", prompt=[[5, 6, 7]]).raise_for_status()
    post(server.url, k, "completions", prompt=[[5, 6, 7]]).raise_for_status()
    fresh = _SeedLog(tokenizer)
    server = serve(fresh)
    k = key(server.url)
    for _ in range(2):
        post(server.url, k, "completions", prompt=[[5, 6, 7]]).raise_for_status()
    assert plain.seeds == fresh.seeds and len(set(fresh.seeds)) == 2


def test_session_streams_follow_the_prompt_and_what_was_recorded():
    from agentrl.proxy.sessions import Session

    s = Session("a", seed=5)
    assert s.tree.meta["session_seed"] == 5
    first = s.call_seed([1, 2, 3], None, "c1")
    s.release_streams("c1")  # c1 failed: nothing recorded
    assert s.call_seed([1, 2, 3], None, "c2") == first  # its retry gets the same stream
    second = s.call_seed([1, 2, 3], None, "c3")
    assert second != first  # while c2 is in flight, the same prompt takes the next stream
    assert s.call_seed([1, 2, 3], None, "c3") not in (first, second)  # a repeat inside one request too
    s.keep_streams("c2")  # c2 was recorded: its stream stays taken
    s.release_streams("c2")  # does nothing after keep
    s.release_streams("c3")
    assert s.call_seed([1, 2, 3], None, "c4") == second  # the lowest free stream
    assert s.call_seed([1, 2, 4], None, "c5") != first  # another prompt, another stream
    assert s.call_seed([1, 2, 3], 0, "c6") != first != Session("b", seed=6).call_seed([1, 2, 3], None, "c")
    # A hard-coded seed is mixed with the session's: episodes still differ.
    assert Session("c", seed=6).call_seed([1, 2, 3], 0, "c") != Session("a2", seed=5).call_seed([1, 2, 3], 0, "c")
    unseeded = Session("d")
    assert unseeded.call_seed([1, 2, 3], 7, "c") == 7 and Session("e").call_seed([1], None, "c") is None
    assert not unseeded._held  # nothing held without a session seed


def test_compaction_to_system_and_summary_is_a_compaction_and_the_session_reward_reaches_the_compacted_path(
        mock_policy, serve):
    server = serve(mock_policy(["r1", "r2", "r3", "r4"]))
    sid, client = _session(server.url)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}]
    out = client.chat.completions.create(model="m", messages=msgs)
    msgs += [_reply(out), {"role": "user", "content": "u2"}]
    client.chat.completions.create(model="m", messages=msgs)
    client.chat.completions.create(model="m", messages=msgs)  # a retry: its sibling is abandoned
    compacted = [msgs[0], {"role": "user", "content": "Summary: u1 and u2 answered."}]
    last = client.chat.completions.create(model="m", messages=compacted)
    tree = _tree(server.url, sid)
    [retry, branch] = tree.meta["branches"]
    assert retry["reason"] == "retry"
    assert branch["reason"] == "compaction" and branch["at_message"] == 1 and branch["continues"] == [2]
    url = f"{server.url}/sessions/{sid}"
    assert httpx.post(f"{url}/reward", json={"reward": 1.0}).json()["nodes"] == [3, 2]
    closed = RolloutTree.from_dict(httpx.post(f"{url}/close").json())
    compacted_leaf, retried, final = closed.nodes[2], closed.nodes[1], closed.nodes[3]
    assert final.info["call_id"] == last.id and final.reward == 1.0 and final.terminated
    assert compacted_leaf.reward == 1.0 and compacted_leaf.terminated
    assert compacted_leaf.info["continued_by"] == last.id and not compacted_leaf.info.get("abandoned")
    assert retried.reward == 0.0 and retried.info["abandoned"] and retried.truncated
    returns = sorted(sum(e.rewards) for e in closed.episodes())
    assert returns == [0.0, 1.0, 1.0]  # the abandoned retry, the compacted path, the final path


@pytest.mark.parametrize(("check_prefix", "checked"), [(None, [1, 2, 8]), (3, [1, 2, 3, 6, 9]),
                                                       (True, list(range(1, 12))), (0, [])])
def test_a_session_renders_only_new_messages_and_checks_the_whole_template_every_nth_turn(
        mock_policy, serve, tokenizer, monkeypatch, check_prefix, checked):
    """Work per call must not grow with the conversation: each call renders its new messages
    only, and the full re-render that checks the template runs on the first two observations
    and every N-th (as the rollout engine's ``template_check_every``)."""
    full_renders: list[int] = []
    render = tokenizer.apply_chat_template

    def counting(messages, *args, **kwargs):
        turns = sum(m["role"] == "assistant" for m in messages)
        if messages[0]["content"] == "The system prompt." and turns:  # a delta renders after a stand-in
            full_renders.append(turns)
        return render(messages, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", counting)
    server = serve(mock_policy(["ok"]), **({} if check_prefix is None else {"check_prefix": check_prefix}))
    sid, client = _session(server.url)
    msgs = [{"role": "system", "content": "The system prompt."}, {"role": "user", "content": "u0"}]
    for turn in range(12):
        out = client.chat.completions.create(model="m", messages=msgs)
        msgs += [_reply(out), {"role": "user", "content": f"u{turn + 1}"}]
    assert full_renders == checked  # by the number of assistant turns in the checked context
    assert _tree(server.url, sid).meta["template_mismatches"] == 0



def test_a_full_proxy_closes_the_session_idle_longest_past_the_limit_for_a_new_one(mock_policy, serve, tmp_path):
    """Sessions never expired: harnesses that never close theirs filled max_sessions, and every
    later session was refused with 429 for as long as the proxy ran."""
    import json

    out = tmp_path / "trees.jsonl"
    from agentrl.proxy import ProxyConfig

    with pytest.raises(ValueError, match="session_idle_s .* must be longer than generate_timeout_s"):
        ProxyConfig(session_idle_s=60)  # a call may still be generating 600 s after its request
    server = serve(mock_policy(["hi"]), max_sessions=2, session_idle_s=60, generate_timeout_s=30, out=str(out))
    proxy = server.app.proxy
    for sid in ("a", "b"):
        assert httpx.post(f"{server.url}/sessions", json={"session_id": sid}).status_code == 200
    r = httpx.post(f"{server.url}/sessions/a/v1/chat/completions",
                   json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200, r.text
    refused = httpx.post(f"{server.url}/sessions", json={"session_id": "c"})
    assert refused.status_code == 429 and "session_idle_s=60" in refused.text  # none idle for 60 s yet
    proxy._touched["a"] -= 100  # a: no request for 100 s; b: an empty session, idle 90 s
    proxy._touched["b"] -= 90
    assert httpx.post(f"{server.url}/sessions", json={"session_id": "c"}).status_code == 200
    assert httpx.post(f"{server.url}/sessions", json={"session_id": "d"}).status_code == 200
    assert sorted(proxy.sessions) == ["c", "d"]
    # a recorded a call: written before it went, marked; b recorded nothing: nothing to write
    [tree] = [json.loads(line) for line in out.read_text().splitlines()]
    assert tree["meta"]["session_id"] == "a" and tree["meta"]["closed_by"] == "idle" and len(tree["nodes"]) == 1
