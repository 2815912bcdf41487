"""kvbench.report.stats on synthetic data whose answer is known: the sign-flip test against exact binomial counts,
the bootstrap against the closed form of a stratified mean, coverage of the 95 % interval, determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvbench.report.stats import ALPHA, Strata, bootstrap, bootstrap_p, holm, interval, sign_flip_p


def test_identical_series_give_p_one_and_a_point_interval():
    values = [0.0, 1.0, 1.0, 0.0, 1.0]
    assert sign_flip_p([np.subtract(values, values)]) == 1.0
    draws = bootstrap(Strata.of([[values, values]]))
    assert np.all(draws[:, 0] == draws[:, 1])  # paired: the same samples for both series
    low, high = interval(draws[:, 0] - draws[:, 1])
    assert low == high == 0.0


def test_exact_sign_flip_counts_like_a_sign_test():
    # k equal positive differences: only the all-plus and all-minus assignments reach |sum| = k -> p = 2 / 2**k
    for k in (3, 5, 10, 16):
        assert sign_flip_p([[1.0] * k]) == pytest.approx(2 / 2**k)
    # zeros do not count; 3 of 3 non-zero differences positive among 10 samples: p = 2/8
    assert sign_flip_p([[1.0, 1.0, 1.0] + [0.0] * 7]) == pytest.approx(0.25)
    # 4 positive and 1 negative of equal size: |sum| >= 3 for 2 * (1 + 5) of 32 assignments
    assert sign_flip_p([[1.0, 1.0, 1.0, 1.0, -1.0]]) == pytest.approx(12 / 32)
    # symmetric in the sign
    assert sign_flip_p([[-2.0, -1.0, -3.0, 0.5]]) == sign_flip_p([[2.0, 1.0, 3.0, -0.5]])


def test_clear_differences_are_significant_and_weights_follow_strata():
    rng = np.random.default_rng(1)
    clear = rng.normal(5.0, 1.0, size=40)  # 40 non-zero differences: the Monte Carlo branch
    p = sign_flip_p([clear])
    assert p == pytest.approx(1 / 10_001)  # no random assignment reaches the observed mean
    assert sign_flip_p([-clear]) == p
    noise = rng.normal(0.0, 1.0, size=40)
    assert sign_flip_p([noise]) > 0.05
    # weights: a stratum of weight 0 does not count
    assert sign_flip_p([[1.0] * 5, [-7.0, 3.0, -2.0]], weights=[1.0, 0.0]) == pytest.approx(2 / 32)


def test_deterministic():
    rng = np.random.default_rng(2)
    data = Strata.of([rng.normal(size=(2, 30)), rng.normal(size=(2, 12))])
    assert np.array_equal(bootstrap(data), bootstrap(data))
    diffs = [rng.normal(0.3, 1.0, size=30)]
    assert sign_flip_p(diffs) == sign_flip_p(diffs)


def test_stratified_bootstrap_matches_the_closed_form():
    """The bootstrap mean of a stratified mean is the stratified mean; its variance sum_s w_s^2 var_s / n_s (with
    the plug-in variance), within Monte Carlo error."""
    rng = np.random.default_rng(3)
    a, b = rng.normal(10, 2, size=25), rng.exponential(3, size=8)
    data = Strata.of([[a], [b]], weights=[0.5, 0.5])
    draws = bootstrap(data)[:, 0]
    mean = 0.5 * a.mean() + 0.5 * b.mean()
    assert data.means()[0] == pytest.approx(mean)
    assert draws.mean() == pytest.approx(mean, abs=0.03)
    sd = math.sqrt(0.25 * a.var() / len(a) + 0.25 * b.var() / len(b))
    assert draws.std() == pytest.approx(sd, rel=0.05)


def test_interval_coverage():
    """The percentile interval of a mean covers the true mean about 95 % of the time (n = 40, normal data): 400
    synthetic data sets, 2,000 resamples each."""
    rng = np.random.default_rng(4)
    covered = 0
    for i in range(400):
        x = rng.normal(1.0, 1.0, size=40)
        low, high = interval(bootstrap(Strata.of([[x]]), resamples=2_000, seed=i)[:, 0])
        covered += int(low <= 1.0 <= high)
    assert 0.91 <= covered / 400 <= 0.98


def test_bootstrap_p_and_holm():
    draws = np.linspace(0.0, 10.0, 1001)
    assert bootstrap_p(draws, 5.0) == pytest.approx(1.0)
    assert bootstrap_p(draws, 0.105) == pytest.approx(2 * 11 / 1001)
    assert bootstrap_p(draws, -1.0) == 0.0
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5]) == [0.5] and holm([]) == []
    assert ALPHA == 0.05


def test_bad_strata_fail():
    with pytest.raises(ValueError):
        Strata.of([np.zeros((2, 0))])
    with pytest.raises(ValueError):
        Strata.of([np.zeros((2, 3)), np.zeros((1, 3))])


def test_a_runs_interval_in_its_metric_units():
    """The figures' error bars: the interval of the samples' mean scaled to the run's score (x100 for 0/1 records),
    a benchmark's datasets as strata (its score is the mean of the datasets' means)."""
    from kvbench.report.figures import score_interval

    recs = [{"id": str(i), "score": float(i % 2)} for i in range(20)]
    low, high = score_interval(recs, 50.0)
    assert low == pytest.approx(30.0) and high == pytest.approx(70.0)
    same = [{"id": str(i), "score": 1.0, "meta": {"dataset": "ab"[i % 2]}} for i in range(6)]
    assert score_interval(same, 100.0) == (100.0, 100.0)
    assert score_interval([{"id": "x"}], 1.0) is None
