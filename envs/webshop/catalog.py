"""Deterministic generator of the WebShop-compatible product catalog and shopping instructions.

Our own generated data, NOT the WebShop data set: the vocabulary (`cope.envs.webshop.vocab`) is 8
categories x 5 product types; each type gets ``products_per_type`` products with an invented brand,
3-4 attributes from the type's pool, a subset of each option group's values, a price, a short
description, features and 0-3 reviews. Each product gets ``instructions_per_product`` goals in the
style of WebShop's instructions::

    i need men's t-shirt that is machine washable and short sleeve in navy blue, size large, and price
    lower than 40.00 dollars

A goal is ``(asin, attributes, goal_options, price_upper)``: 1-3 of the product's attributes, one value
per option group of the product, and a price bound drawn the way WebShop draws it (two of the first
four multiples of $10 above the price, the larger one). Splits: a seeded fifth of the products of every
type are *test* products; test instructions have test goal products only, and a test instruction whose
text also occurs in train is dropped, so the splits are disjoint by goal product and by text. The
catalog (search space) is shared by both splits, as in WebShop.

Files (one JSON record per line, keys sorted, ASCII; byte-identical for a given seed)::

    products.json      [ {asin, name, name_nouns, title, category, product_category, query, price,
                          rating, attributes, options, description, features, reviews}, ... ]
    instructions.json  {"seed": S, "version": V, "train": [goal, ...], "test": [goal, ...]}
                       goal = {asin, instruction, attributes, goal_options, price_upper}

Regenerate the shipped files with ``python -m cope.envs.webshop.catalog --out envs/webshop/data``.
Stdlib only.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from cope.envs.webshop.vocab import (
    BRANDS,
    DEFAULT_OPTION_PHRASES,
    LEADS,
    OPTION_PHRASES,
    REVIEW_TEMPLATES,
    TYPES,
)

VERSION = 1
DEFAULT_SEED = 2022
PRODUCTS_FILE, INSTRUCTIONS_FILE = "products.json", "instructions.json"
_ASIN_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ0123456789"


def _title_case(text: str) -> str:
    return " ".join(w[:1].upper() + w[1:] for w in text.split(" "))


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _make_product(rng: random.Random, category: str, spec: tuple, asin: str) -> dict[str, Any]:
    name, nouns, path, attr_pool, option_groups, (lo, hi) = spec
    brand = rng.choice(BRANDS[category])
    attrs = rng.sample(attr_pool, rng.choice([3, 4]))
    options = {}
    for group in sorted(option_groups):
        values = option_groups[group]
        keep = set(rng.sample(values, rng.randint(min(2, len(values)), len(values))))
        options[group] = [v for v in values if v in keep]  # table order (sizes stay sorted)
    cents = rng.randint(lo, hi) * 100 - rng.choice([1, 1, 1, 51, 5])  # $x.99, $x.49, $x.95
    price = max(cents, 99) / 100
    title = f"{brand} {_title_case(name)} - {_title_case(attrs[0])}, {_title_case(attrs[1])}"
    reviews = []
    for _ in range(rng.choice([0, 1, 2, 2, 3])):
        text = rng.choice(REVIEW_TEMPLATES).format(attr=rng.choice(attrs), name=name)
        reviews.append({"score": rng.choice([3, 4, 4, 5, 5]), "text": text})
    rating = round(sum(r["score"] for r in reviews) / len(reviews), 1) if reviews else "N.A."
    return {
        "asin": asin,
        "name": name,
        "name_nouns": list(nouns),
        "title": title,
        "category": category,
        "product_category": path,
        "query": name,
        "price": price,
        "rating": rating,
        "attributes": attrs,
        "options": options,
        "description": f"This {name} from {brand} is {_join(attrs)}.",
        "features": [_title_case(a) for a in attrs] + [f"Sold by {brand}"],
        "reviews": reviews,
    }


def price_upper_for(rng: random.Random, price: float) -> float:
    """WebShop's bound: of the first four multiples of $10 above ``price``, two at random, the larger."""
    candidates = [10.0 * i for i in range(1, 100) if 10.0 * i > price][:4]
    if len(candidates) < 2:
        return 1_000_000.0
    return max(rng.sample(candidates, 2))


def make_goal(rng: random.Random, product: dict[str, Any]) -> dict[str, Any]:
    """One instruction for ``product``: 1-3 of its attributes, one value per option group, a price bound."""
    attrs = sorted(rng.sample(product["attributes"], rng.randint(1, min(3, len(product["attributes"])))))
    goal_options = {g: rng.choice(vals) for g, vals in sorted(product["options"].items())}
    price_upper = price_upper_for(rng, product["price"])
    name, attr_text = product["name"], _join(attrs)
    form = rng.randrange(3)
    if form == 0:
        text = f"{rng.choice(LEADS)} {attr_text} {name}"
    elif form == 1:
        text = f"{rng.choice(LEADS)} {name} that is {attr_text}"
    else:
        text = f"{rng.choice(LEADS)} {name} which is {attr_text}"
    phrases = [rng.choice(OPTION_PHRASES.get(g, DEFAULT_OPTION_PHRASES)).format(g=g, v=v) for g, v in goal_options.items()]
    if phrases:
        text += ", " + ", ".join(phrases)
    if price_upper < 1_000_000:
        text += f", and price lower than {price_upper:.2f} dollars"
    return {
        "asin": product["asin"],
        "instruction": text,
        "attributes": attrs,
        "goal_options": goal_options,
        "price_upper": price_upper,
    }


def generate(seed: int = DEFAULT_SEED, products_per_type: int = 10, instructions_per_product: int = 2,
             test_fraction: float = 0.2) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The catalog and the instructions for ``seed``: ``(products, {"seed", "version", "train", "test"})``."""
    if products_per_type < 1:
        raise ValueError(f"products_per_type must be >= 1, got {products_per_type!r}")
    if instructions_per_product < 1:
        raise ValueError(f"instructions_per_product must be >= 1, got {instructions_per_product!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    rng = random.Random(f"webshop-catalog/{seed}")
    products, asins, test_asins = [], set(), set()
    for category in sorted(TYPES):
        for spec in TYPES[category]:
            made = []
            for _ in range(products_per_type):
                asin = "B0" + "".join(rng.choice(_ASIN_CHARS) for _ in range(8))
                while asin in asins:
                    asin = "B0" + "".join(rng.choice(_ASIN_CHARS) for _ in range(8))
                asins.add(asin)
                made.append(_make_product(rng, category, spec, asin))
            n_test = max(1, round(test_fraction * products_per_type)) if products_per_type > 1 else 0
            test_asins.update(p["asin"] for p in rng.sample(made, n_test))
            products += made
    goals: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    for product in products:
        split = "test" if product["asin"] in test_asins else "train"
        seen = set()
        for _ in range(instructions_per_product):
            goal = make_goal(rng, product)
            if goal["instruction"] not in seen:
                seen.add(goal["instruction"])
                goals[split].append(goal)
    train_texts = {g["instruction"] for g in goals["train"]}
    goals["test"] = [g for g in goals["test"] if g["instruction"] not in train_texts]
    for split in ("train", "test"):
        random.Random(f"webshop-order/{seed}/{split}").shuffle(goals[split])
    return products, {"seed": seed, "version": VERSION, "train": goals["train"], "test": goals["test"]}


def _dump(record: Any) -> str:
    return json.dumps(record, sort_keys=True, ensure_ascii=True)


def write(out: str | Path, seed: int = DEFAULT_SEED, **kwargs: Any) -> list[Path]:
    """Generate and write ``products.json`` and ``instructions.json`` into ``out``; returns the paths."""
    products, instructions = generate(seed, **kwargs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ",\n".join(_dump(p) for p in products)
    (out / PRODUCTS_FILE).write_text(f"[\n{lines}\n]\n", encoding="ascii")
    parts = [f'"seed": {_dump(instructions["seed"])}', f'"version": {_dump(instructions["version"])}']
    for split in ("train", "test"):
        lines = ",\n".join(_dump(g) for g in instructions[split])
        parts.append(f'"{split}": [\n{lines}\n]')
    (out / INSTRUCTIONS_FILE).write_text("{\n" + ",\n".join(parts) + "\n}\n", encoding="ascii")
    return [out / PRODUCTS_FILE, out / INSTRUCTIONS_FILE]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output folder (created if missing)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--products-per-type", type=int, default=10)
    parser.add_argument("--instructions-per-product", type=int, default=2)
    args = parser.parse_args(argv)
    paths = write(args.out, args.seed, products_per_type=args.products_per_type,
                  instructions_per_product=args.instructions_per_product)
    for p in paths:
        print(f"wrote {p} ({p.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
