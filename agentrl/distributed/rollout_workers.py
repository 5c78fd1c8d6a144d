"""Rollout-worker actors: generation load-balanced over policy backends in a Ray cluster.

``RayPolicy`` is a ``Policy`` (the engine and the trainer see no difference)
whose ``agenerate`` sends each request to one of
``distributed.num_rollout_workers`` ``RolloutWorker`` actors. Each worker owns
one backend built from ``policy`` (``hf`` on CPU or a GPU, ``vllm``, ...), with
its own micro-batcher and prefix cache; it is an async actor, so the requests
routed to it at once share its batches.

Routing with prefix-cache affinity (``PrefixRouter``): a request goes to the
worker that served the longest prefix of its prompt. An episode's next prompt
extends its previous prompt and the tokens sampled for it, so its turns stay
on the worker that holds their keys and values; a prompt with no known prefix
goes to the least busy worker (ties in turn). A request carries no episode id
(``GenerateRequest`` is token ids and sampling parameters), and the prompt's
prefix is that id: two episodes whose histories are identical token for token
are interchangeable. Affinity gives way when the matched worker has
``max_batch_size`` more requests in flight than the least busy one.

Weights travel through Ray's object store: ``update_weights(state_dict)`` puts
the state dict there once (``ray.put``) and every worker loads it from there,
so the driver sends it once whatever the number of workers. ``weights_updated()``
pushes the weights of ``model``, the in-process copy a trainer trains (with
LoRA adapters merged in, ``merged_weights``).

Failures: Ray restarts a dead worker (``distributed.max_restarts``); one whose
restarts fail ``max_failed_starts`` times in a row (it crashes while it loads, or
does not answer within the call timeout) is lost and killed, as Ray would restart
it for ever under ``max_restarts=-1`` and the run would never stop. A request
whose worker died is sent again to another worker, up to
``distributed.generate_retries`` times, so the episode goes on; past that it
fails with ``PolicyError`` naming the deaths, and the engine records it in the
episode's tree. A request that was in flight on ``distributed.max_request_deaths``
workers that died fails then, whatever retries are left: a request that kills
the worker it lands on (an out-of-memory prompt) would take the next one down
too, so it fails alone instead of taking down the fleet. A generation is pure given the weights, the prompt and the
seed, so a retry samples what the dead worker would have (same weights,
version and seed). A restarted worker comes back with the starting weights:
before it serves again it loads the latest weights (their object-store
reference is kept), version and settings. A call that outlasts the call timeout
(``RayPolicy(call_timeout_s=...)``) is slow, not dead: no death is counted, and the
worker is resynced the same way before it serves again. ``stats`` counts the deaths
seen, the requests retried and the slow calls.

Asynchronous training (``train.asynchronous``): the workers already sample
from their own copy of the weights, so the producer samples through a
``RaySampler`` (``ray_sampler.py``) over the same workers; the trainer's sync
pushes the new weights, and a worker loads them between two of its ``generate``
batches (``HFPolicy.weights_lock``), so every token keeps the version that
sampled it; the sampler then checks the version each worker reports.

Not forwarded across processes: a ``RequestControl``'s ``on_token`` (no
streaming from a worker). Cancelling the awaiting task cancels the remote call.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..config import Config, DistributedConfig, PolicyConfig
from ..errors import PolicyError
from ..policy.base import GenerateRequest, GenerateResult, SamplingParams
from .cluster import cancel_call, check_placeable, connect, ray_error, restart_count, wait_for_room
from .ray_sampler import RaySampler
from .weights import merged_weights, wire_weights

__all__ = ["PrefixRouter", "RayPolicy", "RolloutWorker", "merged_weights", "placement"]

_CALL_TIMEOUT_S = 600.0  # RayPolicy(call_timeout_s=...)'s default
_MAX_FAILED_STARTS = 3  # RayPolicy(max_failed_starts=...)'s default
_MOD = (1 << 61) - 1  # a Mersenne prime: rolling prefix hashes modulo it
_BASE = 1_000_003


def _prefix_hashes(ids: list[int]) -> list[int]:
    """``h[i]``: the rolling hash of ``ids[:i]`` (``h[0]`` is the empty prefix)."""
    h, out = 0, [0]
    for t in ids:
        h = (h * _BASE + t + 1) % _MOD
        out.append(h)
    return out


class PrefixRouter:
    """Which worker gets a prompt: the one that served its longest known prefix.

    ``record(ids, worker)`` remembers that ``worker`` holds ``ids`` (a prompt,
    and the prompt with its sampled tokens) in its cache; ``pick`` walks the
    prompt's prefixes from the longest down. An LRU bound keeps ``capacity``
    sequences. ``slack``: affinity yields to balance when the matched worker has
    that many more requests in flight than the least busy one.
    """

    def __init__(self, workers: int, slack: int = 16, capacity: int = 200_000):
        self.load = [0] * workers
        self.slack, self.capacity = slack, capacity
        self._owner: OrderedDict[int, int] = OrderedDict()
        self._turn = 0
        self._lock = threading.Lock()

    def owner(self, prompt: list[int]) -> int | None:
        """The worker that served the longest recorded prefix of ``prompt``, if any."""
        hashes = _prefix_hashes(prompt)
        with self._lock:
            for h in reversed(hashes[1:]):
                w = self._owner.get(h)
                if w is not None:
                    self._owner.move_to_end(h)
                    return w
        return None

    def pick(self, prompt: list[int], avoid: set[int] | frozenset[int] = frozenset()) -> int:
        """The worker for ``prompt``, counted as busy with it until ``done``; never one in
        ``avoid`` (dead, or just failed this request) unless every worker is."""
        w = self.owner(prompt)
        with self._lock:
            n = len(self.load)  # the least busy; ties go round-robin, so one-at-a-time requests spread
            ok = [i for i in ((self._turn + j) % n for j in range(n)) if i not in avoid] or list(range(n))
            least = min(ok, key=self.load.__getitem__)
            if w is None or w in avoid or self.load[w] - self.load[least] >= self.slack:
                w = least
                self._turn = (least + 1) % n
            self.load[w] += 1
        return w

    def done(self, worker: int, sequences: list[list[int]]) -> None:
        """``worker`` finished a request and now holds ``sequences`` (prompt, prompt + tokens)."""
        ends = [_prefix_hashes(ids)[-1] for ids in sequences if ids]
        with self._lock:
            self.load[worker] -= 1
            for h in ends:
                self._owner[h] = worker
                self._owner.move_to_end(h)
            while len(self._owner) > self.capacity:
                self._owner.popitem(last=False)


class RolloutWorker:
    """The actor: one backend built from a ``PolicyConfig`` (an async actor)."""

    def __init__(self, policy: dict[str, Any]):
        from ..policy.registry import make_policy

        self.policy = make_policy(PolicyConfig.model_validate(policy))
        self.incarnation = uuid.uuid4().hex  # a restart makes a new one: the caller sees it came back

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "incarnation": self.incarnation, "version": self.policy.version,
                "deterministic_by_default": bool(getattr(self.policy, "deterministic_by_default", False)),
                "has_deterministic": hasattr(self.policy, "deterministic"),
                "constrains_actions": bool(getattr(self.policy, "constrains_actions", False))}

    async def generate(self, prompt_ids: list[int], params: SamplingParams, admissible: tuple[str, ...] | None = None,
                       admissible_head: int = 0) -> tuple[GenerateResult, str]:
        """The result, and the incarnation that sampled it; ``admissible``: a constrained reply."""
        request = GenerateRequest(prompt_ids, params, admissible=admissible, admissible_head=admissible_head)
        return await self.policy.agenerate(request), self.incarnation

    async def update_weights(self, state_dict: dict[str, Any], version: int | None = None) -> int:
        """Load the weights (Ray resolved the object-store ref: numpy arrays are read in place
        from shared memory, and copied once, into the model) and take ``version`` if given;
        the new version. Runs off the actor's loop: an ``hf`` backend loads between two of its
        ``generate`` batches, while requests keep arriving."""
        return await asyncio.to_thread(self._load, state_dict, version)

    def _load(self, state_dict: dict[str, Any], version: int | None) -> int:
        import numpy as np
        import torch

        with warnings.catch_warnings():  # read-only arrays: load_state_dict copies, never writes them
            warnings.simplefilter("ignore", UserWarning)
            weights = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in state_dict.items()}
        def load() -> int:  # the version moves with the weights, in one step for a sampling batch
            self.policy.update_weights(weights)
            if version is not None:
                self.policy.version = version
            return self.policy.version

        return self._locked(load)

    async def set_version(self, version: int) -> None:
        await asyncio.to_thread(self._locked, setattr, self.policy, "version", version)

    async def set_deterministic(self, on: bool) -> None:
        await asyncio.to_thread(self._locked, setattr, self.policy, "deterministic", on)

    def _locked(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` between two generate batches: a running batch keeps its version and mode."""
        with getattr(self.policy, "weights_lock", None) or contextlib.nullcontext():
            return fn(*args)


class RayPolicy:
    """A ``Policy`` over rollout-worker actors (see the module docstring).

    ``model``: an in-process copy of the weights for a trainer to train
    (``weights_updated`` pushes it); None when only rollouts are wanted.
    ``on_dispatch(request, worker)`` is called as each request is routed.
    ``call_timeout_s``: how long the workers may take to start, and a worker to answer a
    settings or weights call or to come back from a restart (loading the model each time).
    ``max_failed_starts``: a worker whose restarts fail this many times in a row (it crashes
    while it starts, or does not answer within ``call_timeout_s``) is lost, whatever
    ``distributed.max_restarts`` is left (-1 would restart it for ever).
    """

    def __init__(self, policy: PolicyConfig, dist: DistributedConfig, tokenizer: Any,
                 model: Any = None, *, call_timeout_s: float = _CALL_TIMEOUT_S,
                 max_failed_starts: int = _MAX_FAILED_STARTS):
        if dist.num_rollout_workers < 1:
            raise PolicyError("RayPolicy needs distributed.num_rollout_workers >= 1")
        if not call_timeout_s > 0:  # NaN too: every wait would end at once
            raise PolicyError(f"RayPolicy(call_timeout_s={call_timeout_s!r}): it must be > 0 seconds")
        if not (isinstance(max_failed_starts, int) and max_failed_starts >= 1):
            raise PolicyError(f"RayPolicy(max_failed_starts={max_failed_starts!r}): it must be an int >= 1")
        self.call_timeout_s, self.max_failed_starts = float(call_timeout_s), max_failed_starts
        ray = connect(dist)  # first: it says how to install Ray where it is missing
        from ray.exceptions import GetTimeoutError

        self.tokenizer, self.model = tokenizer, model
        self.retries, self.max_request_deaths = dist.generate_retries, dist.max_request_deaths
        need = {"CPU": float(dist.rollout_worker_cpus)}
        if dist.rollout_worker_gpus:
            need["GPU"] = float(dist.rollout_worker_gpus)
        keys = "distributed.num_rollout_workers, rollout_worker_cpus, rollout_worker_gpus"
        check_placeable(ray, need, "rollout worker", dist.num_rollout_workers, keys)
        wait_for_room(ray, need, "rollout worker", dist.num_rollout_workers, keys)
        actor = ray.remote(RolloutWorker).options(num_cpus=dist.rollout_worker_cpus,
                                                  num_gpus=dist.rollout_worker_gpus,
                                                  max_restarts=dist.max_restarts, max_task_retries=0)
        self.workers = [actor.remote(policy.model_dump()) for _ in range(dist.num_rollout_workers)]
        try:
            infos = ray.get([w.info.remote() for w in self.workers], timeout=self.call_timeout_s)
        except BaseException as e:  # a Ctrl-C too: a notebook that goes on would keep them reserved
            for w in self.workers:
                with contextlib.suppress(Exception):  # the cluster may be gone: the error says why
                    ray.kill(w)
            if isinstance(e, GetTimeoutError):
                raise PolicyError(f"the rollout workers did not start within {self.call_timeout_s:g} s (loading "
                                  f"{policy.model} on each): killed") from e
            if not isinstance(e, Exception):
                raise
            raise ray_error(e, PolicyError, "a rollout worker") from e
        self._version = int(infos[0]["version"])
        self.deterministic_by_default = bool(infos[0]["deterministic_by_default"])
        self._deterministic: bool | None = None
        self._has_deterministic = all(i["has_deterministic"] for i in infos)
        self.constrains_actions = all(i["constrains_actions"] for i in infos)  # rollout.constrain
        self.router = PrefixRouter(len(self.workers), slack=policy.max_batch_size)
        self.on_dispatch: Callable[[GenerateRequest, int], None] | None = None
        self.sync_seconds: list[float] = []
        # -- fault tolerance: which incarnation of each worker holds the current weights
        self._incarnation = [i["incarnation"] for i in infos]
        self._weights_ref: Any = None  # the latest pushed weights (None: the starting ones)
        self._stale: set[int] = set()  # died since they last loaded: resync before serving
        self._dead: set[int] = set()  # lost: Ray's restarts used up, or its starts kept failing
        self._lost_reason = ""  # how the last of them died, as Ray said
        # -- restart waits that ran out since each worker last answered (failed starts)
        self._failed_waits = [0] * len(self.workers)
        self._last_failed_wait = [0.0] * len(self.workers)  # when the last counted one ran out
        self._max_restarts = dist.max_restarts
        self._state_lock = threading.Lock()
        self._push_lock = threading.Lock()  # one push or resync at a time: versions move in order
        self._resyncing: set[int] = set()  # stale workers a background thread is bringing back
        self._closed = False
        self.stats = {"rollout_workers/deaths": 0, "rollout_workers/retried_requests": 0,
                      "rollout_workers/lost": 0, "rollout_workers/slow_calls": 0}

    # -- generation --------------------------------------------------------------------
    async def agenerate(self, request: GenerateRequest, *, sampler: RaySampler | None = None) -> GenerateResult:
        """Route the request (prefix affinity) and await its worker's result; sent again to
        another worker when its worker dies, up to ``distributed.generate_retries`` times."""
        if self._closed:
            raise PolicyError("the rollout workers are closed")
        prompt = list(request.prompt_ids)
        failed: set[int] = set()
        reasons: list[str] = []
        deaths = 0  # workers that died while this request was running on them
        for _ in range(self.retries + 1):
            with self._state_lock:
                live = set(range(len(self.workers))) - self._dead
                if not live:
                    break
                ready = live - self._stale - failed  # a stale worker serves only when no ready one is left
                usable = ready or (live - failed) or live
                avoid = set(range(len(self.workers))) - usable
            w = self.router.pick(prompt, avoid)
            out: list[list[int]] = [prompt]
            ref = None
            sent = None  # the incarnation the request went to
            try:  # whatever fails, the worker's load is given back (finally)
                if w in self._stale or w in self._dead:
                    await asyncio.to_thread(self._resync, w)  # raises _Unusable unless it is ready now
                sent = self._incarnation[w]
                if sampler is not None and sampler.closed:
                    raise PolicyError("sampling stopped: the rollout producer is closing")
                if self.on_dispatch is not None:
                    self.on_dispatch(request, w)
                ref = self.workers[w].generate.remote(prompt, request.params, request.admissible,
                                                      request.admissible_head)
                if sampler is not None:
                    sampler.track(ref)
                res, incarnation = await ref
                if incarnation != sent:  # it died idle and came back with the starting weights
                    raise _Restarted(f"rollout worker {w} restarted since it last loaded the weights")
            except asyncio.CancelledError:
                cancel_call(ref)
                raise
            except Exception as e:
                err = ray_error(e, PolicyError, f"rollout worker {w}")
                if not _died(e) or self._closed or (sampler is not None and sampler.closed):
                    raise err from e
                self._note_death(w, sent)
                failed.add(w)
                reasons.append(str(err))
                deaths += _in_flight_death(e, ref)
                if deaths >= self.max_request_deaths:
                    raise PolicyError(
                        f"the request was running on {deaths} rollout workers that died "
                        f"(distributed.max_request_deaths={self.max_request_deaths}): a request that kills "
                        f"its worker (out of memory, say) fails alone rather than take more workers down: "
                        f"{'; '.join(reasons)}") from e
                continue
            else:
                out.append(prompt + list(res.token_ids))
                if reasons:
                    with self._state_lock:
                        self.stats["rollout_workers/retried_requests"] += 1
                return res
            finally:
                self.router.done(w, out)
                if sampler is not None and ref is not None:
                    sampler.untrack(ref)
        raise PolicyError(f"no rollout worker could serve the request: {len(reasons)} attempts failed "
                          f"(distributed.generate_retries={self.retries}; {len(self._dead)} of "
                          f"{len(self.workers)} workers lost): {'; '.join(reasons) or 'every worker is lost'}")

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """A batch, spread over the workers as ``agenerate`` would; blocks until all are done."""
        async def run() -> list[GenerateResult]:
            return list(await asyncio.gather(*(self.agenerate(r) for r in requests)))

        return asyncio.run(run())

    # -- faults ------------------------------------------------------------------------------
    def _note_death(self, w: int, incarnation: str | None) -> None:
        """Worker ``w``'s ``incarnation`` died (or came back restarted): count each death once,
        however many of its requests fail, and resync ``w`` before it serves again. A failure
        of an incarnation already replaced (resynced since) is not counted again."""
        with self._state_lock:
            if self._closed:  # close() killed them: no death to count
                return
            if incarnation in (None, self._incarnation[w]) and w not in self._stale and w not in self._dead:
                self._stale.add(w)
                self.stats["rollout_workers/deaths"] += 1
        self._resync_soon(w)

    def _note_slow(self, w: int) -> None:
        """Worker ``w`` did not answer a call within ``call_timeout_s``: slow (a long batch holds
        its weights lock, say), not dead, so no death is counted; it may not have taken the
        call's state yet, so it is resynced before it serves again, as a restarted one is."""
        with self._state_lock:
            if self._closed or w in self._dead:
                return
            self._stale.add(w)
            self.stats["rollout_workers/slow_calls"] += 1
        self._resync_soon(w)

    def _resync_soon(self, w: int) -> None:
        """Bring stale worker ``w`` back in a background thread (requests meanwhile go to the
        ready workers); one such thread a worker at a time."""
        with self._state_lock:
            if self._closed or w in self._dead or w not in self._stale or w in self._resyncing:
                return
            self._resyncing.add(w)

        def run() -> None:
            try:
                self._resync(w)
            except _Unusable:
                pass  # still stale: the next push, or a request with no ready worker, tries again
            finally:
                with self._state_lock:
                    self._resyncing.discard(w)

        threading.Thread(target=run, name=f"agentrl-resync-{w}", daemon=True).start()

    def _resync(self, w: int) -> None:
        """Make worker ``w`` ready to serve (blocking; run in a thread): wait for its restart,
        then give it the latest weights, version and settings. Raises ``_Unusable`` when it
        cannot serve now (the caller tries another worker); a worker Ray will not restart
        (``ActorDiedError``) is marked lost for good."""
        import ray
        from ray.exceptions import ActorDiedError

        if w in self._dead:
            raise _Unusable(f"rollout worker {w} is lost (max_restarts used up, or its starts kept failing)")
        worker = self.workers[w]
        try:
            info = self._await_start(w)  # outside the push lock: a restart loads the model
            with self._push_lock:
                if w not in self._stale:  # another request did it meanwhile
                    return
                if self._weights_ref is not None:
                    ray.get(worker.update_weights.remote(self._weights_ref, self._version), timeout=self.call_timeout_s)
                else:
                    ray.get(worker.set_version.remote(self._version), timeout=self.call_timeout_s)
                if self._deterministic is not None:
                    ray.get(worker.set_deterministic.remote(self._deterministic), timeout=self.call_timeout_s)
                with self._state_lock:
                    self._incarnation[w] = info["incarnation"]
                    self._stale.discard(w)
                    self._failed_waits[w] = 0  # it answered: a new run of starts begins
        except _Unusable:
            raise
        except Exception as e:
            err = ray_error(e, PolicyError, f"rollout worker {w}")
            if isinstance(e, ActorDiedError):
                self._lose(w, str(err))
                raise _Unusable(f"rollout worker {w} is lost (distributed.max_restarts used up): {err}") from e
            raise _Unusable(f"rollout worker {w} could not be made ready (tried again later): {err}") from e

    def _await_start(self, w: int) -> dict[str, Any]:
        """Worker ``w``'s ``info`` once it is up again (``_await_restart``). It is lost
        (``_Unusable``) after ``max_failed_starts`` starts that failed in a row, as Ray would
        restart it for ever under ``max_restarts=-1``: restarts Ray counts during one wait,
        or waits that ran out (``call_timeout_s``) with no answer in between."""
        from ray.exceptions import ActorUnavailableError, GetTimeoutError

        began = time.monotonic()
        try:
            return _await_restart(self.workers[w], self.call_timeout_s, self.max_failed_starts)
        except _CrashLoop as e:
            failed, restarts = e.args
            why = (f"rollout worker {w} failed to start {failed} times in a row (Ray restarted it {restarts} "
                   f"times, distributed.max_restarts={self._max_restarts}; RayPolicy max_failed_starts="
                   f"{self.max_failed_starts}): it crashes while it starts (loading its model, say)")
            self._lose(w, why)
            raise _Unusable(f"rollout worker {w} is lost: {why}") from e
        except (ActorUnavailableError, GetTimeoutError) as e:
            with self._state_lock:  # waits that overlap a counted one are the same failed start
                if began >= self._last_failed_wait[w]:
                    self._failed_waits[w] += 1
                    self._last_failed_wait[w] = time.monotonic()
                n = self._failed_waits[w]
            if n < self.max_failed_starts:
                raise
            why = (f"rollout worker {w} did not come back within {self.call_timeout_s:g} s {n} times in a row "
                   f"(RayPolicy max_failed_starts={self.max_failed_starts}): lost")
            self._lose(w, why)
            raise _Unusable(why) from e

    def _lose(self, w: int, reason: str) -> None:
        """Worker ``w`` is lost for good (``reason``): no request goes to it again. One Ray
        would go on restarting (a crash loop) is killed, so that it gives its resources back."""
        import ray

        with self._state_lock:
            if w in self._dead or self._closed:
                return
            self._stale.discard(w)
            self._dead.add(w)
            self._lost_reason = reason
            self.stats["rollout_workers/lost"] += 1
        with contextlib.suppress(Exception):  # already dead, or the cluster is gone
            ray.kill(self.workers[w], no_restart=True)

    def _all(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every live worker (call with ``_push_lock`` held). A worker that
        fails is marked stale, so it gets the new state when it next serves (``_resync``);
        raises only when no worker took it and none can: all lost, or a failure that is no
        death (a bad argument fails on every worker alike)."""
        import ray

        live = [w for w in range(len(self.workers)) if w not in self._dead]
        refs = [(w, self._incarnation[w], getattr(self.workers[w], method).remote(*args)) for w in live]
        out, error = [], None
        for w, incarnation, ref in refs:
            try:
                out.append(ray.get(ref, timeout=self.call_timeout_s))
            except Exception as e:
                if _died(e):
                    self._note_death(w, incarnation)
                elif _slow(e):
                    self._note_slow(w)
                else:
                    error = error or ray_error(e, PolicyError, f"rollout worker {w}")
                    with self._state_lock:
                        self._stale.add(w)  # resynced after this push (_resync_soon)
        if not out and (error is not None or not live):
            raise error or PolicyError(f"no rollout worker can take {method}: all "
                                       f"{len(self.workers)} are lost")
        return out

    # -- settings broadcast to every worker --------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        with self._push_lock:
            self._all("set_version", int(value))
            self._version = int(value)

    @property
    def deterministic(self) -> bool:
        if not self._has_deterministic:
            raise AttributeError("deterministic")
        return bool(self._deterministic if self._deterministic is not None else self.deterministic_by_default)

    @deterministic.setter
    def deterministic(self, on: bool) -> None:
        if on != self._deterministic:
            with self._push_lock:
                self._all("set_deterministic", bool(on))
                self._deterministic = bool(on)

    # -- weights -------------------------------------------------------------------------
    def update_weights(self, state_dict: dict[str, Any]) -> None:
        """New weights for every worker (and the in-process ``model``, if any). Names and shapes
        are checked against the in-process model first: one it lacks (plain names given to a
        LoRA-wrapped model) was skipped there without a word while the workers took it."""
        if self.model is not None:
            from ..policy.hf import check_weight_update

            check_weight_update(self.model.state_dict(), state_dict)
            self.model.load_state_dict(state_dict, strict=False)
        self._push(state_dict)

    def weights_updated(self) -> None:
        """``model`` (trained in this process) changed: push its weights to every worker."""
        if self.model is None:
            raise PolicyError("weights_updated() needs the in-process model; use update_weights(state_dict)")
        self._push(merged_weights(self.model))

    def _push(self, state_dict: dict[str, Any]) -> None:
        """Put the weights in the object store once; every worker loads them from there, as
        version ``version + 1``. The reference is kept for a worker that restarts later."""
        import ray

        t0 = time.perf_counter()
        with self._push_lock:
            if self._closed:  # its workers are killed: the weights would stay in the store for nobody
                raise PolicyError("the rollout workers are closed: no weights to push to")
            ref = ray.put(wire_weights(state_dict))
            # a worker that missed it (restarting) is stale and loads this ref when it next serves
            self._all("update_weights", ref, self._version + 1)
            self._weights_ref = ref  # the previous one is freed
            self._version += 1
        self.sync_seconds.append(time.perf_counter() - t0)
        for w in list(self._stale):
            self._resync_soon(w)

    def worker_versions(self) -> dict[int, int]:
        """The weights version each ready worker reports (workers index -> version). A stale
        or lost worker is left out (it loads the latest before it serves); one found restarted
        here is marked stale the same way."""
        import ray

        with self._state_lock:
            ready = [(w, self._incarnation[w]) for w in range(len(self.workers))
                     if w not in self._dead and w not in self._stale]
        refs = [(w, incarnation, self.workers[w].info.remote()) for w, incarnation in ready]
        out: dict[int, int] = {}
        for w, incarnation, ref in refs:
            try:
                info = ray.get(ref, timeout=self.call_timeout_s)
            except Exception as e:
                if _slow(e):
                    self._note_slow(w)
                    continue
                if not _died(e):
                    raise ray_error(e, PolicyError, f"rollout worker {w}") from e
                self._note_death(w, incarnation)
                continue
            if info["incarnation"] != incarnation:  # died idle: it comes back through a resync
                self._note_death(w, incarnation)
                continue
            out[w] = int(info["version"])
        return out

    def workers_gone(self) -> str | None:
        """Why no request can be served any more, when every worker is lost; else None."""
        with self._state_lock:
            if len(self._dead) < len(self.workers) or self._closed:
                return None
            why = f"; last: {self._lost_reason}" if self._lost_reason else ""
        return (f"every rollout worker is lost ({len(self.workers)} of them; Ray restarts a worker "
                f"distributed.max_restarts={self._max_restarts} times){why}")

    def sampler(self) -> RaySampler:
        """A view for asynchronous training's producer (see ``RaySampler``)."""
        return RaySampler(self)

    def close(self) -> None:
        """Kill the workers and let go of the last weights; later and in-flight requests fail
        with the reason."""
        import ray

        self._closed = True
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already gone
                pass
        with self._push_lock:  # after a push that runs now, which would set it again
            self._weights_ref = None  # the object store frees them now, not when this object is collected


def _await_restart(worker: Any, timeout_s: float, max_failed_starts: int | None = None) -> dict[str, Any]:
    """``worker.info()`` once it is up again, within ``timeout_s``: Ray answers "temporarily
    unavailable" while it restarts (which loads the model), and "died" only when it will not
    come back. ``_CrashLoop(failed, restarts)`` once Ray has restarted it ``max_failed_starts``
    more times during the wait: each of those starts failed. Restarts before the wait are not
    counted: a worker that died idle and came back is no failed start."""
    import ray
    from ray.exceptions import ActorUnavailableError

    deadline = time.monotonic() + timeout_s
    first: int | None = None  # Ray's restart count when the wait first found it restarting
    while True:
        try:
            return ray.get(worker.info.remote(), timeout=max(deadline - time.monotonic(), 0.0))
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            if max_failed_starts is not None and (restarts := restart_count(worker)) is not None:
                first = restarts if first is None else first
                if restarts - first >= max_failed_starts:
                    raise _CrashLoop(restarts - first, restarts) from None
            time.sleep(0.1)


class _CrashLoop(Exception):
    """A restarting worker whose starts keep failing: Ray would restart it for ever."""


class _Restarted(Exception):
    """A worker answered from an incarnation that never loaded the current weights."""


class _Unusable(Exception):
    """A worker that cannot serve now (restarting, lost, or its reload failed)."""


def _in_flight_death(e: BaseException, ref: Any) -> bool:
    """Whether ``e`` is the death of the worker while ``ref`` (this request's call) ran on it,
    not a restart found before sending, a failed resync or a timeout."""
    from ray.exceptions import RayActorError

    return ref is not None and isinstance(e, RayActorError)


def _died(e: BaseException) -> bool:
    """``e`` says the worker died, restarted or could not be reached (so the request, a pure
    function of weights, prompt and seed, may go to another), not that the request failed on it.
    ``ActorUnavailableError`` (a restart, or a network blip) counts: the worker is resynced.
    A timeout does not (``_slow``): the worker is busy, and its process and state live on."""
    from ray.exceptions import RayActorError

    return isinstance(e, RayActorError | _Restarted | _Unusable)


def _slow(e: BaseException) -> bool:
    """``e`` says the worker did not answer in time (``GetTimeoutError``), not that it died."""
    from ray.exceptions import GetTimeoutError

    return isinstance(e, GetTimeoutError)


def placement(cfg: Config) -> str:
    """`` on 2 rollout workers (Ray, distributed.ray=auto)`` and the like, for a command's
    loading line; '' when everything runs in this process."""
    dist = cfg.distributed
    if dist is None:
        return ""
    parts = [f"{dist.num_rollout_workers} rollout workers"] if dist.num_rollout_workers else []
    if cfg.rollout.env_executor == "ray":
        parts.append(f"{dist.num_env_workers} env workers")
    return f" on {' and '.join(parts)} (Ray, distributed.ray={dist.ray})" if parts else ""
