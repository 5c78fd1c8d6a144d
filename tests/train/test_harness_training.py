"""agentrl train --harness: the example ReAct agent, unmodified, trains the tiny hf model on GuessNumber."""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

import agentrl.credit
import agentrl.train.step as step_module
from agentrl.credit import assign_report
from agentrl.policy import HFPolicy
from agentrl.proxy import harness_rollouts
from agentrl.proxy.rollouts import merge_sessions
from agentrl.train.cli import register
from agentrl.types import Node, RolloutTree

pytest.importorskip("openai", reason="the example harness uses the openai client")

AGENT = Path(__file__).resolve().parents[2] / "examples" / "harness" / "react_agent.py"


# --------------------------------------------------------------------------- merging sessions


def _session(sid: str, rewards: list[float], error: str | None = None) -> RolloutTree:
    """A linear session tree: one node per call, the last one rewarded."""
    tree = RolloutTree(meta={"session_id": sid, **({"error": error} if error else {})})
    parent = None
    for k, r in enumerate(rewards):
        node = Node(context_ids=[1, 2] if k == 0 else [3], action_ids=[10 + k, 20 + k],
                    logprobs=[-0.5, -0.25], reward=r, terminated=k == len(rewards) - 1 and r > 0)
        parent = tree.add(node, parent).id
    return tree


def test_merged_sessions_are_one_group_and_failed_sessions_stay_out_of_credit():
    won, lost = _session("a", [0.0, 1.0]), _session("b", [0.0])
    crashed_late = _session("c", [1.0], error="harness exited with code 4: boom")
    crashed_early = RolloutTree(meta={"session_id": "d", "error": "harness exited with code 3: "})
    tree = merge_sessions([won, lost, crashed_late, crashed_early], {"task": 7})

    assert tree.meta["task"] == 7 and [s["session_id"] for s in tree.meta["sessions"]] == list("abcd")
    assert len(tree.roots) == 4 and len(tree.nodes) == 5
    assert [n.info["session_id"] for n in tree.nodes.values()] == ["a", "a", "b", "c", "d"]
    assert tree.nodes[1].parent == 0 and tree.nodes[0].children == [1]
    assert won.nodes[0].children == [1] and "session_id" not in won.nodes[0].info  # inputs untouched
    assert tree.nodes[3].error == "harness exited with code 4: boom" and tree.nodes[3].terminated
    assert tree.nodes[4].error.startswith("harness exited with code 3") and not tree.nodes[4].action_ids

    report = assign_report([tree], "grpo")
    # GRPO over the two kept episodes, rewards 1 and 0: mean 0.5, sample std 1/sqrt(2).
    adv = {ep.nodes[0].info["session_id"]: a for ep, a in report.items}
    assert sorted(adv) == ["a", "b"]
    assert adv["a"] == pytest.approx([0, 0, 0.70710, 0.70710, 0, 0.70710, 0.70710], abs=1e-4)
    assert adv["b"] == pytest.approx([0, 0, -0.70710, -0.70710], abs=1e-4)
    assert sorted(err for _, _, err in report.failed) == [
        "harness exited with code 3: ", "harness exited with code 4: boom"]


def test_a_reward_that_cannot_be_read_fails_the_episode_instead_of_scoring_zero(tokenizer):
    from agentrl.policy import MockPolicy
    from agentrl.proxy import RunningServer, create_app
    from agentrl.proxy.envserver import EnvServerConfig, create_env_app
    from agentrl.proxy.harness import EnvServer, open_session, run_harness_episode

    # The env is closed under the runner (with the server's token: the harness's own key may not
    # close it), so the runner finds no env to read the reward from.
    closes_env = ("import httpx, os; e = os.environ; httpx.post(f\"{e['AGENTRL_ENV_URL']}/envs/"
                  "{e['AGENTRL_ENV_INSTANCE']}/close\", headers={'Authorization': "
                  "'Bearer t'}).raise_for_status()")
    with RunningServer(create_app(MockPolicy(tokenizer, ["1"]))) as proxy, \
            RunningServer(create_env_app(EnvServerConfig(token="t"))) as envs:
        async def run():
            session = await open_session(proxy.url)
            return await run_harness_episode([sys.executable, "-c", closes_env], session,
                                             EnvServer(envs.url, "t", "agentrl/GuessNumber-v0", 0),
                                             timeout=60)

        tree = asyncio.run(run())
    assert tree.meta["harness"]["returncode"] == 0
    assert tree.meta["error"].startswith("the env's reward could not be read")


# --------------------------------------------------------------------------- end to end


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    """Half-open runs of 1s in a loss mask: the action tokens of each turn."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_cli_train_harness_trains_on_exactly_what_the_proxy_sampled(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    calls: list[dict] = []  # every generation the policy ran, as the proxy asked for it
    trained: list[dict] = []
    groups: list[list[RolloutTree]] = []

    generate = HFPolicy.agenerate

    async def record_generation(self, request):
        result = await generate(self, request)
        calls.append({"prompt": list(request.prompt_ids), "tokens": list(result.token_ids),
                      "logprobs": list(result.logprobs), "version": result.version,
                      "temperature": request.params.temperature,
                      "max_new": request.params.max_new_tokens})
        return result

    train_on_samples = step_module.train_on_samples

    def record_update(model, optimizer, scheduler, samples, *args, **kwargs):
        before = [p.detach().clone() for p in model.parameters()]
        out = train_on_samples(model, optimizer, scheduler, samples, *args, **kwargs)
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        trained.append({"samples": list(samples), "changed": changed})
        return out

    credit = agentrl.credit.assign

    def record_credit(trees, *args, **kwargs):
        groups.append([g.tree for g in trees])  # the step hands credit each tree's episodes
        return credit(trees, *args, **kwargs)

    monkeypatch.setattr(HFPolicy, "agenerate", record_generation)
    monkeypatch.setattr(step_module, "train_on_samples", record_update)
    monkeypatch.setattr(agentrl.credit, "assign", record_credit)

    # Episodes 0 and 1 play normally; 2 crashes before any model call; 3 plays, then
    # its command exits 4 (a crash after its calls were recorded).
    py, agent = shlex.quote(sys.executable), shlex.quote(str(AGENT))
    harness = (f"sh -c 'case $AGENTRL_EPISODE in 2) exit 3;; 3) \"$0\" \"$1\"; exit 4;; esac; "
               f"exec \"$0\" \"$1\"' {py} {agent}")
    out = tmp_path / "run"
    sets = ["policy.model=tiny-random", "policy.backend=hf", "env.kwargs={high: 4, max_turns: 2}",
            "rollout.group_size=4", "rollout.max_context_tokens=512", "train.tasks_per_step=1",
            "train.micro_batch_tokens=1024", "train.evaluation.task_seeds=[99]", "train.optimizer.lr=1e-3",
            "train.evaluation.temperature=null",  # held-out calls sample as training does: one check for all
            "train.loss.entropy_coef=0.01",  # a gradient even if all rewards are equal
            "sampling.temperature=0.7", "sampling.max_new_tokens=6",
            "train.output.tensorboard=false", "train.checkpointing.export_hf=false", "train.output.plot=false",
            "train.harness_env.REACT_MAX_TURNS=2"]
    app = typer.Typer()  # as the agentrl command composes it: the proxy hands in the harness rollouts
    register(app, harness_rollouts=harness_rollouts)
    result = CliRunner().invoke(app, [
        "train", "--harness", harness, "--env", "agentrl/GuessNumber-v0", "--steps", "1",
        "--out", str(out), "--no-progress", *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 0, (result.output, result.exception)

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    [step] = [r for r in rows if r["phase"] == "rl"]
    assert step["policy/version"] == 1
    assert step["rollout/episodes"] == 4 and step["rollout/failed"] == 2
    assert step["rollout/harness_repinned"] > 0  # the agent asks temperature 1.0 and 128 tokens
    assert step["mismatch/max_abs_dlogprob"] < 1e-3  # sampled and scored at the same temperature
    assert all(r["eval/failed"] == 0 for r in rows if "eval/failed" in r)

    # The failures are recorded on their episodes, with the reasons, and left out.
    [[tree]] = groups
    errors = {s["episode"]: s.get("error") for s in tree.meta["sessions"]}
    assert errors[0] is None and errors[1] is None
    assert errors[2].startswith("harness exited with code 3")
    assert errors[3].startswith("harness exited with code 4")
    late = [n for n in tree.nodes.values() if n.info["session_id"] == tree.meta["sessions"][3]["session_id"]]
    assert late and late[-1].error == errors[3] and late[0].action_ids  # its calls were recorded

    # What trained is exactly what the proxy sampled: every turn's prefix is a prompt
    # the policy was given, and the turn's tokens and behaviour logprobs its sample.
    [update] = trained
    assert update["changed"]
    samples = update["samples"]
    assert len(samples) == 2
    sampled = {}
    for c in calls:
        sampled.setdefault(tuple(c["prompt"]), []).append((c["tokens"], c["logprobs"]))
        assert c["temperature"] == 0.7 and c["max_new"] <= 6
    for s in samples:
        spans = _spans(s.mask)
        assert spans and spans[-1][1] == len(s.input_ids)
        for start, end in spans:
            got = (s.input_ids[start:end], s.behaviour[start:end])
            assert got in sampled[tuple(s.input_ids[:start])]
    # The held-out episode after the update sampled with the new weights.
    assert calls[0]["version"] == 0 and calls[-1]["version"] == 1


# --------------------------------------------------------------------------- what a harness run tells


def test_merged_sessions_count_generated_tokens_and_env_steps():
    won, lost = _session("a", [0.0, 1.0]), _session("b", [0.0])
    won.meta["env"], lost.meta["env"] = {"steps": 2}, {"steps": 1}
    tree = merge_sessions([won, lost], {"task": 7})
    assert tree.meta["counters"] == {"generated_tokens": 6, "env_steps": 3}


def test_harness_python_is_this_interpreter():
    from agentrl.proxy.harness import harness_argv

    assert harness_argv("python agent.py --x 1") == [sys.executable, "agent.py", "--x", "1"]
    assert harness_argv(["python3", "-c", "pass"])[0] == sys.executable
    assert harness_argv("sh -c 'python x'")[0] == "sh"


def test_a_step_whose_every_harness_episode_fails_stops_the_run_with_its_stderr(tokenizer):
    from agentrl.config import load_config
    from agentrl.errors import ConfigError
    from agentrl.policy import MockPolicy
    from agentrl.proxy.rollouts import HarnessRollouts

    cfg = load_config(None, ["rollout.group_size=2"])
    fails = "python -c \"import sys; sys.stderr.write('ran by ' + sys.executable); sys.exit(3)\""
    source = HarnessRollouts(fails, MockPolicy(tokenizer, ["1"]), cfg)
    try:
        with pytest.raises(ConfigError, match="every harness episode of this step failed") as e:
            source.collect(cfg.env.id, source.policy, cfg, [0])
    finally:
        source.close()
    assert f"ran by {sys.executable}" in str(e.value)  # python was this interpreter, and its stderr is shown


def test_a_crashing_verifier_records_its_traceback_as_the_failure_reason(tokenizer):
    from agentrl.config import load_config
    from agentrl.policy import MockPolicy
    from agentrl.proxy.rollouts import HarnessRollouts

    def verifier(tree):
        if tree.meta["episode"] == 1:
            raise KeyError("answer")
        return 1.0

    one_call = ("import httpx, os; e = os.environ; httpx.post(e['OPENAI_BASE_URL'] + '/chat/completions', "
                "headers={'Authorization': 'Bearer ' + e['OPENAI_API_KEY']}, json={'model': 'm', "
                "'messages': [{'role': 'user', 'content': 'hi'}]}, timeout=60).raise_for_status()")
    cfg = load_config(None, ["rollout.group_size=2"])
    source = HarnessRollouts(f"python -c {shlex.quote(one_call)}", MockPolicy(tokenizer, ["1"]), cfg,
                             verifier=verifier)
    try:
        [tree] = source.collect(cfg.env.id, source.policy, cfg, [0])
    finally:
        source.close()
    assert "error" not in tree.meta["sessions"][0]
    error = tree.meta["sessions"][1]["error"]
    assert error.startswith("verifier failed: KeyError") and "Traceback" in error and "in verifier" in error
    assert tree.meta["counters"]["generated_tokens"] > 0
