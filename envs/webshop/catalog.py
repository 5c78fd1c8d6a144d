"""The WebShop-style product catalog: generated from a seed and searched with BM25.

``get_catalog(seed, size)`` builds (once per process, then cached) ``size``
products from the word lists in ``vocab`` and a ``bm25s`` index over their
text. Every env made with the same seed and size shares one ``Catalog``, so
``reset`` and ``snapshot`` never copy or rebuild it.
"""

from __future__ import annotations

import random
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from agentrl.errors import EnvError

from .vocab import BRAND_PARTS, CATEGORIES, OPTION_GROUPS, STYLE_WORDS

__all__ = ["Catalog", "Product", "build_catalog", "get_catalog", "tokenize"]

_TOKEN = re.compile(r"(?u)\b\w\w+\b")
_CACHE: OrderedDict[tuple[int, int], Catalog] = OrderedDict()
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 4
SEARCH_DEPTH = 50  # results kept per query, as in WebShop (5 pages of 10)


@dataclass(slots=True, frozen=True)
class Product:
    """One product. ``options`` maps an option group to the values on offer."""

    asin: str
    category: str
    product_type: str
    title: str
    description: str
    features: tuple[str, ...]
    attributes: tuple[str, ...]
    options: dict[str, tuple[str, ...]]
    price: float
    rating: float

    def text(self) -> str:
        """The text the search index sees."""
        return " ".join(
            (self.title, self.product_type, self.category, " ".join(self.attributes))
            + self.features
        )


@dataclass(slots=True)
class Catalog:
    """Products plus a BM25 index over them; shared by every env of one seed and size."""

    seed: int
    products: list[Product]
    by_asin: dict[str, int]
    _retriever: object = field(repr=False)
    _stopwords: frozenset[str] = field(repr=False)

    def __len__(self) -> int:
        return len(self.products)

    def search(self, query: str, k: int = SEARCH_DEPTH) -> tuple[int, ...]:
        """Indices of the ``k`` best BM25 matches for ``query``, best first.

        Ties break by catalog order, so a query always gives the same list.
        Products that share no word with the query are not returned.
        """
        return bm25_top(self._retriever, self._stopwords, query, k)


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens, the same rule the index was built with."""
    return _TOKEN.findall(text.lower())


def bm25_top(retriever: object, stopwords: frozenset[str], query: str, k: int) -> tuple[int, ...]:
    """Indices of a bm25s ``retriever``'s ``k`` best matches for ``query``, best first; ties by
    index, so a query always gives the same list; documents sharing no word are left out."""
    tokens = [t for t in tokenize(query) if t not in stopwords]
    ids = retriever.get_tokens_ids(tokens)  # type: ignore[attr-defined]
    if not ids:
        return ()
    scores = retriever.get_scores(ids)  # type: ignore[attr-defined]
    n = len(scores)
    k = min(k, n)
    top = np.argpartition(-scores, k - 1)[:k] if k < n else np.arange(n)
    top = top[np.lexsort((top, -scores[top]))]  # by score descending, then by index
    return tuple(int(i) for i in top if scores[i] > 0.0)


def _asin(index: int) -> str:
    # Multiplying by a prime coprime to 36**8 permutes the ids: unique, random-looking.
    n = (index * 1_000_003 + 7_777_777) % 36**8
    chars = []
    for _ in range(8):
        n, r = divmod(n, 36)
        chars.append("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"[r])
    return "B0" + "".join(reversed(chars))


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def _brands(rng: random.Random, count: int) -> list[str]:
    first, second = BRAND_PARTS
    names = sorted({a + b for a in first for b in second})
    rng.shuffle(names)
    return [n.capitalize() for n in names[:count]]


def _make_product(index: int, rng: random.Random, brands: list[str], types: list) -> Product:
    category, ptype, (pool, groups, (lo, hi)) = types[index % len(types)]
    brand = rng.choice(brands)
    attributes = tuple(rng.sample(pool, rng.randint(2, 4)))
    options = {}
    for group in groups:
        values = OPTION_GROUPS[group]
        chosen = set(rng.sample(values, rng.randint(2, min(5, len(values)))))
        options[group] = tuple(v for v in values if v in chosen)
    style = rng.choice(STYLE_WORDS)
    title = f"{brand} {style.title()} {attributes[0].title()} {ptype.title()}"
    if rng.random() < 0.5:
        title += f", {attributes[1].title()}"
    features = tuple(
        f"{attr.upper()}: this {ptype} is {attr}, made by {brand} for everyday use"
        for attr in attributes
    ) + (f"WHAT YOU GET: one {style} {ptype} from {brand}, backed by a 30-day guarantee",)
    description = (
        f"The {brand} {ptype} is {_article(style)} {style} choice in {category}. "
        f"It is {', '.join(attributes[:-1])} and {attributes[-1]}. "
        f"Available in {', '.join(v for vs in options.values() for v in vs[:2])} and more."
    )
    return Product(
        asin=_asin(index),
        category=category,
        product_type=ptype,
        title=title,
        description=description,
        features=features,
        attributes=attributes,
        options=options,
        price=round(rng.uniform(lo, hi), 2),
        rating=round(rng.uniform(2.5, 5.0), 1),
    )


def build_catalog(seed: int, size: int) -> Catalog:
    """Generate ``size`` products from ``seed`` and index them (uncached; see ``get_catalog``)."""
    import bm25s  # imported here: only building a catalog needs it
    from bm25s.stopwords import STOPWORDS_EN

    rng = random.Random(seed)
    types = [(c, t, spec) for c, ts in CATEGORIES.items() for t, spec in ts.items()]
    brands = _brands(rng, 120)
    products = [_make_product(i, rng, brands, types) for i in range(size)]
    stop = frozenset(STOPWORDS_EN)
    corpus = [[t for t in tokenize(p.text()) if t not in stop] for p in products]
    retriever = bm25s.BM25()
    retriever.index(corpus, show_progress=False)
    return Catalog(
        seed=seed,
        products=products,
        by_asin={p.asin: i for i, p in enumerate(products)},
        _retriever=retriever,
        _stopwords=stop,
    )


def get_catalog(seed: int = 0, size: int = 10_000) -> Catalog:
    """The catalog for ``(seed, size)``, built on first use and then shared."""
    if size < 1:
        raise EnvError(f"catalog size must be >= 1, got {size}")
    key = (int(seed), int(size))
    with _CACHE_LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
        catalog = build_catalog(*key)
        _CACHE[key] = catalog
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
        return catalog
