"""The observation-consistent expert of the WebShop-style env.

Its next action is a function of the pages the agent has seen and the actions
it took. It never reads the goal product, so a policy of the observations can
imitate it (``docs/architecture.md``, Principles: demonstrations must be
learnable). The env's ``oracle_action`` keeps the privileged shopper, which
knows which product the goal was drawn from.

What it reads off the instruction (``parse_request``): the product type (the
longest type of the shop's vocabulary that the instruction names), the
attributes before it, the options it names (each option group's phrase, as
``vocab.OPTION_PHRASES`` words it) and the price limit. Then:

1. search page: ``search[attributes, type, option values]``;
2. results page: open the best result not tried yet, judged by its visible
   title and price: the type in the title and the price under the limit, then
   the most requested attributes in the title, then rank. None left on this
   page: the next page, else back to search;
3. item page: a wrong type, a price over the limit or a requested option
   value not on offer sends it back (``< prev``). Else it selects each
   requested option, reads the features once when the title does not show
   every requested attribute (and goes back if one is missing), and buys;
4. description or features page: back to the item.

It can still buy a product whose attributes it could not see, and it gives
up on a query after one pass over the results: its score is below 1 on some
tasks (``bench`` reports its mean score and success).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .vocab import CATEGORIES, OPTION_GROUPS, OPTION_PHRASES

__all__ = ["Request", "ShopNotes", "expert_from_history", "next_action", "parse_request"]

_TYPES = sorted((t for ts in CATEGORIES.values() for t in ts), key=len, reverse=True)
_PRICE = re.compile(r"price lower than ([\d.]+) dollars")
_INSTRUCTION = re.compile(r"^Instruction: (.+)$", re.MULTILINE)
_RESULT = re.compile(r"^\[(b0[0-9a-z]+)\] (.+) \| \$([\d.]+)$", re.MULTILINE)
_ITEM_PRICE = re.compile(r"^Price: \$([\d.]+)", re.MULTILINE)
_CLICK = re.compile(r"^\s*click\s*\[(.+)\]\s*$", re.IGNORECASE | re.DOTALL)
_OPENERS = ("i need", "i am looking for", "i want to buy", "find me", "i'm searching for", "get me")


@dataclass(frozen=True, slots=True)
class Request:
    """What an instruction asks for."""

    product_type: str
    attributes: tuple[str, ...]
    options: tuple[tuple[str, str], ...]  # (group, value)
    price_upper: float

    @property
    def query(self) -> str:
        return " ".join([*self.attributes, self.product_type, *(v for _, v in self.options)])


def parse_request(instruction: str) -> Request | None:
    """The request an instruction states, or None when it names no known product type."""
    text = instruction.lower().strip()
    m = _PRICE.search(text)
    price = float(m.group(1)) if m else float("inf")
    head = re.sub(r",? and\s*$", "", text[: m.start()]) if m else text
    ptype = next((t for t in _TYPES if f" {t} " in f" {head} "), None)
    if ptype is None:
        return None
    before, _, after = head.partition(f" {ptype}")
    for opener in _OPENERS:
        if before.startswith(opener + " "):
            before = before[len(opener) + 1:]
            break
    before = re.sub(r"^an? ", "", before)
    attributes = tuple(a.strip() for a in before.split(" and ") if a.strip())
    options = []
    for group, values in OPTION_GROUPS.items():
        for value in values:
            if OPTION_PHRASES[group].format(value) in after:
                options.append((group, value))
    return Request(ptype, attributes, tuple(options), price)


@dataclass(slots=True)
class ShopNotes:
    """What the agent has seen: the request, the page now, the items tried, the features read."""

    request: Request | None = None
    page: str = ""  # the last page's text
    item: str | None = None  # the asin of the item page it is on (from the click that opened it)
    tried: set[str] = field(default_factory=set)
    features: dict[str, str] = field(default_factory=dict)  # asin -> features text it read
    searches: int = 0

    def read(self, action: str | None, observation: str) -> None:
        """Update from one observation (``action``: what produced it; None at reset)."""
        if self.request is None:
            m = _INSTRUCTION.search(observation)
            if m:
                self.request = parse_request(m.group(1))
        if observation.startswith("Invalid action!"):
            return  # the page did not change
        self.page = observation
        click = _CLICK.match(action or "")
        target = click.group(1).strip().lower() if click else ""
        if action and action.lower().startswith("search"):
            self.searches += 1
        if re.fullmatch(r"b0[0-9a-z]+", target):
            self.item = target
            self.tried.add(target)
        elif _page(observation) == "features" and self.item:
            self.features[self.item] = _body(observation)
        elif _page(observation) in ("search", "results"):
            self.item = None


def _body(obs: str) -> str:
    """The page without its instruction line."""
    if obs.startswith("Instruction:"):
        return obs.split("\n", 1)[1] if "\n" in obs else ""
    return obs


def _page(obs: str) -> str:
    body = _body(obs)
    if body.startswith("[search]"):
        return "search"
    if "[buy now]" in body:
        return "item"
    if body.startswith("[back to search]") and "[< prev]" not in body.split("\n", 1)[0]:
        return "results"
    if "\n- " in body:
        return "features"
    return "description" if body else "none"


def next_action(n: ShopNotes) -> str:
    """The expert's next action from what ``n`` has seen."""
    r, page = n.request, _page(n.page)
    if page == "search":
        return f"search[{r.query if r else ''}]"
    if r is None:
        return "click[back to search]"
    if page == "results":
        return _pick_result(n, r)
    if page == "item":
        return _on_item(n, r)
    return "click[< prev]"


def _pick_result(n: ShopNotes, r: Request) -> str:
    rows = _RESULT.findall(n.page)
    best, best_key = None, None
    for rank, (asin, title, price) in enumerate(rows):
        t = title.lower()
        if asin in n.tried or r.product_type not in t or float(price) > r.price_upper:
            continue
        key = (-sum(a in t for a in r.attributes), rank)
        if best_key is None or key < best_key:
            best, best_key = asin, key
    if best is not None:
        return f"click[{best}]"
    if "[next >]" in n.page:
        return "click[next >]"
    return "click[back to search]"


def _on_item(n: ShopNotes, r: Request) -> str:
    lines = _body(n.page).split("\n")
    title = lines[1].lower() if len(lines) > 1 else ""
    m = _ITEM_PRICE.search(n.page)
    price = float(m.group(1)) if m else float("inf")
    if r.product_type not in title or price > r.price_upper:
        return "click[< prev]"
    offered = _offered(n.page)
    for group, value in r.options:
        if value not in offered.get(group, ()):
            return "click[< prev]"
        if offered[group] and _selected(n.page, group) != value:
            return f"click[{value}]"
    missing = [a for a in r.attributes if a not in title]
    if missing and n.item is not None:
        seen = n.features.get(n.item)
        if seen is None:
            return "click[features]"
        if any(a not in seen.lower() for a in missing):
            return "click[< prev]"
    return "click[buy now]"


_OPTION_LINE = re.compile(r"^([a-z ]+?)(?: \(selected: (.+?)\))?: (\[.*\])$", re.MULTILINE)


def _offered(page: str) -> dict[str, tuple[str, ...]]:
    """Option group -> the values the item page offers."""
    return {m.group(1): tuple(re.findall(r"\[([^\]]+)\]", m.group(3)))
            for m in _OPTION_LINE.finditer(page) if m.group(1) in OPTION_GROUPS}


def _selected(page: str, group: str) -> str | None:
    """The value selected in ``group`` on the item page, or None."""
    for m in _OPTION_LINE.finditer(page):
        if m.group(1) == group:
            return m.group(2)
    return None


def expert_from_history(observations: list[str], actions: list[str]) -> str:
    """The expert's next action after ``actions`` (one fewer than ``observations``: the reset's first)."""
    if len(observations) != len(actions) + 1:
        raise ValueError("give the opening observation plus one observation per action")
    notes = ShopNotes()
    notes.read(None, observations[0])
    for a, o in zip(actions, observations[1:], strict=True):
        notes.read(a, o)
    return next_action(notes)
