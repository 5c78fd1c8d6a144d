"""``openai`` backend: sample from an OpenAI-compatible server, with token ids in and out.

The server owns the model. It can be vLLM's, SGLang's or agentrl's own proxy.
This backend owns the HTTP. A prompt is sent to ``/v1/completions`` as a list
of token ids. The sampled tokens come back as ids through one of two server
extensions:

- ``return_token_ids``: newer vLLM puts integer ``token_ids`` in the choice;
- ``return_tokens_as_token_ids``: tokens are written ``"token_id:N"`` in
  ``logprobs.tokens`` and in the keys of ``logprobs.top_logprobs``.

A server that returns neither is refused with a ``PolicyError``. The text is
never tokenized again: that can give other ids than the ones that were sampled
(``docs/architecture.md``, Principles: token-exact). The local tokenizer
serves ``action_text`` and ``ChatContext`` only.

What a server cannot tell us:

- Entropies. The API returns a few top logprobs, not the whole distribution, so
  ``entropies`` are NaN. A sum over the top k would only be a lower bound.
  Compute entropies in the trainer's forward pass instead.
- Which distribution the logprobs come from. vLLM reports the model's raw
  distribution by default. Start it with ``--logprobs-mode processed_logprobs``
  to get the sampling distribution that ``GenerateResult`` promises.
- Which weights sampled a token. The server owns the weights, so
  ``update_weights`` refuses. A server that sends ``X-Policy-Version`` (the
  agentrl proxy does) tags each result with its own version. For another server
  that is updated out of band, call ``set_version``.

A seed makes a sample repeatable on one server. Another server, or another
backend, draws other tokens from the same seed.

Failures. Connection errors and HTTP 429, 502, 503 and 504 are retried with
exponential backoff; a ``Retry-After`` header is honoured. No wait is longer
than ``MAX_RETRY_WAIT_S`` (a minute): ``Retry-After: inf`` would sleep forever, and
a day's wait looks like a hang to the run that waits. Other statuses fail
at once, and so do read timeouts: a timed-out request may still be running on
the server, which is already slow. Either way the ``PolicyError`` names the
status and the server's message. A 400 that says the context length was exceeded
becomes a ``ContextOverflowError``. An answer that is not what was asked for is a
``PolicyError`` too, never trained on: no tokens, more than ``max_tokens``, a token
id outside the tokenizer's vocabulary (a server running another model), a logprob
that is NaN or above 0, or fewer top logprobs than asked.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import random
import threading
import time
from typing import Any, Literal

import httpx

from ..errors import ContextOverflowError, PolicyError
from ..loopthread import LoopThread
from .base import FinishReason, GenerateRequest, GenerateResult, SamplingParams, stop_string_hit

__all__ = ["OpenAIPolicy", "completion_body", "completion_result", "retry_delay"]

TokenIdsMode = Literal["auto", "return_token_ids", "return_tokens_as_token_ids"]
_MODES = ("auto", "return_token_ids", "return_tokens_as_token_ids")
RETRY_STATUSES = frozenset({429, 502, 503, 504})
# Connection failures. Resending a completion is safe: it changes nothing on the server.
_RETRY_ERRORS = (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ConnectTimeout)
MAX_RETRY_WAIT_S = 60.0
_ID_PREFIX = "token_id:"
VERSION_HEADER = "X-Policy-Version"


def completion_body(model: str, request: GenerateRequest,
                    token_ids_mode: TokenIdsMode = "auto") -> dict[str, Any]:
    """The JSON body of ``POST /v1/completions`` for one request.

    ``logprobs`` is at least 1, because the sampled tokens' own logprobs come
    with it. Extensions that are off (``top_k=0``, no stop ids, no seed) are
    left out, so that a stricter server is not sent fields it does not know.
    """
    p = request.params
    body: dict[str, Any] = {
        "model": model, "prompt": list(request.prompt_ids), "max_tokens": p.max_new_tokens,
        "temperature": p.temperature, "top_p": p.top_p, "n": 1, "stream": False,
        "logprobs": max(1, p.logprobs),
        "include_stop_str_in_output": True,  # keep the text of the tokens we keep
    }
    if p.top_k:
        body["top_k"] = p.top_k
    if p.stop:
        body["stop"] = list(p.stop)
    if p.stop_token_ids:
        body["stop_token_ids"] = list(p.stop_token_ids)
    if p.seed is not None:
        body["seed"] = p.seed
    if token_ids_mode in ("auto", "return_token_ids"):
        body["return_token_ids"] = True
    if token_ids_mode in ("auto", "return_tokens_as_token_ids"):
        body["return_tokens_as_token_ids"] = True
    return body


def _id_of(token: Any) -> int | None:
    """``N`` from ``"token_id:N"``; None for a token written as text."""
    if isinstance(token, str) and token.startswith(_ID_PREFIX):
        digits = token[len(_ID_PREFIX):]
        if digits.isdigit():
            return int(digits)
    return None


def _sampled_ids(choice: dict[str, Any], vocab_size: int | None) -> list[int]:
    """The sampled token ids, from whichever of the two forms the server returned; each an
    int in ``[0, vocab_size)`` (a float, a bool or a string is not cast into one)."""
    direct = choice.get("token_ids")
    tokens = (choice.get("logprobs") or {}).get("tokens") or []
    via_text = [_id_of(t) for t in tokens]
    from_tokens = via_text if tokens and None not in via_text else None
    if direct is None and from_tokens is None:
        raise PolicyError(
            "the server returned no token ids, only text; the openai backend needs a server "
            "that supports `return_token_ids` or `return_tokens_as_token_ids` (vLLM does), "
            "because tokenizing the text again would not give the sampled ids")
    ids = direct if direct is not None else from_tokens
    if not isinstance(ids, list):
        raise PolicyError(f"the server's `token_ids` is not a list: {ids!r:.100}")
    top = vocab_size if vocab_size is not None else float("inf")
    bad = [t for t in ids if type(t) is not int or not 0 <= t < top]
    if bad:
        raise PolicyError(f"the server returned token id {bad[0]!r:.40}, not an id of the tokenizer's vocabulary "
                          f"[0, {vocab_size}): is it serving the model this tokenizer belongs to?")
    if from_tokens is not None and ids != from_tokens:
        raise PolicyError("the server's `token_ids` and its `token_id:N` tokens disagree")
    return ids


def _top_k(entry: dict[str, float] | None, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely ``(id, logprob)`` of one position, best first.

    vLLM adds the sampled token to the top k when it is not among them, so an
    entry can hold ``k + 1`` tokens.
    """
    pairs = [(_id_of(name), float(lp)) for name, lp in (entry or {}).items()]
    if any(i is None for i, _ in pairs):
        raise PolicyError("the server named its top logprobs by text, not by id; ask for top "
                          "logprobs only from a server that supports `return_tokens_as_token_ids`")
    if len(pairs) < k:
        raise PolicyError(f"the server returned {len(pairs)} top logprobs for a token, {k} asked")
    return sorted(pairs, key=lambda p: -p[1])[:k]  # type: ignore[arg-type, return-value]


_NONE = object()  # the server named no stop reason at all


def _finish_reason(choice: dict[str, Any], token_ids: list[int], params: SamplingParams,
                   eos_ids: set[int], tokenizer: Any = None) -> FinishReason:
    """Our finish reason for the server's answer: ``hf``'s, read from the tokens.

    Servers say ``stop`` for EOS, stop tokens and stop strings alike; vLLM says
    which in ``stop_reason``, SGLang in ``matched_stop`` (a string is a stop
    string, an id or None a token). What they say does not always fit the
    tokens, so the tokens decide, in ``hf``'s order:

    - a last token that is EOS or a stop token is ``stop``, even where the
      server says ``length`` (vLLM checks ``max_tokens`` first, so an EOS that
      is also the last token allowed ends as ``length``: the turn did end);
    - else a stop string that the last token completes (``stop_string_hit``,
      on ``tokenizer``) is ``stop_string``, even where the server names none,
      says null, or says ``length``;
    - else the server's word: a stop string it names, or ``stop`` (an EOS of
      the server's model that this tokenizer does not name), or ``length``.

    Without a tokenizer a server that names no reason ended on a stop string
    exactly when its last token is not a stop token (the best guess left).
    """
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length"):
        raise PolicyError(f"the server ended generation with finish_reason={reason!r}")
    named = next((choice[key] for key in ("stop_reason", "matched_stop") if key in choice), _NONE)
    if token_ids[-1] in eos_ids | set(params.stop_token_ids):
        return "stop"
    if params.stop and tokenizer is not None and _completes_stop_string(tokenizer, token_ids, params.stop):
        return "stop_string"
    if reason == "length":
        return "length"
    if isinstance(named, str):
        return "stop_string"
    if named is _NONE and tokenizer is None and params.stop:
        return "stop_string"
    return "stop"


def _completes_stop_string(tokenizer: Any, token_ids: list[int], stop: tuple[str, ...]) -> bool:
    """Whether the last token completes a stop string: a hit now that was not one a token earlier
    (then the server sampled past it, and it did not end the reply)."""
    return stop_string_hit(tokenizer, token_ids, stop) and not stop_string_hit(tokenizer, token_ids[:-1], stop)


def completion_result(data: dict[str, Any], params: SamplingParams, eos_ids: set[int],
                      version: int, vocab_size: int | None = None, tokenizer: Any = None) -> GenerateResult:
    """A ``GenerateResult`` from a ``/v1/completions`` response body (one choice), checked
    against what was asked (see the module docstring); ``vocab_size``: the tokenizer's;
    ``tokenizer`` finds the stop string a reply ends on (``_finish_reason``)."""
    try:
        choice = data["choices"][0]
        ids = _sampled_ids(choice, vocab_size)
        if not 1 <= len(ids) <= params.max_new_tokens:
            raise PolicyError(f"the server returned {len(ids) or 'no'} tokens for max_tokens={params.max_new_tokens}")
        logprobs = choice.get("logprobs") or {}
        chosen = [float(x) for x in logprobs.get("token_logprobs") or []]
        if len(chosen) != len(ids):
            raise PolicyError(f"the server returned {len(chosen)} logprobs for {len(ids)} tokens")
        wrong = [(i, x) for i, x in enumerate(chosen) if not x <= 0]  # NaN too
        if wrong:
            raise PolicyError(f"the server returned logprob {wrong[0][1]} for token {wrong[0][0]}: "
                              "a log-probability is a number <= 0")
        tops = None
        if params.logprobs:
            entries = logprobs.get("top_logprobs") or []
            if len(entries) != len(ids):
                raise PolicyError(f"the server returned {len(entries)} top-logprob entries "
                                  f"for {len(ids)} tokens")
            tops = [_top_k(e, params.logprobs) for e in entries]
        finish = _finish_reason(choice, ids, params, eos_ids, tokenizer)
        details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise PolicyError(f"malformed completion response ({e!r}): {str(data)[:300]}") from e
    return GenerateResult(ids, chosen, [math.nan] * len(ids), finish, version, tops, cached)


def retry_delay(attempt: int, backoff: float, retry_after: str | None = None) -> float:
    """Seconds to wait before resending after failed try number ``attempt`` (0-based).

    The server's ``Retry-After`` (seconds or an HTTP date) wins when it sent
    one. Otherwise: ``backoff * 2**attempt``, scaled by a random factor in
    [0.5, 1] so that many requests refused together do not all come back together.
    Either way at most ``MAX_RETRY_WAIT_S``.
    """
    if retry_after:
        try:
            return min(MAX_RETRY_WAIT_S, max(0.0, float(retry_after)))
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(retry_after)
                return min(MAX_RETRY_WAIT_S, max(0.0, when.timestamp() - time.time()))
            except (TypeError, ValueError):
                pass  # unreadable: fall back to our own schedule
    return min(MAX_RETRY_WAIT_S, backoff * 2 ** attempt) * random.uniform(0.5, 1.0)


def _server_message(resp: httpx.Response) -> str:
    """The error text of a failed response: OpenAI's ``error.message`` or the closest thing."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:500] or resp.reason_phrase
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if key in data:
                return str(data[key])
    return str(data)[:500]


class OpenAIPolicy:
    """A ``Policy`` served by an OpenAI-compatible server at ``base_url``.

    ``base_url`` is the server's root, with or without the trailing ``/v1``.
    ``model`` is the name the server knows the model by. ``tokenizer`` must be
    the server model's tokenizer. ``token_ids_mode`` picks which token-id
    extension to ask for: ``auto`` asks for both and reads whichever comes
    back. ``max_retries`` counts resends, so a request is tried up to
    ``max_retries + 1`` times. ``timeout`` bounds connecting, and each read and
    write, in seconds. ``max_connections`` bounds the requests in flight on
    each event loop.

    ``agenerate`` is the async API. ``generate`` runs a whole list at once, on
    a private event loop, so it also works when the caller already runs a loop.
    """

    def __init__(self, base_url: str, model: str, tokenizer: Any, api_key: str | None = None,
                 timeout: float = 60.0, max_retries: int = 3, backoff: float = 0.5,
                 max_connections: int = 64, token_ids_mode: TokenIdsMode = "auto"):
        bad = [f"{name}={value!r} ({rule})" for name, value, ok, rule in (
            ("base_url", base_url, str(base_url).startswith(("http://", "https://")),
             "an http:// or https:// URL"),
            ("timeout", timeout, timeout > 0, "> 0"),
            ("max_retries", max_retries, max_retries >= 0, ">= 0"),
            ("backoff", backoff, backoff >= 0, ">= 0"),
            ("max_connections", max_connections, max_connections >= 1, ">= 1"),
            ("token_ids_mode", token_ids_mode, token_ids_mode in _MODES, f"one of {_MODES}"),
        ) if not ok]
        if bad:
            raise PolicyError("invalid OpenAIPolicy arguments: " + ", ".join(bad))
        root = base_url.rstrip("/")
        self.base_url = root if root.endswith("/v1") else root + "/v1"
        self.model = model
        self.tokenizer = tokenizer
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_connections = max_connections
        self.token_ids_mode = token_ids_mode
        self.version = 0
        eos = tokenizer.eos_token_id
        self.eos_ids: set[int] = {eos} if isinstance(eos, int) else set(eos or [])
        self.vocab_size = len(tokenizer)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # An httpx client's connections belong to the event loop that opened them,
        # so each loop (ours, or a caller's) gets its own client.
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._clients_lock = threading.Lock()
        self._loop_thread: LoopThread | None = None  # the private loop of the sync API, made on first use

    def _loop(self) -> LoopThread:
        with self._clients_lock:
            if self._loop_thread is None:
                self._loop_thread = LoopThread("agentrl-openai")
            return self._loop_thread

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        with self._clients_lock:
            for old in [lp for lp in self._clients if lp.is_closed()]:
                del self._clients[old]  # its loop is gone; so are its connections
            if loop not in self._clients:
                self._clients[loop] = httpx.AsyncClient(
                    base_url=self.base_url, headers=self._headers,
                    # No pool timeout: a request waiting for a free connection is queued, not late.
                    timeout=httpx.Timeout(self.timeout, pool=None),
                    limits=httpx.Limits(max_connections=self.max_connections,
                                        max_keepalive_connections=self.max_connections))
            return self._clients[loop]

    async def _post(self, body: dict[str, Any]) -> httpx.Response:
        """POST a completion, resending on the failures worth resending (see the module docstring)."""
        url, tries = f"{self.base_url}/completions", self.max_retries + 1
        client = self._client()
        for attempt in range(tries):
            last = attempt == tries - 1
            try:
                resp = await client.post("/completions", json=body)
            except _RETRY_ERRORS as e:
                if last:
                    raise PolicyError(f"could not reach {url} after {tries} tries: {e!r}") from e
                await asyncio.sleep(retry_delay(attempt, self.backoff))
                continue
            except httpx.TimeoutException as e:
                raise PolicyError(f"{url} did not answer within timeout={self.timeout} s "
                                  f"({type(e).__name__}); raise `timeout` for long generations") from e
            except httpx.HTTPError as e:
                raise PolicyError(f"POST {url} failed: {e!r}") from e
            if resp.status_code < 400:
                return resp
            if resp.status_code in RETRY_STATUSES and not last:
                await asyncio.sleep(retry_delay(attempt, self.backoff, resp.headers.get("retry-after")))
                continue
            message = _server_message(resp)
            where = f" after {tries} tries" if resp.status_code in RETRY_STATUSES else ""
            error = f"POST {url} failed with HTTP {resp.status_code}{where}: {message}"
            if resp.status_code == 400 and "context length" in message.lower():
                raise ContextOverflowError(error)
            raise PolicyError(error)
        raise AssertionError("unreachable")  # the last try returns or raises

    def _version_from(self, headers: httpx.Headers, sent_at: int) -> int:
        """The server's weights version if it reports one, else the local one when sent."""
        raw = headers.get(VERSION_HEADER)
        if raw is None:
            return sent_at
        try:
            version = int(raw)
        except ValueError:
            raise PolicyError(f"the server sent a bad {VERSION_HEADER} header: {raw!r}") from None
        self.version = max(self.version, version)  # responses can arrive out of order
        return version

    async def agenerate(self, request: GenerateRequest) -> GenerateResult:
        """Sample one continuation of ``request.prompt_ids`` on the server."""
        if not request.prompt_ids:
            raise PolicyError("the request has an empty prompt")
        if request.admissible:
            raise PolicyError("the openai backend cannot constrain a reply to admissible actions (no field of "
                              "the API does it); rollout.constrain: admissible needs hf or vllm")
        sent_at = self.version
        resp = await self._post(completion_body(self.model, request, self.token_ids_mode))
        version = self._version_from(resp.headers, sent_at)
        try:
            data = resp.json()
        except ValueError as e:
            raise PolicyError(f"the server's answer is not JSON: {resp.text[:300]!r}") from e
        return completion_result(data, request.params, self.eos_ids, version, self.vocab_size, self.tokenizer)

    async def _agenerate_all(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        tasks = [asyncio.ensure_future(self.agenerate(r)) for r in requests]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:  # one failed: do not leave the others running
                t.cancel()
            raise

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Run all requests concurrently; results in the order of ``requests``."""
        if not requests:
            return []
        return self._loop().run(self._agenerate_all(requests))

    def update_weights(self, state_dict: dict[str, Any]) -> None:
        """Refuse: the server owns the weights (no standard endpoint loads new ones)."""
        raise PolicyError(
            f"the openai backend cannot load weights: the server at {self.base_url} owns them. "
            "Update the server out of band (restart it on the new checkpoint, or use its own "
            "weight-sync API), then call set_version(v) so that tokens name the weights that sampled them")

    def set_version(self, version: int) -> None:
        """Record that the server now runs weights ``version`` (updated out of band)."""
        if not isinstance(version, int) or version < 0:
            raise PolicyError(f"version must be an int >= 0, got {version!r}")
        self.version = version

    async def aclose(self) -> None:
        """Close the connections opened on the running event loop."""
        with self._clients_lock:
            client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    def close(self) -> None:
        """Close the private loop's connections and stop its thread."""
        if self._loop_thread is not None:
            self._loop_thread.run(self.aclose())
            self._loop_thread.close()
