"""BM25 over a corpus with ``bm25s``: the lexical baseline and the source of hard negatives for training triples.

The variant, stated because BM25 numbers differ by variant (docs/design.md: "state the BM25 variant you compare
against"):

* Lucene BM25 (``bm25s`` ``method="lucene"``): ``idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5))`` and
  ``score(q, d) = sum_{t in q} idf(t) * tf / (tf + k1 * (1 - b + b * |d| / avgdl))``, summed over query tokens with
  repetition (as Lucene's boolean query does).
* ``k1 = 0.9, b = 0.4``: Pyserini's defaults (BEIR "flat" baselines), not bm25s's own ``k1=1.5, b=0.75``.
* Tokens: lower-cased, ``\\b\\w\\w+\\b`` (words of two or more characters), bm25s's English stopwords removed (the
  33 words of Lucene's ``EnglishAnalyzer`` set, as Pyserini), Snowball English ("Porter2") stemming from PyStemmer
  where Pyserini uses Lucene's Porter stemmer. Query tokens absent from the corpus vocabulary are dropped.
* Only documents sharing at least one token with the query are returned (score > 0), like Lucene; a query that
  tokenizes to nothing (stopwords, punctuation) returns no documents. Ties are broken by document id, descending,
  as trec_eval ranks them (:mod:`hil.data.ranking`), so BM25's top k is the first k of any deeper BM25 ranking.
* ``skip_self`` (BEIR's rule for ArguAna, Quora, CQADupStack: it retrieves k + 1 and skips the hit whose id is the
  query's): the query's own document is skipped before the cut, so k other documents are ranked.

On SciFact test this gives nDCG@10 = 0.676 (BEIR paper / Pyserini flat: 0.665-0.679; bm25s defaults give 0.686).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from hil.data.beir import BeirDataset
from hil.data.ranking import id_rank, top_k_indices

PYSERINI_K1 = 0.9
PYSERINI_B = 0.4


def _tokenize(texts: Sequence[str], stemmer: Any, stopwords: str | list[str]) -> list[list[str]]:
    import bm25s  # imported here: only BM25 users pay for it

    tokens = bm25s.tokenize(list(texts), lower=True, stopwords=stopwords, stemmer=stemmer, return_ids=False,
                            show_progress=False)
    return [[token for token in text if token] for text in tokens]


def _top_k(scores: np.ndarray, k: int, tie_rank: np.ndarray, exclude: int | None = None) -> np.ndarray:
    """Indices of the ``k`` highest positive scores, in trec_eval's order (ties by document id, descending)."""
    positive = np.flatnonzero(scores > 0)
    skip = None
    if exclude is not None:
        found = np.flatnonzero(positive == exclude)
        skip = int(found[0]) if len(found) else None
    return positive[top_k_indices(scores[positive], tie_rank[positive], k, exclude=skip)]


class BM25Index:
    """A BM25 index over ``doc_ids``; :meth:`search` maps query texts to ranked ``(doc_id, score)`` lists."""

    def __init__(self, doc_ids: list[str], retriever: Any, stemmer: Any, stopwords: str | list[str],
                 settings: dict[str, Any]) -> None:
        self.doc_ids = doc_ids
        self._retriever = retriever  # None when no document has a single token
        self._stemmer = stemmer
        self._stopwords = stopwords  # the same tokenization for queries as for documents
        self._settings = settings
        self._id_rank = id_rank(doc_ids)
        self._row = {doc_id: row for row, doc_id in enumerate(doc_ids)}

    @classmethod
    def build(cls, doc_ids: Sequence[str], texts: Sequence[str], k1: float = PYSERINI_K1, b: float = PYSERINI_B,
              method: str = "lucene", language: str = "english", stopwords: str | list[str] = "en") -> "BM25Index":
        """Tokenize ``texts`` once and index them; ``doc_ids[i]`` names ``texts[i]``."""
        import bm25s
        import Stemmer

        doc_ids = [str(doc_id) for doc_id in doc_ids]
        if len(doc_ids) != len(texts):
            raise ValueError(f"{len(doc_ids)} document ids but {len(texts)} texts")
        if not doc_ids:
            raise ValueError("cannot build a BM25 index over an empty corpus")
        if len(set(doc_ids)) != len(doc_ids):
            raise ValueError("document ids must be unique")
        stemmer = Stemmer.Stemmer(language) if language else None
        corpus_tokens = _tokenize(texts, stemmer, stopwords)
        retriever = None
        if any(corpus_tokens):  # bm25s cannot index a corpus without a single token
            retriever = bm25s.BM25(k1=k1, b=b, method=method)
            retriever.index(corpus_tokens, show_progress=False)
        settings = {"library": "bm25s", "method": method, "k1": k1, "b": b, "stemmer": language or None,
                    "stopwords": stopwords if isinstance(stopwords, str) else "custom", "num_docs": len(doc_ids)}
        return cls(doc_ids, retriever, stemmer, stopwords, settings)

    @classmethod
    def from_dataset(cls, dataset: BeirDataset, **kwargs: Any) -> "BM25Index":
        """An index over ``dataset.documents()`` (title + text), keyed by ``dataset.doc_ids()``."""
        return cls.build(dataset.doc_ids(), dataset.documents(), **kwargs)

    def settings(self) -> dict[str, Any]:
        return dict(self._settings)

    def search(self, queries: Sequence[str], k: int,
               query_ids: Sequence[str] | None = None) -> list[list[tuple[str, float]]]:
        """For each query, up to ``k`` ``(doc_id, score)`` pairs with score > 0, best first; with ``query_ids``,
        the document whose id is the query's is skipped (module docstring)."""
        if query_ids is not None and len(query_ids) != len(queries):
            raise ValueError(f"{len(query_ids)} query ids for {len(queries)} queries")
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        results: list[list[tuple[str, float]]] = [[] for _ in queries]
        if self._retriever is None or k == 0 or not queries:
            return results
        vocabulary = self._retriever.vocab_dict
        query_tokens = _tokenize(queries, self._stemmer, self._stopwords)
        for position, tokens in enumerate(query_tokens):
            token_ids = [vocabulary[token] for token in tokens if token in vocabulary]
            if not token_ids:
                continue
            scores = self._retriever.get_scores_from_ids(token_ids)  # (num_docs,)
            own = self._row.get(str(query_ids[position])) if query_ids is not None else None
            ranked = _top_k(np.asarray(scores), k, self._id_rank, exclude=own)
            results[position] = [(self.doc_ids[index], float(scores[index])) for index in ranked]
        return results


def bm25_run(dataset: BeirDataset, k: int = 1000, index: BM25Index | None = None, skip_self: bool = False,
             **kwargs: Any) -> dict[str, dict[str, float]]:
    """A BEIR-shaped run ``{query_id: {doc_id: score}}`` for every query of ``dataset`` (``{}`` when nothing
    matches); ``skip_self``: k documents other than the query's own (module docstring)."""
    index = index if index is not None else BM25Index.from_dataset(dataset, **kwargs)
    query_ids = dataset.query_ids()
    ranked = index.search([dataset.queries[query_id] for query_id in query_ids], k,
                          query_ids=query_ids if skip_self else None)
    return {query_id: dict(hits) for query_id, hits in zip(query_ids, ranked)}
