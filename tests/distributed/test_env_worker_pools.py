"""Env-worker pools within one run: an engine holds its pool while it runs, and a new pool
(a curriculum stage's, the evaluation's) first frees the CPUs of the env's idle pools but the
most recent one, or all of them where the cluster has no room: a later stage never waits for
CPUs an idle pool keeps."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray", reason="ray is not installed here: pip install 'agentrl[ray]' (make extras)")

from agentrl.config import load_config  # noqa: E402
from agentrl.distributed import env_workers  # noqa: E402
from agentrl.distributed.env_workers import env_worker_pool, release_env_worker_pool  # noqa: E402


def _cfg(max_steps: int, cpus: float, workers: int = 1):
    return load_config(overrides=["env.id=agentrl/GuessNumber-v0", f"env.kwargs={{max_turns: {max_steps}}}",
                                  "rollout.env_executor=ray", "distributed.ray=auto",
                                  f"distributed.num_env_workers={workers}",
                                  f"distributed.env_worker_cpus={cpus}", "distributed.rollout_worker_cpus=0.25"])


def _alive(ray, pool, timeout: float = 60.0) -> bool:
    try:
        ray.get([w.pid.remote() for w in pool.workers], timeout=timeout)
        return True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


@pytest.fixture
def pools(cluster):
    deadline = time.monotonic() + 60  # the workers an earlier test killed give their CPUs back
    while cluster.available_resources().get("CPU", 0.0) < 2.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    yield cluster
    env_workers.shutdown_env_worker_pools("agentrl/GuessNumber-v0")


def test_a_new_pool_keeps_only_the_most_recent_idle_pool_and_never_one_in_use(pools):
    ray = pools
    a = env_worker_pool(_cfg(3, 0.25))
    release_env_worker_pool(a)
    e = env_worker_pool(_cfg(4, 0.25))  # the evaluation's level
    release_env_worker_pool(e)
    assert _alive(ray, a) and _alive(ray, e)
    b = env_worker_pool(_cfg(5, 0.25))  # the next stage: the older idle pool goes, the recent one stays
    assert not _alive(ray, a, timeout=10) and _alive(ray, e) and _alive(ray, b)
    assert a not in env_workers._POOLS.values() and e in env_workers._POOLS.values()
    c = env_worker_pool(_cfg(6, 0.25))  # b is in use: kept, whatever its age
    assert _alive(ray, b) and _alive(ray, e) and _alive(ray, c)
    assert env_worker_pool(_cfg(5, 0.25)) is b and b.users == 2  # the same level reuses its pool
    for pool in (b, b, c):
        release_env_worker_pool(pool)
    d = env_worker_pool(_cfg(7, 0.25))  # idle: e (oldest), b, c (newest) -> only c stays
    assert [_alive(ray, p, timeout=10) for p in (e, b, c, d)] == [False, False, True, True]


def test_a_pool_that_needs_the_cpus_an_idle_pool_holds_gets_them(pools):
    """Two CPUs; each pool's two workers take one each. Before, the second level's workers
    waited for good; now the idle pool is shut down first and they start."""
    ray = pools
    first = env_worker_pool(_cfg(3, 1.0, workers=2))
    assert _alive(ray, first)
    release_env_worker_pool(first)
    second = env_worker_pool(_cfg(4, 1.0, workers=2))
    assert _alive(ray, second, timeout=60), "the second level's workers never started"
    assert not _alive(ray, first, timeout=10)


def test_an_engine_gives_its_pool_back_when_it_closes(pools):
    from agentrl.rollout.executors import EnvExecutor

    cfg = _cfg(3, 0.25)
    executor = EnvExecutor(cfg, cfg.env.id)
    pool = executor._env_workers
    assert pool.users == 1
    executor.close()
    executor.close()  # twice: given back once
    assert pool.users == 0


def test_a_retired_pool_goes_first_and_the_evaluation_s_is_the_one_kept(pools):
    """A finished stage's pool, used more recently than the evaluation's, is retired: the next
    stage's new pool shuts it down and keeps the evaluation's, right away, on a cluster whose CPUs
    the three pools fill (the stage's are counted free before Ray has them back). One retired in
    use stays until given back and a new pool is made."""
    ray = pools
    ev = env_worker_pool(_cfg(4, 1.0))  # two CPUs: one for each of these pools' one worker
    release_env_worker_pool(ev)
    stage = env_worker_pool(_cfg(3, 1.0))
    release_env_worker_pool(stage)
    assert env_workers.retire_env_worker_pool(_cfg(3, 1.0))
    assert _alive(ray, stage)  # nothing killed yet
    nxt = env_worker_pool(_cfg(5, 1.0))  # at once, as the trainer's next step does
    assert env_workers._POOLS.get(ev.key) is ev and stage not in env_workers._POOLS.values()
    assert _alive(ray, ev) and _alive(ray, nxt) and not _alive(ray, stage, timeout=10)
    assert env_workers.retire_env_worker_pool(_cfg(5, 1.0))  # in use: it stays
    later = env_worker_pool(_cfg(6, 1.0))  # ... whatever is made meanwhile (in the CPU of ev, idle)
    assert _alive(ray, nxt) and nxt in env_workers._POOLS.values() and _alive(ray, later)
    release_env_worker_pool(nxt)
    release_env_worker_pool(later)
    again = env_worker_pool(_cfg(5, 1.0))  # taken again before it went: wanted after all
    assert again is nxt and not nxt.retired
    assert not env_workers.retire_env_worker_pool(_cfg(9, 0.25))  # none made for it


def test_a_worker_whose_threads_all_hang_is_dealt_no_more_envs(pools, monkeypatch, tmp_path):
    """Env steps that hang past their episode's timeout keep their worker's threads: a worker
    whose every thread is held so can run no call, yet round-robin dealt it every other env,
    whose episodes then waited out their own timeouts. Once every worker is so, the env
    cannot be made, and the error says why."""
    import asyncio

    from agentrl.distributed.env_workers import EnvWorkerPool
    from agentrl.errors import EnvError

    monkeypatch.setattr(env_workers, "MAX_CALLS_PER_WORKER", 2)  # threads a worker runs at once
    mark = tmp_path / "hangs"
    pool = EnvWorkerPool("agentrl-test/Hangs-v0", {"mark": str(mark)}, _cfg(3, 0.25, workers=2).distributed,
                         ["tests.distributed.worker_envs"])

    async def hang_all(worker: int) -> None:  # two episodes that give up on a hung step each
        envs = []
        while len(envs) < 2:
            env = pool.make_env()
            envs += [env] if env._index == worker else []
        calls = [asyncio.ensure_future(env.acall("step", "hang")) for env in envs]
        deadline = time.monotonic() + 60
        while (mark.read_text().count("hang") if mark.exists() else 0) < 2 * (worker + 1):
            assert time.monotonic() < deadline, "the hung steps did not begin"
            await asyncio.sleep(0.05)
        for call in calls:  # their episodes time out: the calls go on in the worker's threads
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)

    try:
        asyncio.run(hang_all(0))
        assert {pool.make_env()._index for _ in range(4)} == {1}
        asyncio.run(hang_all(1))
        with pytest.raises(EnvError, match="all 2 threads of each live env worker.*episode_timeout_s"):
            pool.make_env()
    finally:
        pool.shutdown(close_wait_s=0)
