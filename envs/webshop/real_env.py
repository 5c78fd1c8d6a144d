"""``agentrl/WebShopReal-v0``: WebShop over its own product and instruction files.

The shop is WebShop's data (``real_data``: the full product set or the
1,000-product subset, the human instructions, the papers' splits), searched
with a cached ``bm25s`` index, and a purchase is scored with the paper's
reward (``real_reward``). The folder comes from ``data_dir=`` or
``$WEBSHOP_DATA``; without the files the env raises ``EnvError`` naming them.
Nothing is fetched.

Pages, in the shape of WebShop's ``text`` observation mode (page parts joined by
" [SEP] "; the instruction heads every page):

- search: ``WebShop [SEP] Instruction: [SEP] <instruction> [SEP] Search``;
- results: ``Back to Search``, ``Page N (Total results: M)``, ``< Prev`` /
  ``Next >``, then asin, name and price of each of 10 products (of the top 50);
- item: ``Back to Search``, ``< Prev``, each option name and its values, the
  name, ``Price: ...``, ``Rating: N.A.``, ``Description``, ``Features``,
  ``Reviews``, ``Buy Now``;
- description, features, reviews: ``Back to Search``, ``< Prev`` and the text.

The page text is written here, not rendered from WebShop's HTML templates, so
it is WebShop's text mode in content and order but may differ in small ways.

Actions are WebShop's: ``search[query]`` and ``click[element]``, lower-cased
as WebShop does, where the element is one shown on the page (asins, option
values and buttons, lower case). ``info["admissible_actions"]`` lists them
(``search[...]`` on the search page, with the instruction as a query). As in
WebShop, anything else leaves the page as it was (the same observation) and
sets ``info["valid"]`` False. An action that is not text does too, and its
observation starts with a sentence naming its type (``agentrl.envs._action``).

``click[buy now]`` ends the episode with the reward of the purchase (its parts
in ``info["reward_parts"]``, ``info["score"]``); ``info["success"]`` is True
when the reward is 1. After ``max_steps`` steps (15, as ReAct and verl-agent)
the episode is truncated. ``reset(seed=i)`` plays goal ``i % num_tasks`` of
the split; ``info["task_type"]`` is the goal product's top category.

``snapshot()``/``restore()`` are references to immutable state, and
``info["state_key"]`` hashes the goal and the page state (GiGPO's anchor).
``oracle_action()`` is a privileged shopper that knows the goal product: it
searches the product's name, opens it, selects the options that match the
goal's, and buys.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, replace
from typing import Any

from agentrl.env import TextEnv
from agentrl.errors import EnvError

from .._action import not_text
from .._settings import path_or_none, reset_options, whole
from .real_data import RealGoal, RealProduct, Shop, get_shop
from .real_reward import (
    FUZZ_THRESHOLD,
    NounTagger,
    normalize_color,
    noun_tagger,
    token_set_ratio,
    webshop_reward,
)

__all__ = ["WebShopRealEnv"]

PAGE_SIZE = 10
SEP = " [SEP] "
BACK, NEXT, PREV, BUY = "back to search", "next >", "< prev", "buy now"
_SUBPAGES = ("description", "features", "reviews")
# An action's name ends at its first "[" after the first character. "(.+?)\[" found that "[" by
# trying every one in turn: a flood of brackets took a minute.
_ACTION = re.compile(r"(.[^\[]*)\[(.+)\]", re.DOTALL)


@dataclass(frozen=True, slots=True)
class _State:
    """Where the shopper is. Immutable, so a snapshot is a reference."""

    goal: int = 0
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


class WebShopRealEnv(TextEnv):
    """WebShop's shop and goals; see the module docstring."""

    def __init__(
        self,
        split: str = "train",
        data_dir: str | os.PathLike[str] | None = None,
        subset: str = "auto",
        num_products: int | None = None,
        max_steps: int = 15,
        type_tagger: str = "auto",
        index_cache: str | os.PathLike[str] | None = None,
        render_mode: str | None = None,
    ):
        super().__init__(render_mode=render_mode)
        max_steps = whole("max_steps", max_steps, low=1)
        data_dir, index_cache = path_or_none("data_dir", data_dir), path_or_none("index_cache", index_cache)
        if not isinstance(type_tagger, str):
            raise EnvError(f"type_tagger must be 'auto', 'heuristic' or a spaCy model name, not {type_tagger!r:.80}")
        if num_products is not None:  # a slice: -1 would drop the last product
            num_products = whole("num_products (or None: every product)", num_products, low=1)
        folder = data_dir if data_dir is not None else os.environ.get("WEBSHOP_DATA")
        if not folder:
            raise EnvError("WebShopReal-v0 needs WebShop's data folder (items_shuffle_1000.json or "
                           "items_shuffle.json, items_ins_v2*.json, items_human_ins.json): pass data_dir=... "
                           "or set WEBSHOP_DATA. agentrl never downloads it.")
        self.shop: Shop = get_shop(folder, subset, num_products, index_cache)
        self.split = split
        self.indices = self.shop.split(split)
        if not self.indices:
            raise EnvError(f"WebShop split {split!r} is empty: the data in {self.shop.folder} makes "
                           f"{len(self.shop.goals)} goals (test 0-499, valid 500-1499, train 1500+)")
        self.max_steps = max_steps
        self.tagger: NounTagger = noun_tagger(type_tagger)
        self._state: _State | None = None

    # -- what the split holds ----------------------------------------------------
    @property
    def num_tasks(self) -> int:
        """Goals in the split (seeds ``0 .. num_tasks - 1`` play each once)."""
        return len(self.indices)

    def task_family(self, seed: int) -> str:
        """The top category of the product goal ``reset(seed=seed)`` asks for."""
        return self.shop.goals[self.indices[int(seed) % len(self.indices)]].category

    @property
    def goal(self) -> RealGoal:
        return self.shop.goals[self._require().goal]

    def _require(self) -> _State:
        if self._state is None:
            raise EnvError("call reset() before using the WebShop env")
        return self._state

    # -- gymnasium API -----------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Goal ``seed % num_tasks`` of the split; ``options={"goal": i}`` plays goal i of the
        whole shuffled list (any split)."""
        super().reset(seed=seed)
        goal = reset_options(options, ("goal",)).get("goal")
        if goal is None:
            i = int(seed) if seed is not None else int(self.np_random.integers(0, len(self.indices)))
            goal = self.indices[i % len(self.indices)]
        else:  # True is an int: it played goal 1
            goal = whole("options['goal']", goal, low=0, high=len(self.shop.goals) - 1)
        state = _State(goal=goal)
        self._state = replace(state, obs=self._render(state))
        self._last_obs = self._state.obs
        g = self.goal
        info = self._info()
        # for a distillation teacher only (train.distill.privileged); never shown to the agent
        info["privileged"] = (f"The product to buy is {g.asin}, '{g.name}'"
                              + (f", with {', '.join(g.goal_options)}" if g.goal_options else "") + ".")
        return self._last_obs, info

    def step(self, action: str):
        state = self._require()
        if state.done:  # pays nothing and repeats how the episode ended
            return state.obs, 0.0, not state.truncated, state.truncated, self._info()
        why = not_text(action)
        new, valid = (state, False) if why else self._transition(state, action)
        reward, terminated, parts = 0.0, False, None
        if new.done:
            parts = webshop_reward(self.shop.products[new.item], self.goal, self.shop.prices[new.item],
                                   [v for _, v in new.selected], self.tagger)
            reward, terminated = float(parts.reward), True
            obs = _receipt(self.shop.products[new.item], new, reward)
        else:
            obs = self._render(new) if new is not state else state.obs
        steps = state.steps + 1
        truncated = not terminated and steps >= self.max_steps
        self._state = replace(new, steps=steps, obs=obs, done=terminated or truncated, truncated=truncated)
        obs = f"{why}\n\n{obs}" if why else obs  # the page stays as it was
        self._last_obs = obs
        info = self._info()
        info["valid"] = valid
        if parts is not None:
            info.update(success=reward >= 1.0, score=reward, reward_parts={
                "r_type": parts.r_type, "query_match": parts.query_match,
                "category_match": parts.category_match, "title_score": parts.title_score,
                "attributes": f"{parts.attributes_matched}/{parts.attributes}",
                "options": f"{parts.options_matched}/{parts.options}", "price_ok": parts.price_ok,
                "type_tagger": parts.tagger})
        return obs, reward, terminated, truncated, info

    def _info(self) -> dict[str, Any]:
        s = self._require()
        if s.done:
            actions: list[str] = []
        elif s.page == "search":
            actions = [f"search[{self.goal.instruction}]"]
        else:
            actions = [f"click[{c}]" for c in self.clickables()]
        return {
            "instruction": self.goal.instruction,
            "admissible_actions": actions,
            "tools": [],
            "page": s.page,
            "task_type": self.goal.category,
            "goal_index": s.goal,
            "state_key": self._state_key(),
        }

    def _state_key(self) -> str:
        """A short hash of the goal and the page state (not the step count): GiGPO's anchor."""
        s = self._require()
        query = "" if s.page == "search" else s.query
        state = (s.goal, s.page, query, s.page_no, s.item, s.selected, s.done)
        return hashlib.blake2b(repr(state).encode(), digest_size=8).hexdigest()

    # -- branching ---------------------------------------------------------------
    def snapshot(self) -> _State:
        return self._require()

    def restore(self, snapshot: _State) -> None:
        self._state = snapshot
        self._last_obs = snapshot.obs

    # -- pages -------------------------------------------------------------------
    def clickables(self) -> list[str]:
        """The elements ``click[...]`` accepts now, lower case."""
        s = self._require()
        if s.done or s.page == "search":
            return []
        if s.page == "results":
            out = [BACK] + ([PREV] if s.page_no > 0 else [])
            out += [NEXT] if (s.page_no + 1) * PAGE_SIZE < len(s.results) else []
            return out + [self.shop.products[i].asin.lower() for i in _page(s)]
        if s.page == "item":
            values = [v for vs in self.shop.products[s.item].options.values() for v in vs]
            return [BACK, PREV, *values, *_SUBPAGES, BUY]
        return [BACK, PREV]

    def _transition(self, s: _State, action: str) -> tuple[_State, bool]:
        m = _ACTION.fullmatch(action.strip()) if len(action) <= 100_000 else None
        if m is None:
            return s, False
        kind, arg = m.group(1).strip().lower(), m.group(2).strip().lower()
        if kind == "search":
            results = self.shop.search(arg)
            return replace(s, page="results", query=arg, results=results, page_no=0, item=-1, selected=()), True
        if kind != "click" or arg not in self.clickables():
            return s, False
        if arg == BACK:
            return replace(s, page="search", results=(), page_no=0, item=-1, selected=()), True
        if arg == NEXT:
            return replace(s, page_no=s.page_no + 1), True
        if arg == PREV:
            if s.page == "results":
                return replace(s, page_no=s.page_no - 1), True
            if s.page == "item":
                return replace(s, page="results", item=-1, selected=()), True
            return replace(s, page="item"), True
        if arg in _SUBPAGES and s.page == "item":
            return replace(s, page=arg), True
        if arg == BUY:
            return replace(s, done=True), True
        if s.page == "results":
            return replace(s, page="item", item=self.shop.by_asin[arg.upper()], selected=()), True
        product = self.shop.products[s.item]
        name = next(n for n, vs in product.options.items() if arg in vs)
        selected = dict(s.selected) | {name: arg}
        return replace(s, selected=tuple(sorted(selected.items()))), True

    def _render(self, s: _State) -> str:
        head = ["Instruction:", self.shop.goals[s.goal].instruction]
        if s.page == "search":
            return SEP.join(["WebShop", *head, "Search"])
        parts = [*head, "Back to Search"]
        if s.page == "results":
            parts.append(f"Page {s.page_no + 1} (Total results: {len(s.results)})")
            parts += ["< Prev"] if s.page_no > 0 else []
            parts += ["Next >"] if (s.page_no + 1) * PAGE_SIZE < len(s.results) else []
            for i in _page(s):
                p = self.shop.products[i]
                parts += [p.asin, p.name, p.price_tag]
            return SEP.join(parts)
        product = self.shop.products[s.item]
        parts.append("< Prev")
        if s.page == "item":
            for name, values in product.options.items():
                parts += [name, *values]
            parts += [product.name, f"Price: {product.price_tag}", f"Rating: {product.rating}",
                      "Description", "Features", "Reviews", "Buy Now"]
            return SEP.join(parts)  # text mode does not mark the selected options
        if s.page == "description":
            parts.append(product.description)
        elif s.page == "features":
            parts += list(product.bullet_points)
        return SEP.join(p for p in parts if p)

    # -- oracle ------------------------------------------------------------------
    def oracle_action(self) -> str:
        """A privileged shopper: it knows the goal product (see the module docstring)."""
        s, goal = self._require(), self.goal
        if s.page == "search":
            return f"search[{goal.name.lower()}]"
        target = goal.asin.lower()
        if s.page == "results":
            asins = [self.shop.products[i].asin.lower() for i in s.results]
            if target not in asins:
                return f"click[{BACK}]"
            page = asins.index(target) // PAGE_SIZE
            return f"click[{NEXT if page > s.page_no else PREV if page < s.page_no else target}]"
        if s.page != "item":
            return f"click[{PREV}]"
        product = self.shop.products[s.item]
        if product.asin.lower() != target:
            return f"click[{PREV}]"
        chosen = {v for _, v in s.selected}
        for wanted in goal.goal_options:
            value = _best_value(product, wanted)
            if value is not None and value not in chosen:
                return f"click[{value}]"
        return f"click[{BUY}]"


def _page(s: _State) -> tuple[int, ...]:
    start = s.page_no * PAGE_SIZE
    return s.results[start:start + PAGE_SIZE]


def _best_value(product: RealProduct, wanted: str) -> str | None:
    """The option value of ``product`` that matches a goal option best, as the reward matches."""
    goal = normalize_color(wanted)
    best, score = None, FUZZ_THRESHOLD
    for values in product.options.values():
        for v in values:
            ratio = token_set_ratio(normalize_color(v), goal)
            if ratio > score:
                best, score = v, ratio
    return best


def _receipt(product: RealProduct, s: _State, reward: float) -> str:
    chosen = ", ".join(f"{n}: {v}" for n, v in s.selected) or "none"
    return SEP.join(["Thank you for shopping with us!", f"You bought {product.name}",
                     f"Options: {chosen}", f"Your score (min 0.0, max 1.0): {reward:.2f}"])
