"""ToolEnv: tool turns, final answers, limits, malformed input, sandbox leasing and crashes."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from pydantic import BaseModel, ValidationError

from agentrl.env import TextEnv
from agentrl.envs.guess_number import GuessNumberEnv
from agentrl.errors import ConfigError, EnvError
from agentrl.tools import Task, ToolEnv, ToolEnvConfig, tool
from tests.tools.sandbox_fakes import DeadSandbox, MemorySandbox


def hermes(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def mult_task(rng) -> Task:
    a, b = (int(x) for x in rng.integers(10, 100, size=2))
    return Task(f"What is {a} * {b}?", verify=lambda ans: ans == str(a * b), info={"answer": a * b})


class EchoArgs(BaseModel):
    text: str
    times: int = 1


@tool
async def echo(args: EchoArgs) -> str:
    """Repeat text."""
    return args.text * args.times


def test_task_episode_tool_turn_then_scored_final_answer():
    env = ToolEnv(mult_task, tools=["calculator"])
    obs, info = env.reset(seed=3)
    assert obs.startswith("What is") and info["instruction"] == obs
    assert [t["name"] for t in info["tools"]] == ["calculator"]
    a, b = (int(w.rstrip("?")) for w in obs.split()[2:5:2])
    obs, reward, term, trunc, info = env.step(
        "Thinking.\n" + hermes("calculator", expression=f"{a}*{b}")
    )
    assert obs == f"<tool_response>\n{a * b}\n</tool_response>"
    assert (reward, term, trunc) == (0.0, False, False)
    assert info["tool_calls"][0]["name"] == "calculator"
    assert info["tool_messages"] == [
        {
            "role": "tool",
            "content": str(a * b),
            "tool_calls": None,
            "tool_call_id": "call_0",
            "name": "calculator",
        }
    ]
    assert info["turn"] == 1 and info["tools"][0]["name"] == "calculator"
    obs, reward, term, trunc, info = env.step(f"<think>easy</think> {a * b} ")
    assert (reward, term, trunc) == (1.0, True, False)
    assert info["answer"] == str(a * b)
    env.close()


def test_wrong_final_answer_scores_zero_and_same_seed_gives_same_task():
    env = ToolEnv(mult_task, tools=["calculator"])
    first, _ = env.reset(seed=11)
    assert env.step("-1")[1:3] == (0.0, True)
    again, _ = env.reset(seed=11)
    assert again == first
    assert env.reset(options={"task": Task("Say hi", verify=lambda a: a == "hi")})[0] == "Say hi"
    assert env.step("hi")[1] == 1.0
    env.close()


def test_wraps_a_text_env_whose_actions_may_call_tools():
    env = ToolEnv(GuessNumberEnv(high=8, max_turns=8), tools=["calculator"])
    obs, info = env.reset(seed=0)
    assert (
        "Guess it" in obs
        and info["admissible_actions"]
        and info["tools"][0]["name"] == "calculator"
    )
    obs, reward, term, trunc, info = env.step(hermes("calculator", expression="2+2"))
    assert obs == "<tool_response>\n4\n</tool_response>" and not term
    assert env.inner.turn == 0  # a tool turn does not step the wrapped env
    for _ in range(8):
        obs, reward, term, trunc, info = env.step(env.inner.expert_action())
        if term:
            break
    assert term and reward == 1.0 and "Correct" in obs
    env.close()


def test_unknown_tool_bad_arguments_and_invalid_json_become_error_observations():
    env = ToolEnv(mult_task, tools=["calculator", echo])
    env.reset(seed=0)
    obs, _, term, trunc, info = env.step(hermes("calculater", expression="1"))
    assert "unknown tool 'calculater'" in obs and "Did you mean 'calculator'" in obs
    assert not term and not trunc and "error" not in info
    obs, *_ = env.step(hermes("echo", text=5, times="many"))
    assert "Invalid arguments for tool 'echo'" in obs and "- text:" in obs and "- times:" in obs
    obs, _, _, _, info = env.step('<tool_call>{"name": "echo", "arguments": {"text": }</tool_call>')
    assert "invalid JSON" in obs and info["parse_errors"]
    obs, *_ = env.step(hermes("echo", text="ok") + "<tool_call>nonsense</tool_call>")
    assert "<tool_response>\nok\n</tool_response>" in obs and "invalid JSON" in obs
    env.close()


def test_per_turn_call_limit_runs_the_first_calls_and_refuses_the_rest():
    env = ToolEnv(mult_task, tools=[echo], max_calls_per_turn=2)
    env.reset(seed=0)
    action = "".join(hermes("echo", text=f"v{i}") for i in range(4))
    obs, _, _, _, info = env.step(action)
    contents = [m["content"] for m in info["tool_messages"]]
    assert contents[:2] == ["v0", "v1"]
    assert all("at most 2 tool calls" in c and "not run" in c for c in contents[2:])
    assert len(contents) == 4 and obs.count("<tool_response>") == 4
    env.close()


def test_output_limits_per_call_and_per_observation():
    env = ToolEnv(mult_task, tools=[echo], max_output_chars=300, max_observation_chars=1000)
    env.reset(seed=0)
    obs, _, _, _, info = env.step(hermes("echo", text="ab", times=50_000))
    content = info["tool_messages"][0]["content"]
    assert len(content) < 400 and content.startswith("abab") and "characters truncated" in content
    obs, _, _, _, info = env.step("".join(hermes("echo", text="x", times=900) for _ in range(4)))
    assert len(obs) <= 1000 + 100
    assert all("characters truncated" in m["content"] for m in info["tool_messages"])
    env.close()


def test_episode_is_truncated_after_max_turns():
    env = ToolEnv(mult_task, tools=[echo], max_turns=3)
    env.reset(seed=0)
    flags = [env.step(hermes("echo", text="x"))[2:4] for _ in range(3)]
    assert flags == [(False, False), (False, False), (False, True)]
    obs, _, _, trunc, info = env.step("late")  # repeats the end; not a new failure
    assert trunc and "Call reset()" in obs and "error" not in info
    env.close()


def test_step_before_reset_is_a_programming_error():
    env = ToolEnv(mult_task, tools=["calculator"])
    with pytest.raises(EnvError, match="reset"):
        env.step("hi")
    env.close()


def test_sandbox_tools_without_a_sandbox_fail_at_construction():
    with pytest.raises(ConfigError, match="sandbox"):
        ToolEnv(mult_task, tools=["bash"])
    with pytest.raises(ConfigError, match='make_sandbox\\("auto"\\)'):  # says how to get one
        ToolEnv(mult_task, tools=["python"])


def test_runs_calls_concurrently():
    class SleepArgs(BaseModel):
        s: float

    state = {"running": 0, "peak": 0}

    @tool
    async def nap(args: SleepArgs) -> str:
        """Sleep."""
        state["running"] += 1
        state["peak"] = max(state["peak"], state["running"])
        await asyncio.sleep(args.s)
        state["running"] -= 1
        return "done"

    env = ToolEnv(mult_task, tools=[nap])
    env.reset(seed=0)
    env.step("".join(hermes("nap", s=0.05) for _ in range(3)))
    assert state["peak"] == 3
    env.close()


def test_call_timeout_gives_an_error_observation():
    class SleepArgs(BaseModel):
        s: float

    @tool
    async def nap(args: SleepArgs) -> str:
        """Sleep."""
        await asyncio.sleep(args.s)
        return "done"

    env = ToolEnv(mult_task, tools=[nap], call_timeout_s=0.05)
    env.reset(seed=0)
    obs, _, term, trunc, _ = env.step(hermes("nap", s=5))
    assert "longer than 0.05 s" in obs and not term and not trunc
    env.close()


def test_fixed_sandbox_is_reset_between_episodes_and_not_closed():
    box = MemorySandbox()
    env = ToolEnv(mult_task, tools=["write_file", "read_file"], sandbox=box)
    env.reset(seed=0)
    obs, *_ = env.step(hermes("write_file", path="a.txt", content="hello"))
    assert "wrote 5 bytes" in obs and box.files == {"a.txt": b"hello"}
    obs, *_ = env.step(hermes("read_file", path="a.txt"))
    assert obs == "<tool_response>\nhello\n</tool_response>"
    env.step("1")  # final answer ends the episode and gives the sandbox back
    assert box.resets == 1 and env.sandbox is None
    env.close()
    assert not box.closed


def test_factory_sandbox_is_created_lazily_and_closed_at_episode_end():
    made: list[MemorySandbox] = []

    def factory():
        made.append(MemorySandbox())
        return made[-1]

    env = ToolEnv(mult_task, tools=["calculator", "read_file"], sandbox=factory)
    env.reset(seed=0)
    env.step(hermes("calculator", expression="1+1"))
    assert made == []  # the calculator needs no sandbox
    env.step(hermes("read_file", path="x"))
    assert len(made) == 1 and not made[0].closed
    env.reset(seed=1)
    assert made[0].closed and env.sandbox is None
    env.close()


def test_pool_like_source_leases_and_takes_back():
    class Pool:
        def __init__(self):
            self.leased, self.returned = 0, []

        async def acquire(self):
            self.leased += 1
            return MemorySandbox()

        async def release(self, box):
            self.returned.append(box)

    pool = Pool()
    env = ToolEnv(mult_task, tools=["read_file"], sandbox=pool)
    env.reset(seed=0)
    env.step(hermes("read_file", path="x"))
    env.step("done")
    assert pool.leased == 1 and len(pool.returned) == 1
    env.close()


def test_task_files_are_written_into_the_sandbox_at_reset():
    box = MemorySandbox()

    class FileTask(Task):
        async def score(self, answer, sandbox):
            return float((await sandbox.read_file("out.txt")) == b"fixed")

    task = FileTask("Fix out.txt", files={"out.txt": "broken"})
    env = ToolEnv(task, tools=["edit_file"], sandbox=box)
    env.reset()
    assert box.files == {"out.txt": b"broken"}
    env.step(hermes("edit_file", path="out.txt", search="broken", replace="fixed"))
    assert env.step("done")[1:3] == (1.0, True)
    env.close()


def test_dead_sandbox_fails_the_episode_with_the_reason_in_info():
    env = ToolEnv(mult_task, tools=["bash"], sandbox=DeadSandbox())
    env.reset(seed=0)
    obs, reward, term, trunc, info = env.step(hermes("bash", command="ls"))
    assert (reward, term, trunc) == (0.0, False, True)
    assert "SandboxDeadError" in info["error"] and "killed from outside" in info["error"]
    assert "release_error" in info  # the dead sandbox could not be reset either
    assert env.step("x")[3] is True  # further steps stay over, without raising
    env.close()


def test_crashing_verifier_or_env_fails_the_episode_not_the_caller():
    def bad_verify(answer):
        raise RuntimeError("verifier bug")

    env = ToolEnv(Task("q", verify=bad_verify), tools=["calculator"])
    env.reset()
    _, reward, term, trunc, info = env.step("answer")
    assert (reward, term, trunc) == (0.0, False, True) and "verifier bug" in info["error"]
    assert "Traceback" in info["error"] and "in bad_verify" in info["error"]  # where it broke

    class Crashing(TextEnv):
        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return "go", {}

        def step(self, action):
            raise RuntimeError("env bug")

    env2 = ToolEnv(Crashing(), tools=["calculator"])
    env2.reset()
    assert "env bug" in env2.step("x")[4]["error"]
    env.close()
    env2.close()


def test_sync_step_works_inside_a_running_event_loop_and_astep_too():
    env = ToolEnv(mult_task, tools=["calculator"])

    async def inside():
        env.reset(seed=0)  # sync API from within a running loop
        sync_obs = env.step(hermes("calculator", expression="6*7"))[0]
        env2 = ToolEnv(mult_task, tools=["calculator"])
        await env2.areset(seed=0)
        async_obs = (await env2.astep(hermes("calculator", expression="6*7")))[0]
        env2.close()
        return sync_obs, async_obs

    assert asyncio.run(inside()) == ("<tool_response>\n42\n</tool_response>",) * 2
    env.close()


def test_json_style_renders_prompt_and_results_as_json():
    env = ToolEnv(mult_task, tools=["calculator"], style="json", tools_in_observation=True)
    obs, _ = env.reset(seed=0)
    assert obs.startswith("# Tools") and "What is" in obs
    obs, *_ = env.step('{"name": "calculator", "arguments": {"expression": "2**5"}}')
    assert json.loads(obs) == {"id": "call_0", "name": "calculator", "content": "32"}
    env.close()


def test_snapshot_and_restore_continue_identically():
    env = ToolEnv(GuessNumberEnv(high=32, max_turns=8), tools=["calculator"])
    env.reset(seed=5)
    env.step("16")
    snap = env.snapshot()
    first = [env.step(a)[:4] for a in ["8", hermes("calculator", expression="1+1"), "24"]]
    env.restore(snap)
    second = [env.step(a)[:4] for a in ["8", hermes("calculator", expression="1+1"), "24"]]
    assert first == second
    env.close()


def test_python_tool_in_a_real_local_sandbox(local_sandbox):
    env = ToolEnv(mult_task, tools=["python", "bash"], sandbox=local_sandbox)
    env.reset(seed=0)
    obs, _, _, _, info = env.step(
        hermes("python", code="x = 6 * 7") + hermes("bash", command="echo hi")
    )
    assert "error" not in info and obs.endswith("<tool_response>\nhi\n</tool_response>")
    obs, *_ = env.step(hermes("python", code="print(x)"))
    assert obs == "<tool_response>\n42\n</tool_response>"
    env.step("42")
    env.close()


def test_snapshot_without_sandbox_snapshots_replays_the_episode():
    box = MemorySandbox()
    env = ToolEnv(mult_task, tools=["write_file", "read_file"], sandbox=box)
    env.reset(seed=2)
    env.step(hermes("write_file", path="a.txt", content="one"))
    snap = env.snapshot()
    assert "replay" in snap  # MemorySandbox cannot snapshot
    env.step(hermes("write_file", path="a.txt", content="two"))
    assert box.files["a.txt"] == b"two"
    env.restore(snap)
    assert box.files == {"a.txt": b"one"} and env._turn == 1
    obs, *_ = env.step(hermes("read_file", path="a.txt"))
    assert obs == "<tool_response>\none\n</tool_response>"
    env.close()


def test_wrapped_env_truncation_passes_through():
    env = ToolEnv(GuessNumberEnv(high=32, max_turns=1), tools=["calculator"])
    env.reset(seed=0)
    secret = env.inner.secret
    obs, reward, term, trunc, info = env.step(str(secret % 32 + 1))
    assert (term, trunc) == (False, True) and "Out of guesses" in obs
    assert "error" not in info
    env.close()


def test_envs_share_a_real_sandbox_pool():
    from agentrl.loopthread import shared_loop
    from agentrl.sandboxes.local import LocalSandbox
    from agentrl.sandboxes.pool import SandboxPool

    pool = SandboxPool(LocalSandbox, size=1, warm=0)
    envs = [ToolEnv(mult_task, tools=["bash"], sandbox=pool) for _ in range(2)]
    try:
        for i, env in enumerate(envs):
            env.reset(seed=i)
            obs, _, _, _, info = env.step(hermes("bash", command="ls; touch mark"))
            assert "error" not in info and "mark" not in obs  # reset between leases
            env.step("done")
        assert pool.stats.created == 1  # one sandbox served both episodes
    finally:
        for env in envs:
            env.close()
        shared_loop().run(pool.close())


def test_python_call_stopped_by_the_call_timeout_does_not_answer_the_next_call(local_sandbox):
    env = ToolEnv(mult_task, tools=["python"], sandbox=local_sandbox, call_timeout_s=60)
    env.reset(seed=0)
    obs, *_ = env.step(hermes("python", code="n = 1"))  # starts the interpreter: slow on a loaded machine
    assert obs == "<tool_response>\n(no output)\n</tool_response>", obs
    env.config.call_timeout_s = 0.5
    slow = "import time\nn = 2\ntime.sleep(3)\nprint('slow')"
    obs, _, _, _, info = env.step(hermes("python", code=slow))
    assert "longer than 0.5 s" in obs and "error" not in info
    obs, *_ = env.step(hermes("python", code="print('fast', n)"))
    assert obs == "<tool_response>\nfast 1\n</tool_response>"
    env.close()


def test_restore_rebuilds_the_python_session(local_sandbox):
    env = ToolEnv(mult_task, tools=["python"], sandbox=local_sandbox)
    env.reset(seed=0)
    env.step(hermes("python", code="x = 41"))
    snap = env.snapshot()
    after = [hermes("python", code="x += 1\nprint(x)")] * 2
    first = [env.step(a)[0] for a in after]
    assert first == [f"<tool_response>\n{n}\n</tool_response>" for n in (42, 43)]
    env.restore(snap)
    again = env.snapshot()  # taken before the restored session ran anything
    assert [env.step(a)[0] for a in after] == first
    env.restore(again)
    assert [env.step(a)[0] for a in after] == first
    env.close()


def test_concurrent_edits_in_one_turn_all_land(local_sandbox):
    env = ToolEnv(mult_task, tools=["write_file", "edit_file", "read_file"], sandbox=local_sandbox)
    env.reset(seed=0)
    env.step(hermes("write_file", path="f.txt", content="a\nb\nc\n"))
    edits = "".join(hermes("edit_file", path="f.txt", search=v, replace=v.upper()) for v in "abc")
    obs, _, _, _, info = env.step(edits)
    assert obs.count("replaced 1 occurrence") == 3, obs
    assert (
        env.step(hermes("read_file", path="f.txt"))[0]
        == "<tool_response>\nA\nB\nC\n\n</tool_response>"
    )
    env.close()


# -- after the episode ended: the rule every env follows ---------------------------------


def _won_math_episode():
    env = ToolEnv(mult_task, tools=["calculator"])
    env.reset(seed=3)
    _, reward, term, trunc, info = env.step(str(env.task.info["answer"]))
    assert (reward, term, trunc) == (1.0, True, False)
    return env, info


def test_a_step_after_a_won_task_pays_nothing_and_stays_terminated():
    # Later steps said terminated=False, truncated=True: a win read as a truncation.
    env, info = _won_math_episode()
    assert info["admissible_actions"] == []  # no action is taken any more
    for _ in range(2):
        obs, reward, term, trunc, info = env.step(str(env.task.info["answer"]))
        assert (reward, term, trunc) == (0.0, True, False)
        assert info["admissible_actions"] == [] and "error" not in info
        assert "episode is over" in obs
    env.close()


def test_a_step_after_a_won_wrapped_env_stays_terminated_with_no_admissible_action():
    env = ToolEnv(GuessNumberEnv(high=8, max_turns=8), tools=["calculator"])
    env.reset(seed=0)
    term = False
    for _ in range(8):
        _, _, term, _, _ = env.step(env.inner.expert_action())
        if term:
            break
    assert term
    for action in (env.inner.expert_action(), hermes("calculator", expression="1+1")):
        _, reward, term, trunc, info = env.step(action)
        assert (reward, term, trunc) == (0.0, True, False)
        assert info["admissible_actions"] == []
    env.close()


def test_a_step_after_truncation_stays_truncated_and_the_answer_pays_nothing():
    env = ToolEnv(mult_task, tools=[echo], max_turns=1)
    env.reset(seed=3)
    *_, term, trunc, info = env.step(hermes("echo", text="x"))
    assert (term, trunc) == (False, True) and info["admissible_actions"] == []
    _, reward, term, trunc, info = env.step(str(env.task.info["answer"]))  # would have won
    assert (reward, term, trunc) == (0.0, False, True) and info["admissible_actions"] == []
    env.close()


def test_a_restored_ended_episode_repeats_how_it_ended():
    env, _ = _won_math_episode()
    snap = env.snapshot()
    env.reset(seed=4)
    env.restore(snap)
    assert env.step("again")[1:4] == (0.0, True, False)
    env.close()


# -- settings: checked as every env checks its own -------------------------------------


@pytest.mark.parametrize(("setting", "value"), [
    ("max_turns", "3"),  # pydantic's lax mode took these as 3, 3 and 1
    ("max_turns", 3.0),
    ("max_calls_per_turn", True),
    ("max_calls_per_turn", 0),
    ("max_calls_per_turn", 129),  # past what the parser reads from one reply
    ("max_output_chars", 10),
    ("call_timeout_s", float("nan")),
    ("call_timeout_s", float("inf")),
    ("call_timeout_s", "60"),
    ("style", "xml"),
    ("tools_in_observation", "no"),  # a truthy str
    ("tools_in_observation", 1),
])
def test_a_bad_setting_is_an_env_error_naming_the_setting_and_the_value(setting, value):
    with pytest.raises(EnvError, match=f"{setting}.*{value!r}"):
        ToolEnv(mult_task, tools=["calculator"], **{setting: value})


def test_an_unknown_setting_is_an_env_error_with_a_did_you_mean():
    with pytest.raises(EnvError, match="max_turn.*did you mean 'max_turns'"):
        ToolEnv(mult_task, tools=["calculator"], max_turn=3)
    with pytest.raises(EnvError, match="config must be a ToolEnvConfig"):
        ToolEnv(mult_task, tools=["calculator"], config={"max_turns": 3})


def test_settings_take_numpy_scalars_and_whole_seconds():
    env = ToolEnv(mult_task, tools=["calculator"], max_turns=np.int64(3), call_timeout_s=60,
                  tools_in_observation=np.bool_(True))
    assert env.config.max_turns == 3 and type(env.config.max_turns) is int
    assert env.config.call_timeout_s == 60.0 and env.config.tools_in_observation is True
    env.close()


def test_the_config_model_is_strict_too():
    with pytest.raises(ValidationError, match="max_turns"):
        ToolEnvConfig(max_turns="3")
    env = ToolEnv(mult_task, tools=["calculator"], config=ToolEnvConfig(max_turns=2), style="json")
    assert (env.config.max_turns, env.config.style) == (2, "json")
    env.close()


def test_a_tool_turn_reports_the_wrapped_envs_latest_state_not_the_reset_one():
    # A tool turn's info held the reset's admissible actions and state key: the list
    # the engine constrains actions to (rollout.constrain) went back to the start.
    env = ToolEnv(GuessNumberEnv(high=8, max_turns=8), tools=["calculator"])
    env.reset(seed=0)
    assert env.inner.secret == 7
    *_, after_guess = env.step("1")
    *_, info = env.step(hermes("calculator", expression="1+1"))
    assert info["admissible_actions"] == after_guess["admissible_actions"] == list("2345678")
    assert info["state_key"] == after_guess["state_key"] == "turn 1: 2..8"
    assert "privileged" in info  # the reset's own keys stay
    env.close()


def test_reset_options_are_checked_as_every_env_checks_them():
    # A misspelt option was ignored and another task played; a task that was not a Task
    # raised AttributeError ('str' object has no attribute 'prompt').
    env = ToolEnv(mult_task, tools=["calculator"])
    for options, why in (({"taks": Task("Say hi")}, r"unknown reset option options\['taks'\].*'task'"),
                         ({"task": "Say hi"}, r"options\['task'\] must be a Task, not 'Say hi'"),
                         (["task"], r"reset options must be a dict, not \['task'\]")):
        with pytest.raises(EnvError, match=why):
            env.reset(seed=0, options=options)
    assert env.reset(seed=0, options={"task": Task("Say hi")})[0] == "Say hi"
    assert env.reset(seed=0, options={})[0].startswith("What is")
    env.close()
