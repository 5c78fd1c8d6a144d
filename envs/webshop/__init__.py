"""``agentrl/WebShop-v0``: a WebShop-style shopping env over a generated catalog.

``WebShopEnv`` is the env; ``get_catalog`` builds (and caches) the product
catalog and its BM25 index; ``make_goal`` / ``score_purchase`` are the task and
its WebShop-style score. ``expert`` is the observation-consistent shopper.
"""

from .catalog import Catalog, Product, build_catalog, get_catalog
from .env import WebShopEnv, WebShopSnapshot
from .expert import Request, ShopNotes, expert_from_history, next_action, parse_request
from .goal import Goal, PurchaseScore, make_goal, satisfies, score_purchase

__all__ = [
    "Catalog",
    "Goal",
    "Product",
    "PurchaseScore",
    "Request",
    "ShopNotes",
    "WebShopEnv",
    "WebShopSnapshot",
    "build_catalog",
    "expert_from_history",
    "get_catalog",
    "make_goal",
    "next_action",
    "parse_request",
    "satisfies",
    "score_purchase",
]
