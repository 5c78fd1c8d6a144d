"""Plumbing shared by agentrl's HTTP servers: the proxy, the env server and the sandbox server.

- ``listen_socket``: a listening socket with ``TCP_NODELAY``. Without it,
  uvicorn's split header and body writes meet the client's delayed ACK, and
  every small reply waits about 40 ms on Linux.
- ``run_until_stopped``: uvicorn's ``Server.run``, after which the caller's
  ``finally`` runs on SIGTERM as on Ctrl-C (what the proxy and the env server
  save and close when they stop).
- The request-size limit. A body may arrive with a declared length or without
  one (chunked), so it is checked in two places: ``declared_too_large`` looks
  at ``content-length`` before anything is read, and ``call_with_body_limit``
  runs the app with a ``receive`` that raises ``BodyTooLarge`` past the limit.
  Each server's gate answers both with a 413 in its own error shape.
- ``read_json``: a request body read as a pydantic model. Everything a client
  can send wrong is a 4xx that says what to fix, never a 500:

  - a body over the limit: 413;
  - a body that is not UTF-8 JSON: 400;
  - ``NaN`` and ``Infinity``, which Python's parser reads but JSON does not
    have: 400 naming the field, before they can reach a reply that must
    encode them;
  - JSON nested deeper than the parser's recursion limit
    (``{"messages": [[[[...`` 100,000 deep): 400, where ``json.loads`` raises
    ``RecursionError``, which is not a ``ValueError``;
  - a string that holds a lone surrogate (``"a\\ud800b"``): 400 naming the
    field. JSON's ``\\u`` escapes allow it, but UTF-8 cannot encode it, so it
    would fail later, far from the request: while a session hashes its
    messages, in the tokenizer, or when a tree with it in its ``meta`` is
    written. Checked here, it can never reach what was recorded;
  - a body the model refuses: 400 naming the field (``messages.0.role``).

``HTTPError`` is that refusal, answered in OpenAI's error shape
(``{"error": {message, type, param, code}}``), which the proxy and the env
server both use. The sandbox server keeps FastAPI's ``{"detail": ...}``.
"""

from __future__ import annotations

import errno
import json
import math
import re
import signal
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from .errors import ConfigError

__all__ = ["BodyTooLarge", "HTTPError", "call_with_body_limit", "declared_too_large", "listen_socket",
           "lone_surrogate_field", "non_finite_field", "read_json",
           "run_until_stopped", "validation_problem"]

M = TypeVar("M", bound=BaseModel)

_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
          503: "service_unavailable", 504: "timeout"}
# A \u escape of a surrogate code point (D800-DFFF): the only way JSON text in UTF-8 spells one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class HTTPError(Exception):
    """A request refused with an HTTP status, answered in OpenAI's error shape.

    ``param`` names the field at fault, ``code`` is a machine-readable reason
    (``context_length_exceeded``), ``headers`` are sent with it (``Retry-After``).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self) -> Any:
        """The error as a starlette ``JSONResponse`` (an ASGI app)."""
        from starlette.responses import JSONResponse

        body = {"error": {"message": self.message, "type": _KINDS.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}
        return JSONResponse(body, self.status, headers=self.headers)


class BodyTooLarge(Exception):
    """Raised by the app's ``receive`` (``call_with_body_limit``) once the body read so far passes the limit."""


def declared_too_large(scope: dict[str, Any], limit: int) -> bool:
    """Whether the request declares a ``content-length`` over ``limit`` (or one that is not a number)."""
    declared = dict(scope.get("headers") or []).get(b"content-length")
    return declared is not None and (not declared.isdigit() or int(declared) > limit)


async def call_with_body_limit(app: Any, scope: dict[str, Any], receive: Callable[[], Awaitable[dict]],
                               send: Callable[[dict], Awaitable[None]], limit: int) -> bool:
    """Run the ASGI ``app`` with its request body limited to ``limit`` bytes; True if it went over.

    Past the limit, the app's read raises ``BodyTooLarge``. Whatever the app
    makes of that (``read_json`` answers a 413; FastAPI answers a body it
    could not read with a 400) is not sent: the caller answers the 413 in its
    own error shape when this returns True.
    """
    seen, over, started = 0, False, False

    async def limited() -> dict:
        nonlocal seen, over
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            over = True
            raise BodyTooLarge
        return message

    async def send_unless_over(message: dict) -> None:
        nonlocal started
        if over and not started:
            return
        started = started or message["type"] == "http.response.start"
        await send(message)

    try:
        await app(scope, limited, send_unless_over)
    except BodyTooLarge:
        pass
    return over and not started


def _printable(key: Any) -> str:
    """A dict key as a path part that UTF-8 can encode (a lone surrogate as its escape)."""
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")


def lone_surrogate_field(data: Any, path: tuple[str, ...] = ()) -> str | None:
    """The dotted path of the first string (or key) in ``data`` that holds a lone surrogate; None if none.

    Iterative, so data nested as deep as ``json.loads`` allows is walked without recursion.
    """
    def bad(value: Any) -> bool:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    return _first_field(data, lambda v: isinstance(v, str) and bad(v), path)


def non_finite_field(data: Any, path: tuple[str, ...] = ()) -> str | None:
    """The dotted path of the first ``NaN`` or ``Infinity`` in ``data`` (Python's parser reads them,
    JSON has neither); None if none."""
    return _first_field(data, lambda v: isinstance(v, float) and not math.isfinite(v), path)


def _first_field(data: Any, bad: Any, path: tuple[str, ...]) -> str | None:
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, path)]
    while stack:
        value, where = stack.pop()
        if bad(value):
            return ".".join(where)
        if isinstance(value, dict):
            for k, v in value.items():  # the key is checked first (popped last): a bad key is
                stack.append((v, (*where, _printable(k))))  # named by its escape, never by itself
                stack.append((k, where))
        elif isinstance(value, list):
            stack.extend((value[i], (*where, str(i))) for i in reversed(range(len(value))))
    return None


def _loads(raw: bytes) -> Any:
    """``raw`` parsed as JSON; every way it can fail is a 400 that says why."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HTTPError(400, f"invalid JSON body: not UTF-8 ({e.reason} at byte {e.start})") from None
    overflowed = False

    def parse_float(literal: str) -> float:  # 1e999 is JSON, and float() makes it inf
        nonlocal overflowed
        value = float(literal)
        overflowed = overflowed or math.isinf(value)
        return value

    try:
        data = json.loads(text, parse_float=parse_float)
    except ValueError as e:
        raise HTTPError(400, f"invalid JSON body: {e}") from None
    except RecursionError:
        raise HTTPError(400, "invalid JSON body: nested too deeply to parse") from None
    if _SURROGATE_ESCAPE.search(text):  # rare: only then walk the data
        field = lone_surrogate_field(data)
        if field is not None:
            raise HTTPError(400, f"{field or 'body'}: holds a lone surrogate (a \\ud800-\\udfff escape "
                            "without its pair), which is not valid Unicode text; send UTF-8 text",
                            param=field or None)
    if overflowed or "NaN" in text or "Infinity" in text:  # rare: only then walk the data
        field = non_finite_field(data)
        if field is not None:
            why = "is past the largest float (1.8e308)" if overflowed else "NaN and Infinity are not JSON"
            raise HTTPError(400, f"{field or 'body'}: {why}; send a finite number or a string",
                            param=field or None)
    return data


async def read_json(request: Any, model: type[M], limit: int, optional: bool = False) -> M:
    """The body of a starlette ``request`` validated as ``model``; refusals are ``HTTPError``\\ s.

    ``limit`` is only named in the 413: the bytes are counted by
    ``call_with_body_limit`` around the app. ``optional``: an empty body reads as ``{}``.
    """
    try:
        raw = await request.body()
    except BodyTooLarge:
        raise HTTPError(413, f"request body over {limit} bytes") from None
    if optional and not raw.strip():
        raw = b"{}"
    data = _loads(raw)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        field, reason = validation_problem(e)
        raise HTTPError(400, f"{field or 'body'}: {reason}", param=field or None) from None
    except RecursionError:
        raise HTTPError(400, "body: nested too deeply to validate") from None


_TYPE_TAG = re.compile(r"[A-Z]|.*[\[(-]|(str|int|float|bool|bytes|dict|list|none|null)$")


def validation_problem(e: ValidationError) -> tuple[str, str]:
    """``(field, reason)`` of pydantic's refusal, for a client to act on.

    A field that takes one of several shapes (``content``: a string or a list of parts) fails
    once per shape, and pydantic lists the string's failure first: a bad part read
    ``content.str: Input should be a valid string``. The deepest failure is where the client's
    own shape went wrong; failures at one depth are alternatives, joined with "or". The
    shapes' names (``str``, ``list[Part]``, a model's name) leave the path.
    """
    errors = e.errors()

    def path(err: Any) -> tuple[Any, ...]:
        return tuple(p for p in err["loc"] if not (isinstance(p, str) and _TYPE_TAG.match(p)))

    deepest = max(len(path(err)) for err in errors)
    at = [err for err in errors if len(path(err)) == deepest]
    where = path(at[0])
    reasons = [("unknown field" if err["type"] == "extra_forbidden" else err["msg"])
               for err in at if path(err) == where]
    return ".".join(str(p) for p in where), " or ".join(dict.fromkeys(reasons))


def listen_socket(host: str = "127.0.0.1", port: int = 0, listen: bool = True) -> socket.socket:
    """A listening TCP socket with ``TCP_NODELAY`` (inherited by accepted connections), for
    uvicorn; ``ConfigError`` saying why where it cannot (a port in use, out of range).
    ``listen=False``: bound only, so a port another server listens on fails now while clients
    are still refused (uvicorn listens when it starts serving)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        if listen:  # here, not in uvicorn: two servers may both bind one port, only one listens
            sock.listen(2048)
    except (OSError, OverflowError) as e:
        sock.close()
        if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
            why = "another process holds the port: pass another --port"
        else:
            why = getattr(e, "strerror", None) or str(e)
        raise ConfigError(f"cannot listen on {host}:{port}: {why}") from None
    return sock


def run_until_stopped(server: Any, sock: socket.socket) -> None:
    """``server.run(sockets=[sock])`` (a ``uvicorn.Server``) until Ctrl-C or SIGTERM, which then
    raise (``KeyboardInterrupt``; ``SystemExit(143)``) once it has stopped, so the caller's
    ``finally`` runs for both. uvicorn catches either signal for its graceful shutdown and
    then raises it again; SIGTERM's default action ended the process right there, before any
    ``finally``. A SIGTERM handler someone else installed is left as it is."""
    def stop(sig: int, frame: Any) -> None:
        raise SystemExit(128 + sig)  # the code a shell reports for a process SIGTERM ended

    ours = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if ours:
        signal.signal(signal.SIGTERM, stop)
    try:
        server.run(sockets=[sock])
    finally:
        if ours:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
