"""Static household data for the ALFWorld-style env: what exists, where it may go.

Everything here is plain data (tuples, frozensets, dicts) read by the scene
generator, the rules and the PDDL exporter. The object properties (which types
can be cleaned, heated, cooled) follow ALFRED's lists of valid action objects;
the placement table (``CAN_CONTAIN``) is our own, chosen to be plausible.
"""

from __future__ import annotations

__all__ = [
    "CAN_CONTAIN",
    "CLEANABLE",
    "COOLABLE",
    "FAMILIES",
    "FAMILY_ROOMS",
    "HEATABLE",
    "LAMP_HOLDERS",
    "LAMPS",
    "OPENABLE",
    "ROOMS",
    "RoomSpec",
]

from dataclasses import dataclass

FAMILIES: tuple[str, ...] = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)

OPENABLE = frozenset({"cabinet", "drawer", "fridge", "microwave", "safe"})

# Object properties (ALFRED's valid action objects, restricted to our types).
HEATABLE = frozenset({"apple", "bread", "cup", "egg", "mug", "plate", "potato", "tomato"})
COOLABLE = frozenset(
    {"apple", "bowl", "bread", "cup", "egg", "lettuce", "mug", "pan", "plate", "pot", "potato"}
    | {"tomato", "winebottle"}
)
CLEANABLE = frozenset(
    {"apple", "bowl", "butterknife", "cloth", "cup", "dishsponge", "egg", "fork", "kettle"}
    | {"knife", "ladle", "lettuce", "mug", "pan", "plate", "pot", "potato", "soapbar"}
    | {"spatula", "spoon", "tomato"}
)

# Light sources: toggleable objects that cannot be picked up, standing on a holder.
LAMPS = frozenset({"desklamp", "floorlamp"})
LAMP_HOLDERS = frozenset({"desk", "sidetable", "dresser", "coffeetable", "tvstand"})

_FOOD = frozenset({"apple", "bread", "egg", "lettuce", "potato", "tomato"})
_DISH = frozenset({"mug", "cup", "plate", "bowl"})
_COOKWARE = frozenset({"pan", "pot", "kettle"})
_UTENSIL = frozenset({"fork", "knife", "butterknife", "spoon", "spatula", "ladle"})
_KITCHEN = frozenset({"saltshaker", "peppershaker", "dishsponge", "winebottle", "soapbottle"})
_TRINKET = frozenset(
    {"alarmclock", "book", "cd", "cellphone", "creditcard", "keychain", "pen", "pencil"}
    | {"remotecontrol", "watch", "newspaper"}
)
_DECOR = frozenset({"vase", "statue", "tissuebox", "box", "candle", "laptop"})
_SOFT = frozenset({"pillow", "teddybear", "cloth"})
_SPORTS = frozenset({"baseballbat", "basketball", "tennisracket"})
_BATH = frozenset(
    {"soapbar", "soapbottle", "spraybottle", "toiletpaper", "candle", "cloth", "tissuebox"}
)
_TOWEL = frozenset({"towel", "handtowel"})

# Which object types each receptacle type can hold (PDDL ``canContain``).
CAN_CONTAIN: dict[str, frozenset[str]] = {
    "countertop": _FOOD | _DISH | _COOKWARE | _UTENSIL | _KITCHEN | _BATH | _TOWEL,
    "diningtable": _FOOD | _DISH | _COOKWARE | _UTENSIL | _KITCHEN | _TRINKET | _DECOR,
    "cabinet": _DISH | _COOKWARE | _KITCHEN | _BATH | _TOWEL | {"bread", "potato", "vase", "box"},
    "drawer": _UTENSIL | _TRINKET | {"cloth", "soapbar", "toiletpaper", "dishsponge", "candle"},
    "fridge": _FOOD | _DISH | {"pan", "pot", "winebottle"},
    "microwave": _FOOD | _DISH,
    "sinkbasin": _FOOD | _DISH | _COOKWARE | _UTENSIL | {"dishsponge", "soapbar", "cloth"},
    "bathtubbasin": frozenset({"soapbar", "cloth", "soapbottle"}),
    "stoveburner": _COOKWARE,
    "coffeemachine": frozenset({"mug", "cup"}),
    "toaster": frozenset(),
    "garbagecan": _FOOD
    | {"cd", "creditcard", "newspaper", "pen", "pencil", "soapbar", "soapbottle"}
    | {"spraybottle", "toiletpaper", "tissuebox", "dishsponge", "cloth", "candle", "winebottle"},
    "shelf": _DISH | _KITCHEN | _TRINKET | _DECOR | _BATH,
    "sidetable": _TRINKET | _DECOR | _DISH | {"pillow", "teddybear"},
    "desk": _TRINKET | _DECOR | {"mug", "cup", "bowl", "baseballbat", "tennisracket"},
    "dresser": _TRINKET | _DECOR | _SPORTS | {"mug", "bowl", "cloth", "teddybear"},
    "coffeetable": _TRINKET | _DECOR | {"plate", "mug", "bowl"},
    "tvstand": _TRINKET | _DECOR,
    "bed": _SOFT | {"book", "cellphone", "laptop", "remotecontrol", "creditcard", "keychain"},
    "sofa": _SOFT
    | {"book", "cellphone", "laptop", "remotecontrol", "creditcard", "keychain"}
    | {"newspaper", "box"},
    "armchair": _SOFT
    | {"book", "cellphone", "laptop", "remotecontrol", "creditcard"}
    | {"keychain", "newspaper", "box"},
    "safe": frozenset({"creditcard", "keychain", "cellphone", "watch", "cd", "vase", "statue"}),
    "toilet": frozenset({"soapbar", "soapbottle", "spraybottle", "toiletpaper", "candle", "cloth"}),
    "towelholder": frozenset({"towel"}),
    "handtowelholder": frozenset({"handtowel"}),
    "toiletpaperhanger": frozenset({"toiletpaper"}),
    "laundryhamper": frozenset({"cloth", "towel", "handtowel"}),
}


@dataclass(frozen=True, slots=True)
class RoomSpec:
    """How a room type is furnished: receptacle counts, object pool and lamps."""

    receptacles: tuple[tuple[str, int, int], ...]  # (type, min count, max count)
    objects: frozenset[str]
    lamps: tuple[str, ...] = ()


ROOMS: dict[str, RoomSpec] = {
    "kitchen": RoomSpec(
        receptacles=(
            ("cabinet", 3, 10),
            ("drawer", 2, 7),
            ("countertop", 1, 3),
            ("fridge", 1, 1),
            ("microwave", 1, 1),
            ("sinkbasin", 1, 2),
            ("stoveburner", 2, 4),
            ("coffeemachine", 1, 1),
            ("toaster", 1, 1),
            ("garbagecan", 1, 1),
            ("shelf", 0, 3),
            ("diningtable", 0, 2),
        ),
        objects=_FOOD | _DISH | _COOKWARE | _UTENSIL | _KITCHEN,
    ),
    "bedroom": RoomSpec(
        receptacles=(
            ("bed", 1, 2),
            ("desk", 0, 2),
            ("sidetable", 1, 2),
            ("dresser", 0, 1),
            ("drawer", 2, 6),
            ("shelf", 0, 5),
            ("garbagecan", 1, 1),
            ("laundryhamper", 0, 1),
            ("safe", 0, 1),
            ("armchair", 0, 1),
        ),
        objects=_TRINKET | _DECOR | _SOFT | _SPORTS | {"mug", "bowl", "cup"},
        lamps=("desklamp",),
    ),
    "livingroom": RoomSpec(
        receptacles=(
            ("sofa", 1, 1),
            ("armchair", 0, 2),
            ("coffeetable", 1, 2),
            ("sidetable", 0, 3),
            ("diningtable", 0, 1),
            ("cabinet", 0, 4),
            ("drawer", 0, 5),
            ("shelf", 0, 6),
            ("tvstand", 0, 1),
            ("dresser", 0, 1),
            ("garbagecan", 1, 1),
            ("safe", 0, 1),
        ),
        objects=_TRINKET | _DECOR | {"pillow", "plate", "bowl", "cloth"},
        lamps=("floorlamp", "desklamp"),
    ),
    "bathroom": RoomSpec(
        receptacles=(
            ("toilet", 1, 1),
            ("sinkbasin", 1, 2),
            ("bathtubbasin", 0, 1),
            ("countertop", 1, 1),
            ("cabinet", 1, 4),
            ("drawer", 0, 4),
            ("shelf", 0, 3),
            ("towelholder", 1, 1),
            ("handtowelholder", 0, 1),
            ("toiletpaperhanger", 1, 1),
            ("garbagecan", 1, 1),
        ),
        objects=_BATH | _TOWEL | {"dishsponge"},
    ),
}

# Which rooms host which task family (the appliance or lamp it needs must be there).
FAMILY_ROOMS: dict[str, tuple[str, ...]] = {
    "pick_and_place_simple": ("kitchen", "bedroom", "livingroom", "bathroom"),
    "look_at_obj_in_light": ("bedroom", "livingroom"),
    "pick_clean_then_place_in_recep": ("kitchen", "bathroom"),
    "pick_heat_then_place_in_recep": ("kitchen",),
    "pick_cool_then_place_in_recep": ("kitchen",),
    "pick_two_obj_and_place": ("kitchen", "bedroom", "livingroom", "bathroom"),
}
