"""``agentrl/WebShop-v0``: a WebShop-style shopping env over a generated catalog.

``WebShopEnv`` is the env; ``get_catalog`` builds (and caches) the product
catalog and its BM25 index; ``make_goal`` / ``score_purchase`` are the task and
its WebShop-style score. ``expert`` is the observation-consistent shopper.

``agentrl/WebShopReal-v0`` (``WebShopRealEnv``) is WebShop itself, from the
user's copy of its files: ``real_data`` reads them (products, goals, splits,
a cached BM25 index) and ``real_reward`` is the paper's reward.
"""

from .catalog import Catalog, Product, build_catalog, get_catalog
from .env import WebShopEnv, WebShopSnapshot
from .expert import Request, ShopNotes, expert_from_history, next_action, parse_request
from .goal import Goal, PurchaseScore, make_goal, satisfies, score_purchase
from .real_data import RealGoal, RealProduct, Shop, get_shop, load_shop
from .real_env import WebShopRealEnv
from .real_reward import RewardParts, webshop_reward

__all__ = [
    "Catalog",
    "Goal",
    "Product",
    "PurchaseScore",
    "RealGoal",
    "RealProduct",
    "Request",
    "RewardParts",
    "Shop",
    "ShopNotes",
    "WebShopEnv",
    "WebShopRealEnv",
    "WebShopSnapshot",
    "build_catalog",
    "expert_from_history",
    "get_catalog",
    "get_shop",
    "load_shop",
    "make_goal",
    "next_action",
    "parse_request",
    "satisfies",
    "score_purchase",
    "webshop_reward",
]
