"""Score sets for 004's distribution analyses: correct, top-K and random (query, document) similarities.

004 Section 2.2 compares, per query, the similarity with its correct document (S_corr), with its top-K retrieved
documents (S_topK) and with a random document (S_rand); ``hil.evaluation.statistics`` turns them into threshold
tables, COE / ROE (Eqs. 1-2) and bootstrapped thresholds (Section 2.3). Here the "similarity" is the model's own
relevance score (``encoder.score`` on the index's stored vectors: for ColBERT a sum of MaxSim cosines over the
query tokens, not a single cosine), the number the ranking uses.

Choices: every relevant document (rel > 0) of a query that is in the index counts as correct; the random
document is drawn uniformly (seeded) among the query's non-relevant documents, one per query; S_topK comes from
the run (the same scores).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from hil.evaluation.runs import ranked
from hil.modeling.contracts import Encoder
from hil.retrieval.encoding import eval_mode
from hil.retrieval.search import score_documents
from hil.retrieval.store import TokenStore


def similarity_sets(encoder: Encoder, store: TokenStore, queries: Mapping[str, str],
                    qrels: Mapping[str, Mapping[str, int]], run: Mapping[str, Mapping[str, float]], *, k: int = 5,
                    seed: int = 0, batch_size: int = 32
                    ) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[float]]]:
    """-> (correct, topk, random): ``{qid: [scores]}`` for the queries with a relevant document in ``store`` and
    a non-empty run."""
    rng = np.random.default_rng(seed)
    qids = [q for q in sorted(queries) if run.get(q)
            and any(int(r) > 0 and d in store.doc_index for d, r in qrels.get(q, {}).items())]
    correct: dict[str, list[float]] = {}
    topk: dict[str, list[float]] = {}
    random: dict[str, list[float]] = {}
    with eval_mode(encoder):
        for start in range(0, len(qids), batch_size):
            batch_qids = qids[start: start + batch_size]
            encoded = encoder.encode_queries([queries[q] for q in batch_qids])
            for row, qid in enumerate(batch_qids):
                relevant = sorted(store.doc_index[d] for d, r in qrels[qid].items()
                                  if int(r) > 0 and d in store.doc_index)
                judged = set(relevant)
                other = int(rng.integers(store.n_docs))
                while other in judged and len(judged) < store.n_docs:
                    other = int(rng.integers(store.n_docs))
                docs = np.array(relevant + [other], dtype=np.int64)
                scores = score_documents(encoder, encoded.select(slice(row, row + 1)), store, docs)[0]
                correct[qid] = [float(s) for s in scores[:-1]]
                random[qid] = [float(scores[-1])]
                topk[qid] = [float(s) for _, s in ranked(run[qid], k)]
    return correct, topk, random
