"""The async rollout engine: concurrency with failures and hangs, token-exact
branching on every backend, replay, budgets, limits and versions."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from agentrl.config import load_config
from agentrl.env import list_envs, make_env, register_env
from agentrl.errors import EnvError, SandboxUnavailableError
from agentrl.policy import HFPolicy, MockPolicy
from agentrl.rollout import (
    COUNTERS,
    Branch,
    Budget,
    Engine,
    Fresh,
    collect,
    format_tree,
    summarize,
)
from agentrl.rollout.allocators import Independent, IndependentOptions
from agentrl.types import RolloutTree
from tests.fakes import RELEASE, NoSnapshotEnv  # registers the Test*-v0 envs


class Recording:
    """Wraps a policy; remembers every (prompt, sampled tokens) pair it served."""

    def __init__(self, policy: Any):
        self.policy, self.calls = policy, set()
        self.tokenizer = policy.tokenizer

    @property
    def version(self) -> int:
        return self.policy.version

    def generate(self, requests):
        out = self.policy.generate(requests)
        for r, o in zip(requests, out, strict=True):
            self.calls.add((tuple(r.prompt_ids), tuple(o.token_ids)))
        return out

    async def agenerate(self, request):
        out = await self.policy.agenerate(request)
        self.calls.add((tuple(request.prompt_ids), tuple(out.token_ids)))
        return out

    def update_weights(self, sd):
        self.policy.update_weights(sd)


def assert_token_exact(trees: list[RolloutTree], rec: Recording) -> int:
    """Every sampled node's action follows exactly the tokens its policy call was given.

    A node made by a segment fork was sampled after the partial nodes above it;
    a node that was split was sampled whole, from where one of them starts.
    """
    checked = 0
    for tree in trees:
        for leaf in tree.leaves():
            ids: list[int] = []
            starts: list[int] = []  # where each partial node of the current turn starts
            for node in tree.path(leaf.id):
                ids += node.context_ids
                if node.action_ids and not node.partial:
                    options = [(tuple(ids), tuple(node.action_ids))]
                    options += [(tuple(ids[:st]), tuple(ids[st:]) + tuple(node.action_ids)) for st in starts]
                    assert any(o in rec.calls for o in options), f"node {node.id}"
                    checked += 1
                starts = starts + [len(ids)] if node.partial else []
                ids += node.action_ids
    return checked


@pytest.fixture(params=["mock", "hf", "openai"])
def policy(request, tokenizer, tiny_model):
    """Each backend this machine runs in-process tests with (vLLM's: tests/policy/test_vllm.py)."""
    if request.param == "mock":  # every call answers differently: a (prompt, action) pair names its call
        calls = itertools.count()
        yield Recording(MockPolicy(tokenizer, lambda p: f"word{next(calls)}"))
    elif request.param == "hf":
        yield Recording(HFPolicy(tiny_model, tokenizer, max_batch_size=64))
    else:  # over HTTP, token ids in and out, against a small OpenAI-compatible server over hf
        from agentrl.policy import OpenAIPolicy
        from tests.policy.oai_test_server import OAITestServer

        with OAITestServer(HFPolicy(tiny_model, tokenizer)) as server:
            yield Recording(OpenAIPolicy(server.url, "tiny", tokenizer))


@pytest.fixture(autouse=True)
def _release_hung_steps():
    RELEASE.clear()
    yield
    RELEASE.set()


@pytest.mark.parametrize("policy", ["mock", "hf"], indirect=True)  # HTTP adds nothing to what fails here
def test_64_concurrent_episodes_only_failing_and_hanging_ones_are_marked(policy):
    cfg = load_config(overrides=[
        "rollout.episodes=64", "rollout.max_turns=5", "rollout.concurrency=64",
        "rollout.episode_timeout_s=6", "sampling.max_new_tokens=6", "rollout.system_prompt=null"])
    trees = collect("agentrl/TestMixed-v0", policy, cfg, list(range(64)))
    assert len(trees) == 64
    for seed, tree in enumerate(trees):
        (ep,) = list(tree.episodes())
        kind = seed % 4
        if kind == 1:
            assert ep.error == "env.step raised RuntimeError: simulated env crash", seed
            assert ep.num_turns == 2
        elif kind == 2:
            assert ep.error and ep.error.startswith("episode timed out after"), (seed, ep.error)
            assert "episode_timeout_s=6" in ep.error
        else:  # untouched by the others' failures: every turn, every token
            assert ep.error is None and ep.num_turns == 3 and ep.nodes[-1].info["success"]
    assert assert_token_exact(trees, policy) == 16 * 2 + 32 * 3 + 16 * 1
    s = summarize(trees, 1.0)
    assert s["failed_episodes"] == 32
    assert s["failure_reasons"] == {"env.step raised RuntimeError": 16, "episode timed out": 16}
    assert s["success_rate"] == 1.0  # over the episodes that did not fail


class Plan:
    """A fixed two-round plan: fresh episodes, then turn and segment branches of task 0."""

    name, needs_snapshots, top_logprobs = "plan", True, 1

    def __init__(self, tasks: int):
        self.tasks = tasks

    def plan(self, state):
        if state.round == 0:
            return [Fresh(t, 2) for t in range(self.tasks)]
        if state.round == 1:
            tree = state.trees[0]
            first = tree.nodes[tree.roots[0]]
            second = tree.nodes[first.children[0]]
            return [Branch(0, first.id, 2), Branch(0, second.id, 2, at_token=1)]
        return []


def test_branches_are_token_exact_and_share_their_context(policy):
    cfg = load_config(overrides=[
        "rollout.max_turns=4", "sampling.max_new_tokens=5", "sampling.temperature=1.0",
        "env.kwargs={high: 1000, max_turns: 4}"])
    engine = Engine(policy, cfg, "agentrl/GuessNumber-v0")
    try:
        trees = asyncio.run(engine.run([0, 1], Plan(2), Budget(8)))
    finally:
        engine.close()
    tree = trees[0]
    assert len(tree.leaves()) == 6 and len(trees[1].leaves()) == 2
    assert tree.meta["budget"] == {"unit": "leaves", "total": 8, "spent": 8}
    first = tree.nodes[tree.roots[0]]
    assert len(first.children) == 3  # the original second turn and two branches
    kids = [tree.nodes[c] for c in first.children]
    assert kids[1].context_ids is kids[2].context_ids  # stored once
    assert kids[1].context_ids == kids[0].context_ids or kids[0].partial
    part = next(n for n in tree.nodes.values() if n.partial)
    assert len(part.action_ids) == 1 and len(part.children) == 3
    for c in part.children:  # each continuation's env step saw the whole turn's text
        node = tree.nodes[c]
        assert node.context_ids == []
        full = policy.tokenizer.decode(part.action_ids + node.action_ids, skip_special_tokens=True).strip()
        assert node.action_text == full
    assert assert_token_exact(trees, policy) > 0
    c = tree.meta["counters"]
    assert set(c) == set(COUNTERS)
    assert c["shared_tokens"] > 0 and c["env_steps_replayed"] == 0
    assert c["generated_tokens"] == sum(len(n.action_ids) for n in tree.nodes.values())
    # The serialized tree writes a shared context once and reads back the same episodes.
    data = tree.to_dict()
    assert sum(d.get("context_from") is not None for d in data["nodes"]) >= 1
    back = RolloutTree.from_json(json.dumps(data))
    assert [e.input_ids for e in back.episodes()] == [e.input_ids for e in tree.episodes()]
    assert "segment fork after 1 tokens" in format_tree(tree)


def test_branches_replay_the_action_prefix_when_the_env_cannot_snapshot(tokenizer):
    rec = Recording(MockPolicy(tokenizer, lambda p: f"w{len(p) % 5}"))
    cfg = load_config(overrides=["rollout.max_turns=5"])

    class DeepBranch(Plan):
        def plan(self, state):
            if state.round == 0:
                return [Fresh(0, 1)]
            if state.round == 1:
                tree = state.trees[0]
                second = tree.nodes[tree.nodes[tree.roots[0]].children[0]]
                return [Branch(0, second.id, 2)]
            return []

    trees = collect("agentrl/TestNoSnapshot-v0", rec, cfg, [0], DeepBranch(1), Budget(3))
    tree = trees[0]
    assert tree.meta["counters"]["env_steps_replayed"] == 2 * 2  # two turns, for each branch
    for ep in tree.episodes():
        assert ep.error is None and ep.num_turns == 3
        assert [n.observation.split(":")[0] for n in ep.nodes] == ["1", "2", "3"]
    assert assert_token_exact(trees, rec) == 3 * 3  # nodes on each root-to-leaf path


@pytest.mark.parametrize("unit,total", [("turns", 7), ("tokens", 40)])
def test_turn_and_token_budgets_are_never_overspent(tokenizer, unit, total):
    cfg = load_config(overrides=["rollout.max_turns=8", "sampling.max_new_tokens=6",
                                 "rollout.group_size=3", "env.kwargs={high: 1000, max_turns: 8}"])
    policy = MockPolicy(tokenizer, lambda p: "one two three four five six seven")
    plan = Independent(IndependentOptions(n=3, est_leaf_cost=1.0))  # plans 6 episodes, more than the budget buys
    trees = collect("agentrl/GuessNumber-v0", policy, cfg, [0, 1], plan, Budget(total, unit))
    nodes = [n for t in trees for n in t.nodes.values() if n.action_ids]
    used = len(nodes) if unit == "turns" else sum(len(n.action_ids) for n in nodes)
    assert used == total  # spent exactly, never more
    reasons = [n.info.get("truncation_reason", "") for t in trees for n in t.leaves()]
    assert any(r.startswith(f"budget: {total} {unit} spent") for r in reasons)


def test_each_turn_carries_the_version_that_sampled_it(tokenizer):
    class Updating(MockPolicy):
        async def agenerate(self, request):
            out = await super().agenerate(request)
            if self.calls % 2 == 0:
                self.update_weights({})
            return out

    cfg = load_config(overrides=["rollout.max_turns=6", "env.kwargs={high: 1000, max_turns: 6}"])
    trees = collect("agentrl/GuessNumber-v0", Updating(tokenizer, ["1"]), cfg, [0])
    (ep,) = list(trees[0].episodes())
    assert [n.version for n in ep.nodes] == [0, 0, 1, 1, 2, 2]
    first, last = ep.turn_spans[0], ep.turn_spans[-1]
    assert set(ep.versions[first[0]:first[1]]) == {0} and set(ep.versions[last[0]:last[1]]) == {2}
    assert ep.versions[0] == -1  # context tokens have no sampling version


def test_hf_micro_batcher_gathers_concurrent_requests(tokenizer, tiny_model):
    policy = HFPolicy(tiny_model, tokenizer, max_batch_size=64)
    cfg = load_config(overrides=["rollout.max_turns=3", "sampling.max_new_tokens=4",
                                 "env.kwargs={high: 1000, max_turns: 3}"])
    collect("agentrl/GuessNumber-v0", policy, cfg, list(range(16)))
    # 16 episodes x 3 turns: far fewer forward batches than requests.
    assert policy.batcher.batched_requests == 48
    assert policy.batcher.mean_batch >= 4


def _tool_env_kwargs(backend: str) -> dict[str, Any]:
    from agentrl.sandboxes import check_backend

    if backend == "remote":
        import httpx

        from agentrl.sandboxes import LocalSandbox, RemoteSandbox
        from agentrl.sandboxes.server import create_app

        app = create_app(lambda: LocalSandbox(), "t0ken", max_request_bytes=4 << 20)
        return {"sandbox": lambda: RemoteSandbox("http://sandbox.test", "t0ken",
                                                 transport=httpx.ASGITransport(app=app))}
    try:
        check_backend(backend)
    except SandboxUnavailableError as e:
        pytest.skip(f"sandbox backend {backend!r} unavailable here: {e}")
    return {"sandbox": backend}


@pytest.mark.parametrize("backend", ["local", "bwrap", "docker", "remote"])
def test_tool_env_branches_restore_the_sandbox(tokenizer, backend):
    """Three branches after one file write each see exactly one earlier write."""
    code = "open('c.txt','a').write('x'); print('count', len(open('c.txt').read()))"
    call = "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"
    cfg = load_config(overrides=["rollout.max_turns=3", "sampling.max_new_tokens=200"])
    cfg.env.kwargs = _tool_env_kwargs(backend)

    class OneThenThree(Plan):
        def plan(self, state):
            if state.round == 0:
                return [Fresh(0, 1, max_turns=1)]
            if state.round == 1:
                return [Branch(0, state.trees[0].roots[0], 3, max_turns=1)]
            return []

    trees = collect("agentrl/MathPython-v0", MockPolicy(tokenizer, [call]), cfg, [0],
                    OneThenThree(1), Budget(3))
    tree = trees[0]
    root = tree.nodes[tree.roots[0]]
    assert root.error is None and "count 1" in root.observation, root.observation
    kids = [tree.nodes[c] for c in root.children]
    assert len(kids) == 3
    for kid in kids:
        assert kid.error is None, kid.error
        assert "count 2" in kid.observation, kid.observation


# agentrl's own envs: other test modules register theirs at import (agentrl/Test*, review/*)
@pytest.mark.parametrize("env_id", [e for e in list_envs() if e.startswith("agentrl/") and "/Test" not in e])
def test_every_registered_env_branches_from_a_snapshot_or_a_replay(tokenizer, env_id):
    if env_id.endswith(("BashFix-v0", "MathPython-v0")):
        pytest.skip("sandboxed tool envs are covered per backend by test_tool_env_branches_restore_the_sandbox")
    try:  # the real-data envs need a dataset that agentrl never downloads
        make_env(env_id).close()
    except EnvError as e:
        if "never downloads" in str(e) or "not installed" in str(e):
            pytest.skip(f"{env_id} unavailable here: {e}")
        raise
    cfg = load_config(overrides=["rollout.max_turns=3", "sampling.max_new_tokens=16"])
    say = ["look", "inventory", "go north"]
    if env_id.endswith("SearchQA-v0"):  # a plain answer would end the episode
        say = ["<tool_call>" + json.dumps({"name": "search", "arguments": {"query": q}}) + "</tool_call>"
               for q in ("river", "city", "year")]
    policy = Recording(MockPolicy(tokenizer, lambda p: say[len(p) % 3]))

    class Twice(Plan):
        def plan(self, state):
            if state.round == 0:
                return [Fresh(0, 1, max_turns=1)]
            if state.round == 1:
                return [Branch(0, state.trees[0].roots[0], 2, max_turns=1)]
            return []

    try:
        trees = collect(env_id, policy, cfg, [0], Twice(1), Budget(2))
    except Exception as e:  # an env whose optional engine is missing here
        if "not installed" in str(e) or isinstance(e, ImportError):
            pytest.skip(f"{env_id} unavailable here: {e}")
        raise
    tree = trees[0]
    errors = [n.error for n in tree.nodes.values() if n.error]
    if errors and all("not installed" in e or "No module" in e for e in errors):
        pytest.skip(f"{env_id} unavailable here: {errors[0]}")
    assert not errors
    root = tree.nodes[tree.roots[0]]
    kids = [tree.nodes[c] for c in root.children]
    assert len(kids) == 2
    # Same state and same prompt: the same action gives the same observation.
    assert kids[0].action_text == kids[1].action_text and kids[0].observation == kids[1].observation
    assert assert_token_exact(trees, policy) == 2 * 2


def test_process_env_executor_isolates_crashes_and_kills_hung_envs(tokenizer):
    cfg = load_config(overrides=[
        "rollout.max_turns=5", "rollout.env_executor=process", "rollout.episode_timeout_s=20",
        "rollout.system_prompt=null"])
    rec = Recording(MockPolicy(tokenizer, ["a", "b", "c"]))
    trees = collect("agentrl/TestMixed-v0", rec, cfg, [0, 1, 3])
    errors = [next(t.episodes()).error for t in trees]
    assert errors[0] is None and errors[2] is None
    assert errors[1] == "env.step raised RuntimeError: simulated env crash"
    assert assert_token_exact(trees, rec) == 3 + 2 + 3


def test_a_hung_process_env_is_killed(tokenizer):
    import multiprocessing

    cfg = load_config(overrides=[
        "rollout.max_turns=5", "rollout.env_executor=process", "rollout.episode_timeout_s=8",
        "rollout.system_prompt=null"])
    trees = collect("agentrl/TestMixed-v0", MockPolicy(tokenizer, ["a"]), cfg, [2])
    assert next(trees[0].episodes()).error.startswith("episode timed out")
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("agentrl-env")]


def test_a_process_env_still_starting_when_its_episode_times_out_is_closed_by_collect(tokenizer):
    """On a loaded machine a process env can take longer to start than the episode may last:
    the env made after its episode gave up is closed before ``collect`` returns."""
    import multiprocessing

    cfg = load_config(overrides=[
        "rollout.env_executor=process", "rollout.episode_timeout_s=0.5", "env.kwargs={start_s: 2}"])
    trees = collect("agentrl/TestSlowStart-v0", MockPolicy(tokenizer, ["a"]), cfg, [0])
    assert next(trees[0].episodes()).error.startswith("episode timed out")
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("agentrl-env")]


def test_a_process_env_child_does_not_load_torch():
    """The child imports the rollout package to serve its env; torch would cost each one
    seconds to start and some 200 MB."""
    code = "import sys, agentrl.rollout.env_process; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def test_a_timed_out_process_env_is_killed_with_its_process_group_before_collect_returns(tokenizer, tmp_path):
    """The env's own child process (a game engine, a server) dies with it: the engine kills the
    timed-out env's process group at once and reaps it, not only the env process."""
    import multiprocessing
    import signal

    pid_file = tmp_path / "child.pid"
    cfg = load_config(overrides=[
        "rollout.max_turns=2", "rollout.env_executor=process", "rollout.episode_timeout_s=8",
        "rollout.system_prompt=null", f"env.kwargs={{pid_file: '{pid_file}'}}"])
    try:
        trees = collect("agentrl/TestSpawnThenHang-v0", MockPolicy(tokenizer, ["a"]), cfg, [0])
        assert next(trees[0].episodes()).error.startswith("episode timed out")
        assert not [p for p in multiprocessing.active_children() if p.name.startswith("agentrl-env")]
        assert pid_file.exists() and not _running(int(pid_file.read_text()))
    finally:
        if pid_file.exists() and _running(pid := int(pid_file.read_text())):
            os.kill(pid, signal.SIGKILL)  # the test's own leftover when it fails


class NestedForks(Plan):
    """Fork a turn, then fork the fork's continuation and fork the same turn again."""

    def plan(self, state):
        tree = state.trees[0]
        if state.round == 0:
            return [Fresh(0, 1)]
        if state.round == 1:
            self.second = tree.nodes[tree.roots[0]].children[0]
            return [Branch(0, self.second, 1, at_token=1)]
        if state.round == 2:
            part = tree.nodes[tree.nodes[self.second].parent]  # the partial node the first fork made
            cont = next(c for c in part.children if c != self.second)
            return [Branch(0, cont, 1, at_token=1), Branch(0, self.second, 1, at_token=1)]
        return []


def test_nested_segment_forks_stay_token_exact(tokenizer):
    calls = itertools.count()
    rec = Recording(MockPolicy(tokenizer, lambda p: f"alpha beta gamma {next(calls)}"))
    cfg = load_config(overrides=["rollout.max_turns=3", "env.kwargs={high: 1000, max_turns: 3}"])
    trees = collect("agentrl/GuessNumber-v0", rec, cfg, [0], NestedForks(1), Budget(4))
    tree = trees[0]
    assert len(tree.leaves()) == 4 and not [n.error for n in tree.nodes.values() if n.error]
    assert assert_token_exact(trees, rec) > 0
    for leaf in tree.leaves():  # the env saw each turn's whole text, heads included
        for node in tree.path(leaf.id):
            if not node.partial and node.action_ids:
                whole = rec.tokenizer.decode(_turn(tree, node), skip_special_tokens=True).strip()
                assert node.action_text == whole


def _turn(tree, node):
    ids = list(node.action_ids)
    while node.parent is not None and tree.nodes[node.parent].partial:
        node = tree.nodes[node.parent]
        ids = node.action_ids + ids
    return ids


def test_an_env_that_raised_is_not_handed_to_the_next_episode(tokenizer, monkeypatch):
    from tests.fakes import MixedEnv

    made = []
    init = MixedEnv.__init__
    def counting(self, *a, **k):
        made.append(self)
        init(self, *a, **k)

    monkeypatch.setattr(MixedEnv, "__init__", counting)
    cfg = load_config(overrides=["rollout.concurrency=1", "rollout.system_prompt=null"])
    trees = collect("agentrl/TestMixed-v0", MockPolicy(tokenizer, ["a"]), cfg, [1, 0, 3])
    errors = [next(t.episodes()).error for t in trees]
    assert errors[0].startswith("env.step raised") and errors[1:] == [None, None]
    assert len(made) == 2  # the crashed env was replaced once; the healthy one was reused


def test_turn_budget_starts_no_empty_episodes_and_closes_open_leaves(tokenizer):
    cfg = load_config(overrides=["rollout.max_turns=8", "env.kwargs={high: 1000, max_turns: 8}"])
    policy = MockPolicy(tokenizer, ["1"])
    trees = collect("agentrl/GuessNumber-v0", policy, cfg, [0, 1],
                    Independent(IndependentOptions(n=8, est_leaf_cost=1.0)), Budget(20, "turns"))
    eps = [ep for t in trees for ep in t.episodes()]
    assert all(ep.num_turns >= 1 for ep in eps)  # no 0-turn roots
    assert sum(ep.num_turns for ep in eps) == 20

    class Paused(Plan):
        def plan(self, state):
            return [Fresh(0, 3, max_turns=2)] if state.round == 0 else []

    (tree,) = collect("agentrl/GuessNumber-v0", policy, cfg, [0], Paused(1), Budget(3))
    for leaf in tree.leaves():
        assert leaf.truncated and not leaf.open
        assert leaf.info["truncation_reason"] == "paused, and not continued by the allocator"


class BadRestore(Plan):
    def plan(self, state):
        if state.round == 0:
            return [Fresh(0, 1, max_turns=1)]
        if state.round == 1:
            return [Branch(0, state.trees[0].roots[0], 2)]
        return []


def test_a_failed_restore_is_recorded_under_its_branch_point(tokenizer, monkeypatch):
    from agentrl.envs.guess_number import GuessNumberEnv

    def broken(self, snap):
        raise OSError("snapshot store gone")

    monkeypatch.setattr(GuessNumberEnv, "restore", broken)
    (tree,) = collect("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1"]), load_config(), [0],
                      BadRestore(1), Budget(2))
    root = tree.nodes[tree.roots[0]]
    assert len(tree.roots) == 1 and len(root.children) == 2 and len(tree.leaves()) == 2
    for c in root.children:
        assert tree.nodes[c].error == "restore for a branch raised OSError: snapshot store gone"


class DriftingEnv(NoSnapshotEnv):
    """Cannot snapshot, and each instance opens with a different text: replay must refuse."""

    made = itertools.count()

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed, options=options)
        return f"{obs} (instance {next(DriftingEnv.made)})", info


register_env("agentrl/TestDrifting-v0", entry_point=DriftingEnv)


def test_replay_refuses_an_env_whose_tokens_do_not_repeat(tokenizer):
    cfg = load_config(overrides=["rollout.max_turns=3"])
    (tree,) = collect("agentrl/TestDrifting-v0", MockPolicy(tokenizer, ["x"]), cfg, [0], BadRestore(1), Budget(2))
    kids = [tree.nodes[c] for c in tree.nodes[tree.roots[0]].children]
    assert len(kids) == 2
    assert all(k.error and k.error.startswith("replay diverged from the stored tokens") for k in kids)


class SeedEcho(MockPolicy):
    """Answers with its request's seed: what it samples depends on the seed alone, not on
    timing or batching (an ``hf`` model's near-ties can flip with the batch it lands in)."""

    def generate(self, requests):
        out = []
        for r in requests:
            ids = self.tokenizer.encode(f"s{r.params.seed % 997}", add_special_tokens=False)
            out.append(self._cut(ids + [self.tokenizer.eos_token_id], r))
        return out


def test_a_run_repeats_exactly(tokenizer):
    """Every path samples its own stream, and a rerun samples the same episodes. (Node ids
    follow completion order, so episodes are compared as sets per task.)"""
    def run():
        cfg = load_config(overrides=["rollout.max_turns=4", "env.kwargs={high: 1000, max_turns: 4}",
                                     "rollout.group_size=4"])
        trees = collect("agentrl/GuessNumber-v0", SeedEcho(tokenizer, ["unused"]), cfg, [0, 1])
        return [sorted(tuple(ep.input_ids) for ep in t.episodes()) for t in trees]

    first = run()
    assert len({ids for tree in first for ids in tree}) == 8
    assert run() == first


def test_hung_env_steps_neither_starve_the_others_nor_block_exit(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        "import tests.fakes\n"
        "from agentrl.config import load_config\n"
        "from agentrl.models import load_tokenizer\n"
        "from agentrl.policy import MockPolicy\n"
        "from agentrl.rollout import collect\n"
        "cfg = load_config(overrides=['rollout.concurrency=4', 'rollout.episode_timeout_s=3',"
        " 'rollout.system_prompt=null'])\n"
        "trees = collect('agentrl/TestMixed-v0', MockPolicy(load_tokenizer('smollm2-135m'), ['a']), cfg,"
        " [2, 6, 10, 14, 0, 3, 4, 7])\n"
        "print([bool(next(t.episodes()).error) for t in trees])\n")
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=root,
                         env={**__import__("os").environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    # the four hung episodes fail; the four healthy ones finish although every first worker hung
    assert out.stdout.strip().splitlines()[-1] == str([True] * 4 + [False] * 4)


def test_a_groups_shared_opening_prompt_is_prefilled_once_and_counted_so(tokenizer, tiny_model):
    """A GRPO group's episodes open with the same prompt. In one batch on ``hf`` it runs once;
    the tree counters say so (the other rows reuse it), and every episode samples what it
    samples with no prefix reuse at all."""
    cfg = load_config(overrides=["env.id=agentrl/ALFWorld-v0", "rollout.group_size=4", "rollout.max_turns=1",
                                 "sampling.max_new_tokens=4", "sampling.temperature=1.0",
                                 "rollout.deterministic=false"])
    shared = HFPolicy(tiny_model, tokenizer, max_batch_size=8, prefill_pad_tokens=0)
    [tree] = collect(cfg.env.id, shared, cfg, [3])
    # Deterministic mode prefills the four identical prompts once and copies the result (the same
    # computation): the prompt's tokens once, none of the last tokens again.
    cfg_det = cfg.model_copy(deep=True)
    cfg_det.rollout.deterministic = True
    [det] = collect(cfg.env.id, HFPolicy(tiny_model, tokenizer, max_batch_size=8, prefill_pad_tokens=0),
                    cfg_det, [3])
    [plain] = collect(cfg.env.id, HFPolicy(tiny_model, tokenizer, max_batch_size=8, prefix_cache_mb=0),
                      cfg, [3])
    # Node ids follow completion order, so compare the episodes as a set.
    assert sorted(e.input_ids for e in tree.episodes()) == sorted(e.input_ids for e in plain.episodes())
    prompt = len(next(tree.episodes()).nodes[0].context_ids)
    c = tree.meta["counters"]
    assert c["prefilled_tokens"] + c["reused_tokens"] == 4 * prompt
    assert c["prefilled_tokens"] == prompt + 3  # one row ran the prompt; three ran their last token
    assert plain.meta["counters"]["prefilled_tokens"] == 4 * prompt
    assert det.meta["counters"]["prefilled_tokens"] == prompt
    assert det.meta["counters"]["prefilled_tokens"] + det.meta["counters"]["reused_tokens"] == 4 * prompt


def test_an_envs_info_cannot_overwrite_what_the_engine_records_about_a_turn(tokenizer):
    class WithTop1(MockPolicy):  # as a backend asked for top-1 logprobs answers
        async def agenerate(self, request):
            out = await super().agenerate(request)
            out.top_logprobs = [[(t, -0.5)] for t in out.token_ids]
            return out

    class Once:
        name, needs_snapshots, top_logprobs = "once", False, 1

        def plan(self, state):
            return [Fresh(0, 1)] if state.round == 0 else []

    cfg = load_config(overrides=["rollout.system_prompt=null", "rollout.record_expert_actions=true"])
    (tree,) = collect("agentrl/TestClashingInfo-v0", WithTop1(tokenizer, ["hi"]), cfg, [0], Once(), Budget(1))
    (ep,) = list(tree.episodes())
    assert [n.expert_action for n in ep.nodes] == ["expert move 0", "expert move 1"]
    assert all(n.top1 == [0.606531] * len(n.action_ids) for n in ep.nodes)  # exp(-0.5), rounded
    assert not any(n.open for n in ep.nodes)  # the env's "open" is not a paused leaf:
    assert ep.nodes[-1].terminated and not ep.nodes[-1].truncated  # nor closed as one at the end
    assert "truncation_reason" not in ep.nodes[-1].info
    assert all(n.info == {"top1": "the env's", "expert_action": "the env's", "open": True} for n in ep.nodes)


def test_a_rollout_error_ends_only_its_episode_with_its_reason(tokenizer, monkeypatch):
    from agentrl.errors import RolloutError
    from agentrl.rollout.episodes import EpisodePlayer

    def refuse(self, obs, info):
        raise RolloutError("opening refused on purpose")

    monkeypatch.setattr(EpisodePlayer, "_opening", refuse)
    cfg = load_config(overrides=["rollout.system_prompt=null"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an uncaught error would be reported as an engine bug
        trees = collect("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1"]), cfg, [0, 1])
    assert [ep.error for t in trees for ep in t.episodes()] == ["opening refused on purpose"] * 2


def test_jsonable_info_keeps_scalars_and_makes_the_rest_json_safe():
    from agentrl.rollout.turns import jsonable_info

    scalars = {"won": True, "score": 0.5, "n": 3, "note": "ok", "none": None, "admissible_actions": ["a"]}
    assert jsonable_info(scalars) == {"won": True, "score": 0.5, "n": 3, "note": "ok", "none": None}
    nested = {"pair": (1, 2), 7: "int key", "obj": Path("a/b"), "deep": {"x": [1, (2,)]}}
    out = jsonable_info(nested)
    assert out == {"pair": [1, 2], "7": "int key", "obj": "a/b", "deep": {"x": [1, [2]]}}
    assert json.loads(json.dumps(out)) == out
    # The keys the engine writes on a node are the engine's: a value head bootstraps from next_context_ids.
    assert jsonable_info({"next_context_ids": [1, 2], "next_context_error": "x", "won": False}) == {"won": False}


@pytest.mark.parametrize("task", [-1, 2, "0"])
def test_a_plan_for_a_task_the_run_does_not_have_is_refused_naming_it(tokenizer, task):
    """A negative task index grew the last tree (Python's trees[-1]) without a word; now the
    request is refused with a warning and recorded (tests/rollout/test_bad_requests.py)."""
    from agentrl.rollout.allocators.base import Fresh

    class Stray(Independent):
        def plan(self, state):
            return [Fresh(task, 1)] if state.round == 0 else []

    cfg = load_config(overrides=["rollout.max_turns=1"])
    with pytest.warns(RuntimeWarning, match=rf"allocator 'independent' .*task {task!r}; this run has tasks 0\.\.1"):
        trees = collect("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1"]), cfg, [0, 1], allocator=Stray())
    assert [len(t.nodes) for t in trees] == [0, 0]
