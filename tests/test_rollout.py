"""The minimal runner: token-exact trees, recorded failures, truncation reasons."""

from __future__ import annotations

import json
import re

import pytest

import tests.fakes  # noqa: F401  (registers the misbehaving test envs)
from agentrl.chat import ChatContext
from agentrl.config import load_config
from agentrl.policy import HFPolicy, MockPolicy
from agentrl.rollout import episode_success, run_episodes, summarize, write_run
from agentrl.types import read_trees


def _bisect(prompt: str) -> str:
    """A scripted agent that reads the hints in its own context and bisects."""
    low, high = 1, 32
    for guess, word in re.findall(r"(\d+) is too (low|high)", prompt):
        if word == "low":
            low = max(low, int(guess) + 1)
        else:
            high = min(high, int(guess) - 1)
    return str((low + high) // 2)


def test_scripted_bisection_wins_every_episode(tokenizer):
    cfg = load_config(overrides=["rollout.episodes=4", "rollout.max_turns=8"])
    trees = run_episodes("agentrl/GuessNumber-v0", MockPolicy(tokenizer, _bisect), cfg)
    assert all(episode_success(t) for t in trees)
    summary = summarize(trees, wall_s=1.0)
    assert summary["success_rate"] == 1.0 and summary["mean_reward"] == 1.0
    assert summary["failed_episodes"] == 0
    assert 1 <= summary["mean_turns"] <= 6
    assert summary["invalid_action_frac"] is None  # GuessNumber does not report invalid actions


def test_invalid_action_frac_counts_the_turns_the_env_called_invalid(tokenizer):
    cfg = load_config(overrides=["rollout.episodes=2", "rollout.max_turns=4", "env.id=agentrl/ALFWorld-v0"])
    calls = iter(range(100))
    # Every other reply is junk ("Nothing happens."); "look" is always admissible.
    policy = MockPolicy(tokenizer, lambda prompt: "take unicorn 1 from nowhere 1" if next(calls) % 2 else "look")
    trees = run_episodes("agentrl/ALFWorld-v0", policy, cfg)
    nodes = [n for t in trees for n in t.nodes.values()]
    assert len(nodes) == 8 and sum(n.observation == "Nothing happens." for n in nodes) == 4
    assert summarize(trees, 1.0)["invalid_action_frac"] == 0.5


def test_episode_tokens_are_exactly_the_context_the_policy_saw(tokenizer):
    cfg = load_config(overrides=["rollout.episodes=2", "rollout.max_turns=3"])
    seen: list[list[int]] = []

    class Recording(MockPolicy):
        def generate(self, requests):
            seen.extend(list(r.prompt_ids) for r in requests)
            return super().generate(requests)

    trees = run_episodes("agentrl/GuessNumber-v0", Recording(tokenizer, ["7", "oops", "9"]), cfg)
    ep = next(trees[0].episodes())
    # Each prompt the policy got is a prefix of the episode's final token sequence.
    prompts = seen[0::2]
    for p, span in zip(prompts, ep.turn_spans, strict=True):
        assert ep.input_ids[:len(p)] == p and span[0] == len(p)
    # Replaying the context by hand gives the same ids.
    ctx = ChatContext(tokenizer, [{"role": "system", "content": cfg.rollout.system_prompt},
                                  {"role": "user", "content": trees[0].meta["instruction"]}])
    for node in ep.nodes[:-1]:
        ctx.append_action(node.action_ids)
        ctx.append_observation([{"role": "user", "content": node.observation}])
    ctx.append_action(ep.nodes[-1].action_ids)
    assert ctx.ids == ep.input_ids
    assert sum(ep.loss_mask) == sum(len(n.action_ids) for n in ep.nodes)
    assert ep.logprobs[ep.turn_spans[0][0]] == -0.5


def test_crashed_env_fails_only_its_episode_with_the_reason(tokenizer):
    cfg = load_config(overrides=["rollout.episodes=2", "env.id=agentrl/TestCrashing-v0",
                                 "env.kwargs={crash_on: 2}"])
    trees = run_episodes("agentrl/TestCrashing-v0", MockPolicy(tokenizer, ["hi"]), cfg)
    for t in trees:
        last = t.leaves()[0]
        assert last.error == "env.step raised RuntimeError: simulated env crash"
        assert last.truncated and len(t.nodes) == 2
    assert summarize(trees, 1.0)["failed_episodes"] == 2


def test_observation_over_budget_truncates_with_reason(tokenizer):
    cfg = load_config(overrides=["rollout.episodes=1", "rollout.max_context_tokens=400"])
    trees = run_episodes("agentrl/TestFlood-v0", MockPolicy(tokenizer, ["hi"]), cfg)
    nodes = list(trees[0].nodes.values())
    assert len(nodes) == 1 and nodes[0].truncated and not nodes[0].terminated
    assert nodes[0].info["truncation_reason"].startswith("context budget")
    assert nodes[0].error is None


def test_generation_without_eos_marks_the_turn_truncated(tokenizer, tiny_model):
    cfg = load_config(overrides=["rollout.episodes=2", "rollout.max_turns=2",
                                 "sampling.max_new_tokens=5"])
    policy = HFPolicy(tiny_model, tokenizer)
    policy.eos_ids = {-1}  # the random model never ends a turn by itself
    trees = run_episodes("agentrl/GuessNumber-v0", policy, cfg)
    for t in trees:
        nodes = list(t.nodes.values())
        assert [n.finish_reason for n in nodes] == ["length", "length"]
        assert all(len(n.action_ids) == 5 == len(n.logprobs) for n in nodes)
        assert nodes[-1].truncated and nodes[-1].info["truncation_reason"] == "max_turns=2"
    assert summarize(trees, 1.0)["truncated_turns"] == 4


def test_run_is_written_atomically_and_reads_back(tokenizer, tmp_path):
    cfg = load_config(overrides=["rollout.episodes=2"])
    trees = run_episodes("agentrl/GuessNumber-v0", MockPolicy(tokenizer, _bisect), cfg)
    out = write_run(tmp_path / "run", trees, summarize(trees, 2.0))
    assert sorted(p.name for p in out.iterdir()) == ["summary.json", "trajectories.jsonl"]
    assert json.loads((out / "summary.json").read_text())["episodes"] == 2
    assert [t.to_dict() for t in read_trees(out / "trajectories.jsonl")] == [t.to_dict() for t in trees]


def test_tool_env_turns_render_tool_messages_and_tools_in_system_prompt(tokenizer):
    cfg = load_config(overrides=["rollout.episodes=1", "rollout.max_turns=3"])
    calls = ['<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>',
             "Answer: 42"]
    trees = run_episodes("agentrl/MathPython-v0", MockPolicy(tokenizer, calls), cfg)
    ep = next(trees[0].episodes())
    text = tokenizer.decode(ep.input_ids)
    assert text.startswith("<|im_start|>system\n" + cfg.rollout.system_prompt)
    assert '"name": "calculator"' in text.split("<|im_start|>user")[0]  # tools listed up front
    assert "<|im_start|>tool\n42<|im_end|>" in text
    first = ep.nodes[0]
    assert first.info["tool_calls"][0]["name"] == "calculator" and not first.done
    assert ep.nodes[-1].terminated


def test_kept_snapshots_restore_the_env_at_that_turn(tokenizer):
    from agentrl.env import make_env
    from agentrl.types import RolloutTree

    cfg = load_config(overrides=["rollout.episodes=1", "rollout.max_turns=4",
                                 "rollout.keep_snapshots=true"])
    tree = run_episodes("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1", "2", "3", "4"]), cfg)[0]
    nodes = list(tree.nodes.values())
    assert len(nodes) == 4  # seed 0's secret is above 4: no early win
    assert [n.snapshot for n in nodes] == ["n0", "n1", "n2", None]  # the last turn ended it
    env = make_env("agentrl/GuessNumber-v0").unwrapped
    env.restore(tree.snapshots["n1"].env)  # the state after the guesses "1" and "2"
    assert env.turn == 2 and env.low_bound == 3
    obs, *_ = env.step("3")
    assert obs == nodes[2].observation  # it continues as the original did
    back = RolloutTree.from_json(tree.to_json())  # handles serialize, live states do not
    assert back.to_dict() == tree.to_dict() and back.snapshots == {}


def test_same_config_samples_the_same_rollouts(tokenizer, tiny_model):
    cfg = load_config(overrides=["rollout.episodes=3", "rollout.max_turns=2",
                                 "sampling.max_new_tokens=4", "rollout.seed=5"])
    first = run_episodes("agentrl/GuessNumber-v0", HFPolicy(tiny_model, tokenizer), cfg)
    again = run_episodes("agentrl/GuessNumber-v0", HFPolicy(tiny_model, tokenizer), cfg)
    assert [t.to_dict() for t in first] == [t.to_dict() for t in again]
    cfg.rollout.seed = 6
    other = run_episodes("agentrl/GuessNumber-v0", HFPolicy(tiny_model, tokenizer), cfg)
    # Compare the sampled tokens only: the trees' metadata (env seeds) always differs.
    assert _actions(other) != _actions(first)


def _actions(trees):
    return [[n.action_ids for n in t.nodes.values()] for t in trees]


def test_episodes_of_one_turn_sample_independently(tokenizer, tiny_model):
    # 32 episodes of one prompt: with one seed per turn, episode i and i+16 drew the same action.
    cfg = load_config(overrides=["rollout.episodes=32", "rollout.max_turns=1",
                                 "sampling.max_new_tokens=4"])
    trees = run_episodes("agentrl/GuessNumber-v0", HFPolicy(tiny_model, tokenizer, max_batch_size=16), cfg)
    firsts = [tuple(t.nodes[0].action_ids) for t in trees]
    assert len(set(firsts)) == 32


def test_a_failed_generation_fails_its_episodes_and_envs_are_closed(tokenizer, monkeypatch):
    closed = []
    from agentrl.envs.guess_number import GuessNumberEnv
    monkeypatch.setattr(GuessNumberEnv, "close", lambda self: closed.append(self))

    class Broken(MockPolicy):
        def generate(self, requests):
            raise RuntimeError("backend died")

    cfg = load_config(overrides=["rollout.episodes=3"])
    trees = run_episodes("agentrl/GuessNumber-v0", Broken(tokenizer, ["1"]), cfg)
    errors = [ep.error for t in trees for ep in t.episodes()]
    assert errors == ["generation failed: RuntimeError: backend died"] * 3
    assert summarize(trees, 1.0)["failure_reasons"] == {"generation failed": 3}
    assert len(closed) == 3

    def close_or_raise(self):  # the first close fails: the others still run, with a warning
        closed.append(self)
        if len(closed) == 4:
            raise OSError("sandbox gone")

    monkeypatch.setattr(GuessNumberEnv, "close", close_or_raise)
    with pytest.warns(RuntimeWarning, match="sandbox gone"):
        run_episodes("agentrl/GuessNumber-v0", Broken(tokenizer, ["1"]), cfg)
    assert len(closed) == 6


def test_context_filled_exactly_is_a_truncation_not_a_failure(tokenizer):
    cfg = load_config(overrides=["rollout.episodes=1", "rollout.max_turns=50"])
    probe = run_episodes("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1"]), cfg)[0]
    nodes = list(probe.nodes.values())
    assert len(nodes) >= 2
    # A budget that the context reaches exactly after the first observation.
    filled = len(nodes[0].context_ids) + len(nodes[0].action_ids) + len(nodes[1].context_ids)
    cfg.rollout.max_context_tokens = filled
    tree = run_episodes("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1"]), cfg)[0]
    last = list(tree.nodes.values())[-1]
    assert len(tree.nodes) == 1 and "error" not in tree.meta
    assert last.truncated and last.done and last.error is None
    assert last.info["truncation_reason"] == f"context budget: {filled} of {filled} tokens used"
    assert summarize([tree], 1.0)["failed_episodes"] == 0


def test_stop_strings_end_the_action_alike_in_hf_and_mock(tokenizer, tiny_model):
    # The env sees the text up to and including the stop string; the tokens stay as sampled.
    cfg = load_config(overrides=["rollout.episodes=1", "rollout.max_turns=1", "sampling.max_new_tokens=12"])
    free = run_episodes("agentrl/GuessNumber-v0", HFPolicy(tiny_model, tokenizer), cfg)[0].nodes[0]
    text = tokenizer.decode(free.action_ids, skip_special_tokens=True)
    stop = tokenizer.decode(free.action_ids[4:5]).strip()[:3]
    assert stop and stop not in tokenizer.decode(free.action_ids[:4]), "pick another seed"
    cfg.sampling.stop = [stop]
    hf = run_episodes("agentrl/GuessNumber-v0", HFPolicy(tiny_model, tokenizer), cfg)[0].nodes[0]
    mock = run_episodes("agentrl/GuessNumber-v0", MockPolicy(tokenizer, [text]), cfg)[0].nodes[0]
    want = text[:text.index(stop) + len(stop)].strip()
    assert hf.action_ids == free.action_ids[:5]  # tokens as sampled, the stop's token included
    for node in (hf, mock):
        assert node.finish_reason == "stop_string"
        assert node.action_text == want


def test_counters_add_up_to_the_context(tokenizer, tiny_model):
    # timing-based batching: the two openings' common prefix is shared (deterministic mode shares none)
    cfg = load_config(overrides=["rollout.episodes=2", "rollout.max_turns=3", "sampling.max_new_tokens=4",
                                 "rollout.deterministic=false"])
    policy = HFPolicy(tiny_model, tokenizer)
    policy.eos_ids = {-1}
    trees = run_episodes("agentrl/GuessNumber-v0", policy, cfg)
    deltas = 0
    for t in trees:
        c = t.meta["counters"]
        nodes = list(t.nodes.values())
        assert c["env_steps"] == len(nodes) == 3
        assert c["generated_tokens"] == sum(len(n.action_ids) for n in nodes)
        # Each turn prefills what is new since the cached prefix: the context tokens
        # plus the previous action's last token, which was sampled but never fed back.
        deltas += sum(len(n.context_ids) for n in nodes) + len(nodes) - 1
        assert c["reused_tokens"] > 0
    # ... except the opening both episodes share, prefilled once in turn 1's batch (short of its
    # last token, which each row runs for its own logits).
    a, b = (t.nodes[t.roots[0]].context_ids for t in trees)
    shared = min(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a)),
                 len(a) - 1, len(b) - 1)
    assert shared > 10
    assert sum(t.meta["counters"]["prefilled_tokens"] for t in trees) == deltas - shared
    summary = summarize(trees, 1.0)
    assert summary["prefilled_tokens"] == sum(t.meta["counters"]["prefilled_tokens"] for t in trees)
