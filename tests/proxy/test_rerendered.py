"""A harness that sends a recorded reply back in its own form keeps the episode's credit.

Scripted harnesses over Chat Completions, each making two calls: the second
sends the first call's reply back re-rendered (its tool call as text, with or
without the id the proxy issued; its whitespace reformatted) and the tool's
result as a user message. The proxy must recognise the reply: the second call
is a ``rerendered`` branch recorded on the harness's rendering, the first call
is continued (not abandoned), and the session's reward reaches both paths.
Sent back unchanged (ids and all), the chain stays one token-exact path.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from agentrl.chat import ChatContext, decode_ids
from agentrl.types import RolloutTree

TOOLS = [{"type": "function", "function": {
    "name": "run_command", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "run_command", "arguments": {"command": "ls -la /srv"}}\n</tool_call>'
OPENING = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "List /srv."}]


def _script(prompt: str) -> str:
    return "The folder holds a.txt." if "a.txt" in prompt else CALL


def _session(url: str) -> tuple[str, dict[str, str]]:
    s = httpx.post(f"{url}/sessions").json()
    return f"{url}/sessions/{s['session_id']}", {"Authorization": f"Bearer {s['api_key']}"}


def _chat(base: str, headers: dict[str, str], messages: list[dict[str, Any]]) -> dict[str, Any]:
    r = httpx.post(f"{base}/v1/chat/completions", headers=headers,
                   json={"model": "m", "messages": messages, "tools": TOOLS})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def _episode(url: str, rewrite: Any) -> tuple[RolloutTree, dict[str, Any]]:
    """Two calls; ``rewrite(reply)`` is the history the harness sends after the first reply."""
    base, headers = _session(url)
    reply = _chat(base, headers, OPENING)
    _chat(base, headers, OPENING + rewrite(reply))
    httpx.post(f"{base}/reward", json={"reward": 1.0})
    return RolloutTree.from_dict(httpx.post(f"{base}/close").json()), reply


def _calls_as_text(reply: dict[str, Any]) -> str:
    """smolagents-style: the calls written back as the assistant's text, ids included."""
    return "Calling tools:\n" + str([{"id": c["id"], "type": "function", "function": c["function"]}
                                     for c in reply["tool_calls"]])


STYLES = {
    # the tool call written out as text, with the id the proxy issued
    "ids": lambda r: [{"role": "assistant", "content": _calls_as_text(r)},
                      {"role": "user", "content": "Observation: a.txt"}],
    # the tool call written out in the harness's own words, no id
    "text": lambda r: [{"role": "assistant", "content": "Action: run_command(command='ls -la /srv')"},
                       {"role": "user", "content": "Observation: a.txt"}],
}


@pytest.mark.parametrize("style", sorted(STYLES))
def test_a_reply_rewritten_as_text_keeps_the_episodes_credit(serve, mock_policy, tokenizer, style):
    server = serve(mock_policy(_script))
    tree, _ = _episode(server.url, STYLES[style])
    first, second = sorted(tree.nodes.values(), key=lambda n: n.id)
    branch = second.info["branch"]
    assert branch["reason"] == "rerendered" and branch["by"] == style and branch["continues"] == [first.id]
    assert branch["from_call"] == first.info["call_id"]
    # Recorded on what the model was shown: the harness's rendering, after the first call's prompt.
    assert second.parent == first.parent is None
    assert second.context_ids[:len(first.context_ids)] == first.context_ids
    shown = decode_ids(tokenizer, second.context_ids[len(first.context_ids):])
    assert ("Calling tools" if style == "ids" else "Action: run_command") in shown and "a.txt" in shown
    # Not abandoned: the first call's path is continued, and the session's reward reaches it.
    assert not first.info.get("abandoned") and first.info["continued_by"] == second.info["call_id"]
    assert [leaf.reward for leaf in tree.leaves()] == [1.0, 1.0]
    assert not any(leaf.truncated for leaf in tree.leaves())


def test_a_reply_sent_back_with_its_ids_reuses_the_recorded_tokens(serve, mock_policy, tokenizer):
    server = serve(mock_policy(_script))

    def with_ids_other_text(reply: dict[str, Any]) -> list[dict[str, Any]]:
        # The same call id, its arguments re-serialized and a note added: still the recorded reply.
        call = reply["tool_calls"][0]
        args = json.dumps(json.loads(call["function"]["arguments"]), indent=2)
        return [{"role": "assistant", "content": "I will list it.",
                 "tool_calls": [{**call, "function": {**call["function"], "arguments": args}}]},
                {"role": "tool", "tool_call_id": call["id"], "content": "a.txt"}]

    tree, _ = _episode(server.url, with_ids_other_text)
    first, second = sorted(tree.nodes.values(), key=lambda n: n.id)
    assert second.parent == first.id and "branch" not in second.info  # one token-exact path
    assert "a.txt" in decode_ids(tokenizer, second.context_ids)
    assert "I will list it" not in decode_ids(tokenizer, second.context_ids)  # the recorded tokens stand
    assert [leaf.reward for leaf in tree.leaves()] == [1.0]


def test_whitespace_reformatted_text_reply_is_recognised(serve, mock_policy):
    text = "First line.\n\n  Second   line.  "
    server = serve(mock_policy(lambda p: "Bye." if "ok" in p else text))
    base, headers = _session(server.url)
    _chat(base, headers, OPENING)
    _chat(base, headers, [*OPENING, {"role": "assistant", "content": "First line. Second line."},
                          {"role": "user", "content": "ok"}])
    httpx.post(f"{base}/reward", json={"reward": 1.0})
    tree = RolloutTree.from_dict(httpx.post(f"{base}/close").json())
    second = max(tree.nodes.values(), key=lambda n: n.id)
    assert second.info["branch"]["reason"] == "rerendered" and second.info["branch"]["by"] == "whitespace"
    assert [leaf.reward for leaf in tree.leaves()] == [1.0, 1.0]


def test_another_reply_in_its_place_is_not_a_rerendering(serve, mock_policy):
    """Control: a harness that replaces the reply with something else left the recorded path."""
    server = serve(mock_policy(_script))
    tree, _ = _episode(server.url, lambda r: [{"role": "assistant", "content": "Action: cat /etc/hosts"},
                                              {"role": "user", "content": "Observation: a.txt"}])
    first, second = sorted(tree.nodes.values(), key=lambda n: n.id)
    assert second.info["branch"]["reason"] != "rerendered"
    assert first.info.get("abandoned") and first.reward == 0.0 and second.reward == 1.0


def test_append_reply_as_context_renders_what_a_full_render_shows(tokenizer):
    """The reply's tokens after a generation prompt are the template's, less the assistant header."""
    ctx = ChatContext(tokenizer, OPENING)
    later = [{"role": "assistant", "content": "Action: ls"}, {"role": "user", "content": "Observation: a.txt"}]
    added = ctx.append_reply_as_context(later)
    assert ctx.ids[-len(added):] == added
    full = tokenizer.apply_chat_template([*OPENING, *later], tokenize=False, add_generation_prompt=True)
    assert decode_ids(tokenizer, ctx.ids) == full
    with pytest.raises(ValueError, match="assistant message first"):
        ctx.append_reply_as_context([{"role": "user", "content": "no reply first"}])


def test_harness_training_credits_both_calls_of_a_rerendered_session_with_its_outcome(serve, mock_policy):
    """In a group, the won session's first call (re-rendered by the harness) trains toward the
    win, as its second call does, and the lost session's call toward the loss."""
    from agentrl.credit import assign
    from agentrl.proxy import merge_sessions

    server = serve(mock_policy(_script))
    won, _ = _episode(server.url, STYLES["ids"])
    base, headers = _session(server.url)
    _chat(base, headers, OPENING)
    httpx.post(f"{base}/reward", json={"reward": 0.0})
    lost = RolloutTree.from_dict(httpx.post(f"{base}/close").json())
    group = merge_sessions([won, lost], {"task": 0})
    items = assign([group], "grpo")
    by_call = {ep.nodes[-1].info["call_id"]: set(adv[i] for i, m in enumerate(ep.loss_mask) if m)
               for ep, adv in items}
    first, second = (n.info["call_id"] for n in sorted(won.nodes.values(), key=lambda n: n.id))
    [loser] = [n.info["call_id"] for n in lost.nodes.values()]
    assert len(items) == 3  # the won session's two paths, the lost one's
    assert all(a > 0 for a in by_call[first] | by_call[second]) and all(a < 0 for a in by_call[loser])
