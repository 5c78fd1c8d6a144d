"""Deterministic mode (``rollout.deterministic``): the same config and seed give the same
trees, losses and weights, bit for bit, whatever the timing, the engine's concurrency or
the batch size. Each check is run against timing-based batching too, where it can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.config import load_config
from agentrl.env import register_env
from agentrl.envs.alfworld import ALFWorldEnv
from agentrl.errors import ConfigError
from agentrl.models import load_model
from agentrl.policy import GenerateRequest, GenerateResult, HFPolicy, MockPolicy, SamplingParams
from agentrl.policy.deterministic import ALONE_TOKENS
from agentrl.rollout import Branch, Budget, Fresh, collect
from agentrl.rollout.tree import renumber
from agentrl.types import Node, RolloutTree, read_trees, write_trees

ROOT = Path(__file__).resolve().parents[2]


class StallingALFWorld(ALFWorldEnv):
    """``ALFWorld-v0``, except that ``reset`` of the task seed ``AGENTRL_TEST_STALL_SEED``
    touches the file ``AGENTRL_TEST_STALL_MARK`` and hangs, so that a test can kill a run
    at a known point (as ``tests/train/test_trainer.LetterEnv`` does for linear runs)."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if seed is not None and str(seed) == os.environ.get("AGENTRL_TEST_STALL_SEED"):
            Path(os.environ["AGENTRL_TEST_STALL_MARK"]).touch()
            time.sleep(600)
        return super().reset(seed=seed, options=options)


register_env("agentrl/TestStallingALFWorld-v0", entry_point=StallingALFWorld)

# segment_tree on ALFWorld-v0 (2 levels of 2: 4 leaves a task), the tiny model, GRPO. A random
# model earns no reward there, so the entropy bonus gives the update something to follow.
BRANCHED = [
    "policy.model=tiny-random", "env.id=agentrl/ALFWorld-v0", "rollout.allocator={name: segment_tree, depth: 2, width: 2}", "rollout.group_size=4", "rollout.max_turns=3",
    "rollout.max_context_tokens=1024", "rollout.deterministic=true", "sampling.max_new_tokens=6",
    "sampling.temperature=1.0", "train.credit=grpo", "train.loss.entropy_coef=0.01",
    "train.tasks_per_step=2", "train.minibatch_size=4", "train.micro_batch_tokens=2048",
    "train.steps=2", "train.optimizer.lr=1e-3", "train.evaluation.episodes=2", "train.output.tensorboard=false",
    "train.checkpointing.export_hf=false", "train.output.plot=false",
]


def _requests(prompts: list[list[int]], seeds: list[int]) -> list[GenerateRequest]:
    return [GenerateRequest(list(p), SamplingParams(max_new_tokens=10, temperature=1.0, seed=s))
            for p, s in zip(prompts, seeds, strict=True)]


def _same(a: GenerateResult, b: GenerateResult) -> bool:
    return (a.token_ids, a.logprobs, a.entropies) == (b.token_ids, b.logprobs, b.entropies)


def _two_turns(model: Any, tokenizer: Any, deterministic: bool, batches: list[list[int]],
               prompts: list[list[int]]) -> list[tuple[GenerateResult, GenerateResult]]:
    """Every prompt's turn, then a second turn that extends it (reusing the cache), with the
    requests grouped into ``batches`` (indices); both turns' results, by prompt."""
    policy = HFPolicy(model, tokenizer, deterministic=deterministic)
    first: dict[int, GenerateResult] = {}
    for batch in batches:
        first.update(zip(batch, policy.generate(_requests([prompts[i] for i in batch], batch)), strict=True))
    second: dict[int, GenerateResult] = {}
    for batch in batches[::-1]:
        nxt = [prompts[i] + first[i].token_ids + [198, 9519, 42, 7] for i in batch]
        second.update(zip(batch, policy.generate(_requests(nxt, [100 + i for i in batch])), strict=True))
    return [(first[i], second[i]) for i in range(len(prompts))]


# --------------------------------------------------------------------------- hf: a row alone


def test_an_hf_row_samples_the_same_bits_alone_or_in_any_batch(tokenizer):
    model = load_model("tiny-random")[0]
    g = torch.Generator().manual_seed(0)
    lengths = (30, 55, 12, ALONE_TOKENS + 20, 30, 3)  # prefilled in groups, and one alone
    prompts = [torch.randint(5, 40000, (n,), generator=g).tolist() for n in lengths]
    prompts[4] = list(prompts[0])  # a twin: prefilled once, copied
    ways = ([[0, 1, 2, 3, 4, 5]], [[i] for i in range(6)], [[5, 3], [1, 0, 2, 4]])
    together, alone, mixed = (_two_turns(model, tokenizer, True, w, prompts) for w in ways)
    for i in range(6):
        for turn in (0, 1):
            assert _same(together[i][turn], alone[i][turn]), (i, turn)
            assert _same(together[i][turn], mixed[i][turn]), (i, turn)
    timing = [_two_turns(model, tokenizer, False, w, prompts) for w in ways[:2]]
    assert any(not _same(timing[0][i][t], timing[1][i][t]) for i in range(6) for t in (0, 1))


def test_a_branch_reuses_its_branch_point_whatever_its_siblings_cached(tokenizer):
    """Two branches share a prompt. The first one's cache entry covers all of that prompt
    but its last token; the second must not reuse it (it would run one token instead of the
    observation's chunk), or its bits would depend on which branch ran first."""
    model = load_model("tiny-random")[0]
    parent = torch.randint(5, 40000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    results = {}
    for deterministic in (True, False):
        got = []
        for siblings in ([11], []):
            policy = HFPolicy(model, tokenizer, deterministic=deterministic)
            [a] = policy.generate(_requests([parent], [10]))
            branch = parent + a.token_ids + [198, 9519, 42, 7, 8, 9]
            for seed in siblings:
                policy.generate(_requests([branch], [seed]))
            got += policy.generate(_requests([branch], [12]))
        results[deterministic] = got
    assert _same(*results[True])
    assert not _same(*results[False])  # timing mode reuses the sibling's entry


def test_a_segment_fork_continues_with_the_bits_its_parent_decoded(tokenizer):
    """A fork's prompt ends inside a cached action: its one new token runs as a decode step
    did, so its first distribution is the parent's at that token, to the bit."""
    model = load_model("tiny-random")[0]
    policy = HFPolicy(model, tokenizer, deterministic=True)
    policy.eos_ids = {-1}  # the parent decodes all its tokens
    prompt = torch.randint(5, 40000, (50,), generator=torch.Generator().manual_seed(2)).tolist()
    [parent] = policy.generate(_requests([prompt], [20]))
    for m in (1, 4, 7):
        other = torch.randint(5, 40000, (33,), generator=torch.Generator().manual_seed(m)).tolist()
        fork, _ = policy.generate(_requests([prompt + parent.token_ids[:m], other], [30 + m, 40]))
        assert fork.cached_tokens == len(prompt) + m - 1
        assert fork.entropies[0] == parent.entropies[m]


# --------------------------------------------------------------------------- the engine


def _tree_data(trees: list[RolloutTree]) -> list[dict[str, Any]]:
    """What must repeat: everything but the counters of work done, which follow batching."""
    out = []
    for t in trees:
        d = t.to_dict()
        d["meta"] = {k: v for k, v in d["meta"].items() if k != "counters"}
        out.append(d)
    return out


def _branched(model: Any, tokenizer: Any, deterministic: bool, concurrency: int, batch: int) -> list:
    cfg = load_config(overrides=[
        "env.id=agentrl/ALFWorld-v0", "rollout.max_turns=3", "sampling.max_new_tokens=6",
        "sampling.temperature=1.0", "rollout.max_context_tokens=1024", "rollout.allocator={name: segment_tree, depth: 2, width: 2}", "rollout.group_size=4", "rollout.seed=3",
        f"rollout.concurrency={concurrency}", f"rollout.deterministic={str(deterministic).lower()}"])
    return _tree_data(collect(cfg.env.id, HFPolicy(model, tokenizer, max_batch_size=batch), cfg, [0, 1, 2]))


def test_branched_trees_repeat_at_any_concurrency_and_batch_size(tokenizer):
    model = load_model("tiny-random")[0]
    runs = [_branched(model, tokenizer, True, c, b) for c, b in ((64, 16), (1, 16), (3, 4))]
    assert runs[0] == runs[1] == runs[2]
    nodes = [n for t in runs[0] for n in t["nodes"]]
    assert len(nodes) == 30 and all(n["id"] == i for t in runs[0] for i, n in enumerate(t["nodes"]))
    timing = [_branched(model, tokenizer, False, c, b) for c, b in ((64, 16), (1, 16))]
    assert timing[0] != timing[1]


def test_renumber_gives_a_rounds_nodes_ids_in_plan_order():
    tree = RolloutTree()
    root = tree.add(Node(action_ids=[1]))
    root.snapshot = "n0"
    tree.snapshots["n0"] = "state after the root"
    # A round's turns finish out of order: stream 2's first node, stream 1's two, stream 2's second.
    keys = {}
    for stream, nth, parent in ((2, 0, 0), (1, 0, 0), (1, 1, None), (2, 1, None)):
        if parent is None:  # under the same stream's previous node
            parent = next(i for i, k in keys.items() if k == (stream, nth - 1))
        node = tree.add(Node(action_ids=[10 * stream + nth]), parent)
        node.snapshot = f"n{node.id}"
        tree.snapshots[node.snapshot] = f"state {stream}.{nth}"
        keys[node.id] = (stream, nth)
    by_node = {id(tree.nodes[i]): k for i, k in keys.items()}
    renumber(tree, 1, lambda n: by_node[id(n)])
    assert [n.id for n in tree.nodes.values()] == [0, 1, 2, 3, 4]
    assert [n.action_ids[0] for n in tree.nodes.values()] == [1, 10, 11, 20, 21]
    assert tree.nodes[0].children == [1, 3] and tree.nodes[2].parent == 1 and tree.nodes[4].parent == 3
    assert tree.nodes[1].children == [2] and tree.nodes[3].children == [4]
    assert {n.snapshot: tree.snapshots[n.snapshot] for n in tree.nodes.values()} == {
        "n0": "state after the root", "n1": "state 1.0", "n2": "state 1.1", "n3": "state 2.0",
        "n4": "state 2.1"}


def test_a_mock_script_plays_every_episode_from_its_start(tokenizer):
    script = ["look", "inventory", "go to cabinet 1"]
    cfg = load_config(overrides=["env.id=agentrl/ALFWorld-v0", "rollout.max_turns=3", "rollout.group_size=4",
                                 "rollout.concurrency=64"])
    trees = collect(cfg.env.id, MockPolicy(tokenizer, script), cfg, [0, 1, 2])
    assert all([n.action_text for n in ep.nodes] == script for t in trees for ep in t.episodes())
    cfg.rollout.deterministic = False  # call order: concurrent episodes interleave the script
    trees = collect(cfg.env.id, MockPolicy(tokenizer, script), cfg, [0, 1, 2])
    assert any([n.action_text for n in ep.nodes] != script for t in trees for ep in t.episodes())


def test_deterministic_true_on_a_backend_without_the_mode_names_the_key(tokenizer):
    class Plain:  # a backend that batches as it likes: no `deterministic` attribute
        version, tokenizer = 0, None

        def __init__(self, tok: Any):
            self.tokenizer, self.inner = tok, MockPolicy(tok, ["look"])

        async def agenerate(self, request: GenerateRequest) -> GenerateResult:
            return await self.inner.agenerate(request)

    cfg = load_config(overrides=["env.id=agentrl/ALFWorld-v0", "rollout.max_turns=1",
                                 "rollout.deterministic=true"])
    with pytest.raises(ConfigError, match="rollout.deterministic"):
        collect(cfg.env.id, Plain(tokenizer), cfg, [0])
    cfg.rollout.deterministic = None  # null: off where the backend has no such mode
    assert len(collect(cfg.env.id, Plain(tokenizer), cfg, [0])[0].nodes) == 1


def test_a_fork_and_its_siblings_repeat_across_batching(tokenizer):
    """Branches and segment forks from the same nodes, at concurrency 1 and 64: the same trees."""
    model = load_model("tiny-random")[0]

    class ForkTwice:
        needs_snapshots, top_logprobs, name = True, 0, "fork_twice"

        def plan(self, state):
            if state.round == 0:
                return [Fresh(t, 2, max_turns=1) for t in range(len(state.trees))]
            if state.round == 1:
                out = []
                for t, tree in enumerate(state.trees):
                    a, b = (tree.nodes[r] for r in tree.roots)
                    out += [Branch(t, a.id, 2, max_turns=1), Branch(t, b.id, 2, at_token=2, max_turns=1)]
                return out
            return []

    def run(deterministic: bool, concurrency: int) -> list:
        cfg = load_config(overrides=[
            "env.id=agentrl/ALFWorld-v0", "rollout.max_turns=3", "sampling.max_new_tokens=5",
            "sampling.temperature=1.0", "rollout.max_context_tokens=1024", "rollout.seed=5",
            f"rollout.concurrency={concurrency}", f"rollout.deterministic={str(deterministic).lower()}"])
        policy = HFPolicy(model, tokenizer)
        policy.eos_ids = {-1}  # five-token actions: every root can be forked at its second token
        return _tree_data(collect(cfg.env.id, policy, cfg, [0, 1], ForkTwice(), Budget(12)))

    a, b = run(True, 64), run(True, 1)
    assert a == b
    assert sum(n["partial"] for t in a for n in t["nodes"]) == 2  # one fork a task
    assert run(False, 64) != run(False, 1)


# --------------------------------------------------------------------------- whole runs


def record_training(out_dir: str, *overrides: str) -> None:
    """Train the ``BRANCHED`` config (plus ``overrides``) on one torch thread, writing every
    tree the run rolls out (evaluations too) to ``out_dir/trees.jsonl``, in order."""
    from agentrl.train.config import load_train_config
    from agentrl.train.trainer import train

    torch.set_num_threads(1)
    cfg = load_train_config(None, BRANCHED + [f"train.output.dir={out_dir}", *overrides])
    path = Path(out_dir) / "trees.jsonl"

    class Recorder:
        stats: dict[str, Any] = {}

        def collect(self, env_id: str, policy: Any, cfg: Any, seeds: list[int], on_episode_done: Any = None):
            trees = collect(env_id, policy, cfg, seeds, on_episode_done=on_episode_done)
            write_trees(path, trees, append=True)
            return trees

        def close(self) -> None:
            pass

    train(cfg, progress=False, rollouts=lambda policy, cfg: Recorder())


def _start(out: Path, *overrides: str) -> subprocess.Popen:
    args = ", ".join(repr(x) for x in (str(out), *overrides))
    code = f"from tests.rollout.test_determinism import record_training; record_training({args})"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stderr=subprocess.PIPE)


def _losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss/total"] for r in rows if r.get("phase") == "rl"]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from agentrl.train import checkpoint as ck

    return ck.load_checkpoint(ck.latest_checkpoint(out)).trainable


def test_training_runs_in_separate_processes_repeat_bit_for_bit(tmp_path):
    """segment_tree on ALFWorld-v0, the tiny model, 2 steps of GRPO, three processes: the
    same trees (token ids, logprobs), losses and trained weights; the third runs its
    episodes one at a time (rollout.concurrency=1), so its batches share nothing."""
    outs = [tmp_path / "a", tmp_path / "b", tmp_path / "one_at_a_time"]
    procs = [_start(outs[0]), _start(outs[1]), _start(outs[2], "rollout.concurrency=1")]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err.decode()[-3000:]
    trees = [_tree_data(read_trees(o / "trees.jsonl")) for o in outs]
    assert len(trees[0]) == 2 + 2 * 2 + 2  # eval at start, 2 steps of 2 tasks, eval at the end
    assert sum(len(t["nodes"]) for t in trees[0][2:6]) == 4 * 10
    assert trees[0] == trees[1] == trees[2]
    losses = [_losses(o) for o in outs]
    assert len(losses[0]) == 2 and losses[0][0] != 0.0
    assert losses[0] == losses[1] == losses[2]
    weights = [_weights(o) for o in outs]
    assert weights[0].keys() == weights[1].keys() == weights[2].keys()
    for name, w in weights[0].items():
        assert torch.equal(w, weights[1][name]) and torch.equal(w, weights[2][name]), name
    start = load_model("tiny-random")[0].state_dict()  # the same seeded init the runs started from
    assert any(not torch.equal(w, start[name]) for name, w in weights[0].items())
