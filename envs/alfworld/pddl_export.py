"""Export our scenes as ALFWorld PDDL problems for the bundled ``alfred.pddl`` domain.

The problem text is what alfworld's ``PddlEnv`` loads (with ``AlfredDemangler``
turning ids back into names). This module is pure text and imports nothing
from alfworld; ``real_engine`` plays the result.

Ids. The demangler names an entity ``<prefix> <k>`` where ``<prefix>`` is the id
up to the first ``_bar_`` (plus "basin" when the id contains "basin"), and it
numbers the ids of one prefix in *descending* sorted order. We therefore give
instance ``n`` of a type the id ``<type>_bar_<900 - n>`` so that "cabinet 1"
here is "cabinet 1" there; sink and bathtub basins are spelt
``sink_bar_<k>_bar_basin`` because the demangler appends "basin" itself.

Every receptacle stands at its own location; the agent starts at
``loc_bar_start`` ("the middle of the room"). Goals are ALFWorld's goal
formulas for the six families (type-level: any object of the type in any
receptacle of the type).

Known differences from ALFWorld's own problems, none of which changes what is
admissible or what wins: we emit no ``sliceable``/``isReceptacleObject`` facts
(no slicing, no movable receptacles), no distances (every ``go to`` costs 1),
and lamps are objects standing in a receptacle (ALFWorld floor lamps sometimes
stand alone).
"""

from __future__ import annotations

from .catalog import CAN_CONTAIN, CLEANABLE, COOLABLE, HEATABLE, LAMPS
from .scene import Scene, Task

__all__ = ["entity_id", "goal_pddl", "scene_to_pddl", "type_id"]

_BASINS = {"sinkbasin": "sink", "bathtubbasin": "bathtub"}


def entity_id(name: str) -> str:
    """The PDDL id of an entity named like "cabinet 3" or "sinkbasin 1"."""
    kind, num = name.rsplit(" ", 1)
    n = int(num)
    if not 1 <= n < 900:
        raise ValueError(f"instance number {n} of {kind!r} is out of range 1..899")
    if kind in _BASINS:
        return f"{_BASINS[kind]}_bar_{900 - n}_bar_basin"
    return f"{kind}_bar_{900 - n}"


def type_id(kind: str) -> str:
    """The PDDL type constant of a kind ("sinkbasin" -> "sinkbasinType")."""
    return f"{kind}Type"


def goal_pddl(task: Task) -> str:
    """ALFWorld's goal formula for ``task``."""
    o, r = type_id(task.obj_type), type_id(task.target)
    if task.family == "look_at_obj_in_light":
        return (
            "(:goal (and\n"
            "  (exists (?ot - object ?r - receptacle ?a - agent ?l - location)\n"
            f"    (and (objectType ?ot {r}) (toggleable ?ot) (isToggled ?ot)\n"
            "         (receptacleAtLocation ?r ?l) (atLocation ?a ?l) (inReceptacle ?ot ?r)))\n"
            f"  (exists (?o - object ?a - agent) (and (objectType ?o {o}) (holds ?a ?o)))))"
        )
    if task.family == "pick_two_obj_and_place":
        return (
            "(:goal (exists (?r - receptacle ?o1 - object ?o2 - object)\n"
            f"  (and (receptacleType ?r {r}) (not (= ?o1 ?o2))\n"
            f"       (objectType ?o1 {o}) (inReceptacle ?o1 ?r)\n"
            f"       (objectType ?o2 {o}) (inReceptacle ?o2 ?r))))"
        )
    extra = {
        "pick_clean_then_place_in_recep": " (cleanable ?o) (isClean ?o)",
        "pick_heat_then_place_in_recep": " (heatable ?o) (isHot ?o)",
        "pick_cool_then_place_in_recep": " (coolable ?o) (isCool ?o)",
    }.get(task.family, "")
    return (
        "(:goal (exists (?r - receptacle ?o - object)\n"
        f"  (and (inReceptacle ?o ?r) (objectType ?o {o}) (receptacleType ?r {r}){extra})))"
    )


def scene_to_pddl(scene: Scene) -> str:
    """The PDDL problem of ``scene`` in its initial state."""
    rids = [entity_id(n) for n in scene.recep_names]
    oids = [entity_id(n) for n in scene.obj_names]
    locs = [f"loc_bar_{r}" for r in range(len(rids))]
    rkinds, okinds = sorted(set(scene.recep_types)), sorted(set(scene.obj_types))
    objects = ["agent1 - agent", "loc_bar_start - location"]
    objects += [f"{loc} - location" for loc in locs]
    objects += [f"{i} - receptacle" for i in rids] + [f"{i} - object" for i in oids]
    objects += [f"{type_id(k)} - rtype" for k in rkinds] + [f"{type_id(k)} - otype" for k in okinds]

    init = ["(atLocation agent1 loc_bar_start)"]
    for r, rid in enumerate(rids):
        kind = scene.recep_types[r]
        init += [
            f"(receptacleAtLocation {rid} {locs[r]})",
            f"(receptacleType {rid} {type_id(kind)})",
        ]
        if scene.openable(r):
            init.append(f"(openable {rid})")
    for o, oid in enumerate(oids):
        kind, r = scene.obj_types[o], scene.obj_start[o]
        init += [f"(objectType {oid} {type_id(kind)})", f"(inReceptacle {oid} {rids[r]})"]
        init.append(f"(objectAtLocation {oid} {locs[r]})")
        init.append(f"(toggleable {oid})" if kind in LAMPS else f"(pickupable {oid})")
        for pred, kinds in (
            ("cleanable", CLEANABLE),
            ("heatable", HEATABLE),
            ("coolable", COOLABLE),
        ):
            if kind in kinds:
                init.append(f"({pred} {oid})")
    for rk in rkinds:
        init += [
            f"(canContain {type_id(rk)} {type_id(ok)})" for ok in okinds if ok in CAN_CONTAIN[rk]
        ]

    lines = [
        f"(define (problem agentrl_{scene.split}_{scene.seed})",
        "(:domain alfred)",
        "(:objects",
    ]
    lines += [f"  {x}" for x in objects] + [")", "(:init"] + [f"  {x}" for x in init] + [")"]
    lines += [goal_pddl(scene.task), ")"]
    return "\n".join(lines) + "\n"
