"""The study's statistics (bench.study.stats), checked against hand-computed values."""
from __future__ import annotations

import math

import numpy as np
import pytest

from bench.study.stats import (
    INF,
    auc_norm,
    bootstrap,
    first_reaching,
    fmt_interval,
    mean_band,
    paired_difference,
    paired_ratio,
    paired_t,
    separates,
    t975,
)


def test_first_reaching_and_censoring():
    assert first_reaching([0, 64, 128, 192], [0.0, 0.1, 0.2, 0.15], 0.15) == 128
    assert first_reaching([0, 64], [0.0, 0.1], 0.15) == INF


def test_auc_is_the_average_height():
    assert auc_norm([0, 100], [0.0, 1.0]) == pytest.approx(0.5)
    assert auc_norm([0, 50, 150], [0.2, 0.2, 0.2]) == pytest.approx(0.2)
    # trapezoids on an uneven grid: (50*(0+0.4)/2 + 100*(0.4+0.4)/2) / 150
    assert auc_norm([0, 50, 150], [0.0, 0.4, 0.4]) == pytest.approx((10 + 40) / 150)
    assert auc_norm([0], [0.3]) is None


def test_bootstrap_interval_contains_the_statistic_and_is_deterministic():
    vals = [0.1, 0.2, 0.3, 0.4, 0.5]
    m, lo, hi = bootstrap(vals)
    assert m == pytest.approx(0.3) and lo < m < hi and 0.1 <= lo and hi <= 0.5
    assert bootstrap(vals) == (m, lo, hi)  # fixed generator seed
    # the bootstrap of the mean of n values has sd ~ sigma/sqrt(n): check the width roughly
    sd = np.std(vals) / math.sqrt(len(vals))
    assert 2.5 * sd < hi - lo < 5 * sd
    assert bootstrap([0.7]) == (0.7, 0.7, 0.7)
    assert all(math.isnan(x) for x in bootstrap([]))


def test_censored_median_stays_infinite_not_nan():
    m, lo, hi = bootstrap([128, 256, INF, INF, INF], "median")
    assert m == INF and hi == INF and lo == 128
    m, lo, hi = bootstrap([128, 128, 256, 256, INF], "median")
    assert m == 256 and lo == 128 and hi == INF
    assert fmt_interval(m, lo, hi, ".0f") == "256 [128, >budget]"


def test_paired_difference_uses_common_seeds_and_separates():
    arm = {0: 0.5, 1: 0.6, 2: 0.55, 3: 0.52, 9: 1.0}
    base = {0: 0.3, 1: 0.35, 2: 0.33, 3: 0.31, 4: 0.0}
    d, lo, hi, n = paired_difference(arm, base)
    assert n == 4 and d == pytest.approx(np.mean([0.2, 0.25, 0.22, 0.21]))
    assert separates(lo, hi) == "better" and separates(-hi, -lo) == "worse"
    noisy = paired_difference({0: 0.5, 1: 0.1, 2: 0.4}, {0: 0.3, 1: 0.3, 2: 0.3})
    assert separates(noisy[1], noisy[2]) == "no"


def test_paired_ratio_is_the_ratio_of_the_mean_gains_over_common_seeds():
    """The share of the SFT gain: (mean ECHO - mean GRPO) / (mean SFT - mean GRPO) on the seeds all three have, not
    the mean of per-seed shares (seed 2's gain of 0.02 would make its own share 5.0)."""
    base = {0: 0.4, 1: 0.3, 2: 0.5, 7: 0.0}
    top = {0: 0.8, 1: 0.7, 2: 0.52}
    arm = {0: 0.5, 1: 0.4, 2: 0.6, 9: 1.0}
    r, lo, hi, n = paired_ratio(arm, top, base)
    assert n == 3 and r == pytest.approx((0.5 - 0.4) / (0.6733333 - 0.4), rel=1e-5)  # means 0.5, 0.67333, 0.4 on seeds 0-2
    assert lo <= r <= hi and (lo, hi) == paired_ratio(arm, top, base)[1:3]  # deterministic
    one = paired_ratio({0: 0.5}, {0: 0.8}, {0: 0.4})
    assert one[0] == pytest.approx(0.25) and one[1] == one[2] == one[0] and one[3] == 1
    assert math.isnan(paired_ratio({0: 0.5, 1: 0.6}, {0: 0.4, 1: 0.4}, {0: 0.4, 1: 0.4})[0])  # no gain: no share
    assert paired_ratio({}, {}, {})[3] == 0


def test_sft_gain_reports_per_seed_shares_and_the_pooled_ratio():
    from bench.study.stages import sft_gain

    final = {"grpo": {0: 0.4, 1: 0.3, 2: 0.5}, "echo": {0: 0.5, 1: 0.4, 2: 0.6}, "grpo_sft": {0: 0.8, 1: 0.7, 2: 0.5}}
    g = sft_gain(final)
    assert g["seeds"] == [0, 1, 2] and g["no_gain_seeds"] == 1 and g["shares"] == pytest.approx({0: 0.25, 1: 0.25})
    assert g["pooled"][0] == pytest.approx(0.1 / (2.0 / 3 - 0.4)) and g["pooled"][1] <= g["pooled"][0] <= g["pooled"][2]
    assert sft_gain({"grpo": {0: 0.1}, "echo": {0: 0.2}}) is None


def test_mean_band_on_the_common_grid():
    grid, mean, lo, hi = mean_band([([0, 10, 20], [0.0, 0.5, 1.0]), ([0, 10], [0.0, 1.0])])
    assert grid.tolist() == [0, 10] and mean.tolist() == [0.0, 0.75]
    assert lo[1] <= 0.75 <= hi[1] and lo[1] >= 0.5 and hi[1] <= 1.0


def test_paired_t_interval_by_hand_and_its_quantiles():
    # differences 0.2, 0.25, 0.22, 0.21 (the seeds both have): mean 0.22, sd 0.021602, t(3) = 3.182
    d, lo, hi, n = paired_t({0: 0.5, 1: 0.6, 2: 0.55, 3: 0.52, 9: 1.0}, {0: 0.3, 1: 0.35, 2: 0.33, 3: 0.31, 4: 0.0})
    half = 3.182 * float(np.std([0.2, 0.25, 0.22, 0.21], ddof=1)) / 2
    assert n == 4 and d == pytest.approx(0.22) and (lo, hi) == (pytest.approx(0.22 - half), pytest.approx(0.22 + half))
    # five differences with one against: the bootstrap excludes 0, the t interval does not (the weak case)
    arm, base = {s: v for s, v in enumerate([0.10, 0.12, 0.08, 0.11, -0.05])}, {s: 0.0 for s in range(5)}
    boot, t = paired_difference(arm, base), paired_t(arm, base)
    assert separates(boot[1], boot[2]) == "better" and separates(t[1], t[2]) == "no"
    assert math.isnan(paired_t({0: 1.0}, {0: 0.5})[1]) and paired_t({}, {})[3] == 0
    assert t975(4) == 2.776 and math.isnan(t975(0))
    stats = pytest.importorskip("scipy.stats")
    for df in (*range(1, 31), 31, 40, 100, 1000):
        assert t975(df) == pytest.approx(float(stats.t.ppf(0.975, df)), abs=6e-4)
