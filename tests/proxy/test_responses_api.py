"""OpenAI Responses (``POST /v1/responses``) through HTTP: items in, items out, streamed events,
``previous_response_id``, and the session tree each call records."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from agentrl.types import RolloutTree

openai = pytest.importorskip("openai", reason="the Responses tests drive the proxy with the openai client")

ADD = {"type": "function", "name": "add", "description": "Add two integers.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
ADD_CALL = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
TOOL_TURN = "<|im_start|>tool\n"  # how the SmolLM2 template opens a tool message


def _render(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _reply_tokens(tokenizer, text: str) -> int:
    return _tokens(tokenizer, text) + 1  # the MockPolicy ends every reply with EOS


def _recording(seen: list[str], reply):
    """A MockPolicy script: keeps each prompt, answers ``reply`` (a text or a function of the prompt)."""
    def respond(prompt: str) -> str:
        seen.append(prompt)
        return reply(prompt) if callable(reply) else reply
    return respond


def _adds_then_answers(prompt: str) -> str:
    return "The sum is 5." if TOOL_TURN in prompt else ADD_CALL


def _session(url: str) -> tuple[str, str, str]:
    data = httpx.post(f"{url}/sessions", json={}).raise_for_status().json()
    return data["session_id"], data["api_key"], data["base_url"]


def _client(base_url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)


def _tree(url: str, sid: str) -> RolloutTree:
    return RolloutTree.from_dict(httpx.get(f"{url}/sessions/{sid}/tree").raise_for_status().json())


def _closed(url: str, sid: str) -> RolloutTree:
    return RolloutTree.from_dict(httpx.post(f"{url}/sessions/{sid}/close").raise_for_status().json())


def _node_of(tree: RolloutTree, call_id: str):
    [node] = [n for n in tree.nodes.values() if n.info["call_id"] == call_id]
    return node


def _sse(text: str) -> list[tuple[str, dict]]:
    """(event name, data) per server-sent event."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        out.append((lines[0][7:], json.loads(lines[1][6:])))
    return out


def _kinds(events: list[tuple[str, dict]]) -> list[str]:
    """Event names, runs of deltas collapsed to one, so an order can be written out."""
    out: list[str] = []
    for name, _ in events:
        if not (name.endswith(".delta") and out and out[-1] == name):
            out.append(name)
    return out


def _post(url: str, body: dict, sid: str | None = None) -> httpx.Response:
    prefix = f"/sessions/{sid}" if sid else ""
    return httpx.post(f"{url}{prefix}/v1/responses", json=body)


# -- input --------------------------------------------------------------------------------
def test_string_input_is_one_user_message_after_the_instructions(mock_policy, serve, tokenizer):
    seen: list[str] = []
    server = serve(mock_policy(_recording(seen, "Hello there!")))
    out = _client(f"{server.url}/v1").responses.create(model="gpt-5-codex", input="Say hi.",
                                                       instructions="Be brief.")
    prompt = _render(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}])
    assert seen == [prompt]
    assert out.id.startswith("resp_") and out.object == "response" and out.status == "completed"
    assert out.model == "gpt-5-codex" and out.instructions == "Be brief."
    [msg] = out.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert out.output_text == "Hello there!"
    n_in, n_out = _tokens(tokenizer, prompt), _reply_tokens(tokenizer, "Hello there!")
    assert (out.usage.input_tokens, out.usage.output_tokens, out.usage.total_tokens) == (n_in, n_out, n_in + n_out)
    assert out.usage.input_tokens_details.cached_tokens == 0


def test_items_become_the_conversation_in_order(mock_policy, serve, tokenizer):
    seen: list[str] = []
    server = serve(mock_policy(_recording(seen, "ok")))
    sid, _, _ = _session(server.url)
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules "},
                                                             {"type": "input_text", "text": "apply."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "What is "},
                                     {"type": "input_text", "text": "2+3?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]},
        {"type": "function_call", "call_id": "call_a", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "5"},
        {"type": "custom_tool_call", "call_id": "call_p", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "call_p", "output": [{"type": "input_text", "text": "done"}]},
        {"type": "reasoning", "id": "rs_2", "summary": []},
        {"role": "user", "content": "thanks"},
    ]
    r = _post(server.url, {"model": "m", "input": items}, sid)
    assert r.status_code == 200, r.text
    expected = [
        {"role": "system", "content": "Rules apply."},
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}'
                                         "\n</tool_call>"},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "apply_patch", "arguments": {"input": '
                                         '"*** Begin Patch"}}\n</tool_call>'},
        {"role": "tool", "content": "done"},
        {"role": "user", "content": "thanks"},
    ]
    assert seen == [_render(tokenizer, expected)]
    assert "developer" not in seen[0] and "opaque" not in seen[0]
    assert _closed(server.url, sid).meta["ignored"] == {"reasoning_item": 2}


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "look"},
                                             {"type": "input_image", "image_url": "data:,"}]}]},
     "input.0.content.1.type"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "computer_call", "call_id": "c"}]}, "input.1.type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "name": "add", "arguments": "{}"}]}, "input.0"),
    ({"input": [{"type": "function_call_output", "output": "5"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]},
     "input.0.output.0.type"),
    ({"input": []}, "input"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"input": "x", "tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "x", "tools": [ADD], "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, "tools.0.name"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "fs", "tools": [{"type": "custom"}]}]},
     "tools.0.tools.0.name"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 2.5}, "temperature"),
    ({"model": "m"}, "input"),
])
def test_unsupported_input_is_refused_naming_the_field(mock_policy, serve, body, param):
    server = serve(mock_policy())
    sid, _, _ = _session(server.url)
    r = _post(server.url, body, sid)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"
    assert not _tree(server.url, sid).nodes  # nothing recorded
    assert _post(server.url, {"input": "hi"}, sid).status_code == 200


# -- previous_response_id -----------------------------------------------------------------
def test_instructions_are_not_carried_over_by_previous_response_id(mock_policy, serve, tokenizer):
    seen: list[str] = []
    server = serve(mock_policy(_recording(seen, "Bonjour.")))
    client = _client(f"{server.url}/v1")
    first = client.responses.create(model="m", input="hi", instructions="Answer in French.")
    client.responses.create(model="m", input="again", previous_response_id=first.id)
    assert "Answer in French." in seen[0] and "Answer in French." not in seen[1]
    assert seen[1] == _render(tokenizer, [{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": "Bonjour."},
                                          {"role": "user", "content": "again"}])


def test_previous_response_id_continues_the_recorded_reply(mock_policy, serve, tokenizer):
    server = serve(mock_policy(_adds_then_answers))
    sid, key, base = _session(server.url)
    client = _client(base, key)
    first = client.responses.create(model="m", input="Add 2 and 3.", instructions="Use tools.", tools=[ADD])
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3}
    second = client.responses.create(model="m", instructions="Use tools.", tools=[ADD], previous_response_id=first.id,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert second.output_text == "The sum is 5." and second.previous_response_id == first.id
    third = client.responses.create(model="m", instructions="Use tools.", tools=[ADD], previous_response_id=second.id,
                                    input="Thanks.")
    tree = _tree(server.url, sid)
    a, b, c = (_node_of(tree, r.id) for r in (first, second, third))
    assert (a.parent, b.parent, c.parent) == (None, a.id, b.id)
    assert tokenizer.decode(b.context_ids) == f"\n{TOOL_TURN}5<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(c.context_ids) == "\n<|im_start|>user\nThanks.<|im_end|>\n<|im_start|>assistant\n"
    assert len(list(tree.episodes())) == 1
    # what the earlier calls recorded is reused, not re-rendered: usage says so
    recorded = len(a.context_ids) + len(a.action_ids)
    assert second.usage.input_tokens_details.cached_tokens == recorded
    assert second.usage.input_tokens == recorded + len(b.context_ids)


def test_previous_response_id_is_refused_unless_stored_in_this_session(mock_policy, serve):
    server = serve(mock_policy(), max_stored_responses=3)
    sid_a, key_a, base_a = _session(server.url)
    sid_b, _, _ = _session(server.url)
    client = _client(base_a, key_a)
    kept = client.responses.create(model="m", input="hi")
    unstored = client.responses.create(model="m", input="hi", store=False)
    assert unstored.store is False
    plain = _post(server.url, {"input": "hi"}).json()["id"]  # no session

    def refused(prev: str, sid: str | None) -> None:
        r = _post(server.url, {"input": "more", "previous_response_id": prev}, sid)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "previous_response_id" and prev in r.json()["error"]["message"]

    refused("resp_nope", sid_a)
    refused(unstored.id, sid_a)
    refused(kept.id, sid_b)  # another session's
    refused(kept.id, None)  # a session's, named without one
    refused(plain, sid_a)  # one made without a session, named in one
    assert _post(server.url, {"input": "more", "previous_response_id": plain}).status_code == 200
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="x", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"
    # the store keeps the newest max_stored_responses (3: kept, plain, and plain's continuation);
    # continuing `kept` stores a fourth, which pushes the oldest, `kept` itself, out
    assert _post(server.url, {"input": "more", "previous_response_id": kept.id}, sid_a).status_code == 200
    refused(kept.id, sid_a)
    assert len(_tree(server.url, sid_b).nodes) == 0


def test_a_closed_or_dropped_sessions_stored_responses_are_freed(mock_policy, serve):
    """A closed session takes no more calls, so what it stored for ``previous_response_id`` is
    memory no one can use: a training run closes thousands of sessions, and the store held the
    last max_stored_responses of them (each a whole conversation) until pushed out."""
    server = serve(mock_policy())
    store = server.app.proxy.responses
    sids = []
    for _ in range(3):
        sid, key, base = _session(server.url)
        sids.append(sid)
        first = _client(base, key).responses.create(model="m", input="hi")
        _client(base, key).responses.create(model="m", input="more", previous_response_id=first.id)
    plain = _post(server.url, {"input": "hi"}).json()["id"]  # no session: kept
    assert len(store) == 7
    _closed(server.url, sids[0])
    httpx.delete(f"{server.url}/sessions/{sids[1]}").raise_for_status()
    assert {s.owner for s in store.values()} == {sids[2], None} and len(store) == 3 and plain in store


# -- tools ----------------------------------------------------------------------------------
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
THREE_CALLS = ("Working.\n"
               '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
               f"<tool_call>\n{json.dumps({'name': 'apply_patch', 'arguments': {'input': PATCH}})}\n</tool_call>\n"
               '<tool_call>\n{"name": "read", "arguments": {"path": "a.txt"}}\n</tool_call>')
CODEX_TOOLS = [ADD,
               {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
                "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
               {"type": "namespace", "name": "fs", "description": "Files.", "tools": [
                   {"type": "function", "name": "read", "description": "Read a file.",
                    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]},
               {"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]}]


def test_function_custom_and_namespace_tools_are_offered_and_called(mock_policy, serve):
    seen: list[str] = []
    server = serve(mock_policy(_recording(seen, THREE_CALLS)))
    sid, _, _ = _session(server.url)
    r = _post(server.url, {"model": "m", "input": "Do it.", "tools": CODEX_TOOLS}, sid)
    assert r.status_code == 200, r.text
    out = r.json()
    message, add, patch, read = out["output"]
    assert message["content"][0]["text"] == "Working."
    assert add == {"type": "function_call", "id": add["id"], "call_id": add["call_id"], "name": "add",
                   "arguments": '{"a": 1, "b": 2}', "status": "completed"}  # no namespace key
    assert patch == {"type": "custom_tool_call", "id": patch["id"], "call_id": patch["call_id"],
                     "name": "apply_patch", "input": PATCH, "status": "completed"}
    assert read["type"] == "function_call" and read["name"] == "read" and read["namespace"] == "fs"
    assert json.loads(read["arguments"]) == {"path": "a.txt"}
    ids = [i["call_id"] for i in (add, patch, read)]
    assert len(set(ids)) == 3 and all(i.startswith("call_") for i in ids)
    assert add["id"].startswith("fc_") and patch["id"].startswith("ctc_")
    # offered: the function, the custom tool as one string argument, the namespace's tool; no hosted tool
    assert '"name": "add"' in seen[0] and '"name": "apply_patch"' in seen[0] and '"name": "read"' in seen[0]
    assert '"input": {"type": "string"' in seen[0]
    assert "web_search" not in seen[0] and "file_search" not in seen[0]
    _post(server.url, {"model": "m", "input": "Again.", "tools": CODEX_TOOLS[3:] + [ADD]}, sid)
    assert _closed(server.url, sid).meta["ignored"] == {"hosted_tool:web_search": 2, "hosted_tool:file_search": 2}


def test_tool_choice_required_over_hosted_tools_alone_is_counted_not_dropped_silently(mock_policy, serve):
    server = serve(mock_policy(["Searched."]))
    sid = _session(server.url)[0]
    out = _post(server.url, {"model": "m", "input": "Look.", "tools": [{"type": "web_search"}],
                             "tool_choice": "required"}, sid).json()
    assert [i["type"] for i in out["output"]] == ["message"]  # nothing of its own to call
    assert _closed(server.url, sid).meta["ignored"] == {"hosted_tool:web_search": 1, "tool_choice:required": 1}


def test_custom_tool_call_streams_its_input(mock_policy, serve):
    server = serve(mock_policy([f"<tool_call>\n{json.dumps({'name': 'apply_patch', 'arguments': {'input': PATCH}})}"
                                "\n</tool_call>"]))
    r = _post(server.url, {"input": "Patch it.", "tools": CODEX_TOOLS[1:2], "stream": True})
    events = _sse(r.text)
    assert _kinds(events) == ["response.created", "response.in_progress", "response.output_item.added",
                              "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done",
                              "response.output_item.done", "response.completed"]
    data = dict(events)
    assert data["response.output_item.added"]["item"]["input"] == ""
    assert data["response.custom_tool_call_input.done"]["input"] == PATCH
    assert "".join(d["delta"] for n, d in events if n.endswith("input.delta")) == PATCH
    [item] = data["response.completed"]["response"]["output"]
    assert item["type"] == "custom_tool_call" and item["input"] == PATCH


@pytest.mark.parametrize(("choice", "hint", "calls"), [
    ("auto", None, 1),
    (None, None, 1),
    ("required", "You must call at least one tool in this reply.", 1),
    ({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "add"}]},
     "You must call at least one tool in this reply.", 1),
    ({"type": "function", "name": "add"}, "You must call the tool 'add' in this reply.", 1),
    ("none", None, 0),
])
def test_tool_choice(mock_policy, serve, choice, hint, calls):
    seen: list[str] = []
    server = serve(mock_policy(_recording(seen, ADD_CALL)))
    body = {"input": "Add.", "tools": [ADD], **({"tool_choice": choice} if choice is not None else {})}
    out = _post(server.url, body).json()
    assert [i["type"] for i in out["output"]] == ["message"] + ["function_call"] * calls
    if calls == 0:  # not parsed: the call stays in the text
        assert out["output"][0]["content"][0]["text"] == ADD_CALL
    assert ("You must call" in seen[0]) == (hint is not None)
    if hint is not None:
        assert hint in seen[0]
    assert out["tool_choice"] == (choice or "auto")


def test_parallel_tool_calls_false_returns_the_first_call_only(mock_policy, serve):
    two = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
           '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
    seen: list[str] = []
    server = serve(mock_policy(_recording(seen, two)))
    both = _post(server.url, {"input": "Add twice.", "tools": [ADD]}).json()
    assert [json.loads(i["arguments"]) for i in both["output"]] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    one = _post(server.url, {"input": "Add twice.", "tools": [ADD], "parallel_tool_calls": False}).json()
    assert [json.loads(i["arguments"]) for i in one["output"]] == [{"a": 1, "b": 2}]
    assert one["parallel_tool_calls"] is False and both["parallel_tool_calls"] is True
    assert "Call at most one tool in this reply." in seen[1] and "Call at most one tool" not in seen[0]


# -- output ---------------------------------------------------------------------------------
def test_reply_cut_by_max_output_tokens_is_incomplete(mock_policy, serve, tokenizer):
    text = "one two three four five six seven"
    server = serve(mock_policy([text]))
    client = _client(f"{server.url}/v1")
    out = client.responses.create(model="m", input="Count.", max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3 and out.max_output_tokens == 3
    assert out.output_text == tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:3])
    full = client.responses.create(model="m", input="Count.")
    assert full.status == "completed" and full.incomplete_details is None and full.output_text == text
    events = list(client.responses.create(model="m", input="Count.", max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_metadata_and_sampling_fields_are_echoed(mock_policy, serve):
    server = serve(mock_policy())
    out = _post(server.url, {"model": "x", "input": "hi", "metadata": {"task": "t1"}, "temperature": 0.5,
                             "top_p": 0.9, "store": False, "user": "u", "include": ["reasoning.encrypted_content"],
                             "reasoning": {"effort": "high"}, "prompt_cache_key": "k"}).json()
    assert (out["metadata"], out["temperature"], out["top_p"], out["store"]) == ({"task": "t1"}, 0.5, 0.9, False)
    assert out["output"][0]["content"][0]["text"] == "Hello there!"


# -- streaming ------------------------------------------------------------------------------
def test_streamed_text_reply_events_in_order(mock_policy, serve, tokenizer):
    server = serve(mock_policy(["Hello there, streaming friend!"]))
    r = _post(server.url, {"model": "m", "input": "hi", "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _sse(r.text)
    assert all(name == data["type"] for name, data in events)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert _kinds(events) == ["response.created", "response.in_progress", "response.output_item.added",
                              "response.content_part.added", "response.output_text.delta",
                              "response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.completed"]
    deltas = [d["delta"] for n, d in events if n == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == "Hello there, streaming friend!"
    data = dict(events)
    assert data["response.output_text.done"]["text"] == "Hello there, streaming friend!"
    assert data["response.created"]["response"]["status"] == "in_progress"
    done = data["response.completed"]["response"]
    assert done["status"] == "completed" and done["output"] == [data["response.output_item.done"]["item"]]
    assert done["usage"]["output_tokens"] == _reply_tokens(tokenizer, "Hello there, streaming friend!")
    msg_id = data["response.output_item.added"]["item"]["id"]
    assert {d.get("item_id") for n, d in events if ".delta" in n} == {msg_id}


def test_streamed_tool_call_reply_events_in_order(mock_policy, serve):
    server = serve(mock_policy([ADD_CALL]))
    r = _post(server.url, {"model": "m", "input": "Add.", "tools": [ADD], "stream": True})
    events = _sse(r.text)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert _kinds(events) == ["response.created", "response.in_progress",
                              "response.output_item.added", "response.content_part.added",
                              "response.output_text.delta", "response.output_text.done",
                              "response.content_part.done", "response.output_item.done",
                              "response.output_item.added", "response.function_call_arguments.delta",
                              "response.function_call_arguments.done", "response.output_item.done",
                              "response.completed"]
    added = [d for n, d in events if n == "response.output_item.added"]
    assert [(d["output_index"], d["item"]["type"]) for d in added] == [(0, "message"), (1, "function_call")]
    assert added[1]["item"]["arguments"] == "" and added[1]["item"]["status"] == "in_progress"
    args = [d for n, d in events if n.startswith("response.function_call_arguments")]
    assert args[0]["delta"] == args[1]["arguments"] == '{"a": 2, "b": 3}' and args[1]["name"] == "add"
    final = dict(events)["response.completed"]["response"]["output"]
    assert [i["type"] for i in final] == ["message", "function_call"]
    assert final[0]["content"][0]["text"] == "Let me add."
    assert final[1]["call_id"] == added[1]["item"]["call_id"]
    assert "".join(d["delta"] for n, d in events if n == "response.output_text.delta") == "Let me add."


def test_openai_client_stream_matches_the_whole_reply(mock_policy, serve):
    server = serve(mock_policy([ADD_CALL]))
    client = _client(f"{server.url}/v1")
    whole = client.responses.create(model="m", input="Add.", tools=[ADD])
    events = list(client.responses.create(model="m", input="Add.", tools=[ADD], stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == whole.output_text == "Let me add."
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output] == [
        (i.type, getattr(i, "arguments", None)) for i in whole.output]


def test_live_stream_on_the_tiny_model_spells_the_reply(hf_server):
    client = _client(f"{hf_server.url}/v1")
    whole = client.responses.create(model="m", input="Say hi.", max_output_tokens=8, temperature=0)
    events = list(client.responses.create(model="m", input="Say hi.", max_output_tokens=8, temperature=0,
                                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress",
                                           "response.output_item.added", "response.content_part.added"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert text == events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


# -- one session, several protocols; ids sent back ----------------------------------------
def test_chat_completions_then_responses_then_messages_record_one_path(mock_policy, serve, tokenizer):
    server = serve(mock_policy(["first", "second", "third"]))
    sid, key, base = _session(server.url)
    chat = _client(base, key).chat.completions.create(
        model="m", messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}])
    resp = _client(base, key).responses.create(model="m", instructions="S", input=[
        {"role": "user", "content": "u1"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "first"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "u2"}]}])
    msg = httpx.post(f"{server.url}/sessions/{sid}/v1/messages", json={
        "model": "claude", "max_tokens": 20, "system": "S", "messages": [
            {"role": "user", "content": "u1"}, {"role": "assistant", "content": "first"},
            {"role": "user", "content": "u2"}, {"role": "assistant", "content": [{"type": "text", "text": "second"}]},
            {"role": "user", "content": [{"type": "text", "text": "u3"}]}]}).json()
    tree = _tree(server.url, sid)
    [episode] = list(tree.episodes())
    assert [n.info["call_id"] for n in episode.nodes] == [chat.id, resp.id, msg["id"]]
    assert [n.info["api"] for n in episode.nodes] == ["chat", "responses", "messages"]
    assert [n.action_text for n in episode.nodes] == ["first", "second", "third"]
    full = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "first"}, {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "second"}, {"role": "user", "content": "u3"}]
    assert tokenizer.decode(episode.input_ids) == _render(tokenizer, full) + "third<|im_end|>"
    assert tree.meta["branches"] == []


@pytest.mark.parametrize("reformat", [False, True])
def test_tool_call_ids_sent_back_reuse_the_recorded_tokens(mock_policy, serve, tokenizer, reformat):
    server = serve(mock_policy(_adds_then_answers))
    sid, _, _ = _session(server.url)
    start = [{"role": "user", "content": "Add 2 and 3."}]
    first = _post(server.url, {"input": start, "tools": [ADD]}, sid).json()
    message, call = first["output"]
    sent_back = [message, call]
    if reformat:  # the harness drops the text and re-serializes the arguments: the id still names the reply
        sent_back = [{"type": "function_call", "call_id": call["call_id"], "name": "add", "arguments": '{"b":3,"a":2}'}]
    second = _post(server.url, {"input": [*start, *sent_back, {"type": "function_call_output",
                                                               "call_id": call["call_id"], "output": "5"}],
                                "tools": [ADD]}, sid).json()
    tree = _tree(server.url, sid)
    a, b = _node_of(tree, first["id"]), _node_of(tree, second["id"])
    assert b.parent == a.id and "branch" not in b.info
    assert tokenizer.decode(b.context_ids) == f"\n{TOOL_TURN}5<|im_end|>\n<|im_start|>assistant\n"
    assert second["usage"]["input_tokens_details"]["cached_tokens"] == len(a.context_ids) + len(a.action_ids)
    assert second["output"][0]["content"][0]["text"] == "The sum is 5."


def test_a_call_id_the_proxy_did_not_issue_is_not_its_reply(mock_policy, serve):
    server = serve(mock_policy(_adds_then_answers))
    sid, _, _ = _session(server.url)
    start = [{"role": "user", "content": "Add 2 and 3."}]
    _post(server.url, {"input": start, "tools": [ADD]}, sid)
    second = _post(server.url, {"input": [
        *start, {"type": "function_call", "call_id": "call_made_up", "name": "add", "arguments": '{"b":3,"a":2}'},
        {"type": "function_call_output", "call_id": "call_made_up", "output": "5"}], "tools": [ADD]}, sid).json()
    assert _node_of(_tree(server.url, sid), second["id"]).parent is None  # rendered whole: a new root
    assert second["usage"]["input_tokens_details"]["cached_tokens"] == 0


def test_custom_tool_call_sent_back_reuses_the_recorded_tokens(mock_policy, serve, tokenizer):
    patch_call = f"<tool_call>\n{json.dumps({'name': 'apply_patch', 'arguments': {'input': PATCH}})}\n</tool_call>"
    server = serve(mock_policy(lambda p: "Patched." if TOOL_TURN in p else patch_call))
    sid, _, _ = _session(server.url)
    start = [{"role": "user", "content": "Patch it."}]
    first = _post(server.url, {"input": start, "tools": CODEX_TOOLS[1:2]}, sid).json()
    [item] = first["output"]
    assert item["type"] == "custom_tool_call" and item["input"] == PATCH
    second = _post(server.url, {"input": [*start, item, {"type": "custom_tool_call_output",
                                                         "call_id": item["call_id"], "output": "ok"}],
                                "tools": CODEX_TOOLS[1:2]}, sid).json()
    tree = _tree(server.url, sid)
    a, b = _node_of(tree, first["id"]), _node_of(tree, second["id"])
    assert b.parent == a.id
    assert tokenizer.decode(b.context_ids) == f"\n{TOOL_TURN}ok<|im_end|>\n<|im_start|>assistant\n"


# -- bugs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [["text"], "text", 1])
def test_a_text_format_that_is_no_object_is_a_400(mock_policy, serve, fmt):
    server = serve(mock_policy())
    r = _post(server.url, {"input": "hi", "text": {"format": fmt}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "text.format"


@pytest.mark.parametrize("reply", ["Hello there!", ADD_CALL, "one two three four five six seven"])
@pytest.mark.parametrize("cut", [False, True])
def test_bodies_and_events_validate_against_the_sdk_types(mock_policy, serve, reply, cut):
    """The openai client builds its models without validation: checked here, field by field, so a
    field its types require (``usage.input_tokens_details.cache_write_tokens``) is never missing."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    server = serve(mock_policy([reply]))
    body = {"model": "m", "input": "hi", "tools": [ADD], **({"max_output_tokens": 3} if cut else {})}
    Response.model_validate(_post(server.url, body).json())
    events = TypeAdapter(list[ResponseStreamEvent]).validate_python(
        [data for _, data in _sse(_post(server.url, {**body, "stream": True}).text)])
    assert events[-1].type == ("response.incomplete" if cut else "response.completed")
    assert events[-1].response.usage.input_tokens_details.cache_write_tokens == 0


class _Gated:
    """Reports ``text``'s tokens through ``on_token``; after the third it waits (up to 10 s) for
    ``go``, so a test can act while the reply is half streamed."""

    version = 0

    def __init__(self, tokenizer, text: str):
        self.tokenizer, self.go = tokenizer, threading.Event()
        self.ids = tokenizer.encode(text) + [tokenizer.eos_token_id]

    async def agenerate(self, request):
        from agentrl.policy import GenerateResult

        for k, t in enumerate(self.ids):
            request.control.on_token(t)
            if k == 2:
                deadline = time.monotonic() + 10
                while not self.go.is_set() and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
        n = len(self.ids)
        return GenerateResult(list(self.ids), [-0.5] * n, [0.0] * n, "stop", self.version)


def test_an_error_after_the_stream_began_continues_its_sequence_numbers(tokenizer, serve):
    policy = _Gated(tokenizer, "Streaming works, token by token, until the session closes.")
    server = serve(policy)
    sid, key, base = _session(server.url)
    events = []
    with _client(base, key).responses.create(model="m", input="hi", stream=True) as stream:
        for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta" and not policy.go.is_set():
                httpx.post(f"{server.url}/sessions/{sid}/close").raise_for_status()
                policy.go.set()
    assert events[-1].type == "error" and "closed" in events[-1].message
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_many_function_call_items_translate_in_linear_time():
    """Each call joined the assistant message by copying its calls so far: 40,000 calls (2 MB of
    items, under the body limit) took about 11 s on the server's loop; now well under a second."""
    from agentrl.proxy.responses_api import Item, _messages

    n = 40_000
    items = [Item(role="user", content="x")] + [Item(type="function_call", call_id=f"c{i}", name="a")
                                                for i in range(n)]
    t0 = time.process_time()  # this process's CPU time, which other load on the machine does not stretch
    [_, assistant] = _messages(items, [])
    assert time.process_time() - t0 < 3.0  # quadratic: about 11 s; linear: about 0.1 s
    assert [c["id"] for c in assistant["tool_calls"]] == [f"c{i}" for i in range(n)]


def test_the_message_of_a_reply_cut_by_max_output_tokens_is_incomplete(mock_policy, serve):
    """As OpenAI writes it: the cut message item's status is incomplete, in the body and the events."""
    server = serve(mock_policy(["one two three four five six seven"]))
    body = {"model": "m", "input": "Count.", "max_output_tokens": 3}
    [item] = _post(server.url, body).json()["output"]
    assert item["status"] == "incomplete"
    events = dict(_sse(_post(server.url, {**body, "stream": True}).text))
    assert events["response.output_item.done"]["item"]["status"] == "incomplete"
    assert events["response.incomplete"]["response"]["output"][0]["status"] == "incomplete"
    [item] = _post(server.url, {**body, "max_output_tokens": 50}).json()["output"]
    assert item["status"] == "completed"


def _messages_held(root) -> int:
    """Distinct message dicts (dicts with a ``role``) reachable from ``root`` through containers
    and slotted objects' fields."""
    seen, todo, count = set(), [root], 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            count += "role" in obj
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, list | tuple):
            todo += obj
        elif hasattr(type(obj), "__slots__"):
            todo += [getattr(obj, f) for f in type(obj).__slots__ if hasattr(obj, f)]
    return count


def test_a_previous_response_id_chain_is_stored_in_linear_memory(mock_policy, tokenizer):
    """Each stored response kept a copy of its whole conversation: a chain of n calls held n^2/2
    messages (a 4,096-call chain, the default store, about 7 GB). Now each message is held once."""
    from starlette.testclient import TestClient

    from agentrl.proxy import ProxyConfig, create_app

    app = create_app(mock_policy(["ok"]), ProxyConfig(max_context_tokens=100_000))
    client, n, prev = TestClient(app), 60, None
    for i in range(n):
        body = {"input": f"turn {i}", **({"previous_response_id": prev} if prev else {})}
        r = client.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        prev = r.json()["id"]
    assert _messages_held(app.proxy.responses) <= 2 * n  # each call's input and reply
    r = client.post("/v1/responses", json={"input": "last", "previous_response_id": prev, "max_output_tokens": 1})
    whole = [m for i in range(n) for m in ({"role": "user", "content": f"turn {i}"},
                                           {"role": "assistant", "content": "ok"})]
    assert r.json()["usage"]["input_tokens"] == _tokens(tokenizer, _render(
        tokenizer, [*whole, {"role": "user", "content": "last"}]))  # the chain is whole, in order
