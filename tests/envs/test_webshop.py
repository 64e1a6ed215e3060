"""Tests for the WebShop-compatible shopping env (`cope.envs.webshop.env` + catalog, search, reward)."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from cope.envs.base import Env, Task
from cope.envs.webshop.catalog import INSTRUCTIONS_FILE, PRODUCTS_FILE, generate, price_upper_for, write
from cope.envs.webshop.env import (
    BUY,
    HARNESS_EMPTY_SEARCH,
    HARNESS_MALFORMED,
    HARNESS_NO_SEARCH,
    HARNESS_TIMEOUT,
    NEXT,
    PREV,
    SEP,
    WebShopEnv,
    parse_action,
    search_keywords,
)
from cope.envs.webshop.reward import purchase_reward, type_reward
from cope.envs.webshop.search import BM25, DEFAULT_CATALOG_DIR, load_catalog, tokenize
from cope.envs.webshop.vocab import BRANDS, TYPES

SHIPPED = DEFAULT_CATALOG_DIR
BUTTONS = {"back to search", "< prev", "next >", "description", "features", "reviews", "buy now", "search"}


def _task(split: str = "train", index: int = 0) -> Task:
    return Task(env="webshop", split=split, index=index)


@pytest.fixture(scope="module")
def env() -> WebShopEnv:
    return WebShopEnv()


def _item_page(env: WebShopEnv, index: int = 0) -> str:
    """Reset to train task ``index`` and open the goal product's page; returns the goal asin."""
    env.reset(_task(index=index))
    actions = env.expert_actions()
    for a in actions[: actions.index(f"click[{env._goal['asin']}]") + 1]:
        assert env.step(a).valid
    return env._goal["asin"]


# -- protocol, data -----------------------------------------------------------------------------------
def test_protocol_counts_and_instructions(env):
    assert isinstance(env, Env)
    assert env.num_tasks("train") == 640 and env.num_tasks("test") == 160
    for word in ("search[", "click[", "Buy Now", "Next >", "< Prev", "option"):
        assert word in env.instructions
    with pytest.raises(ValueError, match="split"):
        env.num_tasks("val")
    with pytest.raises(ValueError, match="index"):
        env.reset(_task("test", 160))


def test_shipped_catalog_shape_and_disjoint_splits():
    products = json.loads((SHIPPED / PRODUCTS_FILE).read_text())
    goals = json.loads((SHIPPED / INSTRUCTIONS_FILE).read_text())
    assert 300 <= len(products) <= 500
    assert sum(f.stat().st_size for f in SHIPPED.glob("*.json")) < 1_000_000
    assert len({p["category"] for p in products}) == 8 and len({p["asin"] for p in products}) == len(products)
    train, test = goals["train"], goals["test"]
    assert {g["asin"] for g in train}.isdisjoint({g["asin"] for g in test})
    assert {g["instruction"] for g in train}.isdisjoint({g["instruction"] for g in test})
    by_asin = {p["asin"]: p for p in products}
    for g in train + test:  # every goal is satisfiable by its own product
        p = by_asin[g["asin"]]
        assert set(g["attributes"]) <= set(p["attributes"]) and p["price"] <= g["price_upper"]
        assert all(v in p["options"][k] for k, v in g["goal_options"].items())
        assert g["instruction"].endswith(f"price lower than {g['price_upper']:.2f} dollars")
        assert all(a in g["instruction"] for a in g["attributes"]) and p["name"] in g["instruction"]


def test_regenerating_the_catalog_is_byte_identical(tmp_path):
    result = subprocess.run([sys.executable, "-m", "cope.envs.webshop.catalog", "--out", str(tmp_path / "cli")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    write(tmp_path / "api")
    for name in (PRODUCTS_FILE, INSTRUCTIONS_FILE):
        shipped = (SHIPPED / name).read_bytes()
        assert (tmp_path / "cli" / name).read_bytes() == shipped
        assert (tmp_path / "api" / name).read_bytes() == shipped
    other, _ = generate(seed=7)
    assert other != json.loads((SHIPPED / PRODUCTS_FILE).read_text())


def test_vocabulary_has_no_substring_clashes():
    """Exact attribute matching plus the text fallback equals exact matching within a product type, and every
    option value is one unambiguous clickable."""
    for category, types in TYPES.items():
        for name, _nouns, _path, attrs, options, _ in types:
            texts = [name, *BRANDS[category]]
            for a in attrs:
                assert not [b for b in attrs if b != a and a in b] and not [t for t in texts if a in t.lower()], a
            values = [v for vs in options.values() for v in vs]
            assert len(values) == len(set(values)) and not {v.lower() for v in values} & BUTTONS


def test_price_bound_follows_webshop():
    rng = random.Random(0)
    bounds = {price_upper_for(rng, 12.99) for _ in range(200)}
    assert bounds == {30.0, 40.0, 50.0}  # the larger of two among 20, 30, 40, 50
    assert price_upper_for(rng, 985.0) == 1_000_000.0


# -- the scripted expert and the reward ---------------------------------------------------------------
@pytest.mark.parametrize("split", ["train", "test"])
def test_expert_buys_the_goal_with_reward_one(env, split):
    for index in range(0, env.num_tasks(split), 16):
        reset = env.reset(_task(split, index))
        assert reset.observation == f"WebShop{SEP}Instruction:{SEP}{reset.task_description}{SEP}Search"
        for a in env.expert_actions():
            out = env.step(a)
            assert out.valid and out.harness == ""
            assert out.done == (a == f"click[{BUY}]")
        assert out.reward == 1.0 and out.success and out.score == 1.0 and out.admissible_actions == []
        assert out.info["purchased_asin"] == env._goal["asin"] and out.observation.endswith("1.000")
        with pytest.raises(RuntimeError, match="reset"):
            env.step(f"click[{BUY}]")


def test_wrong_option_gives_the_formula_value(env):
    for index in range(env.num_tasks("train")):
        goal = env.goal("train", index)
        options = env._catalog.by_asin[goal["asin"]]["options"]
        if len(goal["attributes"]) == 2 and len(goal["goal_options"]) == 2:
            break
    _item_page(env, index)
    (_, v1), (g2, v2) = goal["goal_options"].items()
    wrong = next(v for v in options[g2] if v != v2)
    for a in (f"click[{v1}]", f"click[{wrong}]"):
        assert env.step(a).valid
    out = env.step(f"click[{BUY}]")
    # r_type 1 * (2 attributes + 1 of 2 options + price ok) / (2 + 2 + 1)
    assert out.reward == pytest.approx(4 / 5) and not out.success and out.done and out.score == out.reward
    assert out.info["option_matches"] == 1 and out.info["attribute_matches"] == 2


def test_buying_without_options_and_wrong_type(env):
    goal_asin = _item_page(env, 0)
    goal = env._goal
    out = env.step(f"click[{BUY}]")
    n_att, n_opt = len(goal["attributes"]), len(goal["goal_options"])
    assert out.reward == pytest.approx((n_att + 1) / (n_att + n_opt + 1)) and not out.success
    # Now buy a product whose type shares no noun with the goal's type: r_type = 0.
    env.reset(_task(index=0))
    goal_nouns = set(env._catalog.by_asin[goal_asin]["name_nouns"])
    other = next(p for p in env._catalog.products if not goal_nouns & set(p["name_nouns"]))
    env.step(f"search[{other['title']}]")
    out = env.step(f"click[{other['asin']}]")
    assert out.valid
    out = env.step(f"click[{BUY}]")
    assert out.done and out.reward == 0.0 and not out.success and out.info["r_type"] == 0.0


def _product(nouns, path="a › b › c", query="q", attrs=(), price=10.0):
    return {"name_nouns": list(nouns), "product_category": path, "query": query, "attributes": list(attrs),
            "title": "T", "features": [], "description": "", "price": price}


def test_reward_formula_by_hand():
    goal_product = _product(["men", "running", "shoes"], "shoes › men › athletic", "men's running shoes")
    goal = {"attributes": ["lightweight", "arch support"], "goal_options": {"color": "navy blue", "size": "10"},
            "price_upper": 30.0}
    same = _product(["men", "running", "shoes"], "shoes › men › athletic", "men's running shoes", ["lightweight"])
    r, parts = purchase_reward(same, 35.0, {"color": "Navy  Blue", "size": "9"}, goal, goal_product)
    assert r == pytest.approx((1 + 1 + 0) / 5) and parts["r_type"] == 1.0  # 1 attr, 1 option, price too high
    r, _ = purchase_reward(same, 25.0, {"color": "navy blue", "size": "10"}, goal, goal_product)
    assert r == pytest.approx(4 / 5)
    same["description"] = "Very light. Great arch support."  # the original's text fallback for attributes
    assert purchase_reward(same, 25.0, {"color": "navy blue", "size": "10"}, goal, goal_product)[0] == 1.0


@pytest.mark.parametrize(
    ("nouns", "path", "query", "r_type"),
    [(["men", "running", "shoes"], "x › y › z", "other", 1.0),  # title_score 1
     (["women", "ankle", "boots", "shoes"], "x › y › z", "other", 1.0),  # 1/3 > 0.2
     (["sandals"], "shoes › men › athletic", "other", 0.0),  # title_score 0 overrides the category match
     (["men"], "shoes › kids › sandals", "other", 1.0)],  # 1/3
)
def test_type_reward_rules(nouns, path, query, r_type):
    goal_product = _product(["men", "running", "shoes"], "shoes › men › athletic", "men's running shoes")
    assert type_reward(_product(nouns, path, query), goal_product)["r_type"] == r_type


def test_type_reward_half_and_tenth():
    six = _product(["a", "b", "c", "d", "e", "f"], "p › q › r", "g")
    eleven = _product([*"abcdefghijk"], "p › q › r", "g")
    one = _product(["a"], "x › y › z", "other")
    assert type_reward(one, six) == {"r_type": 0.5, "query_match": False, "category_match": False,
                                     "title_score": pytest.approx(1 / 6)}
    assert type_reward(one, eleven)["r_type"] == 0.1
    cat = _product(["a"], "p › q › z", "other")  # 2 shared category levels rescue 1/6 to 1.0
    assert type_reward(cat, six)["r_type"] == 1.0


# -- pages, navigation, pagination --------------------------------------------------------------------
def test_pagination(env):
    env.reset(_task(index=3))
    first = env.step("search[non slip]")  # 84 matches, the top 50 shown
    total = len(env._results)
    assert total == 50 and f"Page 1 (Total results: {total})" in first.observation
    assert f"click[{NEXT}]" in first.admissible_actions and f"click[{PREV}]" not in first.admissible_actions
    page1 = env._page_asins()
    pages = [page1]
    for n in range(2, 6):
        out = env.step(f"click[{NEXT}]")
        assert out.valid and f"Page {n} (Total results: {total})" in out.observation
        assert f"click[{PREV}]" in out.admissible_actions
        pages.append(env._page_asins())
    assert f"click[{NEXT}]" not in out.admissible_actions and not env.step(f"click[{NEXT}]").valid
    assert [len(p) for p in pages] == [10] * 5 and len({a for p in pages for a in p}) == 50
    assert env._results == env._catalog.search("non slip", 50) and len(env._catalog.search("non slip", 99)) == 84
    for _ in range(4):
        back = env.step(f"click[{PREV}]")
    assert back.observation == first.observation and back.admissible_actions == first.admissible_actions


def test_item_sub_pages_and_back(env):
    asin = _item_page(env, 5)
    product = env._catalog.by_asin[asin]
    value = next(iter(product["options"].values()))[-1]
    item = env.step(f"click[{value}]")
    assert item.observation.startswith(f"Instruction:{SEP}{env._goal['instruction']}{SEP}You have clicked {value}.")
    assert f"Price: ${product['price']:.2f}" in item.observation and item.observation.endswith(f"Reviews{SEP}{BUY}")
    assert item.admissible_actions[:2] == ["click[Back to Search]", f"click[{PREV}]"]
    assert {f"click[{v}]" for vs in product["options"].values() for v in vs} <= set(item.admissible_actions)
    desc = env.step("click[Description]")
    assert desc.observation.endswith(product["description"]) and desc.admissible_actions == [
        "click[Back to Search]", f"click[{PREV}]"]
    assert not env.step(f"click[{BUY}]").valid and not env.step("click[Features]").valid  # not on a sub page
    assert env.step(f"click[{PREV}]").observation == item.observation  # options kept
    assert env.step("click[features]").observation.endswith(SEP.join(product["features"]))
    assert env.step(f"click[{PREV}]").observation == item.observation
    results = env.step(f"click[{PREV}]")
    assert "Total results" in results.observation and f"click[{asin}]" in results.admissible_actions
    again = env.step(f"click[{asin}]")
    assert "You have clicked" not in again.observation  # a fresh visit starts with no options
    search = env.step("click[Back to Search]")
    assert search.observation.endswith(f"{SEP}Search") and search.admissible_actions == [
        f"search[{search_keywords(env._goal['instruction'])}]"]


def test_every_admissible_action_is_valid_on_random_walks(env):
    rng = random.Random(1)
    pages = set()
    for index in range(40):
        out = env.reset(_task("test", index))
        for _ in range(15):
            assert out.admissible_actions, env._page
            out = env.step(rng.choice(out.admissible_actions))
            assert out.valid and out.harness in ("", HARNESS_TIMEOUT)
            pages.add(out.info["page"])
            if out.done:
                break
    assert pages == {"search", "results", "item", "sub", "done"}


# -- invalid actions, noise, limits -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("page", "action", "notice"),
    [("search", "click[Buy Now]", "not a clickable"), ("search", "search[]", HARNESS_EMPTY_SEARCH),
     ("search", "buy it", HARNESS_MALFORMED), ("search", "", HARNESS_MALFORMED),
     ("search", "search[a]\nclick[b]", HARNESS_MALFORMED), ("search", "click[search]", "not a clickable"),
     ("item", "search[shoes]", HARNESS_NO_SEARCH), ("item", "click[Next >]", "not a clickable"),
     ("item", "click[B0NOTTHERE]", "not a clickable"), ("item", "click Buy Now", HARNESS_MALFORMED)],
)
def test_invalid_actions_are_flagged_and_change_nothing(env, page, action, notice):
    if page == "search":
        env.reset(_task(index=2))
    else:
        _item_page(env, 2)
    before = (env._segments(), env._admissible(), env._page, dict(env._options))
    out = env.step(action)
    assert not out.valid and out.observation == "" and notice in out.harness
    assert out.reward == 0.0 and not out.done and not out.success
    assert (env._segments(), env._admissible(), env._page, dict(env._options)) == before
    assert out.admissible_actions == before[1]


@pytest.mark.parametrize(
    ("text", "parsed"),
    [(' "click[Buy Now]". ', ("click", "Buy Now")), ("Action: CLICK[ buy   now ]", ("click", "buy now")),
     ("click['Buy Now']", ("click", "Buy Now")), ("`search[red shoes]`", ("search", "red shoes")),
     ("click [Next >]", ("click", "Next >")), ("buy now", None), ("click[a] click[b]", ("click", "a] click[b"))],
)
def test_parse_action_noise(text, parsed):
    assert parse_action(text) == parsed


def test_noisy_buy_is_accepted(env):
    _item_page(env, 4)
    out = env.step('Action: "CLICK[ buy   NOW ]."')
    assert out.valid and out.done and out.reward > 0


def test_timeout_and_truncation():
    env = WebShopEnv(max_steps=3, max_observation_chars=300)
    env.reset(_task(index=1))
    out = env.step("jump")
    assert not out.done and out.harness == HARNESS_MALFORMED
    out = env.step("search[men's t-shirt]")
    assert out.valid and len(out.observation) == 300 and out.harness.startswith("[observation truncated to 300 of ")
    out = env.step("click[Back to Search]")
    assert out.done and out.info["timeout"] and out.harness == HARNESS_TIMEOUT and out.reward == 0.0
    assert out.score == 0.0 and not out.success and out.admissible_actions == []


def test_repeat_instruction_off():
    env = WebShopEnv(repeat_instruction=False)
    env.reset(_task(index=1))
    assert env.step("search[men's t-shirt]").observation.startswith(f"Back to Search{SEP}Page 1 ")


def test_determinism():
    a, b = WebShopEnv(), WebShopEnv()
    rng_a, rng_b = random.Random(5), random.Random(5)
    for index in range(10):
        ra, rb = a.reset(_task("test", index)), b.reset(_task("test", index))
        assert ra.observation == rb.observation and ra.admissible_actions == rb.admissible_actions
        for _ in range(8):
            oa = a.step(rng_a.choice(ra.admissible_actions))
            ob = b.step(rng_b.choice(rb.admissible_actions))
            assert (oa.observation, oa.admissible_actions, oa.reward) == (ob.observation, ob.admissible_actions, ob.reward)
            if oa.done:
                break
            ra, rb = oa, ob


# -- search -------------------------------------------------------------------------------------------
def test_bm25_by_hand():
    docs = [["red", "shoe"], ["blue", "shoe", "shoe"], ["red", "hat", "wool", "warm"]]
    index = BM25(docs)
    assert index.rank(["red"], 10) == [0, 2]  # the shorter document first
    assert index.rank(["shoe"], 10) == [1, 0]  # higher term frequency first
    assert index.rank(["green"], 10) == [] and index.rank(["red", "shoe"], 1) == [0]
    assert tokenize("I need Men's T-Shirt, price lower than 30.00 dollars") == ["men", "s", "t", "shirt", "30", "00"]


def test_instruction_keywords_find_the_goal_on_page_one(env):
    for split in ("train", "test"):
        for index in range(env.num_tasks(split)):
            goal = env.goal(split, index)
            assert goal["asin"] in env._catalog.search(search_keywords(goal["instruction"]), 10)


# -- configuration ------------------------------------------------------------------------------------
def _tiny_catalog(folder: Path) -> None:
    folder.mkdir()
    product = {"asin": "B0TEST0001", "name": "mug", "name_nouns": ["mug"], "title": "Acme Mug - Dishwasher Safe",
               "category": "home", "product_category": "home › kitchen › mugs", "query": "mug", "price": 9.99,
               "rating": "N.A.", "attributes": ["dishwasher safe"], "options": {"color": ["red", "blue"]},
               "description": "A mug.", "features": ["Dishwasher Safe"], "reviews": []}
    goal = {"asin": "B0TEST0001", "instruction": "i need a dishwasher safe mug in blue, and price lower than 20.00 dollars",
            "attributes": ["dishwasher safe"], "goal_options": {"color": "blue"}, "price_upper": 20.0}
    (folder / PRODUCTS_FILE).write_text(json.dumps([product]))
    (folder / INSTRUCTIONS_FILE).write_text(json.dumps({"train": [goal], "test": [goal]}))


def test_alternative_catalog_dir(tmp_path):
    _tiny_catalog(tmp_path / "cat")
    env = WebShopEnv(catalog_dir=str(tmp_path / "cat"))
    assert env.num_tasks("train") == env.num_tasks("test") == 1
    env.reset(_task())
    for a in ("search[mug]", "click[b0test0001]", "click[BLUE]", "click[buy now]"):
        out = env.step(a)
    assert out.success and out.reward == 1.0
    with pytest.raises(ValueError, match="catalog_dir"):
        WebShopEnv(catalog_dir=str(tmp_path / "missing"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / PRODUCTS_FILE).write_text("[{}]")
    (tmp_path / "bad" / INSTRUCTIONS_FILE).write_text("{}")
    with pytest.raises(ValueError, match="lacks"):
        WebShopEnv(catalog_dir=str(tmp_path / "bad"))
    assert load_catalog(str(tmp_path / "cat")) is load_catalog(str(tmp_path / "cat"))  # loaded once


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [({"max_steps": 0}, "max_steps"), ({"results_per_page": 0}, "results_per_page"),
     ({"max_results": 0}, "max_results"), ({"max_observation_chars": 10}, "max_observation_chars"),
     ({"num_train_tasks": 641}, "num_train_tasks"), ({"num_test_tasks": 0}, "num_test_tasks"), ({"name": ""}, "name")],
)
def test_bad_constructor_args(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        WebShopEnv(**kwargs)


def test_task_limits():
    env = WebShopEnv(num_train_tasks=5, num_test_tasks=3)
    assert env.num_tasks("train") == 5 and env.num_tasks("test") == 3
    with pytest.raises(ValueError, match="index"):
        env.reset(_task("train", 5))


def test_imports_without_torch():
    code = "import cope.envs.webshop.env, cope.envs.webshop.catalog, sys; assert 'torch' not in sys.modules; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.long
def test_one_epoch_of_training(run_train, tmp_path):
    result = run_train(
        ["env=webshop", "model.max_context=2048", "data.max_context=2048", "model.tokenizer_episodes=4",
         "model.warm_start_walks=4", "model.warm_start_steps=2", "data.tasks_per_epoch=1", "data.group_size=2",
         "data.minibatch_size=2", "data.val_tasks=1", "data.val_batch_size=1", "trainer.max_epochs=1",
         "env.max_steps=3", "validate_before_fit=false"],
        tmp_path,
    )
    assert result["counters/episodes"] == 2
