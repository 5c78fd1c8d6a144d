"""A run cancelled mid-way (Ctrl-C) names the tasks whose every planned episode had ended,
so what a caller writes was played to the end: a task with one episode of its group still
running is left out even though its tree already holds the other, finished one."""

from __future__ import annotations

import asyncio
import threading

from agentrl.config import load_config
from agentrl.env import TextEnv, register_env
from agentrl.policy import MockPolicy
from agentrl.rollout import Engine, RunInterrupted, collect

GATE = threading.Event()
_RESETS: dict[int, int] = {}


class SecondOfSeed2Hangs(TextEnv):
    """One-step episodes; the second episode of seed 2 waits in its step until GATE opens."""

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.seed_, _RESETS[seed] = seed, _RESETS.get(seed, 0) + 1
        self.hang = seed == 2 and _RESETS[seed] == 2
        return "say anything", {"instruction": "say anything"}

    def step(self, action):
        if self.hang:
            GATE.wait(60)
        return "ok", 1.0, True, False, {}


register_env("agentrl/TestSecondOfSeed2Hangs-v0", entry_point=SecondOfSeed2Hangs)


def test_a_cancelled_run_names_only_the_tasks_whose_episodes_all_ended(tokenizer):
    cfg = load_config(overrides=["rollout.group_size=2", "rollout.concurrency=1", "rollout.max_turns=1",
                                 "sampling.max_new_tokens=4", "rollout.system_prompt=null"])
    done: list[int] = []
    engine = Engine(MockPolicy(tokenizer, lambda p: "hi"), cfg, "agentrl/TestSecondOfSeed2Hangs-v0",
                    on_episode_done=lambda tree: done.append(tree.meta["seed"]))

    async def main():
        run = asyncio.create_task(engine.run([0, 1, 2, 3]))
        while len(done) < 5:  # seeds 0 and 1 whole, seed 2's first episode; its second hangs
            await asyncio.sleep(0.01)
        run.cancel()
        try:
            await run
        except asyncio.CancelledError:
            return
        raise AssertionError("the run was not cancelled")

    _RESETS.clear()
    GATE.clear()
    try:
        asyncio.run(main())
        assert sorted(done) == [0, 0, 1, 1, 2]
        assert [t.meta["seed"] for t in engine.finished] == [0, 1]
        assert [len(list(t.episodes())) for t in engine.finished] == [2, 2]
    finally:
        GATE.set()
        engine.close()


def test_collect_turns_the_ctrl_c_of_a_cancelled_run_into_run_interrupted(tokenizer, monkeypatch):
    """The whole path, with a real SIGINT, is tests/test_interrupt.py's; here, what ``collect``
    raises once asyncio.run has cancelled the run and raised KeyboardInterrupt."""
    from agentrl.types import RolloutTree

    async def cancelled_run(self, seeds, allocator=None, budget=None):
        self.finished = [RolloutTree(meta={"seed": 7})]
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "run", cancelled_run)
    cfg = load_config(overrides=["rollout.max_turns=1"])
    try:
        collect("agentrl/TestSecondOfSeed2Hangs-v0", MockPolicy(tokenizer, lambda p: "hi"), cfg, [0, 1])
    except RunInterrupted as e:
        assert [t.meta["seed"] for t in e.trees] == [7] and e.report is None
    else:
        raise AssertionError("collect did not raise RunInterrupted")
