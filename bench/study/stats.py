"""Statistics of the sample-efficiency study (:mod:`bench.study.launch`): curves, thresholds, bootstrap intervals.

Pure functions over plain lists, so that they can be checked by hand (tests/test_study_stats.py).

* A run's curve is its held-out success after every validation against the episodes (or env steps)
  spent before it, starting with the warm start at 0 episodes.
* Episodes to threshold: the counter at the first validation with success >= threshold; a run that
  never gets there is *censored*: ``inf`` (it needed more than the budget).
* AUC: the area under the success-vs-episodes curve (trapezoids) divided by the episodes spanned,
  i.e. the average held-out success over the run (higher = learned earlier or better).
* Intervals: percentile bootstrap over seeds (resampling seeds with replacement, 10,000 draws, a fixed
  generator seed). Medians are read without interpolation (``inverted_cdf``), so a censored ``inf``
  stays ``inf`` instead of turning into ``nan``: an upper bound of ``inf`` says "not reached in at
  least 2.5% of the resamples".
* Arms are compared with GRPO *paired by seed* (same task stream, same warm start): the bootstrap of
  the mean per-seed difference. An arm separates from GRPO at 95% when that interval excludes 0.
  With 5 seeds the percentile bootstrap is narrow (it cannot see beyond the 5 differences it resamples),
  so the paired Student-t interval of the same differences (``paired_t``) is reported beside it as the
  conservative check: a separation that only the bootstrap shows is a weak one.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

INF = math.inf
DRAWS = 10_000


def first_reaching(xs: Sequence[float], ys: Sequence[float], threshold: float) -> float:
    """The x of the first point with y >= threshold; ``inf`` when none (censored at the budget)."""
    return next((float(x) for x, y in zip(xs, ys) if y >= threshold), INF)


def auc_norm(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Trapezoid area under (xs, ys) divided by the x span: the curve's average height. None for < 2 points."""
    if len(xs) < 2 or xs[-1] == xs[0]:
        return None
    area = sum((x1 - x0) * (y0 + y1) / 2 for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]))
    return area / (xs[-1] - xs[0])


def _median(a: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.quantile(a, 0.5, axis=axis, method="inverted_cdf")


STATS: dict[str, Callable[..., np.ndarray]] = {"mean": lambda a, axis=-1: np.mean(a, axis=axis), "median": _median}


def bootstrap(values: Sequence[float], stat: str = "mean", draws: int = DRAWS, seed: int = 0,
              level: float = 0.95) -> tuple[float, float, float]:
    """(statistic, low, high): the statistic of ``values`` and its percentile-bootstrap interval over them.

    ``values`` are one number per seed (``inf`` allowed for censored medians). One value gives a
    zero-width interval (nothing to resample); none gives nans."""
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return (math.nan, math.nan, math.nan)
    fn = STATS[stat]
    point = float(fn(a))
    if a.size == 1:
        return (point, point, point)
    rng = np.random.default_rng(seed)
    samples = a[rng.integers(0, a.size, size=(draws, a.size))]  # (draws, n)
    return (point, *_percentiles(fn(samples, axis=1), level))


def _percentiles(dist: np.ndarray, level: float) -> tuple[float, float]:
    """The percentile interval of a bootstrap distribution (draws,), read without interpolation."""
    tail = (1.0 - level) / 2
    return (float(np.quantile(dist, tail, method="inverted_cdf")),
            float(np.quantile(dist, 1.0 - tail, method="inverted_cdf")))


def paired_difference(arm: dict[int, float], base: dict[int, float], draws: int = DRAWS, seed: int = 0,
                      level: float = 0.95) -> tuple[float, float, float, int]:
    """(mean difference, low, high, pairs) of ``arm[s] - base[s]`` over the seeds both have (finite values only)."""
    seeds = sorted(s for s in arm.keys() & base.keys() if math.isfinite(arm[s]) and math.isfinite(base[s]))
    diffs = [arm[s] - base[s] for s in seeds]
    mean, lo, hi = bootstrap(diffs, "mean", draws, seed, level)
    return (mean, lo, hi, len(seeds))


def paired_ratio(arm: dict[int, float], top: dict[int, float], base: dict[int, float], draws: int = DRAWS,
                 seed: int = 0, level: float = 0.95) -> tuple[float, float, float, int]:
    """(ratio, low, high, seeds): the share of ``top``'s gain over ``base`` that ``arm`` recovers, pooled over seeds,
    (mean arm - mean base) / (mean top - mean base) on the seeds all three have, with the percentile-bootstrap interval
    of resampling those seeds (each seed's three values together). A resample whose denominator is 0 has no ratio and
    is left out; nan where the point's denominator is 0. The ratio of the means, not the mean of per-seed ratios: a
    seed whose own gain is near 0 does not dominate it."""
    seeds = sorted(s for s in arm.keys() & top.keys() & base.keys()
                   if all(math.isfinite(d[s]) for d in (arm, top, base)))
    if not seeds:
        return (math.nan, math.nan, math.nan, 0)
    v = np.asarray([[arm[s], top[s], base[s]] for s in seeds], dtype=float)  # (n, 3)

    def ratio(m: np.ndarray) -> np.ndarray:  # m: (..., 3) means
        den = m[..., 1] - m[..., 2]
        return np.where(den != 0, (m[..., 0] - m[..., 2]) / np.where(den != 0, den, 1.0), np.nan)

    point = float(ratio(v.mean(axis=0)))
    if len(seeds) == 1 or not math.isfinite(point):
        return (point, point, point, len(seeds))
    rng = np.random.default_rng(seed)
    dist = ratio(v[rng.integers(0, len(seeds), size=(draws, len(seeds)))].mean(axis=1))
    return (point, *_percentiles(dist[np.isfinite(dist)], level), len(seeds))


# Student t 0.975 quantiles for 1..30 degrees of freedom (tests/test_study_stats.py checks them against scipy)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (nan below 1); past 30 the
    Cornish-Fisher expansion around the normal quantile (error < 1e-4 there)."""
    if df < 1:
        return math.nan
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def paired_t(arm: dict[int, float], base: dict[int, float]) -> tuple[float, float, float, int]:
    """(mean difference, low, high, pairs): the paired Student-t 95% interval of ``arm[s] - base[s]`` over the
    seeds both have (finite values only); nan bounds below 2 pairs."""
    seeds = sorted(s for s in arm.keys() & base.keys() if math.isfinite(arm[s]) and math.isfinite(base[s]))
    d = np.asarray([arm[s] - base[s] for s in seeds], dtype=float)
    if d.size == 0:
        return (math.nan, math.nan, math.nan, 0)
    mean = float(d.mean())
    if d.size < 2:
        return (mean, math.nan, math.nan, int(d.size))
    half = t975(d.size - 1) * float(d.std(ddof=1)) / math.sqrt(d.size)
    return (mean, mean - half, mean + half, int(d.size))


def separates(lo: float, hi: float) -> str:
    """``better`` / ``worse`` when the interval excludes 0 (on that side), else ``no``."""
    if lo > 0:
        return "better"
    if hi < 0:
        return "worse"
    return "no"


def mean_band(curves: list[tuple[Sequence[float], Sequence[float]]], draws: int = 2_000, seed: int = 0,
              level: float = 0.95) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(grid, mean, low, high) over seeds' curves on the x grid every curve covers (linear interpolation);
    the band is the bootstrap interval of the mean at each grid point."""
    grid = np.unique(np.concatenate([np.asarray(c[0], dtype=float) for c in curves]))
    grid = grid[grid <= min(float(c[0][-1]) for c in curves)]
    ys = np.stack([np.interp(grid, c[0], c[1]) for c in curves])  # (seeds, points)
    if len(curves) == 1:
        return grid, ys[0], ys[0], ys[0]
    rng = np.random.default_rng(seed)
    means = ys[rng.integers(0, len(curves), size=(draws, len(curves)))].mean(1)  # (draws, points)
    tail = (1.0 - level) / 2
    return grid, ys.mean(0), np.quantile(means, tail, axis=0), np.quantile(means, 1 - tail, axis=0)


def fmt_interval(point: float, lo: float, hi: float, spec: str = ".3f") -> str:
    """``0.123 [0.100, 0.150]``; censored values print as ``>budget``."""
    def f(x: float) -> str:
        if math.isnan(x):
            return "–"
        return ">budget" if math.isinf(x) else format(x, spec)
    return f"{f(point)} [{f(lo)}, {f(hi)}]"
