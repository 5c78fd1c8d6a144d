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
pushes the weights of ``model``, the in-process copy a trainer trains.

Not forwarded across processes: a ``RequestControl``'s ``on_token`` (no
streaming from a worker). Cancelling the awaiting task cancels the remote call.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..config import Config, DistributedConfig, PolicyConfig
from ..errors import PolicyError
from ..policy.base import GenerateRequest, GenerateResult, Policy, SamplingParams
from .cluster import cancel_call, check_placeable, connect, ray_error

__all__ = ["PrefixRouter", "RayPolicy", "RolloutWorker", "policy_for_run"]

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

    def pick(self, prompt: list[int]) -> int:
        """The worker for ``prompt``, counted as busy with it until ``done``."""
        w = self.owner(prompt)
        with self._lock:
            n = len(self.load)  # the least busy; ties go round-robin, so one-at-a-time requests spread
            least = min(((self._turn + i) % n for i in range(n)), key=self.load.__getitem__)
            if w is None or self.load[w] - self.load[least] >= self.slack:
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

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "version": self.policy.version,
                "deterministic_by_default": bool(getattr(self.policy, "deterministic_by_default", False)),
                "has_deterministic": hasattr(self.policy, "deterministic")}

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateResult:
        return await self.policy.agenerate(GenerateRequest(prompt_ids, params))

    def update_weights(self, state_dict: dict[str, Any]) -> int:
        """Load the weights (Ray resolved the object-store ref: numpy arrays are read in place
        from shared memory, and copied once, into the model); the new version."""
        import numpy as np
        import torch

        with warnings.catch_warnings():  # read-only arrays: load_state_dict copies, never writes them
            warnings.simplefilter("ignore", UserWarning)
            weights = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in state_dict.items()}
        self.policy.update_weights(weights)
        return self.policy.version

    def set_version(self, version: int) -> None:
        self.policy.version = version

    def set_deterministic(self, on: bool) -> None:
        self.policy.deterministic = on  # type: ignore[attr-defined]


def _wire_weights(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state dict as it goes into the object store: each tensor once (a tied weight is
    sent under its first name; ``update_weights`` counts its twin as given), as a numpy array
    where numpy has the dtype (Ray stores those without pickling and workers map them in
    place), else as a tensor (bfloat16)."""
    import torch

    out: dict[str, Any] = {}
    seen: set[int] = set()
    for k, v in state_dict.items():
        if isinstance(v, torch.Tensor):
            v = v.detach().cpu()
            if v.numel() and v.data_ptr() in seen:
                continue
            seen.add(v.data_ptr())
            if v.dtype != torch.bfloat16:
                v = v.numpy()
        out[k] = v
    return out


class RayPolicy:
    """A ``Policy`` over rollout-worker actors (see the module docstring).

    ``model``: an in-process copy of the weights for a trainer to train
    (``weights_updated`` pushes it); None when only rollouts are wanted.
    ``on_dispatch(request, worker)`` is called as each request is routed.
    """

    def __init__(self, policy: PolicyConfig, dist: DistributedConfig, tokenizer: Any,
                 model: Any = None):
        if dist.num_rollout_workers < 1:
            raise PolicyError("RayPolicy needs distributed.num_rollout_workers >= 1")
        ray = connect(dist)
        self.tokenizer, self.model = tokenizer, model
        check_placeable(ray, {"CPU": float(dist.rollout_worker_cpus)}, "a rollout worker")
        actor = ray.remote(RolloutWorker).options(num_cpus=dist.rollout_worker_cpus)
        self.workers = [actor.remote(policy.model_dump()) for _ in range(dist.num_rollout_workers)]
        try:
            infos = ray.get([w.info.remote() for w in self.workers])
        except Exception as e:
            raise ray_error(e, PolicyError, "a rollout worker") from e
        self._version = int(infos[0]["version"])
        self.deterministic_by_default = bool(infos[0]["deterministic_by_default"])
        self._deterministic: bool | None = None
        self._has_deterministic = all(i["has_deterministic"] for i in infos)
        self.router = PrefixRouter(len(self.workers), slack=policy.max_batch_size)
        self.on_dispatch: Callable[[GenerateRequest, int], None] | None = None
        self.sync_seconds: list[float] = []

    # -- generation --------------------------------------------------------------------
    async def agenerate(self, request: GenerateRequest) -> GenerateResult:
        """Route the request (prefix affinity) and await its worker's result."""
        prompt = list(request.prompt_ids)
        w = self.router.pick(prompt)
        out: list[list[int]] = [prompt]
        ref = None
        try:  # whatever fails, the worker's load is given back (finally)
            if self.on_dispatch is not None:
                self.on_dispatch(request, w)
            ref = self.workers[w].generate.remote(prompt, request.params)
            res = await ref
        except asyncio.CancelledError:
            cancel_call(ref)
            raise
        except Exception as e:
            raise ray_error(e, PolicyError, f"rollout worker {w}") from e
        else:
            out.append(prompt + list(res.token_ids))
        finally:
            self.router.done(w, out)
        return res

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """A batch, spread over the workers as ``agenerate`` would; blocks until all are done."""
        async def run() -> list[GenerateResult]:
            return list(await asyncio.gather(*(self.agenerate(r) for r in requests)))

        return asyncio.run(run())

    # -- settings broadcast to every worker --------------------------------------------
    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        try:
            return ray.get([getattr(w, method).remote(*args) for w in self.workers])
        except Exception as e:
            raise ray_error(e, PolicyError, "a rollout worker") from e

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, value: int) -> None:
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
            self._all("set_deterministic", bool(on))
            self._deterministic = bool(on)

    # -- weights -------------------------------------------------------------------------
    def update_weights(self, state_dict: dict[str, Any]) -> None:
        """New weights for every worker (and the in-process ``model``, if any)."""
        if self.model is not None:
            self.model.load_state_dict(state_dict, strict=False)
        self._push(state_dict)

    def weights_updated(self) -> None:
        """``model`` (trained in this process) changed: push its weights to every worker."""
        if self.model is None:
            raise PolicyError("weights_updated() needs the in-process model; use update_weights(state_dict)")
        self._push(self.model.state_dict())

    def _push(self, state_dict: dict[str, Any]) -> None:
        """Put the weights in the object store once; every worker loads them from there."""
        import ray

        t0 = time.perf_counter()
        ref = ray.put(_wire_weights(state_dict))
        versions = set(self._all("update_weights", ref))
        del ref
        if len(versions) != 1:
            raise PolicyError(f"rollout workers disagree on the weights version after an update: {versions}")
        self._version = versions.pop()
        self.sync_seconds.append(time.perf_counter() - t0)

    def close(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)


def policy_for_run(cfg: Config, trainable: bool = False) -> Policy:
    """The policy a run's config asks for: ``RayPolicy`` over rollout workers when
    ``distributed.num_rollout_workers`` > 0 (with an in-process ``model`` to train when
    ``trainable``), else ``make_policy(cfg.policy)`` in this process."""
    from ..models import load_model, load_tokenizer
    from ..policy.registry import make_policy

    dist = cfg.distributed
    if dist is None or dist.num_rollout_workers == 0:
        return make_policy(cfg.policy)
    p = cfg.policy
    if trainable:
        model, tokenizer = load_model(p.model, dtype=p.dtype, device=p.device)
    else:
        model, tokenizer = None, load_tokenizer(p.model)
    return RayPolicy(p, dist, tokenizer, model)
