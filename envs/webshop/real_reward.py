"""WebShop's purchase reward, as the paper defines it (Yao et al. 2022, "WebShop",
Sec. 3.1 and its reward code), written again here.

For a goal ``U`` (attributes, options, a price limit, and the product it was
written for) and a bought product ``Y`` with the options selected on its page::

    r = r_type * (n_att + n_opt + 1[price <= u_price]) / (|U_att| + |U_opt| + 1)

- ``n_att``: goal attributes that fuzzy-match (token-set ratio > 85) one of the
  product's attributes, or else occur (lower-cased substring) in its title, its
  bullet points or its description;
- ``n_opt``: goal options that fuzzy-match one of the selected option values,
  both sides first passed through ``normalize_color`` (the first colour word
  of WebShop's list found in the text, else the text);
- the price term is 1 when the price paid is within the goal's limit;
- ``r_type`` (``type_reward``) compares the product with the goal's product:
  ``query_match`` (the same search query), ``category_match`` (at least two
  levels of the "›"-separated category path shared), and ``title_score``, the
  share of the goal product name's nouns found among the bought product name's
  nouns (0.2 when the goal name has none). It is 1.0 when any of the three
  holds (title score above 0.2), else 0.5; then 0.1 when the title score is
  below 0.1, and 0.0 when it is 0. A purchase succeeds when ``r == 1``.

Fuzzy matching is fuzzywuzzy's / thefuzz's ``token_set_ratio`` (with their
``full_process`` as in thefuzz 0.19, which WebShop pins: characters 128-255
dropped, each character that is not a letter, digit or underscore (``\\W``)
a space, lower case; so ``heavy_duty`` is one word, and scores 50 against
``heavy duty``), over the Indel ratio ``200 * LCS / (len1 + len2)`` of
python-Levenshtein and rapidfuzz, rounded to an integer.

Nouns. WebShop tags names with spaCy's ``en_core_web_lg`` and keeps NOUN and
PROPN tokens. ``noun_tagger()`` loads that model when it is installed (then
``en_core_web_md``, ``en_core_web_sm``: each tags a little differently), and
otherwise falls back to a heuristic (every word of letters that is not an
English function word) that over-counts adjectives: ``RewardParts.tagger``
and the envs' ``info`` say which was used, so a number reported beside the
paper's can say so too. ``python -m spacy download en_core_web_lg`` installs
the paper's model.

Where our procedural WebShop-v0 departs (``goal``'s docstring: exact
attribute and option matching, ``r_type`` 1.0 only for the same product type),
this module does not.
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .real_data import RealGoal, RealProduct

__all__ = [
    "COLOR_SET",
    "NounTagger",
    "RewardParts",
    "TypeReward",
    "attribute_matches",
    "fuzz_ratio",
    "full_process",
    "noun_tagger",
    "normalize_color",
    "option_matches",
    "token_set_ratio",
    "type_reward",
    "webshop_reward",
]

FUZZ_THRESHOLD = 85  # a match is a token-set ratio above this

# WebShop's colour words, in its order: normalize_color returns the first one found.
COLOR_SET: tuple[str, ...] = (
    "alabaster", "apricot", "aqua", "ash", "asphalt", "azure", "banana", "beige", "black", "blue",
    "blush", "bordeaux", "bronze", "brown", "burgundy", "camel", "camo", "caramel", "champagne",
    "charcoal", "cheetah", "chestnut", "chocolate", "christmas", "coffee", "cognac", "copper",
    "coral", "cranberry", "cream", "crystal", "dark", "denim", "eggplant", "elephant", "espresso",
    "fuchsia", "gold", "granite", "grape", "graphite", "grass", "gray", "green", "grey", "heather",
    "indigo", "ivory", "ivy", "khaki", "lavender", "lemon", "leopard", "light", "lilac", "lime",
    "magenta", "maroon", "mauve", "merlot", "midnight", "mint", "mocha", "multicolor", "mushroom",
    "mustard", "natural", "navy", "nude", "olive", "orange", "peach", "pewter", "pink", "plum",
    "purple", "rainbow", "red", "rose", "royal", "rust", "sand", "sapphire", "seashell", "silver",
    "skull", "slate", "steel", "stone", "stonewash", "sunflower", "tan", "taupe", "teal", "tiger",
    "turquoise", "violet", "walnut", "wheat", "white", "wine", "yellow",
)  # fmt: skip


def normalize_color(text: str) -> str:
    """The first colour word of ``COLOR_SET`` that ``text`` contains, else ``text``."""
    for color in COLOR_SET:
        if color in text:
            return color
    return text


# -- fuzzy matching ------------------------------------------------------------------

_LATIN1 = {i: None for i in range(128, 256)}
_NON_WORD = re.compile(r"\W")  # thefuzz's "(?ui)\W": an underscore is a word character


def full_process(text: str) -> str:
    """thefuzz's preprocessing: drop characters 128-255, each non-word character to a space
    (``_`` stays), lower case, strip."""
    return _NON_WORD.sub(" ", str(text).translate(_LATIN1)).lower().strip()


def fuzz_ratio(a: str, b: str) -> int:
    """The Indel similarity of two strings, 0-100: ``round(200 * LCS / (len(a) + len(b)))``."""
    if not a or not b:
        return 0
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return round(200 * prev[-1] / (len(a) + len(b)))


def token_set_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's ``token_set_ratio``: compare the shared words with each side's whole."""
    ta, tb = set(full_process(a).split()), set(full_process(b).split())
    if not ta or not tb:
        return 0
    sect = " ".join(sorted(ta & tb))
    a_all = (sect + " " + " ".join(sorted(ta - tb))).strip()
    b_all = (sect + " " + " ".join(sorted(tb - ta))).strip()
    return max(fuzz_ratio(sect, a_all), fuzz_ratio(sect, b_all), fuzz_ratio(a_all, b_all))


# -- nouns -----------------------------------------------------------------------------

_WORD = re.compile(r"[A-Za-z][A-Za-z'\-]*")
_FUNCTION_WORDS = frozenset(
    "a an the and or nor but for of to in on at by with from into onto over under about as per "
    "via vs than then so is are be was were been it its this that these those each every any all "
    "both either neither no not only very more most less least such same other another own our "
    "your their his her my we you they he she i me us them up down out off new".split()
)


@dataclass(frozen=True, slots=True)
class NounTagger:
    """Finds the nouns of a product name; ``name`` says how (a spaCy model, or ``heuristic``)."""

    name: str
    nouns: Callable[[str], list[str]]


def _heuristic_nouns(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text) if w.lower() not in _FUNCTION_WORDS]


_TAGGER: NounTagger | None = None
_TAGGER_LOCK = threading.Lock()
SPACY_MODELS = ("en_core_web_lg", "en_core_web_md", "en_core_web_sm")


def noun_tagger(prefer: str = "auto") -> NounTagger:
    """The noun finder of ``type_reward``: ``"auto"`` (a spaCy model of ``SPACY_MODELS``
    if one is installed, else the heuristic, with a warning once), a model name, or
    ``"heuristic"``. A model asked for by name and not installed is an error."""
    global _TAGGER
    if prefer == "heuristic":
        return NounTagger("heuristic", _heuristic_nouns)
    with _TAGGER_LOCK:
        if prefer == "auto" and _TAGGER is not None:
            return _TAGGER
        tagger = _spacy_tagger(SPACY_MODELS if prefer == "auto" else (prefer,))
        if tagger is None:
            if prefer != "auto":
                from agentrl.errors import EnvError

                raise EnvError(f"spaCy model {prefer!r} is not installed: pip install spacy, then "
                               f"python -m spacy download {prefer}")
            warnings.warn("WebShop's type reward tags nouns with spaCy's en_core_web_lg, which is not "
                          "installed here; using a heuristic noun finder, so r_type may differ from "
                          "WebShop's. Install it: pip install spacy && python -m spacy download "
                          "en_core_web_lg", RuntimeWarning, stacklevel=2)
            tagger = NounTagger("heuristic", _heuristic_nouns)
        if prefer == "auto":
            _TAGGER = tagger
        return tagger


def _spacy_tagger(models: Sequence[str]) -> NounTagger | None:
    try:
        import spacy
    except ImportError:
        return None
    for model in models:
        try:
            nlp = spacy.load(model)
        except (OSError, ImportError):
            continue

        def nouns(text: str, nlp=nlp) -> list[str]:
            return [t.text.lower() for t in nlp(text) if t.pos_ in ("PNOUN", "NOUN", "PROPN")]

        return NounTagger(model, nouns)
    return None


# -- the reward ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TypeReward:
    """``r_type`` and what it was computed from."""

    r_type: float
    query_match: bool
    category_match: bool
    title_score: float


@dataclass(frozen=True, slots=True)
class RewardParts:
    """A purchase's reward and its parts; ``reward`` is the number in [0, 1]."""

    reward: float
    r_type: float
    query_match: bool
    category_match: bool
    title_score: float
    attributes_matched: int
    attributes: int
    options_matched: int
    options: int
    price_ok: bool
    tagger: str


def type_reward(bought_query: str, bought_category: str, bought_name: str,
                goal_query: str, goal_category: str, goal_name: str, tagger: NounTagger) -> TypeReward:
    """WebShop's ``r_type`` (see the module docstring)."""
    query_match = bought_query == goal_query
    bought_path = {x.strip() for x in bought_category.split("›")}
    goal_path = {x.strip() for x in goal_category.split("›")}
    category_match = len(bought_path & goal_path) >= 2
    bought_nouns, goal_nouns = tagger.nouns(bought_name), tagger.nouns(goal_name)
    title_score = len(set(bought_nouns) & set(goal_nouns)) / len(goal_nouns) if goal_nouns else 0.2
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return TypeReward(r_type, query_match, category_match, title_score)


def attribute_matches(goal_attributes: Iterable[str], product_attributes: Sequence[str],
                      title: str, bullet_points: Sequence[str], description: str) -> int:
    """How many goal attributes the product has (fuzzy in its attributes, else a substring of its text)."""
    texts = (title.lower(), " ".join(bullet_points).lower(), description.lower())
    n = 0
    for goal_attr in goal_attributes:
        if any(token_set_ratio(p, goal_attr) > FUZZ_THRESHOLD for p in product_attributes) or any(
            goal_attr in t for t in texts
        ):
            n += 1
    return n


def option_matches(goal_options: Iterable[str], selected: Iterable[str]) -> int:
    """How many goal options one of the selected values matches, after ``normalize_color``."""
    picked = [normalize_color(o) for o in selected]
    return sum(
        any(token_set_ratio(p, normalize_color(g)) > FUZZ_THRESHOLD for p in picked) for g in goal_options
    )


def webshop_reward(product: RealProduct, goal: RealGoal, price: float, selected: Iterable[str],
                   tagger: NounTagger | None = None) -> RewardParts:
    """The reward of buying ``product`` at ``price`` with the ``selected`` option values."""
    tagger = tagger or noun_tagger()
    t = type_reward(product.query, product.product_category, product.name,
                    goal.query, goal.product_category, goal.name, tagger)
    n_att = attribute_matches(goal.attributes, product.attributes, product.title, product.bullet_points,
                              product.description)
    n_opt = option_matches(goal.goal_options, list(selected))
    price_ok = price <= goal.price_upper
    reward = t.r_type * (n_att + n_opt + int(price_ok)) / (len(goal.attributes) + len(goal.goal_options) + 1)
    return RewardParts(reward, t.r_type, t.query_match, t.category_match, t.title_score, n_att,
                       len(goal.attributes), n_opt, len(goal.goal_options), price_ok, tagger.name)
