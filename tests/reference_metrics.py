"""Slow, obvious per-query retrieval metrics: the references the pytrec_eval-based metrics are tested against.

Each takes one query's judgements ``{docid: rel}`` and its ranking (document ids already in rank order).
"""

from __future__ import annotations

import math
from typing import Mapping


def ndcg_at_k_reference(qrels_for_query: Mapping[str, int], ranked_doc_ids: list[str], k: int) -> float:
    """trec_eval's ``ndcg_cut.k`` for one query, written the slow obvious way.

    ``DCG@k = sum_{i=1..k} gain(d_i) / log2(i + 1)`` with ``gain = max(rel, 0)`` (unjudged = 0);
    ``IDCG@k`` is the same sum over the judged gains sorted descending; nDCG = DCG / IDCG, 0 if IDCG is 0.
    """
    gains = [max(int(qrels_for_query.get(doc, 0)), 0) for doc in ranked_doc_ids[:k]]
    dcg = sum(g / math.log2(i + 2) for i, g in enumerate(gains))
    ideal = sorted((max(int(r), 0) for r in qrels_for_query.values()), reverse=True)[:k]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


def mrr_at_k_reference(qrels_for_query: Mapping[str, int], ranked_doc_ids: list[str], k: int) -> float:
    """1 / rank of the first document with rel > 0 among the first ``k``; 0 if there is none."""
    for i, doc in enumerate(ranked_doc_ids[:k]):
        if qrels_for_query.get(doc, 0) > 0:
            return 1.0 / (i + 1)
    return 0.0


def recall_at_k_reference(qrels_for_query: Mapping[str, int], ranked_doc_ids: list[str], k: int) -> float:
    """|relevant in the first ``k``| / |relevant|, relevant meaning rel > 0; 0 if nothing is relevant."""
    relevant = {doc for doc, rel in qrels_for_query.items() if rel > 0}
    if not relevant:
        return 0.0
    return len(relevant.intersection(ranked_doc_ids[:k])) / len(relevant)
