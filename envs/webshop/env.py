"""``agentrl/WebShop-v0``: find and buy the product an instruction asks for.

A text version of WebShop (Yao et al. 2022) over a generated catalog
(``catalog.get_catalog``; 10,000 products by default, BM25 search via
``bm25s``). Each episode draws a goal from a target product
(``goal.make_goal``): "i need a gluten free snack pack with sea salt flavor,
of 12 count, and price lower than 30.00 dollars".

Pages and their clickable elements:

- ``search``: only here ``search[query]`` is valid.
- ``results``: ``page_size`` products per page (10, as in WebShop) from the
  top 50 hits, each clickable by its ASIN, with ``back to search``, ``next >`` and ``< prev``.
- ``item``: title, price, rating, option values (click one to select it),
  ``description``, ``features``, ``buy now``, ``< prev`` and
  ``back to search``.
- ``description`` / ``features``: the product text, with ``< prev``.

Every page repeats the instruction on its first line, as WebShop does;
``repeat_instruction=False`` states it on the search page only (fewer tokens a
turn). Actions are ``search[query]`` and ``click[element]``, where the element is
one of the clickables now shown (case-insensitive). Anything else gets an
"Invalid action!" observation, and the page stays as it was; for an action that
is not text, the observation names its type (``agentrl.envs._action``).

Reward: 0 until ``click[buy now]``, which ends the episode with the WebShop
score of the bought item (formula in ``goal``'s docstring); ``info["success"]``
is True when the score is 1. The episode is truncated after ``max_steps``
steps (15 by default). ``info["state_key"]`` is a short hash of the true shop
state (GiGPO's anchor).

Two scripted shoppers. ``expert_action`` acts only on the pages seen so far
(``expert``): SFT clones it by default. ``oracle_action`` is privileged: it
reads the goal product to pick a match from the results. It checks that every
goal can be solved and can teach as a privileged teacher, never as SFT data by
default.
"""

from __future__ import annotations

import copy
import hashlib
import random
import re
from dataclasses import dataclass, field, replace
from typing import Any

from agentrl.env import TextEnv
from agentrl.errors import EnvError

from .._action import not_text
from .._settings import flag, reset_options, whole
from .catalog import Catalog, Product, get_catalog
from .expert import ShopNotes, next_action
from .goal import Goal, make_goal, satisfies, score_purchase

__all__ = ["WebShopEnv", "WebShopSnapshot"]

PAGE_SIZE = 10
_ACTION = re.compile(r"^\s*(search|click)\s*\[(.*)\]\s*$", re.DOTALL | re.IGNORECASE)
_MAX_QUERY = 500
BACK, NEXT, PREV, BUY = "back to search", "next >", "< prev", "buy now"


@dataclass(slots=True, frozen=True)
class _State:
    """Where the shopper is. Immutable, so a snapshot is a reference."""

    page: str = "search"
    query: str = ""
    results: tuple[int, ...] = ()
    page_no: int = 0
    item: int = -1
    selected: tuple[tuple[str, str], ...] = ()
    steps: int = 0
    done: bool = False
    truncated: bool = False  # done for want of steps, not by a purchase
    obs: str = ""


@dataclass(slots=True, frozen=True)
class WebShopSnapshot:
    """A restorable point of an episode; the catalog is shared, never copied."""

    catalog_key: tuple[int, int]
    goal: Goal
    state: _State
    notes: ShopNotes = field(default_factory=ShopNotes)  # what the agent saw (the expert reads it)


class WebShopEnv(TextEnv):
    """Search a generated store, pick options, and buy what the instruction asks."""

    def __init__(
        self,
        num_products: int = 10_000,
        catalog_seed: int = 0,
        max_steps: int = 15,
        page_size: int = PAGE_SIZE,
        repeat_instruction: bool = True,
        render_mode: str | None = None,
    ):
        super().__init__(render_mode=render_mode)
        self.page_size = whole("page_size", page_size, low=1)
        self.repeat_instruction = flag("repeat_instruction", repeat_instruction)
        self.num_products = whole("num_products", num_products, low=1)
        self.catalog_seed = whole("catalog_seed", catalog_seed)
        self.max_steps = whole("max_steps", max_steps, low=1)
        self.catalog: Catalog = get_catalog(self.catalog_seed, self.num_products)
        self.goal: Goal | None = None
        self._state = _State()
        self._notes = ShopNotes()

    # -- gymnasium API ---------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """A new goal from ``seed``; ``options={"goal": Goal}`` plays that goal instead."""
        super().reset(seed=seed)
        rng = random.Random(int(self.np_random.integers(2**63)))
        goal = reset_options(options, ("goal",)).get("goal")
        if goal is not None and not isinstance(goal, Goal):
            raise EnvError(f"options['goal'] must be a Goal, not {type(goal).__name__}")
        self.goal = goal if goal is not None else make_goal(self.catalog, rng)
        self._state = _State()
        obs = self._render(self._state)
        self._state = replace(self._state, obs=obs)
        self._last_obs = obs
        self._notes = ShopNotes()
        self._notes.read(None, obs)
        g = self.goal
        options = ", ".join(f"{k}: {v}" for k, v in g.options)
        # For a distillation teacher only (train.distill.privileged); never shown to the agent.
        privileged = (f"The product to buy is {g.asin}, '{g.title}'" + (f", with {options}" if options else "")
                      + f"; search for: {g.query}.")
        return obs, {**self._info(), "privileged": privileged}

    def step(self, action: str):
        if self.goal is None:
            raise EnvError("call reset() before step()")
        state = self._state
        if state.done:  # pays nothing and repeats how the episode ended
            return state.obs, 0.0, not state.truncated, state.truncated, self._info()
        reward, terminated = 0.0, False
        why = not_text(action)
        new_state, message = (None, why) if why else self._transition(state, action)
        if new_state is None:
            obs = f"Invalid action! {message}\n\n{state.obs}"
            new_state = state
        elif new_state.done:
            obs, reward = self._purchase(new_state)
            terminated = True
        else:
            obs = self._render(new_state)
        steps = state.steps + 1
        truncated = not terminated and steps >= self.max_steps
        if truncated:
            obs += "\n\nOut of steps: the episode ends without a purchase."
        keep_obs = new_state.obs if new_state is state else obs
        self._state = replace(new_state, steps=steps, obs=keep_obs, done=terminated or truncated,
                              truncated=truncated)
        self._last_obs = obs
        self._notes.read("" if why else action, obs)
        info = self._info()
        if terminated:
            info["success"] = reward >= 1.0
            info["score"] = reward
        return obs, reward, terminated, truncated, info

    # -- branching -------------------------------------------------------------
    def snapshot(self) -> WebShopSnapshot:
        if self.goal is None:
            raise EnvError("call reset() before snapshot()")
        return WebShopSnapshot((self.catalog_seed, self.num_products), self.goal, self._state,
                               copy.deepcopy(self._notes))

    def restore(self, snapshot: WebShopSnapshot) -> None:
        if snapshot.catalog_key != (self.catalog_seed, self.num_products):
            self.catalog_seed, self.num_products = snapshot.catalog_key
            self.catalog = get_catalog(*snapshot.catalog_key)
        self.goal = snapshot.goal
        self._state = snapshot.state
        self._last_obs = snapshot.state.obs
        self._notes = copy.deepcopy(snapshot.notes)

    # -- pages -----------------------------------------------------------------
    def clickables(self) -> list[str]:
        """The elements ``click[...]`` accepts on the current page."""
        return _clickables(self.catalog, self._state, self.page_size)

    def _info(self) -> dict[str, Any]:
        state = self._state
        if state.done:
            actions: list[str] = []
        elif state.page == "search":
            actions = [f"search[{self.goal.query}]"] if self.goal else []
        else:
            actions = [f"click[{c}]" for c in _clickables(self.catalog, state, self.page_size)]
        return {
            "instruction": self.goal.instruction if self.goal else "",
            "admissible_actions": actions,
            "tools": [],
            "page": state.page,
            "state_key": self._state_key(),
        }

    def _state_key(self) -> str:
        """A short hash of the true shop state (goal, page, query, results page,
        item, selected options), blind to the step count and to an invalid
        action's message: equal keys mean the same state. GiGPO groups steps by it."""
        s = self._state
        goal = self.goal.instruction if self.goal else ""
        query = "" if s.page == "search" else s.query  # the search page forgets its last query
        state = (goal, s.page, query, s.page_no, s.item, s.selected, s.done)
        return hashlib.blake2b(repr(state).encode(), digest_size=8).hexdigest()

    def _render(self, state: _State) -> str:
        assert self.goal is not None
        head = f"Instruction: {self.goal.instruction}\n"
        if not self.repeat_instruction and state.page != "search":
            head = ""  # compact: the search page alone states the instruction
        if state.page == "search":
            return head + "[search] Type search[your query] to look for products."
        if state.page == "results":
            return head + _render_results(self.catalog, state, self.page_size)
        product = self.catalog.products[state.item]
        if state.page == "item":
            return head + _render_item(product, dict(state.selected))
        if state.page == "description":
            return head + f"[{BACK}] [{PREV}]\n{product.description}"
        bullets = "\n".join(f"- {f}" for f in product.features)
        return head + f"[{BACK}] [{PREV}]\n{bullets}"

    def _transition(self, state: _State, action: str) -> tuple[_State | None, str]:
        """The next state and a message, or ``(None, why)`` when the action is invalid."""
        match = _ACTION.match(action) if len(action) <= 100_000 else None
        if match is None:
            return None, "Use search[query] on the search page, or click[element]."
        kind, arg = match.group(1).lower(), match.group(2).strip()
        if kind == "search":
            if state.page != "search":
                return None, f"There is no search bar on this page; click[{BACK}] first."
            query = arg[:_MAX_QUERY]
            return replace(
                state, page="results", query=query, results=self.catalog.search(query), page_no=0
            ), ""
        element = arg.lower()
        if element not in _clickables(self.catalog, state, self.page_size):
            return None, f"{arg[:80]!r} is not a clickable element on this page."
        return self._click(state, element), ""

    def _click(self, state: _State, element: str) -> _State:
        if element == BACK:
            return replace(state, page="search", results=(), page_no=0, item=-1, selected=())
        if element == NEXT:
            return replace(state, page_no=state.page_no + 1)
        if element == PREV:
            if state.page == "results":
                return replace(state, page_no=state.page_no - 1)
            if state.page == "item":
                return replace(state, page="results", item=-1, selected=())
            return replace(state, page="item")
        if element in ("description", "features"):
            return replace(state, page=element)
        if element == BUY:
            return replace(state, done=True)
        if state.page == "results":
            index = self.catalog.by_asin[element.upper()]
            return replace(state, page="item", item=index, selected=())
        product = self.catalog.products[state.item]
        group = next(g for g, vs in product.options.items() if element in vs)
        selected = dict(state.selected)
        selected[group] = element
        return replace(state, selected=tuple(sorted(selected.items())))

    def _purchase(self, state: _State) -> tuple[str, float]:
        """The receipt and the score of buying the item on ``state``'s page."""
        assert self.goal is not None
        product = self.catalog.products[state.item]
        selected = dict(state.selected)
        result = score_purchase(self.goal, product, selected)
        chosen = ", ".join(f"{g}: {v}" for g, v in sorted(selected.items())) or "none"
        return (
            f"Thank you for shopping with us! You bought {product.title} "
            f"(${product.price:.2f}; options: {chosen}). Your score: {result.reward:.2f}"
        ), result.reward

    # -- experts ---------------------------------------------------------------
    def expert_action(self) -> str:
        """The observation-consistent shopper's next action (see ``expert``)."""
        if self.goal is None:
            raise EnvError("call reset() before expert_action()")
        return next_action(self._notes)

    def oracle_action(self) -> str:
        """A privileged scripted shopper: search the goal, open a match, pick options, buy."""
        if self.goal is None:
            raise EnvError("call reset() before oracle_action()")
        goal, state, products = self.goal, self._state, self.catalog.products
        if state.page == "search":
            return f"search[{goal.title if state.query == goal.query else goal.query}]"
        if state.page == "results":
            hits = [i for i, r in enumerate(state.results) if satisfies(goal, products[r])]
            if not hits:
                return f"click[{BACK}]"
            target = hits[0] // self.page_size
            if target > state.page_no:
                return f"click[{NEXT}]"
            if target < state.page_no:
                return f"click[{PREV}]"
            return f"click[{products[state.results[hits[0]]].asin.lower()}]"
        if state.page == "item":
            product = products[state.item]
            if not satisfies(goal, product):
                return f"click[{PREV}]"
            selected = dict(state.selected)
            for group, value in goal.options:
                if selected.get(group) != value:
                    return f"click[{value}]"
            return f"click[{BUY}]"
        return f"click[{PREV}]"


def _clickables(catalog: Catalog, state: _State, page_size: int) -> list[str]:
    if state.done or state.page == "search":
        return []
    if state.page == "results":
        out = [BACK]
        if state.page_no > 0:
            out.append(PREV)
        if (state.page_no + 1) * page_size < len(state.results):
            out.append(NEXT)
        start = state.page_no * page_size
        out += [catalog.products[i].asin.lower() for i in state.results[start : start + page_size]]
        return out
    if state.page == "item":
        product = catalog.products[state.item]
        values = [v for vs in product.options.values() for v in vs]
        return [BACK, PREV, *values, "description", "features", BUY]
    return [BACK, PREV]


def _render_results(catalog: Catalog, state: _State, page_size: int) -> str:
    total = len(state.results)
    if total == 0:
        return f"[{BACK}]\nNo products match {state.query!r}."
    start = state.page_no * page_size
    lines = [f"[{BACK}]", f"Page {state.page_no + 1} (total results: {total})"]
    nav = []
    if state.page_no > 0:
        nav.append(f"[{PREV}]")
    if start + page_size < total:
        nav.append(f"[{NEXT}]")
    if nav:
        lines.append(" ".join(nav))
    for i in state.results[start : start + page_size]:
        p = catalog.products[i]
        lines.append(f"[{p.asin.lower()}] {p.title} | ${p.price:.2f}")
    return "\n".join(lines)


def _render_item(product: Product, selected: dict[str, str]) -> str:
    lines = [
        f"[{BACK}] [{PREV}]",
        product.title,
        f"Price: ${product.price:.2f}  Rating: {product.rating}",
    ]
    for group, values in product.options.items():
        mark = f" (selected: {selected[group]})" if group in selected else ""
        lines.append(f"{group}{mark}: " + " ".join(f"[{v}]" for v in values))
    lines.append("[description] [features] [buy now]")
    return "\n".join(lines)
