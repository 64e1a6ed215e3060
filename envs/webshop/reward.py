"""The purchase reward of the WebShop-compatible env: the WebShop paper's formula, made deterministic.

At ``click[Buy Now]`` on product Y with chosen options, for goal U (Yao et al. 2022, eq. 1)::

    r = r_type * (|U_att ∩ Y_att| + |U_opt ∩ Y_opt| + 1[y_price <= u_price]) / (|U_att| + |U_opt| + 1)

* ``|U_att ∩ Y_att|``: goal attributes the product has. A goal attribute counts when it equals one of
  the product's attributes (lower-case, spaces collapsed) or, as in the original, occurs as a substring
  of the product's title, features or description (lower-cased). The original matches attributes with a
  fuzzy ratio (thefuzz ``token_set_ratio > 85``); we use exact matching, which on our generated catalog
  (clean, fixed attribute strings) gives the same counts.
* ``|U_opt ∩ Y_opt|``: distinct goal option *values* among the chosen option values (exact match after
  normalisation; the option group is not compared, as in the original, which matches values only).
  Options not clicked count as not chosen. Unlike the original we do not also credit a chosen value
  that merely occurs in the title or description.
* ``1[y_price <= u_price]``: the product's listed price within the goal's bound.
* ``r_type`` (product-type match), reconstructed from the original's rule with the spaCy part-of-speech
  filter replaced by each product's ``name_nouns`` (the nouns of its type name, from our vocabulary;
  a catalog without that field falls back to the words of ``name``, filler words removed)::

      title_score    = |nouns(Y) ∩ nouns(U)| / |nouns(U)|        (0.2 when U has no nouns)
      query_match    = Y.query == U.query
      category_match = at least 2 shared levels of the ›-separated category paths
      r_type = 1.0 if query_match or category_match or title_score > 0.2 else 0.5
      r_type = 0.1 if title_score < 0.1;  r_type = 0.0 if title_score == 0

  U's type fields are those of the goal's own product.

The reward lies in [0, 1]; it is 1.0 exactly when the type matches and every goal attribute, every goal
option and the price bound are met. Stdlib only.
"""
from __future__ import annotations

from typing import Any

from cope.envs.webshop.search import tokenize


def _norm(text: str) -> str:
    return " ".join(str(text).lower().split())


def nouns(product: dict[str, Any]) -> set[str]:
    """The type nouns of ``product`` (``name_nouns``, else the words of ``name``)."""
    if product.get("name_nouns"):
        return {_norm(n) for n in product["name_nouns"]}
    return set(tokenize(product["name"]))


def type_reward(purchased: dict[str, Any], goal_product: dict[str, Any]) -> dict[str, Any]:
    """``r_type`` and its parts for buying ``purchased`` when ``goal_product`` was asked for."""
    query_match = purchased["query"] == goal_product["query"]
    cats_p = {c.strip() for c in purchased["product_category"].split("›")}
    cats_g = {c.strip() for c in goal_product["product_category"].split("›")}
    category_match = len(cats_p & cats_g) >= 2
    wanted = nouns(goal_product)
    title_score = len(nouns(purchased) & wanted) / len(wanted) if wanted else 0.2
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return {"r_type": r_type, "query_match": query_match, "category_match": category_match,
            "title_score": title_score}


def attribute_matches(purchased: dict[str, Any], goal_attributes: list[str]) -> int:
    have = {_norm(a) for a in purchased["attributes"]}
    text = " ".join([purchased["title"], *purchased["features"], purchased["description"]]).lower()
    return sum(1 for a in goal_attributes if _norm(a) in have or _norm(a) in text)


def option_matches(chosen: dict[str, str], goal_options: dict[str, str]) -> int:
    return len({_norm(v) for v in chosen.values()} & {_norm(v) for v in goal_options.values()})


def purchase_reward(purchased: dict[str, Any], price: float, chosen: dict[str, str], goal: dict[str, Any],
                    goal_product: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """``(reward, parts)`` for buying ``purchased`` at ``price`` with options ``chosen`` for ``goal``."""
    t = type_reward(purchased, goal_product)
    n_att = attribute_matches(purchased, goal["attributes"])
    n_opt = option_matches(chosen, goal["goal_options"])
    price_ok = float(price) <= float(goal["price_upper"])
    total = len(goal["attributes"]) + len(goal["goal_options"]) + 1
    reward = t["r_type"] * (n_att + n_opt + int(price_ok)) / total
    parts = {**t, "attribute_matches": n_att, "option_matches": n_opt, "price_ok": price_ok,
             "num_attributes": len(goal["attributes"]), "num_options": len(goal["goal_options"])}
    return reward, parts
