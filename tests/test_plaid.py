"""Centroid pruning (hil.retrieval.plaid) and residual compression (hil.retrieval.codec) against slow references.

Random unit vectors stand in for token embeddings; the references are loops written the obvious way.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hil.retrieval.codec import CompressedEmbeddings, ResidualCodec, fit_residual_codec
from hil.retrieval.plaid import CentroidPlan, assign_codes, build_ivf, default_n_centroids, train_centroids
from hil.retrieval.plaid_search import cell_scores, centroid_interaction, plaid_candidates, probe_cells, top_by_score


@pytest.fixture(autouse=True, scope="module")
def one_faiss_thread():
    import faiss

    previous = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)  # tiny problems: threads only add overhead on a shared machine
    yield
    faiss.omp_set_num_threads(previous)


def unit(rows: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def random_plan(n_docs: int, dim: int, n_centroids: int, seed: int) -> tuple[CentroidPlan, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 9, size=n_docs)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    vectors = unit(int(offsets[-1]), dim, seed + 1)
    centroids = unit(n_centroids, dim, seed + 2)
    codes = assign_codes(vectors, centroids)
    ivf_offsets, ivf_docs = build_ivf(codes, offsets, n_centroids)
    return CentroidPlan(centroids, codes, ivf_offsets, ivf_docs, offsets), vectors


def test_default_n_centroids():
    assert default_n_centroids(815_000) == 8192  # ColBERTv2's 2^floor(log2(16 sqrt(n)))
    assert default_n_centroids(100) == 12  # capped at n / 8
    assert default_n_centroids(0) == 1


def test_assign_codes_is_nearest_centroid():
    vectors, centroids = unit(300, 8, 0), unit(7, 8, 1)
    codes = assign_codes(vectors, centroids, block_tokens=64)
    np.testing.assert_array_equal(codes, np.argmax(vectors @ centroids.T, axis=1))


def test_train_centroids_are_normalized_and_seeded():
    vectors = unit(500, 8, 3)
    a = train_centroids(vectors, 6, train_size=400, niter=5, seed=1)
    b = train_centroids(vectors, 6, train_size=400, niter=5, seed=1)
    assert a.shape == (6, 8)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="n_centroids"):
        train_centroids(vectors, 501, train_size=500)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 30), st.integers(1, 9), st.integers(0, 10_000))
def test_ivf_lists_the_documents_of_each_centroid(n_docs, n_centroids, seed):
    plan, _ = random_plan(n_docs, 6, n_centroids, seed)
    for c in range(n_centroids):
        expected = sorted({d for d in range(n_docs)
                           for t in range(plan.doc_offsets[d], plan.doc_offsets[d + 1]) if plan.codes[t] == c})
        assert plan.ivf_docs[plan.ivf_offsets[c]: plan.ivf_offsets[c + 1]].tolist() == expected


def reference_centroid_interaction(plan: CentroidPlan, query: np.ndarray, doc: int) -> float:
    """PLAID Eq. 3 as loops: sum over query tokens of the best centroid score among the document's tokens."""
    total = 0.0
    tokens = range(plan.doc_offsets[doc], plan.doc_offsets[doc + 1])
    for q in query:
        total += max((float(q @ plan.centroids[plan.codes[t]]) for t in tokens), default=0.0)
    return total


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 25), st.integers(1, 8), st.integers(1, 5), st.integers(0, 10_000), st.integers(1, 400))
def test_centroid_interaction_matches_loops(n_docs, n_centroids, lq, seed, block):
    plan, _ = random_plan(n_docs, 6, n_centroids, seed)
    query = unit(lq, 6, seed + 7)
    scores = torch.from_numpy(query) @ torch.from_numpy(plan.centroids).T
    docs = np.random.default_rng(seed).permutation(n_docs)[: max(1, n_docs // 2)]
    got = centroid_interaction(plan, scores, docs, block_elements=block)
    expected = [reference_centroid_interaction(plan, query, int(d)) for d in docs]
    np.testing.assert_allclose(got, expected, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 25), st.integers(1, 8), st.integers(1, 5), st.integers(1, 4), st.integers(0, 10_000),
       st.sampled_from([None, True, False]))
def test_cell_scores_match_loops(n_docs, n_centroids, lq, nprobe, seed, dense):
    plan, _ = random_plan(n_docs, 6, n_centroids, seed)
    query = unit(lq, 6, seed + 7)
    scores = torch.from_numpy(query) @ torch.from_numpy(plan.centroids).T  # (Lq, C)
    cells = probe_cells(scores, nprobe)
    docs, bound = cell_scores(plan, scores, cells, dense=dense)
    reference: dict[int, float] = {}
    for i in range(lq):
        best: dict[int, float] = {}
        for c in cells[i].tolist():
            assert scores[i, c] >= torch.topk(scores[i], min(nprobe, n_centroids)).values.min()
            for d in plan.ivf_docs[plan.ivf_offsets[c]: plan.ivf_offsets[c + 1]].tolist():
                best[d] = max(best.get(d, -np.inf), float(scores[i, c]))
        for d, value in best.items():
            reference[d] = reference.get(d, 0.0) + value
    assert docs.tolist() == sorted(reference)
    np.testing.assert_allclose(bound, [reference[d] for d in docs.tolist()], atol=1e-5)


def test_plaid_candidates_with_every_cell_equal_exhaustive_centroid_ranking():
    plan, _ = random_plan(40, 8, 6, 11)
    query = torch.from_numpy(unit(4, 8, 12))
    docs, approx, counts = plaid_candidates(plan, query, nprobe=6, ndocs=10, stage2_docs=40)
    scores = query @ torch.from_numpy(plan.centroids).T
    present = np.flatnonzero(np.diff(plan.doc_offsets) > 0)  # documents with a token appear in some cell
    everything = centroid_interaction(plan, scores, present)
    expected, _ = top_by_score(present, everything, 10)
    assert docs.tolist() == expected.tolist()
    assert counts["probed_docs"] == len(present)


def test_top_by_score_breaks_ties_by_document():
    docs, scores = np.array([5, 1, 3, 2]), np.array([1.0, 2.0, 1.0, 1.0], dtype=np.float32)
    kept, kept_scores = top_by_score(docs, scores, 2)
    assert kept.tolist() == [1, 2] and kept_scores.tolist() == [2.0, 1.0]


# -- residual compression ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("nbits", [1, 2, 4, 8])
def test_codec_roundtrip_matches_reference(nbits):
    vectors, centroids = unit(200, 16, 5), unit(5, 16, 6)
    codes = assign_codes(vectors, centroids)
    codec = fit_residual_codec(vectors, codes, centroids, nbits)
    assert len(codec.cutoffs) == 2 ** nbits - 1 and np.all(np.diff(codec.cutoffs) >= 0)
    packed = codec.compress(vectors, codes)
    assert packed.shape == (200, 16 * nbits // 8) and packed.dtype == np.uint8
    # Reference: bucket every residual value by counting cutoffs <= it, add the bucket weight, normalize.
    residuals = vectors - centroids[codes]
    buckets = (residuals[:, :, None] >= codec.cutoffs[None, None, :]).sum(axis=2)
    expected = centroids[codes] + codec.weights[buckets]
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(codec.decompress(codes, packed), expected, atol=1e-5)


def test_more_bits_give_closer_vectors():
    vectors, centroids = unit(400, 16, 5), unit(5, 16, 6)
    codes = assign_codes(vectors, centroids)
    cosines = []
    for nbits in (1, 2, 4, 8):
        codec = fit_residual_codec(vectors, codes, centroids, nbits)
        restored = codec.decompress(codes, codec.compress(vectors, codes))
        cosines.append(float((restored * vectors).sum(axis=1).mean()))
    assert cosines == sorted(cosines) and cosines[-1] > 0.999, cosines


def test_codec_rejects_bad_bits():
    with pytest.raises(ValueError, match="nbits"):
        ResidualCodec(unit(2, 8, 0), 3, np.zeros(7, np.float32), np.zeros(8, np.float32))


def test_compressed_embeddings_index_like_an_array():
    vectors, centroids = unit(50, 8, 1), unit(3, 8, 2)
    codes = assign_codes(vectors, centroids)
    codec = fit_residual_codec(vectors, codes, centroids, 4)
    store = CompressedEmbeddings(codec, codes, codec.compress(vectors, codes))
    whole = codec.decompress(codes, codec.compress(vectors, codes))
    assert store.shape == (50, 8) and len(store) == 50
    np.testing.assert_allclose(store[3:9], whole[3:9])
    np.testing.assert_allclose(store[np.array([7, 2, 7])], whole[[7, 2, 7]])
    np.testing.assert_allclose(store[4], whole[4])
    np.testing.assert_allclose(np.asarray(store), whole)
    np.testing.assert_allclose(store.rows_torch(torch.tensor([1, 0])).numpy(), whole[[1, 0]])
