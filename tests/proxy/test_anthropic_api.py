"""Anthropic Messages (``POST /v1/messages``, ``/v1/messages/count_tokens``) through HTTP: blocks
in, blocks out, streamed events, auth headers, errors in Anthropic's shape, and the session tree."""

from __future__ import annotations

import json

import httpx
import pytest

from agentrl.types import RolloutTree

anthropic = pytest.importorskip("anthropic", reason="the Messages tests drive the proxy with the anthropic client")

ADD = {"name": "add", "description": "Add two integers.",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
ADD_CALL = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
TWO_CALLS = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
TOOL_TURN = "<|im_start|>tool\n"  # how the SmolLM2 template opens a tool message
USER = [{"role": "user", "content": "Add 2 and 3."}]


def _render(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _recording(seen: list[str], reply):
    """A MockPolicy script: keeps each prompt, answers ``reply`` (a text or a function of the prompt)."""
    def respond(prompt: str) -> str:
        seen.append(prompt)
        return reply(prompt) if callable(reply) else reply
    return respond


def _adds_then_answers(prompt: str) -> str:
    return "The sum is 5." if TOOL_TURN in prompt else ADD_CALL


def _session(url: str, headers: dict | None = None) -> tuple[str, str]:
    data = httpx.post(f"{url}/sessions", json={}, headers=headers).raise_for_status().json()
    return data["session_id"], data["api_key"]


def _client(url: str, key: str = "unused", sid: str | None = None) -> anthropic.Anthropic:
    """The anthropic client posts to ``{base_url}/v1/messages``: a session's base is ``/sessions/{id}``."""
    base = f"{url}/sessions/{sid}" if sid else url
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)


def _post(url: str, body: dict, sid: str | None = None, path: str = "messages", **kw) -> httpx.Response:
    prefix = f"/sessions/{sid}" if sid else ""
    return httpx.post(f"{url}{prefix}/v1/{path}", json=body, **kw)


def _body(**over) -> dict:
    return {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": USER, **over}


def _tree(url: str, sid: str) -> RolloutTree:
    return RolloutTree.from_dict(httpx.get(f"{url}/sessions/{sid}/tree").raise_for_status().json())


def _closed(url: str, sid: str) -> RolloutTree:
    return RolloutTree.from_dict(httpx.post(f"{url}/sessions/{sid}/close").raise_for_status().json())


def _node_of(tree: RolloutTree, call_id: str):
    [node] = [n for n in tree.nodes.values() if n.info["call_id"] == call_id]
    return node


def _sse(text: str) -> list[tuple[str, dict]]:
    """(event name, data) per server-sent event; every event has its ``event:`` line."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        out.append((lines[0][7:], json.loads(lines[1][6:])))
    return out


def _kinds(events: list[tuple[str, dict]]) -> list[str]:
    """Event names (text deltas as ``text_delta``, JSON ones as ``input_json_delta``), runs collapsed."""
    out: list[str] = []
    for name, data in events:
        kind = data["delta"]["type"] if name == "content_block_delta" else name
        if not (kind == "text_delta" and out and out[-1] == kind):
            out.append(kind)
    return out


def _anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert body["error"]["type"] == kind and isinstance(body["error"]["message"], str)
    return body["error"]["message"]


# -- the request ------------------------------------------------------------------------------
@pytest.mark.parametrize("system", ["Be brief.\nUse tools.", [
    {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]])
def test_system_string_or_text_blocks_is_the_first_message(mock_policy, serve, tokenizer, system):
    seen: list[str] = []
    server = serve(mock_policy(_recording(seen, "Hello there!")))
    out = _client(server.url).messages.create(model="claude-x", max_tokens=32, system=system,
                                              messages=[{"role": "user", "content": "hi"}])
    prompt = _render(tokenizer, [{"role": "system", "content": "Be brief.\nUse tools."},
                                 {"role": "user", "content": "hi"}])
    assert seen == [prompt]
    assert out.id.startswith("msg_") and out.type == "message" and out.role == "assistant"
    assert out.model == "claude-x" and [b.type for b in out.content] == ["text"]
    assert out.content[0].text == "Hello there!" and out.stop_reason == "end_turn" and out.stop_sequence is None
    assert out.usage.input_tokens == _tokens(tokenizer, prompt) and out.usage.cache_read_input_tokens == 0
    assert out.usage.output_tokens == _tokens(tokenizer, "Hello there!") + 1  # and the EOS


def test_blocks_become_the_conversation_and_thinking_is_dropped_and_counted(mock_policy, serve, tokenizer):
    seen: list[str] = []
    server = serve(mock_policy(_recording(seen, "ok")))
    sid, _ = _session(server.url)
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "What is 2+3"}, {"type": "text", "text": "and 4+5?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "secret plan", "signature": "sig"},
            {"type": "text", "text": "Let me add."},
            {"type": "tool_use", "id": "toolu_a", "name": "add", "input": {"a": 2, "b": 3}},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "tool_use", "id": "toolu_b", "name": "add", "input": {"a": 4, "b": 5}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a", "content": "5"},
            {"type": "tool_result", "tool_use_id": "toolu_b", "is_error": False,
             "content": [{"type": "text", "text": "nine"}, {"type": "text", "text": "(9)"}]},
            {"type": "text", "text": "Sum them.", "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "Reminder: be exact."},
        {"role": "assistant", "content": "14"},
        {"role": "user", "content": "Thanks."},
    ]
    r = _post(server.url, _body(system="S", messages=messages,
                                thinking={"type": "enabled", "budget_tokens": 2048}), sid)
    assert r.status_code == 200, r.text
    expected = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "What is 2+3\nand 4+5?"},
        {"role": "assistant", "content": 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
                                         '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n'
                                         "</tool_call>"},
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "nine\n(9)"},
        {"role": "user", "content": "Sum them."},
        {"role": "system", "content": "Reminder: be exact."},  # stays where it was sent
        {"role": "assistant", "content": "14"},
        {"role": "user", "content": "Thanks."},
    ]
    assert seen == [_render(tokenizer, expected)]
    assert "secret plan" not in seen[0] and "opaque" not in seen[0]
    assert _closed(server.url, sid).meta["ignored"] == {"thinking": 1, "thinking_block": 1,
                                                        "redacted_thinking_block": 1}


def test_disabled_thinking_is_not_counted(mock_policy, serve):
    server = serve(mock_policy())
    sid, _ = _session(server.url)
    assert _post(server.url, _body(thinking={"type": "disabled"}), sid).status_code == 200
    assert _closed(server.url, sid).meta["ignored"] == {}


def test_server_tools_are_not_offered_and_are_counted(mock_policy, serve):
    seen: list[str] = []
    server = serve(mock_policy(_recording(seen, ADD_CALL)))
    sid, _ = _session(server.url)
    tools = [ADD, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
             {"type": "custom", "name": "echo", "input_schema": {"type": "object"}}]
    out = _post(server.url, _body(tools=tools), sid).json()
    assert [b["type"] for b in out["content"]] == ["text", "tool_use"]
    assert '"name": "add"' in seen[0] and '"name": "echo"' in seen[0] and "web_search" not in seen[0]
    _post(server.url, _body(tools=tools), sid)
    assert _closed(server.url, sid).meta["ignored"] == {"server_tool:web_search_20250305": 2}


def test_tool_choice_any_over_server_tools_alone_is_counted_not_dropped_silently(mock_policy, serve):
    server = serve(mock_policy(["Searched."]))
    sid, _ = _session(server.url)
    search = {"type": "web_search_20250305", "name": "web_search"}
    out = _post(server.url, _body(tools=[search], tool_choice={"type": "any"}), sid).json()
    assert out["content"] == [{"type": "text", "text": "Searched."}]  # nothing of its own to call
    assert _closed(server.url, sid).meta["ignored"] == {"server_tool:web_search_20250305": 1, "tool_choice:any": 1}


# -- tool calls and their ids ---------------------------------------------------------------
def test_tool_use_ids_round_trip_reuses_the_recorded_tokens(mock_policy, serve, tokenizer):
    server = serve(mock_policy(_adds_then_answers))
    sid, key = _session(server.url)
    client = _client(server.url, key, sid)
    first = client.messages.create(model="claude-x", max_tokens=100, system="Use tools.", messages=USER, tools=[ADD])
    text, call = first.content
    assert first.stop_reason == "tool_use" and text.text == "Let me add."
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "add"
    assert call.input == {"a": 2, "b": 3}
    second = client.messages.create(model="claude-x", max_tokens=100, system="Use tools.", tools=[ADD], messages=[
        *USER, {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "5"}]}])
    assert second.content[0].text == "The sum is 5." and second.stop_reason == "end_turn"
    tree = _tree(server.url, sid)
    a, b = _node_of(tree, first.id), _node_of(tree, second.id)
    assert b.parent == a.id and "branch" not in b.info
    assert tokenizer.decode(b.context_ids) == f"\n{TOOL_TURN}5<|im_end|>\n<|im_start|>assistant\n"
    recorded = len(a.context_ids) + len(a.action_ids)
    assert second.usage.cache_read_input_tokens == recorded
    assert second.usage.input_tokens == len(b.context_ids)  # input + cache read == the whole prompt
    # the harness drops the text and reorders the input's keys: the id alone still names the reply
    third = client.messages.create(model="claude-x", max_tokens=100, system="Use tools.", tools=[ADD], messages=[
        *USER, {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": "add",
                                                  "input": {"b": 3, "a": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "5"}]}]}])
    c = _node_of(_tree(server.url, sid), third.id)
    assert c.parent == a.id and c.context_ids == b.context_ids and c.info["branch"]["reason"] == "retry"


def test_a_tool_use_id_the_proxy_did_not_issue_is_not_its_reply(mock_policy, serve):
    server = serve(mock_policy(_adds_then_answers))
    sid, _ = _session(server.url)
    _post(server.url, _body(tools=[ADD]), sid)
    second = _post(server.url, _body(tools=[ADD], messages=[
        *USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_made_up", "name": "add",
                                                  "input": {"b": 3, "a": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_made_up", "content": "5"}]}]),
        sid).json()
    assert _node_of(_tree(server.url, sid), second["id"]).parent is None  # rendered whole: a new root
    assert second["usage"]["cache_read_input_tokens"] == 0


@pytest.mark.parametrize(("choice", "hint", "blocks"), [
    (None, None, ["tool_use", "tool_use"]),
    ({"type": "auto"}, None, ["tool_use", "tool_use"]),
    ({"type": "any"}, "You must call at least one tool in this reply.", ["tool_use", "tool_use"]),
    ({"type": "tool", "name": "add"}, "You must call the tool 'add' in this reply.", ["tool_use", "tool_use"]),
    ({"type": "none"}, None, ["text"]),
    ({"type": "auto", "disable_parallel_tool_use": True}, "Call at most one tool in this reply.", ["tool_use"]),
    ({"type": "any", "disable_parallel_tool_use": True}, "Call at most one tool in this reply.", ["tool_use"]),
])
def test_tool_choice_and_disable_parallel_tool_use(mock_policy, serve, choice, hint, blocks):
    seen: list[str] = []
    server = serve(mock_policy(_recording(seen, TWO_CALLS)))
    body = _body(tools=[ADD], max_tokens=200, **({"tool_choice": choice} if choice else {}))
    out = _post(server.url, body).json()
    assert [b["type"] for b in out["content"]] == blocks
    if blocks[0] == "tool_use":
        assert [b["input"] for b in out["content"]] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}][:len(blocks)]
        assert out["stop_reason"] == "tool_use"
    else:  # not parsed: the calls stay in the text
        assert out["content"][0]["text"] == TWO_CALLS and out["stop_reason"] == "end_turn"
    hints = ("You must call", "Call at most one tool")
    assert any(h in seen[0] for h in hints) == (hint is not None)
    if hint is not None:
        assert hint in seen[0]


# -- the reply --------------------------------------------------------------------------------
def test_stop_reasons(mock_policy, serve, tokenizer):
    server = serve(mock_policy(lambda p: ADD_CALL if "Add" in p else "alpha END beta STOP gamma"))
    client = _client(server.url)
    plain = client.messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    assert (plain.stop_reason, plain.stop_sequence) == ("end_turn", None)
    assert plain.content[0].text == "alpha END beta STOP gamma"
    tool = client.messages.create(model="m", max_tokens=64, messages=USER, tools=[ADD])
    assert (tool.stop_reason, tool.stop_sequence) == ("tool_use", None)
    cut = client.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 2)
    ids = tokenizer.encode("alpha END beta STOP gamma", add_special_tokens=False)
    assert cut.content[0].text == tokenizer.decode(ids[:2])
    stopped = client.messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}],
                                     stop_sequences=["STOP", "END"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "END")
    assert stopped.content[0].text == "alpha "
    unmet = client.messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}],
                                   stop_sequences=["OMEGA"])
    assert (unmet.stop_reason, unmet.stop_sequence) == ("end_turn", None)


def test_streamed_text_reply_events_in_order(mock_policy, serve, tokenizer):
    text = "Hello there, streaming friend!"
    server = serve(mock_policy([text]))
    r = _post(server.url, _body(stream=True))
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _sse(r.text)
    assert all(name == data["type"] for name, data in events)
    assert _kinds(events) == ["message_start", "content_block_start", "text_delta", "content_block_stop",
                              "message_delta", "message_stop"]
    deltas = [d["delta"]["text"] for n, d in events if n == "content_block_delta"]
    assert len(deltas) > 1 and "".join(deltas) == text
    data = dict(events)
    start = data["message_start"]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert data["content_block_start"] == {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "text", "text": ""}}
    end = data["message_delta"]
    assert end["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == _tokens(tokenizer, text) + 1
    assert end["usage"]["input_tokens"] == start["usage"]["input_tokens"] > 0


def test_streamed_tool_use_reply_events_in_order(mock_policy, serve):
    server = serve(mock_policy([ADD_CALL]))
    events = _sse(_post(server.url, _body(tools=[ADD], stream=True)).text)
    assert _kinds(events) == ["message_start",
                              "content_block_start", "text_delta", "content_block_stop",
                              "content_block_start", "input_json_delta", "content_block_stop",
                              "message_delta", "message_stop"]
    starts = [d for n, d in events if n == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [(0, "text"), (1, "tool_use")]
    tool = starts[1]["content_block"]
    assert tool["id"].startswith("toolu_") and tool["name"] == "add" and tool["input"] == {}
    [js] = [d for n, d in events if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert js["index"] == 1 and json.loads(js["delta"]["partial_json"]) == {"a": 2, "b": 3}
    assert [d["index"] for n, d in events if n == "content_block_stop"] == [0, 1]
    assert dict(events)["message_delta"]["delta"]["stop_reason"] == "tool_use"


def test_client_stream_matches_the_whole_reply(mock_policy, serve):
    server = serve(mock_policy([ADD_CALL]))
    client = _client(server.url)
    whole = client.messages.create(model="m", max_tokens=100, messages=USER, tools=[ADD])
    with client.messages.stream(model="m", max_tokens=100, messages=USER, tools=[ADD]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Let me add." and final.stop_reason == whole.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [
        (b.type, getattr(b, "input", None)) for b in whole.content]
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequence_in_a_stream(mock_policy, serve):
    server = serve(mock_policy(["alpha END beta"]))
    with _client(server.url).messages.stream(model="m", max_tokens=64, messages=USER,
                                             stop_sequences=["END"]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "alpha " and (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")


def test_live_stream_on_the_tiny_model_spells_the_reply(hf_server):
    client = _client(hf_server.url)
    kw = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi."}],
          "extra_body": {"temperature": 0}}  # greedy; this client no longer has the argument
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


# -- auth, count_tokens, errors ------------------------------------------------------------
def test_auth_by_x_api_key_or_bearer(mock_policy, serve):
    server = serve(mock_policy(), token="s3cret")
    versions = {"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"}
    assert _post(server.url, _body(), headers={"x-api-key": "s3cret", **versions}).status_code == 200
    assert _post(server.url, _body(), headers={"Authorization": "Bearer s3cret"}).status_code == 200
    for headers in ({}, {"x-api-key": "wrong", **versions}, {"Authorization": "Bearer wrong"}):
        msg = _anthropic_error(_post(server.url, _body(), headers=headers), 401, "authentication_error")
        assert "token" in msg
    sid_a, key_a = _session(server.url, {"Authorization": "Bearer s3cret"})
    sid_b, _ = _session(server.url, {"Authorization": "Bearer s3cret"})
    assert _post(server.url, _body(), sid_a, headers={"x-api-key": key_a}).status_code == 200
    out = _client(server.url, key_a, sid_a).messages.create(model="m", max_tokens=16, messages=USER)
    assert out.content[0].text == "Hello there!"
    msg = _anthropic_error(_post(server.url, _body(), sid_b, headers={"x-api-key": key_a}), 403, "permission_error")
    assert "another session" in msg
    with pytest.raises(anthropic.AuthenticationError):
        _client(server.url, "wrong").messages.create(model="m", max_tokens=16, messages=USER)
    def recorded(sid: str) -> int:
        return len(httpx.get(f"{server.url}/sessions/{sid}/tree", headers={"Authorization": "Bearer s3cret"})
                   .raise_for_status().json()["nodes"])

    assert (recorded(sid_a), recorded(sid_b)) == (2, 0)


def test_count_tokens_is_the_full_render_and_records_nothing(mock_policy, serve, tokenizer):
    server = serve(mock_policy(_adds_then_answers))
    sid, key = _session(server.url)
    client = _client(server.url, key, sid)
    messages = [*USER, {"role": "assistant", "content": [{"type": "text", "text": "Let me add."}]},
                {"role": "user", "content": "Please."}]
    counted = client.messages.count_tokens(model="m", system="S", messages=messages)
    rendered = _render(tokenizer, [{"role": "system", "content": "S"}, *USER,
                                   {"role": "assistant", "content": "Let me add."}, messages[2]])
    assert counted.input_tokens == _tokens(tokenizer, rendered)
    tools = [ADD, {"type": "web_search_20250305", "name": "web_search"}]
    r = _post(server.url, _body(system="S", messages=messages, tools=tools,
                                thinking={"type": "enabled", "budget_tokens": 1024}), sid, "messages/count_tokens")
    with_tools = r.json()["input_tokens"]
    assert with_tools > counted.input_tokens  # the tools' description is part of the render
    tree = _tree(server.url, sid)
    assert not tree.nodes and tree.meta["ignored"] == {} and tree.meta["calls"] == 0
    # the same body sampled on a fresh session: input tokens (no cache yet) are what count_tokens said
    out = _post(server.url, _body(system="S", messages=messages, tools=[ADD]), _session(server.url)[0]).json()
    assert (out["usage"]["input_tokens"], out["usage"]["cache_read_input_tokens"]) == (with_tools, 0)


@pytest.mark.parametrize(("body", "names"), [
    ({"model": "m", "messages": USER}, "max_tokens"),
    (_body(max_tokens=0), "max_tokens"),
    (_body(messages=[]), "messages"),
    (_body(messages=[{"role": "robot", "content": "x"}]), "messages.0.role"),
    (_body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]),
     "messages.0.content.1.type"),
    (_body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}]),
     "messages.0.content.0.content.0.type"),
    (_body(messages=[*USER, {"role": "assistant", "content": [{"type": "server_tool_use", "id": "s"}]}]),
     "messages.1.content.0.type"),
    (_body(messages=[*USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {}}]}]),
     "messages.1.content.0"),
    (_body(messages=[*USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "add",
                                                               "input": [1, 2]}]}]), "messages.1.content.0"),
    (_body(system=[{"type": "image", "source": {}}]), "system.0.type"),
    (_body(tools=[ADD], tool_choice={"type": "tool"}), "tool_choice.name"),
    (_body(tool_choice={"type": "sometimes"}), "tool_choice"),
    (_body(tools=[{"name": "", "input_schema": {}}]), "tools.0.name"),
    (_body(stop_sequences=["", "x"]), "stop_sequences"),
    (_body(temperature=3), "temperature"),
    (_body(top_k=-1), "top_k"),
])
def test_bad_bodies_get_anthropic_errors_naming_the_field(mock_policy, serve, body, names):
    server = serve(mock_policy())
    sid, _ = _session(server.url)
    msg = _anthropic_error(_post(server.url, body, sid), 400, "invalid_request_error")
    assert names in msg, msg
    assert not _tree(server.url, sid).nodes
    assert _post(server.url, _body(), sid).status_code == 200


def test_image_blocks_are_refused_by_the_client_too(mock_policy, serve):
    server = serve(mock_policy())
    with pytest.raises(anthropic.BadRequestError) as e:
        _client(server.url).messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0.type" in e.value.body["error"]["message"] and "image" in e.value.message


def test_transport_errors_are_in_anthropic_shape(mock_policy, serve):
    server = serve(mock_policy(), max_request_bytes=2048, max_context_tokens=256)
    big = _body(messages=[{"role": "user", "content": "x" * 4096}])
    for path in ("messages", "messages/count_tokens"):
        assert "2048" in _anthropic_error(_post(server.url, big, path=path), 413, "request_too_large")
        assert "nope" in _anthropic_error(_post(server.url, _body(), "nope", path), 404, "not_found_error")
        r = httpx.post(f"{server.url}/v1/{path}", content=b'{"model": "m", "max_tokens": ',
                       headers={"content-type": "application/json"})
        assert "JSON" in _anthropic_error(r, 400, "invalid_request_error")
    # a body sent without a declared length is counted as it arrives
    chunked = httpx.post(f"{server.url}/v1/messages", content=iter([json.dumps(big).encode()]))
    _anthropic_error(chunked, 413, "request_too_large")
    long = _body(messages=[{"role": "user", "content": "word " * 300}])
    assert "context budget" in _anthropic_error(_post(server.url, long), 400, "invalid_request_error")
    sid, _ = _session(server.url)
    httpx.post(f"{server.url}/sessions/{sid}/close").raise_for_status()
    assert "closed" in _anthropic_error(_post(server.url, _body(), sid), 409, "invalid_request_error")
    assert _post(server.url, _body()).status_code == 200


# -- bugs ---------------------------------------------------------------------------------------
def _strict_json(text: str):
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("stream", [False, True])
def test_a_sampled_tool_call_with_nan_arguments_is_answered_in_json(mock_policy, serve, stream):
    server = serve(mock_policy(['<tool_call>\n{"name": "add", "arguments": {"a": NaN, "b": 1}}\n</tool_call>']))
    sid, _ = _session(server.url)
    r = _post(server.url, _body(tools=[ADD], stream=stream), sid)
    assert r.status_code == 200, r.text
    if stream:
        for _, data in _sse(r.text):
            if data["type"] == "content_block_delta" and data["delta"]["type"] == "input_json_delta":
                _strict_json(data["delta"]["partial_json"])
    else:
        _strict_json(r.text)


@pytest.mark.parametrize("fields", [
    {"output_config": {"effort": "high", "format": {"type": "json_schema", "schema": {"type": "object"}}}},
    {"output_format": {"type": "json_schema", "schema": {"type": "object"}}},
])
def test_structured_outputs_are_served_free_and_counted_as_ignored(mock_policy, serve, fields):
    """Claude Code asks for its session title with output_config.format: refused with a 400,
    one of its calls failed (and was missing from the tree). The proxy does not constrain
    decoding to a schema; it says so in meta["ignored"]."""
    server = serve(mock_policy())
    sid, _ = _session(server.url)
    r = _post(server.url, _body(**fields), sid)
    assert r.status_code == 200 and r.json()["content"][0]["text"] == "Hello there!", r.text
    tree = _closed(server.url, sid)
    assert len(tree.nodes) == 1 and tree.meta["ignored"] == {"structured_output": 1}


def test_output_config_without_a_format_is_served(mock_policy, serve):
    server = serve(mock_policy())
    for config in ({"effort": "high"}, {"format": None}, {}):
        r = _post(server.url, _body(output_config=config))
        assert r.status_code == 200 and r.json()["content"][0]["text"] == "Hello there!", r.text
