"""Retrieval metrics with pytrec_eval (trec_eval's code), BEIR conventions.

Metric names and the trec_eval measure behind each:

=================  =====================================================================================
``ndcg@k``         ``ndcg_cut.k``: gain = graded relevance (not ``2^rel - 1``; as BEIR), discount
                   ``log2(rank + 1)``, ideal ranking from all judged documents of the query.
``recall@k``       ``recall.k``: relevant documents in the top k / all relevant documents.
``p@k``            ``P.k``.
``success@k``      ``success.k``: 1 if any relevant document is in the top k (the "top-K accuracy" of 004).
``map``            ``map`` (full list); ``map@k`` is ``map_cut.k``.
``mrr@k``          ``recip_rank`` on each query's run truncated to its top k (trec_eval's ``recip_rank`` has
                   no cutoff). Truncation uses trec_eval's own order (score desc, then docid desc), so the
                   truncated list is exactly the first k documents trec_eval would rank.
``mrr``            ``recip_rank`` on the full run.
``ndcg``           ``ndcg`` (no cutoff).
=================  =====================================================================================

Relevance levels: nDCG uses the graded judgments as gains, whatever the level. Every binary metric (recall, P,
success, MAP, MRR) counts a document as relevant when its grade is at least ``relevance_level``: 1 by default
(trec_eval's ``-l 1``, BEIR's convention), 2 for TREC DL, whose guidelines binarize grades 2 and 3 as relevant (as
``trec_eval -l 2`` in the published DL figures). :func:`hil.evaluation.evaluate.score_run` takes it from the dataset
(``BeirDataset.relevance_level``). Judgments of documents no run could retrieve (outside a re-ranking set's corpus)
still count: in the ideal DCG and in the number of relevant documents, as in trec_eval.

Conventions (documented choices):

* Ties in score are broken by document id, descending, as trec_eval does (checked in the tests).
* ``drop_self_matches=True`` removes a document whose id equals the query id from that query's run before
  anything else (BEIR's ``ignore_identical_ids``; ArguAna and Quora queries are also corpus documents).
* A query is *missing* when it is judged in ``qrels`` but the run has no document for it (absent, empty, or
  emptied by self-match dropping). ``missing_queries="zero"`` (default) scores it 0 on every metric, so a
  retriever that returns nothing is penalized; ``"ignore"`` leaves it out of the mean. (BEIR averages over the
  queries present in its results, i.e. ignores absent queries but scores an emptied one 0.)
* Queries in the run but not in ``qrels`` are not evaluated (as trec_eval). Queries whose judgements are all
  ``rel <= 0`` are kept and score 0 (as trec_eval/BEIR). Negative relevance counts as 0 gain.
* The aggregate is the plain mean over the evaluated queries.
"""

from __future__ import annotations

import math
import re
from typing import Iterable, Literal, Mapping

import numpy as np
import pytrec_eval

from hil.errors import UserError
from hil.evaluation.runs import Run, top_k

Qrels = dict[str, dict[str, int]]
DEFAULT_METRICS = ("ndcg@10", "mrr@10", "recall@100", "recall@1000")

# our name -> (trec_eval measure prefix, key prefix in pytrec_eval's output), for metrics with a cutoff.
_CUT_MEASURES = {
    "ndcg": ("ndcg_cut", "ndcg_cut"),
    "recall": ("recall", "recall"),
    "p": ("P", "P"),
    "success": ("success", "success"),
    "map": ("map_cut", "map_cut"),
}
_FULL_MEASURES = {"map": "map", "mrr": "recip_rank", "ndcg": "ndcg"}
_NAME = re.compile(r"^(?P<base>[a-z]+)(?:@(?P<k>\d+))?$")


# ir_measures' spelling (``RR@10``, ``R@100``, ``AP``; ``nDCG@10``, ``P@10`` and ``Success@10`` only differ in case)
IR_MEASURES_NAMES = {"rr": "mrr", "r": "recall", "ap": "map"}


def parse_metric(name: str) -> tuple[str, int | None]:
    """``"nDCG@10"`` -> ``("ndcg", 10)``; ``"map"`` -> ``("map", None)``; ir_measures' names too (``"RR@10"`` ->
    ``("mrr", 10)``, ``"R@100"`` -> ``("recall", 100)``, ``"AP"`` -> ``("map", None)``). Raises ValueError for
    unknown names."""
    match = _NAME.match(name.strip().lower())
    if match is None:
        raise ValueError(f"cannot parse metric name {name!r}; expected e.g. 'ndcg@10', 'mrr@10' (or 'RR@10'), "
                         "'map'")
    base, k = IR_MEASURES_NAMES.get(match["base"], match["base"]), match["k"]
    if k is None:
        if base not in _FULL_MEASURES:
            raise ValueError(f"metric {name!r} needs a cutoff ('{base}@k'); without one: {sorted(_FULL_MEASURES)}")
        return base, None
    if base not in _CUT_MEASURES and base != "mrr":
        raise ValueError(f"unknown metric {name!r}; known: {sorted(set(_CUT_MEASURES) | {'mrr'})} with '@k'")
    if int(k) < 1:
        raise ValueError(f"metric {name!r}: cutoff must be >= 1")
    return base, int(k)


def canonical_metric(name: str) -> str:
    """The package's name of a metric (``"RR@10"`` -> ``"mrr@10"``, ``"nDCG@10"`` -> ``"ndcg@10"``): the key of its
    values in every result. Raises ValueError for unknown names."""
    base, k = parse_metric(name)
    return base if k is None else f"{base}@{k}"


# Measures whose value at a cutoff beyond the run's depth equals their value at the depth (the documents a run
# lacks count as not retrieved, and nothing else depends on the cutoff): recall@1000 of a top-100 run is its
# recall@100. nDCG@k (ideal DCG over k) and P@k (divided by k) still depend on k: they are kept.
DEPTH_BOUND_MEASURES = ("recall", "mrr", "success", "map")


def canonical_metrics(names: Iterable[str], option: str, *, allow_empty: bool = False) -> tuple[str, ...]:
    """A setting's metric names in the package's spelling, each once (:func:`canonical_metric`); a string, an empty
    list (unless ``allow_empty``) or an unknown name is a :class:`~hil.errors.UserError` naming ``option``."""
    if isinstance(names, str) or not (names or allow_empty):
        raise UserError(f"{option}: a list of metric names expected (got {names!r})")
    try:
        return tuple(dict.fromkeys(canonical_metric(name) for name in names))
    except ValueError as err:
        raise UserError(f"{option}: {err}") from None


def measurable_metrics(metrics: Iterable[str], depth: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """-> (the metrics a run of ``depth`` documents per query measures, those it cannot): one of
    :data:`DEPTH_BOUND_MEASURES` with a cutoff above the depth would only repeat its value at the depth under
    another name. A metric without a cutoff is measured on the whole run."""
    kept, dropped = [], []
    for name in metrics:
        base, k = parse_metric(name)
        (dropped if base in DEPTH_BOUND_MEASURES and k is not None and k > depth else kept).append(name)
    return tuple(kept), tuple(dropped)


def _clean_qrels(qrels: Mapping[str, Mapping[str, int]]) -> Qrels:
    clean: Qrels = {}
    for qid, docs in qrels.items():
        row: dict[str, int] = {}
        for docid, rel in docs.items():
            if isinstance(rel, float) and not rel.is_integer():
                raise ValueError(f"qrels: query {qid!r}, document {docid!r}: relevance {rel!r} is not an integer")
            try:
                # A negative grade (Touche's old -2) is sent as 0: every measure used here gives the same figure
                # for both (checked against pytrec_eval where it survives), and pytrec_eval crashes the process
                # (SIGSEGV) on a query judged only negative after another query when it computes two measures.
                row[str(docid)] = max(int(rel), 0)
            except (TypeError, ValueError):
                raise ValueError(f"qrels: query {qid!r}, document {docid!r}: relevance {rel!r} "
                                 "is not an integer") from None
        clean[str(qid)] = row
    return clean


def _clean_run(run: Mapping[str, Mapping[str, float]], judged: Iterable[str], drop_self_matches: bool) -> Run:
    """Only judged queries, string ids, float scores, self matches dropped, empty queries removed."""
    judged = set(judged)
    clean: Run = {}
    for qid, docs in run.items():
        qid = str(qid)
        if qid not in judged:
            continue
        row: dict[str, float] = {}
        for docid, score in docs.items():
            docid = str(docid)
            if drop_self_matches and docid == qid:
                continue
            score = float(score)
            if math.isnan(score):
                raise ValueError(f"run: query {qid!r}, document {docid!r}: score is NaN")
            row[docid] = score
        if row:
            clean[qid] = row
    return clean


def evaluate_run(qrels: Mapping[str, Mapping[str, int]], run: Mapping[str, Mapping[str, float]],
                 metrics: Iterable[str] = DEFAULT_METRICS, drop_self_matches: bool = True,
                 missing_queries: Literal["zero", "ignore"] = "zero", relevance_level: int = 1,
                 ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Evaluate ``run`` against ``qrels`` with pytrec_eval; see the module docstring for names and conventions
    (``relevance_level``: the lowest grade binary metrics count as relevant).

    Returns ``(aggregate, per_query)``: ``aggregate[metric]`` is the mean over evaluated queries (NaN if none),
    ``per_query[qid][metric]`` the per-query values, keyed by :func:`canonical_metric` of the names given.
    """
    if missing_queries not in ("zero", "ignore"):
        raise ValueError(f"missing_queries must be 'zero' or 'ignore', got {missing_queries!r}")
    if isinstance(relevance_level, bool) or not isinstance(relevance_level, int) or relevance_level < 1:
        raise ValueError(f"relevance_level must be an integer >= 1, got {relevance_level!r}")
    names = list(dict.fromkeys(canonical_metric(m) for m in metrics))
    if not names:
        raise ValueError("no metrics requested")
    parsed = {name: parse_metric(name) for name in names}

    qrels = _clean_qrels(qrels)
    run = _clean_run(run, qrels, drop_self_matches)

    # One evaluator for everything trec_eval computes on the full list; one per distinct MRR cutoff, on a
    # truncated run. Each entry: our name -> (which run, pytrec_eval output key).
    full_measures: set[str] = set()
    mrr_cutoffs: set[int] = set()
    plan: dict[str, tuple[int | None, str]] = {}
    for name, (base, k) in parsed.items():
        if base == "mrr" and k is not None:
            mrr_cutoffs.add(k)
            plan[name] = (k, "recip_rank")
        elif k is None:
            full_measures.add(_FULL_MEASURES[base])
            plan[name] = (None, _FULL_MEASURES[base])
        else:
            measure, key = _CUT_MEASURES[base]
            full_measures.add(f"{measure}.{k}")
            plan[name] = (None, f"{key}_{k}")

    def evaluator(measures: set[str]) -> pytrec_eval.RelevanceEvaluator:
        return pytrec_eval.RelevanceEvaluator(qrels, measures, relevance_level=relevance_level)

    raw: dict[int | None, dict[str, dict[str, float]]] = {}
    if run:
        if full_measures:
            raw[None] = evaluator(full_measures).evaluate(run)
        for k in mrr_cutoffs:
            raw[k] = evaluator({"recip_rank"}).evaluate(top_k(run, k))

    per_query: dict[str, dict[str, float]] = {}
    for qid in qrels:
        if qid not in run:
            if missing_queries == "zero":
                per_query[qid] = {name: 0.0 for name in names}
            continue
        per_query[qid] = {name: float(raw[which][qid][key]) for name, (which, key) in plan.items()}

    aggregate = {name: float(np.mean([row[name] for row in per_query.values()])) if per_query else math.nan
                 for name in names}
    return aggregate, per_query

