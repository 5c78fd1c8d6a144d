"""``agentrl env serve``: any registered env over a small HTTP API, for harnesses.

A harness that knows nothing of agentrl plays an env through these routes
(every one needs ``Authorization: Bearer <token>``, compared in constant time)::

    POST /envs                 {env_id, seed?, options?, kwargs?} -> {id, key, observation, info}
    GET  /envs/{id}            -> {observation, info, reward, terminated, truncated, steps}
    POST /envs/{id}/step       {action} -> {observation, reward, terminated, truncated, info}
    POST /envs/{id}/close      -> the final state
    GET  /registry             -> registered env ids
    GET  /health

The ``GET /envs/{id}`` and ``.../step`` routes also take that env's own
``key`` as the bearer token; it opens no other env and no other route. A
harness gets that key, not the server's token (``harness.run_harness_episode``):
it plays its own episode and cannot make envs (filling ``max_envs`` for every
other episode), nor step, read or close another episode's env, nor close its
own (the runner's close reads the reward: an env closed before it failed the
episode, which credit leaves out, so a losing model could dodge its reward).

Outcomes sort as in ``ToolEnv``: a request the server cannot read (bad JSON, a
missing or mistyped field) is a 400 that names the field; an unknown env id a
400 with the closest registered id; an unknown instance a 404. An env that
raises inside ``step``, exits, or answers against the env contract (a NaN
reward, bytes, a 4-tuple: ``agentrl.env.answer_problem``) ends its episode: the
reply is an error observation with ``truncated=True`` and the reason in
``info["error"]``, and the server goes on. Such a ``reset`` is a 400 with the reason.
Env calls run on a worker thread, one at a time per env, so a slow env does
not stall the others; a close waits for the step in flight, so the state it
returns holds that step's reward. An env made after its request gave up (504)
is closed once made, and idle envs are closed on a thread. Envs are sandboxed
as they are when made in-process.
When the server stops (Ctrl-C, SIGTERM), the envs still open are closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentrl.env import EnvClosers, close_quietly
from agentrl.errors import ConfigError, EnvError
from agentrl.httputil import (
    HTTPError,
    call_with_body_limit,
    declared_too_large,
    listen_socket,
    read_json,
    run_until_stopped,
)
from agentrl.rollout.pool import DaemonPool

__all__ = ["EnvServerConfig", "create_env_app", "serve_envs"]

_GRACEFUL_S = 5.0
_ACTION_CHARS = 1_000_000  # the longest action (the harness runner submits as many: harness._ANSWER_CHARS)


class EnvServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token: str = Field(min_length=1, description="Bearer token every request must carry.")
    max_envs: int = Field(256, ge=1, description="Envs alive at once; more get 429.")
    # 8 MiB: a step body holds the longest action in UTF-8 JSON, at most 6 bytes a character (a
    # control character's \u escape; 4 for one past the BMP). 1 MiB refused 600,000 "é" (a 413).
    max_request_bytes: int = Field(8 << 20, ge=1024, description="Larger bodies get 413.")
    step_timeout_s: float = Field(300.0, gt=0, description="A reset or step over this ends the episode.")
    idle_s: float = Field(3600.0, gt=0, description="Envs untouched this long are closed.")


class MakeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    env_id: str = Field(min_length=1, description="Registered env id, e.g. agentrl/GuessNumber-v0.")
    seed: int | None = Field(None, description="reset(seed=...).")
    options: dict[str, Any] | None = Field(None, description="reset(options=...).")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the env.")


class StepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    action: str = Field(max_length=_ACTION_CHARS, description="The action text.")


@dataclass(slots=True)
class _Live:
    env: Any
    env_id: str
    observation: str
    info: dict[str, Any]
    key: str  # opens this env alone (``key`` in the make's reply): what a harness is given
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    steps: int = 0
    last_used: float = field(default_factory=time.monotonic)

    def state(self, env_instance: str) -> dict[str, Any]:
        return {"id": env_instance, "env_id": self.env_id, "observation": self.observation,
                "info": self.info, "reward": self.reward, "terminated": self.terminated,
                "truncated": self.truncated, "steps": self.steps}


def _plain(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` as strict JSON data (``agentrl.env.jsonable``: numpy values become numbers,
    NaN a string, objects their text), which the reply can always encode.

    ``privileged`` (a hidden goal or expert plan, for distillation teachers) is
    dropped: the server talks to the agent, which must not see it.
    """
    from agentrl.env import jsonable

    return jsonable({k: v for k, v in info.items() if k != "privileged"})


def create_env_app(config: EnvServerConfig) -> Any:
    """The env server's ASGI app."""
    envs: dict[str, _Live] = {}
    making = [0]  # makes under way: they count toward max_envs before they hold an id
    expected = config.token.encode()
    limit = config.max_request_bytes
    pool = DaemonPool(name="agentrl-env-serve")

    def bearer(request: Request) -> bytes:
        value = request.headers.get("authorization", "")
        return value[7:].strip().encode() if value[:7].lower() == "bearer " else b""

    def check(request: Request) -> None:
        if not hmac.compare_digest(bearer(request), expected):
            raise HTTPError(401, "missing or wrong bearer token (an env's own key opens only that env)")

    def live(request: Request, server_only: bool = False) -> tuple[str, _Live]:
        """The env the route names; ``server_only``: a route its own key does not open (close)."""
        given, eid = bearer(request), request.path_params["eid"]
        state = envs.get(eid)
        # An env's own key opens it alone; which envs exist is told only to the server's token.
        own = state is not None and hmac.compare_digest(given, state.key.encode())
        server = hmac.compare_digest(given, expected)
        if not own and not server:
            raise HTTPError(401, "missing or wrong bearer token")
        if server_only and not server:  # the runner reads the reward in the close: not the harness's call
            raise HTTPError(403, "closing an env takes the server's token; its own key steps and reads it")
        if state is None:
            raise HTTPError(404, f"no env {eid!r} (closed, expired or never made)")
        state.last_used = time.monotonic()
        return eid, state

    async def off_loop(fn: Any, *args: Any) -> Any:
        # Daemon threads: a step stuck for good must not hold the server's exit (to_thread's
        # pool is joined when the loop closes, and again at interpreter exit).
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def bounded(fn: Any, *args: Any) -> Any:
        return await asyncio.wait_for(off_loop(_no_exit, fn, *args), config.step_timeout_s)

    async def make(request: Request) -> Response:
        check(request)
        body: MakeRequest = await read_json(request, MakeRequest, limit)
        for env in _reap(envs, config.idle_s):  # closed on a thread: a slow close holds no request
            pool.submit(close_quietly, env)
        if len(envs) + making[0] >= config.max_envs:
            raise HTTPError(429, f"at most {config.max_envs} envs alive; close some first")
        making[0] += 1
        try:
            return await made(body)
        finally:
            making[0] -= 1

    async def made(body: MakeRequest) -> Response:
        from agentrl.env import answer_problem, make_env, resolve_env_id

        try:
            resolve_env_id(body.env_id)
        except EnvError as e:
            raise HTTPError(400, f"env_id: {e}", param="env_id") from None
        building = asyncio.get_running_loop().run_in_executor(
            pool, _no_exit, lambda: make_env(body.env_id, **body.kwargs))
        try:
            env = await asyncio.wait_for(asyncio.shield(building), config.step_timeout_s)
        except TimeoutError:  # it goes on on its thread: closed once made, as nobody can name it
            building.add_done_callback(lambda f: _close_made(f, pool))
            raise HTTPError(504, f"making {body.env_id} took over step_timeout_s={config.step_timeout_s:g}") from None
        except Exception as e:  # a setting the env refused (EnvError, TypeError, ValueError) or its bug
            raise HTTPError(400, f"cannot make {body.env_id} with kwargs {str(body.kwargs)[:200]}: "
                            f"{type(e).__name__}: {e}", param="kwargs") from None
        try:
            answer = await bounded(lambda: env.reset(seed=body.seed, options=body.options))
            problem = answer_problem("reset", answer)
        except Exception as e:
            problem = f"{type(e).__name__}: {e}"
        if problem:
            await off_loop(close_quietly, env)
            raise HTTPError(400, f"reset failed: {problem}")
        obs, info = answer
        eid = secrets.token_urlsafe(12)
        envs[eid] = _Live(env, body.env_id, obs, _plain(info), key=secrets.token_urlsafe(24))
        return JSONResponse({"id": eid, "key": envs[eid].key, "observation": obs, "info": envs[eid].info})

    async def show(request: Request) -> Response:
        eid, state = live(request)
        return JSONResponse(state.state(eid))

    async def step(request: Request) -> Response:
        eid, state = live(request)
        body: StepRequest = await read_json(request, StepRequest, limit)
        async with state.lock:
            if envs.get(eid) is not state:  # closed while this step waited for the one before it
                raise HTTPError(404, f"no env {eid!r} (closed, expired or never made)")
            if state.terminated or state.truncated:
                raise HTTPError(409, "the episode is over; make a new env")
            from agentrl.env import answer_problem

            try:
                answer = await bounded(state.env.step, body.action)
                reason = answer_problem("step", answer)  # a NaN reward or a lone surrogate cannot be sent
            except Exception as e:  # outside the model's control: the episode ends, recorded
                reason = "step timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            if reason:
                obs, reward, terminated, truncated = f"error: the env failed ({reason})", 0.0, False, True
                info = {"error": reason}
            else:
                obs, reward, terminated, truncated, info = answer
                info = _plain(info)
            state.steps += 1
            state.observation, state.info = obs, info
            state.reward += float(reward)
            state.terminated, state.truncated = bool(terminated), bool(truncated)
        return JSONResponse({"observation": obs, "reward": float(reward), "terminated": bool(terminated),
                             "truncated": bool(truncated), "info": info})

    async def close(request: Request) -> Response:
        eid, state = live(request, server_only=True)
        # After the step in flight, if any (a harness that exited or was killed mid-step): the
        # state it returns holds that step's reward, and the env is not closed under it.
        async with state.lock:
            if envs.get(eid) is not state:
                raise HTTPError(404, f"no env {eid!r} (closed, expired or never made)")
            envs.pop(eid)
            closing = asyncio.get_running_loop().run_in_executor(pool, close_quietly, state.env)
            # At most step_timeout_s: an env stuck in close() (a container that will not stop) goes
            # on closing on its thread, and the state, the reward the runner reads, is answered.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(closing), config.step_timeout_s)
        return JSONResponse(state.state(eid))

    async def registry(request: Request) -> Response:
        check(request)
        from agentrl.env import list_envs

        return JSONResponse({"envs": list_envs()})

    async def health(request: Request) -> Response:
        check(request)
        return JSONResponse({"ok": True, "envs": len(envs)})

    def guarded(fn: Any) -> Any:
        async def run(request: Request) -> Response:
            try:
                return await fn(request)
            except HTTPError as e:
                return e.response()
        return run

    routes = [Route("/envs", guarded(make), methods=["POST"]),
              Route("/envs/{eid}", guarded(show), methods=["GET"]),
              Route("/envs/{eid}/step", guarded(step), methods=["POST"]),
              Route("/envs/{eid}/close", guarded(close), methods=["POST"]),
              Route("/registry", guarded(registry), methods=["GET"]),
              Route("/health", guarded(health), methods=["GET"])]
    app = Starlette(routes=routes)
    app.state.envs = envs
    return _SizeGate(app, limit)


class _SizeGate:
    """Refuse bodies over the limit (413): a declared length before reading, else while reading."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit
        self.state = app.state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = HTTPError(413, f"request body over {self.limit} bytes").response()
        if declared_too_large(scope, self.limit) or await call_with_body_limit(
                self.app, scope, receive, send, self.limit):
            await too_large(scope, receive, send)


def _no_exit(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, with a ``SystemExit`` (an env's argparse or library exiting) as a
    ``RuntimeError``: its episode fails. Done on the env's thread, since asyncio re-raises a
    SystemExit from a task into the event loop, which then stops the server."""
    try:
        return fn(*args)
    except SystemExit as e:
        raise RuntimeError(f"the env called sys.exit({e.code!r})") from None


def _reap(envs: dict[str, _Live], idle_s: float) -> list[Any]:
    """Drop the envs untouched for ``idle_s``; returns them, for the caller to close."""
    now = time.monotonic()
    return [envs.pop(eid).env for eid in [k for k, v in envs.items()
                                          if now - v.last_used > idle_s and not v.lock.locked()]]


def _close_made(made: asyncio.Future, pool: DaemonPool) -> None:
    """Close an env whose make finished after its request gave up (a 504)."""
    if not made.cancelled() and made.exception() is None:
        pool.submit(close_quietly, made.result())


def serve_envs(config: EnvServerConfig, host: str = "127.0.0.1", port: int = 8766) -> None:
    """Run the env server in the foreground (``agentrl env serve``)."""
    import uvicorn

    if not config.token:
        raise ConfigError("env serve: a non-empty token is required")
    sock = listen_socket(host, port)  # a port in use fails here, before the line that says it serves
    app = create_env_app(config)
    # A request in flight (a step stuck in its env) holds a graceful stop at most this long.
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", access_log=False,
                                           timeout_graceful_shutdown=_GRACEFUL_S))
    print(f"agentrl env server on http://{host}:{sock.getsockname()[1]}", flush=True)  # --port 0: the one it got
    try:
        run_until_stopped(server, sock)  # until Ctrl-C or SIGTERM
    finally:
        close_live_envs(app.state.envs)


def close_live_envs(envs: dict[str, Any], wait_s: float = 20.0) -> int:
    """Close the envs still open when the server stops, each on a thread of its own (an env
    that holds a sandbox, a container or a browser would outlive the server otherwise);
    wait at most ``wait_s`` for them all. Returns how many closes were still running."""
    closers = EnvClosers()
    for live in envs.values():
        closers.close(live.env)
    envs.clear()
    if hung := closers.wait(time.monotonic() + wait_s):
        print(f"warning: {hung} env close() call(s) still running after {wait_s:.0f} s: left behind", flush=True)
    return hung
