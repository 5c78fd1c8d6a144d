"""One tree as the page's data: advantages (saved or recomputed), branch reasons, tokens, safe JSON."""

from __future__ import annotations

import json
import math

import pytest

from agentrl.types import Node, RolloutTree
from agentrl.viewer import CreditSpec, Run, branch_reasons, render_page, tree_data, tree_payload
from agentrl.viewer.curves import curve_panels, series
from agentrl.viewer.page import to_json

from .conftest import fork_tree


def _node(p: dict, nid: int) -> dict:
    return next(n for n in p["nodes"] if n["id"] == nid)


def test_grpo_advantages_are_recomputed_per_episode_and_the_failure_left_out():
    # outcomes of the kept episodes: 1 (win) and 0 (truncated); mean 0.5, sample std 0.7071
    # (grpo adds a small epsilon to the std, hence the tolerance)
    p = tree_payload(fork_tree(), CreditSpec("grpo"))
    a = pytest.approx(0.5 / math.sqrt(0.5), rel=1e-5)
    assert _node(p, 1)["advantage"] == a
    assert -_node(p, 2)["advantage"] == a
    assert _node(p, 3)["advantage"] is None  # failed: no advantage, and the page says why
    first = _node(p, 0)
    assert first["advantages"]["1"] == a and -first["advantages"]["2"] == a
    assert first["advantage"] == pytest.approx(0.0)
    assert p["tokens"]["0"]["advantages"]["1"] == [a, a]
    assert "grpo" in p["credit"]["method"] and not p["credit"]["saved"]


def test_a_run_recorded_in_either_credit_form_recomputes_the_same_advantages():
    from agentrl.train.config import load_train_config
    from agentrl.viewer.payload import credit_spec, episode_values

    new = load_train_config(None, ["train.credit={name: tree, leaf_norm: none}"]).model_dump(mode="json")
    old = {"train": {"credit": "tree", "credit_options": {"leaf_norm": "none"}}}  # recorded before the change
    spec_new, spec_old = credit_spec(new), credit_spec(old)
    assert spec_new.method == spec_old.method == "tree" and spec_new.options["leaf_norm"] == "none"
    got_new, note = episode_values(fork_tree(), spec_new)
    assert got_new == episode_values(fork_tree(), spec_old)[0] and "recomputed with train.credit=tree" in note
    # leaf 1 (outcome 1) over the root and its parent (both 0.5): 0.5 + 0.5, leaf_norm none
    assert got_new["advantages"][1][1] == [pytest.approx(1.0)]


def test_saved_training_values_win_and_give_the_log_ratio():
    t = fork_tree()
    t.meta["token_values"] = {"1": {"advantages": [0.5, 0.5, 2.0], "teacher_logprobs": [-0.1, -0.3, -0.4],
                                    "student_logprobs": [-0.1, -0.2, -1.0]}}
    p = tree_payload(t, CreditSpec("grpo"))
    assert p["credit"]["saved"] and p["has_teacher"]
    assert p["tokens"]["0"]["advantages"] == {"1": [0.5, 0.5]}
    assert p["tokens"]["1"]["advantages"] == {"1": [2.0]}
    assert p["tokens"]["1"]["teacher"] == {"1": [-0.4]} and p["tokens"]["1"]["student"] == {"1": [-1.0]}
    assert "token_values" not in p["meta"]


def test_tool_calls_results_truncation_and_failure_reach_the_page():
    p = tree_payload(fork_tree())
    win, cut, dead = _node(p, 1), _node(p, 2), _node(p, 3)
    assert win["tool_calls"] == [{"name": "open", "arguments": {"what": "box"}}]
    assert win["tool_results"] == [{"name": "open", "content": "the box holds gold"}]
    assert win["success"] and win["leaf"]
    assert cut["truncated"] and cut["truncation_reason"] == "max_turns=2"
    assert dead["error"].startswith("sandbox died")
    assert {e["leaf"]: e["reason"] for e in p["episodes"]} == {
        1: None, 2: "max_turns=2", 3: "sandbox died: killed by signal 9"}


def test_entropy_branch_reason_is_the_allocators_own_score():
    # every continuation's first tokens have entropy 2.0 (1.9 for one) against 0.1 in the first turn
    reasons = branch_reasons(fork_tree(allocator="entropy_branch"))
    assert reasons["0"].startswith("entropy rise +1.90 nats")


def test_key_state_segment_fork_and_proxy_reasons():
    t = fork_tree(allocator="key_state")
    t.nodes[1].top1 = [0.2]
    assert "mean top-1 probability 0.20" in branch_reasons(t, {"top1_threshold": 0.5})["0"]
    t = fork_tree(allocator="segment_tree")
    assert "segment tree" in branch_reasons(t)["0"]
    t.nodes[1].info["branch"] = {"reason": "retry"}
    t.nodes[2].info["branch"] = {"reason": "edit"}
    assert branch_reasons(t)["0"] == "harness proxy: retry, edit"
    t.meta["branch_reasons"] = {"0": "recorded by the engine"}
    assert branch_reasons(t)["0"] == "recorded by the engine"


def test_rerendered_continued_and_side_paths_reach_the_page():
    t = RolloutTree(meta={"allocator": "independent"})
    side = t.add(Node(action_ids=[1], logprobs=[-1.0], entropies=[0.5], reward=1.0,
                      info={"side_conversation": True}))
    first = t.add(Node(action_ids=[2], logprobs=[-1.0], entropies=[0.5], reward=1.0,
                       info={"continued_by": "chatcmpl-2"}))
    t.add(Node(action_ids=[3], logprobs=[-1.0], entropies=[0.5], reward=1.0, terminated=True,
               info={"branch": {"reason": "rerendered", "by": "ids"}}))
    nodes = {n["id"]: n for n in tree_payload(t)["nodes"]}
    assert nodes[side.id]["side_conversation"] and not nodes[first.id]["side_conversation"]
    assert nodes[first.id]["continued_by"] == "chatcmpl-2" and nodes[side.id]["continued_by"] is None
    assert "harness proxy: rerendered" in branch_reasons(t)["prompt"]


def test_several_roots_make_the_prompt_a_branch_point():
    t = RolloutTree(meta={"allocator": "independent"})
    for _ in range(3):
        t.add(Node(action_ids=[1], logprobs=[-1.0], entropies=[0.5], terminated=True))
    assert branch_reasons(t) == {"prompt": "3 episodes started from the prompt (independent)"}


def test_tokens_are_decoded_once_per_id():
    calls = []

    def decode(ids):
        calls.append(list(ids))
        return {i: f"<{i}>" for i in ids}

    p = tree_payload(fork_tree(), decode=decode)
    assert len(calls) == 1 and p["vocab"]["10"] == "<10>" and set(p["vocab"]) == {
        str(i) for i in (1, 2, 3, 4, 10, 11, 12, 13, 14)}


def test_model_text_cannot_close_the_script_element():
    t = fork_tree()
    t.nodes[1].action_text = "</script><script>alert(1)</script>"
    page = render_page({"title": "x", "trees": []}, {0: tree_payload(t)})
    assert "</script><script>alert" not in page
    body = to_json({"a": "</script>", "b": float("nan")})
    assert json.loads(body) == {"a": "</script>", "b": None}


def test_recorded_run_gives_saved_advantages_and_segment_tree_reasons(branched_run):
    run = Run(branched_run)
    p = tree_data(run, 0, None)
    assert p["credit"]["saved"] and p["has_teacher"]
    assert all("segment tree" in r for k, r in p["branch_points"].items() if k != "prompt")
    assert p["branch_points"]["prompt"].startswith("2 episodes started from the prompt")
    assert all(n["advantage"] is not None for n in p["nodes"])


def test_curves_take_eval_points_derived_rates_and_say_what_is_missing():
    rows = [{"step": 0, "phase": "start", "eval/success": 0.25},
            {"step": 1, "rollout/success": 0.5, "rollout/generated_tokens": 100, "time/rollout_s": 4.0,
             "ppo/clip_frac_low": 0.1, "ppo/clip_frac_high": 0.05, "loss/pg": float("nan")},
            {"step": 2, "rollout/success": 0.75, "eval/success": 0.5}]
    panels = {p["title"]: p for p in curve_panels(rows)}
    success = {s["key"]: s for s in panels["success"]["series"]}
    assert success["eval/success"]["eval"] and success["eval/success"]["points"] == [[0, 0.25], [2, 0.5]]
    assert success["rollout/success"]["points"] == [[1, 0.5], [2, 0.75]]
    assert series(rows, "rollout/tokens_per_s") == [(1, 25.0)]
    assert [s["key"] for s in panels["clip fraction"]["series"]] == ["ppo/clip_frac"]
    assert panels["staleness"]["series"] == [] and "staleness" in panels["staleness"]["missing"]
    rows.append({"step": 3, "async/staleness_mean": 1.5})
    assert [s["key"] for s in {p["title"]: p for p in curve_panels(rows)}["staleness"]["series"]] == [
        "async/staleness_mean"]


def test_saved_values_mark_episodes_the_update_left_out_and_tokens_it_masked():
    t = fork_tree()
    t.meta["token_values"] = {  # leaf 1: its second token masked out (TIP); leaves 2 and 3 left out
        "1": {"advantages": [0.5, None, 2.0], "teacher_logprobs": [-0.1, None, -0.4],
              "student_logprobs": [-0.2, None, -1.0]},
        "2": {"trained": False, "reason": "MC-GRPO's pivot: the group's median episode carries no gradient"},
        "3": {"trained": False, "reason": "failed episode, left out (rollout.failed_episodes=exclude)"}}
    p = tree_payload(t, CreditSpec("grpo"))
    assert p["credit"]["saved"] and p["credit"]["note"] == "saved: the values the update used"
    assert p["tokens"]["0"]["advantages"] == {"1": [0.5, None]}
    assert _node(p, 0)["advantage"] == 0.5  # the masked token is not in the mean
    assert _node(p, 2)["advantage"] is None and _node(p, 2)["advantages"] == {}
    by_leaf = {e["leaf"]: e for e in p["episodes"]}
    assert by_leaf[1]["trained"] is True and by_leaf[1]["untrained_reason"] is None
    assert by_leaf[2]["trained"] is False and "pivot" in by_leaf[2]["untrained_reason"]
    assert p["has_teacher"] and p["teacher_note"].startswith("saved")
    assert json.loads(to_json(p))["tokens"]["0"]["teacher"] == {"1": [-0.1, None]}
    # Saved values without a teacher's: the page says none was saved, not "not recorded".
    t.meta["token_values"] = {"1": {"advantages": [0.5, 0.5, 2.0]}}
    p = tree_payload(t, CreditSpec("grpo"))
    assert not p["has_teacher"] and p["teacher_note"].startswith("none saved")
    assert tree_payload(fork_tree())["teacher_note"].startswith("not saved")
    assert all(e["trained"] is None for e in tree_payload(fork_tree())["episodes"])  # not known
