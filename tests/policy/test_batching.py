"""The micro-batcher: concurrent requests share batches, failures stay alone, loops stay apart."""

from __future__ import annotations

import asyncio
import threading

import pytest

from agentrl.policy import GenerateRequest, GenerateResult, MicroBatcher


def _echo(calls: list[int]):
    def generate(requests):
        calls.append(len(requests))
        out = []
        for r in requests:
            if r.prompt_ids == [666]:
                raise RuntimeError("poisoned prompt")
            out.append(GenerateResult(list(r.prompt_ids), [0.0] * len(r.prompt_ids), [0.0], "stop", 0))
        return out
    return generate


def test_concurrent_requests_share_one_batch_and_a_failure_stays_alone():
    calls: list[int] = []
    b = MicroBatcher(_echo(calls))

    async def main():
        reqs = [GenerateRequest([i]) for i in range(8)] + [GenerateRequest([666])]
        return await asyncio.gather(*(b.submit(r) for r in reqs), return_exceptions=True)

    out = asyncio.run(main())
    assert [o.token_ids for o in out[:8]] == [[i] for i in range(8)]
    assert isinstance(out[8], RuntimeError) and "poisoned" in str(out[8])
    assert calls[0] == 9  # all in one batch, then retried one by one to isolate the failure
    assert sorted(calls[1:]) == [1] * 9
    assert b.mean_batch == 9


def test_requests_arriving_a_moment_apart_are_gathered():
    calls: list[int] = []
    b = MicroBatcher(_echo(calls), max_wait_s=0.5, quiet_s=0.05)

    async def late(i):
        await asyncio.sleep(0.01 * i)
        return await b.submit(GenerateRequest([i]))

    async def main():
        return await asyncio.gather(*(late(i) for i in range(5)))

    asyncio.run(main())
    assert calls == [5]


def test_two_event_loops_keep_their_own_queues():
    calls: list[int] = []
    b = MicroBatcher(_echo(calls))
    results: dict[int, list[list[int]]] = {}

    def run(base: int):
        async def main():
            outs = await asyncio.gather(*(b.submit(GenerateRequest([base + i])) for i in range(20)))
            return [o.token_ids for o in outs]
        results[base] = asyncio.run(main())

    threads = [threading.Thread(target=run, args=(base,)) for base in (100, 200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results[100] == [[100 + i] for i in range(20)]
    assert results[200] == [[200 + i] for i in range(20)]
    assert sum(calls) == 40


@pytest.mark.parametrize("n", [1, 300])
def test_max_batch_caps_each_generate_call(n):
    calls: list[int] = []
    b = MicroBatcher(_echo(calls), max_batch=128)

    async def main():
        return await asyncio.gather(*(b.submit(GenerateRequest([i])) for i in range(n)))

    out = asyncio.run(main())
    assert len(out) == n and max(calls) <= 128 and sum(calls) == n


def test_an_event_loop_that_submitted_is_not_kept_alive_by_the_batcher():
    """Each ``asyncio.run`` makes a loop; the batcher's per-loop queue must not keep it (nor its
    tasks and futures) once it is gone: its finished drain task referenced the loop."""
    import gc
    import weakref

    b = MicroBatcher(_echo([]))
    loops = []

    async def main():
        loops.append(weakref.ref(asyncio.get_running_loop()))
        return await b.submit(GenerateRequest([1]))

    for _ in range(3):
        assert asyncio.run(main()).token_ids == [1]
    gc.collect()
    assert [ref() for ref in loops] == [None] * 3
    assert len(b._queues) == 0


@pytest.mark.parametrize("bad", [{"max_batch": 0}, {"max_wait_s": -1.0}, {"quiet_s": -0.5},
                                 {"max_wait_s": float("nan")}, {"max_wait_s": float("inf")}])
def test_bad_batcher_settings_fail_naming_the_setting(bad):
    # max_batch=0 took empty batches forever: every submit hung, the loop spinning
    from agentrl.errors import PolicyError

    with pytest.raises(PolicyError, match=next(iter(bad))):
        MicroBatcher(_echo([]), **bad)
