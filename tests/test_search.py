"""Full ranking, exact ranking and re-ranking against slow, obvious references.

A random 1-layer BERT with the shared uncased tokenizer, a toy corpus of 50 short texts. References: a MaxSim
double loop over the stored vectors, brute-force token search in numpy, and ``encoder.score`` of directly
encoded documents.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hil.retrieval.backends.configs import IvfPqIndexConfig
from hil.retrieval.builder import build_index
from hil.retrieval.encoding import eval_mode
from hil.retrieval.full_ranking import full_rank
from hil.retrieval.search import exact_rank, rerank, score_documents, top_k
from hil.retrieval.store import gather_documents

from toys import QUERIES, TwoHeadEncoder, make_encoder, toy_corpus  # noqa: E402


@pytest.fixture(scope="module")
def setup(hf_tokenizer, tmp_path_factory):
    encoder = make_encoder(hf_tokenizer)
    ids, texts = toy_corpus()
    index = build_index(encoder, ids, texts, tmp_path_factory.mktemp("search") / "idx", batch_size=16,
                        chunk_docs=20, progress=False)
    return encoder, index, ids, texts


@pytest.fixture(scope="module")
def two_head_setup(hf_tokenizer, tmp_path_factory):
    encoder = make_encoder(hf_tokenizer, TwoHeadEncoder, seed=1)
    ids, texts = toy_corpus()
    index = build_index(encoder, ids, texts, tmp_path_factory.mktemp("two") / "idx", progress=False)
    return encoder, index


def reference_maxsim(query: np.ndarray, doc: np.ndarray) -> float:
    """Eq. 1 written as loops: sum over query tokens of the best dot product with any document token."""
    total = 0.0
    for q in query:
        total += max(float(np.dot(q, d)) for d in doc) if len(doc) else 0.0
    return total


def encode_query(encoder, text):
    with eval_mode(encoder):
        return encoder.encode_queries([text])


def stored(index, head, i):
    return index.embeddings[head][index.doc_offsets[i]: index.doc_offsets[i + 1]].astype(np.float64)


# -- exact ranking ----------------------------------------------------------------------------------------------

def test_exact_rank_matches_loop_reference(setup):
    encoder, index, ids, _ = setup
    result = exact_rank(encoder, index, QUERIES, k=10, progress=False)
    for qid, text in QUERIES.items():
        query = encode_query(encoder, text).heads["colbert"][0].double().numpy()
        reference = {ids[i]: reference_maxsim(query, stored(index, "colbert", i)) for i in range(index.n_docs)}
        expected = sorted(reference, key=lambda d: (-reference[d], d))[:10]
        assert list(result.run[qid]) == expected, qid
        np.testing.assert_allclose([result.run[qid][d] for d in expected], [reference[d] for d in expected],
                                   rtol=1e-5, atol=1e-5)


# -- full ranking -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [7, 1000])
def test_full_rank_with_full_depth_equals_exact_rank(setup, k):
    encoder, index, _, _ = setup
    exact = exact_rank(encoder, index, QUERIES, k=k, progress=False)
    full = full_rank(encoder, index, QUERIES, k=k, ncandidates=index.n_tokens, batch_size=4, progress=False)
    assert list(full.run) == list(QUERIES)
    for qid in QUERIES:
        assert list(full.run[qid]) == list(exact.run[qid]), f"{qid}: same documents in the same order"
        np.testing.assert_allclose(list(full.run[qid].values()), list(exact.run[qid].values()), atol=1e-5, rtol=0)
        assert len(full.run[qid]) == min(k, index.n_docs)
    assert full.stats["candidates_mean"] == index.n_docs
    assert set(full.stats) >= {"encode_s", "ann_s", "score_s", "total_s", "ms_per_query"}
    assert all(src == ("colbert",) for run in full.sources.values() for src in run.values())


def test_shallow_full_rank_scores_are_exact_for_its_candidates(setup):
    """With few ANN hits the candidates are a subset, but every returned score is the exact one."""
    encoder, index, _, _ = setup
    exact = exact_rank(encoder, index, QUERIES, k=index.n_docs, progress=False)
    full = full_rank(encoder, index, QUERIES, k=5, ncandidates=2, progress=False, keep_candidate_sources=True)
    assert full.stats["candidates_mean"] < index.n_docs
    for qid in QUERIES:
        assert 0 < len(full.run[qid]) <= 5
        for doc, score in full.run[qid].items():
            assert score == pytest.approx(exact.run[qid][doc], abs=1e-5)
        candidates = full.sources[qid]
        expected = sorted(candidates, key=lambda d: (exact.run[qid][d], d), reverse=True)[:5]
        assert list(full.run[qid]) == expected, "top 5 of the candidates under the exact scores"


def test_ivfpq_full_rank_returns_exactly_scored_results(setup, tmp_path):
    encoder, index, ids, texts = setup
    ivf = build_index(encoder, ids, texts, tmp_path / "ivf", backend=IvfPqIndexConfig(nlist=4, m=4, nbits=4),
                      progress=False)
    exact = exact_rank(encoder, index, QUERIES, k=index.n_docs, progress=False)
    result = full_rank(encoder, ivf, QUERIES, k=10, ncandidates=8, nprobe=2, progress=False)
    assert result.stats["search"] == {"backend": "ivfpq", "ncandidates": 8, "max_candidates": None, "nprobe": 2}
    for qid in QUERIES:
        assert len(result.run[qid]) > 0
        for doc, score in result.run[qid].items():
            assert score == pytest.approx(exact.run[qid][doc], abs=1e-5)
    wider = full_rank(encoder, ivf, QUERIES, k=10, ncandidates=8, nprobe=4, progress=False)
    assert wider.stats["candidates_mean"] >= result.stats["candidates_mean"], "more lists probed, more candidates"
    assert wider.stats["search"]["nprobe"] == 4, "read back from the FAISS index after the search"
    again = full_rank(encoder, ivf, QUERIES, k=10, ncandidates=8, nprobe=2, progress=False)
    assert again.run == result.run and again.stats["search"]["nprobe"] == 2, "the cached FAISS index is reset"


def brute_force_candidates(encoder, index, text, ncandidates):
    """Per head: every query token's ``ncandidates`` most similar stored tokens (numpy), as document rows."""
    encoded = encode_query(encoder, text)
    found = {}
    for head in encoder.head_names:
        query = encoded.heads[head][0][encoded.mask[0]].float().numpy()
        sims = query @ index.embeddings[head].astype(np.float32).T  # (Lq, n_tokens)
        top = np.argsort(-sims, axis=1, kind="stable")[:, :ncandidates]
        found[head] = {int(index.token_doc[t]) for t in top.ravel()}
    return found


def test_two_heads_union_and_sources(two_head_setup):
    encoder, index = two_head_setup
    result = full_rank(encoder, index, QUERIES, k=1000, ncandidates=3, keep_candidate_sources=True, progress=False)
    exact = exact_rank(encoder, index, QUERIES, k=1000, progress=False)
    only_one_head = 0
    for qid, text in QUERIES.items():
        per_head = brute_force_candidates(encoder, index, text, 3)
        union = per_head["a"] | per_head["b"]
        expected_sources = {index.doc_ids[d]: tuple(h for h in ("a", "b") if d in per_head[h]) for d in union}
        assert result.sources[qid] == expected_sources, qid
        assert set(result.run[qid]) == set(expected_sources)
        only_one_head += sum(len(s) == 1 for s in expected_sources.values())
        for doc, score in result.run[qid].items():  # the model's combined score (sum of both heads)
            assert score == pytest.approx(exact.run[qid][doc], abs=1e-5)
    assert only_one_head > 0, "the heads retrieve different documents, so the union matters"
    counts = result.stats["candidate_sources"]
    assert set(counts) == {"a", "b", "a+b"}
    assert sum(counts.values()) == sum(len(s) for s in result.sources.values())
    # Without keep_candidate_sources, sources cover the ranked documents only.
    top = full_rank(encoder, index, QUERIES, k=2, ncandidates=3, progress=False)
    assert all(set(top.sources[qid]) == set(top.run[qid]) for qid in QUERIES)


def test_max_candidates_keeps_best_approximate_scores(two_head_setup):
    encoder, index = two_head_setup
    ncandidates, cap = 4, 5
    result = full_rank(encoder, index, QUERIES, k=1000, ncandidates=ncandidates, max_candidates=cap,
                       keep_candidate_sources=True, progress=False)
    for qid, text in QUERIES.items():
        encoded = encode_query(encoder, text)
        approx: dict[int, float] = {}
        for head in encoder.head_names:  # sum over heads and query tokens of the best retrieved similarity
            query = encoded.heads[head][0].float().numpy()
            sims = query @ index.embeddings[head].astype(np.float32).T
            for row in range(len(query)):
                best: dict[int, float] = {}
                for t in np.argsort(-sims[row], kind="stable")[:ncandidates]:
                    d = int(index.token_doc[t])
                    best[d] = max(best.get(d, -np.inf), float(sims[row, t]))
                for d, s in best.items():
                    approx[d] = approx.get(d, 0.0) + s
        expected = sorted(approx, key=lambda d: (-approx[d], d))[:cap]
        assert set(result.sources[qid]) == {index.doc_ids[d] for d in expected}, qid


# -- re-ranking -------------------------------------------------------------------------------------------------

def test_rerank_equals_exact_scores_restricted_to_candidates(setup):
    encoder, index, ids, texts = setup
    rng = np.random.default_rng(3)
    candidates = {qid: list(rng.choice(ids, size=12, replace=False)) for qid in QUERIES}
    candidates["q3"] = candidates["q3"] + candidates["q3"][:2]  # duplicates are scored once
    exact = exact_rank(encoder, index, QUERIES, k=index.n_docs, progress=False)
    with_index = rerank(encoder, index, QUERIES, candidates, k=8, progress=False)
    for qid in QUERIES:
        allowed = set(candidates[qid])
        expected = [d for d in exact.run[qid] if d in allowed][:8]
        assert list(with_index.run[qid]) == expected
        np.testing.assert_allclose([with_index.run[qid][d] for d in expected],
                                   [exact.run[qid][d] for d in expected], atol=1e-5, rtol=0)

    # Without an index the texts are encoded on the fly (fp32): compare with encoder.score on direct encodings.
    text_of = dict(zip(ids, texts))
    on_the_fly = rerank(encoder, None, QUERIES, candidates, text_of, k=8, chunk_docs=15, progress=False)
    for qid, query_text in QUERIES.items():
        docs = list(dict.fromkeys(candidates[qid]))
        with eval_mode(encoder):
            reference = encoder.score(encoder.encode_queries([query_text]),
                                      encoder.encode_documents([text_of[d] for d in docs]))[0].numpy()
        order = sorted(range(len(docs)), key=lambda i: (-reference[i], docs[i]))[:8]
        assert list(on_the_fly.run[qid]) == [docs[i] for i in order]
        np.testing.assert_allclose(list(on_the_fly.run[qid].values()), reference[order], atol=1e-4)
        # fp16 storage changes scores by little
        np.testing.assert_allclose(list(on_the_fly.run[qid].values()),
                                   [exact.run[qid][docs[i]] for i in order], atol=2e-2)


def test_rerank_refuses_unknown_documents_and_handles_empty(setup):
    encoder, index, ids, texts = setup
    with pytest.raises(KeyError, match="not in the index"):
        rerank(encoder, index, {"q1": "gene"}, {"q1": ["nope"]}, progress=False)
    with pytest.raises(ValueError, match="texts"):
        rerank(encoder, None, {"q1": "gene"}, {"q1": ids[:2]}, progress=False)
    result = rerank(encoder, index, {"q1": "gene", "q2": "cell"}, {"q1": ids[:3]}, progress=False)
    assert result.run["q2"] == {} and len(result.run["q1"]) == 3


# -- building blocks --------------------------------------------------------------------------------------------

def test_gather_documents_pads_and_masks(setup):
    encoder, index, _, _ = setup
    rows = [5, 0, 17, 5]
    batch = gather_documents(index, rows)
    lengths = index.doc_lengths[rows]
    assert batch.heads["colbert"].shape == (4, lengths.max(), encoder.dim)
    assert batch.heads["colbert"].dtype == torch.float32
    for b, i in enumerate(rows):
        n = int(lengths[b])
        assert batch.mask[b].tolist() == [True] * n + [False] * (int(lengths.max()) - n)
        np.testing.assert_array_equal(batch.heads["colbert"][b, :n].numpy(), stored(index, "colbert", i))
        assert (batch.heads["colbert"][b, n:] == 0).all()
        lo, hi = index.doc_offsets[i], index.doc_offsets[i + 1]
        assert batch.input_ids[b, :n].tolist() == index.token_ids[lo:hi].tolist()


def test_score_documents_blocks_agree_with_one_block(setup):
    encoder, index, _, _ = setup
    with eval_mode(encoder):
        queries = encoder.encode_queries(list(QUERIES.values()))
        docs = np.array([3, 9, 1, 40, 22, 9])
        small = score_documents(encoder, queries, index, docs, block_tokens=7)
        whole = encoder.score(queries, gather_documents(index, docs)).numpy()
    np.testing.assert_allclose(small, whole, atol=1e-5)


def test_ties_are_broken_by_doc_id(hf_tokenizer, tmp_path):
    encoder = make_encoder(hf_tokenizer)
    ids, texts = ["zeta", "alpha", "mid", "beta"], ["gene therapy", "gene therapy", "brain", "gene therapy"]
    index = build_index(encoder, ids, texts, tmp_path / "idx", progress=False)
    for result in (exact_rank(encoder, index, {"q": "gene"}, k=4, progress=False),
                   full_rank(encoder, index, {"q": "gene"}, k=4, ncandidates=100, progress=False)):
        ranked = [d for d in result.run["q"] if d != "mid"]
        assert ranked == ["zeta", "beta", "alpha"], "trec_eval's order: ties by id descending"
        assert len({result.run["q"][d] for d in ranked}) == 1, "identical texts, identical scores"
    deep = exact_rank(encoder, index, {"q": "gene"}, k=4, progress=False).run["q"]
    for k in (1, 2, 3):  # a shallow search is the head of a deep one, ties included
        assert list(exact_rank(encoder, index, {"q": "gene"}, k=k, progress=False).run["q"]) == list(deep)[:k]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=30), st.integers(1, 10))
def test_top_k_matches_sorting(values, k):
    scores = np.array(values, dtype=np.float32)
    docs = np.arange(len(values))[::-1].copy()
    rank = np.random.default_rng(len(values)).permutation(len(values)) if values else np.zeros(0, dtype=np.int64)
    got_docs, got_scores = top_k(scores, docs, rank, k)
    expected = sorted(range(len(values)), key=lambda i: (-scores[i], -rank[docs[i]]))[:k]
    assert got_docs.tolist() == [int(docs[i]) for i in expected]
    assert got_scores.tolist() == [float(scores[i]) for i in expected]
