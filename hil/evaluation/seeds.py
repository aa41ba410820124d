"""Statistics over training seeds: is a method's difference bigger than the noise of one training?

A comparison of two trained models on one set of queries answers "is this model better on these queries"; whether
the *method* helps needs several trainings of each (seeds), because a second seed may flip the sign. With each
method trained under seeds ``s`` and evaluated on the same queries ``q``, ``x[m, s, q]`` a per-query metric:

- **spread** (:func:`seed_spread`): the seed-level scores ``X[m, s] = mean_q x[m, s, q]``, their mean, sample
  standard deviation (``ddof=1``) and range over seeds: the noise of one training.
- **queries** (:func:`seed_comparison`, ``p_t_test_queries``): a paired t-test (``scipy.stats.ttest_rel``) over
  queries of the per-query means over seeds, ``mean_s x[a, s, q]`` against ``mean_s x[b, s, q]``. Averaging over
  seeds first takes the training noise out of each query's value; the test's unit is the query, so it says whether
  the difference would hold on other queries *for these trainings*. It cannot say whether other seeds would agree.
- **seeds** (``p_t_test_seeds``): a one-sample t-test (``scipy.stats.ttest_1samp``) of the seed-level differences
  ``X[a, s] - X[b, s]`` over the seeds both methods were trained with (the same seed gives both the same data order
  and initialisation of shared weights, so the difference is paired by seed). Its unit is the training: it says
  whether the difference exceeds the seed noise. With 3 seeds it has 2 degrees of freedom, so it needs a
  difference about 2.5 standard deviations of the per-seed differences (t > 4.30 at 0.05): little power, on purpose
  no more than three trainings can give.
- **signs**: the sign of every seed's difference.

The verdict (:func:`seed_verdict`) is ``exceeds seed noise`` when every seed agrees in sign with the mean
difference and the seed-level test is significant at :data:`SEED_LEVEL` after the multiple-comparison adjustment
of its family; ``same sign, within seed noise`` when the seeds agree but the test is not significant; ``no
difference`` when every seed's difference is 0; ``seeds disagree`` otherwise.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
from scipy import stats as scipy_stats

from hil.errors import UserError
from hil.evaluation.statistics import adjust_p_values, paired_t_test

PerSeed = Mapping[int, Mapping[str, float]]  # seed -> {qid: value}
SEED_LEVEL = 0.05  # the seed-level test's level: 2 degrees of freedom with 3 seeds make 0.01 (t > 9.92) unreachable
VERDICTS = ("exceeds seed noise", "same sign, within seed noise", "seeds disagree", "no difference")


def seed_spread(values: Mapping[int, float]) -> dict[str, Any]:
    """Mean, sample standard deviation (``ddof=1``; None for one seed), min, max and range of ``{seed: value}``."""
    if not values:
        raise UserError("no seeds to summarize")
    array = np.asarray([values[seed] for seed in sorted(values)], dtype=np.float64)
    return {"n_seeds": len(array), "mean": float(array.mean()),
            "sd": float(array.std(ddof=1)) if len(array) > 1 else None,
            "min": float(array.min()), "max": float(array.max()), "range": float(array.max() - array.min()),
            "per_seed": {str(seed): float(values[seed]) for seed in sorted(values)}}


def common_queries(*per_seed: PerSeed) -> list[str]:
    """The queries every seed of every method was measured on, sorted."""
    sets = [set(per_query) for method in per_seed for per_query in method.values()]
    return sorted(set.intersection(*sets)) if sets else []


def seed_means(per_seed: PerSeed, queries: Sequence[str]) -> dict[str, float]:
    """Each query's value averaged over the seeds: ``{qid: mean_s x[s, q]}``."""
    return {q: float(np.mean([per_seed[seed][q] for seed in sorted(per_seed)])) for q in queries}


def seed_comparison(a: PerSeed, b: PerSeed) -> dict[str, Any]:
    """Method ``a`` against ``b`` over seeds x queries (the module docstring): mean difference, per-seed differences
    and signs (seeds both were trained with), ``p_t_test_queries`` and ``p_t_test_seeds`` (None with fewer than two
    shared seeds). Only the queries every seed of both measured are used (their number is ``n_queries``)."""
    queries = common_queries(a, b)
    if not queries:
        raise UserError("the two methods share no query measured under every seed")
    level = {name: {seed: float(np.mean([per_query[q] for q in queries])) for seed, per_query in per.items()}
             for name, per in (("a", a), ("b", b))}
    shared = sorted(set(a) & set(b))
    differences = {seed: level["a"][seed] - level["b"][seed] for seed in shared}
    mean_difference = float(np.mean(list(level["a"].values())) - np.mean(list(level["b"].values())))
    queries_test = paired_t_test(seed_means(a, queries), seed_means(b, queries))
    p_seeds = None
    if len(shared) >= 2:
        diffs = np.asarray([differences[seed] for seed in shared])
        if np.all(diffs == diffs[0]):  # scipy: NaN for all-zero, t infinite for a nonzero constant
            p_seeds = 1.0 if diffs[0] == 0 else 0.0
        else:
            p_seeds = float(scipy_stats.ttest_1samp(diffs, 0.0).pvalue)
    return {"n_queries": len(queries), "mean_difference": mean_difference,
            "per_seed_difference": {str(seed): differences[seed] for seed in shared},
            "signs": "".join("+" if differences[s] > 0 else "-" if differences[s] < 0 else "0" for s in shared),
            "p_t_test_queries": queries_test.p_value, "p_t_test_seeds": p_seeds}


def seed_verdict(comparison: Mapping[str, Any], level: float = SEED_LEVEL) -> str:
    """One of :data:`VERDICTS` for a comparison whose ``p_t_test_seeds_adjusted`` is set (the module docstring)."""
    sign = np.sign(comparison["mean_difference"])
    signs = comparison["signs"]
    if signs and set(signs) == {"0"}:
        return VERDICTS[3]
    agree = bool(signs) and sign != 0 and all(s == ("+" if sign > 0 else "-") for s in signs)
    if not agree:
        return VERDICTS[2]
    p = comparison.get("p_t_test_seeds_adjusted")
    return VERDICTS[0] if p is not None and p < level else VERDICTS[1]


def seed_table(methods: Mapping[str, PerSeed], reference: str, p_adjust: str = "holm") -> dict[str, Any]:
    """Every method's spread, and every other method against ``reference``: both tests' p-values adjusted within
    the family "every method against the reference" (each test apart), and the verdict.

    ``methods``: method -> seed -> ``{qid: value}`` of one metric on one dataset."""
    if reference not in methods:
        raise UserError(f"reference method {reference!r} is not among {sorted(methods)}")
    queries = common_queries(*methods.values())
    spreads = {name: seed_spread({seed: float(np.mean([pq[q] for q in queries])) for seed, pq in per.items()})
               for name, per in methods.items()}
    comparisons = {name: seed_comparison(per, methods[reference]) for name, per in methods.items()
                   if name != reference}
    for test in ("p_t_test_queries", "p_t_test_seeds"):
        names = list(comparisons)
        adjusted = adjust_p_values([comparisons[n][test] for n in names], p_adjust)
        for name, value in zip(names, adjusted):
            comparisons[name][f"{test}_adjusted"] = None if comparisons[name][test] is None else float(value)
    for comparison in comparisons.values():
        comparison["verdict"] = seed_verdict(comparison)
    return {"reference": reference, "n_queries": len(queries), "p_adjust": p_adjust, "seed_level": SEED_LEVEL,
            "spread": spreads, "comparisons": comparisons}
