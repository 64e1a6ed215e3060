"""WebShop-compatible shopping env: our own implementation of WebShop's text mode (not the benchmark).

WebShop (Yao et al. 2022) is a simulated web store: an instruction asks for a product with attributes,
options and a price bound; the agent searches, opens products, picks options and buys. This module
re-implements its *text* interface over our own generated catalog (`cope.envs.webshop.catalog`, a few
hundred products) with a BM25 search (`cope.envs.webshop.search`) and the paper's purchase reward
(`cope.envs.webshop.reward`). Numbers from it are not WebShop benchmark numbers.

Pages (segments joined by `` [SEP] ``, as in WebShop's ``observation_mode="text"``; every page but the
first repeats ``Instruction: [SEP] <instruction>`` unless ``repeat_instruction=False``)::

    search:   WebShop [SEP] Instruction: [SEP] <instruction> [SEP] Search
    results:  Back to Search [SEP] Page 1 (Total results: 50) [SEP] < Prev [SEP] Next > [SEP] <ASIN> [SEP] <title> [SEP] $12.99 ...
    item:     You have clicked <value>. [SEP] Back to Search [SEP] < Prev [SEP] <group> [SEP] <value> ... [SEP] <title>
              [SEP] Price: $12.99 [SEP] Rating: 4.5 [SEP] Description [SEP] Features [SEP] Reviews [SEP] Buy Now
    sub page: Back to Search [SEP] < Prev [SEP] <description | features | reviews>
    done:     Thank you for shopping with us! [SEP] Purchased [SEP] <ASIN> [SEP] ... [SEP] Your score (min 0.0, max 1.0) [SEP] 0.800

``< Prev`` shows only from page 2 on and ``Next >`` only while more results follow (10 per page, top 50).

Actions: ``search[keywords]`` (only on the search page, which has the search bar; non-empty keywords) and
``click[label]`` with a label shown on the current page (product ASIN, option value, ``Back to Search``,
``< Prev``, ``Next >``, ``Description``, ``Features``, ``Reviews``, ``Buy Now``). Labels match
case-insensitively with inner spaces collapsed; the usual model noise is removed first
(`cope.envs.actions.clean_action`). Invalid actions (not encodable text: `cope.envs.actions.unencodable`;
malformed, unknown label, search without a search bar, empty keywords, multi-line) leave the page
unchanged and are flagged ``valid=False`` with an empty observation and a harness notice (the original
ignores them silently). Every action counts toward
``max_steps``; at the limit the episode ends without a purchase (``info["timeout"]``, a harness notice).

Admissible actions: every clickable of the page as ``click[<label>]``; on the search page (no clickables)
one concrete search, ``search[<instruction words without filler words and price clause>]``, which is
always valid there. The agent may search for anything else too.

Reward (``reward_mode`` is not offered: the score only changes at the purchase, so sparse and
score-delta rewards coincide): 0 on every step except ``click[Buy Now]``, which ends the episode with
the paper's reward in [0, 1] (`cope.envs.webshop.reward`). ``score`` is that reward (0 before or without
a purchase); ``success`` is ``reward == 1.0``.
"""
from __future__ import annotations

import re
from typing import Any

from cope.envs.actions import single_line, unencodable
from cope.envs.base import EnvReset, EnvStep, Task, TaskEnv
from cope.envs.webshop.reward import purchase_reward
from cope.envs.webshop.search import STOPWORDS, Catalog, load_catalog

SEP = " [SEP] "
INSTRUCTIONS = (
    "You are shopping in WebShop, a text web store. Buy the product that best matches the instruction: its "
    "type, attributes, options (such as size or color) and price bound. Pages are shown as text with parts "
    "separated by [SEP]. Each turn, answer with exactly one action: search[keywords] on the search page, or "
    "click[label] where label is a clickable shown on the current page: a product id, an option value, "
    "Back to Search, < Prev, Next >, Description, Features, Reviews or Buy Now. Click the option values you "
    "want before Buy Now; buying ends the episode."
)
BACK, PREV, NEXT, BUY = "Back to Search", "< Prev", "Next >", "Buy Now"
SUB_PAGES = ("Description", "Features", "Reviews")
HARNESS_MALFORMED = "Invalid action. Answer with one action: search[keywords] or click[label]."
HARNESS_NO_SEARCH = "Invalid action: there is no search bar on this page. Click Back to Search first."
HARNESS_EMPTY_SEARCH = "Invalid action: search[...] needs keywords."
HARNESS_UNKNOWN = "Invalid action: {label!r} is not a clickable on this page."
HARNESS_TIMEOUT = "Step limit reached: the episode ends without a purchase."
HARNESS_TRUNCATED = "[observation truncated to {kept} of {total} characters]"
_ACTION = re.compile(r"(search|click)\s*\[(.*)\]", re.IGNORECASE)
_PRICE_CLAUSE = re.compile(r",?\s*and price lower than .*$")


def parse_action(text: str) -> tuple[str, str] | None:
    """``(verb, argument)`` of a ``search[...]``/``click[...]`` action, or None when malformed."""
    s = single_line(text)
    m = _ACTION.fullmatch(s) if s else None
    if m is None:
        return None
    arg = m.group(2).strip()
    if len(arg) >= 2 and arg[0] == arg[-1] and arg[0] in "\"'`":
        arg = arg[1:-1].strip()
    return m.group(1).lower(), " ".join(arg.split())


def search_keywords(instruction: str) -> str:
    """The instruction's words without filler words and without the price clause."""
    words = re.findall(r"[^\s,:]+", _PRICE_CLAUSE.sub("", instruction))
    return " ".join(w for w in words if w.lower() not in STOPWORDS)


def _price(value: float) -> str:
    return f"${float(value):.2f}"


class WebShopEnv(TaskEnv):
    """The WebShop-compatible text store behind the `cope.envs.base.Env` protocol; one episode at a time.

    Args:
        catalog_dir: Folder with ``products.json`` and ``instructions.json`` (schema: docs/envs/webshop.md);
            None uses the shipped generated catalog (``envs/webshop/data``).
        max_steps: Actions per episode before a timeout (no purchase, reward 0).
        results_per_page: Products per search results page (WebShop: 10).
        max_results: Products a search returns at most (WebShop: 50).
        max_observation_chars: Longer observations are cut here, with a harness notice.
        repeat_instruction: Show the instruction on every page (as WebShop does), not only the first.
        num_train_tasks: Use only the first n train instructions (None: all).
        num_test_tasks: Use only the first n test instructions (None: all).
        name: Env name used in task ids.
    """

    # Branched rollouts (cope.train.collect.branching) rebuild a child by replay: pages are a pure function of the
    # fixed catalog and the actions (BM25 ties broken by catalog order, no clock, no randomness).
    forks_by_replay = True

    def __init__(
        self,
        catalog_dir: str | None = None,
        max_steps: int = 15,
        results_per_page: int = 10,
        max_results: int = 50,
        max_observation_chars: int = 4000,
        repeat_instruction: bool = True,
        num_train_tasks: int | None = None,
        num_test_tasks: int | None = None,
        name: str = "webshop",
    ) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps!r}")
        if results_per_page < 1:
            raise ValueError(f"results_per_page must be >= 1, got {results_per_page!r}")
        if max_results < 1:
            raise ValueError(f"max_results must be >= 1, got {max_results!r}")
        if max_observation_chars < 200:
            raise ValueError(f"max_observation_chars must be >= 200, got {max_observation_chars!r}")
        if not name:
            raise ValueError("name must be a non-empty string")
        try:
            self._catalog: Catalog = load_catalog(str(catalog_dir) if catalog_dir else None)
        except (OSError, ValueError) as e:
            raise ValueError(f"catalog_dir {catalog_dir!r} is not a usable WebShop catalog: {e}") from e
        self._num_tasks = {}
        for split, n, arg in (("train", num_train_tasks, "num_train_tasks"), ("test", num_test_tasks, "num_test_tasks")):
            have = len(self._catalog.goals[split])
            if n is not None and not 1 <= n <= have:
                raise ValueError(f"{arg} must be in [1, {have}] for this catalog, got {n!r}")
            self._num_tasks[split] = have if n is None else n
        self.catalog_dir, self.max_steps, self.name = catalog_dir, max_steps, name
        self.results_per_page, self.max_results = results_per_page, max_results
        self.max_observation_chars, self.repeat_instruction = max_observation_chars, bool(repeat_instruction)
        self._goal: dict[str, Any] | None = None

    @property
    def instructions(self) -> str:
        return INSTRUCTIONS

    def goal(self, split: str, index: int) -> dict[str, Any]:
        """The goal of task ``index`` of ``split``: asin, instruction, attributes, goal_options, price_upper."""
        return self._catalog.goals[split][self.check_index(split, index)]

    # -- episode ---------------------------------------------------------------------------------------
    def reset(self, task: Task) -> EnvReset:
        self._reset_started()
        self._goal = self.goal(task.split, task.index)
        self._page, self._query, self._results, self._page_no = "search", "", [], 1
        self._asin, self._options, self._sub, self._score = "", {}, "", 0.0
        self._episode_started()
        observation, admissible, _ = self._show(cap=False)  # the search page is the goal itself: never cut
        return EnvReset(
            observation=observation,
            task_description=self._goal["instruction"],
            admissible_actions=admissible,
            info={"goal_asin": self._goal["asin"], "page": "search"},
        )

    def step(self, action: str) -> EnvStep:
        self._step_started()
        notice, reward, info = unencodable(action) or self._apply(parse_action(action)), 0.0, {}
        if self._page == "done":
            reward, info = self._buy()
        valid = notice is None
        timeout = self._step_ended(self._page == "done")
        observation, admissible, harness = self._show() if valid else ("", self._admissible(), notice)
        if timeout:
            harness = f"{harness}\n{HARNESS_TIMEOUT}".strip()
        return EnvStep(
            observation=observation, reward=reward, done=self.episode_over, valid=valid,
            success=self._page == "done" and reward == 1.0, score=self._score, harness=harness,
            admissible_actions=[] if self.episode_over else admissible,
            info={"page": self._page, "timeout": timeout, **info},
        )

    def close(self) -> None:
        pass

    def expert_actions(self) -> list[str]:
        """A scripted expert's actions from the search page: search the goal's title, page to it, pick the
        goal options, buy (tests and benchmarks only)."""
        self._require_episode("expert_actions")
        product = self._catalog.by_asin[self._goal["asin"]]
        query = product["title"].lower()
        rank = self._catalog.search(query, self.max_results).index(product["asin"])
        return [f"search[{query}]", *[f"click[{NEXT}]"] * (rank // self.results_per_page),
                f"click[{product['asin']}]", *[f"click[{v}]" for v in self._goal["goal_options"].values()],
                f"click[{BUY}]"]

    # -- transitions -----------------------------------------------------------------------------------
    def _apply(self, parsed: tuple[str, str] | None) -> str | None:
        """Applies an action; returns None if it was valid, else the harness notice (state unchanged)."""
        if parsed is None:
            return HARNESS_MALFORMED
        verb, arg = parsed
        if verb == "search":
            if self._page != "search":
                return HARNESS_NO_SEARCH
            if not arg:
                return HARNESS_EMPTY_SEARCH
            self._query = arg.lower()
            self._results = self._catalog.search(self._query, self.max_results)
            self._page, self._page_no = "results", 1
            return None
        target = self._clickables().get(arg.lower())
        if target is None:
            return HARNESS_UNKNOWN.format(label=arg)
        kind, value = target
        if kind == "back":
            self._page, self._query, self._results, self._asin, self._options = "search", "", [], "", {}
        elif kind == "page":
            self._page_no += value
        elif kind == "product":
            self._page, self._asin, self._options = "item", value, {}
        elif kind == "option":
            self._options[value[0]] = value[1]
        elif kind == "sub":
            self._page, self._sub = "sub", value
        elif kind == "prev":
            self._page = "results" if self._page == "item" else "item"
        elif kind == "buy":
            self._page = "done"
        return None

    def _buy(self) -> tuple[float, dict[str, Any]]:
        product = self._catalog.by_asin[self._asin]
        goal_product = self._catalog.by_asin[self._goal["asin"]]
        reward, parts = purchase_reward(product, product["price"], self._options, self._goal, goal_product)
        self._score = reward
        return reward, {**parts, "purchased_asin": self._asin, "options": dict(self._options)}

    def _clickables(self) -> dict[str, tuple[str, Any]]:
        """Lower-cased label -> (kind, value), in page order."""
        out: dict[str, tuple[str, Any]] = {}
        if self._page in ("results", "item", "sub"):
            out[BACK.lower()] = ("back", None)
        if self._page == "results":
            if self._page_no > 1:
                out[PREV.lower()] = ("page", -1)
            if self._page_no * self.results_per_page < len(self._results):
                out[NEXT.lower()] = ("page", 1)
            for asin in self._page_asins():
                out.setdefault(asin.lower(), ("product", asin))
        elif self._page in ("item", "sub"):
            out[PREV.lower()] = ("prev", None)
        if self._page == "item":
            for group, values in self._catalog.by_asin[self._asin]["options"].items():
                for v in values:
                    out.setdefault(" ".join(v.lower().split()), ("option", (group, v)))
            for sub in SUB_PAGES:
                out.setdefault(sub.lower(), ("sub", sub))
            out.setdefault(BUY.lower(), ("buy", None))
        return out

    def _labels(self) -> list[str]:
        """Display labels of the clickables, in page order."""
        labels = {BACK: BACK, PREV: PREV, NEXT: NEXT, BUY: BUY, **{s: s for s in SUB_PAGES}}
        lower = {k.lower(): v for k, v in labels.items()}
        out = []
        for key, (kind, value) in self._clickables().items():
            out.append(value if kind == "product" else value[1] if kind == "option" else lower.get(key, key))
        return out

    def _admissible(self) -> list[str]:
        if self._page == "search":
            return [f"search[{search_keywords(self._goal['instruction']) or 'products'}]"]
        return [f"click[{label}]" for label in self._labels()]

    def _page_asins(self) -> list[str]:
        start = (self._page_no - 1) * self.results_per_page
        return self._results[start:start + self.results_per_page]

    # -- rendering -------------------------------------------------------------------------------------
    def _show(self, cap: bool = True) -> tuple[str, list[str], str]:
        """``(observation, admissible actions, harness)`` of the current page, cut to the char cap."""
        text = SEP.join(self._segments())
        harness = ""
        if cap and len(text) > self.max_observation_chars:
            harness = HARNESS_TRUNCATED.format(kept=self.max_observation_chars, total=len(text))
            text = text[: self.max_observation_chars]
        return text, ([] if self._page == "done" else self._admissible()), harness

    def _segments(self) -> list[str]:
        instruction = self._goal["instruction"]
        if self._page == "search":
            return ["WebShop", "Instruction:", instruction, "Search"]
        head = ["Instruction:", instruction] if self.repeat_instruction else []
        if self._page == "results":
            segs = [*head, BACK, f"Page {self._page_no} (Total results: {len(self._results)})"]
            segs += [PREV] * (self._page_no > 1) + [NEXT] * (self._page_no * self.results_per_page < len(self._results))
            for asin in self._page_asins():
                p = self._catalog.by_asin[asin]
                segs += [asin, p["title"], _price(p["price"])]
            return segs if self._results else [*segs, "No products match your search."]
        if self._page == "done":
            p = self._catalog.by_asin[self._asin]
            chosen = ", ".join(f"{g}: {v}" for g, v in self._options.items()) or "none"
            return ["Thank you for shopping with us!", "Purchased", p["asin"], p["title"], f"Options: {chosen}",
                    "Your score (min 0.0, max 1.0)", f"{self._score:.3f}"]
        p = self._catalog.by_asin[self._asin]
        if self._page == "sub":
            segs = [*head, BACK, PREV]
            if self._sub == "Description":
                return [*segs, p["description"]]
            if self._sub == "Features":
                return [*segs, *p["features"]]
            reviews = [x for r in p["reviews"] for x in (f"Rating: {r['score']}/5", r["text"])]
            return [*segs, *(reviews or ["No reviews yet."])]
        segs = [*head, *[f"You have clicked {v}." for v in self._options.values()], BACK, PREV]
        for group, values in p["options"].items():
            segs += [group, *values]
        return [*segs, p["title"], f"Price: {_price(p['price'])}", f"Rating: {p['rating']}", *SUB_PAGES, BUY]
