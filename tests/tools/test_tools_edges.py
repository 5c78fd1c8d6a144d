"""Edge cases of the tools and ``ToolEnv`` found by a hostile review: each test failed
before the fix that its commit describes."""

from __future__ import annotations

import pytest

from agentrl.tools import Task, ToolEnv

_CALC = '{"name": "calculator", "arguments": {"expression": "1+1"}}'


def _one_plus_one_env() -> ToolEnv:
    task = Task("What is 1+1?", verify=lambda answer: float(answer == "Answer: 2"))
    return ToolEnv(task, tools=["calculator"])


@pytest.mark.parametrize("draft", [_CALC, f"<tool_call>{_CALC}</tool_call>"], ids=["json", "hermes"])
def test_a_call_drafted_inside_think_is_not_run_and_the_answer_is_scored(draft):
    env = _one_plus_one_env()
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(
        f"<think>I could call {draft}, but I know it.</think>Answer: 2"
    )
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert "tool_calls" not in info and info["answer"] == "Answer: 2"
    env.close()


@pytest.mark.parametrize("draft", [_CALC, f"<tool_call>{_CALC}</tool_call>"], ids=["json", "hermes"])
def test_a_call_after_the_thinking_runs_once(draft):
    env = _one_plus_one_env()
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(
        f"<think>Let me draft {draft} first.</think>\n<tool_call>{_CALC}</tool_call>"
    )
    assert obs == "<tool_response>\n2\n</tool_response>"
    assert len(info["tool_calls"]) == 1 and not terminated
    env.close()


def test_a_think_tag_inside_a_call_argument_is_text_not_thinking():
    env = _one_plus_one_env()
    env.reset(seed=0)
    call = '{"name": "calculator", "arguments": {"expression": "len(\'<think>\')"}}'
    obs, reward, terminated, truncated, info = env.step(f"<tool_call>{call}</tool_call>")
    assert info["parse_errors"] == [] and info["tool_calls"][0]["arguments"] == {"expression": "len('<think>')"}
    env.close()


# -- calculator ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("+".join(["1"] * 60), 60),  # a sum of 60 prices, say
        ("+".join(["1"] * 400), 400),  # 799 chars: within the length limit
        ("100" + "-1" * 99, 1),
        ("*".join(["2"] * 60), 2**60),
        ("(" * 40 + "1" + "+1)" * 40 + "+1" * 100, 141),  # ((1+1)+1)...: as flat as 1+1+1
    ],
    ids=["sum60", "sum400", "minus99", "product60", "parenthesised_chain"],
)
def test_a_long_flat_chain_of_operators_is_not_taken_for_deep_nesting(expression, value):
    from agentrl.tools.calculator import evaluate

    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", ["1+(" * 60 + "1" + ")" * 60, "-" * 900 + "1", "sqrt(" * 60 + "1" + ")" * 60])
def test_real_nesting_past_the_limit_is_still_a_clear_error(expression):
    from agentrl.tools.calculator import CalcError, evaluate

    with pytest.raises(CalcError, match="nested"):
        evaluate(expression)


def _calculator_worker(env: ToolEnv):
    """The worker process of ``env``'s calculator tool (None before its first call)."""
    return env.tools["calculator"]._worker._box[0]


def test_closing_an_env_stops_the_calculator_worker_it_made():
    env = _one_plus_one_env()  # tools=["calculator"]: the env made the tool
    env.reset(seed=0)
    env.step(f"<tool_call>{_CALC}</tool_call>")
    proc = _calculator_worker(env)
    assert proc is not None and proc.poll() is None
    env.close()
    assert proc.wait(timeout=5) is not None  # the process is gone, not left until gc or exit


def test_closing_an_env_leaves_a_calculator_the_caller_gave_it_running():
    import asyncio

    from agentrl.tools import CalculatorTool

    calculator = CalculatorTool()
    env = ToolEnv(Task("What is 1+1?", verify=lambda answer: 1.0), tools=[calculator])
    env.reset(seed=0)
    env.step(f"<tool_call>{_CALC}</tool_call>")
    proc = _calculator_worker(env)
    env.close()
    assert proc.poll() is None  # the caller owns it, and may share it with other envs
    assert asyncio.run(calculator.invoke({"expression": "6*7"}, None)).content == "42"
    assert _calculator_worker(env) is proc
    calculator._worker.close()


# -- ToolEnv over a list of tasks ----------------------------------------------------------


def _task_list(n: int) -> list[Task]:
    return [Task(f"question {i}", verify=lambda answer: 0.0) for i in range(n)]


def test_seeds_zero_to_n_minus_one_play_each_task_of_a_list_once():
    env = ToolEnv(_task_list(20))
    every = {f"question {i}" for i in range(20)}
    first = [env.reset(seed=seed)[0] for seed in range(20)]
    again = [env.reset(seed=seed)[0] for seed in range(20, 40)]
    assert set(first) == every and set(again) == every  # each run of 20 seeds plays each once
    assert first != sorted(first, key=lambda p: int(p.split()[1]))  # shuffled: not the list's order
    assert first != again and env.reset(seed=7)[0] == first[7]  # each run its own order; repeatable
    assert env.num_tasks == 20  # what agentrl eval reads to play the whole list
    env.close()


def test_an_unseeded_reset_still_draws_a_task_of_the_list_and_other_sources_count_none():
    env = ToolEnv(_task_list(3))
    assert env.reset()[0] in {"question 0", "question 1", "question 2"}
    env.close()
    assert ToolEnv(lambda rng: _task_list(1)[0]).num_tasks is None


# -- the tool-call parser -----------------------------------------------------------------


def _call_text(expression: str) -> str:
    import json

    return json.dumps({"name": "calculator", "arguments": {"expression": expression}})


@pytest.mark.parametrize("inside", ["</tool_call>", "<tool_call>", "a <tool_call>b</tool_call> c"])
def test_a_tool_call_tag_inside_an_argument_string_is_text(inside):
    from agentrl.tools.parse import parse_tool_calls

    text = f"<tool_call>{_call_text(inside)}</tool_call>\n<tool_call>{_call_text('6*7')}</tool_call>"
    res = parse_tool_calls(text)
    assert res.errors == []
    assert [c.arguments["expression"] for c in res.calls] == [inside, "6*7"]


def test_a_broken_block_is_still_an_error_and_the_next_block_is_read():
    from agentrl.tools.parse import parse_tool_calls

    res = parse_tool_calls(f'<tool_call>{{"name": "x", </tool_call><tool_call>{_call_text("1")}</tool_call>')
    assert len(res.errors) == 1 and "invalid JSON" in res.errors[0]
    assert [c.arguments for c in res.calls] == [{"expression": "1"}]
    res = parse_tool_calls(f"<tool_call>{_call_text('1')} oops</tool_call>")  # text after the JSON
    assert res.calls == [] and "text after the JSON object" in res.errors[0]


def test_many_blocks_each_opening_a_long_string_parse_quickly():
    import time

    from agentrl.tools.parse import parse_tool_calls

    text = ('<tool_call>{"name": "a", "arguments": {"x": "' + "y" * 2_000) * 90  # 180 KB, no quote closes
    start = time.perf_counter()
    res = parse_tool_calls(text)
    assert time.perf_counter() - start < 2.0 and res.calls == [] and res.errors


def test_a_wrapped_env_gets_the_action_without_the_reasoning_it_opens_with():
    from agentrl.envs.guess_number import GuessNumberEnv

    env = ToolEnv(GuessNumberEnv(high=8, max_turns=8), tools=["calculator"])
    env.reset(seed=0)
    secret = env.inner.secret
    wrong = secret % 8 + 1  # the first number of the raw text, which GuessNumber reads
    obs, reward, terminated, truncated, info = env.step(f"<think>Not {wrong}, I think.</think>\n{secret}")
    assert (obs, reward, terminated) == (f"Correct! The number was {secret}.", 1.0, True)
    env.close()
