"""Fuzz the Responses and Anthropic Messages bodies: whatever a client sends, the proxy answers
with a 2xx or a 4xx in the protocol's own error shape that names the field at fault, never a
500, and it goes on answering valid requests in the same session.

The app runs in process (starlette's ``TestClient``) over a ``MockPolicy`` that calls the first
tool it is offered, so replies with tool calls (function, custom, namespaced) are written too.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from agentrl.policy import MockPolicy
from agentrl.proxy import ProxyConfig, create_app
from agentrl.proxy.anthropic_api import MessagesRequest
from agentrl.proxy.responses_api import ResponsesRequest

_OFFERED = re.compile(r'<tools>\n\{"type": "function", "function": \{"name": "((?:[^"\\]|\\.)*)"')
# Refusals that are about the request as a whole, not one field.
_FIELDLESS = ("invalid JSON body", "the prompt is ", "the prompt (")
_ANTHROPIC_ERROR_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                          "request_too_large", "rate_limit_error", "overloaded_error", "timeout_error"}


def _first_tool_call(prompt: str) -> str:
    """Call the first tool offered (its name as JSON text), with an ``input`` a custom tool takes."""
    m = _OFFERED.search(prompt)
    if m is None:
        return "Hello there!"
    return f'Sure.\n<tool_call>\n{{"name": "{m.group(1)}", "arguments": {{"input": "x"}}}}\n</tool_call>'


@pytest.fixture(scope="module")
def proxy(tokenizer):
    """(client, session id): one app and one session for every example of a test."""
    app = create_app(MockPolicy(tokenizer, _first_tool_call),
                     ProxyConfig(max_context_tokens=2048, default_max_tokens=32, max_request_bytes=1 << 16))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, client.post("/sessions", json={}).json()["session_id"]


def _post(client: TestClient, path: str, body: Any) -> Any:
    # allow_nan: Python's json reads NaN and Infinity, so a client may send them
    raw = json.dumps(body, ensure_ascii=True, allow_nan=True).encode()
    return client.post(path, content=raw, headers={"content-type": "application/json"})


def _names_a_field(message: str, fields: set[str], body: Any) -> bool:
    """The message says which field is at fault (``input.0.role: ...``): a path that starts at a field
    of the request model or of the body sent; or the fault is the whole request."""
    if message.startswith(_FIELDLESS):
        return True
    sent = {str(k) for k in (body if isinstance(body, dict) else range(len(body)) if isinstance(body, list) else ())}
    return any(message.startswith((f + ".", f + ":")) or f": {f}." in message or f": {f}:" in message
               for f in fields | sent)


def _check_openai(r: Any, body: Any) -> None:
    """A Responses answer: 200 with a response (or its events), or an OpenAI-shaped 4xx."""
    assert r.status_code < 500, r.text
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: ")]
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        else:
            out = r.json()
            assert out["object"] == "response" and out["status"] in ("completed", "incomplete")
            assert {i["type"] for i in out["output"]} <= {"message", "function_call", "custom_tool_call"}
        return
    err = r.json()["error"]
    assert set(r.json()) == {"error"} and isinstance(err["message"], str) and isinstance(err["type"], str)
    if err["param"] is not None:
        assert err["param"] in err["message"], err
    assert _names_a_field(err["message"], set(ResponsesRequest.model_fields) | {"body"}, body), err


def _check_anthropic(r: Any, body: Any, count: bool = False) -> None:
    """A Messages answer: 200 with a message (or its events, or a count), or an Anthropic-shaped 4xx."""
    assert r.status_code < 500, r.text
    if r.status_code == 200:
        if count:
            assert isinstance(r.json()["input_tokens"], int)
        elif r.headers["content-type"].startswith("text/event-stream"):
            names = [line[7:] for line in r.text.split("\n") if line.startswith("event: ")]
            types = [json.loads(line[6:])["type"] for line in r.text.split("\n") if line.startswith("data: ")]
            assert names == types and names[0] == "message_start" and names[-1] == "message_stop", names
        else:
            out = r.json()
            assert out["type"] == "message" and out["stop_reason"] in ("end_turn", "tool_use", "max_tokens",
                                                                       "stop_sequence")
            assert {b["type"] for b in out["content"]} <= {"text", "tool_use"}
        return
    data = r.json()
    assert set(data) == {"type", "error"} and data["type"] == "error", data
    assert set(data["error"]) == {"type", "message"} and data["error"]["type"] in _ANTHROPIC_ERROR_TYPES
    assert _names_a_field(data["error"]["message"], set(MessagesRequest.model_fields) | {"body"}, body), data


def _values(value: Any) -> list[Any]:
    """Every value and key inside a JSON value."""
    out, todo = [], [value]
    while todo:
        v = todo.pop()
        out.append(v)
        if isinstance(v, dict):
            out += v.keys()
            todo += v.values()
        elif isinstance(v, list):
            todo += v
    return out


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


# -- strategies ---------------------------------------------------------------------------
# Wild values: anything JSON can hold, with odd text (lone surrogates, NUL, template and tool-call tags).
texts = st.one_of(
    st.text(max_size=16),
    st.text(st.characters(exclude_categories=()), max_size=8),  # any code point
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "<tool_call>", "</tool_call>", "<|im_end|>", "{}", "é😀"]),
)
names = st.one_of(st.sampled_from(["add", "apply_patch", "read", "f", ""]), st.text(max_size=12))
ids = st.one_of(st.sampled_from(["call_1", "toolu_1", "call_a"]), st.text(max_size=8))


def json_values() -> st.SearchStrategy[Any]:
    """Any JSON Python's json reads: NaN and Infinity too."""
    scalars = st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats() | texts
    return st.recursive(scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(texts, kids, max_size=3),
                        max_leaves=8)


def numbers() -> st.SearchStrategy[Any]:
    return st.one_of(st.integers(-3, 40), st.integers(-(2 ** 64), 2 ** 64), st.floats(-3, 3), st.floats(),
                     json_values())



# Valid bodies, varied: every item, block, tool and choice kind each protocol takes.
plain = st.one_of(st.text(max_size=20), st.sampled_from(["<tool_call>", "é😀 ok", "a\nb", ""]))
tool_names = st.sampled_from(["add", "apply_patch", "read", "f_ü"])
params = st.one_of(st.just({"type": "object", "properties": {"a": {"type": "integer"}}}),
                   st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
                       st.text(max_size=6), st.fixed_dictionaries({"type": st.sampled_from(
                           ["string", "integer", "object", "array"])}), max_size=3)}))
call_args = st.dictionaries(st.text(max_size=4), st.one_of(st.integers(), st.text(max_size=6)), max_size=2)
issued = st.sampled_from(["call_1", "call_2", "toolu_1"])

r_text_parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "text"]),
                                               "text": plain}), min_size=1, max_size=2)
r_valid_items = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer"]),
                           "content": st.one_of(plain, r_text_parts)}, optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": issued, "name": tool_names,
                           "arguments": call_args.map(json.dumps)}),
    st.fixed_dictionaries({"type": st.just("custom_tool_call"), "call_id": issued, "name": tool_names,
                           "input": plain}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call_output", "custom_tool_call_output"]),
                           "call_id": issued, "output": st.one_of(plain, r_text_parts)}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.just([])}),
)
r_valid_tool = st.one_of(
    st.fixed_dictionaries({"type": st.just("function"), "name": tool_names},
                          optional={"description": plain, "parameters": params}),
    st.fixed_dictionaries({"type": st.just("custom"), "name": tool_names}, optional={"description": plain}),
    st.sampled_from([{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["v"]}]),
)
r_valid_tools = st.lists(st.one_of(r_valid_tool, st.fixed_dictionaries({
    "type": st.just("namespace"), "name": st.sampled_from(["fs", "web"]),
    "tools": st.lists(r_valid_tool, max_size=2)})), min_size=1, max_size=3)
r_valid = st.fixed_dictionaries(
    {"model": st.sampled_from(["gpt-5", "m"]), "tools": st.one_of(r_valid_tools, st.just([])),
     "input": st.one_of(plain, st.lists(r_valid_items, min_size=1, max_size=5))},
    optional={"instructions": plain,
              "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]),
                                       tool_names.map(lambda n: {"type": "function", "name": n}),
                                       st.just({"type": "allowed_tools", "mode": "required", "tools": []})),
              "parallel_tool_calls": st.booleans(), "max_output_tokens": st.sampled_from([3, 64, 200, 200]),
              "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "stream": st.booleans(),
              "store": st.booleans(), "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2),
              "reasoning": st.just({"effort": "low"}), "text": st.just({"format": {"type": "text"}})})

a_text_blocks = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": plain},
                                               optional={"cache_control": st.just({"type": "ephemeral"})}),
                         min_size=1, max_size=2)
a_user = st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(plain, st.lists(st.one_of(
    a_text_blocks.map(lambda b: b[0]),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": issued,
                           "content": st.one_of(plain, a_text_blocks)}, optional={"is_error": st.booleans()})),
    min_size=1, max_size=3))})
a_assistant = st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(plain, st.lists(st.one_of(
    a_text_blocks.map(lambda b: b[0]),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": issued, "name": tool_names, "input": call_args}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": plain, "signature": st.just("s")}),
    st.just({"type": "redacted_thinking", "data": "x"})), min_size=1, max_size=3))})
a_valid_tools = st.lists(st.one_of(
    st.fixed_dictionaries({"name": tool_names}, optional={"description": plain, "input_schema": params,
                                                          "type": st.just("custom")}),
    st.just({"type": "web_search_20250305", "name": "web_search", "max_uses": 3})), min_size=1, max_size=3)
a_valid = st.fixed_dictionaries(
    {"model": st.sampled_from(["claude-sonnet-4-5", "m"]), "max_tokens": st.sampled_from([3, 64, 200, 200]),
     "messages": st.lists(st.one_of(a_user, a_assistant, st.fixed_dictionaries(
         {"role": st.just("system"), "content": st.one_of(plain, a_text_blocks)})), min_size=1, max_size=5),
     "tools": st.one_of(a_valid_tools, st.just([]))},
    optional={"system": st.one_of(plain, a_text_blocks),
              "tool_choice": st.one_of(st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}]),
                                       tool_names.map(lambda n: {"type": "tool", "name": n}),
                                       st.fixed_dictionaries({"type": st.sampled_from(["auto", "any"]),
                                                              "disable_parallel_tool_use": st.booleans()})),
              "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}]),
              "stop_sequences": st.lists(st.text(min_size=1, max_size=3), max_size=2),
              "temperature": st.floats(0, 1), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
              "stream": st.booleans(), "metadata": st.just({"user_id": "u"})})


def _paths(value: Any, at: tuple = ()) -> list[tuple]:
    """Every place in a JSON value, the root included."""
    out = [at]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*at, i))
    return out


@st.composite
def corrupted(draw: Any, valid: st.SearchStrategy[Any]) -> Any:
    """A valid body with up to three places broken: a value replaced, a key dropped, a value wrapped
    in a list or an object (shapes a client gets wrong)."""
    body = copy.deepcopy(draw(valid))  # strategies such as st.just hand out one shared object
    for _ in range(draw(st.integers(0, 3))):
        path = draw(st.sampled_from(_paths(body)))
        if not path:
            continue
        parent = body
        for p in path[:-1]:
            parent = parent[p]
        how = draw(st.sampled_from(["replace", "drop", "wrap_list", "wrap_object"]))
        if how == "drop" and isinstance(parent, dict):
            del parent[path[-1]]
        elif how == "wrap_list":
            parent[path[-1]] = [parent[path[-1]]]
        elif how == "wrap_object":
            parent[path[-1]] = {"value": parent[path[-1]]}
        else:
            parent[path[-1]] = draw(json_values())
    return body


# Wild bodies: the right keys, each holding valid-looking or arbitrary values.
r_parts = st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(["input_text", "output_text", "text", "refusal", "input_image",
                                        "input_file", "input_audio"]), texts)},
    optional={"text": st.one_of(texts, json_values()), "refusal": texts, "image_url": texts})
r_content = st.one_of(texts, st.lists(r_parts, max_size=3), st.none(), json_values())
r_items = st.fixed_dictionaries({}, optional={
    "type": st.one_of(st.sampled_from(["message", "function_call", "function_call_output", "custom_tool_call",
                                       "custom_tool_call_output", "reasoning", "computer_call", "item_reference"]),
                      st.none(), texts),
    "role": st.one_of(st.sampled_from(["user", "assistant", "system", "developer", "tool", "robot"]), texts),
    "content": r_content, "call_id": ids, "name": names, "id": ids, "output": r_content,
    "arguments": st.one_of(st.just('{"a": 1}'), texts, json_values()), "input": st.one_of(texts, json_values()),
    "summary": json_values()})
r_tool = st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(["function", "custom", "namespace", "web_search", "file_search"]), texts)},
    optional={"name": names, "description": texts, "parameters": st.one_of(params, json_values()),
              "format": json_values()})
r_tools = st.one_of(st.lists(st.one_of(r_tool, r_tool.flatmap(
    lambda t: st.lists(r_tool, max_size=2).map(lambda kids: {**t, "type": "namespace", "tools": kids}))),
    max_size=3), json_values())
r_choice = st.one_of(
    st.sampled_from(["auto", "none", "required", "any"]), texts, json_values(),
    st.fixed_dictionaries({"type": st.sampled_from(["function", "custom", "allowed_tools", "mcp", "file_search"])},
                          optional={"name": names, "mode": st.sampled_from(["auto", "required", "none"]),
                                    "tools": json_values()}))
r_wild = st.fixed_dictionaries(
    {"input": st.one_of(texts, st.lists(r_items, max_size=5), json_values())},
    optional={"model": st.one_of(texts, json_values()), "instructions": st.one_of(texts, json_values()),
              "previous_response_id": st.one_of(st.just("resp_nope"), texts), "store": st.booleans(),
              "tools": r_tools, "tool_choice": r_choice, "parallel_tool_calls": st.one_of(st.booleans(), numbers()),
              "max_output_tokens": numbers(), "temperature": numbers(), "top_p": numbers(),
              "stream": st.one_of(st.booleans(), texts),
              "text": st.one_of(st.fixed_dictionaries({"format": st.fixed_dictionaries({"type": st.sampled_from(
                  ["text", "json_schema", "json_object"])})}), json_values()),
              "metadata": st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=2),
              "reasoning": json_values(), "include": json_values(), "truncation": json_values()})

a_blocks = st.deferred(lambda: st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(["text", "tool_use", "tool_result", "thinking", "redacted_thinking",
                                        "image", "document", "server_tool_use", "search_result"]), texts)},
    optional={"text": st.one_of(texts, json_values()), "id": ids, "name": names, "tool_use_id": ids,
              "input": st.one_of(st.just({"a": 1}), json_values()), "is_error": st.booleans(),
              "content": st.one_of(texts, st.lists(a_blocks, max_size=2), json_values()),
              "cache_control": st.just({"type": "ephemeral"}), "thinking": texts, "signature": texts,
              "source": json_values()}))
a_messages = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "assistant", "system"]), texts),
     "content": st.one_of(texts, st.lists(a_blocks, max_size=3), json_values())})
a_tool = st.fixed_dictionaries(
    {"name": names},
    optional={"type": st.one_of(st.sampled_from(["custom", "web_search_20250305", "bash_20250124"]), st.none(),
                                texts),
              "description": texts, "input_schema": st.one_of(params, json_values()), "max_uses": numbers()})
a_choice = st.one_of(
    st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["auto", "any", "tool", "none"]), texts)},
                          optional={"name": names, "disable_parallel_tool_use": st.one_of(st.booleans(), texts)}),
    json_values())
a_wild = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(a_messages, min_size=1, max_size=4), json_values())},
    optional={"model": st.one_of(texts, json_values()), "max_tokens": numbers(),
              "system": st.one_of(texts, st.lists(a_blocks, max_size=2), json_values()),
              "tools": st.one_of(st.lists(a_tool, max_size=3), json_values()), "tool_choice": a_choice,
              "thinking": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"])},
                                                          optional={"budget_tokens": numbers()}), json_values()),
              "stop_sequences": st.one_of(st.lists(texts, max_size=3), json_values()),
              "temperature": numbers(), "top_p": numbers(), "top_k": numbers(),
              "stream": st.one_of(st.booleans(), texts), "metadata": json_values(),
              "cache_control": json_values(), "output_config": json_values()})

RESPONSES_OK = {"model": "m", "input": "Say hi."}
MESSAGES_OK = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Say hi."}]}


def _still_answers(client: TestClient, sid: str) -> None:
    r = _post(client, f"/sessions/{sid}/v1/responses", RESPONSES_OK)
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "Hello there!", r.text
    r = _post(client, f"/sessions/{sid}/v1/messages", MESSAGES_OK)
    assert r.status_code == 200 and r.json()["content"][0]["text"] == "Hello there!", r.text


def _tree_still_serves(client: TestClient, sid: str) -> None:
    r = client.get(f"/sessions/{sid}/tree")
    assert r.status_code == 200 and r.json()["meta"]["session_id"] == sid


# -- bodies -----------------------------------------------------------------------------------
@settings(deadline=None, max_examples=300)
@given(body=st.one_of(corrupted(r_valid), corrupted(r_valid), r_wild), in_session=st.booleans())
def test_responses_bodies_get_a_reply_or_an_openai_error(proxy, body, in_session):
    client, sid = proxy
    path = f"/sessions/{sid}/v1/responses" if in_session else "/v1/responses"
    _check_openai(_post(client, path, body), body)
    _still_answers(client, sid)


@settings(deadline=None, max_examples=300)
@given(body=st.one_of(corrupted(a_valid), corrupted(a_valid), a_wild), in_session=st.booleans(),
       count=st.booleans())
def test_messages_bodies_get_a_reply_or_an_anthropic_error(proxy, body, in_session, count):
    client, sid = proxy
    path = ("/sessions/" + sid if in_session else "") + ("/v1/messages/count_tokens" if count else "/v1/messages")
    _check_anthropic(_post(client, path, body), body, count)
    _still_answers(client, sid)


@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_replies_sent_back_broken_get_a_reply_or_an_error(proxy, data):
    """A reply's own items or blocks, with their issued ids, sent back in a next call that is then broken."""
    client, sid = proxy
    r = _post(client, f"/sessions/{sid}/v1/responses", {"input": "Go.", "tools": [
        {"type": "function", "name": "add"}, {"type": "custom", "name": "apply_patch"}]})
    items = r.json()["output"]
    outputs = [{"type": f"{i['type']}_output", "call_id": i["call_id"], "output": "5"}
               for i in items if i["type"] != "message"]
    body = data.draw(corrupted(st.just({"input": [{"role": "user", "content": "Go."}, *items, *outputs],
                                        "tools": [{"type": "function", "name": "add"}]})))
    _check_openai(_post(client, f"/sessions/{sid}/v1/responses", body), body)
    r = _post(client, f"/sessions/{sid}/v1/messages", {**MESSAGES_OK, "tools": [{"name": "add"}]})
    blocks = r.json()["content"]
    results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "5"}
               for b in blocks if b["type"] == "tool_use"]
    body = data.draw(corrupted(st.just({**MESSAGES_OK, "tools": [{"name": "add"}], "messages": [
        *MESSAGES_OK["messages"], {"role": "assistant", "content": blocks},
        {"role": "user", "content": [*results, {"type": "text", "text": "Go on."}]}]})))
    _check_anthropic(_post(client, f"/sessions/{sid}/v1/messages", body), body)
    _still_answers(client, sid)


@settings(deadline=None, max_examples=40)
@given(body=json_values(), path=st.sampled_from(["/v1/responses", "/v1/messages", "/v1/messages/count_tokens"]))
def test_any_json_body_gets_an_error_in_its_protocols_shape(proxy, body, path):
    client, sid = proxy
    r = _post(client, f"/sessions/{sid}{path}", body)
    if path == "/v1/responses":
        _check_openai(r, body)
    else:
        _check_anthropic(r, body, count=path.endswith("count_tokens"))
    assert r.status_code in (200, 400)


# -- one field made wrong: the error names it ----------------------------------------------
not_text_part = st.one_of(st.sampled_from(["input_image", "input_file", "input_audio"]),
                          st.text(min_size=1, max_size=8)).filter(lambda t: t not in ("input_text", "output_text",
                                                                                      "text", "refusal"))
not_a_role = st.text(max_size=8).filter(lambda r: r not in ("user", "assistant", "system", "developer"))
RESPONSES_WRONG = st.one_of(
    st.floats(2.0001, 1e9).map(lambda v: ({"temperature": v}, "temperature")),
    st.floats(-1e9, -0.0001).map(lambda v: ({"temperature": v}, "temperature")),
    st.one_of(st.floats(1.0001, 1e9), st.floats(-1e9, 0)).map(lambda v: ({"top_p": v}, "top_p")),
    st.integers(-(2 ** 40), 0).map(lambda v: ({"max_output_tokens": v}, "max_output_tokens")),
    not_a_role.map(lambda r: ({"input": [{"role": r, "content": "x"}]}, "input.0.role")),
    not_text_part.map(lambda t: ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                                         {"type": t}]}]}, "input.0.content.1.type")),
    st.text(min_size=1, max_size=8).filter(lambda t: t not in (
        "message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
        "reasoning")).map(lambda t: ({"input": [{"role": "user", "content": "x"}, {"type": t}]}, "input.1.type")),
    st.sampled_from(["function_call_output", "custom_tool_call_output"]).map(
        lambda t: ({"input": [{"type": t, "output": "5"}]}, "input.0.call_id")),
    st.sampled_from(["json_schema", "json_object"]).map(lambda t: ({"text": {"format": {"type": t}}}, "text.format")),
    st.text(max_size=8).filter(lambda c: c not in ("auto", "none", "required")).map(
        lambda c: ({"tools": [{"type": "function", "name": "add"}], "tool_choice": c}, "tool_choice")),
    st.sampled_from(["function", "custom"]).map(lambda t: ({"tools": [{"type": t}]}, "tools.0.name")),
    st.text(min_size=129, max_size=140).map(lambda n: ({"tools": [{"type": "function", "name": n}]}, "tools.0.name")),
    st.text(max_size=12).map(lambda i: ({"previous_response_id": "resp_" + i}, "previous_response_id")),
)
MESSAGES_WRONG = st.one_of(
    st.integers(-(2 ** 40), 0).map(lambda v: ({"max_tokens": v}, "max_tokens")),
    st.floats(2.0001, 1e9).map(lambda v: ({"temperature": v}, "temperature")),
    st.one_of(st.floats(1.0001, 1e9), st.floats(-1e9, 0)).map(lambda v: ({"top_p": v}, "top_p")),
    st.integers(-(2 ** 40), -1).map(lambda v: ({"top_k": v}, "top_k")),
    st.text(max_size=8).filter(lambda r: r not in ("user", "assistant", "system")).map(
        lambda r: ({"messages": [{"role": r, "content": "x"}]}, "messages.0.role")),
    st.text(min_size=1, max_size=8).filter(lambda t: t not in ("text", "tool_result")).map(
        lambda t: ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": t}]}]},
                   "messages.0.content.1.type")),
    st.text(min_size=1, max_size=8).filter(lambda t: t not in ("text", "tool_use", "thinking", "redacted_thinking"))
    .map(lambda t: ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": t}]}]},
                    "messages.1.content.0.type")),
    st.text(min_size=1, max_size=8).filter(lambda t: t != "text").map(
        lambda t: ({"system": [{"type": t}]}, "system.0.type")),
    st.lists(st.text(max_size=4), min_size=1, max_size=3).map(
        lambda s: ({"stop_sequences": [*s, ""]}, "stop_sequences")),
    st.text(max_size=8).filter(lambda t: t not in ("auto", "any", "tool", "none")).map(
        lambda t: ({"tool_choice": {"type": t}}, "tool_choice")),
    st.just(({"tools": [{"name": "add"}], "tool_choice": {"type": "tool"}}, "tool_choice.name")),
    st.one_of(st.just(""), st.text(min_size=129, max_size=140)).map(
        lambda n: ({"tools": [{"name": n}]}, "tools.0.name")),
)


@settings(deadline=None, max_examples=50)
@given(wrong=RESPONSES_WRONG)
def test_a_wrong_responses_field_is_named(proxy, wrong):
    client, sid = proxy
    change, field = wrong
    body = {**RESPONSES_OK, **change}
    r = _post(client, f"/sessions/{sid}/v1/responses", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(field) and field in err["message"], err


@settings(deadline=None, max_examples=50)
@given(wrong=MESSAGES_WRONG, count=st.booleans())
def test_a_wrong_messages_field_is_named(proxy, wrong, count):
    client, sid = proxy
    change, field = wrong
    if count and field in ("max_tokens", "temperature", "top_p", "top_k", "stop_sequences"):
        return  # count_tokens reads no sampling fields
    body = {**MESSAGES_OK, **change}
    path = "/v1/messages/count_tokens" if count else "/v1/messages"
    r = _post(client, f"/sessions/{sid}{path}", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and field in r.json()["error"]["message"], r.json()


# -- bugs the fuzzing found -----------------------------------------------------------------
@pytest.mark.parametrize("raw", [
    b'{"input": "hi", "metadata": {"x": NaN}}',
    b'{"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"x": Infinity}}]}',
    b'{"input": "hi", "tools": [{"type": "function", "name": "f"}], '
    b'"tool_choice": {"type": "function", "name": "f", "x": -Infinity}}',
])
def test_responses_echoing_nan_or_infinity_is_not_a_500(proxy, raw):
    client, _ = proxy
    r = client.post("/v1/responses", content=raw, headers={"content-type": "application/json"})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"] is not None


@pytest.mark.parametrize(("path", "raw", "field"), [
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
     "temperature"),
    ("/v1/messages", b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], '
     b'"metadata": {"x": -1' + b"0" * 400 + b'.5}}', "metadata.x"),
])
def test_a_number_past_the_largest_float_is_a_400_naming_it(proxy, path, raw, field):
    """JSON has no limit on a number: 1e999 parsed to inf, which the NaN/Infinity check (it
    looked for those words) let through; a reward of 1e999 was recorded as inf."""
    client, _ = proxy
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert f"{field}: is past the largest float" in r.json()["error"]["message"]


def test_responses_nested_near_the_parser_limit_is_not_a_500(proxy):
    client, _ = proxy
    statuses = set()
    for depth in range(900, 1000, 2):
        nested = "[" * depth + "]" * depth
        raw = f'{{"input": "hi", "tools": [{{"type": "function", "name": "f", "parameters": {{"x": {nested}}}}}]}}'
        statuses.add(client.post("/v1/responses", content=raw.encode(),
                                 headers={"content-type": "application/json"}).status_code)
    assert statuses <= {200, 400}, statuses



@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/v1/chat/completions"])
def test_a_lone_surrogate_key_is_a_400(proxy, path):
    client, _ = proxy
    raw = (r'{"model": "m", "max_tokens": 5, "input": "hi", "messages": [{"role": "user", "content": "hi"}], '
           r'"metadata": {"\ud800": "\udc00"}}')
    r = client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "lone surrogate" in r.text


# -- last: the session every example above went through ---------------------------------
def test_the_fuzzed_session_still_records_and_serves_its_tree(proxy):
    client, sid = proxy
    _still_answers(client, sid)
    _tree_still_serves(client, sid)
    assert client.post(f"/sessions/{sid}/close").status_code == 200
