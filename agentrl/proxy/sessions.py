"""Sessions: what a harness's calls sampled, kept token-exact as a ``RolloutTree``.

Every call of a session becomes nodes of one tree, one node per choice. A
node's ``context_ids`` are the tokens added after its parent's action (all of
them for a root), its ``action_ids`` and ``logprobs`` are exactly what the
policy sampled. The prompt of a call is therefore always the parent's path
plus the node's context: nothing already recorded is ever tokenized again.

Where a call hangs (``plan_chat``, ``plan_tokens``):

- chat: the deepest recorded choice whose conversation (its call's messages
  plus the assistant message returned for it) the new messages extend, compared
  by ``messages.canonical_key``. The prompt is that choice's tokens plus the
  template rendering of the new messages only (``ChatContext.append_observation``).
  A call whose messages equal an earlier call's reuses that call's prompt. No
  match: a new root, rendered whole. Every protocol's request arrives here as
  the same internal conversation (``conversation.py``), so a session may mix
  Chat Completions, Responses and Anthropic Messages calls.
- a reply sent back in the harness's own shape: an assistant message that
  carries exactly the tool-call ids the proxy issued for one recorded choice
  (as ``tool_calls``, Responses ``function_call`` items or Anthropic
  ``tool_use`` blocks) is keyed as that choice's reply, whatever its text and
  whitespace. The recorded tokens stand, and the chain stays one token-exact
  path.
- a prefill (a final assistant message the reply continues): the call is
  planned on the messages before it, then the prefill's tokens are appended
  to its prompt and context. Its reply is keyed as prefill plus continuation,
  the one assistant message the next call's history holds.
- completions: the deepest node whose path tokens start the token prompt.

A call whose parent already has children starts a branch (``branch_info``):

- ``retry``: the same prompt as a sibling (siblings then share one context);
- ``edit``: a message of the history was replaced and every message the
  earlier call sent after it kept, or a prefill was added, dropped or
  changed after messages the earlier call sent;
- ``compaction``: the history got shorter (dropped or summarized messages),
  e.g. ``[system, summary]`` after some turns;
- ``tools_changed``: the same messages under different tools;
- ``rerendered``: the history sends a recorded reply back in another form
  than the one returned (its calls written out as text, with their ids or
  their names and arguments, or its whitespace reformatted;
  ``conversation.rerendering``). The call is recorded on the tokens the model
  is shown, the harness's rendering: a branch beside the recorded reply, from
  the same prompt, whose context holds that rendering. ``info["branch"]["by"]``
  says how the reply was recognised;
- ``divergence``: anything else, e.g. a sub-agent with its own system prompt,
  or a token prompt that leaves the recorded path.

The branch point (the parent node, the message index and the token offset
where the histories part) is kept on the branch's first node
(``info["branch"]``) and in ``Session.branches``. The reasons other than
``retry`` are read from message shapes, so they are a best guess.

Assembly (``Session.assemble``): leaves other than the last call's choices end
paths the harness left (a retried call, an unpicked choice, an edited
history): they are marked ``truncated`` with ``info["abandoned"] = True``, and
keep reward 0 unless a reward is set on their call. Every assembly makes
these marks (and ``side_conversation``, ``continued_by`` below) afresh: an
earlier one (a GET of the tree mid-session) judged a session the harness then
went on with.

A side conversation is different too: a root whose first message is not the
main conversation's (a harness's title or topic call under another system
prompt, a sub-agent) is part of the episode, not a path the harness left.
Its latest leaf carries ``info["side_conversation"]`` and the session's
reward, as the last call's choices do.

A compaction is different: the harness did not leave the path it compacted,
it went on from the state that path produced, in fewer tokens; so is a
re-rendering, where it went on from the recorded reply shown in its own
words. So the compacted path's leaf (the choices of the call the compaction
branched from, or the re-rendered choice: ``branch["continues"]``) is not
abandoned. It carries ``info["continued_by"]``
(the compacting call's id), and the session's reward (``set_reward`` without a
``call_id``) goes to it as well as to the last call's choices, with the same
``terminated``/``truncated``, transitively over repeated compactions. Credit
then treats every path that led to the final one as an episode with the
session's outcome: in harness training, the turns before a compaction or a
re-rendering are trained toward the reward they earned instead of toward 0.
Such a session thus adds one episode per compaction or re-rendered reply to
its group, each with the same return.
"""

from __future__ import annotations

import itertools
import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from agentrl.chat import ChatContext
from agentrl.policy.base import GenerateResult, request_seed
from agentrl.types import Node, RolloutTree

from .conversation import PromptSpec, canonical, chain_keys, key_of, prefill_key, rerendering

__all__ = ["Call", "Plan", "Session"]

# Branches whose harness went on from the state the earlier path produced: that path is not
# abandoned, and the session's reward reaches it (see the module docstring).
_CONTINUING = ("compaction", "rerendered")


@dataclass(slots=True)
class Plan:
    """Where a call goes and what its prompt is, decided before it is sampled."""

    kind: str
    prompt_ids: list[int]
    parent: int | None
    context_ids: list[int]
    ctx: ChatContext | None = None
    keys: list[str] = field(default_factory=list)
    chain: list[str] = field(default_factory=list)
    render_key: str = ""
    new_messages: list[dict[str, Any]] = field(default_factory=list)
    rerendered: dict[str, Any] | None = None  # the recorded reply the history re-renders
    reply_base: str = ""  # chain key a reply extends: of the messages before a prefill, if any


@dataclass(slots=True)
class Call:
    """One recorded call: its prompt, its choices' nodes, version and timing."""

    call_id: str
    kind: str
    prompt_ids: tuple[int, ...]
    parent: int | None
    context_ids: list[int]
    node_ids: list[int]
    version: int
    timing: dict[str, float]
    branch: dict[str, Any] | None
    keys: tuple[str, ...]  # a tuple, as ``prompt_ids`` is: out of the collector's walks
    render_key: str
    reply_keys: list[str]
    ctx: ChatContext | None
    replies: list[dict[str, Any]] = field(default_factory=list)  # canonical reply messages
    issued: list[tuple[str, ...]] = field(default_factory=list)  # tool-call ids issued per choice
    model: str = ""
    api: str = ""

    def summary(self) -> dict[str, Any]:
        return {"call_id": self.call_id, "kind": self.kind, "prompt_tokens": len(self.prompt_ids),
                "reused_tokens": len(self.prompt_ids) - len(self.context_ids),
                "nodes": self.node_ids, "version": self.version, "timing": self.timing,
                "branch": self.branch, "api": self.api, "model": self.model}


def _prompt_digest(ids: list[int]) -> int:
    return request_seed(*ids) if ids else 0


class Session:
    """The calls of one harness episode and the tree they make."""

    def __init__(self, session_id: str, api_key: str | None = None, meta: dict[str, Any] | None = None,
                 check_prefix: bool | int = 8, seed: int | None = None):
        self.session_id = session_id
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.meta = dict(meta or {})
        self.check_prefix = check_prefix
        self.tree = RolloutTree(meta={"session_id": session_id, **self.meta})
        self.calls: list[Call] = []
        self.by_id: dict[str, Call] = {}
        self.branches: list[dict[str, Any]] = []
        self.cancelled: list[dict[str, Any]] = []
        self.closed = False
        self.created = time.time()
        self.reward: float | None = None
        self._by_prompt: dict[str, Call] = {}  # chain key of a call's messages
        self._by_conv: dict[str, tuple[Call, int]] = {}  # chain key of messages + reply -> choice
        self._issued: dict[str, tuple[Call, int]] = {}  # tool-call id the proxy issued -> its choice
        self.ignored: dict[str, int] = {}  # request parts the proxy ignored, by name (see ``note_ignored``)
        self.seed = seed
        if seed is not None:
            self.tree.meta["session_seed"] = seed
        self._streams: dict[int, set[int]] = {}  # prompt digest -> stream indices recorded or in flight
        self._held: dict[str, list[tuple[int, int]]] = {}  # call id -> its (digest, index), until recorded
        self._marked: set[int] = set()  # leaves the last ``assemble`` marked abandoned (and truncated)

    def call_seed(self, prompt_ids: list[int], own: int | None, call_id: str) -> int | None:
        """A seeded session's stream for a call, held for ``call_id``: from the session seed,
        the prompt, the lowest stream index of that prompt that no recorded or in-flight call
        holds, and the call's own seed. So concurrent calls with one prompt get different
        streams (in the order their ``call_seed`` runs), a retry of a call that ended before
        it was recorded (``release_streams``: refused, failed or cancelled) gets its stream
        again unless another call took it first, and a harness that hard-codes a seed still
        gets new streams per episode.
        Unseeded session: the call's own seed, as it is, and nothing held."""
        if self.seed is None:
            return own
        key = _prompt_digest(prompt_ids)
        taken = self._streams.setdefault(key, set())
        index = next(i for i in itertools.count() if i not in taken)
        taken.add(index)
        self._held.setdefault(call_id, []).append((key, index))
        return request_seed(self.seed, key, index, -1 if own is None else own)

    def keep_streams(self, call_id: str) -> None:
        """The call was recorded: its streams stay taken."""
        self._held.pop(call_id, None)

    def release_streams(self, call_id: str) -> None:
        """The call ended unrecorded (an error, a cancel): its streams are free again. After
        ``keep_streams`` this does nothing."""
        for key, index in self._held.pop(call_id, []):
            self._streams[key].discard(index)

    # -- planning ------------------------------------------------------------------------
    def plan_chat(self, spec: PromptSpec, tokenizer: Any) -> Plan:
        keys = self._known_replies(spec)
        n = len(keys)
        if spec.prefill is not None:  # part of the prompt (a retry must match it), not of the history
            keys.append(prefill_key(spec.prefill))
        chain = chain_keys(spec.render_key, keys)
        plan = Plan("chat", [], None, [], keys=keys, chain=chain, render_key=spec.render_key,
                    reply_base=chain[n - 1])
        same = self._by_prompt.get(chain[-1])
        if same is not None:  # a retry: reuse the recorded prompt as it is
            plan.prompt_ids, plan.parent, plan.context_ids = same.prompt_ids, same.parent, same.context_ids
            plan.ctx = same.ctx
            return plan
        self._plan_history(plan, spec, tokenizer, n)
        if spec.prefill is not None:
            assert plan.ctx is not None
            plan.context_ids = plan.context_ids + plan.ctx.append_prefill(spec.prefill)
            plan.prompt_ids = plan.ctx.ids
        return plan

    def _plan_history(self, plan: Plan, spec: PromptSpec, tokenizer: Any, n: int) -> None:
        """Plan a call's history (its ``n`` messages, a prefill left out) up to the generation prompt."""
        chain = plan.chain
        offset = len(spec.template) - n  # a system message added for tools
        for k in range(n - 1, 0, -1):
            hit = self._by_conv.get(chain[k - 1])
            if hit is not None:  # messages[:k] are a recorded call's and its reply: go on from there
                call, choice = hit
                node = self.tree.nodes[call.node_ids[choice]]
                assert call.ctx is not None
                ctx = call.ctx.fork()
                ctx.append_action(node.action_ids, node.logprobs)
                plan.new_messages = spec.template[k + offset:]
                plan.context_ids = ctx.append_observation(plan.new_messages)
                plan.parent, plan.ctx, plan.prompt_ids = node.id, ctx, ctx.ids
                return
            prompted = self._by_prompt.get(chain[k - 1])
            if prompted is not None and self._plan_rerendered(plan, prompted, spec, k, offset):
                return
        ctx = ChatContext(tokenizer, spec.template, check_prefix=self.check_prefix, **spec.template_kwargs)
        plan.ctx, plan.prompt_ids, plan.context_ids = ctx, ctx.ids, list(ctx.ids)

    def _known_replies(self, spec: PromptSpec) -> list[str]:
        """The history's keys, where an assistant message carrying exactly the tool-call ids the
        proxy issued for one recorded choice is keyed as that reply: the harness sent the reply
        back in its own shape (items, blocks, reformatted text), and the recorded tokens stand."""
        keys = list(spec.keys)
        for j, ids in enumerate(spec.call_ids):
            hits = [self._issued.get(i) for i in ids]
            if not hits or any(h is None or h != hits[0] for h in hits):
                continue
            call, choice = hits[0]  # type: ignore[misc]
            if set(ids) == set(call.issued[choice]):
                keys[j] = call.reply_keys[choice]
        return keys

    def _plan_rerendered(self, plan: Plan, call: Call, spec: PromptSpec, k: int, offset: int) -> bool:
        """Plan a call whose messages[:k] are ``call``'s and whose messages[k] re-renders one of
        its replies: a branch beside that reply, on the harness's rendering of it (what the
        model is shown). False (nothing planned) when messages[k] is no such reply."""
        if k >= len(spec.canon) or call.ctx is None:
            return False
        msg = {**spec.canon[k], "ids": spec.call_ids[k]}
        for choice, reply in enumerate(call.replies):
            how = rerendering(msg, reply, call.issued[choice])
            if how is None:
                continue
            ctx = call.ctx.fork()
            try:
                added = ctx.append_reply_as_context(spec.template[k + offset:])
            except ValueError:  # the template cannot cut a reply out: the call gets its own root
                return False
            node = call.node_ids[choice]
            plan.rerendered = {"from_call": call.call_id, "choice": choice, "by": how, "continues": [node]}
            plan.new_messages = spec.template[k + offset:]
            plan.parent, plan.ctx, plan.prompt_ids = call.parent, ctx, ctx.ids
            plan.context_ids = call.context_ids + added
            return True
        return False

    def plan_tokens(self, prompt_ids: list[int]) -> Plan:
        parent, pos = self._deepest_prefix(prompt_ids)
        return Plan("completion", list(prompt_ids), parent, list(prompt_ids[pos:]))

    def _deepest_prefix(self, prompt: list[int]) -> tuple[int | None, int]:
        """The deepest node whose path tokens start ``prompt``, and that path's length."""
        parent: int | None = None
        pos, kids = 0, self.tree.roots
        while True:
            found = None
            for k in reversed(kids):  # the latest branch first
                n = self.tree.nodes[k]
                mid, end = pos + len(n.context_ids), pos + len(n.context_ids) + len(n.action_ids)
                if pos < end <= len(prompt) and prompt[pos:mid] == n.context_ids \
                        and prompt[mid:end] == n.action_ids:
                    found = (k, end)
                    break
            if found is None:
                return parent, pos
            parent, pos = found
            kids = self.tree.nodes[parent].children

    # -- recording -----------------------------------------------------------------------
    def record(self, plan: Plan, call_id: str, results: list[GenerateResult], texts: list[str],
               replies: list[dict[str, Any]], timing: dict[str, float], model: str = "",
               api: str = "chat") -> Call:
        """Add one node per choice under the plan's parent; returns the call.

        ``replies`` are the assistant messages returned for a chat call's choices
        (none for completions); ``model`` the name the harness asked for and
        ``api`` the wire protocol, both kept in each node's ``info``.
        """
        siblings = self.tree.roots if plan.parent is None else self.tree.nodes[plan.parent].children
        branch = self.branch_info(plan, siblings) if siblings else None
        context = next((self.tree.nodes[s].context_ids for s in siblings
                        if self.tree.nodes[s].context_ids == plan.context_ids), plan.context_ids)
        if plan.parent is not None and plan.new_messages:
            parent = self.tree.nodes[plan.parent]
            parent.observation = parent.observation or "\n".join(
                str(m.get("content", "")) for m in plan.new_messages)
        ids = []
        for i, (res, text) in enumerate(zip(results, texts, strict=True)):
            info: dict[str, Any] = {"call_id": call_id, "choice": i, "timing": timing,
                                    "cached_tokens": res.cached_tokens, "api": api}
            if model:
                info["model"] = model
            if branch is not None and i == 0:
                info["branch"] = branch
            node = Node(context_ids=context, action_ids=list(res.token_ids), logprobs=list(res.logprobs),
                        entropies=list(res.entropies), version=res.version, action_text=text,
                        finish_reason=res.finish_reason, info=info)
            ids.append(self.tree.add(node, plan.parent).id)
        canon = [canonical(r) for r in replies]
        issued = [tuple(c.get("id") or "" for c in r.get("tool_calls") or ()) for r in replies]
        # A recorded prompt is read and forked, never appended to. As a tuple of ints it leaves the
        # garbage collector's walks, which otherwise grow with every recorded call of every session.
        prompt = tuple(plan.prompt_ids)
        if plan.ctx is not None:
            plan.ctx.ids = prompt  # type: ignore[assignment]
        call = Call(call_id, plan.kind, prompt, plan.parent, context, ids,
                    min(r.version for r in results), timing, branch, tuple(plan.keys), plan.render_key,
                    [key_of(c) for c in canon], plan.ctx, canon, issued, model, api)
        self.calls.append(call)
        self.by_id[call_id] = call
        if branch is not None:
            self.branches.append({"call_id": call_id, **branch})
        if plan.kind == "chat":
            self._by_prompt.setdefault(plan.chain[-1], call)
            for i, key in enumerate(call.reply_keys):
                self._by_conv[chain_keys(plan.reply_base, [key])[0]] = (call, i)
                for tool_call_id in issued[i]:
                    if tool_call_id:
                        self._issued[tool_call_id] = (call, i)
        return call

    def note_ignored(self, parts: list[str]) -> None:
        """Count request parts the proxy accepted but ignored (``thinking``, reasoning items,
        hosted tools); the tree's ``meta["ignored"]`` reports them."""
        for p in parts:
            self.ignored[p] = self.ignored.get(p, 0) + 1

    def branch_info(self, plan: Plan, siblings: list[int]) -> dict[str, Any]:
        """Why a call that starts a new branch under ``plan.parent`` does so, and where."""
        at_token = len(plan.prompt_ids) - len(plan.context_ids)
        info: dict[str, Any] = {"parent_node": plan.parent, "at_token": at_token}
        same = next((s for s in siblings if self.tree.nodes[s].context_ids == plan.context_ids), None)
        if same is not None:
            return {"reason": "retry", **info, "from_call": self.tree.nodes[same].info.get("call_id")}
        if plan.rerendered is not None:
            return {"reason": "rerendered", **info, **plan.rerendered}
        chats = [c for c in self.calls if c.kind == "chat"]
        if plan.kind != "chat" or not chats:
            return {"reason": "divergence", **info}
        history = lambda c: [*c.keys, *c.reply_keys[:1]]  # noqa: E731
        ref = max(reversed(chats), key=lambda c: _common(history(c), plan.keys))
        h, m = history(ref), plan.keys
        j = _common(h, m)
        info.update(at_message=j, from_call=ref.call_id)
        if j > 0 and ref.render_key != plan.render_key:
            return {"reason": "tools_changed", **info}
        if any(j < len(k) and _is_prefill(k[j]) for k in (h, m)):
            return {"reason": "edit", **info}  # the same messages, another start of the reply (or none)
        # An edit keeps every message the earlier call sent after the replaced one; a history
        # that ends at the replaced message but is shorter than that call's is a compaction.
        if 0 < j < len(h) and j < len(m) and _role(h[j]) == _role(m[j]) and len(m) >= len(ref.keys) \
                and m[j + 1:] == h[j + 1:j + 1 + len(m[j + 1:])]:
            return {"reason": "edit", **info}
        if 0 < j and len(m) < len(h):
            left = [n for n in ref.node_ids if not self.tree.nodes[n].children]
            return {"reason": "compaction", **info, "continues": left}
        return {"reason": "divergence", **info}

    def record_cancelled(self, call_id: str, why: str) -> None:
        """A call that ended before anything was sampled; kept in the log, no node."""
        self.cancelled.append({"call_id": call_id, "reason": why, "time": time.time()})

    # -- rewards and assembly ------------------------------------------------------------
    def set_reward(self, reward: float, call_id: str | None = None, choice: int | None = None,
                   terminated: bool = True) -> list[int]:
        """Put a reward on a call's nodes (default: the last call, as the session's reward).

        Raises ``KeyError``/``IndexError``/``ValueError`` with a message naming the bad field.
        """
        if not math.isfinite(reward):  # JSON's 1e999 reads as inf: it would reach every advantage
            raise ValueError(f"reward: {reward} is not a finite number")
        if call_id is None:
            if not self.calls:
                raise KeyError("call_id: the session has no calls to reward yet")
            call = self.calls[-1]
            self.reward = reward
        elif call_id in self.by_id:
            call = self.by_id[call_id]
        else:
            raise KeyError(f"call_id: no call {call_id!r} in session {self.session_id!r}")
        if choice is not None and choice >= len(call.node_ids):
            raise IndexError(f"choice: call {call.call_id!r} has {len(call.node_ids)} choices")
        nodes = call.node_ids if choice is None else [call.node_ids[choice]]
        if call_id is None:  # the session's reward: also on the paths the final one continues
            nodes = nodes + list(self.continued(nodes)) + list(self.side_leaves(nodes))
        for nid in nodes:
            node = self.tree.nodes[nid]
            node.reward = reward
            if call_id is None:  # its end is the session's now, whatever an assembly made of it
                node.terminated, node.truncated = terminated, not terminated
                node.info.pop("abandoned", None)
                self._marked.discard(nid)
        return nodes

    def continued(self, node_ids: list[int]) -> dict[int, str]:
        """The leaves of the paths that the paths to ``node_ids`` continue after a compaction,
        transitively, each with the id of the call that compacted it."""
        out: dict[int, str] = {}
        todo = list(node_ids)
        while todo:
            for node in self.tree.path(todo.pop()):
                call = self.by_id.get(node.info.get("call_id", ""))
                if call is None or call.branch is None or call.branch["reason"] not in _CONTINUING:
                    continue
                for leaf in call.branch["continues"]:
                    if leaf not in out and not self.tree.nodes[leaf].children:  # else the path went on
                        out[leaf] = call.call_id
                        todo.append(leaf)
        return out

    def side_leaves(self, final: list[int]) -> list[int]:
        """The outcome leaves of the session's side conversations, and the paths they continue.

        A side conversation is one the harness held beside the main one, from another
        first message (a title or topic call under another system prompt, a sub-agent):
        a root whose first message differs from that of every root holding ``final``
        (a retry or an edit of the main conversation starts with the same one). It is
        part of the episode, not a path the harness left, so its latest leaf carries
        the session's outcome. A first call retried, or answered with n choices, makes
        roots with one prompt: a root of them the harness never went on from is a
        reply it dropped (abandoned), where another of them went on or came later.
        """
        main = [self._root(n) for n in [*final, *self.continued(final)]]
        firsts = {self._first_message(r) for r in main}
        done = set(main) | self._dropped_roots()
        out: list[int] = []
        for leaf in sorted(self.tree.leaves(), key=lambda n: -n.id):  # the latest first
            root = self._root(leaf.id)
            if root in done:
                continue
            done.add(root)
            first = self._first_message(root)
            if first is not None and first not in firsts:
                out += [leaf.id, *self.continued([leaf.id])]
        return out

    def _dropped_roots(self) -> set[int]:
        """Roots that are replies the harness dropped: among roots with one prompt, each one
        with no child, where another one has a child or came later. (Roots with one prompt that
        each went on are conversations held side by side: parallel sub-agents.)"""
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        for r in self.tree.roots:
            by_prompt.setdefault(tuple(self.tree.nodes[r].context_ids), []).append(r)
        dropped: set[int] = set()
        for roots in by_prompt.values():
            ends = [r for r in roots if not self.tree.nodes[r].children]
            kept = max(ends) if len(ends) == len(roots) else None  # none went on: the latest stands
            dropped |= {r for r in ends if r != kept}
        return dropped

    def _first_message(self, root: int) -> str | None:
        call = self.by_id.get(self.tree.nodes[root].info.get("call_id", ""))
        return call.keys[0] if call is not None and call.keys else None

    def _root(self, node_id: int) -> int:
        return self.tree.path(node_id)[0].id

    def assemble(self) -> RolloutTree:
        """The session's tree, with abandoned leaves marked (see the module docstring)."""
        # An earlier assembly (a GET of the tree mid-session) judged the session as it was then:
        # its marks are made afresh, since the harness may have gone on from a leaf it took for
        # left or for a side conversation.
        for node in self.tree.nodes.values():
            node.info.pop("side_conversation", None)
            node.info.pop("continued_by", None)
        for nid in self._marked:
            self.tree.nodes[nid].info.pop("abandoned", None)
            self.tree.nodes[nid].truncated = False  # marked only where it was not done
        self._marked.clear()
        last = set(self.calls[-1].node_ids) if self.calls else set()
        for leaf, call_id in self.continued(sorted(last)).items():
            self.tree.nodes[leaf].info["continued_by"] = call_id
            last.add(leaf)
        for leaf in self.side_leaves(sorted(last)):
            self.tree.nodes[leaf].info["side_conversation"] = True
            last.add(leaf)
        for leaf in self.tree.leaves():
            if leaf.id not in last and not leaf.done:
                leaf.truncated = True
                leaf.info["abandoned"] = True
                self._marked.add(leaf.id)
        self.tree.meta.update(
            session_id=self.session_id, calls=len(self.calls), branches=self.branches,
            reward=self.reward, cancelled_calls=len(self.cancelled), ignored=dict(self.ignored),
            template_mismatches=sum(len(c.ctx.mismatches) for c in self.calls if c.ctx is not None),
        )
        return self.tree

    def close(self) -> RolloutTree:
        tree = self.assemble()
        self.closed = True
        for call in self.calls:  # contexts are only needed to extend the session
            call.ctx = None
        return tree

    def summary(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "closed": self.closed, "reward": self.reward,
                "meta": self.meta, "calls": [c.summary() for c in self.calls],
                "branches": self.branches, "cancelled": self.cancelled}


def _common(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _role(key: str) -> str:
    return json.loads(key)["role"]


def _is_prefill(key: str) -> bool:
    return "prefill" in json.loads(key)  # ``prefill_key``: no message has such a field
