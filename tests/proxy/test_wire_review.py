"""The three wire protocols agree, and say what happened: a reply cut by the harness's limit
says it was cut, Anthropic's turns merge as Anthropic merges them, prompts can be counted."""

from __future__ import annotations

import httpx
import pytest

ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
USER = [{"role": "user", "content": "Add 2 and 3."}]


def _call_tokens(tokenizer) -> int:
    return len(tokenizer.encode(CALL, add_special_tokens=False))


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_cut_at_the_harness_max_tokens_says_it_was_cut_though_it_holds_a_whole_call(
        mock_policy, serve, tokenizer, stream):
    """The policy writes a whole tool call and goes on until the harness's own ``max_tokens``
    cuts it: OpenAI says ``length``, Anthropic ``max_tokens``, Responses ``incomplete``, as
    their APIs do for any reply that reached the limit; the call is still returned."""
    limit = _call_tokens(tokenizer) + 3  # the call, then 3 tokens of the text after it
    server = serve(mock_policy([CALL + " and then I keep on talking for a long while"]))
    url = server.url

    def sse_lines(r: httpx.Response) -> str:
        assert r.status_code == 200, r.text
        return r.text

    chat = {"model": "m", "messages": USER, "max_tokens": limit, "stream": stream,
            "tools": [{"type": "function", "function": {"name": "add", "parameters": ADD_SCHEMA}}]}
    r = httpx.post(f"{url}/v1/chat/completions", json=chat)
    if stream:
        text = sse_lines(r)
        assert '"finish_reason": "length"' in text and '"tool_calls"' in text
    else:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"]

    msgs = {"model": "m", "messages": USER, "max_tokens": limit, "stream": stream,
            "tools": [{"name": "add", "input_schema": ADD_SCHEMA}]}
    r = httpx.post(f"{url}/v1/messages", json=msgs)
    if stream:
        text = sse_lines(r)
        assert '"stop_reason": "max_tokens"' in text and '"tool_use"' in text
    else:
        body = r.json()
        assert body["stop_reason"] == "max_tokens" and "tool_use" in [b["type"] for b in body["content"]]

    resp = {"model": "m", "input": "Add 2 and 3.", "max_output_tokens": limit, "stream": stream,
            "tools": [{"type": "function", "name": "add", "parameters": ADD_SCHEMA}]}
    r = httpx.post(f"{url}/v1/responses", json=resp)
    if stream:
        text = sse_lines(r)
        assert "event: response.incomplete" in text and '"function_call"' in text
    else:
        body = r.json()
        assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
        assert "function_call" in [i["type"] for i in body["output"]]


def test_a_whole_call_that_ends_the_reply_is_still_a_tool_call(mock_policy, serve, tokenizer):
    """The other side of the cut: a reply that ended by itself, or at a limit the proxy set
    (the harness asked for more), reports its call as a call."""
    server = serve(mock_policy([CALL]))
    chat = {"model": "m", "messages": USER, "max_tokens": 500,
            "tools": [{"type": "function", "function": {"name": "add", "parameters": ADD_SCHEMA}}]}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat).json()["choices"][0][
        "finish_reason"] == "tool_calls"
    cut_by_proxy = serve(mock_policy([CALL + " and then more"]), default_max_tokens=_call_tokens(tokenizer) + 1)
    del chat["max_tokens"]
    assert httpx.post(f"{cut_by_proxy.url}/v1/chat/completions", json=chat).json()["choices"][0][
        "finish_reason"] == "tool_calls"


def _count(url: str, messages: list[dict], **over) -> httpx.Response:
    return httpx.post(f"{url}/v1/messages/count_tokens", json={"model": "m", "messages": messages, **over})


def test_consecutive_same_role_anthropic_turns_are_one_turn(mock_policy, serve):
    """Anthropic joins consecutive user (or assistant) messages into one turn; so does the proxy,
    where it rendered two turns a strict chat template refuses (roles must alternate)."""
    url = serve(mock_policy()).url
    split = [{"role": "user", "content": "Add 2 and 3."}, {"role": "user", "content": [{"type": "text", "text": "Now."}]}]
    joined = [{"role": "user", "content": "Add 2 and 3.\nNow."}]
    assert _count(url, split).json() == _count(url, joined).json()
    use = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"}]}
    tools = [{"name": "add", "input_schema": ADD_SCHEMA}]
    split = [*joined, {"role": "assistant", "content": "Let me add."}, {"role": "assistant", "content": [use]}, result]
    one = [*joined, {"role": "assistant", "content": [{"type": "text", "text": "Let me add."}, use]}, result]
    assert _count(url, split, tools=tools).json() == _count(url, one, tools=tools).json()


def test_two_assistant_messages_at_the_end_are_one_prefill(mock_policy, serve):
    """As Anthropic joins them: the reply continues both, as one assistant turn."""
    seen: list[str] = []
    server = serve(mock_policy(lambda prompt: seen.append(prompt) or " five."))
    messages = [*USER, {"role": "assistant", "content": "Let me see."}, {"role": "assistant", "content": "It is"}]
    r = httpx.post(f"{server.url}/v1/messages", json={"model": "m", "max_tokens": 8, "messages": messages})
    assert r.status_code == 200, r.text
    assert seen[0].endswith("Let me see.\nIt is")
    # with nothing before the joined prefill, it is still refused
    r = httpx.post(f"{server.url}/v1/messages", json={"model": "m", "max_tokens": 8, "messages": [
        {"role": "assistant", "content": ""}, {"role": "assistant", "content": "0"}]})
    assert r.status_code == 400 and "needs a message" in r.json()["error"]["message"]


def test_responses_input_tokens_counts_what_the_call_would_render(mock_policy, serve):
    """``POST /v1/responses/input_tokens`` (OpenAI's count): the tokens the same body's call
    renders, tools and a stored previous response included; it records nothing."""
    server = serve(mock_policy(["Five."]))
    s = httpx.post(f"{server.url}/sessions").json()
    base, headers = s["base_url"], {"Authorization": f"Bearer {s['api_key']}"}
    body = {"model": "m", "instructions": "Be brief.", "input": "Add 2 and 3.",
            "tools": [{"type": "function", "name": "add", "parameters": ADD_SCHEMA}]}
    r = httpx.post(f"{base}/responses/input_tokens", json=body, headers=headers)
    assert r.status_code == 200, r.text
    counted = r.json()
    assert counted["object"] == "response.input_tokens"
    assert httpx.get(f"{server.url}/sessions/{s['session_id']}", headers=headers).json()["calls"] == []
    first = httpx.post(f"{base}/responses", json=body, headers=headers).json()
    assert first["usage"]["input_tokens"] == counted["input_tokens"]
    follow = {"model": "m", "input": "And 3 + 4?", "previous_response_id": first["id"]}
    counted = httpx.post(f"{base}/responses/input_tokens", json=follow, headers=headers).json()["input_tokens"]
    assert httpx.post(f"{base}/responses", json=follow, headers=headers).json()["usage"]["input_tokens"] == counted
    r = httpx.post(f"{server.url}/v1/responses/input_tokens", json={"model": "m"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_with_a_token_a_session_key_samples_and_reads_its_session_but_cannot_score_or_end_it(
        mock_policy, serve):
    """The harness holds its session's key: with it, it may sample and read its own session,
    not set the session's rewards (the outcome training learns from), close it or delete it:
    those take the admin token. Without a token anyone may do all of it, as the harness runner
    (which then sends the session key) does."""
    server = serve(mock_policy(), token="s3cret")
    url, admin = server.url, {"Authorization": "Bearer s3cret"}
    s = httpx.post(f"{url}/sessions", json={}, headers=admin).json()
    key, here = {"x-api-key": s["api_key"]}, f"{url}/sessions/{s['session_id']}"
    assert httpx.post(f"{s['base_url']}/chat/completions", json={"model": "m", "messages": USER},
                      headers=key).status_code == 200
    assert httpx.get(here, headers=key).status_code == 200
    assert httpx.get(f"{here}/tree", headers=key).status_code == 200
    for method, path, body in [("POST", "/reward", {"reward": 1.0}), ("POST", "/close", None), ("DELETE", "", None)]:
        r = httpx.request(method, here + path, json=body, headers=key)
        assert r.status_code == 403 and "admin token" in r.json()["error"]["message"], (path, r.text)
    assert httpx.post(f"{here}/reward", json={"reward": 1.0}, headers=admin).json()["nodes"] == [0]
    assert httpx.post(f"{here}/close", headers=admin).json()["nodes"][0]["reward"] == 1.0
    assert httpx.delete(here, headers=admin).status_code == 200
    open_ = serve(mock_policy())
    s = httpx.post(f"{open_.url}/sessions", json={}).json()
    httpx.post(f"{s['base_url']}/chat/completions", json={"model": "m", "messages": USER}).raise_for_status()
    r = httpx.post(f"{open_.url}/sessions/{s['session_id']}/reward", json={"reward": 1.0},
                   headers={"Authorization": f"Bearer {s['api_key']}"})
    assert r.status_code == 200, r.text


def test_a_reward_after_the_close_is_refused_not_lost(mock_policy, serve, tmp_path):
    """The close wrote the tree to ``out``: a reward posted after it reached no reader, yet was
    answered ok. It is a 409 that says to reward before closing."""
    out = tmp_path / "trees.jsonl"
    server = serve(mock_policy(), out=str(out))
    s = httpx.post(f"{server.url}/sessions").json()
    here = f"{server.url}/sessions/{s['session_id']}"
    httpx.post(f"{s['base_url']}/chat/completions", json={"model": "m", "messages": USER}).raise_for_status()
    httpx.post(f"{here}/close").raise_for_status()
    r = httpx.post(f"{here}/reward", json={"reward": 1.0})
    assert r.status_code == 409 and "closed" in r.json()["error"]["message"], r.text
    assert httpx.get(f"{here}/tree").json()["nodes"][0]["reward"] == 0.0


def test_tools_too_long_for_the_budget_are_refused_before_rendering(mock_policy, serve):
    """6 MB of tool descriptions were rendered and tokenized on the event loop before the
    budget's 400: 18 s here, while every other request (a /health) waited past its timeout.
    The tools' text counts with the messages' in the check made before rendering."""
    server = serve(mock_policy(), max_context_tokens=4096)
    tools = [{"type": "function", "function": {"name": f"t{i}", "description": "word " * 20000}} for i in range(20)]
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"model": "m", "messages": USER, "tools": tools})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "characters of message and tool text" in r.json()["error"]["message"]



def test_a_close_that_fails_mid_write_leaves_no_broken_line_in_out(mock_policy, serve, tmp_path):
    """The disk fills while a tree is written: the close is a 500 and the session stays open,
    to be closed again. The part of the line that was written stayed in ``out``, so the file
    then held a line that is no JSON and read_trees failed on all of it."""
    import resource
    import signal

    from agentrl.types import read_trees

    out = tmp_path / "trees.jsonl"
    server = serve(mock_policy(["word " * 3000] * 2), out=str(out), max_context_tokens=8192, default_max_tokens=4000)
    sids = [httpx.post(f"{server.url}/sessions").json()["session_id"] for _ in range(2)]
    for sid in sids:
        httpx.post(f"{server.url}/sessions/{sid}/v1/chat/completions", json={"model": "m", "messages": USER},
                   timeout=30).raise_for_status()
    httpx.post(f"{server.url}/sessions/{sids[0]}/close").raise_for_status()
    limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:  # the disk fills mid-line: a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (out.stat().st_size + 1000, limits[1]))
        assert httpx.post(f"{server.url}/sessions/{sids[1]}/close").status_code == 500
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    httpx.post(f"{server.url}/sessions/{sids[1]}/close").raise_for_status()  # closed again, as the 500 says
    assert sorted(t.meta["session_id"] for t in read_trees(out)) == sorted(sids)

def test_a_text_prompt_too_long_for_the_budget_is_refused_before_tokenizing(mock_policy, serve):
    """/v1/completions tokenized a 7.5 MB text prompt on the event loop before the budget's
    400: 26 s here, with every other request (a /health) waiting as long."""
    server = serve(mock_policy())
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={"model": "m", "prompt": "word " * 1_500_000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt" and "characters" in r.json()["error"]["message"]


def _flags(tree: dict) -> list[tuple]:
    return [(n["info"].get("abandoned", False), n["info"].get("side_conversation", False),
             n["info"].get("continued_by") is not None, n["truncated"], n["terminated"]) for n in tree["nodes"]]


def test_a_tree_read_mid_session_leaves_no_stale_marks_on_the_final_tree(mock_policy, serve):
    """GET .../tree assembles the tree so far: the main conversation's leaf, seen beside a
    later side conversation (a title call), was marked a side conversation, and kept the mark
    once the harness went on from it. The final tree is the same whether or not it was read."""
    server = serve(mock_policy(["r1", "title", "r2"] * 2))
    main = [{"role": "system", "content": "You help."}, {"role": "user", "content": "u1"}]
    side = [{"role": "system", "content": "Write a title."}, {"role": "user", "content": "u1"}]
    trees = []
    for read_midway in (False, True):
        s = httpx.post(f"{server.url}/sessions").json()
        here = f"{server.url}/sessions/{s['session_id']}"
        for k, messages in enumerate([main, side, [*main, {"role": "assistant", "content": "r1"},
                                                   {"role": "user", "content": "u2"}]]):
            if k == 2 and read_midway:
                httpx.get(f"{here}/tree").raise_for_status()
            httpx.post(f"{s['base_url']}/chat/completions", json={"model": "m", "messages": messages}).raise_for_status()
        httpx.post(f"{here}/reward", json={"reward": 1.0}).raise_for_status()
        trees.append(httpx.post(f"{here}/close").json())
    assert _flags(trees[1]) == _flags(trees[0])
    assert _flags(trees[0])[0] == (False, False, False, False, False)  # the main path's first node


def test_a_session_key_in_x_api_key_opens_beside_another_bearer_token(mock_policy, serve):
    """The anthropic SDK sends both ``x-api-key`` (ANTHROPIC_API_KEY: the runner sets the session
    key) and ``Authorization: Bearer`` (ANTHROPIC_AUTH_TOKEN, inherited from the user's shell)
    where both are set: only the bearer was read, so every call was a 401."""
    server = serve(mock_policy(), token="s3cret")
    s = httpx.post(f"{server.url}/sessions", json={}, headers={"Authorization": "Bearer s3cret"}).json()
    root = f"{server.url}/sessions/{s['session_id']}"
    r = httpx.post(f"{root}/v1/messages", headers={"x-api-key": s["api_key"], "Authorization": "Bearer sk-ant-mine"},
                   json={"model": "m", "max_tokens": 8, "messages": USER})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{root}/v1/messages", headers={"x-api-key": "wrong", "Authorization": "Bearer sk-ant-mine"},
                   json={"model": "m", "max_tokens": 8, "messages": USER})
    assert r.status_code == 401


def test_an_idle_session_dropped_without_out_says_what_was_lost(mock_policy, serve, caplog):
    """Without ``out`` a session closed for want of room is written nowhere: its calls were
    dropped without a word."""
    server = serve(mock_policy(["hi"]), max_sessions=1, session_idle_s=60, generate_timeout_s=30)
    s = httpx.post(f"{server.url}/sessions", json={"session_id": "a"}).json()
    httpx.post(f"{s['base_url']}/chat/completions", json={"model": "m", "messages": USER}).raise_for_status()
    server.app.proxy._touched["a"] -= 100
    with caplog.at_level("WARNING", logger="agentrl.proxy"):
        assert httpx.post(f"{server.url}/sessions", json={"session_id": "b"}).status_code == 200
    assert any("'a'" in r.getMessage() and "1 call" in r.getMessage() and "no out" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
