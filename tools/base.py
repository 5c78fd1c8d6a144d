"""The ``Tool`` base class: a name, a description, a pydantic ``Args`` model and
an async ``__call__(args, sandbox) -> ToolResult``.

A tool reports mistakes the model can fix (a missing file, a bad expression) as
a ``ToolResult`` with ``is_error=True``. It raises only for failures outside the
model's control: ``SandboxError`` (the sandbox died) or ``ToolError``; the
``ToolEnv`` then fails the episode and records the reason.

``Tool.invoke(arguments, sandbox)`` is the entry point for raw model arguments:
it validates them against ``Args`` (a readable error result on failure), runs the
tool and caps the output size.

A tool that keeps state outside the sandbox's files (the ``python`` tool's
interpreter) implements ``snapshot_state``/``restore_state``, so that a
restored ``ToolEnv`` continues as the original did.

``ToolEnv`` stops a call after ``call_timeout_s``, but only at an ``await``: an
async tool body that blocks (``time.sleep``, a CPU loop) stalls the event loop
every env shares. A plain ``def`` tool runs on a daemon thread of its own
instead: it blocks no other episode, and one that times out is answered with
the error while its thread finishes (a thread cannot be killed) without
holding up later calls or the process's exit. Concurrent episodes call it on
concurrent threads, so state it shares across calls needs a lock.

The ``@tool`` decorator makes a tool from a function whose first parameter is
annotated with a pydantic model::

    class AddArgs(BaseModel):
        a: int = Field(description="first addend")
        b: int = Field(description="second addend")

    @tool(description="Add two integers.")
    def add(args: AddArgs) -> str:
        return str(args.a + args.b)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import json
import math
import numbers
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, get_type_hints

from pydantic import BaseModel, ConfigDict, ValidationError

from agentrl.errors import ConfigError
from agentrl.types import ToolSpec

if TYPE_CHECKING:
    from agentrl.sandboxes.base import Sandbox

__all__ = [
    "DEFAULT_MAX_OUTPUT_CHARS",
    "FunctionTool",
    "NoArgs",
    "Tool",
    "ToolResult",
    "as_text",
    "format_validation_error",
    "tool",
    "tool_problem",
    "truncate_middle",
]

DEFAULT_MAX_OUTPUT_CHARS = 8_000


@dataclass(slots=True)
class ToolResult:
    """What one tool call returned: the text shown to the model and an error flag."""

    content: str
    is_error: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def error(cls, message: str, **metadata: Any) -> ToolResult:
        return cls(content=message, is_error=True, metadata=dict(metadata))


class NoArgs(BaseModel):
    """Arguments of a tool that takes none."""

    model_config = ConfigDict(extra="forbid")


def as_text(value: Any) -> str:
    """What a tool returned, as the text the model reads: None is empty, bytes are
    decoded as UTF-8 (bad bytes replaced), dicts and lists are JSON, and anything
    else is ``str(value)``. A lone surrogate is written as its escape (``\\udcff``)."""
    if isinstance(value, str):
        return _unicode(value)
    if value is None:
        return ""
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, dict | list | tuple):
        return _unicode(json.dumps(value, ensure_ascii=False, default=str))
    return _unicode(str(value))


def _unicode(text: str) -> str:
    """``text`` with each lone surrogate written as its escape. Python strs may hold them
    (``os.listdir`` gives undecodable bytes of a name as ``\\udc..``), UTF-8 cannot: the
    engine refuses such an observation and fails the episode (``agentrl.env.answer_problem``)."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", errors="backslashreplace").decode("utf-8")
    return text


def positive_setting(owner: str, name: str, value: Any, *, whole: bool = False) -> Any:
    """``value`` of the constructor setting ``name`` of the tool class ``owner``: a finite
    number > 0 (a whole one with ``whole``), as a Python float (int), or a ``ConfigError``
    naming both. A bad one failed only at the first call, as the episode's failure."""
    kind = numbers.Integral if whole else numbers.Real
    ok = isinstance(value, kind) and not isinstance(value, bool)  # numpy bools are not numbers.Real
    if not ok or not math.isfinite(value) or value <= 0:
        what = "whole number" if whole else "finite number"
        raise ConfigError(f"{owner}({name}=...) must be a {what} > 0, not {value!r:.80}")
    return int(value) if whole else float(value)


def truncate_middle(text: str, limit: int) -> str:
    """``text`` cut to at most about ``limit`` chars, keeping its head and tail.

    The marker says how much was dropped, so the model knows output is missing.
    """
    if limit <= 0 or len(text) <= limit:
        return text
    marker = f"\n[... {len(text) - limit} characters truncated ...]\n"
    head = max(0, (limit * 2) // 3)
    tail = max(0, limit - head)
    return text[:head] + marker + (text[-tail:] if tail else "")


def format_validation_error(tool_name: str, err: ValidationError) -> str:
    """A short, model-readable account of why arguments failed validation."""
    lines = [f"Invalid arguments for tool {tool_name!r}:"]
    for e in err.errors(include_url=False)[:10]:
        loc = ".".join(str(p) for p in e.get("loc", ())) or "(arguments)"
        lines.append(f"- {loc}: {e.get('msg', 'invalid')}")
    return "\n".join(lines)


def _schema(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAI-style JSON schema of an ``Args`` model (no pydantic titles)."""

    def strip(node: Any, in_props: bool = False) -> Any:
        # Drop pydantic's "title" keys (noise for the model) but keep a
        # property that happens to be named "title".
        if isinstance(node, dict):
            return {
                k: strip(v, in_props=(k == "properties" and not in_props))
                for k, v in node.items()
                if in_props or k != "title"
            }
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    out = strip(model.model_json_schema())
    out.setdefault("type", "object")
    out.setdefault("properties", {})
    if _refuses_unknown_keys(model):
        out.setdefault("additionalProperties", False)
    return out


def _refuses_unknown_keys(model: type[BaseModel]) -> bool:
    """True when ``model`` leaves ``extra`` unset. Pydantic then drops unknown keys
    silently, and the model would believe an argument it made up was honoured;
    ``invoke`` refuses them instead. An explicit ``extra`` setting is respected."""
    return model.model_config.get("extra") is None


def _unknown_keys(model: type[BaseModel], arguments: dict[str, Any]) -> list[str]:
    """The keys of ``arguments`` that no field of ``model`` reads."""
    known: set[str] = set()
    for name, f in model.model_fields.items():
        known.add(name)
        for alias in (f.alias, f.validation_alias):
            if isinstance(alias, str):
                known.add(alias)
            elif alias is not None:  # AliasChoices or AliasPath: leave it to pydantic
                return []
    return [k for k in arguments if k not in known]


def _not_unicode(arguments: dict[str, Any]) -> list[str]:
    """The keys of ``arguments`` whose key or value holds a lone surrogate (``"\\ud800"``):
    no UTF-8 encoder (a file, a process) takes it, so ``write_file`` raised."""
    bad = []
    for key, value in arguments.items():
        try:
            text = json.dumps([key, value], ensure_ascii=False, default=str)
        except (ValueError, TypeError, RecursionError):  # not JSON data: left to pydantic
            continue
        if not text.isascii() and _unicode(text) != text:
            bad.append(str(key))
    return bad


def _checked_args(t: Tool, arguments: dict[str, Any]) -> BaseModel | ToolResult:
    """``arguments`` as ``t.Args``, or an error result naming each bad field."""
    head = f"Invalid arguments for tool {t.name!r}:\n"
    if bad := _not_unicode(arguments):
        return ToolResult.error(head + "".join(
            f"- {k}: holds a lone surrogate (such as \\ud800), which is not valid Unicode; write "
            "the character itself or a complete surrogate pair\n" for k in bad[:10]))
    if _refuses_unknown_keys(t.Args) and (unknown := _unknown_keys(t.Args, arguments)):
        takes = ", ".join(t.Args.model_fields) or "no arguments"
        return ToolResult.error(head + "".join(
            f"- {k}: not an argument of this tool (it takes: {takes})\n" for k in unknown[:10]))
    try:
        return t.Args.model_validate(arguments)
    except ValidationError as err:
        return ToolResult.error(format_validation_error(t.name, err))


class Tool:
    """A tool the model can call. Subclasses set ``name``, ``description``,
    ``Args`` and implement ``__call__``.

    ``needs_sandbox`` tells the env whether to lease a sandbox for this tool.
    ``max_output_chars`` caps what one call returns (head and tail are kept).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Args: ClassVar[type[BaseModel]] = NoArgs
    needs_sandbox: ClassVar[bool] = False
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS

    def spec(self) -> ToolSpec:
        """The schema the model is shown."""
        return ToolSpec(name=self.name, description=self.description, parameters=_schema(self.Args))

    async def __call__(self, args: Any, sandbox: Sandbox | None) -> ToolResult:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")

    async def invoke(self, arguments: dict[str, Any], sandbox: Sandbox | None) -> ToolResult:
        """Validate raw ``arguments``, run the tool and cap its output.

        Invalid arguments give an error result naming each bad field, each one
        holding a lone surrogate, and each unknown one unless ``Args`` sets ``extra``
        itself. Every result is capped, argument errors too. Errors
        outside the model's control (``SandboxError``, ``ToolError``) propagate.
        """
        args = _checked_args(self, arguments)
        result = args if isinstance(args, ToolResult) else await self(args, sandbox)
        if not isinstance(result, ToolResult):
            result = ToolResult(content=as_text(result))
        result.content = as_text(result.content)
        if len(result.content) > self.max_output_chars:  # argument errors too: they echo keys
            result.metadata["truncated_from"] = len(result.content)
            result.content = truncate_middle(result.content, self.max_output_chars)
        return result

    async def release(self, sandbox: Sandbox) -> None:
        """Drop any state this tool keeps for ``sandbox`` (called when an episode ends)."""

    def close(self) -> None:
        """Free what this tool holds across episodes (the calculator's worker process). A
        ``ToolEnv`` calls it on close for the tools it made from names; a later call may
        start them again."""

    async def snapshot_state(self, sandbox: Sandbox) -> Any:
        """Plain data from which ``restore_state`` rebuilds what this tool keeps for
        ``sandbox`` outside its files (a sandbox snapshot holds only files); None: nothing."""
        return None

    async def restore_state(self, sandbox: Sandbox, state: Any) -> None:
        """Rebuild the state captured by ``snapshot_state``, after the sandbox was restored."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _takes_sandbox(fn: Callable[..., Any]) -> bool:
    """Whether the env calls ``fn(args, sandbox)`` rather than ``fn(args)``: it does when
    ``fn`` has a second positional parameter. A signature neither call fits (a third
    required parameter, a required keyword-only one) is a ``TypeError`` now, not at
    the first call."""
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in _POSITIONAL]
    if not positional and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise TypeError(f"{_label(fn)} must take an args parameter annotated with a model")
    left = [p.name for p in positional[2:] if p.default is p.empty]
    left += [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if left:
        raise TypeError(
            f"{_label(fn)} is called as fn(args) or fn(args, sandbox); give its other "
            f"parameters defaults: {', '.join(left)}"
        )
    return len(positional) >= 2


def _label(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


# The tool names every chat API accepts (OpenAI's and Anthropic's rule).
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def tool_problem(t: Any) -> str | None:
    """Why ``t`` cannot be offered to a model, or None: checked when a tool is
    defined or given to an env, so that a bad one fails there, not at reset."""
    if isinstance(t, type) and issubclass(t, Tool):
        return f"{t.__name__} is a Tool class; pass an instance: {t.__name__}()"
    if not isinstance(t, Tool):
        hint = "; decorate it with @tool" if callable(t) else ""
        return f"{t!r} is not a Tool or a built-in tool name{hint}"
    if not isinstance(t.name, str) or not _TOOL_NAME.fullmatch(t.name):
        return (
            f"{type(t).__name__} has tool name {t.name!r}; a name is 1 to 64 letters, "
            "digits, '_' or '-'"
        )
    try:
        t.spec()
    except Exception as err:  # pydantic cannot write a JSON schema for some field types
        return f"tool {t.name!r}: its arguments have no JSON schema to show the model ({_first_line(err)})"
    return None


def _first_line(err: Exception) -> str:
    return str(err).split("\n", 1)[0]


class FunctionTool(Tool):
    """A tool made from a function ``fn(args)`` or an async one ``fn(args)`` or ``fn(args, sandbox)``,
    which returns a ``ToolResult`` or any value (shown to the model as ``as_text`` writes it).
    A plain function runs in a worker thread."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args_model: type[BaseModel],
        name: str,
        description: str,
        needs_sandbox: bool,
    ):
        self._fn = fn
        self._pass_sandbox = _takes_sandbox(fn)
        # Instance attributes shadow the ClassVars of Tool on purpose.
        self.name = name  # type: ignore[misc]
        self.description = description  # type: ignore[misc]
        self.Args = args_model  # type: ignore[misc]
        self.needs_sandbox = needs_sandbox  # type: ignore[misc]

    async def __call__(self, args: Any, sandbox: Sandbox | None) -> ToolResult:
        if not inspect.iscoroutinefunction(self._fn):  # off the loop every env shares
            out = await _in_thread(self._fn, args, f"agentrl-tool-{self.name}")
            if inspect.isawaitable(out):  # a def that hands back a coroutine (a sync decorator's wrapper)
                out = await out
        else:
            out = await (self._fn(args, sandbox) if self._pass_sandbox else self._fn(args))
        return out if isinstance(out, ToolResult) else ToolResult(content=as_text(out))


def run_and_settle(loop: asyncio.AbstractEventLoop, done: asyncio.Future[Any], fn: Callable[..., Any],
                   *args: Any, **kwargs: Any) -> None:
    """On a worker thread: ``fn(*args, **kwargs)``, its result or exception handed to ``done``
    on ``loop`` (raised where it is awaited, as ``to_thread`` does), unless the awaiting call
    gave up on it (a timeout cancelled ``done``) or the loop closed while it ran."""
    try:
        value, error = fn(*args, **kwargs), None
    except BaseException as e:
        value, error = None, e
    with contextlib.suppress(RuntimeError):  # the loop closed
        loop.call_soon_threadsafe(_settle, done, value, error)


def _settle(done: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if done.cancelled():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(value)


async def _in_thread(fn: Callable[..., Any], arg: Any, name: str) -> Any:
    """``fn(arg)`` on a daemon thread of its own, awaited. Not ``asyncio.to_thread``: a call
    stuck past ``call_timeout_s`` would hold one of the default executor's few threads (later
    calls then queue behind it and time out) and, as Python joins those threads at exit, keep
    the process from exiting. Abandoned, a daemon thread costs its stack until it returns."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def run(context: contextvars.Context) -> None:
        run_and_settle(loop, done, context.run, fn, arg)

    threading.Thread(target=run, args=(contextvars.copy_context(),), name=name, daemon=True).start()
    return await done


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
) -> Any:
    """Decorator: turn ``def fn(args: SomeModel)`` or ``async def fn(args: SomeModel[, sandbox])``
    into a ``Tool`` (a plain function runs in a worker thread).

    The name defaults to the function's name and the description to its
    docstring. The tool asks for a sandbox when ``fn`` takes a second positional
    parameter; keyword-only parameters and ``**kwargs`` keep their defaults. A
    bound method works too: ``tool(obj.method)``.
    """

    # Locals of the decorating scope, so models defined in a function resolve
    # under ``from __future__ import annotations``.
    caller_locals = dict(sys._getframe(1).f_locals)

    def wrap(f: Callable[..., Any]) -> FunctionTool:
        # A partial or a callable object has no annotations of its own to read.
        if not (inspect.isfunction(f) or inspect.ismethod(f)):
            raise TypeError(
                f"@tool takes a function or a bound method, not {type(f).__name__}; "
                "wrap the call in a def"
            )
        if inspect.isasyncgenfunction(f) or inspect.isgeneratorfunction(f):
            raise TypeError(f"@tool takes a function that returns its result; {f.__name__} is a generator")
        if not inspect.iscoroutinefunction(f) and _takes_sandbox(f):
            raise TypeError(f"{f.__name__} takes the sandbox, whose methods are coroutines: make it an async def")
        # In a class body the function is not bound yet: ``self`` would be taken for
        # the args and the args for the sandbox. ``tool(obj.method)`` works.
        if inspect.isfunction(f) and f.__qualname__.split(".")[-2:-1] not in ([], ["<locals>"]):
            raise TypeError(
                f"{f.__qualname__} is a method; decorate a plain function, or make a tool of "
                "the bound method: tool(obj.method)"
            )
        needs_sandbox = _takes_sandbox(f)
        params = list(inspect.signature(f).parameters)
        try:
            hints = get_type_hints(f, localns=caller_locals)
        except NameError as err:
            raise TypeError(f"cannot resolve the annotations of {f.__name__}: {err}") from err
        model = hints.get(params[0], NoArgs)
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"annotate {f.__name__}'s first parameter with a pydantic model")
        doc = inspect.getdoc(f) or ""
        made = FunctionTool(
            f,
            model,
            name=name or f.__name__,
            description=description if description is not None else doc,
            needs_sandbox=needs_sandbox,
        )
        if problem := tool_problem(made):
            raise TypeError(problem)
        return made

    return wrap(fn) if fn is not None else wrap
