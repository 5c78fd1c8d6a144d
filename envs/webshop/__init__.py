"""``agentrl/WebShop-v0``: a WebShop-style shopping env over a generated catalog.

``WebShopEnv`` is the env; ``get_catalog`` builds (and caches) the product
catalog and its BM25 index; ``make_goal`` / ``score_purchase`` are the task and
its WebShop-style score.
"""

from .catalog import Catalog, Product, build_catalog, get_catalog
from .env import WebShopEnv, WebShopSnapshot
from .goal import Goal, PurchaseScore, make_goal, satisfies, score_purchase

__all__ = [
    "Catalog",
    "Goal",
    "Product",
    "PurchaseScore",
    "WebShopEnv",
    "WebShopSnapshot",
    "build_catalog",
    "get_catalog",
    "make_goal",
    "satisfies",
    "score_purchase",
]
