"""Catalog loading and the lexical search engine of the WebShop-compatible env (`cope.envs.webshop.env`).

:func:`load_catalog` reads a catalog folder (``products.json`` + ``instructions.json``, the schema written
by `cope.envs.webshop.catalog`), checks it, and builds the search index once per folder and process
(cached: the trainer makes one env instance per episode, and they all share it).

Search is Okapi BM25 (k1=1.5, b=0.75, idf = ln(1 + (N - df + 0.5) / (df + 0.5))) over each product's
title, attributes, category and category path. Text is lower-cased and split into ``[a-z0-9]+`` tokens;
a fixed list of instruction filler words (``i``, ``need``, ``price``, ``dollars``, ...) is dropped from
documents and queries. Each distinct query token counts once. Results: products with a positive score,
best first, ties broken by catalog order; at most ``max_results`` (WebShop shows the top 50).
Deterministic; stdlib only.
"""
from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cope.envs.webshop.catalog import INSTRUCTIONS_FILE, PRODUCTS_FILE

DEFAULT_CATALOG_DIR = Path(__file__).resolve().parent / "data"
STOPWORDS = frozenset(
    "a an the i i'm im am is are be want would like need looking look find me for to of and or that which with "
    "in on my some please buy get price lower less than dollars dollar under".split()
)
_TOKEN = re.compile(r"[a-z0-9]+")
_PRODUCT_KEYS = ("asin", "name", "title", "category", "product_category", "query", "price", "rating",
                 "attributes", "options", "description", "features", "reviews")
_GOAL_KEYS = ("asin", "instruction", "attributes", "goal_options", "price_upper")


def tokenize(text: str) -> list[str]:
    """Lower-cased ``[a-z0-9]+`` tokens of ``text`` without the filler words."""
    return [t for t in _TOKEN.findall(text.lower()) if t not in STOPWORDS]


class BM25:
    """Okapi BM25 over a list of token lists (documents are indexed by their position)."""

    def __init__(self, docs: list[list[str]], k1: float = 1.5, b: float = 0.75) -> None:
        self.k1, self.b, self.n = k1, b, len(docs)
        self.lengths = [len(d) for d in docs]
        self.avg_len = sum(self.lengths) / max(1, self.n)
        self.postings: dict[str, list[tuple[int, int]]] = {}
        for i, doc in enumerate(docs):
            counts: dict[str, int] = {}
            for t in doc:
                counts[t] = counts.get(t, 0) + 1
            for t, tf in counts.items():
                self.postings.setdefault(t, []).append((i, tf))
        self.idf = {t: math.log(1.0 + (self.n - len(p) + 0.5) / (len(p) + 0.5)) for t, p in self.postings.items()}

    def scores(self, query: list[str]) -> dict[int, float]:
        """Positive BM25 scores of the documents that share a token with ``query``."""
        out: dict[int, float] = {}
        for t in dict.fromkeys(query):  # distinct tokens, first-seen order
            idf = self.idf.get(t)
            if idf is None:
                continue
            for i, tf in self.postings[t]:
                norm = tf + self.k1 * (1.0 - self.b + self.b * self.lengths[i] / self.avg_len)
                out[i] = out.get(i, 0.0) + idf * tf * (self.k1 + 1.0) / norm
        return out

    def rank(self, query: list[str], limit: int) -> list[int]:
        """Indices of the best ``limit`` documents (score > 0), best first, ties by index."""
        scored = self.scores(query)
        return sorted((i for i, s in scored.items() if s > 0), key=lambda i: (-scored[i], i))[:limit]


@dataclass(frozen=True)
class Catalog:
    folder: str
    products: list[dict[str, Any]]
    by_asin: dict[str, dict[str, Any]]
    goals: dict[str, list[dict[str, Any]]]  # split -> goals
    index: BM25

    def search(self, query: str, limit: int) -> list[str]:
        """ASINs of the top ``limit`` products for ``query``."""
        return [self.products[i]["asin"] for i in self.index.rank(tokenize(query), limit)]


def _document(p: dict[str, Any]) -> list[str]:
    return tokenize(" ".join([p["title"], *p["attributes"], p["category"], p["product_category"].replace("›", " ")]))


def _check(records: Any, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(records, list) or not records:
        raise ValueError(f"{where}: expected a non-empty JSON list of records")
    for n, r in enumerate(records):
        missing = [k for k in keys if not isinstance(r, dict) or k not in r]
        if missing:
            raise ValueError(f"{where}: record {n} lacks {missing}")


@functools.lru_cache(maxsize=4)
def load_catalog(folder: str | None = None) -> Catalog:
    """The catalog in ``folder`` (None: the shipped one), loaded and indexed once per process."""
    path = Path(folder).expanduser().resolve() if folder else DEFAULT_CATALOG_DIR
    pfile, gfile = path / PRODUCTS_FILE, path / INSTRUCTIONS_FILE
    for f in (pfile, gfile):
        if not f.is_file():
            raise FileNotFoundError(f"webshop catalog_dir {str(path)!r} has no {f.name} (see docs/envs/webshop.md)")
    products = json.loads(pfile.read_text(encoding="utf-8"))
    _check(products, _PRODUCT_KEYS, str(pfile))
    raw = json.loads(gfile.read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ValueError(f"{gfile}: expected a JSON object with 'train' and 'test' lists")
    by_asin = {p["asin"]: p for p in products}
    if len(by_asin) != len(products):
        raise ValueError(f"{pfile}: duplicate asin")
    goals = {}
    for split in ("train", "test"):
        _check(raw.get(split), _GOAL_KEYS, f"{gfile} [{split!r}]")
        unknown = [g["asin"] for g in raw[split] if g["asin"] not in by_asin]
        if unknown:
            raise ValueError(f"{gfile} [{split!r}]: goal asins not in {PRODUCTS_FILE}: {unknown[:3]}")
        goals[split] = raw[split]
    return Catalog(str(path), products, by_asin, goals, BM25([_document(p) for p in products]))
