"""WebShop's own data files: products, their attributes, the human instructions,
the goals made from them, the splits, and a cached BM25 index.

The folder holds WebShop's files (its ``setup.sh`` downloads them into ``data/``):

- products: ``items_shuffle.json`` (the full set, about 1.18M products) or
  ``items_shuffle_1000.json`` (the 1,000-product subset). A list of objects
  with ``asin``, ``name``, ``category``, ``query``, ``product_category``,
  ``full_description``, ``small_description`` (a string or a list: the bullet
  points), ``pricing`` ("$12.99", or "$10.99 to $15.99"), ``images`` and
  ``customization_options`` (option name -> list of ``{"value", "image"}``);
- attributes: ``items_ins_v2.json`` or ``items_ins_v2_1000.json``: asin ->
  ``{"attributes": [...], "instruction": ..., "instruction_attributes": [...]}``;
- human instructions: ``items_human_ins.json``: asin -> a list of
  ``{"instruction", "instruction_attributes", "instruction_options"}``.

Products are read as WebShop's ``load_products`` reads them: an asin that is
"nan", longer than 10 characters or seen before is skipped; option names are
lower-cased and values stripped, lower-cased, with "/" written " | "; a
product without ``pricing`` costs $100; one without attributes gets
``DUMMY_ATTR``; the price paid for a product with a price range is drawn
uniformly in the range. Goals are WebShop's human goals (``get_human_goals``):
one per human instruction with attributes, in product order; the price limit
is the larger of two of the (up to) four multiples of $10 above the price,
drawn at random, and ", and price lower than X.00 dollars" is appended (no
limit when fewer than two exist). The goals are then shuffled with
``random.seed(233)`` as WebShop's ``SimServer`` does, and split by index as
its baseline code does: ``test`` 0-499 (the 500 the papers report on),
``valid`` 500-1,499, ``train`` the rest. The draws are agentrl's own: WebShop
draws the prices and the limits from Python's global generator without a seed,
so they change from one WebShop process to the next; here they come from one
``random.Random(42)``, prices first, then limits, the same in every run. The
shuffled order of instructions does not depend on them.

Search. ``bm25s`` over WebShop's search documents (title, description, first
bullet point and the options, lower-cased; English stop words removed, no
stemming), top 50 results. WebShop itself searches a Lucene index with
pyserini, so result lists can differ. The index is built once and saved under
``$AGENTRL_CACHE/webshop/`` (keyed by the product file's path, size and time),
and a loaded shop is shared by every env of the process.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

from agentrl.errors import EnvError

from .catalog import bm25_top, tokenize

__all__ = [
    "SEARCH_DEPTH",
    "SPLITS",
    "RealGoal",
    "RealProduct",
    "Shop",
    "find_files",
    "get_shop",
    "load_shop",
    "split_indices",
]

SEARCH_DEPTH = 50
SPLITS: dict[str, tuple[int, int | None]] = {"test": (0, 500), "valid": (500, 1500), "train": (1500, None)}
PRICE_RANGE = [10.0 * i for i in range(1, 100)]
_NO_LIMIT = 1_000_000.0
_INDEX_VERSION = 1


@dataclass(frozen=True, slots=True)
class RealProduct:
    """One product as WebShop's ``load_products`` leaves it."""

    asin: str
    name: str
    category: str
    query: str
    product_category: str
    description: str
    bullet_points: tuple[str, ...]
    attributes: tuple[str, ...]
    options: dict[str, tuple[str, ...]]
    pricing: tuple[float, ...]
    price_tag: str
    rating: str = "N.A."

    @property
    def title(self) -> str:
        return self.name

    def search_text(self) -> str:
        """WebShop's search document: title, description, first bullet point, options."""
        options = ", and ".join(f"{k}: {', '.join(v)}" for k, v in self.options.items())
        first = self.bullet_points[0] if self.bullet_points else ""
        return " ".join((self.name, self.description, first, options)).lower()


@dataclass(frozen=True, slots=True)
class RealGoal:
    """One goal: a human instruction, the product it was written for, and WebShop's goal fields."""

    asin: str
    category: str
    query: str
    name: str
    product_category: str
    instruction: str
    attributes: tuple[str, ...]
    goal_options: tuple[str, ...]
    price_upper: float


@dataclass(slots=True)
class Shop:
    """Products, their prices, the shuffled goals and the search index; shared, never copied."""

    folder: Path
    products: list[RealProduct]
    by_asin: dict[str, int]
    prices: list[float]
    goals: list[RealGoal]
    _retriever: object = field(repr=False)
    _stopwords: frozenset[str] = field(repr=False)

    def search(self, query: str, k: int = SEARCH_DEPTH) -> tuple[int, ...]:
        """Indices of the ``k`` best BM25 matches, best first; ties by product order; no zero scores."""
        return bm25_top(self._retriever, self._stopwords, query, k)

    def split(self, name: str) -> range:
        """The goal indices of a split (see the module docstring)."""
        return split_indices(len(self.goals), name)


def split_indices(n_goals: int, name: str) -> range:
    """Goal indices of split ``name`` among ``n_goals`` shuffled goals."""
    if name not in SPLITS:
        raise EnvError(f"unknown WebShop split {name!r}; use one of {', '.join(SPLITS)}")
    start, stop = SPLITS[name]
    return range(min(start, n_goals), n_goals if stop is None else min(stop, n_goals))


# -- files ----------------------------------------------------------------------------


def find_files(folder: Path, subset: str = "auto") -> tuple[Path, Path, Path]:
    """(products, attributes, human instructions) in ``folder``; ``subset`` is
    ``full``, ``1000`` or ``auto`` (the full set when present, else the subset)."""
    if subset not in ("auto", "full", "1000"):
        raise EnvError(f"subset must be 'auto', 'full' or '1000', not {subset!r}")
    full = (folder / "items_shuffle.json", folder / "items_ins_v2.json")
    small = (folder / "items_shuffle_1000.json", folder / "items_ins_v2_1000.json")
    human = folder / "items_human_ins.json"
    options = {"full": [full], "1000": [small], "auto": [full, small]}[subset]
    for products, attributes in options:
        if products.is_file() and attributes.is_file() and human.is_file():
            return products, attributes, human
    wanted = " or ".join(f"{p.name} + {a.name}" for p, a in options)
    raise EnvError(
        f"no WebShop data in {folder}: it needs {wanted}, and items_human_ins.json. These are "
        "WebShop's own files (its setup.sh downloads them into WebShop's data/ folder); point the env "
        "at that folder with data_dir=... or WEBSHOP_DATA=.... agentrl never downloads them.")


def _read_json(path: Path) -> object:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise EnvError(f"cannot read WebShop file {path}: {e}") from e


def _pricing(raw: object) -> tuple[tuple[float, ...], str]:
    if not raw:
        return (100.0,), "$100.0"
    try:
        prices = [float(Decimal(re.sub(r"[^\d.]", "", p))) for p in str(raw).split("$")[1:]]
    except InvalidOperation:
        prices = []
    if not prices:
        return (100.0,), "$100.0"
    if len(prices) == 1:
        return (prices[0],), f"${prices[0]}"
    return (prices[0], prices[1]), f"${prices[0]} to ${prices[1]}"


def _options(raw: object) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for name, contents in (raw or {}).items() if isinstance(raw, dict) else ():
        if contents is None:
            continue
        out[str(name).lower()] = tuple(
            str(c["value"]).strip().replace("/", " | ").lower() for c in contents)
    return out


def _products(raw: list, attributes: dict, num_products: int | None) -> list[RealProduct]:
    seen: set[str] = set()
    out = []
    for p in raw[:num_products] if num_products is not None else raw:
        asin = str(p.get("asin", "nan"))
        if asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        small = p.get("small_description")
        bullets = tuple(small) if isinstance(small, list) else (str(small or ""),)
        pricing, tag = _pricing(p.get("pricing"))
        attrs = attributes.get(asin, {}).get("attributes") if isinstance(attributes.get(asin), dict) else None
        out.append(RealProduct(
            asin=asin, name=str(p.get("name", "")), category=str(p.get("category", "")),
            query=str(p.get("query", "")).lower().strip(), product_category=str(p.get("product_category", "")),
            description=str(p.get("full_description") or ""), bullet_points=bullets,
            attributes=tuple(attrs) if attrs else ("DUMMY_ATTR",), options=_options(p.get("customization_options")),
            pricing=pricing, price_tag=tag))
    return out


def _goals(products: list[RealProduct], human: dict, prices: list[float], rng: random.Random) -> list[RealGoal]:
    goals = []
    for product, price in zip(products, prices, strict=True):
        for ins in human.get(product.asin) or ():
            attributes = tuple(ins.get("instruction_attributes") or ())
            if not attributes:
                continue
            above = [p for p in PRICE_RANGE if p > price][:4]
            if len(above) >= 2:
                _, price_upper = sorted(rng.sample(above, 2))
                price_text = f", and price lower than {price_upper:.2f} dollars"
            else:
                price_upper, price_text = _NO_LIMIT, ""
            options = ins.get("instruction_options") or ()
            goals.append(RealGoal(
                asin=product.asin, category=product.category, query=product.query, name=product.name,
                product_category=product.product_category,
                instruction=str(ins.get("instruction", "")).strip(".") + price_text, attributes=attributes,
                goal_options=tuple(options.values() if isinstance(options, dict) else options),
                price_upper=price_upper))
    return goals


# -- the shop -------------------------------------------------------------------------


def load_shop(folder: str | os.PathLike[str], subset: str = "auto", num_products: int | None = None,
              index_cache: str | os.PathLike[str] | None = None) -> Shop:
    """Read WebShop's files in ``folder`` and build (or load) the search index; uncached
    in memory (see ``get_shop``). ``num_products`` keeps the first N products, as WebShop's."""
    from bm25s.stopwords import STOPWORDS_EN

    root = Path(folder).expanduser()
    products_file, attributes_file, human_file = find_files(root, subset)
    raw = _read_json(products_file)
    attributes, human = _read_json(attributes_file), _read_json(human_file)
    if not isinstance(raw, list) or not isinstance(attributes, dict) or not isinstance(human, dict):
        raise EnvError(f"{root}: WebShop's product file must hold a list and its instruction files "
                       "objects keyed by asin")
    products = _products(raw, attributes, num_products)
    if not products:
        raise EnvError(f"{products_file} holds no product")
    rng = random.Random(42)  # our seed: WebShop draws these unseeded (module docstring)
    prices = [rng.uniform(*p.pricing) if len(p.pricing) == 2 else p.pricing[0] for p in products]
    goals = _goals(products, human, prices, rng)
    random.Random(233).shuffle(goals)
    stop = frozenset(STOPWORDS_EN)
    retriever = _index(products, products_file, num_products, stop, index_cache)
    return Shop(root, products, {p.asin: i for i, p in enumerate(products)}, prices, goals, retriever, stop)


def _index(products: list[RealProduct], source: Path, num_products: int | None, stop: frozenset[str],
           cache: str | os.PathLike[str] | None) -> object:
    """The BM25 index, loaded from the cache folder or built and saved there atomically."""
    import bm25s

    from agentrl.models import cache_dir

    st = source.stat()
    key = hashlib.sha256(repr((_INDEX_VERSION, str(source.resolve()), st.st_size, st.st_mtime_ns,
                               num_products, len(products))).encode()).hexdigest()[:16]
    folder = Path(cache).expanduser() if cache is not None else cache_dir() / "webshop"
    target = folder / f"bm25-{key}"
    if (target / "params.index.json").is_file():
        try:
            return bm25s.BM25.load(str(target), show_progress=False)
        except Exception:  # a damaged cache entry: build it again below
            shutil.rmtree(target, ignore_errors=True)
    retriever = bm25s.BM25()
    corpus = [[t for t in tokenize(p.search_text()) if t not in stop] for p in products]
    retriever.index(corpus, show_progress=False)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".bm25-", dir=folder))
        retriever.save(str(tmp), show_progress=False)
        try:
            os.replace(tmp, target)
        except OSError:  # another process saved it first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:  # a read-only cache: the index still works, it is just built again next time
        pass
    return retriever


_SHOPS: dict[tuple, Shop] = {}
_SHOPS_LOCK = threading.Lock()


def get_shop(folder: str | os.PathLike[str], subset: str = "auto", num_products: int | None = None,
             index_cache: str | os.PathLike[str] | None = None) -> Shop:
    """The shop of ``folder``, loaded once per process and then shared."""
    key = (str(Path(folder).expanduser().resolve()), subset, num_products,
           None if index_cache is None else str(index_cache))
    with _SHOPS_LOCK:
        if key not in _SHOPS:
            _SHOPS[key] = load_shop(folder, subset, num_products, index_cache)
        return _SHOPS[key]
