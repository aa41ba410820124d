"""Score-distribution analyses of paper 004 (Roychowdhury et al., "A Compass for Navigating the World of Sentence
Embeddings for the Telecom Domain"), Section 2, over a retriever's relevance scores.

Section 2.2: the overlap of the correct and random score distributions (ECDFs), COE and ROE, Eqs. 1-2
(``overlap_coe_roe``, ``threshold_analysis``); Section 2.3: bootstrapped similarity thresholds tau(psi) and their
top-K accuracy (``bootstrap_thresholds``). Bootstrap samples are m draws of l questions with replacement, seeded
(``numpy.random.default_rng(seed)``); intervals are percentile intervals (``hil.evaluation.statistics``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence, Union

import numpy as np

from hil.evaluation.runs import ranked
from hil.evaluation.statistics import Align, check_counts, percentile_interval

# ----------------------------------------------------------------------------------------------------------
# 004 Section 2.2: distribution overlap (Eqs. 1-2, COE / ROE)

ScoreSets = Union[Mapping[str, Union[float, Sequence[float]]], Sequence[float], np.ndarray]


def _flatten_scores(scores: ScoreSets, what: str) -> np.ndarray:
    if isinstance(scores, Mapping):
        parts = [np.atleast_1d(np.asarray(scores[q], dtype=float)).ravel() for q in sorted(scores)]
        flat = np.concatenate(parts) if parts else np.empty(0)
    else:
        flat = np.asarray(scores, dtype=float).ravel()
    if flat.size == 0:
        raise ValueError(f"{what}: no scores")
    if np.any(np.isnan(flat)):
        raise ValueError(f"{what}: contains NaN")
    return flat


@dataclass(frozen=True)
class ThresholdRow:
    threshold: float
    frac_relevant_above: float  # P(sim_corr > threshold), 004 Eq. 1
    frac_nonrelevant_above: float  # P(sim_rand > threshold), 004 Eq. 2
    n_relevant_above: int
    n_nonrelevant_above: int


def threshold_analysis(scores_relevant: ScoreSets, scores_nonrelevant: ScoreSets,
                       thresholds: Sequence[float] | None = None) -> list[ThresholdRow]:
    """For each threshold, the share of correct and of incorrect (query, document) pairs scoring above it.

    These are 004's Eqs. 1-2 evaluated at given thresholds: ``C_corr(theta) = P(sim_corr > theta)`` and
    ``C_rand(theta) = P(sim_rand > theta)`` (strictly greater, as in the paper). A useful threshold keeps
    most correct pairs and drops most incorrect ones. Inputs are flat score arrays or ``{qid: score(s)}``.
    ``thresholds=None`` uses the 0th, 5th, ..., 100th percentiles of all scores pooled (our choice; the paper
    derives thresholds from bootstrapped top-K minima, see ``bootstrap_thresholds``). Rows in ascending order.
    """
    relevant = _flatten_scores(scores_relevant, "scores_relevant")
    nonrelevant = _flatten_scores(scores_nonrelevant, "scores_nonrelevant")
    if thresholds is None:
        thresholds = np.unique(np.percentile(np.concatenate([relevant, nonrelevant]), np.arange(0, 101, 5)))
    rows = []
    for theta in sorted(float(t) for t in thresholds):
        n_rel = int(np.sum(relevant > theta))
        n_non = int(np.sum(nonrelevant > theta))
        rows.append(ThresholdRow(theta, n_rel / relevant.size, n_non / nonrelevant.size, n_rel, n_non))
    return rows


def _ragged(scores: Mapping[str, float | Sequence[float]], qids: list[str], what: str) -> np.ndarray:
    """Per-query score lists as a (n_queries, max_len) array padded with NaN."""
    rows = [np.atleast_1d(np.asarray(scores[q], dtype=float)).ravel() for q in qids]
    for q, row in zip(qids, rows):
        if row.size == 0:
            raise ValueError(f"{what}: query {q!r} has no score")
        if np.any(np.isnan(row)):
            raise ValueError(f"{what}: query {q!r} has a NaN score")
    out = np.full((len(rows), max(r.size for r in rows)), np.nan)
    for i, row in enumerate(rows):
        out[i, :row.size] = row
    return out


@dataclass(frozen=True)
class OverlapResult:
    """COE / ROE as fractions in [0, 1] (004 reports percent), with percentile CIs over the m samples."""

    coe: float
    coe_low: float
    coe_high: float
    roe: float
    roe_low: float
    roe_high: float
    theta: float  # mean over samples of theta_j
    psi: float  # percentile (0-100) of the pooled top-K similarities that defines theta_j
    n_samples: int
    sample_size: int


def overlap_coe_roe(correct: Mapping[str, float | Sequence[float]], topk: Mapping[str, Sequence[float]],
                    random: Mapping[str, float | Sequence[float]], *, psi: float, n_samples: int = 500,
                    sample_size: int | None = None, confidence: float = 0.95, seed: int = 0,
                    on: Align = "same") -> OverlapResult:
    """Correct-overlap and random-overlap ECDF estimates, COE and ROE (004 Section 2.2, Eqs. 1-2).

    Per query q: ``correct[q]`` = similarity of q with its correct document(s) (S_corr), ``topk[q]`` = the
    similarities of its top-K retrieved documents (S_topK), ``random[q]`` = similarity with a randomly chosen
    document (S_rand). For each bootstrap sample ``Q_j`` (``l`` queries with replacement):
    ``theta_j`` = the psi-th percentile of the pooled top-K similarities of ``Q_j``;
    ``C_corr(theta_j) = P(sim_corr > theta_j)`` and ``C_rand(theta_j) = P(sim_rand > theta_j)`` over the
    sample's correct / random similarities. COE and ROE are the means over the m samples, CIs the
    ``(1-c)/2``, ``(1+c)/2`` percentiles.

    Choices where 004 is silent: the three sets are all restricted to the bootstrap sample (otherwise theta_j
    or the ECDFs would not vary with j and the paper's CIs would be degenerate); a query with several correct
    documents (BEIR) contributes all of their similarities; ``psi`` has no default because the paper does not
    state the value it used.
    """
    if not 0.0 <= psi <= 100.0:
        raise ValueError(f"psi is a percentile in [0, 100], got {psi}")
    key_sets = [set(map(str, d)) for d in (correct, topk, random)]
    if on == "same" and not key_sets[0] == key_sets[1] == key_sets[2]:
        raise ValueError("correct, topk and random cover different queries; pass on='intersection'")
    qids = sorted(key_sets[0] & key_sets[1] & key_sets[2])
    if not qids:
        raise ValueError("no query has correct, top-K and random similarities")
    as_str = lambda d: {str(q): v for q, v in d.items()}  # noqa: E731
    corr = _ragged(as_str(correct), qids, "correct")  # (n, Rc)
    top = _ragged(as_str(topk), qids, "topk")  # (n, K)
    rand = _ragged(as_str(random), qids, "random")  # (n, Rr)
    sample_size = check_counts(n_samples, sample_size, len(qids))

    rng = np.random.default_rng(seed)
    coe, roe, thetas = np.empty(n_samples), np.empty(n_samples), np.empty(n_samples)
    for j in range(n_samples):
        idx = rng.integers(0, len(qids), size=sample_size)  # Q_j
        pooled_top = top[idx].ravel()
        theta = np.percentile(pooled_top[~np.isnan(pooled_top)], psi)
        sample_corr, sample_rand = corr[idx].ravel(), rand[idx].ravel()
        sample_corr, sample_rand = sample_corr[~np.isnan(sample_corr)], sample_rand[~np.isnan(sample_rand)]
        thetas[j] = theta
        coe[j] = np.mean(sample_corr > theta)
        roe[j] = np.mean(sample_rand > theta)
    coe_low, coe_high = percentile_interval(coe, confidence)
    roe_low, roe_high = percentile_interval(roe, confidence)
    return OverlapResult(float(coe.mean()), coe_low, coe_high, float(roe.mean()), roe_low, roe_high,
                         float(thetas.mean()), float(psi), n_samples, sample_size)


# ----------------------------------------------------------------------------------------------------------
# 004 Section 2.3: bootstrapped similarity thresholds


@dataclass(frozen=True)
class ThresholdAccuracyRow:
    psi: float  # percentile (0-100) of Gamma
    tau: float  # tau(psi)
    accuracy: float  # mean bootstrapped top-K accuracy with scores below tau removed
    low: float
    high: float
    kept_fraction: float  # mean share of the top-K results scoring >= tau


def bootstrap_thresholds(run: Mapping[str, Mapping[str, float]], qrels: Mapping[str, Mapping[str, int]], *,
                         k: int = 5, psis: Sequence[float] = tuple(range(0, 55, 5)), n_samples: int = 500,
                         sample_size: int | None = None, confidence: float = 0.95, seed: int = 0,
                         drop_self_matches: bool = True) -> list[ThresholdAccuracyRow]:
    """004 Section 2.3: thresholds tau(psi) from bootstrapped minima of top-K similarities, and their effect.

    For each bootstrap sample ``Q_j``, ``gamma_j`` = the smallest top-K similarity over all of its queries;
    ``Gamma = {gamma_j}``; ``tau(psi)`` = the psi-th percentile of Gamma. With similarities below tau removed
    (the paper "sets them to zero"; we read that as dropping them from the results), a query counts as
    answered when a relevant document (rel > 0) is in its top K *and* scores >= tau. Accuracy per sample is
    the share of answered queries; rows give its mean and percentile CI over the same m samples for every
    psi, plus the share of top-K results kept. psi = 0 keeps every result (tau = min Gamma), so its row is
    the unthresholded top-K accuracy. Which row to report is the caller's trade-off (the paper reports the
    best accuracy with its tau and psi).

    Evaluated queries: those in ``qrels`` with at least one relevant document; one absent from the run is
    never answered and does not enter Gamma.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    qids = sorted(str(q) for q, docs in qrels.items() if any(int(r) > 0 for r in docs.values()))
    if not qids:
        raise ValueError("qrels has no query with a relevant document")
    run = {str(q): docs for q, docs in run.items()}
    top_scores = np.full((len(qids), k), -np.inf)  # (n, K)
    retrieved = np.zeros((len(qids), k), dtype=bool)  # (n, K) False where a query has fewer than K results
    best_relevant = np.full(len(qids), -np.inf)  # (n,) best score of a relevant doc inside the top K
    has_relevant = np.zeros(len(qids), dtype=bool)  # (n,)
    for i, qid in enumerate(qids):
        docs = {str(d): s for d, s in run.get(qid, {}).items() if not (drop_self_matches and str(d) == qid)}
        relevant = {str(d) for d, r in qrels[qid].items() if int(r) > 0}
        for rank, (docid, score) in enumerate(ranked(docs, k)):
            top_scores[i, rank] = score
            retrieved[i, rank] = True
            if docid in relevant:
                has_relevant[i] = True
                best_relevant[i] = max(best_relevant[i], score)
    query_min = np.where(retrieved, top_scores, np.inf).min(axis=1)  # (n,) inf for queries with no result
    sample_size = check_counts(n_samples, sample_size, len(qids))

    idx = np.random.default_rng(seed).integers(0, len(qids), size=(n_samples, sample_size))  # (m, l)
    gamma = query_min[idx].min(axis=1)  # (m,)
    gamma = gamma[np.isfinite(gamma)]
    if gamma.size == 0:
        raise ValueError("the run retrieves nothing for the evaluated queries")
    rows = []
    for psi in psis:
        if not 0.0 <= psi <= 100.0:
            raise ValueError(f"psi is a percentile in [0, 100], got {psi}")
        tau = float(np.percentile(gamma, psi))
        answered = has_relevant & (best_relevant >= tau)  # (n,)
        kept = (retrieved & (top_scores >= tau)).sum(axis=1) / k  # (n,)
        accuracy = answered[idx].mean(axis=1)  # (m,)
        low, high = percentile_interval(accuracy, confidence)
        rows.append(ThresholdAccuracyRow(float(psi), tau, float(accuracy.mean()), low, high,
                                         float(kept[idx].mean())))
    return rows
