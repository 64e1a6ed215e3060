"""RWML's rewards: does a predicted next observation match the real one? Binary, pure functions over text.

Follows RWML (arXiv 2602.05842): reward 1 if ``1 - cos(E(prediction), E(s_{t+1})) < tau_d`` under a frozen text
embedder E, else 0 (:class:`EmbeddingCosine`). Binary on purpose: the paper found a thresholded embedding distance
harder to hack than an LLM judge's graded score. Neither E nor tau_d is published; the default here is the lexical
hashed embedder (:mod:`cope.algos.rwml.embedders`) and tau_d = 0.2, our choices.

Two more, picked by config (``rwml.reward._target_``), ours:

* :class:`RougeL`: 1 if the ROUGE-L F1 of the whitespace tokens (longest common subsequence) is >= ``threshold``;
* :class:`ExactMatch`: 1 if the texts are equal after whitespace is normalized (runs collapsed, ends stripped).

Each reward is called on the epoch's predictions at once, ``reward(predictions, targets) -> [0.0 | 1.0, ...]``, and
depends on nothing but those texts. Boundaries: the embedding reward is strict (``d < tau_d``, as in the paper), the
ROUGE-L one inclusive (``F1 >= threshold``).
"""
from __future__ import annotations

import logging
from typing import Callable, Protocol

import torch

from cope.algos.rwml.embedders import HashedNgramEmbedder

log = logging.getLogger(__name__)

Embedder = Callable[[list[str]], torch.Tensor]  # texts -> (n, D) rows


class Reward(Protocol):
    def __call__(self, predictions: list[str], targets: list[str]) -> list[float]:
        """1.0 where ``predictions[i]`` matches ``targets[i]``, else 0.0."""
        ...


def normalize_whitespace(text: str) -> str:
    """Runs of whitespace as one space, none at the ends."""
    return " ".join(text.split())


def exact_match(prediction: str, target: str) -> bool:
    """Equal after :func:`normalize_whitespace`."""
    return normalize_whitespace(prediction) == normalize_whitespace(target)


def lcs_length(a: list[str], b: list[str]) -> int:
    """The length of the longest common subsequence of two token lists (O(len(a) len(b)))."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l_f1(prediction: str, target: str) -> float:
    """ROUGE-L F1 over whitespace tokens: 2PR / (P + R), P = LCS / |prediction|, R = LCS / |target|; 1 when both
    are empty, 0 when one is."""
    p, t = prediction.split(), target.split()
    if not p or not t:
        return float(not p and not t)
    lcs = lcs_length(p, t)
    return 0.0 if lcs == 0 else 2.0 * lcs / (len(p) + len(t))  # = 2PR / (P + R)


def cosine_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``1 - cos`` of matching rows of ``a`` and ``b`` (n, D), in float64 (a zero row has cosine 0: distance 1)."""
    a, b = a.double(), b.double()
    den = a.norm(dim=-1) * b.norm(dim=-1)  # (n,)
    cos = (a * b).sum(-1) / den.clamp_min(1e-300)  # (n,)
    return 1.0 - torch.where(den > 0, cos, torch.zeros_like(cos))  # (n,)


def _check_pairs(predictions: list[str], targets: list[str]) -> None:
    if len(predictions) != len(targets):
        raise ValueError(f"a reward needs one target per prediction, got {len(predictions)} and {len(targets)}")


class EmbeddingCosine:
    """RWML's reward: 1 if ``1 - cos(E(prediction), E(target)) < tau_d``.

    Args:
        embedder: the frozen embedder E (``texts -> (n, D)``; default :class:`HashedNgramEmbedder`).
        tau_d: the distance threshold, in (0, 2) (cosine distances lie in [0, 2]). At tau_d >= 1 the reward pays an
            empty prediction (an all-zero embedding has distance 1) and text orthogonal to the target: a warning says
            so, since that is almost surely a mistake.
    """

    def __init__(self, embedder: Embedder | None = None, tau_d: float = 0.2):
        if not 0.0 < tau_d < 2.0:
            raise ValueError(f"rwml.reward.tau_d must be in (0, 2) (a cosine distance threshold), got {tau_d}")
        if tau_d >= 1.0:
            log.warning("rwml.reward.tau_d=%s: a distance of 1 (an empty prediction, unrelated text) is under it, so the "
                        "reward pays predictions that know nothing of the target", tau_d)
        self.embedder = embedder if embedder is not None else HashedNgramEmbedder()
        self.tau_d = float(tau_d)

    def distances(self, predictions: list[str], targets: list[str]) -> torch.Tensor:
        """``1 - cos`` per pair (n,), float64."""
        _check_pairs(predictions, targets)
        if not predictions:
            return torch.zeros(0, dtype=torch.float64)
        emb = self.embedder([*predictions, *targets])  # (2n, D)
        return cosine_distances(emb[: len(predictions)], emb[len(predictions):])

    def __call__(self, predictions: list[str], targets: list[str]) -> list[float]:
        return [float(d < self.tau_d) for d in self.distances(predictions, targets).tolist()]


class RougeL:
    """1 if the ROUGE-L F1 (:func:`rouge_l_f1`) is >= ``threshold``.

    Args:
        threshold: in (0, 1].
    """

    def __init__(self, threshold: float = 0.8):
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"rwml.reward.threshold must be in (0, 1] (a ROUGE-L F1), got {threshold}")
        self.threshold = float(threshold)

    def __call__(self, predictions: list[str], targets: list[str]) -> list[float]:
        _check_pairs(predictions, targets)
        return [float(rouge_l_f1(p, t) >= self.threshold) for p, t in zip(predictions, targets)]


class ExactMatch:
    """1 if the texts are equal after whitespace normalization (:func:`exact_match`)."""

    def __call__(self, predictions: list[str], targets: list[str]) -> list[float]:
        _check_pairs(predictions, targets)
        return [float(exact_match(p, t)) for p, t in zip(predictions, targets)]
