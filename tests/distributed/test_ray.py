"""agentrl.distributed on a local Ray instance (2 CPUs, no dashboard), started once for the module.

Each check compares with the one-process path: the same config gives the same
trees with ``env_executor: ray`` as with ``thread``; rollout workers sample what
a local ``HFPolicy`` samples. Then the failure and placement rules.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch

from agentrl.config import load_config
from agentrl.models import load_model
from agentrl.policy import GenerateRequest, HFPolicy, MockPolicy, SamplingParams, request_seed
from agentrl.rollout import collect

ray = pytest.importorskip("ray", reason="ray is not installed here: pip install 'agentrl[ray]' (make extras)")

from agentrl.distributed import (  # noqa: E402  (after the skip: the module needs ray to run)
    RayPolicy,
    env_resources,
    env_worker_options,
    env_worker_pool,
)
from agentrl.policy.for_run import policy_for_run  # noqa: E402

# Small actors: the module's 2 CPUs hold every worker these tests start.
SMALL = ["distributed.ray=auto", "distributed.env_worker_cpus=0.25", "distributed.rollout_worker_cpus=0.25"]


def _shape(trees: list[Any]) -> list[Any]:
    """What must match between executors: token ids, rewards, ends and errors, node by node."""
    return [[(n.id, n.context_ids, n.action_ids, n.reward, n.terminated, n.truncated, n.error,
              n.observation) for n in t.nodes.values()] for t in trees]


def test_ray_env_executor_grows_the_same_trees_as_threads(cluster, tokenizer, tiny_model):
    """ALFWorld-v0 branched with segment_tree: reset, step, snapshot and restore all go
    through the env workers; the trees are the thread executor's, token for token."""
    base = ["policy.model=tiny-random", "env.id=agentrl/ALFWorld-v0", "rollout.allocator={name: segment_tree, depth: 2, width: 2}", "rollout.group_size=4",
            "rollout.max_turns=3", "rollout.max_context_tokens=1024", "rollout.deterministic=true",
            "sampling.max_new_tokens=6", "sampling.temperature=1.0", *SMALL]
    trees = {}
    for executor in ("thread", "ray"):
        cfg = load_config(overrides=[*base, f"rollout.env_executor={executor}"])
        policy = HFPolicy(tiny_model, tokenizer, max_batch_size=4)
        trees[executor] = collect(cfg.env.id, policy, cfg, seeds=[0, 1])
    workers = env_worker_pool(load_config(overrides=[*base, "rollout.env_executor=ray"])).workers
    assert sum(ray.get([w.made_envs.remote() for w in workers])) >= 2  # the envs lived in the workers
    assert sum(len(t.nodes) for t in trees["ray"]) > 2 * 4  # branched trees, not single nodes
    assert not [n.error for t in trees["ray"] for n in t.nodes.values() if n.error]
    assert _shape(trees["ray"]) == _shape(trees["thread"])


def _requests(tokenizer: Any, n: int) -> list[GenerateRequest]:
    prompts = [tokenizer.encode(f"Guess the number {i}, then say why:") for i in range(n)]
    return [GenerateRequest(list(p), SamplingParams(max_new_tokens=8, temperature=1.0, seed=100 + i))
            for i, p in enumerate(prompts)]


def test_rollout_workers_sample_what_a_local_policy_samples(cluster, tokenizer):
    cfg = load_config(overrides=["policy.backend=hf", "policy.model=tiny-random",
                                 "distributed.num_rollout_workers=2", *SMALL])
    remote = RayPolicy(cfg.policy, cfg.distributed, tokenizer)
    model, _ = load_model("tiny-random")
    local = HFPolicy(model, tokenizer, deterministic=True)
    remote.deterministic = True
    try:
        reqs = _requests(tokenizer, 4)
        got, want = remote.generate(reqs), local.generate(reqs)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert [x for r in got for x in r.logprobs] == pytest.approx(
            [x for r in want for x in r.logprobs], abs=1e-4)
        assert remote.router.load == [0, 0]

        # weights through the object store: both workers load the same new weights
        torch.manual_seed(0)
        new = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
        local.update_weights(new)
        remote.update_weights(new)
        assert remote.version == local.version == 1
        got, want = remote.generate(reqs), local.generate(reqs)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert {r.version for r in got} == {1}
    finally:
        remote.close()


def test_rollout_workers_constrain_replies_as_a_local_policy_does(cluster, tokenizer):
    """``rollout.constrain: admissible`` over rollout workers: each request's action list goes
    with it, and the replies and their logprobs are a local policy's."""
    cfg = load_config(overrides=["policy.backend=hf", "policy.model=tiny-random", "rollout.constrain=admissible",
                                 "distributed.num_rollout_workers=1", *SMALL])
    remote = RayPolicy(cfg.policy, cfg.distributed, tokenizer)
    local = HFPolicy(load_model("tiny-random")[0], tokenizer, deterministic=True)
    remote.deterministic = True
    actions = ("go to shelf 1", "take mug 1 from countertop 2", "look")
    try:
        assert remote.constrains_actions
        reqs = [GenerateRequest(r.prompt_ids, dataclasses.replace(r.params, max_new_tokens=16), admissible=actions)
                for r in _requests(tokenizer, 3)]
        got, want = remote.generate(reqs), local.generate(reqs)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert all(r.finish_reason == "stop" and tokenizer.decode(r.token_ids[:-1]) in actions for r in got)
        assert [x for r in got for x in r.logprobs] == pytest.approx(
            [x for r in want for x in r.logprobs], abs=1e-4)
    finally:
        remote.close()


def test_rollout_workers_keep_an_episode_on_one_worker(cluster, tokenizer):
    cfg = load_config(overrides=["policy.backend=hf", "policy.model=tiny-random",
                                 "env.id=agentrl/ALFWorld-v0", "rollout.episodes=4",
                                 "rollout.max_turns=3", "sampling.max_new_tokens=6",
                                 "distributed.num_rollout_workers=2", *SMALL])
    policy = RayPolicy(cfg.policy, cfg.distributed, tokenizer)
    served: dict[int, int] = {}  # request seed -> worker (the openings of all tasks are alike)
    policy.on_dispatch = lambda req, w: served.__setitem__(req.params.seed, w)
    try:
        trees = collect(cfg.env.id, policy, cfg, seeds=[0, 1, 2, 3])
    finally:
        policy.close()
    episodes = []
    for task, tree in enumerate(trees):  # one episode a task: seed stream 0, turns 0, 1, ...
        turns = len(tree.path(tree.leaves()[0].id))
        assert turns >= 2
        episodes.append([served[request_seed(cfg.rollout.seed, tree.meta["seed"], task, 0, t)]
                         for t in range(turns)])
    assert all(len(set(w)) == 1 for w in episodes), episodes  # each episode on one worker
    assert {w[0] for w in episodes} == {0, 1}  # and the episodes spread over both


class _KillingPolicy(MockPolicy):
    """Mock answers that GuessNumber rejects (each episode plays every turn); on the
    ``kill_at``-th request the env worker is killed, and the call waits for its restart."""

    def __init__(self, tokenizer: Any, worker: Any, kill_at: int):
        super().__init__(tokenizer, ["no number"])
        self.worker, self.kill_at, self.requests = worker, kill_at, 0

    async def agenerate(self, request: GenerateRequest) -> Any:
        self.requests += 1
        if self.requests == self.kill_at:
            before = ray.get(self.worker.pid.remote())
            ray.kill(self.worker, no_restart=False)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # the next env call must reach the new incarnation
                try:
                    if ray.get(self.worker.pid.remote(), timeout=30) != before:
                        break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    time.sleep(0.1)
            else:
                raise AssertionError("the env worker did not restart within 120 s")
        return await super().agenerate(request)


def test_a_killed_env_worker_fails_only_its_episode(cluster, tokenizer):
    cfg = load_config(overrides=["env.id=agentrl/GuessNumber-v0", "rollout.env_executor=ray",
                                 "rollout.concurrency=1", "rollout.max_turns=3",
                                 "distributed.num_env_workers=1", "distributed.max_restarts=2", *SMALL])
    worker = env_worker_pool(cfg).workers[0]
    policy = _KillingPolicy(tokenizer, worker, kill_at=5)  # episode 2 (of 4), turn 2
    trees = collect(cfg.env.id, policy, cfg, seeds=[0, 1, 2, 3])
    errors = [[n.error for n in t.nodes.values() if n.error] for t in trees]
    assert [len(e) for e in errors] == [0, 1, 0, 0], errors
    assert "env worker restarted" in errors[1][0] and errors[1][0].startswith("env.step raised EnvError")
    assert [len(t.nodes) for t in trees] == [3, 2, 3, 3]  # later episodes play all their turns
    deadline = time.monotonic() + 30  # closing the engine dropped the restarted worker's env
    while ray.get(worker.hosted.remote()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ray.get(worker.hosted.remote()) == 0


def _restart(worker: Any) -> None:
    """Kill an env worker and return once its restarted incarnation answers."""
    before = ray.get(worker.pid.remote())
    ray.kill(worker, no_restart=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if ray.get(worker.pid.remote(), timeout=30) != before:
                return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            time.sleep(0.1)
    raise AssertionError("the env worker did not restart within 120 s")


def test_an_idle_env_whose_worker_restarted_plays_its_next_episode(cluster, tokenizer):
    """The worker dies between two episodes: the env the engine keeps for the next one lost
    nothing that episode needs, as its first call is a reset. It is made again on the restarted
    worker; before, that reset failed the episode ("the env's state was lost")."""
    cfg = load_config(overrides=["env.id=agentrl/GuessNumber-v0", "rollout.env_executor=ray",
                                 "rollout.concurrency=1", "rollout.max_turns=2", "distributed.num_env_workers=1",
                                 "distributed.max_restarts=2", *SMALL])
    worker = env_worker_pool(cfg).workers[0]
    done: list[Any] = []

    def kill_after_the_first(tree: Any) -> None:
        done.append(tree)
        if len(done) == 1:
            _restart(worker)

    trees = collect(cfg.env.id, MockPolicy(tokenizer, ["no number"]), cfg, seeds=[0, 1, 2],
                    on_episode_done=kill_after_the_first)
    errors = [[n.error for n in t.nodes.values() if n.error] for t in trees]
    assert errors == [[], [], []]
    assert [len(t.nodes) for t in trees] == [2, 2, 2]


def _kill_for_good(worker: Any) -> None:
    """Kill an env worker without restart, and return once a call to it says so (a kill lands a
    moment later: a call sent before that would still be served)."""
    ray.kill(worker)
    _until_dead(worker)


def test_an_env_worker_ray_will_not_restart_gets_no_more_episodes(cluster, tokenizer):
    """An env worker whose restarts are used up is dealt no more envs: an episode whose first
    call finds it dead moves to a live worker, so only the pool's other workers host episodes.
    With every worker lost, each episode fails naming that."""
    from agentrl.distributed.env_workers import release_env_worker_pool, shutdown_env_worker_pools

    cfg = load_config(overrides=["env.id=agentrl/GuessNumber-v0", "rollout.env_executor=ray",
                                 "rollout.concurrency=4", "rollout.max_turns=2", "distributed.num_env_workers=2",
                                 "distributed.max_restarts=0", *SMALL])
    pool = env_worker_pool(cfg)
    release_env_worker_pool(pool)
    _kill_for_good(pool.workers[0])
    trees = collect(cfg.env.id, MockPolicy(tokenizer, ["no number"]), cfg, seeds=[0, 1, 2, 3])
    errors = [n.error for t in trees for n in t.nodes.values() if n.error]
    assert errors == []  # round-robin would have sent two of the four episodes to the dead worker
    assert [len(t.nodes) for t in trees] == [2, 2, 2, 2]
    _kill_for_good(pool.workers[1])
    try:
        trees = collect(cfg.env.id, MockPolicy(tokenizer, ["no number"]), cfg, seeds=[0, 1])
        errors = [n.error for t in trees for n in t.nodes.values() if n.error]
        assert len(errors) == 2 and all("every env worker of agentrl/GuessNumber-v0 is lost" in e
                                        for e in errors), errors
        # the next batch (a trainer's next step) does not start: the run stops, saying why
        from agentrl.distributed import env_workers
        from agentrl.distributed.env_workers import lost_env_workers
        from agentrl.errors import EnvError

        assert "max_restarts=0" in lost_env_workers() and "; last: env worker 1 died" in lost_env_workers()
        with pytest.raises(EnvError, match="every env worker of agentrl/GuessNumber-v0 is lost.*run stops"):
            collect(cfg.env.id, MockPolicy(tokenizer, ["no number"]), cfg, seeds=[0, 1])
        # said once: the dead pool is forgotten, so a later collect in this process (a notebook's
        # next cell) makes new workers instead of failing for good
        assert lost_env_workers() is None and pool not in env_workers._POOLS.values()
    finally:  # its dead pool would stop the later tests' runs
        shutdown_env_worker_pools(cfg.env.id)


def test_an_env_that_calls_exit_fails_its_episode_not_its_worker(cluster, tokenizer):
    """sys.exit in an env step (argparse on bad input) fails that episode, as under
    env_executor: thread. It ended the env worker's process: every episode it hosted failed,
    and each such exit used up one of distributed.max_restarts."""
    cfg = load_config(overrides=["env.id=agentrl-test/Exits-v0", "env.imports=[tests.distributed.worker_envs]",
                                 "rollout.env_executor=ray", "rollout.concurrency=4", "rollout.max_turns=2",
                                 "distributed.num_env_workers=1", "distributed.max_restarts=2", *SMALL])
    worker = env_worker_pool(cfg).workers[0]
    pid = ray.get(worker.pid.remote())
    calls: list[str] = []

    def first_says_exit(text: str) -> str:
        calls.append(text)
        return "exit" if len(calls) == 1 else "no number"

    trees = collect(cfg.env.id, MockPolicy(tokenizer, first_says_exit), cfg, seeds=[0, 1, 2, 3])
    errors = [n.error for t in trees for n in t.nodes.values() if n.error]
    assert len(errors) == 1 and "the env called sys.exit(3)" in errors[0], errors
    assert sorted(len(t.nodes) for t in trees) == [1, 2, 2, 2]  # the others play both turns
    assert ray.get(worker.pid.remote()) == pid  # the same process: no restart


def test_shutting_a_pool_down_closes_the_envs_its_workers_host(cluster, tmp_path):
    """The envs a pool's workers still host (a script's, an engine's whose closes were still on
    their way) are closed before the workers are killed: a kill skips env.close, so a docker
    sandbox's container stayed up until some later sandbox on the node swept it."""
    from agentrl.distributed.env_workers import shutdown_env_worker_pools

    mark = tmp_path / "closed.txt"
    cfg = load_config(overrides=["env.id=agentrl-test/MarksClose-v0", "env.imports=[tests.distributed.worker_envs]",
                                 f"env.kwargs={{mark: '{mark}'}}", "rollout.env_executor=ray",
                                 "distributed.num_env_workers=2", *SMALL])
    pool = env_worker_pool(cfg)
    envs = [pool.make_env() for _ in range(3)]
    for i, env in enumerate(envs):
        env.reset(seed=i)  # made on the workers, never closed
    assert shutdown_env_worker_pools(cfg.env.id) == 1
    assert mark.read_text().splitlines() == ["closed"] * 3
    for worker in pool.workers:  # and killed (a kill lands a moment after it is sent)
        _until_dead(worker)


def _until_dead(worker: Any) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(worker.pid.remote(), timeout=10)
        except ray.exceptions.ActorDiedError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.05)
    raise AssertionError("the env worker still answers 30 s after its pool was shut down")


def test_a_docker_env_asks_for_the_docker_resource(cluster):
    cfg = load_config(overrides=["distributed.ray=auto"])
    assert env_resources("agentrl/GuessNumber-v0", {}) == {}
    docker = env_worker_options("agentrl/GuessNumber-v0", {"sandbox": "docker"}, cfg.distributed)
    assert docker["resources"] == {"sandbox_docker": 1.0}
    assert docker["num_cpus"] == cfg.distributed.env_worker_cpus
    assert docker["max_restarts"] == cfg.distributed.max_restarts
    for backend in ("local", "auto", "remote"):
        assert env_resources("agentrl/GuessNumber-v0", {"sandbox": backend}) == {}
    # no node of the test cluster advertises sandbox_docker: refused at once, not left pending
    from agentrl.distributed.env_workers import EnvWorkerPool
    from agentrl.errors import ConfigError

    with pytest.raises(ConfigError, match="sandbox_docker"):
        EnvWorkerPool("agentrl/GuessNumber-v0", {"sandbox": "docker"}, cfg.distributed)


def test_more_workers_than_the_cluster_can_ever_hold_are_refused_at_once(cluster, tokenizer):
    """Each worker fits a node, but not all of them fit the cluster: Ray would keep the rest
    pending for good (rollout workers: a 600 s wait then a bare GetTimeoutError; env workers:
    their episodes wait out rollout.episode_timeout_s). Refused before any actor starts."""
    from agentrl.distributed.env_workers import EnvWorkerPool
    from agentrl.errors import ConfigError

    cfg = load_config(overrides=["policy.backend=hf", "policy.model=tiny-random", "distributed.ray=auto",
                                 "distributed.num_rollout_workers=3", "distributed.rollout_worker_cpus=1"])
    with pytest.raises(ConfigError, match=r"can host 2 of the 3 rollout workers needing \{'CPU': 1\.0\} each "
                                          r"\(distributed\.num_rollout_workers"):
        RayPolicy(cfg.policy, cfg.distributed, tokenizer, call_timeout_s=5.0)  # the old wait, shortened
    cfg = load_config(overrides=["distributed.ray=auto", "distributed.num_env_workers=9",
                                 "distributed.env_worker_cpus=0.25"])
    with pytest.raises(ConfigError, match=r"can host 8 of the 9 env workers .*distributed\.num_env_workers"):
        EnvWorkerPool("agentrl/GuessNumber-v0", {}, cfg.distributed)


class _Hog:
    def ping(self) -> bool:
        return True


def test_workers_the_busy_cluster_has_no_room_for_fail_naming_the_keys(cluster, tokenizer, monkeypatch):
    """Other actors hold the CPUs (the default 2 env workers of 1 CPU beside as many rollout
    workers as a machine has cores, say): new workers would be left pending for good, their
    episodes waiting out rollout.episode_timeout_s. After a short wait for room: a ConfigError."""
    from agentrl.distributed import cluster as cluster_mod
    from agentrl.distributed.env_workers import EnvWorkerPool
    from agentrl.errors import ConfigError

    monkeypatch.setattr(cluster_mod, "ROOM_WAIT_S", 1.0)
    hogs = []
    try:
        while (free := ray.available_resources().get("CPU", 0.0)) >= 0.25:  # fill the cluster's CPUs
            hogs.append(ray.remote(num_cpus=free)(_Hog).remote())
            ray.get(hogs[-1].ping.remote())
        cfg = load_config(overrides=["distributed.ray=auto", "distributed.num_env_workers=1",
                                     "distributed.env_worker_cpus=0.25"])
        with pytest.raises(ConfigError, match=r"1 env workers need \{'CPU': 0\.25\} \(distributed\.num_env_workers"):
            EnvWorkerPool("agentrl/GuessNumber-v0", {}, cfg.distributed)
        cfg = load_config(overrides=["policy.backend=hf", "policy.model=tiny-random", "distributed.ray=auto",
                                     "distributed.num_rollout_workers=1", "distributed.rollout_worker_cpus=0.25"])
        with pytest.raises(ConfigError, match=r"1 rollout workers need .*other actors hold the rest"):
            RayPolicy(cfg.policy, cfg.distributed, tokenizer)
    finally:
        for hog in hogs:
            ray.kill(hog)


def _live_rollout_workers() -> int:
    """Rollout-worker actors of the cluster that are alive, starting or restarting (GCS's table)."""
    from ray._private.state import actors

    return sum(1 for a in actors().values() if a.get("ActorClassName", "").endswith("RolloutWorker")
               and a.get("State") not in ("DEAD",))


def test_rollout_workers_interrupted_while_they_start_are_killed(cluster, tokenizer, monkeypatch):
    """A Ctrl-C (or any error) while the workers load their model kills them: a notebook that
    carries on would keep their CPUs and GPUs reserved, and its next RayPolicy would wait for them.
    A start that times out is a PolicyError saying so, not Ray's bare GetTimeoutError."""
    from agentrl.errors import PolicyError

    cfg = load_config(overrides=["policy.backend=hf", "policy.model=tiny-random",
                                 "distributed.num_rollout_workers=2", *SMALL])
    deadline = time.monotonic() + 30  # earlier tests' closed workers are dead by now
    while _live_rollout_workers() and time.monotonic() < deadline:
        time.sleep(0.1)
    before = _live_rollout_workers()
    real_get = ray.get

    def interrupted(refs: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(refs, list):  # the workers' first answers
            raise KeyboardInterrupt
        return real_get(refs, *args, **kwargs)

    monkeypatch.setattr(ray, "get", interrupted)
    with pytest.raises(KeyboardInterrupt) as interrupt:  # kept, as IPython keeps sys.last_traceback:
        RayPolicy(cfg.policy, cfg.distributed, tokenizer)  # its frames hold the worker handles
    monkeypatch.setattr(ray, "get", real_get)
    deadline = time.monotonic() + 30
    while _live_rollout_workers() > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live_rollout_workers() == before
    del interrupt

    with pytest.raises(PolicyError, match=r"rollout workers did not start within 0\.01 s") as timeout:
        RayPolicy(cfg.policy, cfg.distributed, tokenizer, call_timeout_s=0.01)  # no model loads that fast
    deadline = time.monotonic() + 30
    while _live_rollout_workers() > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live_rollout_workers() == before
    del timeout


def test_trainer_runs_on_env_and_rollout_workers(cluster, tmp_path):
    """Two GRPO steps with both kinds of workers, set by config only. The weights reach the
    rollout workers: step 2's tokens, sampled there after the sync, score the same under the
    trainer's weights."""
    import json

    from agentrl.train.config import load_train_config
    from agentrl.train.trainer import train

    cfg = load_train_config(None, [
        "policy.backend=hf", "policy.model=tiny-random", "env.id=agentrl/GuessNumber-v0",
        "rollout.max_turns=2", "rollout.group_size=4", "rollout.max_context_tokens=512",
        "rollout.env_executor=ray", "sampling.max_new_tokens=4", "train.credit=grpo",
        "train.loss.entropy_coef=0.01", "train.tasks_per_step=2", "train.minibatch_size=8",
        "train.micro_batch_tokens=2048", "train.steps=2", "train.optimizer.lr=1e-3", "train.evaluation.episodes=2",
        "train.output.tensorboard=false", "train.checkpointing.export_hf=false", "train.output.plot=false",
        f"train.output.dir={tmp_path}", "distributed.num_rollout_workers=2", *SMALL])
    train(cfg, progress=False)
    rl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if r.get("phase") == "rl"]
    assert [r["policy/version"] for r in rl] == [1, 2]
    assert all(r["mismatch/max_abs_dlogprob"] < 1e-3 for r in rl if "mismatch/kl" in r)
    assert any("mismatch/kl" in r for r in rl[1:])


def _on_version_1(tokenizer: Any, seed: int) -> tuple[RayPolicy, HFPolicy]:
    """Two rollout workers (restartable) and a local policy, both on the same new weights
    (version 1, which a restart loses: a worker comes back with the starting ones), deterministic."""
    cfg = load_config(overrides=["policy.backend=hf", "policy.model=tiny-random", "distributed.num_rollout_workers=2",
                                 "distributed.max_restarts=2", *SMALL])
    remote = RayPolicy(cfg.policy, cfg.distributed, tokenizer)
    model, _ = load_model("tiny-random")
    local = HFPolicy(model, tokenizer, deterministic=True)
    remote.deterministic = True
    torch.manual_seed(seed)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    local.update_weights(new)
    remote.update_weights(new)
    return remote, local


def test_a_rollout_worker_killed_mid_batch_is_retried_and_comes_back_with_the_weights(cluster, tokenizer):
    """Version 1's weights, then one worker killed as the third request is routed: the batch
    completes with what a live worker samples (deterministic mode: the retry draws the same
    tokens), one death is counted however many requests it failed, and the restarted worker
    loads version 1 before it serves again."""
    remote, local = _on_version_1(tokenizer, seed=0)
    try:
        pids = [ray.get(w.info.remote())["pid"] for w in remote.workers]
        routed: list[int] = []

        def kill_third(req: GenerateRequest, w: int) -> None:
            routed.append(w)
            if len(routed) == 3:
                ray.kill(remote.workers[w], no_restart=False)

        remote.on_dispatch = kill_third
        reqs = _requests(tokenizer, 8)
        got, want = remote.generate(reqs), local.generate(reqs)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert {r.version for r in got} == {1}
        assert remote.stats["rollout_workers/deaths"] == 1
        assert remote.stats["rollout_workers/retried_requests"] >= 1
        assert remote.stats["rollout_workers/lost"] == 0

        killed = routed[2]
        deadline = time.monotonic() + 120  # meanwhile a background thread brings it back
        while killed in remote._stale and time.monotonic() < deadline:
            time.sleep(0.05)
        remote.on_dispatch = lambda req, w: routed.append(w)
        routed.clear()
        more = _requests(tokenizer, 16)
        got, want = remote.generate(more), local.generate(more)
        assert killed in routed  # the restarted worker serves again...
        info = ray.get(remote.workers[killed].info.remote())
        assert info["pid"] != pids[killed] and info["version"] == 1  # ...a new process, on version 1's weights
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert {r.version for r in got} == {1}
        assert remote.stats["rollout_workers/deaths"] == 1
    finally:
        remote.close()


def test_a_rollout_worker_ray_will_not_restart_is_lost_and_the_others_serve(cluster, tokenizer):
    cfg = load_config(overrides=["policy.backend=hf", "policy.model=tiny-random", "distributed.num_rollout_workers=2",
                                 "distributed.max_restarts=0", *SMALL])
    remote = RayPolicy(cfg.policy, cfg.distributed, tokenizer)
    try:
        ray.kill(remote.workers[0])
        got = remote.generate(_requests(tokenizer, 6))  # round-robin: some go to the dead worker first
        assert len(got) == 6 and all(r.token_ids for r in got)
        assert remote.stats["rollout_workers/deaths"] == 1
        deadline = time.monotonic() + 60  # a background thread finds that Ray will not restart it
        while remote.stats["rollout_workers/lost"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert remote.stats["rollout_workers/lost"] == 1
        ray.kill(remote.workers[1])
        from agentrl.errors import PolicyError

        with pytest.raises(PolicyError, match="2 of 2 workers lost"):
            remote.generate(_requests(tokenizer, 2))
    finally:
        remote.close()


def test_a_rollout_worker_that_died_idle_never_serves_the_starting_weights(cluster, tokenizer):
    """Killed between batches, the worker is back (Ray restarted it) before anything failed on
    it: its first answer comes from a new process, is discarded and retried, and it loads the
    current weights before serving."""
    remote, local = _on_version_1(tokenizer, seed=1)
    try:
        pid = ray.get(remote.workers[0].info.remote())["pid"]
        ray.kill(remote.workers[0], no_restart=False)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until the new process answers: an idle death
            try:
                if ray.get(remote.workers[0].info.remote(), timeout=30)["pid"] != pid:
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                time.sleep(0.1)
        assert remote.stats["rollout_workers/deaths"] == 0  # nothing noticed yet
        reqs = _requests(tokenizer, 8)
        got, want = remote.generate(reqs), local.generate(reqs)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert {r.version for r in got} == {1}
        assert remote.stats["rollout_workers/deaths"] == 1
        deadline = time.monotonic() + 60  # the background resync gives it version 1
        while 0 in remote._stale and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ray.get(remote.workers[0].info.remote())["version"] == 1
    finally:
        remote.close()


def test_a_request_that_kills_each_worker_it_lands_on_fails_alone(cluster, tokenizer):
    """A poison request (every worker it is sent to dies: an out-of-memory prompt, say) is
    not sent to ``generate_retries`` workers: at ``max_request_deaths`` it fails, naming the
    key, and the fleet goes on serving."""
    from agentrl.errors import PolicyError

    cfg = load_config(overrides=["policy.backend=hf", "policy.model=tiny-random", "distributed.num_rollout_workers=2",
                                 "distributed.generate_retries=4", "distributed.max_request_deaths=2", *SMALL])
    remote = RayPolicy(cfg.policy, cfg.distributed, tokenizer)
    poison, *fine = _requests(tokenizer, 5)
    try:
        def kill_on_poison(req: GenerateRequest, w: int) -> None:
            if req.prompt_ids == poison.prompt_ids:
                ray.kill(remote.workers[w], no_restart=False)

        remote.on_dispatch = kill_on_poison
        with pytest.raises(PolicyError, match=r"running on 2 rollout workers that died \(distributed\.max_request_deaths=2\)"):
            remote.generate([poison])
        assert remote.stats["rollout_workers/deaths"] == 2  # not generate_retries + 1 = 5
        got = remote.generate(fine)  # both workers come back (Ray restarts them) and serve
        assert all(r.token_ids for r in got) and remote.stats["rollout_workers/lost"] == 0
    finally:
        remote.close()


def test_the_sampler_checks_each_workers_version_after_a_sync(cluster, tokenizer):
    """After a push, a worker that reports another version fails the producer's refresh."""
    from agentrl.errors import PolicyError

    remote, _ = _on_version_1(tokenizer, seed=2)
    try:
        sampler = remote.sampler()
        sampler.refresh(None, 1)  # both workers on version 1
        ray.get(remote.workers[1].set_version.remote(0))  # a push that did not reach worker 1
        with pytest.raises(PolicyError, match="worker 1: 0"):
            sampler.refresh(None, 1)
        assert remote.worker_versions() == {0: 1, 1: 0}
    finally:
        remote.close()


def test_a_proxy_session_survives_its_rollout_worker_dying(cluster, tokenizer):
    """A harness call whose rollout worker is killed under it is retried on the other worker:
    the call succeeds and the session records its one turn, token for token. With every
    worker gone the call fails with a clear 503, and the session records nothing of it."""
    import httpx

    from agentrl.proxy import ProxyConfig, RunningServer, create_app
    from agentrl.types import RolloutTree

    cfg = load_config(overrides=["policy.backend=hf", "policy.model=tiny-random", "distributed.num_rollout_workers=2",
                                 "distributed.max_restarts=0", *SMALL])
    remote = RayPolicy(cfg.policy, cfg.distributed, tokenizer)
    killed: list[int] = []

    def kill_first(req: GenerateRequest, w: int) -> None:
        if not killed:
            killed.append(w)
            ray.kill(remote.workers[w])

    remote.on_dispatch = kill_first
    server = RunningServer(create_app(remote, ProxyConfig(max_context_tokens=1024, default_max_tokens=8)))
    try:
        sess = httpx.post(f"{server.url}/sessions", json={}).raise_for_status().json()
        url = f"{sess['base_url']}/chat/completions"
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                "seed": 3, "return_token_ids": True}
        out = httpx.post(url, json=body, headers={"Authorization": f"Bearer {sess['api_key']}"}, timeout=120)
        assert out.status_code == 200, out.text
        assert killed and remote.stats["rollout_workers/deaths"] == 1
        tree = RolloutTree.from_dict(httpx.get(f"{server.url}/sessions/{sess['session_id']}/tree").json())
        [node] = tree.nodes.values()
        assert node.action_ids == out.json()["choices"][0]["token_ids"]

        ray.kill(remote.workers[1 - killed[0]])  # the last worker: nothing can serve now
        body["messages"] = [{"role": "user", "content": "again"}]
        out = httpx.post(url, json=body, headers={"Authorization": f"Bearer {sess['api_key']}"}, timeout=120)
        assert out.status_code == 503 and "no rollout worker could serve" in out.text
        tree = RolloutTree.from_dict(httpx.get(f"{server.url}/sessions/{sess['session_id']}/tree").json())
        assert len(tree.nodes) == 1  # the failed call left no half-recorded turn
    finally:
        server.stop()
        remote.close()


def _ray_train_config(tmp_path: Any, *extra: str) -> Any:
    from agentrl.train.config import load_train_config

    return load_train_config(None, [
        "policy.backend=hf", "policy.model=tiny-random", "env.id=agentrl/GuessNumber-v0",
        "rollout.max_turns=2", "rollout.group_size=4", "rollout.max_context_tokens=512",
        "sampling.max_new_tokens=4", "train.credit=grpo",
        "train.loss.entropy_coef=0.01", "train.tasks_per_step=2", "train.minibatch_size=8",
        "train.micro_batch_tokens=2048", "train.steps=2", "train.optimizer.lr=1e-3", "train.evaluation.episodes=2",
        "train.output.tensorboard=false", "train.checkpointing.export_hf=false", "train.output.plot=false",
        f"train.output.dir={tmp_path}", "distributed.num_rollout_workers=2", *SMALL, *extra])


def _rl_rows(out: Any) -> list[dict[str, Any]]:
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("phase") == "rl"]


def test_training_goes_on_when_a_rollout_worker_and_an_env_worker_are_killed_mid_batch(cluster, tmp_path):
    """Step 1's rollout loses a rollout worker (its requests are retried) and then one of two
    env workers (its running episodes fail, with the reason in their trees; the other worker's
    episodes give step 1 its samples); both steps train."""
    import json

    from agentrl.train.trainer import train

    cfg = _ray_train_config(tmp_path, "rollout.env_executor=ray", "distributed.num_env_workers=2",
                            "distributed.max_restarts=2", "train.evaluation.start=false")
    policy = policy_for_run(cfg, trainable=True)
    pool = env_worker_pool(cfg)
    warm = [pool.make_env() for _ in pool.workers]  # one on each worker (round-robin): both started, the
    for i, env in enumerate(warm):  # env imported, so step 1's resets on worker 0 are done before the kill;
        env.reset(seed=i)  # a worker still starting took its resets (fresh calls) to its next incarnation,
    for env in warm:  # and no episode failed (seen once in CI)
        env.close()
    env_worker = pool.workers[0]
    routed: list[int] = []

    def kill(req: GenerateRequest, w: int) -> None:
        routed.append(w)
        if len(routed) == 3:
            ray.kill(policy.workers[w], no_restart=False)
        if len(routed) == 6:
            ray.kill(env_worker, no_restart=False)

    policy.on_dispatch = kill
    try:
        train(cfg, progress=False, policy=policy)
    finally:
        policy.close()
    rl = _rl_rows(tmp_path)
    assert [r["policy/version"] for r in rl] == [1, 2]  # both steps trained
    assert rl[-1]["rollout_workers/deaths"] == 1 and rl[-1]["rollout_workers/lost"] == 0
    failed = rl[0]["rollout/failed"]
    trees = [json.loads(line) for line in (tmp_path / "trees" / "step-000001.jsonl").read_text().splitlines()]
    errors = [n["error"] for t in trees for n in t["nodes"] if n.get("error")]
    assert 1 <= failed < 8 and len(errors) == failed  # the env worker's episodes: failed, each with its reason
    assert all("env worker" in e for e in errors), errors
    assert not [e for e in errors if "rollout worker" in e]  # the rollout worker's requests were retried
    assert rl[1]["rollout/failed"] == 0  # the restarted env worker hosts step 2's episodes


def test_asynchronous_training_samples_on_rollout_workers(cluster, tmp_path):
    """k=0 over rollout workers repeats the synchronous run over them (deterministic mode);
    k=1 overlaps, with the staleness logged and every batch at most one version old."""
    from agentrl.train.trainer import train

    det = ["rollout.deterministic=true", "train.evaluation.episodes=0"]
    sync = train(_ray_train_config(tmp_path / "sync", *det), progress=False)
    k0 = train(_ray_train_config(tmp_path / "k0", *det, "train.asynchronous={max_batch_staleness: 0}"), progress=False)
    train(_ray_train_config(tmp_path / "k1", *det, "train.asynchronous={max_batch_staleness: 1, queue_size: 1}"),
          progress=False)
    assert sync["phases"] == k0["phases"]
    a, b = _rl_rows(tmp_path / "sync"), _rl_rows(tmp_path / "k0")
    skip = ("time/", "memory/", "async/", "train/tokens_per_s", "rollout_workers/")
    for x, y in zip(a, b, strict=True):
        same = {k: v for k, v in x.items() if not k.startswith(skip)}
        assert {k: y[k] for k in same} == same  # same tasks, rollouts and losses
        assert y["async/staleness_max"] == 0
    c = _rl_rows(tmp_path / "k1")
    assert [r["policy/version"] for r in c] == [1, 2]
    # later steps were rolled out on the workers while the step before trained: tokens one version old
    stale = [r["async/staleness_max"] for r in c]
    assert stale[0] == 0 and max(stale) == 1, stale
    assert all(r["async/dropped_batches"] == 0 for r in c)


def test_router_follows_the_longest_served_prefix_and_yields_to_balance():
    from agentrl.distributed import PrefixRouter

    r = PrefixRouter(2, slack=2)
    a = r.pick([1, 2, 3])  # nothing known: the least busy worker
    b = r.pick([1, 2, 3])
    assert {a, b} == {0, 1}
    r.done(a, [[1, 2, 3], [1, 2, 3, 7, 7]])
    r.done(b, [[1, 2, 3], [1, 2, 3, 8, 8]])
    for _ in range(2):  # each episode's next turn extends its own history
        wa, wb = r.pick([1, 2, 3, 7, 7, 4, 4]), r.pick([1, 2, 3, 8, 8, 5])
        assert (wa, wb) == (a, b)
    assert r.load == [2, 2]
    r.load[a] += 2  # a is now `slack` requests busier than b: affinity gives way
    assert r.pick([1, 2, 3, 7, 7, 4]) == b


def test_ray_executor_without_a_distributed_section_names_the_key():
    from agentrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"rollout\.env_executor=ray needs the distributed section"):
        load_config(overrides=["rollout.env_executor=ray"])
    with pytest.raises(ConfigError, match=r"distributed\.num_rollout_workers"):
        load_config(overrides=["distributed.num_rollout_workers=-1"])


def test_rollout_worker_settings_are_checked_naming_the_key():
    from agentrl.errors import ConfigError
    from agentrl.train.config import load_train_config

    # rollout workers hold their own copy: asynchronous training needs no hf backend here
    load_train_config(None, ["distributed.num_rollout_workers=2", "policy.backend=mock",
                             "train.asynchronous={max_batch_staleness: 1}"])
    with pytest.raises(ConfigError, match=r"train\.asynchronous"):
        load_train_config(None, ["policy.backend=mock", "train.asynchronous={max_batch_staleness: 1}"])
    with pytest.raises(ConfigError, match=r"distributed\.generate_retries"):
        load_config(overrides=["distributed.generate_retries=-1"])
