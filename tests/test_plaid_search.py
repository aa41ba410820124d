"""Full ranking over a ``plaid`` index (centroid pruning, optional residual compression) against exact ranking.

A random 1-layer BERT with the shared uncased tokenizer and a toy corpus of 60 short texts, as in test_search.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hil.retrieval.backends.centroid import PlaidBackend
from hil.retrieval.backends.configs import PlaidIndexConfig
from hil.retrieval.backends.registry import open_backend
from hil.retrieval.builder import build_index, open_or_build_index, rebuild_faiss
from hil.retrieval.encoding import eval_mode
from hil.retrieval.full_ranking import full_rank
from hil.retrieval.index import TokenIndex
from hil.retrieval.plaid_search import centroid_interaction, top_by_score
from hil.retrieval.search import exact_rank
from hil.retrieval.store import gather_documents

from toys import TwoHeadEncoder, make_encoder  # noqa: E402
from toys import toy_corpus as _toy_corpus  # noqa: E402

QUERIES = {"q1": "protein gene therapy", "q2": "tumor growth in the mouse brain", "q3": "vaccine dose trial",
           "q4": "heart and lung risk", "q5": "what is a cell?"}


def toy_corpus(n: int = 60, seed: int = 0) -> tuple[list[str], list[str]]:
    return _toy_corpus(n, seed)


PLAID = {"n_centroids": 16, "niter": 5, "seed": 0}


@pytest.fixture(scope="module")
def setup(hf_tokenizer, tmp_path_factory):
    encoder = make_encoder(hf_tokenizer)
    ids, texts = toy_corpus()
    root = tmp_path_factory.mktemp("plaid")
    flat = build_index(encoder, ids, texts, root / "flat", progress=False)
    plaid = build_index(encoder, ids, texts, root / "plaid", faiss_kind="plaid", faiss_params=PLAID, progress=False)
    return encoder, flat, plaid, ids, texts, root


def test_plaid_with_every_cell_and_document_equals_exact(setup):
    encoder, flat, plaid, *_ = setup
    exact = exact_rank(encoder, flat, QUERIES, k=20, progress=False)
    result = full_rank(encoder, plaid, QUERIES, k=20, nprobe=16, max_candidates=plaid.n_docs,
                       stage2_docs=plaid.n_docs, progress=False)
    assert result.stats["search"] == {"backend": "plaid", "nprobe": 16, "ndocs": plaid.n_docs,
                                      "stage2_docs": plaid.n_docs}
    for qid in QUERIES:
        assert list(result.run[qid]) == list(exact.run[qid]), qid
        np.testing.assert_allclose(list(result.run[qid].values()), list(exact.run[qid].values()), atol=1e-5)


def test_plaid_keeps_the_best_centroid_interaction_documents_and_scores_them_exactly(setup):
    encoder, flat, plaid, *_ = setup
    exact = exact_rank(encoder, flat, QUERIES, k=flat.n_docs, progress=False)
    ndocs = 6
    result = full_rank(encoder, plaid, QUERIES, k=100, nprobe=16, max_candidates=ndocs, stage2_docs=plaid.n_docs,
                       keep_candidate_sources=True, progress=False)
    plan = open_backend(plaid).plan("colbert")
    for qid, text in QUERIES.items():
        with eval_mode(encoder):
            query = encoder.encode_queries([text])
        vectors = query.heads["colbert"][0][query.mask[0]].float()
        scores = vectors @ torch.from_numpy(plan.centroids).T
        present = np.flatnonzero(plaid.doc_lengths > 0)
        expected, _ = top_by_score(present, centroid_interaction(plan, scores, present), ndocs)
        assert set(result.sources[qid]) == {plaid.doc_ids[d] for d in expected}, qid
        assert len(result.run[qid]) == ndocs
        for doc, score in result.run[qid].items():  # exact scores of the kept documents
            assert score == pytest.approx(exact.run[qid][doc], abs=1e-5)


def test_plaid_files_and_reuse(setup, hf_tokenizer):
    encoder, _, plaid, ids, texts, root = setup
    for name in ("centroids", "codes", "ivf_offsets", "ivf_docs"):
        assert (plaid.directory / f"colbert.{name}.npy").is_file()
    assert not (plaid.directory / "colbert.residuals.npy").exists()
    assert plaid.faiss_settings["params"]["n_centroids"] == 16
    assert plaid.bytes_per_token() == 2 * encoder.dim  # the fp16 vectors are kept
    assert isinstance(open_backend(plaid), PlaidBackend)  # centroids, not a FAISS search
    # the same build-time settings reuse the index (search-time ones are never part of it)
    again = open_or_build_index(encoder, ids, texts, plaid.directory, backend=PlaidIndexConfig(**PLAID),
                                progress=False)
    assert (plaid.directory / "colbert.codes.npy").stat().st_mtime_ns == \
        (again.directory / "colbert.codes.npy").stat().st_mtime_ns


def test_bad_plaid_params_are_refused(setup):
    encoder, _, _, ids, texts, root = setup
    with pytest.raises(ValueError, match="keep_embeddings"):
        build_index(encoder, ids, texts, root / "bad1", faiss_kind="plaid",
                    faiss_params={"keep_embeddings": False, "residual_bits": 0}, progress=False)
    with pytest.raises(ValueError, match="residual_bits"):
        build_index(encoder, ids, texts, root / "bad2", faiss_kind="plaid", faiss_params={"residual_bits": 3},
                    progress=False)
    with pytest.raises(ValueError, match="do not apply"):
        build_index(encoder, ids, texts, root / "bad3", faiss_kind="plaid", faiss_params={"nlist": 3},
                    progress=False)


def test_compressed_only_index_scores_decompressed_vectors(setup):
    encoder, flat, _, ids, texts, root = setup
    params = {**PLAID, "residual_bits": 2, "keep_embeddings": False}
    small = build_index(encoder, ids, texts, root / "compressed", faiss_kind="plaid", faiss_params=params,
                        progress=False)
    assert not (small.directory / "colbert.embeddings.npy").exists()
    assert small.compressed_only
    assert small.bytes_per_token() == 2 + 16 * 2 // 8  # uint16 centroid id + 2 bits x 16 dims
    reopened = TokenIndex.load(small.directory)
    stored = reopened.embeddings["colbert"]
    assert stored.shape == (flat.n_tokens, encoder.dim)
    restored = np.asarray(stored)
    original = np.asarray(flat.embeddings["colbert"], dtype=np.float32)
    cosine = (restored * original).sum(axis=1)
    assert cosine.mean() > 0.85, "2-bit residuals stay close to the original vectors"
    # gather_documents decompresses exactly the rows read
    rows = [4, 0, 9]
    batch = gather_documents(reopened, rows)
    for b, i in enumerate(rows):
        lo, hi = reopened.doc_offsets[i], reopened.doc_offsets[i + 1]
        np.testing.assert_allclose(batch.heads["colbert"][b, : hi - lo].numpy(), restored[lo:hi], atol=1e-6)
    # full ranking over every document = exact ranking over the decompressed vectors
    everything = full_rank(encoder, reopened, QUERIES, k=10, nprobe=16, max_candidates=flat.n_docs,
                           stage2_docs=flat.n_docs, progress=False)
    reference = exact_rank(encoder, reopened, QUERIES, k=10, progress=False)
    for qid in QUERIES:
        assert list(everything.run[qid]) == list(reference.run[qid])
    # another FAISS kind over a compressed-only index keeps the compressed vectors readable
    with pytest.raises(ValueError, match="compressed only"):
        rebuild_faiss(reopened, "plaid", PLAID, progress=False)


def test_two_heads_union_of_per_head_candidates(hf_tokenizer, tmp_path):
    encoder = make_encoder(hf_tokenizer, TwoHeadEncoder, seed=1)
    ids, texts = toy_corpus()
    flat = build_index(encoder, ids, texts, tmp_path / "flat", progress=False)
    plaid = build_index(encoder, ids, texts, tmp_path / "plaid", faiss_kind="plaid", faiss_params=PLAID,
                        progress=False)
    exact = exact_rank(encoder, flat, QUERIES, k=flat.n_docs, progress=False)
    ndocs = 4
    result = full_rank(encoder, plaid, QUERIES, k=100, nprobe=16, max_candidates=ndocs, stage2_docs=60,
                       keep_candidate_sources=True, progress=False)
    only_one = 0
    for qid, text in QUERIES.items():
        with eval_mode(encoder):
            query = encoder.encode_queries([text])
        expected = {}
        for head in ("a", "b"):
            plan = open_backend(plaid).plan(head)
            scores = query.heads[head][0][query.mask[0]].float() @ torch.from_numpy(plan.centroids).T
            present = np.flatnonzero(plaid.doc_lengths > 0)
            top, _ = top_by_score(present, centroid_interaction(plan, scores, present), ndocs)
            for d in top.tolist():
                expected.setdefault(plaid.doc_ids[d], []).append(head)
        assert result.sources[qid] == {d: tuple(h) for d, h in expected.items()}, qid
        only_one += sum(len(h) == 1 for h in expected.values())
        for doc, score in result.run[qid].items():  # the combined exact score
            assert score == pytest.approx(exact.run[qid][doc], abs=1e-5)
    assert only_one > 0, "the heads keep different documents, so the union matters"


@pytest.mark.parametrize("code_dtype", [np.uint16, np.int32])
def test_stage3_reads_16_bit_codes_in_place_and_unsigned(code_dtype, monkeypatch, tmp_path):
    """Above DISTINCT_CODES_MAX_TOKENS stage 3 reads the stored codes; 16-bit ones (centroid numbers past 32,767
    included) stay the file's pages (no int32 copy of every token) and score as a slow loop over tokens does."""
    import hil.retrieval.plaid as plaid_module
    from hil.retrieval.plaid import CentroidPlan

    monkeypatch.setattr(plaid_module, "DISTINCT_CODES_MAX_TOKENS", 0)
    rng = np.random.default_rng(3)
    n_centroids, lengths = 60000, rng.integers(0, 9, size=25)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    np.save(tmp_path / "codes.npy", rng.integers(0, n_centroids, size=int(offsets[-1])).astype(code_dtype))
    codes = np.load(tmp_path / "codes.npy", mmap_mode="r")
    centroids = rng.standard_normal((n_centroids, 4)).astype(np.float32)
    plan = CentroidPlan(centroids, codes, np.zeros(n_centroids + 1, np.int64), np.zeros(0, np.int32), offsets)
    scores = torch.from_numpy(rng.standard_normal((3, n_centroids)).astype(np.float32))
    docs = np.arange(len(lengths))
    got = centroid_interaction(plan, scores, docs).numpy()
    expected = [sum(max(float(scores[i, int(c)]) for c in codes[offsets[d]: offsets[d + 1]]) for i in range(3))
                if lengths[d] else 0.0 for d in docs]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert (codes >= 1 << 15).any()
    table = plan.tables("cpu").doc_codes
    assert table.data_ptr() == codes.ctypes.data  # shared with the memory map, not copied
