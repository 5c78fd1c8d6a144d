"""The rules of the ALFWorld-style household: state, admissible commands, feedback text.

``World`` holds the mutable state of one episode over a static ``Scene``. Its
rules mirror ALFWorld's PDDL domain (``alfred.pddl``) action by action, so that
the admissible commands agree with the real engine's (``pddl_export`` checks):

- ``go to R``: any receptacle but the one the agent is at.
- ``open R`` / ``close R``: an openable receptacle here, closed / open.
- ``take O from R``: hands empty, O in R here, R open or not openable.
- ``put O in/on R`` (``move O to R`` in alfworld >= 0.4): holding O, R here,
  open or not openable, and R's type can contain O's type.
- ``clean O with sinkbasin N`` / ``heat O with microwave N`` / ``cool O with
  fridge N``: holding a cleanable / heatable / coolable O at that receptacle
  (it need not be open). Heating clears "cool" and cooling clears "hot".
- ``use L``: a light L in a receptacle here (it stays "on" once used, as the
  PDDL ``isToggled`` does).
- ``examine R`` for the receptacle here; ``examine O`` for the held object only
  (the real engine's grounding never offers it for objects lying in a receptacle).
- ``look``, ``inventory`` and ``help`` always.

Anything else is answered "Nothing happens." and changes nothing.

Feedback text matches the real engine's (up to the order of listed items),
except ``help`` (no slicing line) and ``look`` in the middle of the room, where
the real grammar answers "you see nothing." and we list the receptacles again.

Hot path: ``admissible()`` is cached and rebuilt only after an action that
changes what is admissible (go, open, close, take, put); ``lookup`` maps a
command to an op tuple with two dict lookups.
"""

from __future__ import annotations

from .catalog import CAN_CONTAIN, CLEANABLE, COOLABLE, HEATABLE, LAMPS
from .scene import Scene

__all__ = ["World", "help_text", "listing"]

HELD = -2
# Op codes: plain ints, because they are compared on every step.
(
    GOTO,
    OPEN,
    CLOSE,
    TAKE,
    PUT,
    CLEAN,
    HEAT,
    COOL,
    USE,
    EXAMINE_R,
    EXAMINE_O,
    INVENTORY,
    LOOK,
    HELP,
) = range(14)
_REBUILD = frozenset({GOTO, OPEN, CLOSE, TAKE, PUT})
CLEAN_F, HOT_F, COOL_F, ON_F = 1, 2, 4, 8

_HELP = (
    "Available commands:\n"
    "  look:                             look around your current location\n"
    "  inventory:                        check your current inventory\n"
    "  go to (receptacle):               move to a receptacle\n"
    "  open (receptacle):                open a receptacle\n"
    "  close (receptacle):               close a receptacle\n"
    "  take (object) from (receptacle):  take an object from a receptacle\n"
    "{put}"
    "  examine (something):              examine a receptacle or an object\n"
    "  use (object):                     use an object\n"
    "  heat (object) with (receptacle):  heat an object using a receptacle\n"
    "  clean (object) with (receptacle): clean an object using a receptacle\n"
    "  cool (object) with (receptacle):  cool an object using a receptacle\n"
)
_HELP_PUT = {
    "put": "  put (object) in/on (receptacle):  place an object in or on a receptacle\n",
    "move": "  move (object) to (receptacle):  place an object in or on a receptacle\n",
}


def help_text(put_style: str = "put") -> str:
    """The answer to "help" (ALFWorld's, without slicing, which these scenes lack)."""
    return _HELP.format(put=_HELP_PUT[put_style])


_ALWAYS = {"inventory": (INVENTORY,), "look": (LOOK,), "help": (HELP,)}
_APPLIANCE_OP = {
    "sinkbasin": (CLEAN, "clean"),
    "microwave": (HEAT, "heat"),
    "fridge": (COOL, "cool"),
}


def listing(names: list[str]) -> str:
    """ALFWorld's list style: "a x", "a x, and a y", "a x, a y, and a z", or "nothing"."""
    if not names:
        return "nothing"
    if len(names) == 1:
        return "a " + names[0]
    return ", ".join("a " + n for n in names[:-1]) + ", and a " + names[-1]


class _Static:
    """Per-scene lookup tables shared by every copy of a ``World``."""

    __slots__ = (
        "scene",
        "rnames",
        "onames",
        "rtypes",
        "otypes",
        "openable",
        "contain",
        "pickup",
        "toggle",
        "prop",
        "goto",
        "appliance",
        "task_objs",
        "put_fmt",
        "put_msg",
        "help",
    )

    def __init__(self, scene: Scene, put_style: str):
        self.scene = scene
        self.rnames, self.onames = scene.recep_names, scene.obj_names
        self.rtypes, self.otypes = scene.recep_types, scene.obj_types
        self.openable = tuple(scene.openable(r) for r in range(len(self.rnames)))
        self.contain = tuple(CAN_CONTAIN[t] for t in self.rtypes)
        self.pickup = tuple(t not in LAMPS for t in self.otypes)
        self.toggle = tuple(t in LAMPS for t in self.otypes)
        self.prop = {
            CLEAN: tuple(t in CLEANABLE for t in self.otypes),
            HEAT: tuple(t in HEATABLE for t in self.otypes),
            COOL: tuple(t in COOLABLE for t in self.otypes),
        }
        self.goto = {f"go to {n}": (GOTO, r) for r, n in enumerate(self.rnames)}
        self.appliance = tuple(_APPLIANCE_OP.get(t) for t in self.rtypes)
        self.task_objs = tuple(i for i, t in enumerate(self.otypes) if t == scene.task.obj_type)
        self.help = help_text(put_style)
        if put_style == "move":
            self.put_fmt, self.put_msg = "move {o} to {r}", "You move the {o} to the {r}."
        else:
            self.put_fmt, self.put_msg = "put {o} in/on {r}", "You put the {o} in/on the {r}."


class World:
    """Mutable state of one episode: where the agent is, what it holds, what is where."""

    __slots__ = ("s", "loc", "held", "opened", "contents", "where", "flags", "_adm", "_local")

    def __init__(self, scene: Scene, put_style: str = "put"):
        self.s = _Static(scene, put_style)
        self.loc = -1  # -1: the middle of the room
        self.held = -1
        self.opened = [False] * len(scene.recep_names)
        self.contents: list[list[int]] = [[] for _ in scene.recep_names]
        for o, r in enumerate(scene.obj_start):
            self.contents[r].append(o)
        self.where = list(scene.obj_start)
        self.flags = [0] * len(scene.obj_names)
        self._adm: list[str] | None = None
        self._local: dict[str, tuple] = {}

    def copy(self) -> World:
        """An independent copy; the static tables are shared."""
        w = World.__new__(World)
        w.s, w.loc, w.held = self.s, self.loc, self.held
        w.opened = self.opened[:]
        w.contents = [c[:] for c in self.contents]
        w.where, w.flags = self.where[:], self.flags[:]
        w._adm, w._local = self._adm, self._local  # both are replaced, never mutated
        return w

    # -- commands ----------------------------------------------------------------
    def visible(self, r: int) -> bool:
        return not self.s.openable[r] or self.opened[r]

    def admissible(self) -> list[str]:
        """The admissible commands now, sorted (the list is cached: do not mutate it)."""
        if self._adm is None:
            self._rebuild()
        return self._adm  # type: ignore[return-value]

    def _rebuild(self) -> None:
        s, loc, held = self.s, self.loc, self.held
        local: dict[str, tuple] = dict(_ALWAYS)
        if loc >= 0:
            rn = s.rnames[loc]
            local["examine " + rn] = (EXAMINE_R, loc)
            if s.openable[loc]:
                local[("close " if self.opened[loc] else "open ") + rn] = (
                    (CLOSE if self.opened[loc] else OPEN),
                    loc,
                )
            vis = self.visible(loc)
            for o in self.contents[loc]:
                if s.toggle[o]:
                    local["use " + s.onames[o]] = (USE, o)
                elif vis and held < 0 and s.pickup[o]:
                    local[f"take {s.onames[o]} from {rn}"] = (TAKE, o, loc)
            if held >= 0:
                if vis and s.otypes[held] in s.contain[loc]:
                    local[s.put_fmt.format(o=s.onames[held], r=rn)] = (PUT, held, loc)
                app = s.appliance[loc]
                if app is not None and s.prop[app[0]][held]:
                    local[f"{app[1]} {s.onames[held]} with {rn}"] = (app[0], held, loc)
        if held >= 0:
            local["examine " + s.onames[held]] = (EXAMINE_O, held)
        self._local = local
        gotos = [c for c, op in s.goto.items() if op[1] != loc]
        gotos.extend(local)
        gotos.sort()
        self._adm = gotos

    def lookup(self, command: str) -> tuple | None:
        """The op for an exact admissible command, or None."""
        if self._adm is None:
            self._rebuild()
        op = self._local.get(command)
        if op is None:
            op = self.s.goto.get(command)
            if op is not None and op[1] == self.loc:
                return None
        return op

    # -- effects -----------------------------------------------------------------
    def apply(self, op: tuple) -> str:
        """Carry out an admissible op and return the feedback text."""
        code, s = op[0], self.s
        if code in _REBUILD:
            self._adm = None
        if code == GOTO:
            self.loc = op[1]
            return f"You arrive at {s.rnames[op[1]]}. {self.describe(op[1])}"
        if code == TAKE:
            o, r = op[1], op[2]
            self.contents[r].remove(o)
            self.where[o], self.held = HELD, o
            return f"You pick up the {s.onames[o]} from the {s.rnames[r]}."
        if code == PUT:
            o, r = op[1], op[2]
            self.contents[r].append(o)
            self.where[o], self.held = r, -1
            return s.put_msg.format(o=s.onames[o], r=s.rnames[r])
        if code == OPEN:
            self.opened[op[1]] = True
            return f"You open the {s.rnames[op[1]]}. {self.describe(op[1])}"
        if code == CLOSE:
            self.opened[op[1]] = False
            return f"You close the {s.rnames[op[1]]}."
        if code == CLEAN:
            self.flags[op[1]] |= CLEAN_F
            return f"You clean the {s.onames[op[1]]} using the {s.rnames[op[2]]}."
        if code == HEAT:
            self.flags[op[1]] = (self.flags[op[1]] | HOT_F) & ~COOL_F
            return f"You heat the {s.onames[op[1]]} using the {s.rnames[op[2]]}."
        if code == COOL:
            self.flags[op[1]] = (self.flags[op[1]] | COOL_F) & ~HOT_F
            return f"You cool the {s.onames[op[1]]} using the {s.rnames[op[2]]}."
        if code == USE:
            self.flags[op[1]] |= ON_F
            return f"You turn on the {s.onames[op[1]]}."
        return self._inspect(op)

    def _inspect(self, op: tuple) -> str:
        code, s = op[0], self.s
        if code == EXAMINE_R:
            return self.describe(op[1])
        if code == EXAMINE_O:
            return self.examine_object(op[1])
        if code == INVENTORY:
            if self.held < 0:
                return "You are not carrying anything."
            return f"You are carrying: a {s.onames[self.held]}."
        if code == LOOK:
            return self.look()
        return s.help

    # -- text --------------------------------------------------------------------
    def describe(self, r: int) -> str:
        s = self.s
        name = s.rnames[r]
        items = listing([s.onames[o] for o in self.contents[r]])
        if s.openable[r]:
            if not self.opened[r]:
                return f"The {name} is closed."
            return f"The {name} is open. In it, you see {items}."
        return f"On the {name}, you see {items}."

    def examine_object(self, o: int) -> str:
        name, f = self.s.onames[o], self.flags[o]
        clean = f & CLEAN_F
        if clean and f & HOT_F:
            return f"This is a hot and clean {name}."
        if clean and f & COOL_F:
            return f"This is a cool and clean {name}."
        if f & HOT_F:
            return f"This is a hot {name}."
        if clean:
            return f"This is a clean {name}."
        if f & COOL_F:
            return f"This is a cold {name}."
        if self.s.toggle[o]:
            return f"This {name} is {'on' if f & ON_F else 'off'}."
        return f"There's nothing special about {name}."

    def look(self) -> str:
        if self.loc >= 0:
            return f"You are facing the {self.s.rnames[self.loc]}. Next to it, you see nothing."
        return (
            "You are in the middle of a room. Looking quickly around you, you see "
            f"{listing(list(self.s.rnames))}."
        )

    # -- goal --------------------------------------------------------------------
    def goal_met(self) -> bool:
        """Whether the task's goal holds now (type-level, as ALFWorld's PDDL goals are)."""
        s = self.s
        task = s.scene.task
        fam = task.family
        if fam == "look_at_obj_in_light":
            if self.held < 0 or s.otypes[self.held] != task.obj_type or self.loc < 0:
                return False
            return any(
                s.otypes[o] == task.target and self.flags[o] & ON_F for o in self.contents[self.loc]
            )
        need = _FAMILY_FLAG.get(fam, 0)
        counts: dict[int, int] = {}
        for o in s.task_objs:
            r = self.where[o]
            if r >= 0 and s.rtypes[r] == task.target and (self.flags[o] & need) == need:
                counts[r] = counts.get(r, 0) + 1
        if fam == "pick_two_obj_and_place":
            return any(c >= 2 for c in counts.values())
        return bool(counts)

    def subgoals(self) -> int:
        """A bitmask of subgoals that hold now: 1 = holding a task object, 2 = its
        state change done (clean/hot/cool), one placed (two), or the lamp on (look)."""
        s, task = self.s, self.s.scene.task
        mask = 1 if self.held >= 0 and s.otypes[self.held] == task.obj_type else 0
        fam = task.family
        need = _FAMILY_FLAG.get(fam, 0)
        if need and any(self.flags[o] & need for o in s.task_objs):
            mask |= 2
        elif fam == "pick_two_obj_and_place":
            if any(
                self.where[o] >= 0 and s.rtypes[self.where[o]] == task.target for o in s.task_objs
            ):
                mask |= 2
        elif fam == "look_at_obj_in_light":
            if any(s.otypes[o] == task.target and f & ON_F for o, f in enumerate(self.flags)):
                mask |= 2
        return mask


_FAMILY_FLAG = {
    "pick_clean_then_place_in_recep": CLEAN_F,
    "pick_heat_then_place_in_recep": HOT_F,
    "pick_cool_then_place_in_recep": COOL_F,
}
