"""The rollout engine: many episodes at once against one policy, grown into trees.

An asyncio orchestrator. Each episode is a coroutine that alternates
``await policy.agenerate(request)`` and an env step run off the loop (a thread
pool, a sandboxed tool env's own loop, or a Ray env worker, the last two awaited
directly: ``agentrl.distributed.env_workers``). No episode waits
for another: when its env step returns, its next request goes straight to the
backend, which batches whatever is pending (``hf``'s micro-batcher, vLLM's
continuous batching).

Work comes from an allocator (``agentrl.rollout.allocators``) in rounds:
``Fresh`` episodes become roots of their task's tree, ``Branch``es grow it from
a node (``agentrl.rollout.tree``). The engine charges every request to the
budget and never overspends it.

Limits end an episode as truncated, with the limit named in
``node.info["truncation_reason"]``: per-turn tokens (``finish_reason=length``),
context tokens, turns, and the budget. A failure (env step, reset, sandbox,
generation, or ``episode_timeout_s``) fails only its episode: the reason goes
into ``Node.error`` of the path's last node (an empty error node when no turn
was recorded), and the rest of the batch goes on.

Every turn carries the policy version that sampled it, so an episode that
spans a weight update keeps per-token versions (``Episode.versions``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..chat import ChatContext
from ..config import Config
from ..env import make_env
from ..errors import ConfigError, ContextOverflowError, RolloutError
from ..policy.base import GenerateRequest, Policy, SamplingParams, action_text, request_seed
from ..types import Node, RolloutTree
from .allocators import Allocator, AllocState, Branch, Budget, Fresh, leaf_cost
from .pool import DaemonPool
from .tree import BranchPoint, renumber, split_node

__all__ = ["COUNTERS", "Engine", "collect", "jsonable_info", "observation_messages", "opening_messages", "run_episodes"]

_HEAVY_INFO = ("admissible_actions", "tools", "tools_prompt")
_JSON_SCALARS = (str, int, float, bool, type(None))  # exact types: a subclass may dump differently
# Per-tree counts, exact: tokens sampled, prompt tokens prefilled or served
# from the backend's prefix cache, context tokens a branch inherited instead of
# replaying, env steps played and replayed to rebuild a branch point.
COUNTERS = ("generated_tokens", "prefilled_tokens", "reused_tokens", "shared_tokens",
            "env_steps", "env_steps_replayed")


class _BudgetSpent(Exception):
    """A path that would start after the budget is spent: nothing is recorded."""


def observation_messages(obs: str, info: dict[str, Any], cfg: Config) -> list[dict[str, Any]]:
    """The chat messages an env answer becomes: tool messages, or one user message
    (with the admissible actions listed when ``rollout.show_admissible``)."""
    if info.get("tool_messages"):  # tool envs answer with role=tool messages
        return [{k: v for k, v in m.items() if v is not None} for m in info["tool_messages"]]
    text = obs
    if cfg.rollout.show_admissible and info.get("admissible_actions"):
        text += "\nValid actions: " + ", ".join(map(str, info["admissible_actions"]))
    return [{"role": "user", "content": text}]


def opening_messages(obs: str, info: dict[str, Any], cfg: Config) -> list[dict[str, Any]]:
    """The opening conversation: the system prompt plus a tool env's tool list, then the first observation."""
    messages = []
    system = [p for p in (cfg.rollout.system_prompt, info.get("tools_prompt")) if p]
    if system:
        messages.append({"role": "system", "content": "\n\n".join(system)})
    return messages + observation_messages(obs, info, cfg)


def jsonable_info(info: dict[str, Any]) -> dict[str, Any]:
    """Info minus per-step lists, made JSON-safe so trees serialize."""
    kept = {k: v for k, v in info.items() if k not in _HEAVY_INFO}
    if all(type(k) is str and type(v) in _JSON_SCALARS for k, v in kept.items()):
        return kept  # what a JSON round trip would give back: skip it (the usual info)
    return json.loads(json.dumps(kept, default=str))


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


class Engine:
    """Runs allocator plans: episodes and branches, concurrently, into trees.

    ``env_id`` and ``cfg.env.kwargs`` make the envs; one tree per task seed.
    Use ``await engine.run(seeds, allocator)``, or the sync ``collect``.
    """

    def __init__(self, policy: Policy, cfg: Config, env_id: str | None = None,
                 on_episode_done: Callable[[RolloutTree], None] | None = None):
        self.policy, self.cfg = policy, cfg
        self.env_id = env_id or cfg.env.id
        self.on_episode_done = on_episode_done
        self.tokenizer = policy.tokenizer
        self._pool = DaemonPool()
        self._idle: list[Any] = []
        self._all: list[Any] = []
        self._closers: list[threading.Thread] = []
        self._making: set[Future[Any]] = set()  # envs being made for episodes that may give up on them
        self._snapshots = False
        self._top_logprobs = 0
        self._budget: Budget | None = None
        self._spent = 0
        self._running = False
        self._keys: dict[int, tuple[int, int]] = {}  # id(node) -> (stream, nth node of its path)
        self._env_workers = None
        if cfg.rollout.env_executor == "ray":  # Ray actors host the envs (agentrl.distributed)
            from ..distributed.env_workers import env_worker_pool

            self._env_workers = env_worker_pool(cfg, self.env_id)

    # -- envs --------------------------------------------------------------------
    async def _call(self, env: Any, method: str, *args: Any) -> Any:
        """Run an env method off the loop; a sandboxed tool env's coroutine is awaited directly.

        Methods are called on ``env.unwrapped``: a branch restores the inner env,
        which ``gymnasium.make``'s order-enforcing wrapper would not know about.
        """
        inner = env.unwrapped
        remote = getattr(inner, "acall", None)  # hosted by a Ray env worker: await the call itself
        if remote is not None:
            return await remote(method, *args)
        on_env_loop = getattr(inner, "run_coroutine", None)  # ToolEnv: awaits a call on the env's loop
        native = getattr(inner, f"a{method}", None) if method in ("step", "reset") else None
        if native is not None and on_env_loop is not None:
            return await on_env_loop(native(seed=args[0]) if method == "reset" else native(*args))
        fn = getattr(inner, method)
        if self.cfg.rollout.env_executor == "inline":  # microsecond steps: a thread hop costs more
            return fn(seed=args[0]) if method == "reset" else fn(*args)
        loop = asyncio.get_running_loop()
        if method == "reset":
            return await loop.run_in_executor(self._pool, lambda: fn(seed=args[0]))
        return await loop.run_in_executor(self._pool, fn, *args)

    def _make_env(self) -> Any:
        if self._env_workers is not None:
            return self._env_workers.make_env()
        if self.cfg.rollout.env_executor == "process":
            from ..env_process import ProcessEnv

            return ProcessEnv(self.env_id, **self.cfg.env.kwargs)
        return make_env(self.env_id, **self.cfg.env.kwargs)

    async def _acquire(self) -> Any:
        if self._idle:
            return self._idle.pop()
        made = self._pool.submit(self._make_env)
        self._making.add(made)
        try:
            env = await asyncio.wrap_future(made)
        except asyncio.CancelledError:  # timed out while the env starts: ``close`` closes what it makes
            raise
        except BaseException:
            self._making.discard(made)
            raise
        self._making.discard(made)
        self._all.append(env)
        return env

    def _release(self, env: Any, healthy: bool, hung: bool = False) -> None:
        if healthy:
            self._idle.append(env)
            return
        self._all.remove(env)
        kill = getattr(env, "kill", None)
        if hung and kill is not None:  # a timed-out process env: its group is killed and reaped now
            kill()
            return
        # A timed-out or crashed env may still be mid-step in a thread: never
        # reuse it; close it on a thread of its own.
        t = threading.Thread(target=_close_quietly, args=(env,), daemon=True, name="agentrl-env-close")
        t.start()
        self._closers.append(t)

    def close(self) -> None:
        """Close every env (each in its own try) and the step pool."""
        envs, self._all, self._idle = self._all, [], []
        for env in envs:
            _close_quietly(env)
        deadline = time.monotonic() + _CLOSE_WAIT_S
        for made in list(self._making):  # its episode timed out while it started (a loaded machine)
            try:
                _close_quietly(made.result(timeout=max(0.0, deadline - time.monotonic())))
            except BaseException:  # noqa: BLE001 - it failed to start, or still starts: nothing to close
                pass
        self._making.clear()
        for t in self._closers:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _opening(self, obs: str, info: dict[str, Any]) -> ChatContext:
        limit = self.cfg.rollout.max_context_tokens
        try:
            ctx = ChatContext(self.tokenizer, opening_messages(obs, info, self.cfg), max_tokens=limit,
                              check_prefix=self.cfg.rollout.template_check_every or False)
        except ContextOverflowError as e:
            raise RolloutError(f"opening prompt over budget: {e}") from None
        if len(ctx) >= limit:
            raise RolloutError(f"opening prompt leaves no room for an action in {len(ctx)} tokens")
        return ctx

    # -- budget --------------------------------------------------------------------
    def _reserve(self, tokens: int) -> int:
        """Charge one turn of up to ``tokens`` tokens; returns the tokens allowed (0: spent)."""
        b = self._budget
        if b is None or b.unit == "leaves":
            return tokens
        left = b.total - self._spent
        if left <= 0:
            return 0
        if b.unit == "turns":
            self._spent += 1
            return tokens
        self._spent += min(tokens, left)
        return min(tokens, left)

    def _refund(self, reserved: int, used: int) -> None:
        if self._budget is not None and self._budget.unit == "tokens":
            self._spent -= reserved - used

    # -- one episode ---------------------------------------------------------------
    def _spent_all(self) -> bool:
        b = self._budget
        return b is not None and b.unit != "leaves" and self._spent >= b.total

    async def _start(self, tree: RolloutTree, task: int, stream: int) -> _Path:
        if self._spent_all():  # do not reset an env for a path that cannot take a turn
            raise _BudgetSpent
        try:
            env = await self._acquire()
        except Exception as e:
            raise RolloutError(f"making the env raised {type(e).__name__}: {e}") from None
        try:
            obs, info = await self._call(env, "reset", tree.meta["seed"])
        except Exception as e:
            self._release(env, healthy=False)
            raise RolloutError(f"env.reset raised {type(e).__name__}: {e}") from None
        tree.meta.setdefault("instruction", info.get("instruction", ""))
        if info.get("state_key") is not None:  # the opening state, for GiGPO's anchor groups
            tree.meta.setdefault("state_key", info["state_key"])
        if info.get("privileged") is not None:  # for a distillation teacher; never in a prompt
            tree.meta.setdefault("privileged", str(info["privileged"]))
        try:
            ctx = self._opening(obs, info)
        except RolloutError:
            self._release(env, healthy=True)
            raise
        if "root" not in tree.snapshots and self._snapshots:
            # a segment fork of a first turn starts here (each fresh root renders its own opening)
            tree.snapshots["root"] = BranchPoint(await self._snapshot(env), ctx.fork(), list(ctx.ids), 0)
        return _Path(task, tree, env, ctx, list(ctx.ids), None, 0, stream)

    async def _snapshot(self, env: Any) -> Any:
        try:
            return await self._call(env, "snapshot")
        except Exception:  # cannot snapshot: branches replay the action prefix instead
            return None

    async def _play(self, path: _Path, max_turns: int | None = None,
                    prefix: tuple[list[int], list[float], list[float]] | None = None) -> None:
        """Play turns until done, a limit, or ``max_turns`` (then the leaf stays open)."""
        r, s = self.cfg.rollout, self.cfg.sampling
        played = 0
        while True:
            head, head_lps, head_ents = prefix or ([], [], [])
            prefix = None
            room = r.max_context_tokens - len(path.ctx) - len(head)
            want = min(s.max_new_tokens - len(head), room)
            if want <= 0:
                raise RolloutError("context budget: no room to continue the forked action")
            allowed = self._reserve(want)
            if allowed == 0:
                self._truncate_last(path, f"budget: {self._budget.total} {self._budget.unit} spent")
                return
            params = SamplingParams(
                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=allowed,
                stop=tuple(s.stop), logprobs=self._top_logprobs,
                seed=request_seed(r.seed, path.tree.meta["seed"], path.task, path.stream, path.turns))
            try:  # the prompt is a new list: the context grows in place after the call
                res = await self.policy.agenerate(GenerateRequest(path.ctx.ids + head, params))
            except BaseException as e:  # a timeout cancels us here: refund, then go on failing
                self._refund(allowed, 0)
                if not isinstance(e, Exception):
                    raise
                raise RolloutError(f"generation failed: {type(e).__name__}: {e}") from None
            self._refund(allowed, len(res.token_ids))
            c = _counters(path.tree)
            c["generated_tokens"] += len(res.token_ids)
            c["prefilled_tokens"] += len(path.ctx) + len(head) - res.cached_tokens
            c["reused_tokens"] += res.cached_tokens
            ids = head + list(res.token_ids)
            try:
                path.ctx.append_action(ids, head_lps + list(res.logprobs))
            except ContextOverflowError as e:
                raise RolloutError(f"context budget: {e}") from None
            text = action_text(self.tokenizer, ids, s.stop).strip()
            node = Node(context_ids=path.pending, action_ids=list(res.token_ids),
                        logprobs=list(res.logprobs), entropies=list(res.entropies),
                        version=res.version, action_text=text, finish_reason=res.finish_reason)
            if res.top_logprobs:
                node.top1 = [round(_top1(t), 6) for t in res.top_logprobs]
            if head:  # a segment fork: this node continues a partial one
                node.context_ids = []
            path.turns += 1
            played += 1
            if r.record_expert_actions:  # what the expert would do in the state this turn acted in
                try:
                    which = "oracle_action" if r.record_expert_actions == "oracle" else "expert_action"
                    node.expert_action = str(await self._call(path.env, which))
                except Exception as e:  # no expert, or it failed: the teacher skips this turn
                    node.expert_action_error = f"{type(e).__name__}: {e}"
            try:
                obs, reward, terminated, truncated, info = await self._call(path.env, "step", text)
            except Exception as e:
                node.error = f"env.step raised {type(e).__name__}: {e}"
                node.truncated = True
                self._add(path, node)
                raise RolloutError(node.error, env_broken=True) from None
            c["env_steps"] += 1
            node.observation, node.reward = obs, float(reward)
            node.terminated, node.truncated = bool(terminated), bool(truncated)
            node.info.update(jsonable_info(info))
            if info.get("error"):  # the env failed the episode itself and said why
                node.error = str(info["error"])
            if not node.done and path.turns >= r.max_turns:
                node.truncated = True
                node.info["truncation_reason"] = f"max_turns={r.max_turns}"
                if r.record_next_context:
                    self._record_next_context(node, path, observation_messages(obs, info, self.cfg))
            if not node.done:
                try:
                    path.pending = path.ctx.append_observation(observation_messages(obs, info, self.cfg))
                except ContextOverflowError as e:
                    node.truncated = True
                    node.info["truncation_reason"] = f"context budget: {e}"
                else:
                    if len(path.ctx) >= r.max_context_tokens:  # full: no action fits
                        node.truncated = True
                        node.info["truncation_reason"] = (
                            f"context budget: {len(path.ctx)} of {r.max_context_tokens} tokens used")
            if res.finish_reason == "length" and "truncation_reason" not in node.info:
                node.info["turn_truncated"] = f"max_new_tokens={params.max_new_tokens}"
            self._add(path, node)
            if node.error:
                raise RolloutError(node.error)
            if node.done:
                return
            paused = max_turns is not None and played >= max_turns
            if paused:
                node.open = True
            if paused or self._snapshots or self.cfg.rollout.keep_snapshots:
                node.snapshot = f"n{node.id}"
                path.tree.snapshots[node.snapshot] = BranchPoint(
                    await self._snapshot(path.env), path.ctx.fork(), path.pending, path.turns)
            if paused:
                return

    def _record_next_context(self, node: Node, path: _Path, messages: list) -> None:
        """Keep the ids the next turn would have read, the state a value head bootstraps GAE
        from, if that turn could have run: it fits the context budget and renders."""
        try:
            ids = path.ctx.observation_ids(messages)
        except Exception as e:  # the cut turn is kept either way; it only bootstraps with 0
            node.info["next_context_error"] = f"{type(e).__name__}: {e}"
            return
        if len(path.ctx) + len(ids) < self.cfg.rollout.max_context_tokens:
            node.info["next_context_ids"] = ids

    def _truncate_last(self, path: _Path, reason: str) -> None:
        """End the path as truncated: its last own node, or a new empty one."""
        node = self._last_own(path)
        node.truncated = True
        node.open = False
        node.info["truncation_reason"] = reason

    def _last_own(self, path: _Path) -> Node:
        if path.added:
            return path.tree.nodes[path.parent]  # type: ignore[index]
        return self._add(path, Node(context_ids=path.pending, truncated=True))

    def _add(self, path: _Path, node: Node) -> Node:
        """Add the path's next node. Its id is provisional until the round ends; then
        ``renumber`` orders the round's nodes by (path stream, nth node of the path)."""
        path.tree.add(node, path.parent)
        self._keys[id(node)] = (path.stream, path.added)
        path.parent, path.added = node.id, path.added + 1
        return node

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

    async def _episode(self, start: Callable[[], Any], tree: RolloutTree, max_turns: int | None,
                       stream: int, prefix: Any = None, anchor: int | None = None) -> None:
        """One path (seed stream ``stream``) to its end, under the per-episode timeout;
        failures stay inside.

        ``anchor`` is the node the path starts under (None: a new root), where a
        failure before its first turn is recorded.
        """
        box: list[_Path] = []
        healthy, hung = True, False
        t0 = time.monotonic()

        async def go() -> None:
            box.append(await start())
            await self._play(box[0], max_turns, prefix)

        def fail(reason: str) -> None:
            self._fail(tree, box[0] if box else None, reason, anchor, stream)

        try:
            await asyncio.wait_for(go(), self.cfg.rollout.episode_timeout_s)
        except _BudgetSpent:
            return
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
                self._release(box[0].env, healthy, hung)
        if self.on_episode_done:
            self.on_episode_done(tree)

    # -- requests ------------------------------------------------------------------
    @staticmethod
    def _stream(tree: RolloutTree) -> int:
        """The next path's seed stream, taken when its job is made, so runs repeat exactly."""
        stream = tree.meta.get("_streams", 0)
        tree.meta["_streams"] = stream + 1
        return stream

    def _fresh_jobs(self, trees: list[RolloutTree], req: Fresh) -> list[Any]:
        tree = trees[req.task]
        jobs = []
        for _ in range(req.n):
            stream = self._stream(tree)
            start = functools.partial(self._start, tree, req.task, stream)
            jobs.append(self._episode(start, tree, req.max_turns, stream))
        return jobs

    def _branch_jobs(self, trees: list[RolloutTree], req: Branch) -> list[Any]:
        tree = trees[req.task]
        if req.node not in tree.nodes:
            raise ValueError(f"branch from unknown node {req.node} of task {req.task}")
        node = tree.nodes[req.node]
        if req.at_token is None:
            if node.done or node.partial:
                raise ValueError(f"branch from node {req.node}: the episode ended there or the turn "
                                 "is not finished (partial); fork a turn with at_token")
            point, parent, prefix = node.id, node.id, None
        else:
            m = req.at_token
            if not 0 < m < len(node.action_ids) or node.partial:
                raise ValueError(f"segment fork at token {m} of node {req.node} with "
                                 f"{len(node.action_ids)} action tokens")
            part = split_node(tree, node.id, m)
            parent = part.id
            point = tree.turn_parent(part.id)  # the state before the turn: above any earlier forks
            head = tree.turn_nodes(part.id)
            prefix = ([t for n in head for t in n.action_ids], [x for n in head for x in n.logprobs],
                      [x for n in head for x in n.entropies])
        jobs = []
        for _ in range(req.k):
            stream = self._stream(tree)
            start = functools.partial(self._resume, tree, req.task, point, parent, prefix, stream)
            jobs.append(self._episode(start, tree, req.max_turns, stream, prefix, anchor=parent))
        return jobs

    async def _resume(self, tree: RolloutTree, task: int, point_node: int | None, parent: int,
                      prefix: Any, stream: int) -> _Path:
        """A new path from the state after ``point_node`` (None: the reset): restore the
        env from its snapshot or replay the actions, and fork the context."""
        if self._spent_all():
            raise _BudgetSpent
        tree.nodes[parent].open = False  # continued: no longer a paused leaf
        key = "root" if point_node is None else tree.nodes[point_node].snapshot
        point = tree.snapshots.get(key) if key else None
        try:
            env = await self._acquire()
        except Exception as e:
            raise RolloutError(f"making the env raised {type(e).__name__}: {e}") from None
        c = _counters(tree)
        try:
            if point is not None and point.env is not None:
                await self._call(env, "restore", point.env)
            else:
                point = await self._replay(env, tree, point_node)
        except RolloutError as e:
            self._release(env, healthy=False)
            raise RolloutError(str(e), env_broken=True) from None
        except Exception as e:
            self._release(env, healthy=False)
            raise RolloutError(f"restore for a branch raised {type(e).__name__}: {e}", env_broken=True) from None
        ctx = point.ctx.fork()
        c["shared_tokens"] += len(ctx) + (len(prefix[0]) if prefix else 0)
        path = _Path(task, tree, env, ctx, point.pending, parent, point.turns, stream)  # shared list
        if prefix is not None:
            path.pending = []
        return path

    async def _replay(self, env: Any, tree: RolloutTree, upto: int | None) -> BranchPoint:
        """Rebuild a branch point by reset + replaying the actions on the path to ``upto``."""
        obs, info = await self._call(env, "reset", tree.meta["seed"])
        ctx = self._opening(obs, info)
        pending, turns = list(ctx.ids), 0
        for node in (tree.path(upto) if upto is not None else []):
            if node.partial:
                continue
            ctx.append_action([t for n in tree.turn_nodes(node.id) for t in n.action_ids])
            obs, _, _, _, info = await self._call(env, "step", node.action_text)
            _counters(tree)["env_steps_replayed"] += 1
            if obs != node.observation:
                raise RolloutError(f"replay diverged at node {node.id}: the env is not deterministic "
                                   "and cannot snapshot, so it cannot be branched")
            pending = ctx.append_observation(observation_messages(obs, info, self.cfg))
            turns += 1
        # The replayed context must be the stored one, token for token (the reset text,
        # listed actions and tool messages count too), or the branch would train on
        # tokens its policy never saw.
        path = tree.path(upto) if upto is not None else []
        stored = [t for n in path for t in n.context_ids + n.action_ids]
        first = tree.nodes[tree.roots[0]].context_ids if not path and tree.roots else None
        nxt = [tree.nodes[c].context_ids for c in (path[-1].children if path else []) if tree.nodes[c].context_ids]
        if ctx.ids[:len(stored)] != stored or (first is not None and pending != first) \
                or (nxt and pending != nxt[0]):
            raise RolloutError(f"replay diverged from the stored tokens up to node {upto}: the env "
                               "is not deterministic and cannot snapshot, so it cannot be branched")
        return BranchPoint(None, ctx, pending, turns)

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
        self._budget, self._spent = budget, 0
        self._snapshots = bool(getattr(allocator, "needs_snapshots", False))
        self._top_logprobs = int(getattr(allocator, "top_logprobs", 0))
        trees = [RolloutTree(meta={"env": self.env_id, "seed": s, "task": i}) for i, s in enumerate(seeds)]
        state = AllocState(trees, budget)
        sem = asyncio.Semaphore(self.cfg.rollout.concurrency)

        async def bounded(job: Any) -> None:
            async with sem:
                await job

        try:
            while True:
                state.spent = self._spent
                requests = allocator.plan(state)
                if not requests:
                    break
                jobs = []
                for req in requests:
                    if budget.unit == "leaves":
                        req = _clip(trees[req.task], req, budget.total - self._spent, state.report)
                        if req is None:
                            continue
                        self._spent += leaf_cost(trees[req.task], req)
                    elif self._spent >= budget.total:
                        continue
                    make = self._fresh_jobs if isinstance(req, Fresh) else self._branch_jobs
                    jobs += make(trees, req)
                if not jobs:
                    break
                firsts = [len(t.nodes) for t in trees]  # the round's nodes get ids from here
                await asyncio.gather(*(bounded(j) for j in jobs))
                for tree, first in zip(trees, firsts, strict=True):  # ids by plan, not by completion
                    renumber(tree, first, lambda n: self._keys[id(n)])
                self._keys.clear()
                state.round += 1
        finally:
            for tree in trees:
                _close_open_leaves(tree, f"budget: {budget.total} {budget.unit} spent" if self._spent_all()
                                   else "paused, and not continued by the allocator")
                tree.meta.pop("_streams", None)
                tree.meta["allocator"] = getattr(allocator, "name", type(allocator).__name__)
                if not self.cfg.rollout.keep_snapshots:
                    tree.snapshots.clear()
        state.spent = self._spent
        for tree in trees:
            tree.meta["budget"] = {"unit": budget.unit, "total": budget.total, "spent": self._spent}
        if state.report:
            trees[0].meta["allocation_report"] = json.loads(json.dumps(state.report, default=str))
        return trees


def _close_open_leaves(tree: RolloutTree, reason: str) -> None:
    """Leaves still paused when the run ends are truncated, with the reason."""
    for leaf in tree.leaves():
        if leaf.open:
            leaf.open = False
            leaf.truncated = True
            leaf.info["truncation_reason"] = reason


def _clip(tree: RolloutTree, req: Fresh | Branch, left: int, report: dict[str, Any]) -> Fresh | Branch | None:
    """Shrink a request to the leaves left (never overspend); None when nothing fits."""
    over = leaf_cost(tree, req) - left
    if over <= 0:
        return req
    report["clipped_leaves"] = report.get("clipped_leaves", 0) + over
    if isinstance(req, Fresh):
        return Fresh(req.task, req.n - over, req.max_turns, req.reason) if req.n > over else None
    k = req.k - over
    return Branch(req.task, req.node, k, req.at_token, req.max_turns, req.reason) if k >= 1 else None


# How long ``close`` waits for the threads closing crashed envs (a hung process env
# is killed at once instead): a process env whose call failed answers ``close`` or
# is killed after 5 s for its lock and 5 s for an answer (ProcessEnv.close).
_CLOSE_WAIT_S = 20.0


def _close_quietly(env: Any) -> None:
    try:
        env.close()
    except Exception as e:
        warnings.warn(f"env.close raised {type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)


def _top1(alternatives: list[tuple[int, float]]) -> float:
    import math

    return math.exp(max(lp for _, lp in alternatives)) if alternatives else 0.0


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
    ``cfg.rollout.allocator``) within ``budget`` (default from the config)."""
    from .allocators import rollout_allocator

    r = cfg.rollout
    if allocator is None or isinstance(allocator, str):
        allocator = rollout_allocator(r, allocator)
    if budget is None:
        budget = Budget(r.budget or len(seeds) * r.group_size, r.budget_unit)
    engine = Engine(policy, cfg, env_id, on_episode_done)
    try:
        return _run_sync(engine.run(seeds, allocator, budget))
    finally:
        engine.close()


def run_episodes(env_id: str, policy: Policy, cfg: Config,
                 on_episode_done: Callable[[RolloutTree], None] | None = None) -> list[RolloutTree]:
    """``cfg.rollout.episodes`` tasks (env seeds ``seed, seed+1, ...``), each grown by the
    configured allocator; with the defaults, one linear episode per task."""
    seeds = [cfg.rollout.seed + i for i in range(cfg.rollout.episodes)]
    return collect(env_id, policy, cfg, seeds, on_episode_done=on_episode_done)
