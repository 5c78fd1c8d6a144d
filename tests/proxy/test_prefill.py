"""Prefills: a final assistant message the reply continues (Anthropic Messages, and Chat Completions'
``continue_final_message`` as vLLM offers it). The prefill's tokens are context, the continuation
is the action, and the next call's history (prefill plus continuation as one message) hangs under
it on the recorded tokens."""

from __future__ import annotations

import httpx
import pytest

from agentrl.chat import ChatContext
from agentrl.types import RolloutTree

anthropic = pytest.importorskip("anthropic", reason="the Messages tests drive the proxy with the anthropic client")
openai = pytest.importorskip("openai", reason="the chat tests drive the proxy with the openai client")

USER = {"role": "user", "content": "Add 2 and 3."}
PREFILL = "The sum is"
HEADER = "<|im_start|>assistant\n"  # how the SmolLM2 template opens an assistant turn


def _recording(seen: list[str], reply: str = " 5."):
    def respond(prompt: str) -> str:
        seen.append(prompt)
        return reply
    return respond


def _session(url: str) -> tuple[str, str]:
    data = httpx.post(f"{url}/sessions", json={}).raise_for_status().json()
    return data["session_id"], data["api_key"]


def _claude(url: str, sid: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{url}/sessions/{sid}" if sid else url, api_key="k", max_retries=0)


def _tree(url: str, sid: str) -> RolloutTree:
    return RolloutTree.from_dict(httpx.get(f"{url}/sessions/{sid}/tree").raise_for_status().json())


def _path_ids(tree: RolloutTree, node_id: int) -> list[int]:
    ids: list[int] = []
    for n in tree.path(node_id):
        ids += [*n.context_ids, *n.action_ids]
    return ids


def _ask(client, messages, **kw):
    return client.messages.create(model="claude-sonnet-4-5", max_tokens=32, messages=messages, **kw)


def test_an_anthropic_prefill_is_continued_and_its_next_call_hangs_under_it(tokenizer, serve, mock_policy):
    seen: list[str] = []
    server = serve(mock_policy(_recording(seen)))
    sid, _ = _session(server.url)
    client = _claude(server.url, sid)
    first = _ask(client, [USER, {"role": "assistant", "content": PREFILL}])
    assert [b.text for b in first.content] == [" 5."]  # the continuation only, as Anthropic answers
    assert first.stop_reason == "end_turn"
    assert seen[0].endswith(HEADER + PREFILL)  # the model continued the prefill, not a new turn
    prompt = tokenizer.apply_chat_template([USER], tokenize=False, add_generation_prompt=True) + PREFILL
    assert first.usage.input_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))

    # the harness keeps prefill and continuation as one assistant message
    history = [USER, {"role": "assistant", "content": PREFILL + " 5."}, {"role": "user", "content": "And 3 + 4?"}]
    second = _ask(client, history)
    tree = _tree(server.url, sid)
    [root] = [n for n in tree.nodes.values() if n.info["call_id"] == first.id]
    [leaf] = [n for n in tree.nodes.values() if n.info["call_id"] == second.id]
    assert tokenizer.decode(root.context_ids) == prompt and root.action_text == " 5."
    assert leaf.parent == root.id and "branch" not in leaf.info  # one path, not a new root
    expected = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert seen[1] == expected  # the recorded tokens are what a full render gives
    assert tokenizer.decode(_path_ids(tree, leaf.id)[:-len(leaf.action_ids)]) == expected


def test_a_retried_prefill_is_a_retry_and_another_prefill_is_an_edit(serve, mock_policy):
    server = serve(mock_policy(_recording([])))
    sid, _ = _session(server.url)
    client = _claude(server.url, sid)
    a = _ask(client, [USER, {"role": "assistant", "content": PREFILL}])
    b = _ask(client, [USER, {"role": "assistant", "content": PREFILL}])
    c = _ask(client, [USER, {"role": "assistant", "content": "Five is"}])
    tree = _tree(server.url, sid)
    by_call = {n.info["call_id"]: n for n in tree.nodes.values()}
    assert by_call[b.id].info["branch"]["reason"] == "retry"
    assert by_call[b.id].context_ids == by_call[a.id].context_ids
    assert by_call[c.id].info["branch"]["reason"] == "edit"  # not a compaction: the first path was left
    closed = RolloutTree.from_dict(httpx.post(f"{server.url}/sessions/{sid}/close").raise_for_status().json())
    assert closed.nodes[by_call[a.id].id].info.get("abandoned") is True


def test_a_streamed_prefill_sends_the_continuation_only(serve, mock_policy):
    server = serve(mock_policy(_recording([], " five, as asked.")))
    client = _claude(server.url)
    with client.messages.stream(model="m", max_tokens=32,
                                messages=[USER, {"role": "assistant", "content": PREFILL}]) as stream:
        text = "".join(stream.text_stream)
    assert text == " five, as asked."


def test_a_prefill_of_text_blocks_is_one_prefill(serve, mock_policy):
    seen: list[str] = []
    server = serve(mock_policy(_recording(seen, '"a": 1}')))
    blocks = [{"type": "thinking", "thinking": "x", "signature": "s"}, {"type": "text", "text": "{"}]
    reply = _ask(_claude(server.url), [USER, {"role": "assistant", "content": blocks}])
    assert reply.content[0].text == '"a": 1}' and seen[0].endswith(HEADER + "{")


@pytest.mark.parametrize(("content", "problem"), [
    ("Sure, ", "trailing whitespace"),
    ("The sum is\n", "trailing whitespace"),
    ([{"type": "text", "text": "Let me"}, {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {}}],
     "tool_use"),
])
def test_prefills_anthropic_refuses_are_refused(serve, mock_policy, content, problem):
    server = serve(mock_policy(_recording([])))
    body = {"model": "m", "max_tokens": 8, "messages": [USER, {"role": "assistant", "content": content}]}
    r = httpx.post(f"{server.url}/v1/messages", json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("messages.1") and problem in message


def test_a_prefill_alone_needs_something_before_it(serve, mock_policy):
    server = serve(mock_policy(_recording([])))
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "assistant", "content": "Hi"}]}
    r = httpx.post(f"{server.url}/v1/messages", json=body)
    assert r.status_code == 400 and "before it" in r.json()["error"]["message"]
    seen: list[str] = []
    server = serve(mock_policy(_recording(seen)))
    assert httpx.post(f"{server.url}/v1/messages", json={**body, "system": "Greet."}).status_code == 200
    assert seen[0].endswith(HEADER + "Hi")


def test_an_empty_prefill_starts_the_turn(serve, mock_policy):
    seen: list[str] = []
    server = serve(mock_policy(_recording(seen)))
    for content in ("", []):
        r = httpx.post(f"{server.url}/v1/messages", json={
            "model": "m", "max_tokens": 8, "messages": [USER, {"role": "assistant", "content": content}]})
        assert r.status_code == 200, r.text
        assert seen[-1].endswith("Add 2 and 3.<|im_end|>\n" + HEADER)


def test_count_tokens_counts_the_prefill(tokenizer, serve, mock_policy):
    server = serve(mock_policy(_recording([])))

    def count(messages):
        r = httpx.post(f"{server.url}/v1/messages/count_tokens", json={"model": "m", "messages": messages})
        return r.raise_for_status().json()["input_tokens"]

    with_prefill = count([USER, {"role": "assistant", "content": PREFILL}])
    assert with_prefill == count([USER]) + len(tokenizer.encode(PREFILL, add_special_tokens=False))


def test_chat_completions_continue_final_message(serve, mock_policy):
    seen: list[str] = []
    server = serve(mock_policy(_recording(seen)))
    sid, key = _session(server.url)
    client = openai.OpenAI(base_url=f"{server.url}/sessions/{sid}/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(model="m", messages=[USER, {"role": "assistant", "content": PREFILL}],
                                           extra_body={"continue_final_message": True})
    assert reply.choices[0].message.content == " 5." and seen[0].endswith(HEADER + PREFILL)
    # without the flag the final assistant message is a finished turn, as OpenAI renders it
    client.chat.completions.create(model="m", messages=[USER, {"role": "assistant", "content": PREFILL}])
    assert seen[1].endswith(PREFILL + "<|im_end|>\n" + HEADER)
    history = [USER, {"role": "assistant", "content": PREFILL + " 5."}, {"role": "user", "content": "More?"}]
    nxt = client.chat.completions.create(model="m", messages=history)
    tree = _tree(server.url, sid)
    first = next(n for n in tree.nodes.values() if n.info["call_id"] == reply.id)
    [leaf] = [n for n in tree.nodes.values() if n.info["call_id"] == nxt.id]
    assert leaf.parent == first.id


@pytest.mark.parametrize("messages", [[USER], [USER, {"role": "assistant", "content": "x", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]])
def test_continue_final_message_needs_a_final_assistant_message_without_calls(serve, mock_policy, messages):
    server = serve(mock_policy(_recording([])))
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"model": "m", "messages": messages, "continue_final_message": True})
    assert r.status_code == 400 and "continue_final_message" in r.json()["error"]["message"], r.text


def test_a_context_continues_a_prefill_token_exactly(tokenizer):
    ctx = ChatContext(tokenizer, [USER])
    added = ctx.append_prefill(PREFILL)
    assert added == tokenizer.encode(PREFILL, add_special_tokens=False)
    with pytest.raises(ValueError, match="generation prompt"):
        ctx.fork().append_prefill("again")
    ctx.append_action(tokenizer.encode(" 5.<|im_end|>", add_special_tokens=False))
    assert ctx.messages[-1] == {"role": "assistant", "content": PREFILL + " 5."}
    with pytest.raises(ValueError, match="generation prompt"):  # after an action: no generation prompt
        ctx.fork().append_prefill("x")
    ctx.append_observation([{"role": "user", "content": "Thanks."}])
    assert ctx.prefix_stable and not ctx.mismatches  # the full re-render equals the tokens seen


@pytest.mark.parametrize("then", ["no prefill", "another prefill after a longer path"])
def test_a_prefill_dropped_or_changed_is_an_edit_not_a_compaction(serve, mock_policy, then):
    """The history [USER] after [USER] + prefill looked shorter than the recorded one, and a new
    prefill after [USER, reply, user] replaced the reply with a shorter history: both were taken
    for compactions, so the path the harness left got the session's reward."""
    server = serve(mock_policy(_recording([])))
    sid, _ = _session(server.url)
    client = _claude(server.url, sid)
    first = _ask(client, [USER, {"role": "assistant", "content": PREFILL}])
    left = first
    if then == "no prefill":
        last = _ask(client, [USER])
    else:
        left = _ask(client, [USER, {"role": "assistant", "content": PREFILL + " 5."},
                             {"role": "user", "content": "And 3 + 4?"}])
        last = _ask(client, [USER, {"role": "assistant", "content": "Five is"}])
    closed = RolloutTree.from_dict(httpx.post(f"{server.url}/sessions/{sid}/close").raise_for_status().json())
    by_call = {n.info["call_id"]: n for n in closed.nodes.values()}
    assert by_call[last.id].info["branch"]["reason"] == "edit"
    assert by_call[left.id].info.get("abandoned") is True and "continued_by" not in by_call[left.id].info


@pytest.mark.parametrize("path", ["messages", "chat"])
def test_a_prefill_right_after_another_assistant_message_is_joined_or_refused(serve, mock_policy, path):
    """Found by the wire fuzz: [assistant "", assistant "0"] was a 500 (the context was not at a
    generation prompt). Anthropic joins such turns, and so do Messages calls (one prefill); Chat
    Completions asks for them as one message."""
    server = serve(mock_policy(_recording([])))
    messages = [USER, {"role": "assistant", "content": "Let me see."}, {"role": "assistant", "content": "It is"}]
    if path == "messages":
        r = httpx.post(f"{server.url}/v1/messages", json={"model": "m", "max_tokens": 8, "messages": messages})
        assert r.status_code == 200 and r.json()["content"][0]["text"] == " 5.", r.text
        r = httpx.post(f"{server.url}/v1/messages", json={
            "model": "m", "max_tokens": 8, "messages": [{"role": "assistant", "content": ""}, messages[2]]})
        assert r.status_code == 400, r.text
    else:
        r = httpx.post(f"{server.url}/v1/chat/completions",
                       json={"model": "m", "messages": messages, "continue_final_message": True})
        assert r.status_code == 400 and "assistant message too" in r.json()["error"]["message"], r.text


def test_a_prefilled_reply_with_a_tool_call_keeps_its_leading_text(serve, mock_policy):
    """The text around calls was stripped: ' 5.' came back as '5.', and a harness that joins it
    to its prefill showed 'The sum is5.'."""
    call = '\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    server = serve(mock_policy(_recording([], " 5." + call)))
    tools = [{"name": "add", "description": "Add.", "input_schema": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]
    reply = _ask(_claude(server.url), [USER, {"role": "assistant", "content": PREFILL}], tools=tools)
    assert [b.type for b in reply.content] == ["text", "tool_use"] and reply.content[0].text == " 5."
    unprefilled = _ask(_claude(server.url), [USER], tools=tools)
    assert unprefilled.content[0].text == "5."  # a reply of its own is stripped as before
