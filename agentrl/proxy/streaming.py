"""A reply that samples when it is sent: cancellable generation, live streaming, recording first.

``Reply`` is the ASGI response every sampling endpoint returns, whatever its
wire protocol. It starts the generation when it is sent, and cancels it if
the client leaves first. Streamed with a ``Live`` (the backend reports tokens
as it samples them: ``hf``, ``vllm``), chunks leave as tokens are decoded;
otherwise, and for what remains after a live stream, the endpoint's
``finish`` records the choices before their bytes are written, so a
disconnect then loses nothing. Errors are written in the protocol's own shape
(``ErrorShape``): OpenAI's ``{"error": {...}}`` or Anthropic's
``{"type": "error", "error": {...}}``, as a body before the stream started and
as an event after.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response

from agentrl.httputil import HTTPError
from agentrl.policy.base import GenerateRequest, GenerateResult

from . import replies

__all__ = ["OPENAI_ERRORS", "ErrorShape", "Finish", "Live", "Reply", "live_for"]

log = logging.getLogger("agentrl.proxy")


@dataclass(frozen=True, slots=True)
class ErrorShape:
    """How one wire protocol writes an error: as a response, and as a stream event."""

    response: Callable[[HTTPError], Response]
    event: Callable[[HTTPError], bytes]


def _openai_event(err: HTTPError) -> bytes:
    return replies.sse({"error": {"message": err.message, "code": err.code}}) + replies.sse("[DONE]")


OPENAI_ERRORS = ErrorShape(lambda err: err.response(), _openai_event)


async def _disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# (results, the text each choice streamed live or None) -> (the body or the remaining events, version)
Finish = Callable[[list[GenerateResult], "list[str | None] | None"], tuple[Any, int]]


class Live:
    """The tokens a backend samples for a streamed call, from its thread to the reply's events.

    ``hook(i)`` is choice i's ``RequestControl.on_token``: it appends on the
    backend's thread and wakes the loop once per batch of tokens. ``events()``,
    on the loop, turns what arrived into chunks through each choice's
    ``TextStream``; ``chunk(i, text, first)`` writes them in the endpoint's shape.
    """

    def __init__(self, n: int, tokenizer: Any, stops: tuple[str, ...], keep_stop: bool,
                 chunk: Callable[[int, str, bool], list[bytes]]):
        self.loop = asyncio.get_running_loop()
        self.ready = asyncio.Event()
        self.texts = [replies.TextStream(tokenizer, stops, keep_stop) for _ in range(n)]
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.read = [0] * n
        self.chunk = chunk
        self.begun = [False] * n  # choice i's first chunk went out
        self._wake_pending = False

    def hook(self, i: int) -> Callable[[int], None]:
        ids = self.ids[i]

        def on_token(token_id: int) -> None:
            ids.append(token_id)
            if not self._wake_pending:
                self._wake_pending = True
                with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped
                    self.loop.call_soon_threadsafe(self._wake)
        return on_token

    def _wake(self) -> None:
        self._wake_pending = False
        self.ready.set()

    def events(self) -> list[bytes]:
        out = []
        for i, text in enumerate(self.texts):
            end = len(self.ids[i])
            new = text.push(self.ids[i][self.read[i]:end])
            self.read[i] = end
            if new:
                out += self.chunk(i, new, not self.begun[i])
                self.begun[i] = True
        return out

    def sent(self) -> list[str | None]:
        """Per choice, the text already streamed; None where not even its first chunk went out."""
        return [t.sent if b else None for t, b in zip(self.texts, self.begun, strict=True)]


_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class Reply(Response):
    """Samples when called and answers; cancels the sampling if the client leaves first.

    Streamed with ``live``: chunks go out as tokens are sampled, and a client
    that leaves mid-stream cancels the generation (nothing is recorded for the
    call, as when it leaves before the first token). Otherwise, and for what
    remains after a live stream, the choices are recorded before the bytes that
    report them are sent, so a disconnect then loses nothing. Each batch of
    events is one write, and no write follows a disconnect the loop has seen.
    """

    def __init__(self, proxy: Any, reqs: list[GenerateRequest], finish: Finish, stream: bool,
                 on_cancel: Callable[[], None], on_end: Callable[[], None] = lambda: None,
                 live: Live | None = None, errors: ErrorShape | None = None):
        self.proxy, self.reqs, self.finish, self.stream, self.on_cancel = proxy, reqs, finish, stream, on_cancel
        self.on_end = on_end  # always, last: frees what a call that was not recorded held
        self.live = live
        self.errors = errors or OPENAI_ERRORS
        self.background = None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await self._reply(scope, receive, send)
        finally:
            self.on_end()

    async def _reply(self, scope: dict, receive: Callable, send: Callable) -> None:
        gen = asyncio.ensure_future(self.proxy.generate(self.reqs))
        watch = asyncio.ensure_future(_disconnected(receive))
        started, left = False, False
        try:
            if self.live is not None:
                started = await self._stream_live(gen, watch, send)
            else:
                await asyncio.wait({gen, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not gen.done():
                gen.cancel()  # cancelled() turns true only once the loop runs it: test our own flag
                left = True
                self.on_cancel()
        if left:
            return
        try:
            sent = self.live.sent() if self.live is not None and started else None
            body, version = self.finish(gen.result(), sent)
            reply = None if self.stream else JSONResponse(body, headers={"x-policy-version": str(version)})
        except Exception as e:  # an HTTPError, or a backend or reply bug: answered, never a dead server
            err = e if isinstance(e, HTTPError) else HTTPError(500, f"internal error: {type(e).__name__}: {e}")
            if not isinstance(e, HTTPError):
                log.exception("proxy generation failed")
            if not started:
                return await self.errors.response(err)(scope, receive, send)
            event = self.errors.event(err)
            return await send({"type": "http.response.body", "body": event, "more_body": False})
        if reply is not None:
            return await reply(scope, receive, send)
        with contextlib.suppress(OSError):  # the client left: everything is recorded already
            if not started:
                await send({"type": "http.response.start", "status": 200, "headers": [
                    *_SSE_HEADERS, (b"x-policy-version", str(version).encode())]})
            await send({"type": "http.response.body", "body": b"".join(body), "more_body": False})

    async def _stream_live(self, gen: asyncio.Future, watch: asyncio.Future, send: Callable) -> bool:
        """Send chunks as tokens arrive, until the generation ends or the client leaves;
        whether the response started."""
        live, started = self.live, False
        assert live is not None
        while True:
            ready = asyncio.ensure_future(live.ready.wait())
            try:
                await asyncio.wait({gen, watch, ready}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                ready.cancel()
            if gen.done() or watch.done():
                return started
            live.ready.clear()
            events = live.events()
            if not events:
                continue
            try:
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": [
                        *_SSE_HEADERS, (b"x-policy-version", str(self.proxy.policy.version).encode())]})
                    started = True
                await send({"type": "http.response.body", "body": b"".join(events), "more_body": True})
            except OSError:  # the client left: the caller cancels the generation
                return started


def live_for(reqs: list[GenerateRequest], tokenizer: Any, stops: tuple[str, ...], keep_stop: bool,
             chunk: Callable[[int, str, bool], list[bytes]]) -> Live:
    """A ``Live`` whose hooks are the requests' ``on_token`` (choice i is request i)."""
    live = Live(len(reqs), tokenizer, stops, keep_stop, chunk)
    for i, r in enumerate(reqs):
        assert r.control is not None  # ``Proxy.requests`` gives each one
        r.control.on_token = live.hook(i)
    return live
