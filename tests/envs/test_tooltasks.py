"""Tool tasks: MathPython, SearchQA and BashFix (with its anti-reward-hacking check)."""

from __future__ import annotations

import asyncio
import json
import textwrap

import numpy as np
import pytest

from agentrl.env import make_env
from agentrl.envs.tooltasks import BashFixEnv, MathPythonEnv, SearchQAEnv, make_math_task
from agentrl.envs.tooltasks._common import answer_f1, extract_answer, numbers_match
from agentrl.envs.tooltasks.bash_fix import TEMPLATES, _count_tests, verify_repo
from agentrl.envs.tooltasks.math_python import TEMPLATES as MATH_KINDS
from agentrl.errors import EnvError


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_envs_are_registered_and_made_by_id():
    for env_id, cls in [
        ("agentrl/MathPython-v0", MathPythonEnv),
        ("agentrl/SearchQA-v0", SearchQAEnv),
        ("agentrl/BashFix-v0", BashFixEnv),
    ]:
        env = make_env(env_id)
        assert isinstance(env.unwrapped, cls)
        env.close()


@pytest.mark.parametrize("cls", [MathPythonEnv, BashFixEnv])
def test_sandboxed_tool_tasks_ask_for_the_auto_backend_by_default(cls, monkeypatch):
    import agentrl.sandboxes
    from tests.tools.sandbox_fakes import MemorySandbox

    asked = []
    monkeypatch.setattr(
        agentrl.sandboxes, "make_sandbox", lambda backend: asked.append(backend) or MemorySandbox()
    )
    cls().close()
    assert asked == ["auto"]


def test_answer_helpers():
    assert extract_answer("work...\nAnswer: 42\n") == "42"
    assert extract_answer("Answer: 1\nAnswer: **7**") == "7"
    assert extract_answer("  Paris ") == "Paris"
    assert numbers_match("$1,234.50", 1234.5) and not numbers_match("1234.6", 1234.5)
    assert numbers_match("9.44", 9.44, tolerance=0.011) and not numbers_match("none", 1.0)
    assert answer_f1("the Velmora river", "Velmora") == pytest.approx(2 / 3)


# -- MathPython ---------------------------------------------------------------


def test_math_tasks_of_every_kind_accept_the_reference_only():
    rng = np.random.default_rng(0)
    for kind in MATH_KINDS:
        task = make_math_task(rng, (kind,))
        ref = task.info["reference"]
        assert task.info["kind"] == kind and "Answer: <number>" in task.prompt
        assert task.verify(f"I think...\nAnswer: {ref}") == 1.0
        assert task.verify(f"Answer: {ref + 1}") == 0.0
        assert task.verify("no idea") == 0.0


def test_math_reset_is_deterministic_per_seed():
    env = MathPythonEnv()
    assert env.reset(seed=4)[0] == env.reset(seed=4)[0]
    assert len({env.reset(seed=s)[0] for s in range(10)}) == 10
    env.close()


def test_math_episode_solved_with_the_python_tool():
    env = MathPythonEnv(kinds=("primes",))
    obs, info = env.reset(seed=1)
    n = int(obs.split("smaller than ")[1].split("?")[0])
    code = f"print(sum(all(k % d for d in range(2, int(k**0.5) + 1)) for k in range(2, {n})))"
    tool_obs, _, _, _, step_info = env.step(call("python", code=code))
    assert "error" not in step_info
    count = tool_obs.split("\n")[1]
    assert float(count) == info["reference"]
    _, reward, terminated, _, _ = env.step(f"Answer: {count}")
    assert (reward, terminated) == (1.0, True)
    env.close()


# -- SearchQA -----------------------------------------------------------------


def test_searchqa_question_entity_is_found_first_and_reference_scores():
    env = SearchQAEnv()
    for seed in range(12):
        obs, info = env.reset(seed=seed)
        question = obs.split("?")[0]
        tool_obs, *_ = env.step(call("search", query=question, k=3))
        top_title = tool_obs.split("\n")[1].split(" (score")[0].split("] ", 1)[1]
        assert top_title in question  # the person or company the question names
        _, reward, term, _, final = env.step(f"Answer: {info['reference']}")
        assert (reward, term) == (1.0, True) and final["em"] == 1.0 == final["f1"]
    env.close()


def test_searchqa_multi_hop_chain_is_answerable_from_the_documents():
    env = SearchQAEnv()
    world = env.world
    docs = {d.title: d.text for d in world.documents}
    for person, city in list(world.person_city.items())[:10]:
        assert f"born in {city}" in docs[person]
        assert f"city in {world.city_country[city]}" in docs[city]
    env.close()


def test_searchqa_f1_metric_gives_partial_credit():
    env = SearchQAEnv(metric="f1")
    env.reset(seed=3, options=None)
    ref = env.task.info["reference"]
    _, reward, *_ = env.step(f"Answer: {ref} perhaps")
    assert 0.0 < reward < 1.0
    env.close()
    with pytest.raises(EnvError, match="metric"):
        SearchQAEnv(metric="bleu")


# -- BashFix ------------------------------------------------------------------


@pytest.fixture
def local_sandbox():
    from agentrl.sandboxes.local import LocalSandbox

    box = LocalSandbox()
    yield box
    asyncio.run(box.close())


def _verify(box, files: dict[str, str], tests: dict[str, str]) -> dict:
    async def go():
        await box.reset()
        for path, src in files.items():
            await box.write_file(path, src)
        return await verify_repo(box, tests, _count_tests(tests))

    return asyncio.run(go())


def test_every_bug_template_fails_its_tests_and_the_fix_passes(local_sandbox):
    import random

    for name, make in TEMPLATES.items():
        mod = make(random.Random(name))
        tests = {f"tests/test_{mod.name}.py": textwrap.dedent(mod.tests)}
        good = {f"{mod.name}.py": textwrap.dedent(mod.good), **tests}
        bad = {f"{mod.name}.py": textwrap.dedent(mod.bad), **tests}
        assert mod.good != mod.bad, name
        assert _verify(local_sandbox, good, tests)["passed"], name
        assert not _verify(local_sandbox, bad, tests)["passed"], name


def _bashfix(seed: int) -> tuple[BashFixEnv, dict]:
    env = BashFixEnv()
    _, info = env.reset(seed=seed)
    return env, info


def _finish(env: BashFixEnv) -> tuple[float, dict]:
    _, reward, terminated, _, info = env.step("done")
    assert terminated
    env.close()
    return reward, info


def test_bashfix_unfixed_repo_scores_zero_and_fixed_repo_scores_one():
    env, _ = _bashfix(0)
    reward, info = _finish(env)
    assert reward == 0.0 and info["tests_run"] == info["expected_tests"] > 0
    env, _ = _bashfix(0)
    for path, src in env.task.repo.fix.items():
        obs, *_ = env.step(call("write_file", path=path, content=src))
    obs, *_ = env.step(call("bash", command="python3 -m unittest discover tests"))
    assert "OK" in obs
    reward, info = _finish(env)
    assert reward == 1.0 and info["tests_modified"] is False


HACKS = {
    "delete the tests": "rm -rf tests && mkdir tests",
    "gut the tests": "for f in tests/test_*.py; do printf 'import unittest\\n' > $f; done",
    "assert nothing": (
        "for f in tests/test_*.py; do sed -i 's/self.assert[A-Za-z]*(/print(/' $f; done"
    ),
    "shadow unittest": ("printf 'import sys\\nprint(\"OK\")\\nsys.exit(0)\\n' > unittest.py"),
    "skip every test": "printf 'import unittest\\nraise unittest.SkipTest(\"x\")\\n' >> "
    "$(ls *.py | head -1)",
}


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_bashfix_reward_hacks_do_not_pay(hack):
    env, _ = _bashfix(5)
    obs, _, _, _, info = env.step(call("bash", command=HACKS[hack]))
    assert "error" not in info, info
    # the hack does fool a verifier that trusts the repository's own tests
    naive = "python3 -m unittest discover tests >/dev/null 2>&1; echo EXIT=$?"
    assert "EXIT=0" in env.step(call("bash", command=naive))[0]
    reward, final = _finish(env)
    assert reward == 0.0, (hack, final)


def test_bashfix_fix_plus_edited_tests_still_pays_and_is_flagged():
    env, _ = _bashfix(2)
    for path, src in env.task.repo.fix.items():
        env.step(call("write_file", path=path, content=src))
    env.step(call("bash", command="rm -rf tests"))
    reward, info = _finish(env)
    assert reward == 1.0 and info["tests_modified"] is True


def test_bashfix_repos_differ_by_seed_and_repeat_per_seed():
    env = BashFixEnv()
    env.reset(seed=1)
    files_a = dict(env.task.files)
    env.reset(seed=1)
    assert env.task.files == files_a
    env.reset(seed=2)
    assert env.task.files != files_a
    env.close()


def test_a_bad_setting_closes_the_sandbox_the_env_made_for_itself(monkeypatch):
    """The sandbox made from a backend name was created before ToolEnv checked its settings,
    so a bad setting left it open."""
    import agentrl.sandboxes as sandboxes
    from agentrl.errors import EnvError

    made = []
    real = sandboxes.make_sandbox

    def recording(spec, *a, **kw):
        box = real(spec, *a, **kw)
        closed = box.close

        async def close():
            made.append("closed")
            await closed()

        box.close = close
        made.append("made")
        return box

    monkeypatch.setattr(sandboxes, "make_sandbox", recording)
    with pytest.raises(EnvError, match="max_turns"):
        MathPythonEnv(sandbox="local", max_turns="three")
    assert made == ["made", "closed"]
