"""The internal conversation: what every wire protocol's request becomes, and what the template sees.

Chat Completions requests are the internal conversation as they are
(``ChatRequest``: messages, tool calls with their ids, tool results); the
Responses and Anthropic Messages adapters (``responses_api``,
``anthropic_api``) translate theirs into one. From here on a call is the same
whatever protocol it came in. Four jobs, all on plain dicts:

- ``canonical_key``: a message as a comparable string. The proxy matches a
  call's history against what it recorded by these keys, so fields a harness
  may add or drop without changing the conversation (``refusal: null``, call
  ids it re-generates, ``content: null`` versus ``""``, text parts versus a
  string) do not break prefix reuse.
- ``template_messages``: the dicts handed to ``ChatContext``. A template that
  knows tools gets ``tools=`` and ``tool_calls`` as they are; any other one
  gets the tools described in the system message (``render_tools_prompt``,
  as native tool envs do) and past calls written back as text.
- ``response_message``: the assistant message returned for sampled text,
  with ``tool_calls`` parsed by ``agentrl.tools.parse``, each with a new id.
- ``rerendering``: whether a history's assistant message is a recorded reply
  that the harness sent back in another form (see ``sessions``).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from agentrl.tools.parse import parse_tool_calls, render_tools_prompt

from .schemas import ChatMessage, ChatRequest, ToolIn

__all__ = ["PromptSpec", "canonical", "canonical_key", "chain_keys", "cut_at_stop", "key_of", "prefill_key",
           "prompt_spec", "rerendering", "response_message"]

_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|\Z)", re.DOTALL)
# One encoder for every key: ``json.dumps`` with options builds a new one per call, and a
# call encodes every message of its history.
_KEYS = json.JSONEncoder(sort_keys=True, ensure_ascii=False)


def _args(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's limit
        return arguments  # kept as text: compared and rendered verbatim


def canonical(msg: ChatMessage | dict[str, Any]) -> dict[str, Any]:
    """The parts of a message that change the conversation."""
    m = msg if isinstance(msg, ChatMessage) else ChatMessage.model_validate(msg)
    role = "system" if m.role == "developer" else m.role
    out: dict[str, Any] = {"role": role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [{"name": c.function.name, "arguments": _args(c.function.arguments)}
                             for c in m.tool_calls]
    if role == "tool" and m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if role != "assistant" and m.name:
        out["name"] = m.name
    return out


def canonical_key(msg: ChatMessage | dict[str, Any]) -> str:
    return key_of(canonical(msg))


def key_of(canon: dict[str, Any]) -> str:
    """The key of a message already in canonical form."""
    return _KEYS.encode(canon)


def chain_keys(prefix_key: str, keys: list[str]) -> list[str]:
    """Hash chain: entry k names the conversation ``keys[:k+1]`` under ``prefix_key``."""
    out, h = [], prefix_key
    for k in keys:
        h = hashlib.blake2b((h + "\x00" + k).encode(), digest_size=16).hexdigest()
        out.append(h)
    return out


@dataclass(slots=True)
class PromptSpec:
    """How a chat request is rendered: template messages, template kwargs, and a key
    that differs whenever the same messages would render differently (tools).

    ``canon`` are the canonical messages (``keys`` are their encodings) and
    ``call_ids`` the tool-call ids each message carries (assistant messages
    only), for recognising recorded replies by the ids the proxy issued.
    """

    keys: list[str]
    template: list[dict[str, Any]]
    template_kwargs: dict[str, Any]
    render_key: str
    parse_tools: bool
    canon: list[dict[str, Any]] = field(default_factory=list)
    call_ids: list[tuple[str, ...]] = field(default_factory=list)
    single_call: bool = False
    prefill: str | None = None  # a final assistant message the reply continues (not in the fields above)


def _tool_choice_hint(choice: Any, single_call: bool = False) -> str:
    hint = ""
    if choice == "required":
        hint = "\nYou must call at least one tool in this reply."
    elif choice is not None and not isinstance(choice, str):
        hint = f"\nYou must call the tool {choice.function.get('name', '')!r} in this reply."
    if single_call:
        hint += "\nCall at most one tool in this reply."
    return hint


def _calls_as_text(calls: list[dict[str, Any]], style: str) -> str:
    blobs = [json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False)
             for c in calls]
    if style == "hermes":
        return "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blobs)
    return "\n".join(blobs)


def _to_template(c: dict[str, Any], native_tools: bool, style: str) -> dict[str, Any]:
    out = {"role": c["role"], "content": c["content"]}
    if "tool_calls" in c:
        if native_tools:
            out["tool_calls"] = [{"type": "function", "function": dict(t)} for t in c["tool_calls"]]
        else:
            text = _calls_as_text(c["tool_calls"], style)
            out["content"] = f"{c['content']}\n{text}" if c["content"] else text
    for k in ("tool_call_id", "name"):
        if k in c:
            out[k] = c[k]
    return out


def prompt_spec(req: ChatRequest, tokenizer: Any, style: str) -> PromptSpec:
    """Canonical keys and template rendering of a chat request's messages.

    With ``continue_final_message`` the final (assistant) message is the
    ``prefill``: the messages before it are rendered up to the generation
    prompt, and the prefill's text follows as the reply's start.
    """
    messages, prefill = req.messages, None
    if req.continue_final_message:
        messages, prefill = messages[:-1], messages[-1].text()
    canon = [canonical(m) for m in messages]
    keys = [_KEYS.encode(c) for c in canon]
    call_ids = [tuple(c.id for c in m.tool_calls if c.id) if m.role == "assistant" and m.tool_calls else ()
                for m in messages]
    template_src = getattr(tokenizer, "chat_template", None) or ""
    native_tools = "tools" in template_src
    tools = [t.function.model_dump() for t in (req.tools or [])]
    parse_tools = bool(tools) and req.tool_choice != "none"
    single = parse_tools and req.parallel_tool_calls is False
    hint = _tool_choice_hint(req.tool_choice, single)
    kwargs: dict[str, Any] = {}
    msgs = [_to_template(c, native_tools, style) for c in canon]
    if tools and native_tools:
        kwargs["tools"] = [ToolIn(function=t).model_dump() for t in tools]  # type: ignore[arg-type]
    elif tools:
        prompt = render_tools_prompt(tools, style=style) + hint  # type: ignore[arg-type]
        if msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{prompt}"}
        else:
            msgs.insert(0, {"role": "system", "content": prompt})
    render = json.dumps({"tools": tools, "choice": hint, "style": style}, sort_keys=True)
    return PromptSpec(keys, msgs, kwargs, render, parse_tools, canon, call_ids, single, prefill)


def prefill_key(text: str) -> str:
    """The key of a prefill: unlike a finished assistant message's, since the reply continues it."""
    return key_of({"role": "assistant", "prefill": text})


def cut_at_stop(text: str, stops: tuple[str, ...], keep: bool) -> str:
    """OpenAI semantics: the text ends before the first stop string (or after it, with ``keep``)."""
    hits = [(i, len(s)) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text
    i, n = min(hits)
    return text[:i + n] if keep else text[:i]


def response_message(text: str, parse_tools: bool, id_prefix: str = "call_",
                     single_call: bool = False, prefilled: bool = False) -> tuple[dict[str, Any], bool]:
    """The assistant message for sampled ``text``, and whether it calls tools.

    Each call gets a new id (``id_prefix`` + hex: ``call_`` for OpenAI,
    ``toolu_`` for Anthropic). ``single_call`` (``parallel_tool_calls: false``)
    keeps the first call only; the tokens keep what was sampled. The text around
    the calls is stripped, except at its start where it continues a prefill
    (``prefilled``): the harness joins the two.
    """
    if parse_tools:
        parsed = parse_tool_calls(text)
        if parsed.calls:
            kept = parsed.calls[:1] if single_call else parsed.calls
            calls = [{"id": f"{id_prefix}{secrets.token_hex(12)}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                     for c in kept]
            content = _BLOCK.sub("", text).rstrip() if "<tool_call>" in text else ""
            content = content if prefilled and content.strip() else content.lstrip()
            return {"role": "assistant", "content": content or None, "tool_calls": calls}, True
    return {"role": "assistant", "content": text}, False


# -- recognising a recorded reply that comes back in another form -------------------------
_SPACE = re.compile(r"\s+")


def _squash(text: str) -> str:
    return _SPACE.sub(" ", text).strip()


def _squashed(msg: dict[str, Any]) -> dict[str, Any]:
    """A canonical message with whitespace runs collapsed, in text and in string arguments."""
    def norm(v: Any) -> Any:
        if isinstance(v, str):
            return _squash(v)
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        if isinstance(v, list):
            return [norm(x) for x in v]
        return v
    return norm({k: msg.get(k) for k in ("role", "content", "tool_calls")})


def _spelled(value: Any) -> list[str]:
    """The strings a text rendering of an argument value must contain."""
    if isinstance(value, str):
        return [_squash(value)] if value.strip() else []
    if isinstance(value, dict):
        return [s for v in value.values() for s in _spelled(v)]
    if isinstance(value, list):
        return [s for v in value for s in _spelled(v)]
    return [json.dumps(value)]


def rerendering(msg: dict[str, Any], reply: dict[str, Any], issued: tuple[str, ...]) -> str | None:
    """How the assistant message ``msg`` (canonical, with the ids it carries folded into
    ``msg["ids"]``) is the recorded ``reply`` in another form; None if it is not.

    - ``"ids"``: it names a tool-call id the proxy issued for that reply, as a
      call id or inside its text ("Calling tools: [{'id': 'call_…', …}]");
    - ``"whitespace"``: the same text and calls once whitespace runs are collapsed;
    - ``"text"``: the calls written out as text: every recorded call's name and
      argument values, and the reply's own text, appear in its text.
    """
    if msg.get("role") != "assistant" or reply.get("role") != "assistant":
        return None
    text = msg.get("content") or ""
    if issued and (set(issued) & set(msg.get("ids", ())) or any(i in text for i in issued)):
        return "ids"
    if _squashed(msg) == _squashed(reply):
        return "whitespace"
    calls = reply.get("tool_calls") or []
    if calls and not msg.get("tool_calls"):
        flat = _squash(text)
        needed = [_squash(reply.get("content") or "")] + [
            s for c in calls for s in [c["name"], *_spelled(c["arguments"])]]
        if all(s in flat for s in needed if s):
            return "text"
    return None
