"""``agentrl/WebShopReal-v0`` and WebShop's reward, on small files in WebShop's own schema.

The reward cases are computed by hand from the paper's definition (see
``envs/webshop/real_reward.py``): r = r_type * (attributes + options + price) / (|att| + |opt| + 1).
"""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.env import make_env
from agentrl.envs.webshop.real_data import RealGoal, RealProduct, load_shop, split_indices
from agentrl.envs.webshop.real_reward import (
    NounTagger,
    attribute_matches,
    full_process,
    fuzz_ratio,
    normalize_color,
    noun_tagger,
    option_matches,
    token_set_ratio,
    type_reward,
    webshop_reward,
)
from agentrl.errors import EnvError

CAT = "Beauty & Personal Care › Personal Care › Deodorants & Antiperspirants › Deodorants"


def _item(asin, name, query, category=CAT, pricing="$10.99", options=None, bullets=("3 ounce stick",)):
    return {
        "asin": asin, "name": name, "category": "beauty", "query": query, "product_category": category,
        "full_description": f"{name}. Gentle on sensitive skin.", "small_description": list(bullets),
        "pricing": pricing, "images": ["x.jpg"], "brand": "dropped",
        "customization_options": {
            name: [{"value": v, "image": None} for v in values] for name, values in (options or {}).items()},
    }


PRODUCTS = [
    _item("B000000001", "Earth Mama Bright Citrus Deodorant Stick", "Deodorant ",
          options={"Size": ["3 Ounce", "2 Pack"], "Scent": ["Bright Citrus", "Lavender/Mint"]}),
    _item("B000000002", "Native Coconut Vanilla Deodorant", "deodorant", pricing="$8.00 to $12.00",
          options={"Color": ["Navy Blue", "Black"]}),
    _item("B000000003", "Hiking Boots Waterproof Leather", "boots",
          category="Clothing › Shoes › Men › Boots", pricing="$89.99",
          options={"Size": ["16 inch", "9 wide"]}),
    _item("B000000001", "a duplicate asin is skipped", "x"),
    _item("nan", "no asin is skipped", "x"),
]
ATTRIBUTES = {
    "B000000001": {"attributes": ["paraben free", "sensitive skin"], "instruction": "",
                   "instruction_attributes": []},
    "B000000002": {"attributes": ["aluminum free"], "instruction": "", "instruction_attributes": []},
}
HUMAN = {
    "B000000001": [
        {"instruction": "i need a 3 ounce deodorant for sensitive skin.",
         "instruction_attributes": ["sensitive skin"], "instruction_options": ["3 ounce"]},
        {"instruction": "no attributes, so no goal", "instruction_attributes": [], "instruction_options": []},
    ],
    "B000000002": [
        {"instruction": "find an aluminum free deodorant in dark blue",
         "instruction_attributes": ["aluminum free"], "instruction_options": ["dark blue"]},
    ],
    "B000000003": [
        {"instruction": "waterproof boots, 12 inch", "instruction_attributes": ["waterproof"],
         "instruction_options": ["12 inch"]},
    ],
}


def write_webshop_folder(folder, products=PRODUCTS, attributes=ATTRIBUTES, human=HUMAN, subset=True):
    suffix = "_1000" if subset else ""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"items_shuffle{suffix}.json").write_text(json.dumps(products))
    (folder / f"items_ins_v2{suffix}.json").write_text(json.dumps(attributes))
    (folder / "items_human_ins.json").write_text(json.dumps(human))
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_webshop_folder(tmp_path_factory.mktemp("webshop"))


@pytest.fixture(scope="module")
def index_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("webshop_index")


HEURISTIC = noun_tagger("heuristic")


def _fixed_nouns(table):
    return NounTagger("fixed", lambda text: table[text])


def _goal(**kw):
    base = dict(asin="G", category="beauty", query="deodorant", name="goal name", product_category=CAT,
                instruction="i need it", attributes=("sensitive skin",), goal_options=("3 ounce",),
                price_upper=20.0)
    return RealGoal(**(base | kw))


def _product(**kw):
    base = dict(asin="P", name="goal name", category="beauty", query="deodorant", product_category=CAT,
                description="", bullet_points=("",), attributes=("sensitive skin",),
                options={"size": ("3 ounce", "2 pack")}, pricing=(10.0,), price_tag="$10.0")
    return RealProduct(**(base | kw))


# -- fuzzy matching and normalisation, as thefuzz computes them ----------------------------


def test_fuzzy_ratios_match_thefuzz_on_worked_examples():
    assert fuzz_ratio("this is a test", "this is a test!") == 97  # thefuzz's README example
    assert token_set_ratio("fuzzy was a bear", "fuzzy fuzzy was a bear") == 100
    assert token_set_ratio("Natural BLACK!", "black natural") == 100  # case and punctuation ignored
    # "16 inch" vs "16 inches": max of 200*2/9, 200*2/11, 200*7/16 = 87.5 -> 88
    assert token_set_ratio("16 inch", "16 inches") == 88
    # "12 inch" vs "16 inch": LCS("inch 12", "inch 16") = 6 -> 200*6/14 = 85.7 -> 86, a match (> 85)
    assert token_set_ratio("12 inch", "16 inch") == 86
    assert token_set_ratio("", "black") == 0 and token_set_ratio("red", "blue") < 85


def test_an_underscore_is_a_word_character_as_in_the_thefuzz_webshop_pins():
    """thefuzz 0.19's ``full_process`` blanks ``\\W`` (not ``_``): "heavy_duty" stays one word, so
    against "heavy duty" no word is shared and the whole strings compare: LCS("heavy_duty",
    "duty heavy") = 5 ("heavy"), 200 * 5 / 20 = 50; not a match."""
    assert full_process("Heavy_Duty, 12-inch!") == "heavy_duty  12 inch"
    assert token_set_ratio("heavy_duty", "heavy duty") == 50
    assert token_set_ratio("heavy_duty", "HEAVY_DUTY") == 100


def test_normalize_color_takes_the_first_colour_of_webshops_list():
    assert normalize_color("navy blue") == "blue"  # "blue" comes before "navy" in the list
    assert normalize_color("dark blue") == "blue"
    assert normalize_color("x-large") == "x-large"


# -- the reward, by hand -------------------------------------------------------------------


def test_exact_purchase_scores_one():
    parts = webshop_reward(_product(), _goal(), 10.0, ["3 ounce"], HEURISTIC)
    assert parts.reward == 1.0 and parts.r_type == 1.0 and parts.query_match


def test_missing_option_and_price_over_the_limit_each_cost_a_third():
    assert webshop_reward(_product(), _goal(), 10.0, [], HEURISTIC).reward == pytest.approx(2 / 3)
    parts = webshop_reward(_product(), _goal(), 25.0, [], HEURISTIC)
    assert parts.reward == pytest.approx(1 / 3) and not parts.price_ok


def test_attribute_found_in_the_text_when_not_in_the_list():
    product = _product(attributes=("paraben free",), description="Kind to Sensitive Skin.")
    assert attribute_matches(("sensitive skin",), product.attributes, product.title, product.bullet_points,
                             product.description) == 1  # lower-cased description holds it
    assert attribute_matches(("Sensitive Skin",), (), "", ("",), "sensitive skin") == 0  # goal side is not lowered
    assert attribute_matches(("sensitive skin",), ("skin sensitive",), "", ("",), "") == 1  # fuzzy: same words


def test_options_match_after_colour_normalisation():
    assert option_matches(["navy blue"], ["dark blue"]) == 1  # both normalise to "blue"
    assert token_set_ratio("navy blue", "dark blue") < 85  # they would not match without it
    assert option_matches(["12 inch"], ["16 inch"]) == 1  # WebShop's fuzzy threshold lets this through
    assert option_matches(["3 ounce", "lavender"], ["3 ounce"]) == 1


@pytest.mark.parametrize(("bought_nouns", "query", "category", "expected"), [
    # goal name nouns: 6 words
    (["a", "b", "c"], "other", "x › y", 1.0),      # title score 3/6 = 0.5 > 0.2
    (["a"], "deodorant", "x › y", 1.0),            # query match, title score 1/6 >= 0.1
    (["a"], "other", CAT.replace("Deodorants", "Soap", 1), 1.0),  # category: 3 levels shared
    (["a"], "other", "Beauty & Personal Care › Soap", 0.5),  # 1 level shared, 1/6 <= 0.2
    (["a"], "other", "x › y", 0.5),                # no match, 1/6 = 0.167 between 0.1 and 0.2
    (["a", "z"], "deodorant", CAT, 1.0),
])
def test_type_reward_follows_the_papers_cases(bought_nouns, query, category, expected):
    tagger = _fixed_nouns({"goal": ["a", "b", "c", "d", "e", "f"], "bought": bought_nouns})
    t = type_reward(query, category, "bought", "deodorant", CAT, "goal", tagger)
    assert t.r_type == expected


def test_type_reward_low_title_scores_override_the_matches():
    many = [f"w{i}" for i in range(11)]
    tagger = _fixed_nouns({"goal": many, "one": ["w0"], "none": ["zzz"], "empty": []})
    # 1/11 < 0.1: 0.1 even though the query matches; 0 shared nouns: 0.0
    assert type_reward("q", CAT, "one", "q", CAT, "goal", tagger).r_type == 0.1
    assert type_reward("q", CAT, "none", "q", CAT, "goal", tagger).r_type == 0.0
    # a goal name without nouns scores 0.2: r_type 1.0 with a query match, else 0.5
    empty = type_reward("q", CAT, "one", "q", CAT, "empty", tagger)
    assert empty.title_score == 0.2 and empty.r_type == 1.0
    assert type_reward("p", "a", "one", "q", "b", "empty", tagger).r_type == 0.5


def test_reward_of_another_product_multiplies_by_r_type():
    tagger = _fixed_nouns({"goal name": ["deodorant", "stick"], "other": ["deodorant"]})
    product = _product(name="other", query="soap", product_category="x › y", attributes=("vegan",),
                       options={"size": ("2 pack",)})
    parts = webshop_reward(product, _goal(), 10.0, ["2 pack"], tagger)
    # r_type 1.0 (title score 1/2 > 0.2); attributes 0, options 0, price 1 -> 1/3
    assert parts.r_type == 1.0 and parts.reward == pytest.approx(1 / 3)


# -- the data --------------------------------------------------------------------------------


def test_shop_reads_webshops_files_as_load_products_does(data, index_cache):
    shop = load_shop(data, index_cache=index_cache)
    assert [p.asin for p in shop.products] == ["B000000001", "B000000002", "B000000003"]
    p1, p2, _ = shop.products
    assert p1.query == "deodorant" and p1.options == {"size": ("3 ounce", "2 pack"),
                                                      "scent": ("bright citrus", "lavender | mint")}
    assert p1.attributes == ("paraben free", "sensitive skin") and shop.products[2].attributes == ("DUMMY_ATTR",)
    assert p2.pricing == (8.0, 12.0) and p2.price_tag == "$8.0 to $12.0" and 8.0 <= shop.prices[1] <= 12.0
    assert shop.prices[0] == 10.99
    # goals: 3 human instructions with attributes (one without is skipped), shuffled with seed 233
    order = [("B000000001", "i need a 3 ounce deodorant for sensitive skin"),
             ("B000000002", "find an aluminum free deodorant in dark blue"),
             ("B000000003", "waterproof boots, 12 inch")]
    random.Random(233).shuffle(order)
    assert [(g.asin, g.instruction.split(", and price")[0]) for g in shop.goals] == order
    # the price limit: the larger of two of the four multiples of 10 above the price, drawn after the prices
    rng = random.Random(42)
    rng.uniform(8.0, 12.0)
    limits = {"B000000001": sorted(rng.sample([20.0, 30.0, 40.0, 50.0], 2))[1]}
    goal = next(g for g in shop.goals if g.asin == "B000000001")
    assert goal.price_upper == limits["B000000001"]
    assert goal.instruction.endswith(f", and price lower than {goal.price_upper:.2f} dollars")
    assert goal.goal_options == ("3 ounce",) and goal.attributes == ("sensitive skin",)


def test_splits_are_webshops_indices():
    assert split_indices(12087, "test") == range(0, 500)
    assert split_indices(12087, "valid") == range(500, 1500)
    assert split_indices(12087, "train") == range(1500, 12087)
    assert split_indices(3, "valid") == range(3, 3)
    with pytest.raises(EnvError, match="unknown WebShop split"):
        split_indices(10, "dev")


def test_search_ranks_by_bm25_and_the_index_is_cached(data, index_cache):
    shop = load_shop(data, index_cache=index_cache)
    assert shop.search("hiking boots")[0] == 2
    assert set(shop.search("deodorant")) == {0, 1}
    assert shop.search("zzzz") == ()
    saved = list(index_cache.glob("bm25-*/params.index.json"))
    assert len(saved) == 1
    again = load_shop(data, index_cache=index_cache)  # loads the saved index
    assert again.search("coconut vanilla") == shop.search("coconut vanilla") == (1,)


def test_without_files_the_error_names_them(tmp_path, monkeypatch):
    with pytest.raises(EnvError, match="items_human_ins.json") as err:
        make_env("agentrl/WebShopReal-v0", data_dir=str(tmp_path))
    assert "items_shuffle_1000.json" in str(err.value) and "never downloads" in str(err.value)
    monkeypatch.delenv("WEBSHOP_DATA", raising=False)
    with pytest.raises(EnvError, match="WEBSHOP_DATA"):
        make_env("agentrl/WebShopReal-v0")
    with pytest.raises(EnvError, match="split 'valid' is empty"):
        make_env("agentrl/WebShopReal-v0", data_dir=str(write_webshop_folder(tmp_path / "w")), split="valid",
                 index_cache=str(tmp_path / "i"))


# -- the env ---------------------------------------------------------------------------------


def _env(data, index_cache, **kw):
    return make_env("agentrl/WebShopReal-v0", data_dir=str(data), split="test", type_tagger="heuristic",
                    index_cache=str(index_cache), **kw)


def test_pages_follow_webshops_text_mode(data, index_cache):
    env = _env(data, index_cache)
    obs, info = env.reset(seed=0)
    goal = env.unwrapped.goal
    assert obs == f"WebShop [SEP] Instruction: [SEP] {goal.instruction} [SEP] Search"
    assert info["admissible_actions"] == [f"search[{goal.instruction}]"]
    obs, *_ , info = env.step("search[Deodorant Stick]")
    assert obs.startswith(f"Instruction: [SEP] {goal.instruction} [SEP] Back to Search [SEP] Page 1 (Total results: ")
    assert "[SEP] B000000001 [SEP] Earth Mama Bright Citrus Deodorant Stick [SEP] $10.99" in obs
    assert "click[b000000001]" in info["admissible_actions"]
    obs, *_ = env.step("click[B000000001]")  # WebShop lower-cases the argument
    assert "[SEP] size [SEP] 3 ounce [SEP] 2 pack [SEP] scent [SEP] bright citrus [SEP] lavender | mint" in obs
    assert obs.endswith("Price: $10.99 [SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews [SEP] Buy Now")
    obs, *_ = env.step("click[features]")
    assert obs.endswith("< Prev [SEP] 3 ounce stick")


def test_invalid_actions_leave_the_page_as_it_was(data, index_cache):
    env = _env(data, index_cache)
    obs, _ = env.reset(seed=1)
    for bad in ("click[buy now]", "buy", "click[]", "search[]", "x" * 200_000):
        new, reward, terminated, truncated, info = env.step(bad)
        assert new == obs and reward == 0.0 and not terminated and info["valid"] is False


def test_oracle_buys_every_goal_with_reward_one(data, index_cache):
    env = _env(data, index_cache)
    inner = env.unwrapped
    assert inner.num_tasks == 3
    for seed in range(3):
        env.reset(seed=seed)
        for _ in range(inner.max_steps):
            obs, reward, terminated, truncated, info = env.step(inner.oracle_action())
            if terminated or truncated:
                break
        assert terminated and reward == 1.0 and info["success"], (seed, obs, info)
        assert info["reward_parts"]["type_tagger"] == "heuristic"


def test_purchase_reward_is_the_papers(data, index_cache):
    env = _env(data, index_cache)
    inner = env.unwrapped
    seed = next(s for s in range(3) if inner.task_family(s) == "beauty"
                and inner.shop.goals[inner.indices[s]].asin == "B000000001")
    env.reset(seed=seed)
    env.step("search[earth mama deodorant]")
    env.step("click[b000000001]")
    env.step("click[2 pack]")  # the wrong size
    obs, reward, terminated, _, info = env.step("click[buy now]")
    # attribute "sensitive skin" in the product's list, option "3 ounce" missed, price 10.99 within the limit
    assert terminated and reward == pytest.approx(2 / 3) and info["success"] is False
    assert info["reward_parts"]["options"] == "0/1" and info["score"] == reward
    assert obs.startswith("Thank you for shopping with us!")


def test_restored_env_continues_identically(data, index_cache):
    env = _env(data, index_cache)
    inner = env.unwrapped
    env.reset(seed=2)
    env.step(inner.oracle_action())
    snap = inner.snapshot()
    first = []
    for _ in range(3):
        obs, r, term, trunc, info = env.step(inner.oracle_action())
        first.append((obs, r, term, info["state_key"]))
    inner.restore(snap)
    again = []
    for _ in range(3):
        obs, r, term, trunc, info = env.step(inner.oracle_action())
        again.append((obs, r, term, info["state_key"]))
    assert again == first


def test_state_key_ignores_the_step_count_and_invalid_actions(data, index_cache):
    env = _env(data, index_cache)
    _, info = env.reset(seed=0)
    start = info["state_key"]
    *_, info = env.step("nonsense")
    assert info["state_key"] == start
    *_, info = env.step("search[deodorant]")
    assert info["state_key"] != start
    *_, info = env.step("click[back to search]")
    assert info["state_key"] == start


JUNK = st.one_of(st.text(max_size=60), st.sampled_from(
    ["search[]", "click[]", "click[next >]", "click[< prev]", "search[deodorant]", "click[b000000001]",
     "click[buy now]", "click[3 ounce]", "[", "]]", "search[" + "a" * 500 + "]"]))


def test_junk_actions_never_crash(data, index_cache):
    env = _env(data, index_cache, max_steps=8)

    @settings(deadline=None, max_examples=60, suppress_health_check=list(HealthCheck))
    @given(actions=st.lists(JUNK, min_size=1, max_size=8))
    def run(actions):
        env.reset(seed=len(actions))
        for a in actions:
            obs, reward, terminated, truncated, info = env.step(a)
            assert isinstance(obs, str) and obs and 0.0 <= reward <= 1.0 and math.isfinite(reward)
            if terminated or truncated:
                break

    run()
