"""Curricula: the env's level as a function of the data position.

A level is a set of env keyword overrides (``env_kwargs``, merged over
``env.kwargs``) and, optionally, its own turn cap (``max_turns``, in place of
``rollout.max_turns``). ALFWorld-v0's levels, for instance, are its
``families``, ``max_receptacles`` and ``max_steps``.

- ``train.curriculum`` is a list of stages, played in order: each is a level
  for ``steps`` RL steps, and the last may leave ``steps`` out to run to the
  end. Steps past the stages stay at the last one.
- ``sft.levels`` gives SFT's expert episodes as several levels: ``episodes``
  tasks each, on consecutive seeds from ``sft.seed_start``. They are one
  dataset, and each epoch draws its minibatches across all of them.

A level's env keyword names are checked against the env's constructor when the
run starts (``check_levels``), so a misspelt key fails naming its stage, not
as every episode of that stage failing later. Values are the env's to check:
a bad one fails the stage's episodes, each with the env's reason recorded.
With ``rollout.env_executor: ray`` each level has its own env worker pool
(pools are keyed by env kwargs); a finished stage's pool is shut down at the
next stage's first step (``agentrl.train.rollouts.retire_finished_stage``), so
the cluster holds the current stage's workers and the evaluation's.

Held-out evaluation stays where ``train.evaluation`` puts it (``env.kwargs``
and its own ``env_kwargs``): the target level, whatever stage the run is in.
Where it names a ``split``, no training data may come from that split:
``check_held_out`` refuses ``env.kwargs``, a stage or an SFT level that sets it.

The stage of step k depends on k alone, as the task seeds do
(``agentrl.train.plan``): a resumed run, or the asynchronous producer rolling
out ahead, plays step k at the level of step k. A promotion on rollout success
would make the level depend on the run's history instead; the logged
``rollout/success`` per ``data/curriculum_stage`` shows where a stage's
success stalls, which is what to set its ``steps`` from.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, TypeVar

from pydantic import Field

from ..config import Config, _Strict
from ..errors import ConfigError

__all__ = ["CurriculumStage", "Level", "SFTLevel", "at_level", "check_held_out", "check_levels", "describe",
           "stage_at"]

C = TypeVar("C", bound=Config)


class Level(_Strict):
    """Env keyword overrides and a turn cap: one level of an env."""

    name: str | None = Field(None, description="A label for logs and the plan; default: stage N.")
    env_kwargs: dict[str, Any] = Field(default_factory=dict, description="Env keyword arguments "
                                       "at this level, merged over env.kwargs.")
    max_turns: int | None = Field(None, ge=1, description="rollout.max_turns at this level; "
                                  "null: rollout.max_turns.")


class CurriculumStage(Level):
    """A level for some RL steps (``train.curriculum``)."""

    steps: int | None = Field(None, ge=1, description="RL steps at this level; null (the last "
                              "stage only): the rest of the run.")


class SFTLevel(Level):
    """Expert episodes at one level (``sft.levels``)."""

    episodes: int = Field(..., ge=1, description="Expert episodes (tasks) at this level.")


def at_level(cfg: C, level: Level | None) -> C:
    """A deep copy of ``cfg`` with ``level``'s env kwargs and turn cap (a plain copy for None)."""
    out = cfg.model_copy(deep=True)
    if level is None:
        return out
    out.env.kwargs = {**cfg.env.kwargs, **level.env_kwargs}
    if level.max_turns is not None:
        out.rollout.max_turns = level.max_turns
    return out


def stage_at(stages: list[CurriculumStage], step: int) -> tuple[int, CurriculumStage] | None:
    """The stage (its index and itself) that RL step ``step`` (0-based) plays; None without stages."""
    end = 0
    for i, stage in enumerate(stages):
        if stage.steps is None:
            return i, stage
        end += stage.steps
        if step < end:
            return i, stage
    return (len(stages) - 1, stages[-1]) if stages else None


def describe(levels: list[CurriculumStage] | list[SFTLevel]) -> str:
    """One line for the plan: ``name (N steps), ...``."""
    parts = []
    for i, lv in enumerate(levels):
        n = getattr(lv, "steps", None) or getattr(lv, "episodes", None)
        unit = "episodes" if isinstance(lv, SFTLevel) else "steps"
        parts.append(f"{lv.name or f'stage {i}'} ({f'{n} {unit}' if n else 'the rest'})")
    return ", ".join(parts)


def check_levels(env_id: str, imports: list[str], levels: dict[str, list[Level]]) -> None:
    """Raise ``ConfigError`` naming ``<key>.<i>.env_kwargs`` where a level passes a keyword the
    env's constructor does not take (one that takes ``**kwargs`` accepts any). ``levels`` maps a
    config key (``train.curriculum``, ``sft.levels``) to its levels."""
    from ..env import check_env_kwargs

    for key, items in levels.items():
        for i, level in enumerate(items):
            check_env_kwargs(env_id, level.env_kwargs, f"{key}.{i}.env_kwargs", imports)


def check_held_out(base: dict[str, Any], held_out: dict[str, Any], levels: dict[str, list[Level]],
                   env_id: str | None = None, imports: list[str] | None = None) -> None:
    """Raise ``ConfigError`` where training data would come from the split the evaluation holds
    out: ``held_out`` is ``train.evaluation.env_kwargs``, ``base`` is ``env.kwargs``, ``levels``
    as in ``check_levels``. Only a ``split`` the evaluation names explicitly is guarded (without
    one it draws other seeds of the training split, by design). With ``env_id``, a split left
    out means the constructor's default, and another name of the same split (the env class's
    ``split_aliases``, such as the real ALFWorld's ``eval_out_of_distribution``) is the same."""
    if held_out.get("split") is None:
        return
    default, aliases = None, {}
    if env_id is not None:
        from ..env import env_creator

        creator = env_creator(env_id, imports or [])
        aliases = dict(getattr(creator, "split_aliases", None) or {})
        with contextlib.suppress(TypeError, ValueError):
            param = inspect.signature(creator).parameters.get("split")
            if param is not None and param.default is not inspect.Parameter.empty:
                default = param.default

    def canonical(split: Any) -> Any:
        try:
            return aliases.get(split, split)
        except TypeError:  # an unhashable split (a list): no alias names it; the env says what it accepts
            return split

    split = canonical(held_out["split"])
    why = f"train.evaluation.env_kwargs.split holds {held_out['split']!r} out for evaluation; train on another split"
    if canonical(base.get("split", default)) == split:
        raise ConfigError(f"env.kwargs.split: {why}")
    for key, items in levels.items():
        for i, level in enumerate(items):
            if canonical({**base, **level.env_kwargs}.get("split", default)) == split:
                raise ConfigError(f"{key}.{i}.env_kwargs.split: {why}")
