"""One job: play one episode path turn by turn, from a reset or from a branch point, into its tree.

A path starts from the env's reset (``start``) or resumes from a node
(``resume``): the env is restored from the node's snapshot, or reset and the
actions on the path to the node replayed (``replay``), and the context forked.
Then it alternates ``await policy.agenerate(request)`` and an env step until
the episode ends, a limit cuts it, or ``max_turns`` pauses it (an open leaf to
branch from later).

Limits end an episode as truncated, with the limit named in
``node.info["truncation_reason"]``: per-turn tokens (``finish_reason=length``),
context tokens, turns, and the budget. A failure (env step, reset, sandbox,
generation, or ``episode_timeout_s``) fails only its episode: the reason goes
into ``Node.error`` of the path's last node (an empty error node when no turn
was recorded).

With ``rollout.constrain: admissible`` each turn's request carries the
admissible actions the env listed with its last answer (the reset's, a step's,
or a branch point's), and the node records them (``Node.admissible``); a turn
whose env listed none samples freely.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import operator
import time
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..chat import ChatContext, off_loop_if_long
from ..config import Config
from ..env import answer_problem, jsonable
from ..errors import ConfigError, ContextOverflowError, RolloutError
from ..types import Node, RolloutTree
from .budget import BudgetMeter, BudgetSpent
from .executors import EnvExecutor
from .tree import BranchPoint
from .turns import (
    listed_actions,
    observation_messages,
    opening_messages,
    record_next_context,
    step_node,
    top1,
)

if TYPE_CHECKING:
    from ..policy.base import Policy

__all__ = ["COUNTERS", "EpisodePlayer", "guarded_callback"]

# Per-tree counts, exact: tokens sampled, prompt tokens prefilled or served
# from the backend's prefix cache, context tokens a branch inherited instead of
# replaying, env steps played and replayed to rebuild a branch point.
COUNTERS = ("generated_tokens", "prefilled_tokens", "reused_tokens", "shared_tokens",
            "env_steps", "env_steps_replayed")

Prefix = tuple[list[int], list[float], list[float]]  # a forked turn's first action tokens, logprobs, entropies


async def _off_loop_if_long(obs: str, info: dict[str, Any], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, which tokenizes the env answer ``(obs, info)``: on a thread when it is long."""
    size = len(obs) + sum(len(str(m.get("content") or "")) for m in info.get("tool_messages") or ())
    size += len(str(info.get("tools_prompt") or ""))
    return await off_loop_if_long(size, fn, *args)


def checked_result(res: Any, backend: str, max_new_tokens: int | None = None) -> Any:
    """A backend's ``GenerateResult`` with plain Python numbers (numpy ids and float32 logprobs
    played, then failed writing the run), or a ``RolloutError`` naming the backend and the
    field that is not what ``GenerateResult`` promises: ids, logprobs and entropies one per
    sampled token (a NaN logprob refused: it poisons the update), a known ``finish_reason``,
    and no more tokens than the request's ``max_new_tokens`` (more overspent a tokens budget,
    and would train on tokens no request asked for; cutting them would pass the backend's bug
    off as a ``length`` stop)."""
    import dataclasses

    from ..policy.base import FinishReason, GenerateResult

    if not isinstance(res, GenerateResult):  # a dict, a server's JSON: dataclasses.replace raised TypeError
        raise RolloutError(f"backend {backend} returned a bad result: a {type(res).__name__}, not a GenerateResult")

    def field(name: str, convert: Callable[[Any], Any]) -> Any:
        try:
            return convert(getattr(res, name))
        except (TypeError, ValueError, AttributeError) as e:
            raise RolloutError(f"backend {backend} returned a bad {name}: {e}") from None

    ids = field("token_ids", lambda v: [_token_id(t) for t in v])
    if max_new_tokens is not None and len(ids) > max_new_tokens:
        raise RolloutError(f"backend {backend} returned {len(ids)} tokens for max_new_tokens={max_new_tokens}")

    def per_token(v: Any) -> list[float]:
        out = [_number(x) for x in v]
        if len(out) != len(ids):
            raise ValueError(f"{len(out)} values for {len(ids)} tokens")
        return out

    def logprobs(v: Any) -> list[float]:
        out = per_token(v)
        if any(math.isnan(x) for x in out):  # one makes the update's loss NaN (a NaN entropy: not known)
            raise ValueError(f"NaN at token {next(i for i, x in enumerate(out) if math.isnan(x))}")
        return out

    def tops(v: Any) -> Any:
        if not v:
            return v
        if len(v) != len(ids):
            raise ValueError(f"{len(v)} lists for {len(ids)} tokens")
        return [[(_token_id(t), _number(lp)) for t, lp in alts] for alts in v]

    def finish(v: Any) -> str:
        if v not in typing.get_args(FinishReason):
            raise ValueError(f"{v!r} is none of {', '.join(typing.get_args(FinishReason))}")
        return v

    return dataclasses.replace(
        res, token_ids=ids, logprobs=field("logprobs", logprobs), entropies=field("entropies", per_token),
        top_logprobs=field("top_logprobs", tops), finish_reason=field("finish_reason", finish),
        version=field("version", _whole), cached_tokens=field("cached_tokens", _whole))


def _whole(x: Any) -> int:
    """``x`` as an int (a numpy one too, not a bool or a float), at least 0."""
    if isinstance(x, bool):
        raise TypeError(f"{x!r} is not an integer")
    n = operator.index(x)
    if n < 0:
        raise ValueError(f"{x!r} is negative")
    return n


def _token_id(x: Any) -> int:
    try:
        return _whole(x)
    except (TypeError, ValueError):
        raise ValueError(f"token id {x!r} is not an integer >= 0") from None


def _number(x: Any) -> float:
    """A real number (a numpy one too) as a float; a string or None is refused, not parsed."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{x!r} is not a number")
    return float(x)


def _counters(tree: RolloutTree) -> dict[str, int]:
    return tree.meta.setdefault("counters", dict.fromkeys(COUNTERS, 0))


@dataclass
class _Path:
    """A live episode: its env, context and where it hangs in the tree."""

    task: int
    tree: RolloutTree
    env: Any
    ctx: ChatContext
    pending: list[int]
    parent: int | None
    turns: int
    stream: int  # seeds this path's requests apart from its siblings'
    added: int = 0  # nodes this path added; before its first, ``parent`` belongs to others
    admissible: list[str] | None = None  # what the next turn is constrained to (None: free)


class EpisodePlayer:
    """Plays the paths of one engine run against its policy, envs and budget.

    ``snapshots``: keep a branch point at every node (the allocator branches);
    ``top_logprobs``: alternatives asked per sampled token (for ``Node.top1``).
    ``keys`` holds each new node's (seed stream, nth node of its path), by which
    the engine renumbers a round's nodes.
    """

    def __init__(self, policy: Policy, cfg: Config, envs: EnvExecutor, meter: BudgetMeter,
                 snapshots: bool = False, top_logprobs: int = 0,
                 on_episode_done: Callable[[RolloutTree], None] | None = None):
        self.policy, self.cfg, self.envs, self.meter = policy, cfg, envs, meter
        self.snapshots, self.top_logprobs = snapshots, top_logprobs
        self.on_episode_done = guarded_callback(on_episode_done)
        self.keys: dict[int, tuple[int, int]] = {}  # id(node) -> (stream, nth node of its path)
        self.constrain = cfg.rollout.constrain == "admissible"
        if self.constrain and not getattr(policy, "constrains_actions", False):
            raise ConfigError(f"rollout.constrain=admissible: the {type(policy).__name__} backend cannot "
                              "constrain replies to the admissible actions; use policy.backend hf or vllm")

    def _admissible(self, info: dict[str, Any]) -> list[str] | None:
        """The actions the next turn is constrained to: the env's list, when constraining."""
        return listed_actions(info) if self.constrain else None

    # -- starting a path -------------------------------------------------------------
    def _opening(self, obs: str, info: dict[str, Any]) -> ChatContext:
        limit = self.cfg.rollout.max_context_tokens
        try:
            ctx = ChatContext(self.policy.tokenizer, opening_messages(obs, info, self.cfg), max_tokens=limit,
                              check_prefix=self.cfg.rollout.template_check_every or False)
        except ContextOverflowError as e:
            raise RolloutError(f"opening prompt over budget: {e}") from None
        if len(ctx) >= limit:
            raise RolloutError(f"opening prompt leaves no room for an action in {len(ctx)} tokens")
        return ctx

    async def _acquire(self) -> Any:
        try:
            return await self.envs.acquire()
        except Exception as e:
            raise RolloutError(f"making the env raised {type(e).__name__}: {e}") from None

    async def start(self, tree: RolloutTree, task: int, stream: int) -> _Path:
        """A new root path: reset the env to the task's seed and render the opening."""
        if not await self.meter.has_room():  # do not reset an env for a path that cannot take a turn
            raise BudgetSpent
        env = await self._acquire()
        try:
            answer = await self.envs.call(env, "reset", tree.meta["seed"])
        except asyncio.CancelledError:  # timed out mid-reset: it may still run; killed, not kept to the end
            self.envs.release(env, healthy=False, hung=True)
            raise
        except Exception as e:
            self.envs.release(env, healthy=False)
            raise RolloutError(f"env.reset raised {type(e).__name__}: {e}") from None
        if problem := answer_problem("reset", answer):
            self.envs.release(env, healthy=False)
            raise RolloutError(problem)
        obs, info = answer
        try:
            # meta is written with the tree: JSON-safe, as a step's info is (a numpy state key
            # failed writing the run after every episode had played)
            tree.meta.setdefault("instruction", jsonable(info.get("instruction", "")))
            if info.get("state_key") is not None:  # the opening state, for GiGPO's anchor groups
                tree.meta.setdefault("state_key", jsonable(info["state_key"]))
            if info.get("privileged") is not None:  # for a distillation teacher; never in a prompt
                tree.meta.setdefault("privileged", str(info["privileged"]))
            ctx = await _off_loop_if_long(obs, info, self._opening, obs, info)
        except BaseException:  # the env was reset and is well (a template's ValueError, a timeout):
            self.envs.release(env, healthy=True)  # held, each episode made one more until the run ended
            raise
        admissible = self._admissible(info)
        if "root" not in tree.snapshots and self.snapshots:
            # a segment fork of a first turn starts here (each fresh root renders its own opening)
            try:
                snap = await self._snapshot(env)
            except BaseException:  # cancelled: the snapshot may still run in its thread
                self.envs.release(env, healthy=False, hung=True)
                raise
            tree.snapshots["root"] = BranchPoint(snap, ctx.fork(), list(ctx.ids), 0, admissible)
        return _Path(task, tree, env, ctx, list(ctx.ids), None, 0, stream, admissible=admissible)

    async def _snapshot(self, env: Any) -> Any:
        try:
            return await self.envs.call(env, "snapshot")
        except Exception:  # cannot snapshot: branches replay the action prefix instead
            return None

    async def resume(self, tree: RolloutTree, task: int, point_node: int | None, parent: int,
                     prefix: Prefix | None, stream: int) -> _Path:
        """A new path from the state after ``point_node`` (None: the reset): restore the
        env from its snapshot or replay the actions, and fork the context."""
        if not await self.meter.has_room():
            raise BudgetSpent
        key = "root" if point_node is None else tree.nodes[point_node].snapshot
        point = tree.snapshots.get(key) if key else None
        env = await self._acquire()
        try:
            if point is not None and point.env is not None:
                await self.envs.call(env, "restore", point.env)
            else:
                point = await self._replay(env, tree, point_node)
        except asyncio.CancelledError:  # timed out mid-restore or replay: killed, not kept to the end
            self.envs.release(env, healthy=False, hung=True)
            raise
        except RolloutError as e:
            self.envs.release(env, healthy=False)
            raise RolloutError(str(e), env_broken=True) from None
        except Exception as e:
            self.envs.release(env, healthy=False)
            raise RolloutError(f"restore for a branch raised {type(e).__name__}: {e}", env_broken=True) from None
        ctx = point.ctx.fork()
        _counters(tree)["shared_tokens"] += len(ctx) + (len(prefix[0]) if prefix else 0)
        path = _Path(task, tree, env, ctx, point.pending, parent, point.turns, stream,  # shared list
                     admissible=point.admissible)
        if prefix is not None:
            path.pending = []
        return path

    async def _replay(self, env: Any, tree: RolloutTree, upto: int | None) -> BranchPoint:
        """Rebuild a branch point by reset + replaying the actions on the path to ``upto``."""
        answer = await self.envs.call(env, "reset", tree.meta["seed"])
        if problem := answer_problem("reset", answer):
            raise RolloutError(problem)
        obs, info = answer
        ctx = await _off_loop_if_long(obs, info, self._opening, obs, info)
        pending, turns, admissible = list(ctx.ids), 0, self._admissible(info)
        path = tree.path(upto) if upto is not None else []
        for node in path:
            if node.partial:
                continue
            ctx.append_action([t for n in tree.turn_nodes(node.id) for t in n.action_ids])
            step = await self.envs.call(env, "step", node.action_text)
            if problem := answer_problem("step", step):
                raise RolloutError(problem)
            _counters(tree)["env_steps_replayed"] += 1
            turns += 1
            admissible = self._admissible(step[4])
            again = Node()
            if step[0] != node.observation:
                raise RolloutError(f"replay diverged at node {node.id}: the env is not deterministic "
                                   "and cannot snapshot, so it cannot be branched")
            pending = await _off_loop_if_long(step[0], step[4], step_node, again, step, ctx, self.cfg, turns,
                                              self.cfg.rollout.max_turns)
            if pending is None:  # the stored episode went on from here
                raise RolloutError(f"replay diverged at node {node.id}: the episode ended "
                                   f"({again.info.get('truncation_reason', 'done')}), so it cannot be branched")
        # The replayed context must be the stored one, token for token (the reset text,
        # listed actions and tool messages count too), or the branch would train on
        # tokens its policy never saw.
        stored = [t for n in path for t in n.context_ids + n.action_ids]
        # A root that failed before its first turn holds no opening (an empty error node).
        openings = [tree.nodes[r].context_ids for r in tree.roots if tree.nodes[r].context_ids]
        first = openings[0] if not path and openings else None
        nxt = [tree.nodes[c].context_ids for c in (path[-1].children if path else []) if tree.nodes[c].context_ids]
        if ctx.ids[:len(stored)] != stored or (first is not None and pending != first) \
                or (nxt and pending != nxt[0]):
            raise RolloutError(f"replay diverged from the stored tokens up to node {upto}: the env "
                               "is not deterministic and cannot snapshot, so it cannot be branched")
        return BranchPoint(None, ctx, pending, turns, admissible)

    # -- turns -----------------------------------------------------------------------
    async def play(self, path: _Path, max_turns: int | None = None, prefix: Prefix | None = None) -> None:
        """Play turns until done, a limit, or ``max_turns`` (then the leaf stays open)."""
        played = 0
        while True:
            turn = await self._sample(path, prefix or ([], [], []))
            prefix = None
            if turn is None:
                if not path.added:  # no turn at all: dropped like a path that never started
                    raise BudgetSpent
                self._truncate_last(path, self.meter.reason())
                return
            node, allowed = turn
            path.turns += 1
            played += 1
            await self._step(path, node)
            if node.finish_reason == "length" and "truncation_reason" not in node.info:
                node.info["turn_truncated"] = f"max_new_tokens={allowed}"
            self._add(path, node)
            if node.error:
                raise RolloutError(node.error)
            if node.done:
                return
            paused = max_turns is not None and played >= max_turns
            if paused:
                node.open = True
            if paused or self.snapshots or self.cfg.rollout.keep_snapshots:
                node.snapshot = f"n{node.id}"
                path.tree.snapshots[node.snapshot] = BranchPoint(
                    await self._snapshot(path.env), path.ctx.fork(), path.pending, path.turns, path.admissible)
            if paused:
                return

    async def _sample(self, path: _Path, head: Prefix) -> tuple[Node, int] | None:
        """The policy's next action on the path as a node (no env step yet), and the tokens it
        was allowed; None when the budget is spent. ``head``: a forked turn's first tokens."""
        # Imported here, not with the module: a process env's child imports this package
        # (rollout/env_process.py), and agentrl.policy would load torch into every one.
        from ..policy.base import GenerateRequest, SamplingParams, action_text, request_seed

        r, s = self.cfg.rollout, self.cfg.sampling
        head_ids, head_lps, _ = head
        room = r.max_context_tokens - len(path.ctx) - len(head_ids)
        want = min(s.max_new_tokens - len(head_ids), room)
        if want <= 0:
            raise RolloutError("context budget: no room to continue the forked action")
        allowed = await self.meter.reserve(want)
        if allowed == 0:
            return None
        admissible = tuple(path.admissible) if path.admissible else None
        # A constrained reply ends with its action's end token: a stop string could only cut an action.
        stop = () if admissible else tuple(s.stop)
        try:  # every way out gives back the reservation: turns waiting for room wait on it
            params = SamplingParams(
                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=allowed,
                stop=stop, logprobs=self.top_logprobs,
                seed=request_seed(r.seed, path.tree.meta["seed"], path.task, path.stream, path.turns))
            request = GenerateRequest(path.ctx.ids + head_ids, params, admissible=admissible,
                                      admissible_head=len(head_ids) if admissible else 0)
            # the prompt is a new list: the context grows in place after the call
            res = await self.policy.agenerate(request)
        except BaseException as e:  # a timeout cancels us here: refund, then go on failing
            self.meter.refund(allowed, 0)
            if not isinstance(e, Exception):
                raise
            raise RolloutError(f"generation failed: {type(e).__name__}: {e}") from None
        try:
            res = checked_result(res, type(self.policy).__name__, allowed)
        except RolloutError:
            self.meter.refund(allowed, 0)  # nothing of it is recorded
            raise
        self.meter.refund(allowed, len(res.token_ids))
        c = _counters(path.tree)
        c["generated_tokens"] += len(res.token_ids)
        c["prefilled_tokens"] += len(path.ctx) + len(head_ids) - res.cached_tokens
        c["reused_tokens"] += res.cached_tokens
        ids = head_ids + list(res.token_ids)
        try:
            path.ctx.append_action(ids, head_lps + list(res.logprobs))
        except ContextOverflowError as e:
            raise RolloutError(f"context budget: {e}") from None
        node = Node(context_ids=path.pending, action_ids=list(res.token_ids),
                    logprobs=list(res.logprobs), entropies=list(res.entropies), version=res.version,
                    action_text=action_text(self.policy.tokenizer, ids, stop).strip(),
                    finish_reason=res.finish_reason, admissible=path.admissible)
        if res.top_logprobs:
            node.top1 = [round(top1(t), 6) for t in res.top_logprobs]
        if head_ids:  # a segment fork: this node continues a partial one
            node.context_ids = []
        return node, allowed

    async def _step(self, path: _Path, node: Node) -> None:
        """Step the env with the node's action and write the outcome onto the node."""
        r = self.cfg.rollout
        if r.record_expert_actions:  # what the expert would do in the state this turn acted in
            try:
                which = "oracle_action" if r.record_expert_actions == "oracle" else "expert_action"
                node.expert_action = str(await self.envs.call(path.env, which))
            except Exception as e:  # no expert, or it failed: the teacher skips this turn
                node.expert_action_error = f"{type(e).__name__}: {e}"
        try:
            step = await self.envs.call(path.env, "step", node.action_text)
            problem = answer_problem("step", step)
        except Exception as e:
            problem = f"env.step raised {type(e).__name__}: {e}"
        if problem:  # the env's failure, recorded on the turn that met it
            node.error = problem
            node.truncated = True
            self._add(path, node)
            raise RolloutError(node.error, env_broken=True)
        _counters(path.tree)["env_steps"] += 1
        obs, _, terminated, truncated, info = step
        path.admissible = self._admissible(info)
        if info.get("error"):  # the env failed the episode itself and said why
            node.error = str(info["error"])
        cut = not (terminated or truncated) and path.turns >= r.max_turns

        def write() -> list[int] | None:
            pending = step_node(node, step, path.ctx, self.cfg, path.turns, r.max_turns)
            if cut and r.record_next_context:
                record_next_context(node, path.ctx, observation_messages(obs, info, self.cfg), r.max_context_tokens)
            return pending

        pending = await _off_loop_if_long(obs, info, write)
        if pending is not None:
            path.pending = pending
            if len(path.ctx) >= r.max_context_tokens:  # full: no action fits
                node.truncated = True
                node.info["truncation_reason"] = (
                    f"context budget: {len(path.ctx)} of {r.max_context_tokens} tokens used")

    # -- the tree --------------------------------------------------------------------
    def _add(self, path: _Path, node: Node) -> Node:
        """Add the path's next node. Its id is provisional until the round ends; then
        ``renumber`` orders the round's nodes by (path stream, nth node of the path)."""
        if not path.added and path.parent is not None:  # continued: no longer a paused leaf
            path.tree.nodes[path.parent].open = False
        path.tree.add(node, path.parent)
        self.keys[id(node)] = (path.stream, path.added)
        path.parent, path.added = node.id, path.added + 1
        return node

    def _last_own(self, path: _Path) -> Node:
        if path.added:
            return path.tree.nodes[path.parent]  # type: ignore[index]
        return self._add(path, Node(context_ids=path.pending, truncated=True))

    def _truncate_last(self, path: _Path, reason: str) -> None:
        """End the path as truncated: its last own node, or a new empty one."""
        node = self._last_own(path)
        node.truncated = True
        node.open = False
        node.info["truncation_reason"] = reason

    def _fail(self, tree: RolloutTree, path: _Path | None, reason: str, anchor: int | None,
              stream: int) -> None:
        """Record why the path failed on its last own node, or on an empty node under
        ``anchor`` (its branch point; None: a new root) when it has none."""
        if path is None:  # failed before its context existed
            path = _Path(-1, tree, None, None, [], anchor, 0, stream)  # type: ignore[arg-type]
        node = self._last_own(path)
        node.truncated = True
        node.open = False
        node.error = node.error or reason

    # -- one episode, whole ----------------------------------------------------------
    async def episode(self, start: Callable[[], Any], tree: RolloutTree, max_turns: int | None,
                      stream: int, prefix: Prefix | None = None, anchor: int | None = None) -> None:
        """One path (seed stream ``stream``) to its end, under the per-episode timeout;
        failures stay inside.

        ``anchor`` is the node the path starts under (None: a new root), where a
        failure before its first turn is recorded. ``on_episode_done(tree)`` is called
        once at the end, also for a path dropped unplayed because the budget was spent.
        """
        box: list[_Path] = []
        healthy, hung = True, False
        t0 = time.monotonic()

        async def go() -> None:
            box.append(await start())
            await self.play(box[0], max_turns, prefix)

        def fail(reason: str) -> None:
            self._fail(tree, box[0] if box else None, reason, anchor, stream)

        try:
            await asyncio.wait_for(go(), self.cfg.rollout.episode_timeout_s)
        except BudgetSpent:  # never started; still reported below, so a bar of planned episodes completes
            pass
        except RolloutError as e:
            healthy = not e.env_broken
            fail(str(e))
        except TimeoutError:
            healthy, hung = False, True
            fail(f"episode timed out after {time.monotonic() - t0:.1f} s "
                 f"(rollout.episode_timeout_s={self.cfg.rollout.episode_timeout_s})")
        except asyncio.CancelledError:
            healthy, hung = False, True  # a step may still run in its thread
            raise
        except Exception as e:  # an engine bug must not take the batch down, nor go unseen
            healthy = False
            warnings.warn(f"rollout engine error in task {tree.meta.get('task')}: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=2)
            fail(f"engine error {type(e).__name__}: {e}")
        finally:
            if box:
                self.envs.release(box[0].env, healthy, hung)
        self._report_done(tree)

    def _report_done(self, tree: RolloutTree) -> None:
        if self.on_episode_done is not None:
            self.on_episode_done(tree)


def guarded_callback(callback: Callable[[RolloutTree], None] | None) -> Callable[[RolloutTree], None] | None:
    """``on_episode_done`` made safe for a run: a user's callback (a progress bar) that raises must
    not lose the batch (its error went up through the round's gather, and every episode of the run
    was lost). It is warned about once, naming it, and not called again; a ``BaseException``
    (Ctrl-C inside it) still stops the run."""
    if callback is None:
        return None
    failed = False

    def call(tree: RolloutTree) -> None:
        nonlocal failed
        if failed:
            return
        try:
            callback(tree)
        except Exception as e:
            failed = True
            warnings.warn(f"on_episode_done callback {getattr(callback, '__qualname__', callback)!r} raised "
                          f"{type(e).__name__}: {e}; the run goes on without calling it again",
                          RuntimeWarning, stacklevel=2)

    return call
