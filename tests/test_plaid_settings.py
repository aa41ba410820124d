"""PLAID's search-time settings with ``ndocs`` != ``stage2_docs`` (issue 24): every other test uses equal values, so
a search that read one for the other (e.g. stage 2 keeping ``ndocs`` documents, or ``plaid_candidates``' own
default of ``4 * ndocs``) would pass them. Here the candidates of every search path are compared with
:func:`hil.retrieval.plaid.plaid_candidates` called explicitly with the intended values, per head, and the values
the search records (``search_stats``, ``SearchResult.stats``) are checked too.
"""

from __future__ import annotations

import numpy as np
import pytest

from hil.retrieval.backends.configs import PlaidIndexConfig, PlaidSearchConfig
from hil.retrieval.backends.registry import open_backend
from hil.retrieval.builder import build_index
from hil.retrieval.encoding import eval_mode
from hil.retrieval.full_ranking import full_rank
from hil.retrieval.plaid_search import plaid_candidates

from toys import QUERIES, TwoHeadEncoder, make_encoder, toy_corpus

HEADS = ("a", "b")
# one probed centroid per query token; stage 2 keeps 7 documents by the probed-cells bound, stage 3 the best 3 of them
NPROBE, NDOCS, STAGE2 = 1, 3, 7


@pytest.fixture(scope="module")
def plaid(hf_tokenizer, tmp_path_factory):
    encoder = make_encoder(hf_tokenizer, TwoHeadEncoder, seed=1)
    ids, texts = toy_corpus(60)
    index = build_index(encoder, ids, texts, tmp_path_factory.mktemp("plaid") / "idx",
                        backend=PlaidIndexConfig(n_centroids=16, niter=5, seed=0), progress=False)
    return encoder, index


def explicit_candidates(encoder, index, text: str, nprobe: int, ndocs: int, stage2_docs: int
                        ) -> dict[str, tuple[str, ...]]:
    """doc id -> the heads whose ``plaid_candidates`` (called with exactly these values) kept it."""
    backend = open_backend(index)
    with eval_mode(encoder):
        query = encoder.encode_queries([text])
    found: dict[str, list[str]] = {}
    for head in HEADS:
        vectors = query.heads[head][0][query.mask[0]].float()
        docs, _, _ = plaid_candidates(backend.plan(head), vectors, nprobe=nprobe, ndocs=ndocs, stage2_docs=stage2_docs)
        for d in docs.tolist():
            found.setdefault(index.doc_ids[d], []).append(head)
    return {doc: tuple(heads) for doc, heads in found.items()}


def intended(encoder, index, nprobe: int = NPROBE, ndocs: int = NDOCS, stage2_docs: int = STAGE2):
    return {qid: explicit_candidates(encoder, index, text, nprobe, ndocs, stage2_docs) for qid, text in QUERIES.items()}


def test_the_values_are_told_apart(plaid):
    """Reading stage2_docs from ndocs, from plaid_candidates' 4 * ndocs, or from the default 1024 changes the
    candidates of some query: the checks below can fail."""
    encoder, index = plaid
    wanted = intended(encoder, index)
    for wrong in (NDOCS, 4 * NDOCS, PlaidSearchConfig().stage2_docs):
        assert intended(encoder, index, stage2_docs=wrong) != wanted, wrong
    assert intended(encoder, index, ndocs=STAGE2, stage2_docs=NDOCS) != wanted  # the two swapped


# (search config, single-field overrides of full_rank): each must search with nprobe 1, ndocs 3, stage2_docs 7
WAYS = {
    "config": (PlaidSearchConfig(nprobe=NPROBE, ndocs=NDOCS, stage2_docs=STAGE2), {}),
    "overrides on the defaults": (None, {"nprobe": NPROBE, "max_candidates": NDOCS, "stage2_docs": STAGE2}),
    "ndocs overridden, stage2_docs from the config": (PlaidSearchConfig(nprobe=NPROBE, ndocs=50, stage2_docs=STAGE2),
                                                      {"max_candidates": NDOCS}),
    "stage2_docs overridden, ndocs from the config": (PlaidSearchConfig(nprobe=NPROBE, ndocs=NDOCS, stage2_docs=40),
                                                      {"stage2_docs": STAGE2}),
    "nprobe overridden": (PlaidSearchConfig(nprobe=9, ndocs=NDOCS, stage2_docs=STAGE2), {"nprobe": NPROBE}),
}


@pytest.mark.parametrize("way", list(WAYS))
def test_full_rank_searches_with_stage2_docs_and_ndocs_apart(plaid, way):
    encoder, index = plaid
    search, overrides = WAYS[way]
    result = full_rank(encoder, index, QUERIES, k=100, search=search, keep_candidate_sources=True, progress=False,
                       **overrides)
    assert result.stats["search"] == {"backend": "plaid", "nprobe": NPROBE, "ndocs": NDOCS, "stage2_docs": STAGE2}
    assert result.sources == intended(encoder, index)


def test_the_backend_searches_and_records_its_settings(plaid):
    encoder, index = plaid
    with eval_mode(encoder):
        queries = encoder.encode_queries(list(QUERIES.values()))
    backend = open_backend(index, PlaidSearchConfig(nprobe=NPROBE, ndocs=NDOCS, stage2_docs=STAGE2))
    found = backend.candidates(queries, HEADS)
    assert backend.search_stats() == {"backend": "plaid", "nprobe": NPROBE, "ndocs": NDOCS, "stage2_docs": STAGE2}
    for candidates, (qid, expected) in zip(found, intended(encoder, index).items()):
        got = {index.doc_ids[d]: tuple(h for h, flag in zip(HEADS, row) if flag)
               for d, row in zip(candidates.docs.tolist(), candidates.heads)}
        assert got == expected, qid


# ColBERTv2's Searcher.dense_search by k (ncells; its ndocs is our stage2_docs, a quarter of it scored exactly),
# written out by hand: k -> (nprobe, ndocs, stage2_docs)
COLBERTV2_BY_K = {1: (1, 64, 256), 10: (1, 64, 256), 11: (2, 256, 1024), 100: (2, 256, 1024),
                  101: (4, 1024, 4096), 1000: (4, 1024, 4096), 1025: (4, 1025, 4100), 5000: (4, 5000, 20000)}


@pytest.mark.parametrize("k", list(COLBERTV2_BY_K))
def test_the_defaults_are_colbertv2s_for_the_ranking_depth(k):
    assert PlaidSearchConfig().for_depth(k) == PlaidSearchConfig(*COLBERTV2_BY_K[k])


def test_given_values_are_kept_and_the_others_follow_them():
    assert PlaidSearchConfig(nprobe=7).for_depth(100) == PlaidSearchConfig(7, 256, 1024)
    assert PlaidSearchConfig(ndocs=50).for_depth(100) == PlaidSearchConfig(2, 50, 200)  # ColBERTv2's 4:1
    assert PlaidSearchConfig(stage2_docs=600).for_depth(100) == PlaidSearchConfig(2, 256, 600)
    assert PlaidSearchConfig(stage2_docs=100).for_depth(100) == PlaidSearchConfig(2, 100, 100)  # at most stage 2
    assert PlaidSearchConfig(3, 5, 9).for_depth(1000) == PlaidSearchConfig(3, 5, 9)


@pytest.mark.parametrize("k", [10, 100, 1000])
def test_without_any_setting_the_defaults_for_k_are_used(plaid, k):
    encoder, index = plaid
    nprobe, ndocs, stage2_docs = COLBERTV2_BY_K[k]
    result = full_rank(encoder, index, QUERIES, k=k, keep_candidate_sources=True, progress=False)
    assert result.stats["search"] == {"backend": "plaid", "nprobe": nprobe, "ndocs": ndocs, "stage2_docs": stage2_docs}
    assert result.sources == intended(encoder, index, nprobe, ndocs, stage2_docs)
    np.testing.assert_array_equal(sorted(result.run), sorted(QUERIES))


def test_a_backend_without_a_depth_refuses_unset_defaults(plaid):
    encoder, index = plaid
    with eval_mode(encoder):
        queries = encoder.encode_queries(["one query"])
    with pytest.raises(ValueError, match="depth"):
        open_backend(index).candidates(queries, HEADS)


def test_fewer_candidates_than_k_are_announced(plaid):
    encoder, index = plaid
    with pytest.warns(UserWarning, match="ndocs=3 < k=10"):
        full_rank(encoder, index, QUERIES, k=10, max_candidates=3, progress=False)


def test_evaluation_records_the_values_its_search_applies():
    from hil.evaluation.evaluate import EvaluationSettings

    for k in (10, 100, 1000):
        settings = EvaluationSettings(k=k, backend="plaid", index_root="unused")
        assert settings.resolved_search.given() == dict(zip(("nprobe", "ndocs", "stage2_docs"), COLBERTV2_BY_K[k]))
        assert settings.search is None  # the request stays "defaults"
    given = EvaluationSettings(k=1000, backend="plaid", index_root="x", search=PlaidSearchConfig(nprobe=8))
    assert given.resolved_search.given() == {"nprobe": 8, "ndocs": 1024, "stage2_docs": 4096}
