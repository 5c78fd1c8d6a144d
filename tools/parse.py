"""Tool calls in model text: parse them, and render tools and results as prompt text.

Two formats are read:

- ``hermes`` (Hermes / Qwen): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks. An unterminated block is accepted, at the end of the text (generation
  often stops on ``</tool_call>``) or before the next ``<tool_call>``. A tag inside
  a JSON string (code that mentions one) does not end its block.
- ``json`` (OpenAI-style, bare): JSON objects anywhere in the text, shaped
  ``{"name": ..., "arguments": ...}``, ``{"name": ..., "parameters": ...}`` or
  ``{"type": "function", "function": {"name": ..., "arguments": ...}}``.

In both, ``arguments`` may be an object or a JSON string holding one. With
``style="auto"`` the hermes format wins when the text holds a ``<tool_call>``
tag; otherwise bare JSON is read.

``parse_tool_calls`` never raises: what it cannot read becomes a message in
``ParseResult.errors``, written for the model to fix its next call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from agentrl.types import ToolCall, ToolSpec

__all__ = [
    "ParseResult",
    "Style",
    "parse_tool_calls",
    "render_tool_results",
    "render_tools_prompt",
]

Style = Literal["hermes", "json"]

MAX_PARSE_CHARS = 200_000  # longer text is cut before parsing; calls live near the start
MAX_CALLS = 128  # calls read from one reply (ToolEnv runs max_calls_per_turn of them); the rest are counted
MAX_ERRORS = 16  # problems listed for one reply; the rest are counted
MAX_JSON_ATTEMPTS = 256
# Chars that bare-JSON decoding may read in all: each "{" is decoded from there on, so
# 256 nested starts of one long broken array read it 256 times (3.9 s for 200 KB).
MAX_SCAN_CHARS = 5 * MAX_PARSE_CHARS
MAX_SPANS = 16  # blocks cut short by a tag in a string that are decoded from the text itself
MAX_NAME_CHARS = 128  # bound on raw_decode tries when scanning for bare JSON
# A block ends at its closing tag, at the next opening tag (models drop the
# closing tag between calls) or at the end of the text.
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|(?=<tool_call>)|\Z)", re.DOTALL)
_FENCE_OPEN = re.compile(r"```[a-zA-Z]*")
# A bare object that starts like a call; used to report broken JSON as an error.
_CALL_START = re.compile(r'\{\s*"(?:name|function)"\s*:')
# The ids a call may bring (OpenAI's call_..., Anthropic's toolu_..., Mistral's); another
# is replaced, as each tool message echoes it into the prompt the template renders.
_CALL_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_HERMES_EXAMPLE = '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>'


def _no_constant(name: str) -> Any:
    """Python's json reads NaN and Infinity; JSON has neither, and no client could read them back."""
    raise ValueError(f"{name} is not JSON (write a number or a string)")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_JSON_EXAMPLE = '{"name": "TOOL", "arguments": {...}}'


@dataclass(slots=True)
class ParseResult:
    """Calls read from one action, plus a message for each part that could not be read."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # While parsing: the ids taken, and what went past MAX_CALLS and MAX_ERRORS.
    _ids: set[str] = field(default_factory=set, init=False, repr=False, compare=False)
    _unread_calls: int = field(default=0, init=False, repr=False, compare=False)
    _unlisted_errors: int = field(default=0, init=False, repr=False, compare=False)

    @property
    def attempted(self) -> bool:
        """True when the text tried to call a tool, successfully or not."""
        return bool(self.calls or self.errors)

    def _error(self, message: str) -> None:
        """List ``message``, or count it past ``MAX_ERRORS``: 9,000 empty blocks made 1 MB of errors."""
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(message)
        else:
            self._unlisted_errors += 1

    def _close(self) -> None:
        """Say what was left out, once parsing is done."""
        if self._unread_calls:
            self.errors.append(f"{self._unread_calls} more tool calls were not read: at most "
                               f"{MAX_CALLS} are read from one reply")
        if self._unlisted_errors:
            self.errors.append(f"{self._unlisted_errors} more problems like these were not listed")


def _short(err: Exception) -> str:
    return str(err).split("\n", 1)[0][:200]


def _is_unicode_text(value: Any) -> bool:
    """False when ``value`` holds a lone surrogate: JSON may write ``"\\ud800"``,
    which decodes to a str no UTF-8 encoder (a file, a process, a tokenizer) takes."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _call_from_obj(obj: Any, index: int) -> ToolCall | str:
    """A ``ToolCall`` from one decoded JSON value, or an error message."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object, got {type(obj).__name__}"
    if isinstance(obj.get("function"), dict):  # OpenAI {"type": "function", "function": {...}}
        call_id = obj.get("id")
        obj = obj["function"]
    else:
        call_id = obj.get("id")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return 'a tool call needs a "name" string naming the tool'
    if len(name) > MAX_NAME_CHARS:
        return f"the tool name is longer than {MAX_NAME_CHARS} characters"
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        if not args.strip():
            args = {}
        else:
            try:
                args = _DECODER.decode(args)
            except (ValueError, RecursionError) as err:
                return f'tool {name!r}: "arguments" is a string but not valid JSON ({_short(err)})'
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f'tool {name!r}: "arguments" must be a JSON object, got {type(args).__name__}'
    if not _is_unicode_text([name, args, call_id]):
        return (
            f"tool {name!r}: the call holds a lone surrogate escape (such as \\ud800), which is "
            "not valid Unicode; write the character itself or a complete surrogate pair"
        )
    cid = call_id if isinstance(call_id, str) and _CALL_ID.fullmatch(call_id) else f"call_{index}"
    return ToolCall(id=cid, name=name.strip(), arguments=args)


def _add(result: ParseResult, obj: Any, where: str) -> None:
    if len(result.calls) >= MAX_CALLS:
        result._unread_calls += 1
        return
    out = _call_from_obj(obj, len(result.calls))
    if isinstance(out, ToolCall):
        # Each result answers one id: a repeated one (the model's, or its own id
        # that matches a generated one) gets the first free ``call_<n>``.
        n = len(result.calls)
        while out.id in result._ids:
            out.id, n = f"call_{n}", n + 1
        result._ids.add(out.id)
        result.calls.append(out)
    else:
        result._error(f"{where}: {out}")


def _unfenced(body: str) -> str:
    """``body`` (stripped) without a Markdown code fence around it (```json ... ```).
    String tests, not a regex: ``\\s*```$`` was tried at every position of the body,
    quadratic in a run of whitespace (100 KB of spaces took 33 s)."""
    if body.startswith("```"):
        body = body[_FENCE_OPEN.match(body).end():]  # type: ignore[union-attr]
    if body.endswith("```"):
        body = body[:-3]
    return body.strip()


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _json_across_tags(text: str, start: int, block_end: int) -> tuple[Any, int | None, int]:
    """Decode the JSON at ``start`` (just after a ``<tool_call>`` tag) from the text itself, not
    from the block the tags cut: an argument string may hold a tag ("</tool_call>" in code being
    written). (value, where parsing goes on, chars read); where is None when the JSON is
    broken, ends inside its block (the block's own error stands) or is followed by more
    than a tag."""
    j = start
    while j < block_end and text[j].isspace():
        j += 1
    if j >= block_end or text[j] not in "{[":
        return None, None, 0
    try:
        obj, end = _DECODER.raw_decode(text, j)
    except (ValueError, RecursionError) as err:
        return None, None, _chars_read(err, text, j)
    if end <= block_end:
        return None, None, end - j
    after = end
    while after < len(text) and text[after].isspace():
        after += 1
    if after < len(text) and not text.startswith((_OPEN, _CLOSE), after):
        return None, None, after - j
    return obj, after + len(_CLOSE) if text.startswith(_CLOSE, after) else after, after - j


def _parse_hermes(text: str, result: ParseResult) -> None:
    pos, n, read, spans = 0, 0, 0, 0
    while (m := _BLOCK.search(text, pos)) is not None:
        n, pos = n + 1, m.end()
        body = _unfenced(m.group(1).strip())
        where = f"tool call {n}"
        if not body:
            result._error(f"{where}: empty <tool_call> block. Write {_HERMES_EXAMPLE}")
            continue
        try:
            obj, end = _DECODER.raw_decode(body)
            extra = body[end:].strip()  # often a stray closing brace
            problem = (f"text after the JSON object: {extra[:40]!r}. Put only the object between "
                       f"the tags: {_HERMES_EXAMPLE}") if extra else ""
        except (ValueError, RecursionError) as err:
            problem = f"invalid JSON ({_short(err)}). Write {_HERMES_EXAMPLE}"
        # A tag inside a string may have cut the block short. Each try decodes the whole text
        # from the tag (and an error counts its lines up to where it failed), so they are few.
        if problem and read < MAX_SCAN_CHARS and spans < MAX_SPANS:
            value, resume, chars = _json_across_tags(text, m.start(1), m.end(1))
            read, spans = read + chars, spans + 1
            if resume is not None:
                obj, pos, problem = value, resume, ""
        if problem:
            result._error(f"{where}: {problem}")
            continue
        items = obj if isinstance(obj, list) and obj else [obj]
        for item in items:
            _add(result, item, where)


def _is_call_shaped(obj: Any) -> bool:
    if not isinstance(obj, dict):
        return False
    if isinstance(obj.get("function"), dict):
        return "name" in obj["function"]
    return "name" in obj and ("arguments" in obj or "parameters" in obj)


def _chars_read(err: BaseException, text: str, start: int) -> int:
    """About how many chars a failed decode from ``start`` read: up to where it failed, or
    the rest of the text where the error does not say (an unterminated string is read to
    the end, and its error points at the string's start)."""
    if isinstance(err, json.JSONDecodeError) and not err.msg.startswith("Unterminated string"):
        return err.pos - start + 1
    return len(text) - start


def _parse_bare_json(text: str, result: ParseResult) -> None:
    """Decode from each "{" in turn, within ``MAX_JSON_ATTEMPTS`` tries and ``MAX_SCAN_CHARS``
    chars read; past either, the rest of the text is not read (as if it held no call)."""
    decoder = _DECODER
    pos, attempts, read = 0, 0, 0
    while attempts < MAX_JSON_ATTEMPTS and read < MAX_SCAN_CHARS:
        start = text.find("{", pos)
        if start < 0:
            return
        attempts += 1
        try:
            obj, end = decoder.raw_decode(text, start)
            read += end - start
        except (ValueError, RecursionError) as err:
            read += _chars_read(err, text, start)
            if _CALL_START.match(text, start):
                result._error(
                    f"tool call at character {start}: invalid JSON ({_short(err)}). "
                    f"Write {_JSON_EXAMPLE}"
                )
            pos = start + 1
            continue
        if _is_call_shaped(obj):
            _add(result, obj, f"tool call at character {start}")
            pos = end
        else:
            pos = start + 1  # a call may sit inside this object, e.g. {"tool_calls": [...]}


def parse_tool_calls(text: Any, style: Literal["auto", "hermes", "json"] = "auto") -> ParseResult:
    """Read the tool calls in ``text``; never raises.

    Calls get ids ``call_0``, ``call_1``, ... unless the JSON carries an ``id`` of 1 to
    64 letters, digits or ``_.:-``; ids are unique within the result.
    """
    result = ParseResult()
    if not isinstance(text, str):
        result._error(f"the action must be text, got {type(text).__name__}")
        return result
    text = text[:MAX_PARSE_CHARS]
    try:
        if style == "hermes" or (style == "auto" and "<tool_call>" in text):
            _parse_hermes(text, result)
        elif style in ("json", "auto"):
            _parse_bare_json(text, result)
        else:
            result._error(f"unknown tool-call style {style!r}; use 'hermes' or 'json'")
    except RecursionError:  # deeply nested values inside an otherwise valid object
        result._error("a tool call is nested too deeply to read")
    result._close()
    return result


def render_tools_prompt(
    specs: list[ToolSpec] | list[dict[str, Any]],
    style: Style = "hermes",
    final_answer_hint: str = "When you are done, reply with your final answer and no tool call.",
) -> str:
    """System-prompt text that lists the tools and says how to call them."""
    dumped = [s.model_dump() if isinstance(s, ToolSpec) else dict(s) for s in specs]
    lines = [json.dumps({"type": "function", "function": d}, ensure_ascii=False) for d in dumped]
    if style == "hermes":
        return (
            "# Tools\n\n"
            "You can call the tools listed between <tools> and </tools>, one JSON schema a line:\n"
            "<tools>\n" + "\n".join(lines) + "\n</tools>\n\n"
            "To call a tool, write a JSON object with the tool's name and its arguments "
            "between <tool_call> and </tool_call>:\n"
            '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments as JSON>}}\n'
            "</tool_call>\n"
            "You may make several calls in one reply. Each result comes back between "
            "<tool_response> and </tool_response>.\n" + final_answer_hint
        )
    if style == "json":
        return (
            "# Tools\n\nYou can call these tools (JSON schemas, one a line):\n"
            + "\n".join(lines)
            + "\n\nTo call a tool, reply with a JSON object: "
            '{"name": "<tool name>", "arguments": {<arguments as JSON>}}. '
            "Each result comes back as a JSON object with the call's name and content.\n"
            + final_answer_hint
        )
    raise ValueError(f"unknown tool-call style {style!r}; use 'hermes' or 'json'")


def render_tool_results(results: list[tuple[str, str, str]], style: Style = "hermes") -> str:
    """Observation text for ``(call_id, tool_name, content)`` triples, in call order.

    ``hermes`` puts each raw result between ``<tool_response>`` tags, as Qwen's
    chat template does for tool messages; ``json`` writes one JSON object a line.
    """
    if style == "hermes":
        return "\n".join(f"<tool_response>\n{c}\n</tool_response>" for _, _, c in results)
    return "\n".join(
        json.dumps({"id": i, "name": n, "content": c}, ensure_ascii=False) for i, n, c in results
    )
