"""Rollout trees: structure, episode views, and lossless JSONL round trips."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.types import (
    Episode,
    Message,
    Node,
    RolloutTree,
    ToolCall,
    ToolSpec,
    read_trees,
    write_trees,
)


def _branching_tree() -> RolloutTree:
    t = RolloutTree(meta={"env": "agentrl/GuessNumber-v0", "seed": 3})
    a = t.add(Node(context_ids=[1, 2, 3], action_ids=[10, 11], logprobs=[-0.1, -0.2], version=1))
    b = t.add(Node(context_ids=[4], action_ids=[12], logprobs=[-0.3], reward=1.0, terminated=True), a.id)
    c = t.add(Node(context_ids=[5, 6], action_ids=[13, 14, 15], logprobs=[-1, -2, -3.5]), a.id)
    return t, a, b, c


def test_episode_view_concatenates_context_and_actions():
    t, a, b, c = _branching_tree()
    eps = list(t.episodes())
    assert len(eps) == 2
    ep = eps[0]
    assert [n.id for n in ep.nodes] == [a.id, b.id]
    assert ep.input_ids == [1, 2, 3, 10, 11, 4, 12]
    assert ep.loss_mask == [0, 0, 0, 1, 1, 0, 1]
    assert ep.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, -0.3]
    assert ep.versions == [-1, -1, -1, 1, 1, -1, 0]
    assert ep.turn_spans == [(3, 5), (6, 7)]
    assert ep.total_reward == 1.0
    assert eps[1].input_ids == [1, 2, 3, 10, 11, 5, 6, 13, 14, 15]
    assert t.nodes[a.id].children == [b.id, c.id]
    assert t.path(c.id)[0] is a


def test_tree_round_trips_through_jsonl(tmp_path):
    t, *_ = _branching_tree()
    t.nodes[0].info = {"won": False, "nested": {"x": [1, 2]}}
    t.nodes[1].error = "env.step raised RuntimeError: boom"
    path = tmp_path / "trees.jsonl"
    assert write_trees(path, [t, t]) == 2
    back = read_trees(path)
    assert len(back) == 2
    assert back[0].to_dict() == t.to_dict()
    assert [e.input_ids for e in back[0].episodes()] == [e.input_ids for e in t.episodes()]


def test_a_lone_surrogate_is_written_escaped_and_read_back(tmp_path):
    t, *_ = _branching_tree()
    t.nodes[0].info = {"text": "caf\u00e9 \ud800"}
    path = tmp_path / "trees.jsonl"
    assert write_trees(path, [t]) == 1
    raw = path.read_bytes()
    raw.decode("utf-8")  # strict UTF-8: a surrogate written raw would not decode
    assert b"\\ud800" in raw
    assert read_trees(path)[0].nodes[0].info == {"text": "caf\u00e9 \ud800"}
    plain, *_ = _branching_tree()
    plain.nodes[0].info = {"text": "caf\u00e9"}
    assert "caf\u00e9" in plain.to_json()  # text without surrogates stays unescaped


def _nested(depth: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(depth):
        value = {"a": value}
    return value


def test_deeply_nested_info_is_written_and_what_json_cannot_nest_is_named(tmp_path):
    """Tool-call arguments (in ``info``) nested 900 deep are valid JSON, which the parser reads
    back; writing them hit RecursionError at about 500 (``asdict`` copied two frames a level)
    and lost the whole file. Past what ``json`` itself can nest, that node's info is replaced
    by a note saying why, and the rest of the tree is kept."""
    t, *_ = _branching_tree()
    t.nodes[1].info = {"args": _nested(900)}
    path = tmp_path / "trees.jsonl"
    assert write_trees(path, [t]) == 1
    assert read_trees(path)[0].nodes[1].info == {"args": _nested(900)}
    t.nodes[2].info = {"args": _nested(5000)}
    assert write_trees(path, [t]) == 1
    back = read_trees(path)[0]
    assert back.nodes[1].info == {"args": _nested(900)}
    assert "too deeply nested" in back.nodes[2].info["error"]
    assert back.nodes[2].action_ids == [13, 14, 15] and back.nodes[2].logprobs == [-1, -2, -3.5]


def test_a_meta_value_nested_past_what_json_writes_is_named_and_the_tree_kept(tmp_path):
    """A hand-built tree (a proxy session's, a user's) may carry a ``meta`` value nested past
    what ``json`` writes: that value is replaced by a note, the other keys and the nodes kept."""
    t, *_ = _branching_tree()
    t.meta = {"env": "e", "seed": 3, "task_spec": _nested(5000)}
    path = tmp_path / "trees.jsonl"
    assert write_trees(path, [t]) == 1
    back = read_trees(path)[0]
    assert back.meta["env"] == "e" and back.meta["seed"] == 3
    assert "too deeply nested" in back.meta["task_spec"]
    assert back.nodes[2].action_ids == [13, 14, 15]


def test_unknown_node_field_is_rejected():
    with pytest.raises(ValueError, match="unknown Node fields"):
        Node.from_dict({"id": 0, "bogus": 1})


node_st = st.builds(
    Node,
    context_ids=st.lists(st.integers(0, 50_000), max_size=5),
    action_ids=st.lists(st.integers(0, 50_000), max_size=5),
    logprobs=st.lists(st.floats(-50, 0, allow_nan=False), max_size=5),
    reward=st.floats(-10, 10, allow_nan=False),
    terminated=st.booleans(),
    action_text=st.text(max_size=20),
    observation=st.text(max_size=20),
    info=st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3),
)


@settings(deadline=None, max_examples=60)
@given(st.lists(st.tuples(node_st, st.integers(0, 100)), min_size=1, max_size=12))
def test_random_trees_round_trip_losslessly(items):
    t = RolloutTree(meta={"k": "v"})
    for node, parent_pick in items:
        parent = None if not t.nodes else parent_pick % (len(t.nodes) + 1)
        t.add(node, parent if parent is not None and parent < len(t.nodes) else None)
    back = RolloutTree.from_json(t.to_json())
    assert back.to_dict() == t.to_dict()
    assert sum(1 for _ in back.episodes()) == len(t.leaves())


def test_message_and_tool_schemas_render_for_templates():
    call = ToolCall(id="c1", name="python", arguments={"code": "1+1"})
    msg = Message(role="assistant", content="", tool_calls=[call])
    d = msg.to_template()
    assert d["tool_calls"][0]["function"] == {"name": "python", "arguments": {"code": "1+1"}}
    spec = ToolSpec(name="python", description="Run code")
    assert spec.to_openai()["function"]["name"] == "python"
    with pytest.raises(ValueError):
        Message(role="robot", content="x")


def test_episode_from_empty_path_is_empty():
    ep = Episode.from_path([])
    assert ep.input_ids == [] and ep.turn_spans == [] and ep.total_reward == 0


def _forked_tree() -> RolloutTree:
    """Turn 0 (node 0), then turn 1 (actions 2, 3, 4) split by two nested segment forks.

    0 ── 3 (partial: 2) ── 4 (partial: 3) ── 1 (4) ── 2
                       └── 5                      └── 6
    """
    from agentrl.rollout.tree import split_node

    t = RolloutTree()
    a = t.add(Node(action_ids=[1]))
    b = t.add(Node(action_ids=[2, 3, 4]), a.id)
    t.add(Node(action_ids=[5], terminated=True), b.id)
    outer = split_node(t, b.id, 1)
    split_node(t, b.id, 1)
    t.add(Node(action_ids=[6], terminated=True), outer.id)
    t.add(Node(action_ids=[7]), b.id)
    return t


def test_turn_nodes_walk_up_through_the_partial_nodes_of_a_turn():
    t = _forked_tree()
    assert [n.id for n in t.turn_nodes(1)] == [3, 4, 1]  # turn 1's action is 2, 3, 4
    assert [n.id for n in t.turn_nodes(5)] == [3, 5]
    assert [n.id for n in t.turn_nodes(2)] == [2]
    assert [n.id for n in t.turn_nodes(0)] == [0]
    assert [t.turn_parent(i) for i in (0, 1, 2, 3, 4, 5)] == [None, 0, 1, 0, 0, 0]
    assert [[n.id for n in e.nodes] for e in t.episodes()] == [[0, 1, 2], [0, 5], [0, 1, 6]]


@pytest.mark.parametrize(("fields", "success"), [
    ({"terminated": True, "reward": 1.0}, True),
    ({"terminated": True, "reward": 0.0}, False),
    ({"terminated": True, "reward": 0.5}, False),  # partial credit is no success: below SUCCESS_REWARD
    ({"terminated": True, "reward": 2.0}, True),
    ({"truncated": True, "reward": 1.0}, False),  # cut off: the env never said it was done
    ({"terminated": True, "reward": 1.0, "info": {"success": False}}, False),  # the env said so
    ({"truncated": True, "reward": 0.0, "info": {"success": True}}, True),
])
def test_success_is_the_envs_word_else_a_full_reward_on_termination(fields, success):
    node = Node(**fields)
    assert node.success is success
    assert Episode.from_path([Node(), node]).success is success
    assert Episode.from_path([]).success is False


def test_engine_annotations_round_trip_in_their_own_fields():
    t = RolloutTree()
    t.add(Node(action_ids=[1, 2], top1=[0.5, 0.25], expert_action="look", open=True,
               info={"expert_action": "the env's own key", "won": True}))
    t.add(Node(expert_action_error="KeyError: no expert"), 0)
    back = RolloutTree.from_json(t.to_json())
    assert back.to_dict() == t.to_dict()
    node = back.nodes[0]
    assert (node.top1, node.expert_action, node.open) == ([0.5, 0.25], "look", True)
    assert node.info == {"expert_action": "the env's own key", "won": True}
    assert back.nodes[1].expert_action_error == "KeyError: no expert"


def test_files_with_engine_annotations_in_info_still_load_into_the_fields():
    old = {"id": 0, "action_ids": [1, 2],
           "info": {"top1": [0.9, 0.1], "expert_action": "go to desk 1", "open": True, "won": False}}
    node = Node.from_dict(old)
    assert (node.top1, node.expert_action, node.open) == ([0.9, 0.1], "go to desk 1", True)
    assert node.info == {"won": False}
    assert old["info"]["top1"] == [0.9, 0.1]  # the caller's dict is left as it was
    err = Node.from_dict({"id": 1, "info": {"expert_action_error": "no expert"}})
    assert err.expert_action_error == "no expert" and err.info == {}
