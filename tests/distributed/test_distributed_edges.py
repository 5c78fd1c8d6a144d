"""Edges of the Ray layer that need no cluster: call timeouts, slow workers against dead ones,
workers that never come back up, LoRA layers with no active adapter, and the pool lock."""

from __future__ import annotations

import threading
import warnings

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed here: pip install 'agentrl[ray]' (make extras)")

from agentrl.config import load_config  # noqa: E402
from agentrl.distributed import rollout_workers  # noqa: E402
from agentrl.distributed.rollout_workers import RayPolicy  # noqa: E402
from agentrl.errors import PolicyError  # noqa: E402


class _Call:
    """What ``actor.method.remote(...)`` returns here: a ref ``ray.get`` (faked) resolves."""

    def __init__(self, worker: _Worker, method: str, args: tuple):
        self.worker, self.method, self.args = worker, method, args


class _Method:
    def __init__(self, worker: _Worker, name: str):
        self.worker, self.name = worker, name

    def remote(self, *args):
        return _Call(self.worker, self.name, args)


class _Worker:
    """A rollout-worker handle whose calls answer from ``answers`` (method -> value, exception,
    or a list of them taken in turn)."""

    def __init__(self, **answers):
        self.answers = answers
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_") or name in ("answers", "calls"):
            raise AttributeError(name)
        return _Method(self, name)

    def answer(self, call: _Call):
        self.calls.append((call.method, call.args))
        a = self.answers[call.method]
        if isinstance(a, list):
            a = a.pop(0) if len(a) > 1 else a[0]
        if callable(a) and not isinstance(a, type):
            a = a()
        if isinstance(a, BaseException):
            raise a
        return a


@pytest.fixture
def fake_get(monkeypatch):
    """``ray.get`` over ``_Call``s; records each timeout it was given."""
    timeouts: list[float | None] = []

    def get(ref, timeout=None):
        timeouts.append(timeout)
        return ref.worker.answer(ref)

    monkeypatch.setattr(ray, "get", get)
    return timeouts


def _policy(workers: list[_Worker], call_timeout_s: float = 600.0) -> RayPolicy:
    """A RayPolicy's state over fake worker handles (``__init__`` would start actors)."""
    p = object.__new__(RayPolicy)
    n = len(workers)
    p.workers, p._closed, p._dead, p._stale, p._resyncing = list(workers), False, set(), set(), set()
    p._state_lock, p._push_lock = threading.Lock(), threading.Lock()
    p._incarnation = [f"inc{i}" for i in range(n)]
    p._weights_ref, p._version, p._deterministic = None, 0, None
    p._lost_reason, p._max_restarts, p.model = "", 3, None
    p.call_timeout_s = call_timeout_s
    p.max_failed_starts = 3
    p._failed_waits, p._last_failed_wait = [0] * n, [0.0] * n
    p.stats = {"rollout_workers/deaths": 0, "rollout_workers/retried_requests": 0, "rollout_workers/lost": 0,
               "rollout_workers/slow_calls": 0}
    return p


# -- 1. the call timeout is a parameter ---------------------------------------------------
def test_the_call_timeout_is_a_parameter_every_call_waits_by(fake_get):
    """It was a module constant (600 s): a cluster whose workers load a large model slowly, or
    a test that wants a dead worker found in seconds, could not set it."""
    p = _policy([_Worker(set_version=None), _Worker(set_version=None)], call_timeout_s=7.5)
    p._all("set_version", 3)
    assert fake_get == [7.5, 7.5]


def test_a_restart_is_awaited_for_the_timeout_given():
    """A worker that stays "temporarily unavailable" is given up on after ``timeout_s``, not 600 s."""
    import time

    from ray.exceptions import ActorUnavailableError

    w = _Worker(info=ActorUnavailableError("restarting", None))
    t0 = time.monotonic()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ray, "get", lambda ref, timeout=None: ref.worker.answer(ref))
        with pytest.raises(ActorUnavailableError):
            rollout_workers._await_restart(w, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 5.0


def test_a_call_timeout_that_is_not_positive_is_refused_naming_it():
    cfg = load_config(overrides=["distributed.num_rollout_workers=1"])
    with pytest.raises(PolicyError, match=r"call_timeout_s=0\b.*> 0"):
        RayPolicy(cfg.policy, cfg.distributed, tokenizer=None, call_timeout_s=0)


# -- 3. a slow worker is not a dead one ------------------------------------------------------
def _timeout():
    from ray.exceptions import GetTimeoutError

    return GetTimeoutError("Get timed out: some object(s) not ready.")


def test_a_worker_slow_to_take_a_push_is_resynced_not_counted_dead(fake_get):
    """A weights push that outlasts the call timeout (a long batch holds the weights lock) was
    counted as the worker's death: ``deaths`` lied, and the worker was treated as restarted."""
    p = _policy([_Worker(update_weights=4), _Worker(update_weights=_timeout())], call_timeout_s=1.0)
    resynced: list[int] = []
    p._resync_soon = resynced.append
    assert p._all("update_weights", "ref", 4) == [4]
    assert p.stats["rollout_workers/deaths"] == 0
    assert p.stats["rollout_workers/slow_calls"] == 1
    assert p._stale == {1} and resynced == [1]  # it loads the latest before it serves again
    assert p._incarnation == ["inc0", "inc1"] and not p._dead


def test_a_worker_slow_to_report_its_version_is_left_out_not_counted_dead(fake_get):
    p = _policy([_Worker(info={"incarnation": "inc0", "version": 2}), _Worker(info=_timeout())])
    p._resync_soon = lambda w: None
    assert p.worker_versions() == {0: 2}
    assert p.stats["rollout_workers/deaths"] == 0 and p.stats["rollout_workers/slow_calls"] == 1
    assert p._stale == {1}


# -- 2. a worker that never comes back up is lost, whatever max_restarts --------------------
def _unavailable():
    from ray.exceptions import ActorUnavailableError

    return ActorUnavailableError("The actor is temporarily unavailable: IOError: The actor is restarting.", None)


@pytest.fixture
def kills(monkeypatch):
    killed: list[object] = []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append(actor))
    return killed


def test_a_worker_that_crashes_on_every_start_is_lost_after_max_failed_starts(fake_get, kills, monkeypatch):
    """``max_restarts=-1``: Ray restarts a worker that crashes while it loads its model for ever,
    and never says "died"; its requests waited on it and the run never stopped. Ray counts its
    restarts (GCS): each one while a wait for it found it restarting is a start that failed."""
    restarts = iter(range(1, 100))  # Ray's count, growing while the worker never answers
    monkeypatch.setattr(rollout_workers, "restart_count", lambda worker: next(restarts))
    w = _Worker(info=_unavailable())
    p = _policy([w], call_timeout_s=2.0)
    p._stale, p._max_restarts = {0}, -1
    with pytest.raises(rollout_workers._Unusable, match="failed to start 3 times in a row"):
        p._resync(0)
    assert p._dead == {0} and not p._stale and p.stats["rollout_workers/lost"] == 1
    assert kills == [w]  # Ray would go on restarting it, holding its CPUs and GPUs
    assert "failed to start 3 times in a row" in p.workers_gone()


def test_without_a_restart_count_restart_waits_that_time_out_count_as_failed_starts(fake_get, kills, monkeypatch):
    """Where Ray cannot say how often it restarted the worker (Ray Client), each wait for it
    that ran out is a failed start; an answer in between starts the count again."""
    monkeypatch.setattr(rollout_workers, "restart_count", lambda worker: None)
    up = [False]
    w = _Worker(info=lambda: {"incarnation": "new", "version": 0} if up[0] else (_ for _ in ()).throw(_unavailable()),
                set_version=None)
    p = _policy([w], call_timeout_s=0.05)
    for _ in range(2):
        p._stale = {0}
        with pytest.raises(rollout_workers._Unusable, match="tried again later"):
            p._resync(0)
    up[0] = True
    p._resync(0)  # it came back: the count starts again
    assert not p._stale and p._incarnation[0] == "new"
    up[0] = False
    for i in range(3):
        p._stale = {0}
        with pytest.raises(rollout_workers._Unusable, match="tried again later" if i < 2 else "in a row"):
            p._resync(0)
    assert p._dead == {0} and p.stats["rollout_workers/lost"] == 1 and kills == [w]
    assert "did not come back within 0.05 s 3 times in a row" in p.workers_gone()


def test_max_failed_starts_below_one_is_refused_naming_it():
    cfg = load_config(overrides=["distributed.num_rollout_workers=1"])
    with pytest.raises(PolicyError, match=r"max_failed_starts=0\b.*>= 1"):
        RayPolicy(cfg.policy, cfg.distributed, tokenizer=None, max_failed_starts=0)


def test_restarts_before_the_wait_are_no_failed_starts(fake_get, kills, monkeypatch):
    """A worker Ray restarted 10 times before (each death noticed or not) that comes back after
    one more restart is ready, not lost: only restarts during a wait count."""
    counts = iter([10, 10, 11])
    monkeypatch.setattr(rollout_workers, "restart_count", lambda worker: next(counts))
    w = _Worker(info=[_unavailable(), _unavailable(), _unavailable(), {"incarnation": "new", "version": 0}],
                set_version=None)
    p = _policy([w], call_timeout_s=5.0)
    p._stale = {0}
    p._resync(0)
    assert not p._dead and not p._stale and not kills and p._incarnation[0] == "new"


# -- 4. LoRA layers with no active adapter ---------------------------------------------------
def _adapted_net(adapters: dict[str, list[str]]):
    """Two linear layers (``a``, ``b``) with LoRA adapters injected in place, each adapter on the
    layers given, its B moved off zero so that it changes the output; and a plain copy."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    plain = Net()
    net = Net()
    net.load_state_dict(plain.state_dict())
    for name, targets in adapters.items():
        with warnings.catch_warnings():  # a second adapter is what the test wants
            warnings.filterwarnings("ignore", "Already found a `peft_config`", UserWarning)
            inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=targets), net, adapter_name=name)
    with torch.no_grad():
        for n, p in net.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn_like(p))
    return net, plain


def _computes_like(plain, weights, net) -> bool:
    import torch

    plain.load_state_dict(weights)
    x = torch.randn(5, 4)
    with torch.no_grad():
        return torch.allclose(plain(x), net(x), atol=1e-6)


def test_a_lora_layer_with_no_active_adapter_gives_its_base_weight():
    """``sum`` over no active adapter is the int 0, and ``0.to(dtype)`` raised AttributeError:
    no weights could be pushed once any adapted layer had none active."""
    pytest.importorskip("peft", reason="trainable=lora needs peft (pip install peft)")
    from agentrl.distributed.weights import merged_weights

    net, plain = _adapted_net({"default": ["a", "b"]})
    net.b.set_adapter([])  # b computes with its base weight alone
    weights = merged_weights(net)
    assert sorted(weights) == ["a.bias", "a.weight", "b.bias", "b.weight"]
    assert weights["b.weight"].equal(net.b.base_layer.weight)
    assert not weights["a.weight"].equal(net.a.base_layer.weight)
    assert _computes_like(plain, weights, net)


def test_only_the_adapters_a_layer_holds_and_runs_are_merged():
    """Adapter ``x`` on ``a`` only, ``y`` on ``b`` only, both active: peft's forward skips an
    active adapter a layer does not hold, where ``get_delta_weight`` raised KeyError. Adapters
    disabled (``disable_adapters``): the base weights, as the forward computes."""
    pytest.importorskip("peft", reason="trainable=lora needs peft (pip install peft)")
    from agentrl.distributed.weights import merged_weights

    net, plain = _adapted_net({"x": ["a"], "y": ["b"]})
    for m in (net.a, net.b):
        m.set_adapter(["x", "y"])
    assert _computes_like(plain, merged_weights(net), net)
    for m in (net.a, net.b):
        m.enable_adapters(False)
    weights = merged_weights(net)
    assert weights["a.weight"].equal(net.a.base_layer.weight) and weights["b.weight"].equal(net.b.base_layer.weight)
    assert _computes_like(plain, weights, net)


# -- 5. making a pool holds no lock others need -----------------------------------------------
class _Context:
    def get_node_id(self) -> str:
        return "node"

    def get_job_id(self) -> str:
        return "job"


class _FakeRay:
    def get_runtime_context(self) -> _Context:
        return _Context()


def test_a_pool_waiting_for_room_holds_up_no_other_caller(monkeypatch):
    """A new pool waits up to 30 s for free CPUs (``wait_for_room``), and shutting idle pools
    down up to 20 s; both ran under the lock of every pool, so an engine giving its pool back,
    the producer asking ``lost_env_workers`` and another env's pool all waited. A second caller
    for the pool being made waits for it and shares it (never two pools for one key), and one
    for another level of the same env waits until it is made, to count the room it took."""
    import time

    from agentrl.distributed import env_workers

    waiting, room = threading.Event(), threading.Event()
    made: list[str] = []

    class SlowPool:
        def __init__(self, env_id, kwargs, dist, imports=()):
            self.env_id, self.users, self.last_used, self.retired, self.key = env_id, 0, 0, False, ()
            if kwargs.get("max_turns") == 3:  # this level's workers wait for room
                waiting.set()
                room.wait(10)
            made.append(f"{env_id.split('/')[-1]}:{kwargs.get('max_turns')}")

        def gone(self) -> None:
            return None

    monkeypatch.setattr(env_workers, "EnvWorkerPool", SlowPool)
    monkeypatch.setattr(env_workers, "connect", lambda dist: _FakeRay())
    monkeypatch.setattr(env_workers, "_room_for", lambda *a, **k: True)
    monkeypatch.setattr(env_workers, "_POOLS", {})

    def cfg(turns: int, env: str = "agentrl/GuessNumber-v0"):
        return load_config(overrides=[f"env.id={env}", f"env.kwargs={{max_turns: {turns}}}",
                                      "rollout.env_executor=ray", "distributed.ray=auto"])

    got: dict[str, object] = {}

    def take(name: str, c) -> threading.Thread:
        t = threading.Thread(target=lambda: got.__setitem__(name, env_workers.env_worker_pool(c)))
        t.start()
        return t

    first = take("first", cfg(3))
    try:
        assert waiting.wait(10)
        t0 = time.monotonic()
        other = env_workers.env_worker_pool(cfg(5, "agentrl/ALFWorld-v0"))  # another env's pool: made at once
        env_workers.release_env_worker_pool(other)
        assert env_workers.lost_env_workers() is None
        assert time.monotonic() - t0 < 2.0
        same, level = take("same", cfg(3)), take("level", cfg(4))
        time.sleep(0.2)
        assert set(got) == set() and made == ["ALFWorld-v0:5"]  # both wait for the pool being made
    finally:
        room.set()
        first.join(10)
    same.join(10)
    level.join(10)
    assert got["first"] is got["same"] and got["first"].users == 2  # shared
    assert made == ["ALFWorld-v0:5", "GuessNumber-v0:3", "GuessNumber-v0:4"]


# -- 2b. the same for env workers ---------------------------------------------------------------
class _EnvActor:
    """An env-worker handle: ``call.remote`` gives a ``_Call`` that ``ray.get`` (faked) answers."""

    def __init__(self, name: str, answer):
        self.name, self._answer = name, answer
        self.call = _Method(self, "call")

    def answer(self, call: _Call):
        a = self._answer
        if isinstance(a, BaseException):
            raise a
        return a


def test_an_env_worker_that_crashes_on_every_start_is_lost_and_the_episode_moves(fake_get, kills, monkeypatch):
    """``max_restarts=-1``: an env worker that crashes while it starts is restarted for ever;
    each episode dealt to it waited ``RESTART_WAIT_S`` (120 s) and failed, and the run never
    stopped. Now its restarts during an episode's first call count: at ``MAX_FAILED_STARTS`` it
    is lost (killed), and the call goes to a live worker."""
    from agentrl.distributed import env_workers
    from agentrl.distributed.env_workers import EnvWorkerPool

    restarts = iter(range(1, 100))
    monkeypatch.setattr(env_workers, "restart_count", lambda actor: next(restarts) if actor.name == "w0" else 0,
                        raising=False)
    monkeypatch.setattr(env_workers, "RESTART_WAIT_S", 5.0)  # the old wait, shortened
    w0, w1 = _EnvActor("w0", _unavailable()), _EnvActor("w1", ("obs", {}))
    pool = object.__new__(EnvWorkerPool)
    pool.env_id, pool.workers, pool.options = "agentrl/GuessNumber-v0", [w0, w1], {"max_restarts": -1,
                                                                                  "max_concurrency": 4}
    pool._next, pool._lost, pool._lost_reason, pool._lock = 0, set(), "", threading.Lock()
    pool._abandoned = [[], []]
    env = pool.make_env()
    assert env._index == 0
    assert env.reset(seed=1) == ("obs", {})  # on w1, at once: not after a 120 s wait
    assert env._index == 1 and pool._lost == {0} and kills == [w0]
    assert "env worker 0 failed to start 3 times in a row" in pool._lost_reason


def test_the_distributed_section_sets_the_rollout_workers_call_timeout_and_failed_starts(monkeypatch):
    """distributed.call_timeout_s and distributed.max_failed_starts reach RayPolicy (they were
    keyword arguments no config could set); a bad value fails naming its key."""
    import agentrl.distributed.rollout_workers as rw
    from agentrl.config import load_config
    from agentrl.errors import ConfigError
    from agentrl.policy.for_run import policy_for_run

    seen = {}

    class Captured:
        def __init__(self, policy, dist, tokenizer, model=None, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(rw, "RayPolicy", Captured)
    monkeypatch.setattr("agentrl.models.load_tokenizer", lambda name: None)
    cfg = load_config(overrides=["distributed.num_rollout_workers=1", "distributed.call_timeout_s=42.5",
                                 "distributed.max_failed_starts=5"])
    policy_for_run(cfg)
    assert seen == {"call_timeout_s": 42.5, "max_failed_starts": 5}
    for bad in ("distributed.call_timeout_s=0", "distributed.max_failed_starts=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].split(".")[1]):
            load_config(overrides=["distributed.num_rollout_workers=1", bad])


def test_update_weights_refuses_names_the_in_process_model_lacks_before_pushing_any(tiny_model):
    """Plain names given to RayPolicy whose in-process model is LoRA-wrapped were skipped there by
    load_state_dict(strict=False), while the workers took them: the trained model and the samplers
    drifted apart without a word. Now it is a PolicyError, and nothing is pushed."""
    import copy
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(tiny_model), LoraConfig(r=2, target_modules=["q_proj"]))
    pushed = []
    fake = SimpleNamespace(model=model, _push=pushed.append)
    with pytest.raises(PolicyError, match="unexpected weight names"):
        RayPolicy.update_weights(fake, {k: v.clone() for k, v in tiny_model.state_dict().items()})
    assert pushed == []
    RayPolicy.update_weights(fake, {k: v.clone() for k, v in model.state_dict().items()})
    assert len(pushed) == 1
