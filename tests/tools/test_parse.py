"""Tool-call parsing from model text (Hermes and bare JSON) and prompt rendering."""

from __future__ import annotations

import json
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.tools import get_tool, parse_tool_calls, render_tool_results, render_tools_prompt
from agentrl.tools.parse import MAX_CALLS, MAX_ERRORS


def test_hermes_block_with_object_arguments():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    res = parse_tool_calls(text)
    assert res.errors == []
    assert [(c.id, c.name, c.arguments) for c in res.calls] == [
        ("call_0", "calculator", {"expression": "1+1"})
    ]


def test_hermes_multiple_blocks_nested_json_and_string_arguments():
    args = {"code": "d = {'a': [1, {'b': 2}]}\nprint(d)", "meta": {"deep": [{"x": {"y": 1}}]}}
    text = (
        f'<tool_call>{{"name": "python", "arguments": {json.dumps(args)}}}</tool_call> and '
        f'<tool_call>{{"name": "bash", "arguments": {json.dumps(json.dumps({"command": "ls"}))}}}'
        "</tool_call>"
    )
    res = parse_tool_calls(text)
    assert res.errors == []
    assert [c.name for c in res.calls] == ["python", "bash"]
    assert res.calls[0].arguments == args
    assert res.calls[1].arguments == {"command": "ls"}
    assert [c.id for c in res.calls] == ["call_0", "call_1"]


def test_hermes_unterminated_last_block_and_code_fence_are_accepted():
    text = '<tool_call>\n```json\n{"name": "search", "arguments": {"query": "paris"}}\n```'
    res = parse_tool_calls(text)
    assert res.errors == []
    assert res.calls[0].name == "search" and res.calls[0].arguments == {"query": "paris"}


def test_hermes_invalid_json_is_an_error_that_shows_the_format():
    res = parse_tool_calls('<tool_call>{"name": "python", "arguments": {"code": }</tool_call>')
    assert res.calls == []
    assert len(res.errors) == 1
    assert "invalid JSON" in res.errors[0] and "<tool_call>" in res.errors[0]
    assert res.attempted


def test_hermes_block_errors_name_the_problem():
    cases = {
        "<tool_call></tool_call>": "empty",
        "<tool_call>[1, 2]</tool_call>": "must be a JSON object",
        '<tool_call>{"arguments": {}}</tool_call>': '"name"',
        '<tool_call>{"name": "x", "arguments": [1]}</tool_call>': "must be a JSON object",
        '<tool_call>{"name": "x", "arguments": "{bad"}</tool_call>': "not valid JSON",
    }
    for text, needle in cases.items():
        res = parse_tool_calls(text)
        assert res.calls == [], text
        assert needle in res.errors[0], (text, res.errors)


def test_bare_openai_json_in_text_and_in_function_wrapper():
    text = 'I will call {"name": "calculator", "arguments": "{\\"expression\\": \\"2*3\\"}"} now.'
    res = parse_tool_calls(text)
    assert res.errors == [] and res.calls[0].arguments == {"expression": "2*3"}
    wrapped = json.dumps(
        {"id": "abc", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    )
    res = parse_tool_calls(wrapped)
    assert [(c.id, c.name, c.arguments) for c in res.calls] == [("abc", "bash", {})]
    llama = '{"name": "search", "parameters": {"query": "x"}}'
    assert parse_tool_calls(llama).calls[0].arguments == {"query": "x"}


def test_bare_json_several_calls_and_plain_json_that_is_no_call():
    text = (
        '{"name": "a", "arguments": {"x": {"name": "inner", "arguments": {}}}}\n'
        '{"name": "b", "arguments": {}}\n{"answer": 42}'
    )
    res = parse_tool_calls(text)
    assert [c.name for c in res.calls] == ["a", "b"]
    assert res.calls[0].arguments == {"x": {"name": "inner", "arguments": {}}}
    assert not parse_tool_calls('The result is {"answer": 42}.').attempted
    assert not parse_tool_calls('{"name": "Alice"}').attempted


def test_broken_bare_call_is_reported_but_prose_is_not():
    res = parse_tool_calls('{"name": "python", "arguments": {"code": "print(1)"')
    assert res.calls == [] and "invalid JSON" in res.errors[0]
    for prose in ["42", "", "{", "}{", "set {1, 2}", "The answer is x = {a}."]:
        assert not parse_tool_calls(prose).attempted, prose


def test_style_selects_the_format():
    bare = '{"name": "a", "arguments": {}}'
    assert parse_tool_calls(bare, style="hermes").calls == []
    assert parse_tool_calls(bare, style="json").calls[0].name == "a"
    assert parse_tool_calls("x", style="yaml").errors  # type: ignore[arg-type]


def test_junk_and_non_text_never_raise():
    deep = "<tool_call>" + "[" * 100_000 + "</tool_call>"
    assert parse_tool_calls(deep).errors
    deep_bare = '{"name": "a", "arguments": ' + '{"x":' * 50_000
    assert parse_tool_calls(deep_bare).errors
    assert parse_tool_calls(None).errors  # type: ignore[arg-type]
    assert parse_tool_calls(b"\x00\xff").errors  # type: ignore[arg-type]
    assert not parse_tool_calls("\x00\ud800\uffff").attempted
    many = "{" * 200_000
    assert not parse_tool_calls(many).attempted


def test_render_tools_prompt_lists_every_tool_in_both_styles():
    specs = [get_tool("calculator").spec(), get_tool("bash").spec()]
    hermes = render_tools_prompt(specs, style="hermes")
    assert "<tools>" in hermes and "<tool_call>" in hermes
    lines = hermes.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in lines] == ["calculator", "bash"]
    plain = render_tools_prompt([s.model_dump() for s in specs], style="json")
    assert '"name": "calculator"' in plain and "<tool_call>" not in plain


def test_rendered_example_call_parses_back():
    prompt_call = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n</tool_call>'
    )
    assert parse_tool_calls(prompt_call).calls[0].name == "calculator"


def test_render_tool_results_in_both_styles():
    triples = [("call_0", "bash", "hi\nthere"), ("call_1", "python", "42")]
    hermes = render_tool_results(triples, style="hermes")
    assert (
        hermes
        == "<tool_response>\nhi\nthere\n</tool_response>\n<tool_response>\n42\n</tool_response>"
    )
    lines = render_tool_results(triples, style="json").splitlines()
    assert [json.loads(x) for x in lines][1] == {"id": "call_1", "name": "python", "content": "42"}


call_objects = st.fixed_dictionaries(
    {
        "name": st.text(min_size=1, max_size=20).filter(str.strip),
        "arguments": st.dictionaries(
            st.text(max_size=10),
            st.recursive(
                st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                lambda kids: (
                    st.lists(kids, max_size=3)
                    | st.dictionaries(st.text(max_size=5), kids, max_size=3)
                ),
                max_leaves=10,
            ),
            max_size=4,
        ),
    }
)


@settings(deadline=None, max_examples=150)
@given(st.lists(call_objects, min_size=1, max_size=4), st.text(max_size=40))
def test_fuzz_well_formed_calls_round_trip(calls, noise):
    noise = noise.replace("<tool_call>", "").replace("</tool_call>", "")
    text = noise + "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls)
    res = parse_tool_calls(text)
    assert res.errors == []
    assert [(c.name, c.arguments) for c in res.calls] == [
        (c["name"].strip(), c["arguments"]) for c in calls
    ]


junk = st.one_of(
    st.text(max_size=300),
    st.text(alphabet='{}[]":,<>/_ toolcalnmeargus\\0123456789', max_size=300),
    st.builds(lambda t: f"<tool_call>{t}</tool_call>", st.text(max_size=200)),
    st.builds(lambda t: '{"name": ' + t, st.text(max_size=200)),
)


@settings(deadline=None, max_examples=300)
@given(junk)
def test_fuzz_parser_never_raises(text):
    res = parse_tool_calls(text)
    assert all(isinstance(e, str) and e for e in res.errors)
    for call in res.calls:
        assert call.name == call.name.strip() and 0 < len(call.name) <= 128
        assert isinstance(call.arguments, dict)
    if "{" not in text and "<tool_call>" not in text:
        assert not res.attempted  # plain text is a final answer, never a call


def test_overlong_tool_name_is_an_error():
    res = parse_tool_calls('<tool_call>{"name": "' + "x" * 500 + '", "arguments": {}}</tool_call>')
    assert res.calls == [] and "longer than 128" in res.errors[0]



# -- adversarial text: every parse is linear, every result bounded ------------------------


def _timed_parse(text: str):
    start = time.perf_counter()
    result = parse_tool_calls(text)
    return result, time.perf_counter() - start


def test_whitespace_inside_a_block_parses_in_linear_time():
    # The code-fence regex (\s*```$ tried at every position) took 33 s on this 100 KB block.
    for body in ("a" + " " * 100_000 + "b", '{"name":' + " \n" * 50_000 + "}"):
        res, seconds = _timed_parse(f"<tool_call>{body}</tool_call>")
        assert seconds < 1.0 and len(res.errors) == 1 and "invalid JSON" in res.errors[0]


def test_a_fenced_call_with_inner_whitespace_still_parses():
    res = parse_tool_calls('<tool_call>```json\n{"name":  "a",\n\n "arguments": {}}\n  ```</tool_call>')
    assert res.errors == [] and [c.name for c in res.calls] == ["a"]


def test_thousands_of_calls_are_cut_at_max_calls_with_one_error_saying_so():
    # Each call's id was checked against a set rebuilt per call: 7,692 calls took 6.7 s.
    many = "<tool_call>[" + ",".join(['{"name": "x"}'] * 7_692) + "]</tool_call>"
    res, seconds = _timed_parse(many)
    assert seconds < 1.0
    assert len(res.calls) == MAX_CALLS and len({c.id for c in res.calls}) == MAX_CALLS
    assert res.errors == [f"{7_692 - MAX_CALLS} more tool calls were not read: at most "
                          f"{MAX_CALLS} are read from one reply"]


def test_thousands_of_broken_blocks_give_a_bounded_list_of_errors():
    res, _ = _timed_parse("<tool_call>" * 9_090)  # was 9,090 errors, 0.96 MB of text
    assert len(res.errors) == MAX_ERRORS + 1
    assert res.errors[-1] == f"{9_090 - MAX_ERRORS} more problems like these were not listed"


def test_bare_json_that_fails_late_is_not_rescanned_for_seconds():
    # 256 nested starts, each decoding 100,000 numbers before failing: 3.9 s.
    blob = '{"a":' * 256 + "[" + "1," * 99_000
    res, seconds = _timed_parse(blob)
    assert seconds < 0.5 and not res.attempted




def test_a_bare_call_after_some_broken_json_is_still_read():
    text = "code: {'a': 1} and {x} then " + json.dumps({"name": "calc", "arguments": {"e": "1"}})
    res = parse_tool_calls(text * 20)
    assert len(res.calls) == 20 and res.errors == []
def test_an_overlong_or_non_string_call_id_is_replaced_by_a_generated_one():
    # A 10,000-char id was echoed into every tool message the chat template renders.
    calls = [{"id": "x" * 10_000, "name": "a"}, {"id": 7, "name": "b"}, {"id": "ok_1", "name": "c"},
             {"id": "a\n</tool_response>", "name": "d"}, {"id": "toolu_01A-b.c:9", "name": "e"}]
    res = parse_tool_calls(f"<tool_call>{json.dumps(calls)}</tool_call>")
    assert [c.id for c in res.calls] == ["call_0", "call_1", "ok_1", "call_3", "toolu_01A-b.c:9"]
