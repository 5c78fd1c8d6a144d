"""Harness rollouts: a training step's trees come from an unmodified agent program.

``agentrl train --harness CMD`` (``train.harness``) swaps the native engine
for ``HarnessRollouts.collect``, which has ``agentrl.rollout.collect``'s
signature: the trainer takes it as its rollout source
(``agentrl.train.rollouts.RolloutSource``; ``harness_rollouts`` makes one). Everything after the rollout is the same code: credit, old
logprobs, loss, weight sync, eval and checkpoints.

For the whole run, two servers listen on free 127.0.0.1 ports, each on a
background thread, and each has its own random bearer token:

- the proxy (``agentrl.proxy``) over the very policy object the trainer
  trains. With the ``hf`` backend that object holds the trained model, so the
  trainer's ``sync_policy`` is all an update needs: the next call samples
  under the new weights and is recorded with the new version;
- the env server (``agentrl env serve``), which makes and steps the envs.

**Episodes.** For every task seed, ``collect`` runs ``rollout.group_size``
episodes, at most ``rollout.concurrency`` at once. An episode is one proxy
session, one env made with the task seed and ``env.kwargs``, and one run of
the command through ``run_harness_episode``, in a new directory of the
episode's own (removed when it ends). That function sets
``OPENAI_BASE_URL`` to the session and passes the env server's address in
``AGENTRL_ENV_*``. Here the command also gets ``AGENTRL_TASK_SEED``,
``AGENTRL_EPISODE`` (the episode's index in its group) and the variables in
``train.harness_env``. The reward is the env's summed reward when the
episode ends. ``merge_sessions`` joins the sessions of one task into one tree:
their roots become its roots, so that tree is the group that credit assignment
compares.

**Sampling is pinned.** The trainer scores every action token at
``sampling.temperature``. PPO's ratio, TIS and the mismatch statistics compare
those scores with the behaviour logprobs, so both must come from the same
distribution. Every call is therefore sampled with ``sampling``'s
``temperature``, ``top_p`` and ``top_k``, and with at most
``sampling.max_new_tokens`` tokens, whatever the harness asks. Calls changed in
this way are counted in ``rollout/harness_repinned``. The harness's stop
strings and seed are kept.

**Outcomes**, sorted in two columns as ``run_harness_episode`` sorts them:

- the model's own doing (a wrong answer, a reply the harness cannot parse,
  turns that run out): the episode counts, with the env's reward;
- failures outside the model (the harness crashed, hung past
  ``rollout.episode_timeout_s``, made no model call; the env could not be
  made; the proxy could not be reached): every leaf of that session carries
  the reason in ``Node.error``. A session with no call gets one empty node
  that holds the reason. Credit leaves these episodes out, ``rollout/failed``
  counts them, and the run goes on, unless every episode of a step failed:
  then nothing can train, and the run stops with the last harness's stderr tail.

``generated_tokens`` and ``env_steps`` (``rollout/*``) count the sessions'
sampled tokens and the env server's steps.

A command that starts with ``python`` or ``python3`` runs under agentrl's own
interpreter (``sys.executable``), which has the packages the run has.

**Drain.** Once the harnesses have exited, ``collect`` waits until no proxy
request is in flight and the generate thread is idle. A killed harness's last
batch then cannot finish after the update and put keys and values of the
old weights into the prefix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, ProxyError
from ..policy.base import GenerateRequest, GenerateResult, SamplingParams, request_seed
from ..types import Node, RolloutTree

if TYPE_CHECKING:
    from ..config import Config, SamplingConfig
    from .app import RunningServer

__all__ = ["HarnessRollouts", "env_idle_s", "harness_rollouts", "merge_sessions"]

_KEPT_META = ("session_id", "episode", "error", "env", "harness", "branches", "calls",
              "template_mismatches", "dropped_rewards")


def merge_sessions(sessions: list[RolloutTree], meta: dict[str, Any]) -> RolloutTree:
    """One task's sessions as one tree (its group): each session's roots become roots here.

    Node ids are renumbered, and ``info["session_id"]`` says which session a node
    came from. Every leaf of a failed session (``meta["error"]``) carries that
    reason in ``error``. A session with no node gets one empty node that holds
    its reason.
    """
    out = RolloutTree(meta={**meta, "sessions": [
        {k: s.meta[k] for k in _KEPT_META if k in s.meta} for s in sessions]})
    # The engine's counters, as far as a harness shows them: sampled tokens, and the env's own step count.
    out.meta["counters"] = {
        "generated_tokens": sum(len(n.action_ids) for s in sessions for n in s.nodes.values()),
        "env_steps": sum(int(s.meta.get("env", {}).get("steps", 0)) for s in sessions)}
    for s in sessions:
        sid = s.meta.get("session_id")
        error = s.meta.get("error")
        if not s.nodes:
            reason = error or "the session recorded no model call"
            out.add(Node(truncated=True, error=reason, info={"session_id": sid}))
            continue
        new_id: dict[int, int] = {}
        for old in sorted(s.nodes):  # ids grow as nodes are added: a parent comes first
            node = s.nodes[old]
            parent = None if node.parent is None else new_id[node.parent]
            copy = replace(node, children=[], info={**node.info, "session_id": sid})
            new_id[old] = out.add(copy, parent).id
        if error:
            for leaf in s.leaves():
                n = out.nodes[new_id[leaf.id]]
                n.error = n.error or error
                n.truncated = not n.terminated
    return out


def env_idle_s(episode_timeout_s: float | None) -> float:
    """How long the env server keeps an env nobody touches: past the longest an episode may run
    (a harness with ``submit="stdout"`` touches it only once it exits), at least an hour; about
    forever where episodes have no time limit."""
    if episode_timeout_s is None:
        return float(1 << 40)
    return max(3600.0, 2 * episode_timeout_s)


def _all_failed(sessions: list[dict[str, Any]]) -> str:
    """Why a step whose every harness episode failed stops the run: nothing can train on it,
    and the next step would fail alike (a wrong command, a missing package)."""
    last = sessions[-1]
    run = last.get("harness", {})
    tail = (run.get("stderr_tail") or "").strip()[-2000:] or "(empty)"
    out = (run.get("stdout_tail") or "").strip()[-2000:] or "(empty)"
    return (f"train.harness: every harness episode of this step failed ({len(sessions)} of {len(sessions)}); "
            f"the last: {last['error'][:2000]}\ncommand: {run.get('cmd')}\nits stderr "
            f"(tail):\n{tail}\nits stdout (tail):\n{out}")


class _Pinned:
    """The trained policy, sampling every call as ``sampling`` says (see the module docstring)."""

    def __init__(self, policy: Any, sampling: SamplingConfig):
        self.policy = policy
        self.sampling = sampling
        self.repinned = 0

    @property
    def tokenizer(self) -> Any:
        return self.policy.tokenizer

    @property
    def version(self) -> int:
        return self.policy.version

    def pin(self, params: SamplingParams) -> SamplingParams:
        s = self.sampling
        pinned = replace(params, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                         max_new_tokens=min(params.max_new_tokens, s.max_new_tokens))
        if pinned != params:
            self.repinned += 1
        return pinned

    async def agenerate(self, request: GenerateRequest) -> GenerateResult:
        return await self.policy.agenerate(replace(request, params=self.pin(request.params)))  # keeps its control


class HarnessRollouts:
    """Rollouts by an agent program through the proxy; ``collect`` is the trainer's rollout source.

    ``cmd`` is the command line of one episode (split like a shell would).
    ``verifier``, if given, scores a session's tree instead of the env's reward.
    ``cwd``, if given, is where every episode's harness runs (shared, and kept); else each
    runs in a new directory of its own. The servers start on the first ``collect`` and stop on ``close``.
    """

    def __init__(self, cmd: str, policy: Any, cfg: Config, harness_env: dict[str, Any] | None = None,
                 verifier: Callable[[RolloutTree], float] | None = None, cwd: str | None = None,
                 submit: str | None = None):
        if cfg.rollout.allocator.name != "independent":
            raise ConfigError(f"train.harness: a harness plays whole episodes, so "
                              f"rollout.allocator must be 'independent' (got {cfg.rollout.allocator.name!r})")
        from .harness import harness_argv

        self.argv = harness_argv(cmd)  # a leading python is this interpreter
        if not self.argv:
            raise ConfigError("train.harness: the command is empty")
        if getattr(policy, "agenerate", None) is None:
            raise ConfigError("train.harness: the policy backend has no agenerate (use backend=hf)")
        self.policy = policy
        self.cfg = cfg
        self.env_vars = {k: str(v) for k, v in (harness_env or {}).items()}
        self.verifier, self.cwd, self.submit = verifier, cwd, submit
        self.pinned = _Pinned(policy, cfg.sampling)
        self.proxy: RunningServer | None = None
        self.envs: RunningServer | None = None
        self.proxy_token = self.env_token = ""
        self.stats: dict[str, float] = {}

    # -- servers -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the proxy and the env server (once)."""
        import secrets

        from .app import RunningServer, create_app
        from .envserver import EnvServerConfig, create_env_app
        from .schemas import ProxyConfig

        if self.proxy is not None:
            return
        r = self.cfg.rollout
        self.proxy_token, self.env_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        proxy_cfg = ProxyConfig(token=self.proxy_token, max_context_tokens=r.max_context_tokens,
                                default_max_tokens=self.cfg.sampling.max_new_tokens,
                                max_concurrent=max(1024, 4 * r.concurrency))
        self.proxy = RunningServer(create_app(self.pinned, proxy_cfg))
        try:
            self.envs = RunningServer(create_env_app(EnvServerConfig(
                token=self.env_token, max_envs=max(256, 2 * r.concurrency),
                idle_s=env_idle_s(r.episode_timeout_s))))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for server in (self.proxy, self.envs):
            if server is not None:
                server.stop()
        self.proxy = self.envs = None

    # -- rollouts ------------------------------------------------------------------------
    def collect(self, env_id: str, policy: Any, cfg: Config, seeds: list[int],
                on_episode_done: Callable[[RolloutTree], None] | None = None) -> list[RolloutTree]:
        """One tree per task seed, ``cfg.rollout.group_size`` harness episodes each."""
        if policy is not self.policy:
            raise ValueError("policy: harness rollouts sample with the policy they were built with")
        self.start()
        self.pinned.sampling, self.pinned.repinned = cfg.sampling, 0
        try:
            trees = asyncio.run(self._collect(env_id, cfg, seeds, on_episode_done))
        finally:
            self._drain()
        sessions = [s for t in trees for s in t.meta["sessions"]]
        if sessions and all(s.get("error") for s in sessions):
            raise ConfigError(_all_failed(sessions))
        walls = [s["harness"]["wall_s"] for s in sessions if "wall_s" in s.get("harness", {})]
        self.stats = {"rollout/harness_repinned": self.pinned.repinned,
                      "rollout/harness_wall_s": sum(walls) / max(len(walls), 1),
                      "rollout/template_mismatches": sum(s.get("template_mismatches", 0) for s in sessions),
                      # rewards harnesses posted for themselves with their session key, zeroed
                      "rollout/harness_dropped_rewards": sum(s.get("dropped_rewards", 0) for s in sessions)}
        return trees

    async def _collect(self, env_id: str, cfg: Config, seeds: list[int],
                       on_episode_done: Callable[[RolloutTree], None] | None) -> list[RolloutTree]:
        from ..rollout.episodes import guarded_callback

        gate = asyncio.Semaphore(cfg.rollout.concurrency)
        g = cfg.rollout.group_size
        on_episode_done = guarded_callback(on_episode_done)  # one that raises loses no episode

        async def one(seed: int, episode: int) -> RolloutTree:
            async with gate:
                tree = await self._episode(env_id, cfg, seed, episode)
            if on_episode_done is not None:
                on_episode_done(tree)
            return tree

        done = await asyncio.gather(*(one(seed, j) for seed in seeds for j in range(g)))
        return [merge_sessions(list(done[i * g:(i + 1) * g]), {"env_id": env_id, "task": seed})
                for i, seed in enumerate(seeds)]

    async def _episode(self, env_id: str, cfg: Config, seed: int, episode: int) -> RolloutTree:
        from .harness import EnvServer, drop_session, open_session, run_harness_episode

        assert self.proxy is not None and self.envs is not None
        meta = {"task": seed, "episode": episode, "env_id": env_id}
        extra = {**self.env_vars, "AGENTRL_TASK_SEED": str(seed), "AGENTRL_EPISODE": str(episode)}
        env = EnvServer(self.envs.url, self.env_token, env_id, seed, dict(cfg.env.kwargs))
        session = None
        try:
            # Calls the harness sends without a seed sample from this episode's own streams.
            session = await open_session(self.proxy.url, self.proxy_token, meta=meta,
                                         seed=request_seed(cfg.rollout.seed, seed, episode))
            tree = await run_harness_episode(self.argv, session, env, cfg.rollout.episode_timeout_s,
                                             self.verifier, extra, self.cwd, self.submit)
        except ProxyError as e:
            return RolloutTree(meta={**meta, "error": f"proxy: {e}"})
        except Exception as e:  # a bug of ours: this episode fails, loudly, and the run goes on
            warnings.warn(f"harness episode (task {seed}, episode {episode}) failed: "
                          f"{type(e).__name__}: {e}", stacklevel=1)
            return RolloutTree(meta={**meta, "error": f"harness runner error {type(e).__name__}: {e}"})
        finally:  # the tree is ours now, or the episode failed: the proxy need not keep the session
            if session is not None:
                with contextlib.suppress(ProxyError):
                    await drop_session(session)
        return tree

    def _drain(self, timeout_s: float = 60.0) -> None:
        """Wait for no request in flight and an idle generate thread (see the module docstring)."""
        if self.proxy is None:
            return
        proxy = self.proxy.app.proxy
        deadline = time.monotonic() + timeout_s
        while proxy.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        # The batcher runs generate calls one at a time on one thread: a no-op queued
        # behind them returns once the last has finished.
        batcher = getattr(self.policy, "batcher", None)
        if batcher is not None:
            try:
                batcher.wait_idle(max(deadline - time.monotonic(), 1.0))
            except RuntimeError:  # the pool was shut down: nothing runs on it
                pass
            except TimeoutError:
                warnings.warn(f"the policy was still generating {timeout_s:g}s after the harnesses "
                              "exited; updating anyway", stacklevel=2)


def harness_rollouts(policy: Any, cfg: Any) -> HarnessRollouts:
    """The rollout source of a run config with ``train.harness`` (for ``agentrl.train.train``)."""
    if cfg.train.harness is None:
        raise ConfigError("train.harness is not set: there is no agent program to run")
    return HarnessRollouts(cfg.train.harness, policy, cfg, cfg.train.harness_env,
                           cwd=cfg.train.harness_cwd, submit=cfg.train.harness_submit)
