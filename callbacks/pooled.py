"""The callbacks' access to the pooling helpers: :func:`pool` (a tally summed over ranks, one float64 all-reduce)
and :func:`log_global` (log values already global). They live in :mod:`cope.train.dist`, with the module's own
pooled epoch metrics (``rollout/*``, ``env/*``, ``val/*``); see there and docs/metrics.md."""
from __future__ import annotations

from cope.train.dist import log_global, pool

__all__ = ["log_global", "pool"]
