"""The tools layer under hostile input: odd tool definitions, malformed model
output, misbehaving tool bodies, verifiers and wrapped envs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import threading

import numpy as np
import pytest
from pydantic import BaseModel

from agentrl.env import TextEnv, answer_problem
from agentrl.errors import ConfigError
from agentrl.tools import (
    BashTool,
    CalculatorTool,
    PythonTool,
    SearchTool,
    Task,
    Tool,
    ToolEnv,
    ToolResult,
    get_tool,
    parse_tool_calls,
    tool,
)
from tests.tools.sandbox_fakes import MemorySandbox


def hermes(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class XArgs(BaseModel):
    x: int = 0


# -- tool definitions ------------------------------------------------------------------


def test_keyword_only_and_var_keyword_parameters_are_not_taken_for_the_sandbox():
    # Any second parameter counted as "the sandbox": such a tool demanded one, and
    # its first call raised TypeError (positional sandbox), failing the episode.
    async def kwonly(args: XArgs, *, scale: int = 2) -> str:
        return str(args.x * scale)

    async def var_kw(args: XArgs, **options) -> str:
        return str(args.x)

    for fn in (kwonly, var_kw):
        t = tool(fn)
        assert t.needs_sandbox is False
        env = ToolEnv(Task("q", verify=lambda a: 1.0), tools=[t])  # no sandbox needed
        env.reset(seed=0)
        obs, _, _, trunc, info = env.step(hermes(t.name, x=3))
        assert not trunc and "error" not in info, info.get("error")
        assert obs.split("\n")[1] == ("6" if fn is kwonly else "3")
        env.close()


def test_signatures_the_env_cannot_call_are_refused_at_definition():
    async def three(args: XArgs, sandbox, extra) -> str:
        return ""

    async def required_kwonly(args: XArgs, *, extra) -> str:
        return ""

    for fn in (three, required_kwonly):
        with pytest.raises(TypeError, match="extra"):
            tool(fn)


def test_decorating_a_method_in_a_class_body_is_refused_and_a_bound_method_works():
    # In a class body, ``self`` was taken for an unannotated args parameter (NoArgs)
    # and the real model parameter for the sandbox.
    with pytest.raises(TypeError, match="method"):

        class Holder:
            @tool
            async def look(self, args: XArgs) -> str:
                return ""

    class Counter:
        def __init__(self):
            self.base = 10

        async def add(self, args: XArgs) -> str:
            return str(self.base + args.x)

    t = tool(Counter().add)
    assert t.Args is XArgs and t.needs_sandbox is False and t.name == "add"
    assert asyncio.run(t.invoke({"x": 5}, None)).content == "15"


def test_partials_and_callable_objects_get_a_clear_error():
    async def base(args: XArgs, sandbox=None) -> str:
        return ""

    class Callable:
        async def __call__(self, args: XArgs) -> str:
            return ""

    for obj in (functools.partial(base), Callable()):
        with pytest.raises(TypeError, match="wrap the call in a def"):
            tool(obj)


class ArrayArgs(BaseModel):
    model_config = {"arbitrary_types_allowed": True}
    data: np.ndarray


def test_tools_given_as_one_name_instead_of_a_list_is_a_clear_error():
    # A str is a sequence: it was read letter by letter ("unknown tool 'c'").
    with pytest.raises(ConfigError, match=r"tools=\['calculator'\]"):
        ToolEnv(Task("q", verify=lambda a: 1.0), tools="calculator")


def test_arguments_with_no_json_schema_are_refused_at_definition_not_at_reset():
    # The schema was first built at reset, so the env failed there, far from the cause.
    async def takes_array(args: ArrayArgs) -> str:
        return ""

    with pytest.raises(TypeError, match="takes_array.*ndarray"):
        tool(takes_array)

    class ArrayTool(Tool):
        name = "arrays"
        Args = ArrayArgs

    with pytest.raises(ConfigError, match="arrays"):
        ToolEnv(Task("q", verify=lambda a: 1.0), tools=[ArrayTool()])


def test_tool_names_no_client_can_call_and_things_that_are_not_tools_are_refused():
    async def f(args: XArgs) -> str:
        return ""

    for bad in (" padded", "two words", "x" * 65, 'quote"d'):
        with pytest.raises(TypeError, match="name"):
            tool(name=bad)(f)

    class Nameless(Tool):  # forgot to set ``name``
        pass

    # A nameless tool, a plain function (not decorated), a Tool class (not an instance).
    for thing, hint in ((Nameless(), "name"), (f, "@tool"), (BashTool, "instance")):
        with pytest.raises(ConfigError, match=hint):
            ToolEnv(Task("q", verify=lambda a: 1.0), tools=[thing], sandbox=MemorySandbox())


class LaxArgs(BaseModel):  # pydantic's default: unknown keys are dropped silently
    x: int = 0


class IgnoringArgs(BaseModel):
    model_config = {"extra": "ignore"}  # the author's explicit choice
    x: int = 0


def test_an_argument_the_tool_does_not_take_is_an_error_naming_it():
    # It was dropped silently: the model believed its extra argument was honoured.
    async def lax(args: LaxArgs) -> str:
        return str(args.x)

    async def ignoring(args: IgnoringArgs) -> str:
        return str(args.x)

    bad = asyncio.run(tool(lax).invoke({"x": 1, "verbose": True}, None))
    assert bad.is_error and "verbose" in bad.content and "lax" in bad.content
    assert tool(lax).spec().parameters["additionalProperties"] is False
    assert asyncio.run(tool(ignoring).invoke({"x": 1, "verbose": True}, None)).content == "1"
    assert "additionalProperties" not in tool(ignoring).spec().parameters


# -- tool bodies -----------------------------------------------------------------------


class _Point:
    def __str__(self) -> str:
        return "point(1, 2)"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, ""),
        (b"caf\xc3\xa9 \xff", "café \ufffd"),
        ({"a": 1, "b": "é", "n": np.float32(1.5)}, '{"a": 1, "b": "é", "n": "1.5"}'),
        ([1, 2], "[1, 2]"),
        (np.int64(7), "7"),
        (_Point(), "point(1, 2)"),
        (ToolResult(content=None), ""),
        (ToolResult(content=b"hi"), "hi"),
    ],
)
def test_whatever_a_tool_returns_becomes_readable_text(value, text):
    # bytes showed as "b'...'", dicts as Python reprs, None as "None", and a
    # ToolResult whose content was not a str failed the episode with a TypeError.
    async def give(args: XArgs):
        return value

    result = asyncio.run(tool(give).invoke({}, None))
    assert result.content == text and result.is_error is False


def _helper_that_breaks(x: int) -> str:
    return {}["key" + str(x)]


@tool
async def buggy(args: XArgs) -> str:
    """Raises from a helper."""
    return _helper_that_breaks(args.x)


def test_a_tool_that_raises_fails_the_episode_with_a_traceback_of_where():
    # Only "KeyError: 'key1'" was recorded: nothing said which line of the tool broke.
    env = ToolEnv(Task("q", verify=lambda a: 1.0), tools=[buggy])
    env.reset(seed=0)
    _, reward, term, trunc, info = env.step(hermes("buggy", x=1))
    assert (reward, term, trunc) == (0.0, False, True)
    assert "KeyError" in info["error"] and "_helper_that_breaks" in info["error"]
    env.close()


# -- rewards ---------------------------------------------------------------------------


class FixedScore(Task):
    def __init__(self, value):
        super().__init__("q")
        self.value = value

    async def score(self, answer, sandbox):
        return self.value


@pytest.mark.parametrize("value", [float("nan"), float("inf"), None, "1", [1.0]])
def test_a_verifier_reward_that_is_not_a_finite_number_fails_the_episode(value):
    # NaN and inf were recorded as the reward (NaN lands in the tree's JSON and in
    # every advantage of the group); None and "1" raised out of step().
    env = ToolEnv(FixedScore(value))
    env.reset(seed=0)
    _, reward, term, trunc, info = env.step("the answer")
    assert (reward, term, trunc) == (0.0, False, True)
    assert "finite number" in info["error"] and repr(value) in info["error"]
    env.close()


def test_integer_bool_and_numpy_rewards_are_kept():
    for value, want in ((True, 1.0), (2, 2.0), (np.float32(0.5), 0.5), (np.int64(1), 1.0)):
        env = ToolEnv(FixedScore(value))
        env.reset(seed=0)
        _, reward, term, trunc, _ = env.step("a")
        assert (reward, term, trunc) == (want, True, False) and type(reward) is float
        env.close()


class Scripted(TextEnv):
    """A wrapped env whose step returns what the test gives it."""

    def __init__(self, step):
        super().__init__()
        self.answer = step

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "go", {}

    def step(self, action):
        return self.answer


@pytest.mark.parametrize(
    ("step", "why"),
    [
        (("o", float("nan"), True, False, {}), "finite number"),
        (("o", None, True, False, {}), "finite number"),
        (("o", 1.0, True, False, None), "info"),
        ((None, 1.0, True, False, {}), "observation"),
    ],
)
def test_a_wrapped_env_step_with_a_bad_reward_info_or_observation_fails_the_episode(step, why):
    # These raised TypeError/ValueError out of ToolEnv.step (or passed NaN through).
    env = ToolEnv(Scripted(step), tools=["calculator"])
    env.reset(seed=0)
    obs, reward, term, trunc, info = env.step("act")
    assert isinstance(obs, str) and (reward, term, trunc) == (0.0, False, True)
    assert why in info["error"]
    env.close()


def _nan_scored_env() -> ToolEnv:
    return ToolEnv(Task("q", verify=lambda a: float("nan")), tools=["calculator"])


def test_a_nan_reward_is_a_recorded_episode_failure_in_a_real_rollout(tokenizer):
    from agentrl.config import Config
    from agentrl.env import register_env
    from agentrl.policy.mock import MockPolicy
    from agentrl.rollout import collect

    register_env("agentrl/HostileNanReward-v0", entry_point=_nan_scored_env)
    cfg = Config.model_validate({"rollout": {"group_size": 1, "max_turns": 3}})
    script = [hermes("calculator", expression="6*7"), "42"]
    (tree,) = collect("agentrl/HostileNanReward-v0", MockPolicy(tokenizer, script), cfg, seeds=[0])
    last = tree.leaves()[0]
    assert last.reward == 0.0 and last.truncated and "finite number" in last.error
    assert "NaN" not in tree.to_json()


# -- model output ----------------------------------------------------------------------


def test_lone_surrogate_escape_in_arguments_is_an_error_observation_not_a_failed_episode():
    # JSON may spell "\ud800", which decodes to text no UTF-8 encoder takes: the
    # write tool raised UnicodeEncodeError and the whole episode failed.
    env = ToolEnv(Task("q", verify=lambda a: 1.0), tools=["write_file"], sandbox=MemorySandbox())
    env.reset(seed=0)
    action = '<tool_call>{"name": "write_file", "arguments": {"path": "a", "content": "x\\ud800"}}</tool_call>'
    obs, reward, term, trunc, info = env.step(action)
    assert (term, trunc) == (False, False) and "error" not in info
    assert "surrogate" in obs and "write_file" in obs
    obs.encode("utf-8")  # the observation itself is valid text
    # A complete surrogate pair is an ordinary character.
    ok = parse_tool_calls('{"name": "t", "arguments": {"s": "\\ud83d\\ude00"}}')
    assert ok.errors == [] and ok.calls[0].arguments == {"s": "\U0001f600"}
    env.close()


def test_call_ids_are_unique_even_when_the_model_repeats_or_reuses_them():
    # Two results answering one id cannot be told apart by a chat template or client.
    text = (
        '<tool_call>{"id": "a", "name": "t", "arguments": {}}</tool_call>'
        '<tool_call>{"id": "a", "name": "t", "arguments": {}}</tool_call>'
        '<tool_call>{"id": "call_3", "name": "t", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "t", "arguments": {}}</tool_call>'
    )
    ids = [c.id for c in parse_tool_calls(text).calls]
    assert len(ids) == 4 and len(set(ids)) == 4
    assert ids[0] == "a" and ids[2] == "call_3"


def test_text_after_the_json_in_a_block_is_named_as_such():
    # The message was json's "Extra data: line 1 column 41", which does not say
    # what to change; a stray closing brace is the usual cause.
    for tail in ("}", " I hope this works"):
        res = parse_tool_calls('<tool_call>{"name": "a", "arguments": {"x": 1}}' + tail + "</tool_call>")
        assert res.calls == [] and len(res.errors) == 1
        assert "after the JSON object" in res.errors[0] and repr(tail.strip()[:40]) in res.errors[0]


def test_a_block_left_open_before_the_next_tool_call_tag_does_not_swallow_it():
    # Models often drop the closing tag between calls; both calls were lost as
    # one "invalid JSON (Extra data)" error.
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}\n'
        '<tool_call>{"name": "b", "arguments": {"y": 2}}</tool_call>'
    )
    res = parse_tool_calls(text)
    assert res.errors == []
    assert [(c.name, c.arguments) for c in res.calls] == [("a", {"x": 1}), ("b", {"y": 2})]


def test_a_tool_named_parse_error_is_refused():
    """Calls the env cannot read are answered under that name: the model could not tell them
    from the tool's own results."""
    class ParseErrorArgs(BaseModel):
        x: int = 0

    @tool
    async def parse_error(args: ParseErrorArgs) -> str:
        return "mine"

    with pytest.raises(ConfigError, match="'parse_error', the name the env answers unreadable calls under"):
        ToolEnv(Task("q", verify=lambda a: 1.0), tools=[parse_error])


def test_a_tool_result_that_is_not_valid_unicode_is_escaped_not_a_failed_episode():
    # os.listdir gives undecodable bytes of a file name as lone surrogates ("\udcff"):
    # a tool returning such a name gave an observation the engine refuses, failing the episode.
    @tool
    async def listing(args: XArgs) -> str:
        """List."""
        return "caf\udce9.txt" if args.x == 0 else ToolResult.error("bad \ud800")

    env = ToolEnv(Task("q", verify=lambda a: 1.0), tools=[listing])
    env.reset(seed=0)
    for x, shown in ((0, "caf\\udce9.txt"), (1, "bad \\ud800")):
        answer = env.step(hermes("listing", x=x))
        assert answer_problem("step", answer) is None
        assert shown in answer[0] and answer[4]["tool_messages"][0]["content"] == shown
    env.close()


@pytest.mark.parametrize(("name", "arguments", "field"), [
    ("write_file", {"path": "a.txt", "content": "a\ud800b"}, "content"),
    ("edit_file", {"path": "a.txt", "search": "x", "replace": "\udcff"}, "replace"),
    ("bash", {"command": "echo \ud800"}, "command"),
])
def test_arguments_that_are_not_valid_unicode_are_an_error_result_when_invoked_directly(name, arguments, field):
    # The parser refuses them; Tool.invoke, the entry point for raw arguments, let them
    # through: write_file and edit_file raised UnicodeEncodeError, failing the episode.
    box = MemorySandbox()
    box.files["a.txt"] = b"x"
    res = asyncio.run(get_tool(name).invoke(arguments, box))
    assert res.is_error and f"- {field}: holds a lone surrogate" in res.content
    assert box.files == {"a.txt": b"x"}


def test_an_argument_error_is_capped_like_any_result():
    # Validation errors returned before the cap: 100 KB unknown keys made a 0.9 MB result.
    res = asyncio.run(get_tool("calculator").invoke({f"{i}" + "k" * 100_000: 1 for i in range(10)}, None))
    assert res.is_error and len(res.content) < get_tool("calculator").max_output_chars + 100
    assert res.metadata["truncated_from"] > 800_000


@pytest.mark.parametrize(("make", "setting", "value"), [
    (CalculatorTool, "timeout_s", "2"),  # select() raised TypeError at the first call
    (CalculatorTool, "timeout_s", 0),  # every call "took longer than 0 s"
    (BashTool, "max_timeout", "60"),  # min() raised TypeError at the first call
    (PythonTool, "max_timeout", float("nan")),
    (PythonTool, "max_timeout", -1),
    (SearchTool, "snippet_chars", -1),  # doc.text[:-1]: all but the last char
    (SearchTool, "snippet_chars", 2.5),
    (SearchTool, "snippet_chars", True),
])
def test_a_bad_tool_setting_is_refused_at_construction_naming_it(make, setting, value):
    with pytest.raises(ConfigError, match=f"{make.__name__}.*{setting}.*{value!r}"):
        make(**{setting: value})


def test_good_tool_settings_are_kept_as_numbers():
    assert CalculatorTool(timeout_s=3).timeout_s == 3.0
    assert BashTool(max_timeout=np.float64(5)).max_timeout == 5.0
    assert SearchTool(["a b"], snippet_chars=np.int64(80)).snippet_chars == 80


class CliArgs(BaseModel):
    argv: list[str] = []


@tool
def cli(args: CliArgs) -> str:
    """A command line tool: argparse exits on arguments it does not take."""
    import argparse

    parser = argparse.ArgumentParser(prog="cli", add_help=False)
    parser.add_argument("--n", type=int, default=1)
    return str(parser.parse_args(args.argv).n)


@tool
async def quits(args: XArgs) -> str:
    """Exits."""
    raise SystemExit(3)


def _exits_when_scored(answer: str) -> float:
    raise SystemExit("verifier gave up")


@pytest.mark.parametrize(("make_env", "action", "why"), [
    (lambda: ToolEnv(Task("q", verify=lambda a: 1.0), tools=[cli]),
     hermes("cli", argv=["--bad"]), "tool 'cli' failed: ToolError: it called exit(2)"),
    (lambda: ToolEnv(Task("q", verify=lambda a: 1.0), tools=[quits]),
     hermes("quits"), "tool 'quits' failed: ToolError: it called exit(3)"),
    (lambda: ToolEnv(Task("q", verify=_exits_when_scored)),
     "42", "verifier failed: SystemExit: verifier gave up"),
])
def test_code_that_calls_exit_fails_its_episode_and_the_shared_loop_lives_on(make_env, action, why, capsys):
    # argparse on bad input raises SystemExit: on the loop every env shares it stopped
    # the loop's thread, and this step and every later one of every env waited forever.
    env = make_env()
    env.reset(seed=0)
    _, reward, term, trunc, info = env.step(action)
    assert (reward, term, trunc) == (0.0, False, True) and info["error"].startswith(why)
    env.close()
    other = ToolEnv(Task("q", verify=lambda a: a == "2"), tools=["calculator"])
    other.reset(seed=0)
    assert other.step(hermes("calculator", expression="1+1"))[0] == "<tool_response>\n2\n</tool_response>"
    other.close()


def test_a_wrapped_envs_own_tools_prompt_does_not_replace_the_tool_envs():
    # The wrapped env's tools_prompt (a tool env inside, say) replaced the one that lists
    # this env's tools, on that step and then on every tool turn after it.
    env = ToolEnv(Scripted(("o", 0.0, False, False, {"tools_prompt": "inner tools", "turn": 99})),
                  tools=["calculator"])
    _, reset_info = env.reset(seed=0)
    *_, info = env.step("act")
    assert info["tools_prompt"] == reset_info["tools_prompt"] != "inner tools" and info["turn"] == 1
    *_, info = env.step(hermes("calculator", expression="1"))
    assert info["tools_prompt"] == reset_info["tools_prompt"] and info["turn"] == 2
    env.close()


class Gated(TextEnv):
    """A wrapped env whose step waits for the test's gate, noting the threads it ran on."""

    def __init__(self, gate, started):
        super().__init__()
        self.gate, self.started, self.threads = gate, started, set()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.threads.add(threading.get_ident())
        return "go", {}

    def step(self, action):
        self.threads.add(threading.get_ident())
        self.started.set()
        return ("opened" if self.gate.wait(10) else "the gate timed out"), 1.0, True, False, {}


def test_a_slow_wrapped_env_step_or_verifier_does_not_stall_other_envs_tools():
    # Every ToolEnv of a process shares one event loop: a sync wrapped-env step or verifier run
    # on it held every other env's tool calls until it returned.
    gate, step_started, verify_started = threading.Event(), threading.Event(), threading.Event()

    def gated_verify(answer):
        verify_started.set()
        return 1.0 if gate.wait(10) else 0.0

    inner = Gated(gate, step_started)
    slow_step = ToolEnv(inner, tools=["calculator"])
    slow_verify = ToolEnv(Task("q", verify=gated_verify), tools=["calculator"])
    fast = ToolEnv(Task("q", verify=lambda a: 1.0), tools=["calculator"])
    for env in (slow_step, slow_verify, fast):
        env.reset(seed=0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        stepping, verifying = pool.submit(slow_step.step, "act"), pool.submit(slow_verify.step, "42")
        assert step_started.wait(10) and verify_started.wait(10)
        obs, *_ = fast.step('<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>')
        gate.set()
        assert obs == "<tool_response>\n4\n</tool_response>"
        assert stepping.result(20)[:2] == ("opened", 1.0)
        assert verifying.result(20)[1] == 1.0
    assert len(inner.threads) == 1  # reset and step on one thread: an env may keep thread-bound state
    for env in (slow_step, slow_verify, fast):
        env.close()
