"""WebShop-style goals: an instruction drawn from a target product, and the score
of a purchase against it.

Score (after Yao et al. 2022, "WebShop", Sec. 3.1 and the reward in its code)::

    r = r_type * (|U_att ∩ Y_att| + |U_opt ∩ Y_opt| + 1[y_price <= u_price])
               / (|U_att| + |U_opt| + 1)

``U`` is the goal (attributes, options, price limit) and ``Y`` the bought item
with the options selected on its page. An attribute counts as matched when the
item lists it or its title or features mention it. An option counts when the
value was selected.

``r_type`` scores the product type:

- 1.0 when the product type is the goal's;
- otherwise 0.5 when the category is the same or the title shares more than
  20% of the target title's words;
- 0.1 when the title shares some words (under 10%) and the category differs;
- 0.0 when the title shares no word and the category differs.

Deviation from WebShop: there, ``r_type`` is also 1.0 on a category match or a
matching source query. Here only the product type gives 1.0, so that a score
of 1 (success) always means the right kind of product. Attribute and option
matches are exact (lower-cased) instead of fuzzy, because both sides come from
the same word lists.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .catalog import Catalog, Product, tokenize
from .vocab import OPTION_PHRASES

__all__ = ["Goal", "PurchaseScore", "make_goal", "satisfies", "score_purchase"]

_OPENERS = (
    "i need",
    "i am looking for",
    "i want to buy",
    "find me",
    "i'm searching for",
    "get me",
)


@dataclass(slots=True, frozen=True)
class Goal:
    """What the shopper asks for; ``asin`` is the product the goal was drawn from."""

    asin: str
    category: str
    product_type: str
    title: str
    attributes: tuple[str, ...]
    options: tuple[tuple[str, str], ...]
    price_upper: float
    instruction: str

    @property
    def query(self) -> str:
        """The instruction without its price clause: a natural first search."""
        words = [*self.attributes, self.product_type, *(v for _, v in self.options)]
        return " ".join(words)


@dataclass(slots=True, frozen=True)
class PurchaseScore:
    """The parts of a purchase's score; ``reward`` is the number in [0, 1]."""

    reward: float
    r_type: float
    attributes_matched: int
    options_matched: int
    price_ok: bool


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def make_goal(catalog: Catalog, rng: random.Random) -> Goal:
    """Draw a target product and phrase a goal from its attributes and options."""
    product = catalog.products[rng.randrange(len(catalog))]
    attributes = tuple(
        rng.sample(product.attributes, rng.randint(1, min(2, len(product.attributes))))
    )
    groups = list(product.options)
    chosen = rng.sample(groups, rng.randint(1, len(groups)))
    options = tuple((g, rng.choice(product.options[g])) for g in groups if g in chosen)
    # A round limit above the price, in the style "lower than 30.00 dollars".
    step = 10.0 if product.price < 100 else 50.0
    price_upper = (int(product.price * rng.uniform(1.05, 1.6) // step) + 1) * step
    attr_text = " and ".join(attributes)
    opt_text = ", ".join(OPTION_PHRASES[g].format(v) for g, v in options)
    opener = rng.choice(_OPENERS)
    instruction = (
        f"{opener} {_article(attr_text)} {attr_text} {product.product_type} {opt_text}, "
        f"and price lower than {price_upper:.2f} dollars"
    )
    return Goal(
        asin=product.asin,
        category=product.category,
        product_type=product.product_type,
        title=product.title,
        attributes=attributes,
        options=options,
        price_upper=price_upper,
        instruction=instruction,
    )


def _type_score(goal: Goal, product: Product) -> float:
    if product.product_type == goal.product_type:
        return 1.0
    goal_words = set(tokenize(goal.title))
    shared = len(goal_words & set(tokenize(product.title))) / max(1, len(goal_words))
    same_category = product.category == goal.category
    if same_category or shared > 0.2:
        return 0.5
    if shared == 0.0:
        return 0.0
    return 0.1 if shared < 0.1 else 0.5


def _has_attribute(product: Product, attribute: str) -> bool:
    if attribute in product.attributes:
        return True
    text = (product.title + " " + " ".join(product.features)).lower()
    return attribute in text


def score_purchase(goal: Goal, product: Product, selected: dict[str, str]) -> PurchaseScore:
    """Score buying ``product`` with the ``selected`` options (group -> value)."""
    r_type = _type_score(goal, product)
    n_att = sum(_has_attribute(product, a) for a in goal.attributes)
    chosen = {v.lower() for v in selected.values()}
    n_opt = sum(v.lower() in chosen for _, v in goal.options)
    price_ok = product.price <= goal.price_upper
    total = (n_att + n_opt + int(price_ok)) / (len(goal.attributes) + len(goal.options) + 1)
    return PurchaseScore(
        reward=r_type * total,
        r_type=r_type,
        attributes_matched=n_att,
        options_matched=n_opt,
        price_ok=price_ok,
    )


def satisfies(goal: Goal, product: Product) -> bool:
    """Whether buying ``product`` with the goal's options would score 1."""
    return (
        product.product_type == goal.product_type
        and product.price <= goal.price_upper
        and all(_has_attribute(product, a) for a in goal.attributes)
        and all(v in product.options.get(g, ()) for g, v in goal.options)
    )
