"""Search back-ends (hil.retrieval.backends) against brute force: with settings wide enough to see everything, every
registered back-end proposes every document, and full ranking equals a MaxSim loop over the stored vectors.

A two-head random-BERT encoder (relevance = the sum of both heads' Eq. 1) over a toy corpus of 50 short texts;
the reference is written as loops, documents sorted by ``(-score, doc_id)``.
"""

from __future__ import annotations

import numpy as np
import pytest

from hil.retrieval.backends.base import CandidateSettings
from hil.retrieval.backends.registry import BACKENDS, FAISS_KINDS, backend_class, open_backend
from hil.retrieval.builder import build_index, rebuild_faiss
from hil.retrieval.encoding import eval_mode
from hil.retrieval.search import full_rank

from toys import QUERIES, TwoHeadEncoder, make_encoder, toy_corpus  # noqa: E402

# Per kind: build parameters, and search settings that look at every token, list, centroid and document.
EVERYTHING = {
    "flat": ({}, {}),
    "ivfflat": ({"nlist": 4, "nprobe": 1}, {"nprobe": 4}),
    "ivfpq": ({"nlist": 4, "m": 4, "nbits": 4, "nprobe": 1}, {"nprobe": 4}),
    "plaid": ({"n_centroids": 8, "niter": 3, "ndocs": 2, "stage2_docs": 2, "nprobe": 1},
              {"nprobe": 8, "max_candidates": 50, "stage2_docs": 50}),
}


@pytest.fixture(scope="module")
def encoder(hf_tokenizer):
    return make_encoder(hf_tokenizer, TwoHeadEncoder, seed=1)


@pytest.fixture(scope="module")
def indexes(encoder, tmp_path_factory):
    ids, texts = toy_corpus()
    root = tmp_path_factory.mktemp("backends")
    return {kind: build_index(encoder, ids, texts, root / kind, faiss_kind=kind, faiss_params=params,
                              progress=False) for kind, (params, _) in EVERYTHING.items()}


def wide_settings(kind: str, index) -> CandidateSettings:
    return CandidateSettings(ncandidates=index.n_tokens, **EVERYTHING[kind][1])


def loop_ranking(encoder, index, text: str, k: int) -> list[tuple[str, float]]:
    """Sum over heads of sum_i max_j q_i . d_j, written as loops over the stored (fp16) vectors."""
    with eval_mode(encoder):
        query = encoder.encode_queries([text])
    scores = {}
    for doc in range(index.n_docs):
        lo, hi = int(index.doc_offsets[doc]), int(index.doc_offsets[doc + 1])
        total = 0.0
        for head in encoder.head_names:
            vectors = query.heads[head][0][query.mask[0]].double().numpy()
            stored = np.asarray(index.embeddings[head][lo:hi], dtype=np.float64)
            for q in vectors:
                total += max((float(np.dot(q, d)) for d in stored), default=0.0)
        scores[index.doc_ids[doc]] = total
    return sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:k]


def test_every_registered_backend_is_covered():
    assert set(EVERYTHING) == set(BACKENDS) == set(FAISS_KINDS)


@pytest.mark.parametrize("kind", list(EVERYTHING))
def test_wide_candidates_are_every_document_from_every_head(encoder, indexes, kind):
    index = indexes[kind]
    assert index.faiss_settings["kind"] == kind and (index.doc_lengths > 0).all()
    backend = open_backend(index, wide_settings(kind, index))
    assert type(backend) is BACKENDS[kind]
    with eval_mode(encoder):
        queries = encoder.encode_queries(list(QUERIES.values()))
    found = backend.candidates(queries, encoder.head_names)
    assert len(found) == len(QUERIES)
    for candidates in found:
        assert candidates.docs.tolist() == list(range(index.n_docs))
        assert candidates.heads.shape == (index.n_docs, 2) and candidates.heads.all()


@pytest.mark.parametrize("kind", list(EVERYTHING))
def test_wide_full_rank_equals_the_brute_force_loop(encoder, indexes, kind):
    index = indexes[kind]
    settings = EVERYTHING[kind][1]
    result = full_rank(encoder, index, QUERIES, k=10, ncandidates=index.n_tokens, batch_size=4, progress=False,
                       **settings)
    assert result.stats["faiss_kind"] == kind and result.stats["candidates_mean"] == index.n_docs
    for qid, text in QUERIES.items():
        expected = loop_ranking(encoder, index, text, 10)
        assert list(result.run[qid]) == [doc for doc, _ in expected], (kind, qid)
        np.testing.assert_allclose(list(result.run[qid].values()), [score for _, score in expected], atol=1e-4)


def test_plaid_search_defaults_come_from_the_index(indexes):
    backend = open_backend(indexes["plaid"])
    assert backend.search_stats() == {"plaid": {"nprobe": 1, "ndocs": 2, "stage2_docs": 2}}
    overridden = open_backend(indexes["plaid"], CandidateSettings(nprobe=3, max_candidates=5))
    assert overridden.search_stats() == {"plaid": {"nprobe": 3, "ndocs": 5, "stage2_docs": 2}}


def test_unknown_kind_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"faiss_kind must be one of \('flat', 'ivfflat', 'ivfpq', 'plaid'\), "
                                         r"got 'hnsw'"):
        backend_class("hnsw")


@pytest.mark.parametrize("kind", list(EVERYTHING))
def test_each_backend_owns_its_parameters(kind):
    backend = backend_class(kind)
    assert backend.kind == kind and backend.search_time_params <= backend.accepted_params
    resolved = backend.resolve_params(EVERYTHING[kind][0], n_tokens=2000, dim=16)
    assert set(resolved) <= backend.accepted_params
    assert backend.resolve_params(resolved, n_tokens=2000, dim=16) == resolved, "resolving is idempotent"
    with pytest.raises(ValueError, match="do not apply"):
        backend.check_params({"no_such_setting": 1})


def test_switching_kinds_leaves_only_the_new_kinds_files(encoder, tmp_path):
    ids, texts = toy_corpus()
    index = build_index(encoder, ids, texts, tmp_path / "idx", faiss_kind="plaid",
                        faiss_params=EVERYTHING["plaid"][0], progress=False)
    base = {"index.json", "doc_ids.json", "doc_offsets.npy", "token_ids.npy", "a.embeddings.npy",
            "b.embeddings.npy"}
    plaid = {f"{h}.{name}.npy" for h in "ab" for name in ("centroids", "codes", "ivf_offsets", "ivf_docs")}
    files = lambda: {path.name for path in index.directory.iterdir()}  # noqa: E731
    assert files() == base | plaid, "no temporary file is left behind"
    index = rebuild_faiss(index, "ivfflat", EVERYTHING["ivfflat"][0], progress=False)
    assert files() == base | {"a.faiss", "b.faiss"}
    index = rebuild_faiss(index, "flat", progress=False)
    assert files() == base
