"""Frozen text embedders E for RWML's embedding reward (:class:`cope.algos.rwml.rewards.EmbeddingCosine`).

RWML (arXiv 2602.05842) scores a predicted observation by the cosine distance between E(prediction) and E(real
observation) under a frozen text embedder; the paper does not name the embedder. Two here, chosen by config
(``rwml.reward.embedder._target_``), each ``embedder(texts) -> (n, D)`` float32 rows, a pure function of the text:

* :class:`HashedNgramEmbedder`, the CPU default: signed feature hashing of character n-grams and words, sublinear
  term frequencies, L2-normalized. No model and no download: no package on the registry this project installs from
  ships the weights of a text-embedding model inside its wheel (``fastembed`` and ``model2vec`` fetch theirs from a
  model hub at run time; the one package that claimed to bundle bge-small is a 4.5 kB wheel without weights), so the
  default is lexical, not semantic. It separates "Wall. Goal: 2 south" from "Goal: 2 south" by the words that
  differ, and is blind to paraphrase; on envs whose observations are templated text (the maze, ALFWorld,
  ScienceWorld) that is most of what matters, on free-form envs use a model.
* :class:`SentenceTransformerEmbedder`, for GPU machines: a sentence-transformers model from a local folder
  (``rwml.reward.embedder.path``), imported and loaded on first use (extra ``rwml``).
"""
from __future__ import annotations

import hashlib
import math
from collections import Counter
from pathlib import Path

import torch

from cope.extras import require


class HashedNgramEmbedder:
    """Bag of hashed character n-grams and words (see the module doc).

    Args:
        dim: the number of hash buckets D (>= 16).
        ngram_min, ngram_max: the character n-gram lengths, of the lower-cased, whitespace-normalized text padded
            with one space at each end (1 <= ngram_min <= ngram_max).
        words: also hash each whole word (a feature of its own kind).
    """

    def __init__(self, dim: int = 4096, ngram_min: int = 3, ngram_max: int = 5, words: bool = True):
        if dim < 16:
            raise ValueError(f"rwml.reward.embedder.dim must be >= 16, got {dim}")
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"rwml.reward.embedder: need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.dim, self.ngram_min, self.ngram_max, self.words = int(dim), int(ngram_min), int(ngram_max), bool(words)

    def features(self, text: str) -> Counter:
        """The text's features (``c:<n-gram>``, ``w:<word>``) with their counts."""
        norm = " ".join(text.lower().split())
        padded = f" {norm} "
        feats: Counter = Counter()
        for n in range(self.ngram_min, self.ngram_max + 1):
            feats.update(f"c:{padded[i: i + n]}" for i in range(max(len(padded) - n + 1, 0)))
        if self.words:
            feats.update(f"w:{w}" for w in norm.split())
        return feats

    def _bucket(self, feature: str) -> tuple[int, float]:
        h = int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "little")  # stable, unsalted
        return h % self.dim, (1.0 if (h >> 63) & 1 else -1.0)

    def __call__(self, texts: list[str]) -> torch.Tensor:
        out = torch.zeros(len(texts), self.dim)  # (n, D)
        for i, text in enumerate(texts):
            for feat, count in self.features(text).items():
                b, sign = self._bucket(feat)
                out[i, b] += sign * (1.0 + math.log(count))
        return torch.nn.functional.normalize(out, dim=-1)  # (n, D); an empty text stays the zero vector


class SentenceTransformerEmbedder:
    """A sentence-transformers model saved in a local folder, frozen (``encode`` runs without gradients).

    Args:
        path: the model folder (``SentenceTransformer.save`` or a downloaded snapshot); must exist.
        device: where it runs (None: sentence-transformers picks, a GPU when there is one).
        batch_size: texts per forward.
    """

    def __init__(self, path: str, device: str | None = None, batch_size: int = 64):
        if not path or not Path(path).expanduser().is_dir():
            raise FileNotFoundError(f"rwml.reward.embedder.path = {path!r}: no such folder (a sentence-transformers model "
                                    "saved locally; nothing is downloaded at run time)")
        require("sentence_transformers", extra="rwml", feature="rwml.reward.embedder (SentenceTransformerEmbedder)")
        if batch_size < 1:
            raise ValueError(f"rwml.reward.embedder.batch_size must be >= 1, got {batch_size}")
        self.path, self.device, self.batch_size = str(Path(path).expanduser()), device, int(batch_size)
        self._model = None

    def __call__(self, texts: list[str]) -> torch.Tensor:
        if self._model is None:
            from sentence_transformers import SentenceTransformer

            self._model = SentenceTransformer(self.path, device=self.device)
            self._model.eval()
        emb = self._model.encode(list(texts), batch_size=self.batch_size, convert_to_tensor=True,
                                 normalize_embeddings=True, show_progress_bar=False)
        return emb.float().cpu()  # (n, D)
