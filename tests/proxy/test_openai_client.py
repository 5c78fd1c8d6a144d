"""The official openai client, sync and async, streaming and not, against the proxy."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the client tests need the openai package (dev extra)")

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_sync_chat_returns_sampled_tokens_and_policy_version(hf_server, tokenizer):
    raw = _client(hf_server.url).chat.completions.with_raw_response.create(
        model="anything", messages=MSGS, max_tokens=6, seed=3, temperature=0.7,
        extra_body={"return_token_ids": True})
    assert raw.headers["x-policy-version"] == "0"
    out = raw.parse()
    choice = out.choices[0]
    data = out.model_dump()
    ids = data["choices"][0]["token_ids"]
    assert 1 <= len(ids) <= 6 and out.usage.completion_tokens == len(ids)
    assert choice.message.content == tokenizer.decode(ids, skip_special_tokens=True)
    assert choice.finish_reason in ("stop", "length")
    # the prompt is the template rendering of the messages, exactly
    assert data["prompt_token_ids"] == tokenizer.apply_chat_template(MSGS, add_generation_prompt=True,
                                                                     tokenize=True, return_dict=False)


def test_seeded_requests_repeat_and_n_gives_distinct_streams(hf_server):
    client = _client(hf_server.url)
    a = client.chat.completions.create(model="m", messages=MSGS, max_tokens=8, seed=11, n=3)
    b = client.chat.completions.create(model="m", messages=MSGS, max_tokens=8, seed=11, n=3)
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert len(set(texts)) > 1  # each choice has its own random stream


def test_sync_stream_rebuilds_the_same_text(hf_server):
    client = _client(hf_server.url)
    whole = client.chat.completions.create(model="m", messages=MSGS, max_tokens=8, seed=5)
    stream = client.chat.completions.create(model="m", messages=MSGS, max_tokens=8, seed=5, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_async_client_stream_and_not(hf_server):
    async def run():
        client = openai.AsyncOpenAI(base_url=f"{hf_server.url}/v1", api_key="x", max_retries=0)
        whole = await client.chat.completions.create(model="m", messages=MSGS, max_tokens=8, seed=9)
        stream = await client.chat.completions.create(model="m", messages=MSGS, max_tokens=8, seed=9,
                                                      stream=True)
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        await client.close()
        return whole.choices[0].message.content, "".join(parts)

    whole, streamed = asyncio.run(run())
    assert whole == streamed


def test_completions_token_prompt_logprobs_and_token_ids(hf_server, tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    out = _client(hf_server.url).completions.create(
        model="m", prompt=prompt, max_tokens=5, logprobs=2, seed=1,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True}).model_dump()
    choice = out["choices"][0]
    ids = choice["token_ids"]
    assert choice["prompt_token_ids"] == prompt
    assert choice["logprobs"]["tokens"] == [f"token_id:{i}" for i in ids]
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
    assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
    assert all(len(alts) == 2 and all(k.startswith("token_id:") for k in alts)
               for alts in choice["logprobs"]["top_logprobs"])
    assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)


def test_completions_batch_of_prompts_and_stop_string(mock_policy, serve, tokenizer):
    server = serve(mock_policy(["alpha STOP beta"]))
    client = _client(server.url)
    out = client.completions.create(model="m", prompt=["one", "two"], n=2, max_tokens=20, stop=["STOP"])
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(c.text == "alpha " for c in out.choices)
    kept = client.completions.create(model="m", prompt="one", max_tokens=20, stop="STOP",
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == "alpha STOP"


def test_tool_calls_are_parsed_and_streamed(mock_policy, serve):
    call = 'Let me add.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    server = serve(mock_policy([call]))
    client = _client(server.url)
    out = client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Let me add."
    assert msg.tool_calls[0].function.name == "add"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"a": 2, "b": 3}
    stream = client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [c.function.name for c in calls] == ["add"]
    none = client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.tool_calls is None and "<tool_call>" in none.choices[0].message.content


def test_tools_are_described_in_the_system_prompt(mock_policy, serve, tokenizer):
    seen = []
    server = serve(mock_policy(lambda prompt: seen.append(prompt) or "ok"))
    _client(server.url).chat.completions.create(model="m", messages=MSGS, tools=TOOLS)
    assert '"name": "add"' in seen[0] and "<tool_call>" in seen[0] and "Be brief." in seen[0]


def test_models_lists_the_served_name(mock_policy, serve):
    server = serve(mock_policy(), served_model_name="my-policy")
    assert [m.id for m in _client(server.url).models.list()] == ["my-policy"]
    assert httpx.get(f"{server.url}/health").headers["x-policy-version"] == "0"
