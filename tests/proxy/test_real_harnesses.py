"""The proxy under real, unmodified agent harnesses, each playing one scripted episode in a session.

Claude Code (``claude -p``, Anthropic Messages) and Codex CLI (``codex exec``,
Responses) are the npm packages ``make test`` installs (``.ci/harness-setup.sh``);
the OpenAI Agents SDK (Responses and Chat Completions models, streamed and
not) and the ``anthropic`` SDK are dev extras. The policy is ``mock``, scripted
from the prompt: while no tool result shows the marker, it calls the harness's
own shell tool with a harmless command that prints it; then it answers.

Each test checks the session tree the proxy recorded:

- every model call the harness made is a node (counted at the HTTP layer);
- the tool's result is in the recorded context of the next call;
- the harness's final answer is what the final action's tokens decode to;
- the session's reward reaches every call of the chain (no call is abandoned);
- a background call under another system prompt or model name is a root of
  its own (a side conversation), not a corruption of the main path.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentrl.chat import decode_ids
from agentrl.policy import MockPolicy
from agentrl.proxy import ProxyConfig, RunningServer, create_app
from agentrl.proxy.harness import open_session, run_harness_episode
from agentrl.types import RolloutTree

MARK = "agentrl_42"
COMMAND = "echo agentrl_$((40+2))"  # prints MARK; the command's own text does not hold it
FINAL = f"Done: the command printed {MARK}."
SHELL_TOOLS = (("exec_command", "cmd"), ("Bash", "command"), ("run_command", "command"))
SETUP = "make test installs it (.ci/harness-setup.sh: npm, into .venv/bin)"


def script(prompt: str) -> str:
    """The mock policy: call the harness's shell tool until its result shows MARK, then answer."""
    if MARK in prompt:
        return FINAL
    for tool, arg in SHELL_TOOLS:
        if f'"name": "{tool}"' in prompt:
            call = json.dumps({"name": tool, "arguments": {arg: COMMAND}})
            return f"Running it.\n<tool_call>\n{call}\n</tool_call>"
    return "There is no tool to call."


class _Counter:
    """ASGI middleware: counts the model calls each session receives, by protocol path."""

    def __init__(self, app: Any):
        self.app, self.proxy, self.calls = app, app.proxy, []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            self.calls.append(scope["path"])
        await self.app(scope, receive, send)

    def model_calls(self, session_id: str) -> int:
        ends = ("/v1/messages", "/v1/responses", "/v1/chat/completions")
        return sum(1 for p in self.calls if p.startswith(f"/sessions/{session_id}/") and p.endswith(ends))


@pytest.fixture
def proxy(tokenizer) -> Iterator[tuple[RunningServer, _Counter]]:
    # The harnesses' own system prompts and tool lists run to ~25k tokens.
    app = _Counter(create_app(MockPolicy(tokenizer, script), ProxyConfig(max_context_tokens=131072)))
    with RunningServer(app) as server:
        yield server, app


def _cli(name: str) -> str:
    path = shutil.which(name, path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if path is None:
        pytest.skip(f"the {name} CLI is not installed: {SETUP}")
    return path


def _episode(server: RunningServer, argv: list[str], env: dict[str, str], cwd: Path) -> RolloutTree:
    async def run() -> RolloutTree:
        session = await open_session(server.url)
        return await run_harness_episode(argv, session, None, timeout=120, verifier=lambda tree: 1.0,
                                         extra_env=env, cwd=str(cwd))
    return asyncio.run(run())


def check_episode(tree: RolloutTree, calls: int, tokenizer: Any, final_text: str | None) -> list[int]:
    """The checks every harness shares (see the module docstring); the main chain's node ids."""
    assert "error" not in tree.meta, tree.meta.get("error")
    assert len(tree.nodes) == calls >= 2, (len(tree.nodes), calls)  # one node per model call (n=1)
    finals = [leaf for leaf in tree.leaves() if FINAL in leaf.action_text]
    assert len(finals) == 1, [leaf.action_text for leaf in tree.leaves()]
    chain = tree.path(finals[0].id)
    assert len(chain) == 2 and COMMAND in chain[0].action_text, [n.action_text for n in chain]
    assert MARK in decode_ids(tokenizer, chain[1].context_ids)  # the tool's result, as the model saw it
    assert MARK not in decode_ids(tokenizer, chain[0].context_ids + chain[0].action_ids)
    for node in tree.nodes.values():  # the recorded text is what the sampled tokens spell
        assert tokenizer.decode(node.action_ids, skip_special_tokens=True) == node.action_text
    if final_text is not None:  # ... and what the harness got back
        assert final_text.strip().endswith(FINAL), final_text
    for leaf in tree.leaves():  # the reward reaches every path: nothing counts as abandoned
        assert leaf.reward == 1.0 and not leaf.info.get("abandoned"), (leaf.id, leaf.info)
    for root in tree.roots:
        if root != chain[0].id:  # a background call: its own root, a side conversation
            assert tree.nodes[root].parent is None
            assert any(n.info.get("side_conversation") for n in tree.leaves() if tree.path(n.id)[0].id == root)
    return [n.id for n in chain]


def test_claude_code_runs_through_the_proxy(proxy, tokenizer, tmp_path):
    server, app = proxy
    claude = _cli("claude")
    env = {"HOME": str(tmp_path), "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
           "DISABLE_ERROR_REPORTING": "1"}
    tree = _episode(server, [claude, "-p", "Run the command, then report what it printed.", "--max-turns", "4",
                             "--allowedTools", "Bash"], env, tmp_path)
    sid = tree.meta["session_id"]
    check_episode(tree, app.model_calls(sid), tokenizer, tree.meta["harness"]["stdout_tail"])
    apis = {n.info["api"] for n in tree.nodes.values()}
    models = {n.info.get("model", "") for n in tree.nodes.values()}
    assert apis == {"messages"} and all(m.startswith("claude") for m in models), (apis, models)
    assert tree.meta["ignored"].get("thinking", 0) >= 2  # Claude Code asks for thinking on every call
    # Claude Code first makes a background call of its own (another system prompt, no tools).
    assert len(tree.roots) == 2


def test_codex_cli_runs_through_the_proxy(proxy, tokenizer, tmp_path):
    server, app = proxy
    codex = _cli("codex")
    home = tmp_path / "codex-home"
    home.mkdir()
    provider = '{name="agentrl", base_url="$OPENAI_BASE_URL", env_key="OPENAI_API_KEY", wire_api="responses"}'
    # The scripted policy only ever runs COMMAND (an echo), so Codex's own sandbox is not needed:
    # it needs user namespaces, which a CI container may not have.
    argv = [codex, "exec", "--skip-git-repo-check", "--sandbox", "danger-full-access",
            "-c", "model_provider=agentrl", "-c", "model=gpt-agentrl", "-c", f"model_providers.agentrl={provider}",
            "Run the command, then report what it printed."]
    # HOME too: Codex runs commands in the user's login shell, which read the machine's dotfiles
    # (this one's run `pyenv rehash`, which waits 60 s on a lock a killed shell can leave behind).
    tree = _episode(server, argv, {"CODEX_HOME": str(home), "HOME": str(tmp_path)}, tmp_path)
    sid = tree.meta["session_id"]
    check_episode(tree, app.model_calls(sid), tokenizer, tree.meta["harness"]["stdout_tail"])
    assert {n.info["api"] for n in tree.nodes.values()} == {"responses"}
    assert {n.info.get("model") for n in tree.nodes.values()} == {"gpt-agentrl"}


# -- the Python harnesses -----------------------------------------------------------------
def _run_command(command: str) -> str:
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30).stdout


@pytest.mark.parametrize("stream", [False, True], ids=["create", "streamed"])
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_openai_agents_sdk_runs_through_the_proxy(proxy, tokenizer, api, stream):
    agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK is a dev extra (openai-agents)")
    from openai import AsyncOpenAI

    server, app = proxy
    agents.set_tracing_disabled(True)  # its tracer would post to api.openai.com
    tool = agents.function_tool(_run_command, name_override="run_command",
                                description_override="Run a shell command; returns its output.")

    async def run() -> tuple[str, RolloutTree]:
        session = await open_session(server.url)
        client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
        model_cls = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
        agent = agents.Agent(name="runner", instructions="Use the tool, then answer.", tools=[tool],
                             model=model_cls("gpt-agentrl", client))
        if stream:
            result = agents.Runner.run_streamed(agent, "Run the command, then report what it printed.")
            async for _ in result.stream_events():
                pass
        else:
            result = await agents.Runner.run(agent, "Run the command, then report what it printed.")
        await client.close()
        async with httpx.AsyncClient(base_url=f"{server.url}/sessions/{session.session_id}") as h:
            await h.post("/reward", json={"reward": 1.0})
            tree = RolloutTree.from_dict((await h.post("/close")).json())
        return str(result.final_output), tree

    final, tree = asyncio.run(run())
    check_episode(tree, app.model_calls(tree.meta["session_id"]), tokenizer, final)
    assert {n.info["api"] for n in tree.nodes.values()} == {api}


def test_anthropic_sdk_create_then_stream_with_a_background_call(proxy, tokenizer):
    anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is a dev extra")

    server, app = proxy
    session = httpx.post(f"{server.url}/sessions").json()
    client = anthropic.Anthropic(base_url=f"{server.url}/sessions/{session['session_id']}",
                                 api_key=session["api_key"])
    tools = [{"name": "Bash", "description": "Run a shell command.",
              "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                               "required": ["command"]}}]
    system = [{"type": "text", "text": "You are a careful agent.", "cache_control": {"type": "ephemeral"}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Run the command, then report what it printed."}]
    first = client.messages.create(model="claude-main", max_tokens=256, system=system, messages=messages,
                                   tools=tools)
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.input == {"command": COMMAND}
    # A background call beside the main conversation: another system prompt and model name.
    title = client.messages.create(model="claude-small", max_tokens=16, system="Write a title.",
                                   messages=[{"role": "user", "content": "Summarize: run a command"}])
    assert title.stop_reason == "end_turn"
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": _run_command(use.input["command"])}]}]
    with client.messages.stream(model="claude-main", max_tokens=256, system=system, messages=messages,
                                tools=tools) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn" and streamed == final.content[0].text == FINAL
    httpx.post(f"{server.url}/sessions/{session['session_id']}/reward", json={"reward": 1.0})
    tree = RolloutTree.from_dict(httpx.post(f"{server.url}/sessions/{session['session_id']}/close").json())
    chain = check_episode(tree, app.model_calls(session["session_id"]), tokenizer, streamed)
    side = [n for n in tree.nodes.values() if n.id not in chain]
    assert len(side) == 1 and side[0].parent is None and side[0].info["model"] == "claude-small"
    assert side[0].info["side_conversation"]
    assert [tree.nodes[i].info["model"] for i in chain] == ["claude-main", "claude-main"]
    # The main chain reused its recorded tokens: the second call's context holds only the tool result.
    assert len(tree.nodes[chain[1]].context_ids) < 40
