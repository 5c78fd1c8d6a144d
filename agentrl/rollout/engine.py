"""One job: run an allocator's plan, round by round, as many concurrent episodes against one policy, into trees.

An asyncio orchestrator. Each episode is a coroutine that alternates
``await policy.agenerate(request)`` and an env step run off the loop
(``agentrl.rollout.executors``: a thread pool, a child process, a sandboxed
tool env's own loop, or a Ray env worker). No episode waits for another: when
its env step returns, its next request goes straight to the backend, which
batches whatever is pending (``hf``'s micro-batcher, vLLM's continuous
batching).

Work comes from an allocator (``agentrl.rollout.allocators``) in rounds:
``Fresh`` episodes become roots of their task's tree, ``Branch``es grow it from
a node (``agentrl.rollout.tree``). Each request becomes one job per path,
played by ``agentrl.rollout.episodes``; every request is charged to the budget
(``agentrl.rollout.budget``), which is never overspent. A failure fails only
its episode, and the rest of the batch goes on.

Every turn carries the policy version that sampled it, so an episode that
spans a weight update keeps per-token versions (``Episode.versions``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import operator
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..config import Config
from ..errors import ConfigError
from ..types import RolloutTree
from .allocators import Allocator, AllocState, Branch, Budget, Fresh
from .budget import BudgetMeter
from .episodes import EpisodePlayer
from .executors import EnvExecutor
from .tree import renumber, split_node

if TYPE_CHECKING:  # not at run time: agentrl.policy loads torch (see EpisodePlayer._sample)
    from ..policy.base import Policy

__all__ = ["Engine", "RunInterrupted", "collect", "run_episodes"]


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a run. ``trees`` holds the tasks whose every planned episode had
    ended by then (in task order); a task with an episode still running is left out, so
    what a caller writes is what was played to the end. ``report`` is for a caller that
    builds one from them (``agentrl.evaluation``)."""

    def __init__(self, trees: list[RolloutTree], report: Any = None) -> None:
        super().__init__(f"interrupted with {len(trees)} finished task(s)")
        self.trees, self.report = trees, report


class Engine:
    """Runs allocator plans: episodes and branches, concurrently, into trees.

    ``env_id`` and ``cfg.env.kwargs`` make the envs; one tree per task seed.
    Use ``await engine.run(seeds, allocator)``, or the sync ``collect``.
    ``on_episode_done(tree)`` is called once for each planned path when it ends, or when it
    is dropped unplayed because a turns or tokens budget was spent (a progress bar of the
    planned episodes then completes). A callback that raises an ``Exception`` is warned about
    (``RuntimeWarning``) and not called again that run; the run goes on.
    """

    def __init__(self, policy: Policy, cfg: Config, env_id: str | None = None,
                 on_episode_done: Callable[[RolloutTree], None] | None = None):
        self.policy, self.cfg = policy, cfg
        self.env_id = env_id or cfg.env.id
        self.on_episode_done = on_episode_done
        self.envs = EnvExecutor(cfg, self.env_id)
        self._running = False
        self._closed = False
        self._pending: dict[int, int] = {}  # task -> its episodes still running
        self.finished: list[RolloutTree] | None = None  # set when a run is cancelled

    def close(self) -> None:
        """Close every env (each in its own try) and the step pool."""
        self._closed = True
        self.envs.close()

    # -- requests ------------------------------------------------------------------
    @staticmethod
    def _stream(tree: RolloutTree) -> int:
        """The next path's seed stream, taken when its job is made, so runs repeat exactly."""
        stream = tree.meta.get("_streams", 0)
        tree.meta["_streams"] = stream + 1
        return stream

    def _fresh_jobs(self, player: EpisodePlayer, trees: list[RolloutTree], req: Fresh) -> list[Any]:
        tree = trees[req.task]
        jobs = []
        for _ in range(req.n):
            stream = self._stream(tree)
            start = functools.partial(player.start, tree, req.task, stream)
            jobs.append(player.episode(start, tree, req.max_turns, stream))
        return jobs

    def _branch_jobs(self, player: EpisodePlayer, trees: list[RolloutTree], req: Branch,
                     cut: dict[tuple[int, int], int]) -> list[Any]:
        """``cut``: the action tokens this round's earlier forks split off the front of a node
        (``at_token`` counts the node's action as the allocator saw it). The request was
        checked (``_request_problem``, ``_fork_problem``)."""
        tree = trees[req.task]
        node = tree.nodes[req.node]
        if req.at_token is None:
            point, parent, prefix = node.id, node.id, None
        else:
            m, off = req.at_token, cut.get((req.task, req.node), 0)
            if m > off:
                part = split_node(tree, node.id, m - off)
                cut[(req.task, req.node)] = m
            else:  # where an earlier fork of this round split it: share that partial node
                part = tree.nodes[node.parent]  # type: ignore[index]
            parent = part.id
            point = tree.turn_parent(part.id)  # the state before the turn: above any earlier forks
            head = tree.turn_nodes(part.id)
            prefix = ([t for n in head for t in n.action_ids], [x for n in head for x in n.logprobs],
                      [x for n in head for x in n.entropies])
        jobs = []
        for _ in range(req.k):
            stream = self._stream(tree)
            start = functools.partial(player.resume, tree, req.task, point, parent, prefix, stream)
            jobs.append(player.episode(start, tree, req.max_turns, stream, prefix, anchor=parent))
        return jobs

    # -- the driver ----------------------------------------------------------------
    def _set_deterministic(self) -> None:
        """Switch the policy's deterministic mode as ``rollout.deterministic`` says: null takes
        the backend's default (``deterministic_by_default``: on for ``mock``, where it costs
        nothing; off for ``hf``, where it cost +75% wall time at 32 rows, bench/engine_overhead)."""
        want = self.cfg.rollout.deterministic
        if not hasattr(self.policy, "deterministic"):
            if want:
                raise ConfigError(f"rollout.deterministic=true, but the {type(self.policy).__name__} backend "
                                  "cannot make a request's result independent of its batch (vLLM batches "
                                  "continuously; a server batches as it likes): set rollout.deterministic "
                                  "to null or false, or use policy.backend=hf")
            return
        if want is None:
            want = bool(getattr(self.policy, "deterministic_by_default", False))
        self.policy.deterministic = want  # type: ignore[attr-defined]

    async def run(self, seeds: list[int], allocator: Allocator | None = None,
                  budget: Budget | None = None) -> list[RolloutTree]:
        """Grow one tree per task seed as the allocator plans, within the budget.

        One run at a time per engine: the budget and branching settings are per run.
        """
        if self._running:
            raise RuntimeError("this Engine is already running a batch; make another Engine")
        if self._closed:  # its step pool is shut: every episode would fail making its env
            raise RuntimeError("this Engine is closed; make another Engine")
        seeds = [_task_seed(s) for s in seeds]
        self._running = True
        try:
            return await self._run(seeds, allocator, budget)
        finally:
            self._running = False

    async def _run(self, seeds: list[int], allocator: Allocator | None,
                   budget: Budget | None) -> list[RolloutTree]:
        if allocator is None:
            from .allocators import Independent, IndependentOptions

            allocator = Independent(IndependentOptions(n=self.cfg.rollout.group_size))
        budget = budget or Budget(len(seeds) * self.cfg.rollout.group_size)
        self._set_deterministic()
        meter = BudgetMeter(budget)
        player = EpisodePlayer(self.policy, self.cfg, self.envs, meter,
                               snapshots=bool(getattr(allocator, "needs_snapshots", False)),
                               top_logprobs=int(getattr(allocator, "top_logprobs", 0)),
                               on_episode_done=self.on_episode_done)
        trees = [RolloutTree(meta={"env": self.env_id, "seed": s, "task": i}) for i, s in enumerate(seeds)]
        state = AllocState(trees, budget)
        self._pending, self.finished = {}, None
        try:
            while await self._round(player, allocator, state):
                state.round += 1
        except asyncio.CancelledError:
            self.finished = [t for i, t in enumerate(trees) if t.nodes and not self._pending.get(i)]
            raise
        finally:
            for tree in trees:
                _close_open_leaves(tree, "interrupted" if self.finished is not None
                                   else meter.reason() if meter.exhausted()
                                   else "paused, and not continued by the allocator")
                tree.meta.pop("_streams", None)
                tree.meta["allocator"] = getattr(allocator, "name", type(allocator).__name__)
                if not self.cfg.rollout.keep_snapshots:
                    tree.snapshots.clear()
            _finish(allocator, state)
        state.spent = meter.spent
        for tree in trees:
            tree.meta["budget"] = {"unit": budget.unit, "total": budget.total, "spent": meter.spent}
        if state.report and trees:
            trees[0].meta["allocation_report"] = json.loads(json.dumps(state.report, default=str))
        return trees

    async def _round(self, player: EpisodePlayer, allocator: Allocator, state: AllocState) -> bool:
        """Plan one round, play its paths concurrently, and number its new nodes by the plan;
        False when there is nothing (more) to play."""
        trees, meter = state.trees, player.meter
        state.spent = meter.spent
        try:
            requests = list(allocator.plan(state) or ())  # a generator too: it is read twice
        except Exception as e:  # the allocator's own bug: the run stops, saying whose
            name = getattr(allocator, "name", type(allocator).__name__)
            e.add_note(f"allocator {name!r} raised planning round {state.round}")
            raise
        if not requests:
            return False
        jobs: list[tuple[int, Any]] = []
        cut: dict[tuple[int, int], int] = {}
        ok = []
        for req in requests:
            if problem := _request_problem(trees, req):
                _reject(state, allocator, req, problem)
            else:
                ok.append(req)
        for req in _forks_in_token_order(ok):
            if isinstance(req, Branch) and (problem := _fork_problem(trees[req.task], req, cut)):
                _reject(state, allocator, req, problem)
                continue
            req = meter.admit(trees[req.task], req, state.report)
            if req is None:
                continue
            made = (self._fresh_jobs(player, trees, req) if isinstance(req, Fresh)
                    else self._branch_jobs(player, trees, req, cut))
            jobs += [(req.task, job) for job in made]
        if not jobs:
            return False
        firsts = [len(t.nodes) for t in trees]  # the round's nodes get ids from here
        sem = asyncio.Semaphore(self.cfg.rollout.concurrency)
        pending = self._pending
        for task, _ in jobs:
            pending[task] = pending.get(task, 0) + 1

        async def bounded(task: int, job: Any) -> None:
            try:
                async with sem:
                    await job
            except asyncio.CancelledError:
                job.close()  # one cancelled while it waited its turn never started: no warning
                raise
            pending[task] -= 1  # not on cancellation: that task is then unfinished

        await asyncio.gather(*(bounded(task, job) for task, job in jobs))
        for tree, first in zip(trees, firsts, strict=True):  # ids by plan, not by completion
            renumber(tree, first, lambda n: player.keys[id(n)])
        player.keys.clear()
        return True


def _finish(allocator: Allocator, state: AllocState) -> None:
    """The allocator's ``finish(state)``, where it has one, however the run ended: the
    contrastive allocator wrote its prefix groups only on its last, empty plan, so an
    interrupted run's finished trees had none. Its error is warned about, not raised: it
    runs while the run's own exception (a Ctrl-C) may be on its way out."""
    finish = getattr(allocator, "finish", None)
    if finish is None:
        return
    try:
        finish(state)
    except Exception as e:
        name = getattr(allocator, "name", type(allocator).__name__)
        warnings.warn(f"allocator {name!r} raised in finish: {type(e).__name__}: {e}", RuntimeWarning,
                      stacklevel=3)


def _task_seed(seed: Any) -> int:
    """``seed`` as a plain int (a numpy one too: the tree's meta is written as JSON), or a
    ``ValueError`` naming it: a float or str seed would fail every episode's reset, or pass
    as another task."""
    if isinstance(seed, bool):
        raise ValueError(f"task seed {seed!r} is not an integer")
    try:
        return operator.index(seed)
    except TypeError:
        raise ValueError(f"task seed {seed!r} is not an integer") from None


def _whole(x: Any) -> bool:
    """An int (a numpy one too), not a bool."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def _request_problem(trees: list[RolloutTree], req: Any) -> str | None:
    """Why the engine cannot play ``req`` as given (None: it can), before any fork of its
    round splits a node; ``_fork_problem`` checks a segment fork's token after them."""
    if not isinstance(req, Fresh | Branch):
        return f"not a Fresh or Branch request: {req!r}"
    if not (_whole(req.task) and 0 <= req.task < len(trees)):  # -1 was the last tree
        return f"task {req.task!r}; this run has tasks 0..{len(trees) - 1}"
    key, count = ("n", req.n) if isinstance(req, Fresh) else ("k", req.k)
    if not (_whole(count) and count >= 1):  # a negative one gave leaves back to the budget
        return f"{key}={count!r}: episodes to play must be a whole number >= 1"
    if req.max_turns is not None and not (_whole(req.max_turns) and req.max_turns >= 1):
        return f"max_turns={req.max_turns!r}: must be null or a whole number >= 1"
    if isinstance(req, Fresh):
        return None
    tree = trees[req.task]
    if not (_whole(req.node) and req.node in tree.nodes):
        return f"branch from unknown node {req.node!r} of task {req.task} (it has {len(tree.nodes)} nodes)"
    node = tree.nodes[req.node]
    if req.at_token is None and (node.done or node.partial):
        return (f"branch from node {req.node} of task {req.task}: the episode ended there or the turn "
                "is not finished (partial); fork a turn with at_token")
    if req.at_token is not None and not _whole(req.at_token):
        return f"segment fork at token {req.at_token!r} of node {req.node}: not a whole number"
    return None


def _fork_problem(tree: RolloutTree, req: Branch, cut: dict[tuple[int, int], int]) -> str | None:
    """Why a segment fork's ``at_token`` is out of its node's action, as the allocator saw it
    (``cut``: tokens this round's earlier forks split off its front); None for a turn branch."""
    if req.at_token is None:
        return None
    node, m, off = tree.nodes[req.node], req.at_token, cut.get((req.task, req.node), 0)
    if not off <= m < off + len(node.action_ids) or m <= 0 or node.partial:
        return (f"segment fork at token {m} of node {req.node} of task {req.task}, with "
                f"{off + len(node.action_ids)} action tokens: fork after 1 to (tokens - 1)")
    return None


def _reject(state: AllocState, allocator: Allocator, req: Any, problem: str) -> None:
    """Fail one request the engine cannot play: the allocator's bug, so warned about loudly and
    recorded in the run's allocation report (``summarize`` counts them), while the rest of the
    round plays on. Nothing is charged to the budget."""
    name = getattr(allocator, "name", type(allocator).__name__)
    warnings.warn(f"allocator {name!r} asked for a request the engine cannot play, skipped: {problem}",
                  RuntimeWarning, stacklevel=3)
    state.report.setdefault("rejected_requests", []).append(
        {"allocator": name, "round": state.round, "request": repr(req), "reason": problem})


def _forks_in_token_order(requests: list[Any]) -> list[Any]:
    """The requests, with the segment forks of each node in the order of their ``at_token``
    (each in a place one of them had): a split moves the node's first tokens into a partial
    node, so the fork after the fewest tokens splits first, and the next splits what is left."""
    places: dict[tuple[int, int], list[int]] = {}
    for i, req in enumerate(requests):
        if isinstance(req, Branch) and req.at_token is not None:
            places.setdefault((req.task, req.node), []).append(i)
    out = list(requests)
    for idx in places.values():
        for i, req in zip(idx, sorted((requests[i] for i in idx), key=lambda r: r.at_token), strict=True):
            out[i] = req
    return out


def _close_open_leaves(tree: RolloutTree, reason: str) -> None:
    """Leaves still paused when the run ends are truncated, with the reason."""
    for leaf in tree.leaves():
        if leaf.open:
            leaf.open = False
            leaf.truncated = True
            leaf.info["truncation_reason"] = reason


def _run_sync(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        running = False
    else:
        running = True
    if running:
        coro.close()
        raise RuntimeError("an event loop is running here: await Engine(...).run(...) instead")
    return asyncio.run(coro)


def collect(env_id: str, policy: Policy, cfg: Config, seeds: list[int],
            allocator: Allocator | str | None = None, budget: Budget | None = None,
            on_episode_done: Callable[[RolloutTree], None] | None = None) -> list[RolloutTree]:
    """Sync entry point: one tree per task seed, grown by ``allocator`` (default
    ``cfg.rollout.allocator``) within ``budget`` (default from the config).

    Ctrl-C raises ``RunInterrupted`` (a ``KeyboardInterrupt``) with the tasks that had
    finished, once the episodes still running are cancelled.
    """
    from .allocators import rollout_allocator

    r = cfg.rollout
    if allocator is None or isinstance(allocator, str):
        allocator = rollout_allocator(r, allocator)
    if budget is None:  # no rollout.budget: episodes * group_size leaves, whatever budget_unit says
        budget = Budget(r.budget, r.budget_unit) if r.budget else Budget(len(seeds) * r.group_size)
    engine = Engine(policy, cfg, env_id, on_episode_done)
    try:
        return _run_sync(engine.run(seeds, allocator, budget))
    except KeyboardInterrupt as e:
        if engine.finished is None or isinstance(e, RunInterrupted):
            raise
        raise RunInterrupted(engine.finished) from e
    finally:
        engine.close()


def run_episodes(env_id: str, policy: Policy, cfg: Config,
                 on_episode_done: Callable[[RolloutTree], None] | None = None) -> list[RolloutTree]:
    """``cfg.rollout.episodes`` tasks (env seeds ``seed, seed+1, ...``), each grown by the
    configured allocator; with the defaults, one linear episode per task."""
    seeds = [cfg.rollout.seed + i for i in range(cfg.rollout.episodes)]
    return collect(env_id, policy, cfg, seeds, on_episode_done=on_episode_done)
