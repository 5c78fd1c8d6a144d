"""A new tool environment in under 20 lines: multiply two numbers with the calculator."""

import json
import re

from agentrl.tools import Task, ToolEnv


def make_task(rng) -> Task:
    a, b = (int(x) for x in rng.integers(100, 1000, size=2))
    return Task(f"What is {a} * {b}? Answer with the number only.", lambda ans: ans == str(a * b))


if __name__ == "__main__":  # play one episode with a scripted "model" that uses the tool
    env = ToolEnv(make_task, tools=["calculator"])
    obs, info = env.reset(seed=0)
    call = {"name": "calculator", "arguments": {"expression": "*".join(re.findall(r"\d+", obs))}}
    result, *_ = env.step(json.dumps(call))
    _, reward, done, *_ = env.step(re.search(r"-?\d+", result).group())
    print(obs, result, f"reward {reward}, done {done}", sep="\n")
