"""Confidence intervals and paired significance tests over per-query metrics (004's score-distribution analyses:
``hil.evaluation.score_distributions``).

Sources:

* Paper 004 (Roychowdhury et al., "A Compass for Navigating the World of Sentence Embeddings for the Telecom
  Domain"), Section 2: m bootstrap samples of l questions (drawn with replacement); Section 2.1 bootstrapped
  accuracy and its 95% percentile CI (``bootstrap_ci``); Section 2.2 correct/random overlap ECDFs, COE and ROE,
  Eqs. 1-2 (``overlap_coe_roe``, ``threshold_analysis``); Section 2.3 bootstrapped similarity thresholds
  tau(psi) (``bootstrap_thresholds``).
* Paper 001 (HIL), Table 2's dagger: "p-value < 0.01 in comparison to ColBERT" over per-query nDCG@10 — the
  paper does not name the test; ``paired_t_test`` (the usual choice in IR) plus the distribution-free
  ``paired_permutation_test`` and ``paired_bootstrap_test`` are offered, their sign flips and resamples drawn
  by ``scipy.stats.permutation_test`` and ``scipy.stats.bootstrap``. Table 4's "BM25-Easy" split:
  ``bm25_easy_split``.
* Many comparisons (a table tests ten variants against one baseline): ``adjust_p_values`` gives Holm-Bonferroni
  (Holm 1979, "A simple sequentially rejective multiple test procedure", Scand. J. Statist. 6; controls the
  family-wise error rate; the default) or Benjamini-Hochberg (Benjamini & Hochberg 1995, J. R. Statist. Soc. B 57;
  controls the false discovery rate, by ``scipy.stats.false_discovery_control``) adjusted p-values;
  ``adjust_in_families`` adjusts each family (e.g. every run against one reference on one metric) on its own.

Per-query inputs are ``{qid: value}`` dicts (or 1-D arrays already aligned). Paired tests align two dicts on
their query ids; all random draws come from ``numpy.random.default_rng(seed)`` so results are reproducible.
Percentiles use numpy's default linear interpolation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Literal, Mapping, MutableMapping, Sequence, Union

import numpy as np

PerQuery = Union[Mapping[str, float], Sequence[float], np.ndarray]
Align = Literal["same", "intersection"]
P_ADJUST_METHODS: tuple[str, ...] = ("holm", "bh", "none")
P_ADJUST_NAMES = {"holm": "Holm-Bonferroni (family-wise error rate)",
                  "bh": "Benjamini-Hochberg (false discovery rate)", "none": "none (raw p-values)"}
SIGNIFICANCE_LEVEL = 0.01  # 001 Table 2's dagger: "p-value < 0.01 in comparison to ColBERT"

# Bootstrap index matrices are drawn in chunks of about this many entries, to bound memory (m * l can be 1e8).
_CHUNK_ENTRIES = 1 << 22
EXACT_PERMUTATION_MAX_N = 16


# ----------------------------------------------------------------------------------------------------------
# input handling


def _as_values(per_query: PerQuery, what: str = "per_query") -> np.ndarray:
    """Values as a float array; dicts are read in sorted-qid order so results do not depend on insertion order."""
    if isinstance(per_query, Mapping):
        values = np.asarray([per_query[q] for q in sorted(per_query)], dtype=float)
    else:
        values = np.asarray(per_query, dtype=float)
    if values.ndim != 1:
        raise ValueError(f"{what}: expected a 1-D sequence of per-query values, got shape {values.shape}")
    if values.size == 0:
        raise ValueError(f"{what}: no queries")
    if not np.all(np.isfinite(values)):
        raise ValueError(f"{what}: {int(np.sum(~np.isfinite(values)))} value(s) are NaN or infinite")
    return values


def _align(a: PerQuery, b: PerQuery, on: Align) -> tuple[np.ndarray, np.ndarray]:
    """Two per-query inputs as aligned arrays. Dicts: same query ids required unless ``on="intersection"``."""
    if on not in ("same", "intersection"):
        raise ValueError(f"on must be 'same' or 'intersection', got {on!r}")
    if isinstance(a, Mapping) != isinstance(b, Mapping):
        raise TypeError("a and b must both be {qid: value} dicts or both be aligned arrays")
    if isinstance(a, Mapping):
        keys_a, keys_b = set(map(str, a)), set(map(str, b))
        a = {str(q): v for q, v in a.items()}
        b = {str(q): v for q, v in b.items()}
        if keys_a != keys_b and on == "same":
            only_a, only_b = sorted(keys_a - keys_b), sorted(keys_b - keys_a)
            raise ValueError(f"the two runs cover different queries ({len(only_a)} only in a, e.g. {only_a[:3]}; "
                             f"{len(only_b)} only in b, e.g. {only_b[:3]}); pass on='intersection' to compare "
                             "on the shared ones")
        shared = sorted(keys_a & keys_b)
        if not shared:
            raise ValueError("the two runs share no query")
        return (_as_values({q: a[q] for q in shared}, "a"), _as_values({q: b[q] for q in shared}, "b"))
    va, vb = _as_values(a, "a"), _as_values(b, "b")
    if va.shape != vb.shape:
        raise ValueError(f"a and b have different lengths ({va.size} vs {vb.size})")
    return va, vb


def _bootstrap_indices(rng: np.random.Generator, n: int, n_samples: int, sample_size: int):
    """Yield (start, stop, idx) with idx (stop - start, sample_size) drawn uniformly from range(n)."""
    rows = max(1, _CHUNK_ENTRIES // sample_size)
    for start in range(0, n_samples, rows):
        stop = min(n_samples, start + rows)
        yield start, stop, rng.integers(0, n, size=(stop - start, sample_size))


def _bootstrap_means(values: np.ndarray, n_samples: int, sample_size: int, rng: np.random.Generator) -> np.ndarray:
    means = np.empty(n_samples)  # (m,)
    for start, stop, idx in _bootstrap_indices(rng, values.size, n_samples, sample_size):
        means[start:stop] = values[idx].mean(axis=1)
    return means


def percentile_interval(samples: np.ndarray, confidence: float) -> tuple[float, float]:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(samples, [tail, 100.0 - tail])
    return float(low), float(high)


def check_counts(n_samples: int, sample_size: int | None, n: int) -> int:
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    sample_size = n if sample_size is None else int(sample_size)
    if sample_size < 1:
        raise ValueError(f"sample_size must be >= 1, got {sample_size}")
    return sample_size


# ----------------------------------------------------------------------------------------------------------
# 004 Section 2.1: bootstrapped mean and percentile confidence interval


@dataclass(frozen=True)
class BootstrapResult:
    """``mean`` is 004's bootstrapped mean ``a = (1/m) sum_j a_j``; ``observed`` the plain mean over queries."""

    mean: float
    low: float
    high: float
    std: float  # standard deviation of the m bootstrap means (ddof=1): the bootstrap standard error
    n_samples: int  # m
    sample_size: int  # l
    observed: float
    confidence: float


def bootstrap_ci(per_query: PerQuery, n_samples: int = 1000, sample_size: int | None = None,
                 confidence: float = 0.95, seed: int = 0) -> BootstrapResult:
    """Percentile bootstrap of a mean per-query metric (004 Section 2.1).

    Draw ``m = n_samples`` bootstrap samples ``Q_j`` of ``l = sample_size`` queries with replacement (default
    ``l`` = the number of queries, the classical bootstrap; 004 uses l=100, m=500 on ~1000 test questions),
    compute each sample's mean ``a_j``, and report ``a = (1/m) sum_j a_j`` with the CI given by the
    ``(1-c)/2`` and ``(1+c)/2`` percentiles of the ``a_j`` (2.5th and 97.5th for c=0.95). With ``l`` smaller
    than the number of queries the interval describes a mean over ``l`` queries, so it is wider.
    """
    values = _as_values(per_query)
    sample_size = check_counts(n_samples, sample_size, values.size)
    means = _bootstrap_means(values, n_samples, sample_size, np.random.default_rng(seed))
    low, high = percentile_interval(means, confidence)
    std = float(means.std(ddof=1)) if n_samples > 1 else 0.0
    return BootstrapResult(mean=float(means.mean()), low=low, high=high, std=std, n_samples=n_samples,
                           sample_size=sample_size, observed=float(values.mean()), confidence=confidence)


def stratified_bootstrap_ci(strata: Mapping[str, PerQuery], n_samples: int = 1000, confidence: float = 0.95,
                            seed: int = 0) -> BootstrapResult:
    """Percentile bootstrap of the mean of per-stratum means (BEIR's CQADupStack: the mean of its 12 forums').

    Each of the ``n_samples`` samples redraws every stratum's queries with replacement within that stratum, so every
    stratum keeps its weight 1/S whatever its size (a bootstrap of the pooled queries would let the weights drift).
    Strata are drawn in sorted-name order from one ``numpy.random.default_rng(seed)``; with one stratum this is
    :func:`bootstrap_ci`. ``observed`` is the mean of the stratum means; ``sample_size`` the number of queries.
    """
    if not strata:
        raise ValueError("strata: none given")
    check_counts(n_samples, None, 1)
    rng = np.random.default_rng(seed)
    arrays = [_as_values(strata[name], f"strata[{name!r}]") for name in sorted(strata)]
    means = np.mean([_bootstrap_means(values, n_samples, values.size, rng) for values in arrays], axis=0)  # (m,)
    low, high = percentile_interval(means, confidence)
    std = float(means.std(ddof=1)) if n_samples > 1 else 0.0
    return BootstrapResult(mean=float(means.mean()), low=low, high=high, std=std, n_samples=n_samples,
                           sample_size=sum(values.size for values in arrays),
                           observed=float(np.mean([values.mean() for values in arrays])), confidence=confidence)


# ----------------------------------------------------------------------------------------------------------
# paired significance tests (001 Table 2 dagger)


@dataclass(frozen=True)
class PairedTestResult:
    """``statistic``: t for the t-test, the observed mean difference for the permutation/bootstrap tests."""

    statistic: float
    p_value: float
    mean_diff: float  # mean over queries of a - b
    n: int
    method: str
    ci: tuple[float, float] | None = None  # bootstrap percentile CI of the mean difference (bootstrap test only)


def paired_t_test(a: PerQuery, b: PerQuery, on: Align = "same") -> PairedTestResult:
    """Two-sided paired t-test (``scipy.stats.ttest_rel``) of per-query metrics ``a`` vs ``b``.

    When every difference is exactly 0, scipy returns NaN (0/0); we return statistic 0 and p = 1 instead — the
    runs are indistinguishable. When the differences are a nonzero constant, scipy's t is infinite and p = 0;
    that is passed through.
    """
    from scipy import stats as scipy_stats  # here, not at the top: --help needs no scipy
    va, vb = _align(a, b, on)
    if va.size < 2:
        raise ValueError("a paired t-test needs at least 2 queries")
    diff = va - vb
    if np.all(diff == 0):
        return PairedTestResult(0.0, 1.0, 0.0, int(va.size), "paired_t")
    result = scipy_stats.ttest_rel(va, vb)
    return PairedTestResult(float(result.statistic), float(result.pvalue), float(diff.mean()), int(va.size),
                            "paired_t")


def _absolute_mean(diff: np.ndarray, axis: int = -1) -> np.ndarray:
    """|mean(d)| along ``axis``: the two-sided statistic of the sign-flip test (large when either run is better)."""
    return np.abs(np.mean(diff, axis=axis))


def _mean_difference(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    """mean(a - b) along ``axis``: the statistic of the paired bootstrap."""
    return np.mean(a - b, axis=axis)


def _tie_tolerance(diff: np.ndarray) -> float:
    """Absolute tolerance under which two mean differences count as tied: 1e-12 * max(1, sum |d_i|) / n.

    Means over sign flips or resamples of the same d_i that are equal in exact arithmetic differ by rounding
    of order eps * sum |d_i| / n, whatever the observed mean (scipy's own relative ``100 eps |observed|`` misses
    such ties when the observed mean is ~0).
    """
    return 1e-12 * max(1.0, float(np.abs(diff).sum())) / diff.size


def _upper_tail_p_value(null: np.ndarray, observed: float, tolerance: float, enumerated: bool) -> float:
    """The share of the null distribution at least ``observed`` (ties within ``tolerance`` count).

    Enumerated (the whole null, the observed pattern among it): ``#{T* >= T} / N``. Random resamples:
    ``(1 + #{T* >= T}) / (1 + N)``, counting the observed data as one more resample so that p is never 0
    (Phipson & Smyth 2010, "Permutation p-values should never be zero"; scipy.stats.permutation_test's rule).
    """
    count = int(np.sum(null >= observed - tolerance))
    p_value = count / null.size if enumerated else (1 + count) / (1 + null.size)
    return min(1.0, p_value)


def paired_permutation_test(a: PerQuery, b: PerQuery, n_permutations: int = 10000, seed: int = 0,
                            exact: bool | None = None, on: Align = "same") -> PairedTestResult:
    """Two-sided paired randomization test: flip the sign of each query's difference ``d_i = a_i - b_i``.

    Under H0 (a and b exchangeable per query) each sign is +-1 with probability 1/2. Method:
    ``scipy.stats.permutation_test((d,), |mean|, permutation_type="samples", alternative="greater")`` -- for one
    sample, scipy's "samples" type flips the sign of each observation independently (SciPy reference,
    ``scipy.stats.permutation_test``). The statistic ``|mean(d)|`` makes the test two-sided: p is the share of
    sign patterns whose |mean| is at least the observed |mean|, ties counted within :func:`_tie_tolerance`.

    ``exact=None`` enumerates all ``2^n`` patterns when ``n <= 16`` (p = count / 2^n, the identity included);
    otherwise ``n_permutations`` random patterns from ``numpy.random.default_rng(seed)`` give
    ``p = (1 + count) / (1 + n_permutations)`` (the +1 counts the observed pattern, so p is never 0). scipy
    enumerates whenever ``n_permutations >= 2^n``, so ``exact=False`` with so few queries also gives the exact
    p; ``method`` says which was done. ``statistic`` is the observed (signed) mean difference.
    """
    from scipy import stats as scipy_stats  # here, not at the top: --help needs no scipy
    va, vb = _align(a, b, on)
    diff = va - vb  # (n,)
    n = diff.size
    observed = float(diff.mean())
    if exact is None:
        exact = n <= EXACT_PERMUTATION_MAX_N
    if exact and n > 24:
        raise ValueError(f"exact enumeration of 2^{n} sign patterns is too large; use exact=False")
    if not exact and n_permutations < 1:
        raise ValueError(f"n_permutations must be >= 1, got {n_permutations}")
    n_resamples = 2 ** n if exact else n_permutations
    enumerated = n_resamples >= 2 ** n  # scipy's own rule for an exact test
    method = "paired_permutation_exact" if enumerated else "paired_permutation"
    if n == 1:  # scipy needs two observations; +d and -d have the same |mean|, so p = 2/2
        return PairedTestResult(observed, 1.0, observed, n, method)
    result = scipy_stats.permutation_test(
        (diff,), _absolute_mean, permutation_type="samples", vectorized=True, n_resamples=n_resamples,
        alternative="greater", batch=max(1, _CHUNK_ENTRIES // n), rng=np.random.default_rng(seed))
    p_value = _upper_tail_p_value(result.null_distribution, abs(observed), _tie_tolerance(diff), enumerated)
    return PairedTestResult(observed, p_value, observed, n, method)


def paired_bootstrap_test(a: PerQuery, b: PerQuery, n_samples: int = 10000, seed: int = 0,
                          confidence: float = 0.95, on: Align = "same") -> PairedTestResult:
    """Two-sided paired bootstrap test of the mean difference (Efron & Tibshirani 1993, 16.4; Sakai 2006).

    Resampling: ``scipy.stats.bootstrap((a, b), mean(a - b), paired=True, method="percentile")`` draws
    ``n_samples`` resamples of the queries with replacement (the same query indices for a and b) from
    ``numpy.random.default_rng(seed)`` and gives the percentile CI of the mean difference (SciPy reference,
    ``scipy.stats.bootstrap``). The test: the null distribution is the bootstrap means shifted to mean 0
    (``mean(d*) - mean(d)``), and ``p = (1 + #{|mean(d*) - mean(d)| >= |mean(d)|}) / (1 + n_samples)``, ties
    within :func:`_tie_tolerance`. Identical runs give p = 1.
    """
    from scipy import stats as scipy_stats  # here, not at the top: --help needs no scipy
    va, vb = _align(a, b, on)
    diff = va - vb  # (n,)
    n = diff.size
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    observed = float(diff.mean())
    if n == 1:  # scipy needs two observations; every resample of one query is that query
        means, ci = np.full(n_samples, observed), (observed, observed)
    else:
        result = scipy_stats.bootstrap(
            (va, vb), _mean_difference, paired=True, vectorized=True, n_resamples=n_samples,
            batch=max(1, _CHUNK_ENTRIES // n), confidence_level=confidence, method="percentile",
            rng=np.random.default_rng(seed))
        means = result.bootstrap_distribution  # (B,)
        ci = (float(result.confidence_interval.low), float(result.confidence_interval.high))
    p_value = _upper_tail_p_value(np.abs(means - observed), abs(observed), _tie_tolerance(diff), enumerated=False)
    return PairedTestResult(observed, p_value, observed, n, "paired_bootstrap", ci=ci)


# ----------------------------------------------------------------------------------------------------------
# many comparisons: adjusted p-values


def holm_adjusted(p_values: Sequence[float] | np.ndarray) -> np.ndarray:
    """Holm-Bonferroni adjusted p-values (Holm 1979) of finite p-values in [0, 1], in the input's order.

    With the m p-values sorted ascending, ``p_(1) <= ... <= p_(m)``, the adjusted value of the i-th is
    ``max_{j <= i} min(1, (m - j + 1) p_(j))``: rejecting where it is <= alpha is Holm's step-down procedure at
    family-wise level alpha. Tied p-values get the same adjusted value (the running maximum carries the first
    one's). Same values as ``statsmodels.stats.multitest.multipletests(p, method="holm")[1]``.
    """
    p = np.asarray(p_values, dtype=float)
    m = p.size
    order = np.argsort(p, kind="stable")  # (m,)
    scaled = np.minimum(1.0, (m - np.arange(m)) * p[order])  # (m - j + 1) p_(j) for j = 1..m
    adjusted = np.empty(m)
    adjusted[order] = np.maximum.accumulate(scaled)
    return adjusted


def adjust_p_values(p_values: Sequence[float | None] | np.ndarray, method: str = "holm") -> np.ndarray:
    """Adjusted p-values of one family of comparisons, in the input's order (a float array).

    ``method``: ``"holm"`` (Holm-Bonferroni, :func:`holm_adjusted`; the default), ``"bh"`` (Benjamini-Hochberg,
    ``scipy.stats.false_discovery_control(p, method="bh")``: ``min_{j >= i} min(1, m p_(j) / j)``) or ``"none"``
    (the raw values). A NaN or None (a comparison that could not be tested) stays NaN and is not counted in the
    family size m. Every adjusted value lies in [raw, 1], and the order of the raw values is kept.
    """
    from scipy import stats as scipy_stats  # here, not at the top: --help needs no scipy
    if method not in P_ADJUST_METHODS:
        raise ValueError(f"p-value adjustment must be one of {', '.join(P_ADJUST_METHODS)}, got {method!r}")
    p = np.asarray([np.nan if v is None else v for v in p_values], dtype=float).reshape(-1)
    tested = ~np.isnan(p)
    if np.any((p[tested] < 0) | (p[tested] > 1)):
        raise ValueError(f"p-values must lie in [0, 1], got {p[tested][(p[tested] < 0) | (p[tested] > 1)][:3]}")
    adjusted = p.copy()
    if method == "none" or not tested.any():
        return adjusted
    if method == "holm":
        adjusted[tested] = holm_adjusted(p[tested])
    else:
        adjusted[tested] = scipy_stats.false_discovery_control(p[tested], method="bh")
    return adjusted


def adjust_in_families(p_values: Sequence[float | None], families: Sequence[Hashable],
                       method: str = "holm") -> list[float | None]:
    """:func:`adjust_p_values` within each family: ``families[i]`` names the family of ``p_values[i]``, and the
    values of one family are adjusted together, apart from the others. None or NaN stays None."""
    if len(p_values) != len(families):
        raise ValueError(f"{len(p_values)} p-values but {len(families)} family labels")
    adjusted: list[float | None] = [None] * len(p_values)
    members: dict[Hashable, list[int]] = {}
    for i, family in enumerate(families):
        members.setdefault(family, []).append(i)
    for indices in members.values():
        for i, value in zip(indices, adjust_p_values([p_values[i] for i in indices], method)):
            adjusted[i] = None if math.isnan(value) else float(value)
    return adjusted


def add_adjusted(rows: Sequence[MutableMapping[str, Any]], fields: Sequence[str],
                 family: Callable[[Mapping[str, Any]], Hashable], method: str = "holm") -> None:
    """Write ``row[f"{field}_adjusted"]`` beside each raw p-value ``row[field]``: adjusted (:func:`adjust_in_families`)
    among the rows of the same ``family(row)``, each field on its own (two tests of one comparison are not two
    comparisons). Rows without the field are no part of its families and get nothing."""
    for field in fields:
        tested = [row for row in rows if field in row]
        for row, value in zip(tested, adjust_in_families([row[field] for row in tested],
                                                         [family(row) for row in tested], method)):
            row[f"{field}_adjusted"] = value


# ----------------------------------------------------------------------------------------------------------
# 001 Table 4: BM25-Easy


def bm25_easy_split(bm25_per_query_ndcg: Mapping[str, float]) -> set[str]:
    """The "BM25-Easy" queries of 001 Table 4: the top 50% of queries by BM25's per-query nDCG@10.

    Queries are sorted by ``(-score, qid)`` and the first ``ceil(n / 2)`` are taken: with an odd count the
    middle query is included, and ties at the boundary (common: many queries score exactly 0 or 1) are
    broken by query id (string order), so the split is deterministic and exactly half.
    """
    if not bm25_per_query_ndcg:
        raise ValueError("bm25_per_query_ndcg is empty")
    items = [(str(q), float(v)) for q, v in bm25_per_query_ndcg.items()]
    bad = [q for q, v in items if math.isnan(v)]
    if bad:
        raise ValueError(f"BM25 nDCG@10 is NaN for {len(bad)} queries, e.g. {bad[:3]}")
    items.sort(key=lambda qv: (-qv[1], qv[0]))
    return {q for q, _ in items[: math.ceil(len(items) / 2)]}
