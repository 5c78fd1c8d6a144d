"""The text environment API: ``TextEnv`` is a ``gymnasium.Env`` whose
observations and actions are strings, the registry helpers, and the check of
what an env returns (``answer_problem``) with the JSON form of its ``info``
(``jsonable``), which every caller of a user's env goes through.

A subclass overrides ``reset`` and ``step`` (calling ``super().reset(seed=seed)``
first, as gymnasium asks) and returns ``info`` with:

- ``instruction``: the task, in words;
- ``admissible_actions``: the valid actions now, where the env knows them;
- ``tools``: the tool specs (``ToolSpec.model_dump()`` dicts) the model may call.

Envs that can be branched implement ``snapshot()`` / ``restore()``. The default
deep-copies the instance's state, which is right for pure-Python envs.
Envs with a scripted expert implement ``expert_action()``: it acts only on what
the agent has observed, so SFT on it teaches a learnable policy. A privileged
solver that reads hidden state is ``oracle_action()``: an oracle and a
distillation teacher, never SFT data by default (``docs/architecture.md``,
Principles: demonstrations must be learnable).

Envs are registered with ``register_env("<namespace>/<Name>-v0", entry_point)``,
which is ``gymnasium.register`` plus a check that the id has a namespace
(``agentrl/`` for the built-in ones, your own, ``myorg/``, for yours).

How a process finds an env registered outside agentrl, in the order tried:

- ``module:Name-v0`` (gymnasium's form): ``module`` is imported, then the id is made;
- ``env.imports: [module, ...]`` in a config: imported before the env is made;
- an ``agentrl.envs`` entry point in the installed package's metadata.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import inspect
import math
import numbers
import threading
import time
import warnings
from importlib.metadata import entry_points
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from .errors import EnvError

__all__ = [
    "NAMESPACE",
    "EnvClosers",
    "TextEnv",
    "TextSpace",
    "answer_problem",
    "check_env_kwargs",
    "close_quietly",
    "env_creator",
    "import_env_modules",
    "jsonable",
    "list_envs",
    "make_env",
    "register_env",
    "resolve_env_id",
]

NAMESPACE = "agentrl"
MAX_TEXT = 1_000_000
_PRINTABLE = "".join(chr(c) for c in range(32, 127)) + "\n\t"


class TextSpace(spaces.Text):
    """A ``gymnasium.spaces.Text`` that holds any Unicode string up to ``max_length``.

    gymnasium's ``Text.contains`` only admits strings over a fixed charset, which
    model outputs and observations do not respect; sampling still draws from
    printable ASCII so ``action_space.sample()`` gives readable junk for fuzzing.
    """

    def __init__(self, max_length: int = MAX_TEXT, min_length: int = 0, seed: int | None = None):
        super().__init__(max_length=max_length, min_length=min_length, charset=_PRINTABLE, seed=seed)

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        if mask is None and probability is None:
            length = int(self.np_random.integers(self.min_length, min(self.max_length, 64) + 1))
            chars = self.np_random.choice(list(_PRINTABLE), size=length)
            return "".join(chars)
        return super().sample(mask=mask, probability=probability)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"TextSpace({self.min_length}, {self.max_length})"


class TextEnv(gym.Env[str, str]):
    """Base class of agentrl's environments: string observations and actions.

    Subclasses override ``reset`` and ``step``; see the module docstring for the
    ``info`` keys. ``snapshot()`` / ``restore()`` deep-copy the instance state by
    default; override them when the state is not plain Python.
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(self, render_mode: str | None = None):
        self.observation_space = TextSpace()
        self.action_space = TextSpace()
        self.render_mode = render_mode
        self._last_obs = ""

    # -- branching -------------------------------------------------------------
    _NOT_STATE = frozenset({"observation_space", "action_space", "spec", "render_mode"})

    def snapshot(self) -> Any:
        """A copy of this env's state that ``restore`` returns to."""
        state = {k: v for k, v in self.__dict__.items() if k not in self._NOT_STATE}
        return copy.deepcopy(state)

    def restore(self, snapshot: Any) -> None:
        """Return to the state captured by ``snapshot()``; the snapshot stays reusable."""
        self.__dict__.update(copy.deepcopy(snapshot))

    # -- optional hooks --------------------------------------------------------
    def expert_action(self) -> str:
        """The scripted expert's next action, a function of what the agent has observed
        so far (so a policy can imitate it). Envs with such an expert override this."""
        raise NotImplementedError(f"{type(self).__name__} has no observation-consistent expert")

    def oracle_action(self) -> str:
        """A privileged solver's next action: it may read hidden state. An oracle and a
        distillation teacher, not SFT data by default. Envs with one override this."""
        raise NotImplementedError(f"{type(self).__name__} has no privileged oracle")

    def render(self) -> str | None:
        if self.render_mode == "ansi":
            return self._last_obs
        return None


_registered: set[str] = set()  # ids registered through register_env, any namespace


def register_env(env_id: str, entry_point: Any, **kwargs: Any) -> None:
    """Register an env under ``<namespace>/<Name>-v<N>`` (a thin ``gymnasium.register``).

    The namespace is yours to pick (``myorg/Foo-v0``); ``agentrl/`` holds the built-in envs.
    """
    namespace, _, name = env_id.partition("/")
    if not namespace or not name or "/" in name or ":" in env_id:
        raise EnvError(f"env id {env_id!r} must look like '<namespace>/<Name>-v0', "
                       f"e.g. 'myorg/{name or namespace or 'MyEnv'}-v0'")
    _registered.add(env_id)
    if env_id in gym.registry:
        return
    gym.register(id=env_id, entry_point=entry_point, **kwargs)


def import_env_modules(modules: list[str] | tuple[str, ...]) -> None:
    """Import each module, so that the envs it registers exist in this process."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise EnvError(f"cannot import env module {module!r} (env.imports, or the module of "
                           f"'module:Name-v0'): {e}") from e
        except Exception as e:  # the user's module itself is broken: say where, not a traceback
            raise EnvError(f"env module {module!r} raised {type(e).__name__} while it was imported: "
                           f"{_where(e)}{e}") from e


def _where(error: BaseException) -> str:
    """``file:line: `` of the innermost frame of ``error``'s traceback (a SyntaxError names its own)."""
    if isinstance(error, SyntaxError):
        return ""  # its message says the file and line
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}: " if tb is not None else ""


_loaded = False
_load_lock = threading.RLock()


def _load_env_plugins() -> None:
    """Import the built-in envs and any ``agentrl.envs`` entry points, once.

    Locked, and marked loaded only after the imports: the rollout engine makes
    envs from several threads at once.
    """
    global _loaded
    if _loaded:
        return
    with _load_lock:
        if _loaded:
            return
        importlib.import_module("agentrl.envs")
        for ep in entry_points(group="agentrl.envs"):
            ep.load()
        _loaded = True


def list_envs() -> list[str]:
    """Ids of every env registered with ``register_env`` (and any ``agentrl/`` id), sorted."""
    _load_env_plugins()
    return sorted(k for k in gym.registry if k.startswith(f"{NAMESPACE}/") or k in _registered)


_HOW_TO_ADD = ("An env of your own: register it with agentrl.register_env('myorg/Name-v0', ...) in a "
               "module, then pass 'module:myorg/Name-v0' as the id, or list the module in env.imports "
               "(--set 'env.imports=[module]'), or publish it as an 'agentrl.envs' entry point.")


def resolve_env_id(env_id: str, imports: list[str] | tuple[str, ...] = ()) -> str:
    """The registered id ``env_id`` names; a bare or versionless name is completed.

    ``imports`` are imported first, and so is ``module`` of a ``module:id``
    (gymnasium's form). Raises ``EnvError`` with the closest registered id,
    the full list and how to make an env visible.
    """
    module, sep, rest = env_id.rpartition(":")
    if sep:
        import_env_modules([module])
        env_id = rest
    import_env_modules(imports)
    known = list_envs()
    if env_id in known:
        return env_id
    short = {k.split("/", 1)[1]: k for k in known}
    bare = {name.split("-v")[0]: k for name, k in short.items()}
    name = env_id.split("/")[-1]
    if name in short:
        return short[name]
    if name in bare:
        return bare[name]
    close = difflib.get_close_matches(name, list(short) + list(bare), n=1, cutoff=0.4)
    hint = f" Did you mean {short.get(close[0], bare.get(close[0]))!r}?" if close else ""
    raise EnvError(f"unknown env {env_id!r}.{hint} Registered envs: {', '.join(known)}. {_HOW_TO_ADD}")


def env_creator(env_id: str, imports: list[str] | tuple[str, ...] = ()) -> Any:
    """The callable gymnasium builds ``env_id`` with (a class, usually)."""
    from gymnasium.envs.registration import load_env_creator

    spec = gym.spec(resolve_env_id(env_id, imports))
    return load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point


def check_env_kwargs(env_id: str, kwargs: dict[str, Any], key: str = "env.kwargs",
                     imports: list[str] | tuple[str, ...] = ()) -> None:
    """Raise ``ConfigError`` naming ``key`` where ``kwargs`` pass a keyword ``env_id``'s constructor
    does not take (one that takes ``**kwargs`` accepts any): checked before a run starts, since
    every episode would fail making its env, each recorded as a failure of its own."""
    from .errors import ConfigError

    if not kwargs:
        return
    try:
        params = inspect.signature(env_creator(env_id, imports)).parameters
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    if bad := sorted(set(kwargs) - set(params) - {"max_episode_steps"}):  # gymnasium.make's own (TimeLimit)
        raise ConfigError(f"{key}: {env_id} takes no keyword {', '.join(map(repr, bad))}; "
                          f"it takes {', '.join(k for k in params if k != 'self')}")


def make_env(env_id: str, **kwargs: Any) -> gym.Env:
    """``gymnasium.make`` for agentrl envs (``module:id`` too), with a did-you-mean on unknown ids."""
    return gym.make(resolve_env_id(env_id), disable_env_checker=True, **kwargs)


# -- what an env returns ---------------------------------------------------------------
# A user's env is checked where its answer is read, so that a wrong value fails its
# episode with a reason that names the env, not later: bytes broke the trajectories
# file after every episode had run, a NaN reward reached the advantages, a str as
# admissible_actions was listed letter by letter.

_SHAPES = {"reset": "(observation, info)",
           "step": "gymnasium's five-tuple (observation, reward, terminated, truncated, info)"}


def _flag(value: Any) -> bool:
    """Whether ``value`` is a gymnasium done flag: a bool (numpy's too), or an int 0 or 1."""
    return isinstance(value, bool | np.bool_) or (isinstance(value, numbers.Integral) and value in (0, 1))


def _observation_problem(method: str, obs: Any) -> str | None:
    if not isinstance(obs, str):
        hint = " (decode bytes first)" if isinstance(obs, bytes | bytearray) else ""
        return f"env.{method} returned an observation of type {type(obs).__name__}: observations are str{hint}"
    if not obs.isascii():
        try:
            obs.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: no tokenizer or file takes it
            return (f"env.{method} returned an observation that is not valid Unicode ({e.reason} "
                    f"{obs[e.start]!r} at index {e.start}); decode bytes with errors='replace'")
    return None


def _info_problem(method: str, info: Any) -> str | None:
    if not isinstance(info, dict):
        return f"env.{method} returned info of type {type(info).__name__}: info is a dict"
    actions = info.get("admissible_actions")
    if actions is not None and not isinstance(actions, list | tuple):
        return (f"env.{method} returned info['admissible_actions'] of type {type(actions).__name__}: "
                "it is a list of action strings")
    messages = info.get("tool_messages")
    if messages and not (isinstance(messages, list | tuple) and all(isinstance(m, dict) for m in messages)):
        return f"env.{method} returned info['tool_messages'] that is not a list of message dicts"
    prompt = info.get("tools_prompt")
    if prompt is not None and not isinstance(prompt, str):
        return f"env.{method} returned info['tools_prompt'] of type {type(prompt).__name__}: it is a str"
    success = info.get("success")
    if success is not None and not isinstance(success, numbers.Number | np.bool_):
        # bool("false") is True: a str here would count as a success
        return f"env.{method} returned info['success']={success!r:.40}: it is a bool"
    return None


def answer_problem(method: str, answer: Any) -> str | None:
    """What is wrong with what ``env.reset`` (``method="reset"``) or ``env.step`` returned,
    against the contract of the module docstring, in words; None when it is right.

    Lenient where gymnasium is (a numpy or int reward, numpy bools, both flags set),
    strict where a value would be misread: a reward that is a str or not finite, a
    done flag that is not a bool, an observation that is not valid Unicode text.
    """
    size = 2 if method == "reset" else 5
    if not isinstance(answer, tuple | list) or len(answer) != size:
        got = f"{len(answer)} values" if isinstance(answer, tuple | list) else type(answer).__name__
        return f"env.{method} returned {got}, not {_SHAPES[method]}"
    if problem := _observation_problem(method, answer[0]) or _info_problem(method, answer[-1]):
        return problem
    if method == "reset":
        return None
    _, reward, terminated, truncated, _ = answer
    if isinstance(reward, str | bytes):
        return f"env.step returned the reward {reward!r:.40}, a {type(reward).__name__}: rewards are numbers"
    try:
        value = float(reward)
    except (TypeError, ValueError):
        return f"env.step returned a reward of type {type(reward).__name__}: rewards are numbers"
    if not math.isfinite(value):  # it would reach every advantage of its group
        return f"env.step returned a reward of {value}: rewards are finite"
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not _flag(flag):
            return f"env.step returned {name}={flag!r:.40}: it is a bool"
    return None


def _text(s: str) -> str:
    if s.isascii():
        return str(s)
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def jsonable(value: Any, _depth: int = 0) -> Any:
    """``value`` (an env's ``info``, or a part of it) as strict JSON data: dict keys become
    str, tuples and sets lists, numpy scalars numbers and arrays lists, non-finite floats the strings "nan",
    "inf" and "-inf" (JSON has none; a file that holds them is unreadable to most parsers),
    a lone surrogate in a str its escape (``\\udcff``: UTF-8 has no such character), and
    anything else its ``str``. A container nested over 64 deep (a cycle) is cut there."""
    if isinstance(value, np.generic):
        value = value.item()
    elif isinstance(value, np.ndarray):  # its str cuts what is over 1,000 elements to '...'
        value = value.tolist()
    if value is None or type(value) is bool:
        return value
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict | list | tuple | set | frozenset):
        if _depth >= 64:
            return f"<{type(value).__name__} nested over 64 deep>"
        if isinstance(value, dict):
            return {_text(str(k)): jsonable(v, _depth + 1) for k, v in value.items()}
        return [jsonable(v, _depth + 1) for v in value]
    return _text(str(value))


def close_quietly(env: Any) -> None:
    """``env.close()``; what it raises is a warning: the env is dropped either way."""
    try:
        env.close()
    except Exception as e:
        warnings.warn(f"env.close raised {type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)


class EnvClosers:
    """Closes envs each on a daemon thread of its own, so that one stuck in ``close()`` (a
    container, a browser, a game engine in C) holds neither the others nor its caller."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []

    def close(self, env: Any) -> None:
        """Start closing ``env``; it does not wait."""
        t = threading.Thread(target=close_quietly, args=(env,), daemon=True, name="agentrl-env-close")
        t.start()
        self._threads.append(t)

    def wait(self, deadline: float) -> int:
        """Wait for the closes started so far until ``time.monotonic()`` reaches ``deadline``;
        returns how many still run (left to their daemon threads)."""
        threads, self._threads = self._threads, []
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        return sum(t.is_alive() for t in threads)
