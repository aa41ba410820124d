"""BM25 (bm25s, Lucene variant, Pyserini k1/b): scores against a slow formula, edge cases, SciFact nDCG@10."""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hil.data.beir import BeirDataset, load_beir
from hil.data.bm25 import BM25Index, _tokenize, bm25_run

SHARED = Path(os.environ.get("HIL_SHARED_DIR", Path(__file__).resolve().parents[1].parent / "shared"))
WORDS = ["cat", "cats", "dog", "running", "runs", "fish", "bird", "green", "blue", "house", "the", "and", "of"]


def reference_bm25(corpus_tokens: list[list[str]], query_tokens: list[str], k1: float, b: float) -> dict[int, float]:
    """Lucene BM25 written the obvious way: idf = ln(1 + (N - df + .5)/(df + .5)), tf saturation, length norm."""
    n_docs = len(corpus_tokens)
    avgdl = sum(len(tokens) for tokens in corpus_tokens) / n_docs
    df = Counter(token for tokens in corpus_tokens for token in set(tokens))
    scores = {}
    for index, tokens in enumerate(corpus_tokens):
        tf = Counter(tokens)
        score = 0.0
        for token in query_tokens:  # repeated query tokens count again, as in Lucene
            if tf[token]:
                idf = math.log(1 + (n_docs - df[token] + 0.5) / (df[token] + 0.5))
                score += idf * tf[token] / (tf[token] + k1 * (1 - b + b * len(tokens) / avgdl))
        if score > 0:
            scores[index] = score
    return scores


sentences = st.lists(st.sampled_from(WORDS + ["!", "a", "I"]), max_size=12).map(" ".join)


@settings(max_examples=40, deadline=None)
@given(st.lists(sentences, min_size=1, max_size=12), st.lists(sentences, min_size=1, max_size=4),
       st.sampled_from([(0.9, 0.4), (1.5, 0.75)]))
def test_scores_match_the_formula(texts, queries, k1_b):
    k1, b = k1_b
    index = BM25Index.build([f"d{i}" for i in range(len(texts))], texts, k1=k1, b=b)
    corpus_tokens = _tokenize(texts, index._stemmer, "en")
    vocabulary = {token for tokens in corpus_tokens for token in tokens}
    results = index.search(queries, k=len(texts))
    for query, got in zip(queries, results):
        query_tokens = [token for token in _tokenize([query], index._stemmer, "en")[0] if token in vocabulary]
        expected = reference_bm25(corpus_tokens, query_tokens, k1, b) if any(corpus_tokens) else {}
        assert {doc_id: score for doc_id, score in got} == pytest.approx(
            {f"d{i}": score for i, score in expected.items()}, rel=1e-5)
        # Best first, ties by document id descending (trec_eval's order).
        keys = [(score, doc_id) for doc_id, score in got]
        assert keys == sorted(keys, reverse=True)


def test_top_k_cut_and_tie_order():
    index = BM25Index.build(["a", "b", "c", "d"], ["cat", "dog", "cat", "cat fish fish"])
    hits = index.search(["cat"], k=2)[0]
    assert [doc_id for doc_id, _ in hits] == ["c", "a"]  # a and c tie above the longer d; c first (id descending)
    assert hits[0][1] == hits[1][1]
    assert [doc_id for doc_id, _ in index.search(["cat"], k=10)[0]] == ["c", "a", "d"]
    # the query's own document is skipped before the cut (BEIR's k + 1 rule): k others are ranked
    assert [doc_id for doc_id, _ in index.search(["cat"], k=2, query_ids=["c"])[0]] == ["a", "d"]
    assert index.search(["cat"], k=0) == [[]]
    with pytest.raises(ValueError):
        index.search(["cat"], k=-1)


def test_stemming_and_stopwords():
    index = BM25Index.build(["a", "b"], ["The cats were running", "a dog"])
    assert [doc_id for doc_id, _ in index.search(["cat run"], 5)[0]] == ["a"]  # stemmed: cats->cat, running->run
    assert index.search(["the of and", "", "!!! ?", "zebra"], 5) == [[], [], [], []]
    assert index.search([], 5) == []


def test_empty_documents_and_an_all_empty_corpus():
    index = BM25Index.build(["a", "b", "c"], ["", "cat", "   "])
    assert [doc_id for doc_id, _ in index.search(["cat"], 5)[0]] == ["b"]
    nothing = BM25Index.build(["a", "b"], ["", "the of"])
    assert nothing.search(["cat", "the"], 5) == [[], []]


def test_bad_construction():
    with pytest.raises(ValueError, match="unique"):
        BM25Index.build(["a", "a"], ["x", "y"])
    with pytest.raises(ValueError, match="2 document ids but 1 texts"):
        BM25Index.build(["a", "b"], ["x"])
    with pytest.raises(ValueError, match="empty corpus"):
        BM25Index.build([], [])


def test_bm25_run_shape_and_settings():
    data = BeirDataset("toy", {"d1": {"title": "Cats", "text": "purr"}, "d2": {"title": "", "text": "dogs bark"}},
                       {"q1": "cat", "q2": "the"}, {"q1": {"d1": 1}, "q2": {"d2": 1}}, "test", "memory")
    run = bm25_run(data, k=10)
    assert set(run) == {"q1", "q2"} and list(run["q1"]) == ["d1"] and run["q2"] == {}
    settings_ = BM25Index.from_dataset(data).settings()
    assert (settings_["method"], settings_["k1"], settings_["b"],
            settings_["stemmer"]) == ("lucene", 0.9, 0.4, "english")


@pytest.mark.integration
def test_scifact_ndcg_at_10():
    import numpy as np
    import pytrec_eval

    folder = SHARED / "data" / "beir" / "scifact"
    if not folder.is_dir():
        pytest.skip(f"no SciFact at {folder}")
    data = load_beir(folder)
    run = bm25_run(data, k=100)
    per_query = pytrec_eval.RelevanceEvaluator(data.qrels, {"ndcg_cut.10"}).evaluate(run)
    assert len(per_query) == 300
    ndcg = float(np.mean([scores["ndcg_cut_10"] for scores in per_query.values()]))
    # Pyserini flat BM25 (k1=0.9, b=0.4) reports 0.679, the BEIR paper 0.665; bm25s with this setting gives 0.676.
    assert 0.65 < ndcg < 0.70, ndcg
