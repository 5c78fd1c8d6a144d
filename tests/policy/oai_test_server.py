"""A small OpenAI-compatible server over an ``HFPolicy``, for the openai backend's tests.

It serves ``/v1/models`` and ``/v1/completions`` for token-id prompts (n=1, no
streaming). It answers in vLLM's shape: ``token_ids`` for
``return_token_ids``, ``"token_id:N"`` tokens for
``return_tokens_as_token_ids``, ``stop_reason`` (the stop string, the stop
token id, or None for EOS), and -inf logprobs written as -9999.0.
``Controls`` make it misbehave on purpose: it can drop either token-id form,
omit ``stop_reason``, answer with error statuses first, or hang.
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentrl.policy import GenerateRequest, GenerateResult, HFPolicy, SamplingParams, action_text

BOTH_FORMS = frozenset({"return_token_ids", "return_tokens_as_token_ids"})


@dataclass
class Controls:
    """How the server behaves; tests set these and the fixture resets them."""

    forms: frozenset[str] = BOTH_FORMS  # the token-id extensions it honours
    report_stop_reason: bool = True
    failures: list[int] = field(default_factory=list)  # statuses to answer, one per request, first
    retry_after: str | None = None  # sent with each injected failure
    failure_message: str | None = None  # the injected failures' error message
    hang_s: float = 0.0  # sleep this long before answering
    version: int | None = None  # sent as X-Policy-Version
    seen: list[tuple[float, dict[str, Any], dict[str, str]]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf; vLLM sends this


def _stop_reason(tokenizer: Any, res: GenerateResult, stop: list[str], stop_ids: list[int]) -> Any:
    if res.finish_reason == "stop_string":
        text = tokenizer.decode(res.token_ids, skip_special_tokens=False)
        return min((s for s in stop if s in text), key=text.find)
    if res.finish_reason == "stop" and res.token_ids[-1] in stop_ids:
        return res.token_ids[-1]
    return None  # EOS, or the length limit


def _choice(tokenizer: Any, res: GenerateResult, body: dict[str, Any], controls: Controls) -> dict:
    stop = [body["stop"]] if isinstance(body.get("stop"), str) else list(body.get("stop") or [])
    as_ids = body.get("return_tokens_as_token_ids") and "return_tokens_as_token_ids" in controls.forms

    def name(t: int) -> str:
        return f"token_id:{t}" if as_ids else tokenizer.decode([t])

    choice: dict[str, Any] = {
        "index": 0, "text": action_text(tokenizer, res.token_ids, stop),
        "finish_reason": "length" if res.finish_reason == "length" else "stop",
        "logprobs": {
            "tokens": [name(t) for t in res.token_ids],
            "token_logprobs": [_finite(x) for x in res.logprobs],
            "top_logprobs": None if res.top_logprobs is None else [
                # vLLM adds the sampled token when it is not in the top k.
                {name(i): _finite(lp) for i, lp in [*top, (t, lp_t)]}
                for top, t, lp_t in zip(res.top_logprobs, res.token_ids, res.logprobs, strict=True)
            ],
        },
    }
    if controls.report_stop_reason:
        choice["stop_reason"] = _stop_reason(tokenizer, res, stop, list(body.get("stop_token_ids") or []))
    if body.get("return_token_ids") and "return_token_ids" in controls.forms:
        choice["token_ids"] = list(res.token_ids)
    return choice


def _params(body: dict[str, Any]) -> SamplingParams:
    stop = body.get("stop") or ()
    return SamplingParams(
        temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0),
        top_k=body.get("top_k", 0), max_new_tokens=body.get("max_tokens", 16),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(body.get("stop_token_ids") or ()),
        logprobs=body.get("logprobs") or 0, seed=body.get("seed"))


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "code": status}},
                        status_code=status, headers=headers)


class OAITestServer:
    """uvicorn on 127.0.0.1, on a free port, in a background thread; ``url`` ends in /v1.

    ``policy`` may be swapped between requests (say, for one with a prefix cache).
    """

    def __init__(self, policy: HFPolicy, model_name: str = "tiny"):
        self.policy, self.model_name, self.controls = policy, model_name, Controls()
        self._lock = threading.Lock()  # HFPolicy is not thread-safe; requests take turns
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1"
        app = Starlette(routes=[Route("/v1/models", self._models),
                                Route("/v1/completions", self._completions, methods=["POST"])])
        self._server = uvicorn.Server(uvicorn.Config(
            app, log_level="warning", lifespan="off", http="h11", loop="asyncio",
            timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="oai-test-server", daemon=True)

    def __enter__(self) -> OAITestServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    async def _models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model"}]})

    def _generate(self, req: GenerateRequest) -> GenerateResult:
        with self._lock:
            return self.policy.generate([req])[0]

    async def _completions(self, request: Request) -> JSONResponse:
        c = self.controls
        body = await request.json()
        c.seen.append((time.monotonic(), body, dict(request.headers)))
        c.in_flight += 1
        c.max_in_flight = max(c.max_in_flight, c.in_flight)
        try:
            if c.failures:
                status = c.failures.pop(0)
                return _error(status, c.failure_message or f"injected failure {status}",
                              {"Retry-After": c.retry_after} if c.retry_after else None)
            end = time.monotonic() + c.hang_s
            while time.monotonic() < end:  # hang, until the client gives up
                if await request.is_disconnected():
                    return _error(499, "client closed the request")
                await asyncio.sleep(0.02)
            prompt = body.get("prompt")
            if body.get("model") != self.model_name:
                return _error(404, f"The model `{body.get('model')}` does not exist.")
            if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
                return _error(400, "this test server takes prompts as a list of token ids")
            if body.get("n", 1) != 1:
                return _error(400, "this test server samples n=1 only")
            res = await run_in_threadpool(self._generate, GenerateRequest(prompt, _params(body)))
            tok = self.policy.tokenizer
            data = {
                "id": "cmpl-test", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [_choice(tok, res, body, c)],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(res.token_ids),
                          "total_tokens": len(prompt) + len(res.token_ids),
                          "prompt_tokens_details": {"cached_tokens": res.cached_tokens}},
            }
            headers = {"X-Policy-Version": str(c.version)} if c.version is not None else None
            return JSONResponse(data, headers=headers)
        finally:
            c.in_flight -= 1
