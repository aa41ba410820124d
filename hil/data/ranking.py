"""The one ranking rule of the package: trec_eval's, so that a metric at k never depends on how deep a search went.

trec_eval ranks a query's documents by score descending and, among equal scores, by document id *descending*
(``strcmp(b, a)`` in ``form_res_rels.c``; pytrec_eval compiles the same code): it ignores a run's rank column and
re-sorts. Every top-k cut in this package -- BM25, full / exact / re-ranking search, dense score matrices, first
stages taken from run files (:func:`hil.evaluation.runs.ranked`) -- follows the same rule, so a depth-k ranking is
exactly the first k documents of any deeper ranking of the same scores, and metrics at k agree between them.

Ids compare as Python strings (code points), which is the byte order of their UTF-8 encoding: ``strcmp``'s order.

Self-matches (BEIR's rule): where a query is also a corpus document (ArguAna, Quora, CQADupStack), BEIR's exact
search retrieves k + 1 documents and skips the one whose id equals the query id, so that k candidates other than
the query itself are ranked. :func:`top_k_indices` takes that document's row as ``exclude`` and skips it before the
cut, which is the same thing.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def id_rank(doc_ids: Sequence[str]) -> np.ndarray:
    """(n,) int64: the position of each id in ascending id order (0 = smallest), to break score ties by id."""
    rank = np.empty(len(doc_ids), dtype=np.int64)
    rank[np.argsort(np.array(doc_ids, dtype=str), kind="stable")] = np.arange(len(doc_ids))
    return rank


def top_k_indices(scores: np.ndarray, tie_rank: np.ndarray, k: int, exclude: int | None = None) -> np.ndarray:
    """Positions of the ``k`` best entries of ``scores`` in trec_eval's order: score descending, then
    ``tie_rank`` descending (the id order of each entry: :func:`id_rank` of their ids). ``exclude``: a position
    never returned (the query's own document). -> (min(k, n),) int64, best first.

    Everything tied with the k-th score is kept before the id tie-break, so the cut is exact with ties.
    """
    scores = np.asarray(scores)
    positions = np.arange(len(scores), dtype=np.int64)
    if exclude is not None and 0 <= exclude < len(scores):
        positions = np.delete(positions, exclude)
    values = scores[positions]
    if len(values) > k:
        kth = np.partition(values, len(values) - k)[len(values) - k]
        keep = values >= kth
        positions, values = positions[keep], values[keep]
    order = np.lexsort((-np.asarray(tie_rank)[positions], -values))[:k]
    return positions[order]
