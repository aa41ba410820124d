"""hil.evaluation.statistics: bootstrap CIs, paired tests, 004's overlap/threshold analyses, BM25-Easy."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from hil.evaluation.metrics import evaluate_run
from hil.evaluation.score_distributions import bootstrap_thresholds, overlap_coe_roe, threshold_analysis
from hil.evaluation.statistics import (
    bm25_easy_split,
    bootstrap_ci,
    paired_bootstrap_test,
    paired_permutation_test,
    paired_t_test,
)

# ----------------------------------------------------------------------------------------------------------
# bootstrap_ci (004 Section 2.1)


def test_bootstrap_matches_slow_reference():
    values = np.random.default_rng(1).uniform(size=30)
    result = bootstrap_ci(values, n_samples=200, sample_size=10, confidence=0.9, seed=7)
    rng = np.random.default_rng(7)
    idx = rng.integers(0, 30, size=(200, 10))
    means = [float(np.mean([values[i] for i in row])) for row in idx]
    assert result.mean == pytest.approx(sum(means) / 200)
    assert result.low == pytest.approx(np.percentile(means, 5))
    assert result.high == pytest.approx(np.percentile(means, 95))
    assert result.std == pytest.approx(np.std(means, ddof=1))
    assert (result.n_samples, result.sample_size, result.observed) == (200, 10, pytest.approx(values.mean()))


def test_bootstrap_ci_covers_true_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    true_mean, covered, trials = 0.4, 0, 200
    for trial in range(trials):
        sample = rng.normal(true_mean, 0.2, size=60)
        result = bootstrap_ci(sample, n_samples=400, seed=trial)
        covered += result.low <= true_mean <= result.high
        assert result.low <= result.mean <= result.high
    # percentile bootstrap with n=60 under-covers slightly; 95% nominal, binomial sd ~1.5% over 200 trials
    assert 0.88 <= covered / trials <= 0.99


def test_bootstrap_width_shrinks_like_one_over_sqrt_l():
    values = np.random.default_rng(3).binomial(1, 0.6, size=500).astype(float)
    widths = {}
    for l in (25, 100, 400):
        r = bootstrap_ci(values, n_samples=2000, sample_size=l, seed=0)
        widths[l] = r.high - r.low
        assert r.std == pytest.approx(values.std() / math.sqrt(l), rel=0.1)
    assert widths[25] > widths[100] > widths[400]
    assert widths[25] / widths[100] == pytest.approx(2.0, rel=0.2)
    assert widths[100] / widths[400] == pytest.approx(2.0, rel=0.2)


def test_bootstrap_dict_input_is_order_independent_and_validated():
    a = {"q1": 0.1, "q2": 0.5, "q3": 0.9}
    b = dict(reversed(list(a.items())))
    assert bootstrap_ci(a, n_samples=50) == bootstrap_ci(b, n_samples=50)
    assert bootstrap_ci(a, n_samples=50, seed=1) != bootstrap_ci(a, n_samples=50, seed=2)
    constant = bootstrap_ci([0.3] * 10, n_samples=20)
    assert constant.low == constant.high == pytest.approx(0.3) and constant.std == pytest.approx(0.0)
    with pytest.raises(ValueError, match="no queries"):
        bootstrap_ci({})
    with pytest.raises(ValueError, match="NaN"):
        bootstrap_ci([0.1, float("nan")])
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_ci([0.1, 0.2], confidence=95)


# ----------------------------------------------------------------------------------------------------------
# paired tests


def _pair(n=40, shift=0.0, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.2, 0.8, size=n)
    other = base + shift + rng.normal(0, 0.05, size=n)
    return ({f"q{i}": float(v) for i, v in enumerate(other)}, {f"q{i}": float(v) for i, v in enumerate(base)})


def test_identical_runs_give_p_one():
    a, _ = _pair()
    for test in (paired_t_test, paired_permutation_test, paired_bootstrap_test):
        result = test(a, dict(a))
        assert result.p_value == 1.0, test.__name__
        assert result.mean_diff == 0.0 and result.n == 40
    t = paired_t_test(a, dict(a))
    assert t.statistic == 0.0 and not math.isnan(t.p_value)


def test_clearly_shifted_runs_are_significant():
    a, b = _pair(shift=0.05)
    for test in (paired_t_test, paired_permutation_test, paired_bootstrap_test):
        result = test(a, b)
        assert result.p_value < 0.01, test.__name__
        assert result.mean_diff == pytest.approx(np.mean([a[q] - b[q] for q in a]))
    boot = paired_bootstrap_test(a, b)
    assert boot.ci[0] < boot.mean_diff < boot.ci[1] and boot.ci[0] > 0


def test_unshifted_noise_is_not_significant():
    a, b = _pair(shift=0.0, seed=5)
    assert paired_t_test(a, b).p_value > 0.05
    assert paired_permutation_test(a, b).p_value > 0.05
    assert paired_bootstrap_test(a, b).p_value > 0.05


def test_t_test_matches_scipy():
    a, b = _pair(shift=0.01, seed=2)
    qids = sorted(a)
    expected = scipy_stats.ttest_rel([a[q] for q in qids], [b[q] for q in qids])
    result = paired_t_test(a, b)
    assert result.statistic == pytest.approx(expected.statistic)
    assert result.p_value == pytest.approx(expected.pvalue)


def _exact_permutation_p(diff):
    observed = abs(sum(diff))
    tol = 1e-12 * max(1.0, sum(abs(d) for d in diff))  # the documented tie tolerance
    hits = sum(abs(sum(s * d for s, d in zip(signs, diff))) >= observed - tol
               for signs in itertools.product((1, -1), repeat=len(diff)))
    return hits / 2 ** len(diff)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-1, 1, allow_nan=False), min_size=1, max_size=8))
def test_exact_permutation_equals_enumeration(diff):
    a = {f"q{i}": d for i, d in enumerate(diff)}
    b = {f"q{i}": 0.0 for i in range(len(diff))}
    result = paired_permutation_test(a, b)  # n <= 16: exact by default
    assert result.method == "paired_permutation_exact"
    assert result.p_value == pytest.approx(_exact_permutation_p(diff), abs=1e-12)


def test_monte_carlo_permutation_is_within_error_of_exact():
    # n = 12: 4096 sign patterns, more than n_permutations, so the random (Monte Carlo) path runs
    diff = [0.30, 0.12, -0.05, 0.22, 0.08, -0.10, 0.15, 0.02, 0.20, 0.04, -0.07, 0.11]
    a = {f"q{i:02d}": 0.5 + d for i, d in enumerate(diff)}
    b = {f"q{i:02d}": 0.5 for i in range(len(diff))}
    exact = _exact_permutation_p(diff)
    assert paired_permutation_test(a, b).p_value == pytest.approx(exact)
    n_perm = 3000
    mc = paired_permutation_test(a, b, n_permutations=n_perm, exact=False, seed=3)
    assert mc.method == "paired_permutation"
    assert abs(mc.p_value - exact) < 4 * math.sqrt(exact * (1 - exact) / n_perm) + 1 / n_perm
    assert 0.0 < exact < 0.2  # a meaningful, non-degenerate case
    # scipy enumerates as soon as n_permutations >= 2^n, whatever exact says: then p is the exact one
    enumerated = paired_permutation_test(a, b, n_permutations=4096, exact=False)
    assert enumerated.method == "paired_permutation_exact" and enumerated.p_value == pytest.approx(exact)


def test_permutation_exact_up_to_16_queries_then_random():
    rng = np.random.default_rng(4)
    for n, method in ((16, "paired_permutation_exact"), (17, "paired_permutation")):
        diff = rng.normal(0.05, 0.2, size=n)
        result = paired_permutation_test(diff, np.zeros(n), n_permutations=500)
        assert result.method == method, n
        assert result.statistic == result.mean_diff == pytest.approx(diff.mean())
    with pytest.raises(ValueError, match="too large"):
        paired_permutation_test(np.ones(25), np.zeros(25), exact=True)
    one = paired_permutation_test([0.7], [0.2])  # +d and -d: the same |mean|
    assert (one.p_value, one.method, one.mean_diff) == (1.0, "paired_permutation_exact", pytest.approx(0.5))


def test_random_permutation_p_is_never_zero():
    # every random pattern has a smaller |mean| than all-positive differences: p = (1 + 0) / (1 + B)
    diff = np.linspace(0.1, 1.0, 30)
    result = paired_permutation_test(diff, np.zeros(30), n_permutations=999, seed=1)
    assert result.method == "paired_permutation" and result.p_value == pytest.approx(1 / 1000)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-10, 10), min_size=2, max_size=9))
def test_exact_permutation_counts_ties_as_exact_arithmetic_does(tenths):
    # d = k / 10: sums of different patterns that are equal in exact arithmetic differ in float rounding; the
    # reference counts with Fractions, without any tolerance
    diff = [k / 10 for k in tenths]
    exact_diff = [Fraction(k, 10) for k in tenths]
    observed = abs(sum(exact_diff))
    hits = sum(abs(sum(s * d for s, d in zip(signs, exact_diff))) >= observed
               for signs in itertools.product((1, -1), repeat=len(diff)))
    result = paired_permutation_test(diff, [0.0] * len(diff))
    assert result.p_value == hits / 2 ** len(diff)


def _bootstrap_test_reference(a, b, n_samples, seed, confidence):
    """The paired bootstrap test written out: resample query indices, mean difference, shifted null, percentiles."""
    diff = np.asarray(a) - np.asarray(b)
    n = len(diff)
    rng = np.random.default_rng(seed)
    means = np.array([np.mean([diff[i] for i in rng.integers(0, n, size=n)]) for _ in range(n_samples)])
    observed = diff.mean()
    count = sum(abs(m - observed) >= abs(observed) - 1e-12 for m in means)
    tail = 100 * (1 - confidence) / 2
    return (1 + count) / (1 + n_samples), tuple(np.percentile(means, [tail, 100 - tail]))


@pytest.mark.parametrize("n,n_samples,confidence,seed", [(30, 500, 0.95, 0), (57, 300, 0.9, 7)])
def test_paired_bootstrap_matches_an_explicit_resampling_loop(n, n_samples, confidence, seed):
    # scipy.stats.bootstrap draws rng.integers(0, n, (B, n)) from the Generator it is given, as this loop does
    rng = np.random.default_rng(100 + n)
    b = rng.uniform(0.2, 0.8, size=n)
    a = b + rng.normal(0.03, 0.1, size=n)
    p_value, (low, high) = _bootstrap_test_reference(a, b, n_samples, seed, confidence)
    result = paired_bootstrap_test(a, b, n_samples=n_samples, seed=seed, confidence=confidence)
    assert result.p_value == pytest.approx(p_value, abs=1e-12)
    assert result.ci == pytest.approx((low, high), abs=1e-12)
    assert result.statistic == result.mean_diff == pytest.approx(np.mean(a - b))
    one = paired_bootstrap_test([0.7], [0.2], n_samples=99)  # every resample of one query is that query
    assert one.ci == pytest.approx((0.5, 0.5)) and one.p_value == pytest.approx(1 / 100)


def test_alignment_of_query_sets():
    a = {"q1": 0.5, "q2": 0.6, "q3": 0.7}
    b = {"q2": 0.5, "q3": 0.65, "q4": 0.1}
    with pytest.raises(ValueError, match="different queries.*q1.*q4"):
        paired_t_test(a, b)
    result = paired_t_test(a, b, on="intersection")
    assert result.n == 2 and result.mean_diff == pytest.approx(0.075)
    with pytest.raises(ValueError, match="share no query"):
        paired_permutation_test({"x": 1.0}, {"y": 1.0}, on="intersection")
    with pytest.raises(ValueError, match="lengths"):
        paired_bootstrap_test([1.0, 2.0], [1.0])
    arrays = paired_t_test(np.array([0.5, 0.6, 0.7]), np.array([0.5, 0.5, 0.6]))
    assert arrays.mean_diff == pytest.approx(0.2 / 3)


# ----------------------------------------------------------------------------------------------------------
# 004 Section 2.2 / 2.3


def test_threshold_analysis_by_hand():
    relevant = [0.9, 0.8, 0.7, 0.4]
    nonrelevant = {"q1": [0.1, 0.5], "q2": 0.6, "q3": [0.2, 0.3, 0.75]}
    rows = threshold_analysis(relevant, nonrelevant, thresholds=[0.75, 0.5])
    assert [r.threshold for r in rows] == [0.5, 0.75]
    assert (rows[0].n_relevant_above, rows[0].n_nonrelevant_above) == (3, 2)  # strict '>' (Eq. 1-2)
    assert rows[0].frac_relevant_above == pytest.approx(3 / 4)
    assert rows[0].frac_nonrelevant_above == pytest.approx(2 / 6)
    assert (rows[1].n_relevant_above, rows[1].n_nonrelevant_above) == (2, 0)
    default = threshold_analysis(relevant, nonrelevant)
    assert default[0].threshold == 0.1 and default[-1].threshold == 0.9
    assert all(x.frac_relevant_above >= y.frac_relevant_above for x, y in zip(default, default[1:]))


def _coe_roe_reference(correct, topk, random, psi, m, l, seed):
    qids = sorted(correct)
    rng = np.random.default_rng(seed)
    coe, roe = [], []
    for _ in range(m):
        sample = [qids[i] for i in rng.integers(0, len(qids), size=l)]
        pooled = [s for q in sample for s in topk[q]]
        theta = np.percentile(pooled, psi)
        corr = [s for q in sample for s in np.atleast_1d(correct[q])]
        rand = [s for q in sample for s in np.atleast_1d(random[q])]
        coe.append(np.mean([s > theta for s in corr]))
        roe.append(np.mean([s > theta for s in rand]))
    return np.mean(coe), np.percentile(coe, [2.5, 97.5]), np.mean(roe), np.percentile(roe, [2.5, 97.5])


def test_overlap_coe_roe_matches_reference():
    rng = np.random.default_rng(0)
    n = 40
    correct = {f"q{i}": (float(rng.normal(0.7, 0.1)) if i % 3 else list(rng.normal(0.7, 0.1, size=2)))
               for i in range(n)}
    topk = {f"q{i}": sorted(rng.normal(0.6, 0.1, size=5), reverse=True) for i in range(n)}
    random = {f"q{i}": float(rng.normal(0.2, 0.15)) for i in range(n)}
    result = overlap_coe_roe(correct, topk, random, psi=10, n_samples=100, sample_size=15, seed=4)
    coe, coe_ci, roe, roe_ci = _coe_roe_reference(correct, topk, random, 10, 100, 15, 4)
    assert result.coe == pytest.approx(coe) and result.roe == pytest.approx(roe)
    assert (result.coe_low, result.coe_high) == pytest.approx(tuple(coe_ci))
    assert (result.roe_low, result.roe_high) == pytest.approx(tuple(roe_ci))
    assert result.coe > result.roe


def test_overlap_separated_distributions():
    topk = {f"q{i}": [0.5, 0.4, 0.3] for i in range(10)}
    correct = {f"q{i}": 0.9 for i in range(10)}
    random = {f"q{i}": -0.1 for i in range(10)}
    result = overlap_coe_roe(correct, topk, random, psi=50, n_samples=20)
    assert (result.coe, result.coe_low, result.coe_high) == (1.0, 1.0, 1.0)
    assert (result.roe, result.roe_high) == (0.0, 0.0)
    assert result.theta == pytest.approx(0.4)
    with pytest.raises(ValueError, match="different queries"):
        overlap_coe_roe(correct, topk, {"q0": 0.1}, psi=50)


def _threshold_toy():
    rng = np.random.default_rng(2)
    qrels, run = {}, {}
    for i in range(30):
        scores = rng.uniform(0, 1, size=8)
        run[f"q{i}"] = {f"d{j}": float(s) for j, s in enumerate(scores)}
        qrels[f"q{i}"] = {f"d{int(rng.integers(0, 8))}": 1}
    qrels["q_none"] = {"d0": 0}  # no relevant document: not evaluated
    return qrels, run


def test_bootstrap_thresholds_reference_and_monotone():
    qrels, run = _threshold_toy()
    k, m, l, psis = 3, 200, 20, (0, 25, 50, 100)
    rows = bootstrap_thresholds(run, qrels, k=k, psis=psis, n_samples=m, sample_size=l, seed=9)
    # slow reference
    qids = sorted(q for q in qrels if q != "q_none")
    top = {q: sorted(run[q].items(), key=lambda kv: -kv[1])[:k] for q in qids}
    idx = np.random.default_rng(9).integers(0, len(qids), size=(m, l))
    gamma = [min(top[qids[i]][-1][1] for i in row) for row in idx]
    for row, psi in zip(rows, psis):
        tau = np.percentile(gamma, psi)
        acc = [np.mean([any(qrels[qids[i]].get(d, 0) > 0 and s >= tau for d, s in top[qids[i]]) for i in r])
               for r in idx]
        kept = np.mean([np.mean([sum(s >= tau for _, s in top[qids[i]]) / k for i in r]) for r in idx])
        assert row.tau == pytest.approx(tau)
        assert row.accuracy == pytest.approx(np.mean(acc))
        assert (row.low, row.high) == pytest.approx(tuple(np.percentile(acc, [2.5, 97.5])))
        assert row.kept_fraction == pytest.approx(kept)
    assert rows[0].kept_fraction == 1.0
    # psi = 0 is the unthresholded top-k accuracy: the bootstrap mean of per-query success@k
    _, per_query = evaluate_run({q: qrels[q] for q in qids}, run, metrics=(f"success@{k}",))
    hits = np.array([per_query[q][f"success@{k}"] for q in qids])
    assert rows[0].accuracy == pytest.approx(hits[idx].mean())
    assert all(x.accuracy >= y.accuracy and x.kept_fraction >= y.kept_fraction for x, y in zip(rows, rows[1:]))


# ----------------------------------------------------------------------------------------------------------
# BM25-Easy (001 Table 4)


def test_bm25_easy_split():
    assert bm25_easy_split({"a": 0.9, "b": 0.5, "c": 0.5, "d": 0.1, "e": 0.0}) == {"a", "b", "c"}
    # tie across the boundary: broken by qid
    assert bm25_easy_split({"z": 1.0, "c": 0.5, "b": 0.5, "a": 0.0}) == {"z", "b"}
    assert bm25_easy_split({"only": 0.0}) == {"only"}
    with pytest.raises(ValueError, match="NaN"):
        bm25_easy_split({"a": float("nan"), "b": 1.0})
    with pytest.raises(ValueError):
        bm25_easy_split({})


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text("abc", min_size=1, max_size=4), st.sampled_from([0.0, 0.25, 0.5, 1.0]),
                       min_size=1, max_size=20))
def test_bm25_easy_split_is_top_half(scores):
    easy = bm25_easy_split(scores)
    assert len(easy) == math.ceil(len(scores) / 2)
    hard = set(scores) - easy
    if hard:
        assert min(scores[q] for q in easy) >= max(scores[q] for q in hard)
