"""The privileged oracle of the ALFWorld-style env: the next command from any state.

The oracle reads the whole hidden state (like ALFWorld's planner expert): it
walks straight to an object it has never seen. So it is an oracle (to check
that every task can be won, and as a privileged distillation teacher), never a
source of SFT data: no policy of the observations can follow it
(``docs/architecture.md``, Principles: demonstrations must be learnable).
``expert`` holds the observation-consistent expert. The oracle re-plans from
scratch at every call, so it also recovers from states reached by other
policies. Its plan:

1. If it holds an object the task does not need, put it down where it stands
   when it can, else at the first receptacle that can hold it.
2. Get a task object: the held one, else the first one not already in place
   (go to its receptacle, open it if closed, take it).
3. Change its state if the family asks (clean at a sinkbasin, heat at a
   microwave, cool at a fridge) unless already done.
4. Finish: put it in the target receptacle (opening it first), or for
   ``look_at_obj_in_light`` go to the lamp and use it.

Each step is one admissible command; a task takes at most about 12 of them.
"""

from __future__ import annotations

from .world import CLEAN_F, COOL_F, HOT_F, World

__all__ = ["oracle_command"]

_STATE = {
    "pick_clean_then_place_in_recep": (CLEAN_F, "clean", "sinkbasin"),
    "pick_heat_then_place_in_recep": (HOT_F, "heat", "microwave"),
    "pick_cool_then_place_in_recep": (COOL_F, "cool", "fridge"),
}


def _go_or(w: World, r: int, then: str) -> str:
    """Go to receptacle ``r``, open it if needed, then do ``then``."""
    s = w.s
    if w.loc != r:
        return f"go to {s.rnames[r]}"
    if not w.visible(r):
        return f"open {s.rnames[r]}"
    return then


def _put(w: World, o: int, r: int) -> str:
    s = w.s
    return _go_or(w, r, s.put_fmt.format(o=s.onames[o], r=s.rnames[r]))


def _drop_held(w: World) -> str:
    s, o = w.s, w.held
    here = w.loc
    if here >= 0 and s.otypes[o] in s.contain[here]:
        return _put(w, o, here)
    hosts = [r for r in range(len(s.rnames)) if s.otypes[o] in s.contain[r]]
    hosts.sort(key=lambda r: (s.openable[r], r))  # an open surface saves a step
    return _put(w, o, hosts[0])


def _take(w: World, o: int) -> str:
    s, r = w.s, w.where[o]
    return _go_or(w, r, f"take {s.onames[o]} from {s.rnames[r]}")


def _target_recep(w: World) -> int:
    """The target receptacle: the one of the target type holding most task objects."""
    s, task = w.s, w.s.scene.task
    best, best_n = -1, -1
    for r, t in enumerate(s.rtypes):
        if t != task.target:
            continue
        n = sum(1 for o in w.contents[r] if s.otypes[o] == task.obj_type)
        if n > best_n:
            best, best_n = r, n
    return best


def oracle_command(w: World) -> str:
    """The oracle's next command in world ``w`` ("look" once the goal holds)."""
    s, task = w.s, w.s.scene.task
    if w.goal_met():
        return "look"
    held = w.held
    if held >= 0 and s.otypes[held] != task.obj_type:
        return _drop_held(w)
    if task.family == "look_at_obj_in_light":
        if held < 0:
            return _take(w, next(o for o in s.task_objs if w.where[o] >= 0))
        lamp = next(o for o, t in enumerate(s.otypes) if t == task.target)
        here = w.where[lamp]
        if w.loc != here:
            return f"go to {s.rnames[here]}"
        return f"use {s.onames[lamp]}"
    target = _target_recep(w)
    if held < 0:
        # pick_two keeps what already lies in the target; the others take any object.
        two = task.family == "pick_two_obj_and_place"
        spare = [o for o in s.task_objs if w.where[o] >= 0 and not (two and w.where[o] == target)]
        return _take(w, spare[0])
    state = _STATE.get(task.family)
    if state is not None and not w.flags[held] & state[0]:
        app = next(r for r, t in enumerate(s.rtypes) if t == state[2])
        if w.loc != app:
            return f"go to {s.rnames[app]}"
        return f"{state[1]} {s.onames[held]} with {s.rnames[app]}"
    return _put(w, held, target)
