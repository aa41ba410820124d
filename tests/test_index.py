"""Token index: build/load round trip, resumable builds, fingerprints, FAISS kinds.

Uses ``tiny_random_colbert`` (conftest): a ColBERTEncoder over a random 1-layer BERT with the shared uncased
tokenizer. The reference for stored vectors is the encoder's own output for each document, encoded alone.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hil.retrieval.backends.configs import REGISTRY, IvfSearchConfig
from hil.retrieval.backends.registry import open_backend
from hil.retrieval.builder import build_index, open_or_build_index
from hil.retrieval.encoding import encode_document_tokens, eval_mode
from hil.retrieval.index import IndexMismatchError, TokenIndex, encoder_fingerprint, fingerprint_corpus

from toys import toy_corpus as _toy_corpus  # noqa: E402


def toy_corpus(n: int = 50, seed: int = 0) -> tuple[list[str], list[str]]:
    return _toy_corpus(n, seed, commas=True)


def reference_tokens(encoder, text: str) -> tuple[np.ndarray, np.ndarray]:
    """The encoder's scored token vectors and ids for one document, encoded on its own. -> (T, D), (T,)"""
    with eval_mode(encoder):
        batch = encoder.encode_documents([text])
    mask = batch.mask[0]
    return batch.heads["colbert"][0][mask].float().numpy(), batch.input_ids[0][mask].numpy()


@pytest.fixture
def corpus():
    return toy_corpus()


def test_build_load_roundtrip_matches_encoder(tiny_random_colbert, corpus, tmp_path):
    encoder = tiny_random_colbert
    ids, texts = corpus
    index = build_index(encoder, ids, texts, tmp_path / "idx", batch_size=8, chunk_docs=16, progress=False)
    loaded = TokenIndex.load(tmp_path / "idx")
    assert loaded.doc_ids == ids and loaded.n_docs == 50
    assert isinstance(loaded.embeddings["colbert"], np.memmap)
    assert loaded.embeddings["colbert"].dtype == np.float16
    assert loaded.bytes_per_token() == 2 * encoder.dim
    punctuation = set(encoder.tokenizer.punctuation_ids.tolist())
    expected_offset = 0
    for i, text in enumerate(texts):
        vectors, token_ids = reference_tokens(encoder, text)
        lo, hi = loaded.doc_offsets[i], loaded.doc_offsets[i + 1]
        assert lo == expected_offset and hi - lo == len(vectors), f"doc {i}: offsets"
        expected_offset = hi
        np.testing.assert_allclose(loaded.embeddings["colbert"][lo:hi].astype(np.float32), vectors, atol=2e-3)
        np.testing.assert_array_equal(loaded.token_ids[lo:hi], token_ids)
        assert not punctuation & set(loaded.token_ids[lo:hi].tolist()), "punctuation tokens are not stored"
        assert (loaded.token_doc[lo:hi] == i).all()
    assert loaded.n_tokens == expected_offset == len(loaded.token_ids)
    assert loaded.token_doc.dtype == np.int32
    np.testing.assert_array_equal(loaded.doc_lengths, np.diff(loaded.doc_offsets))
    # Punctuation was in the texts and in the encoder input, so the test above is not vacuous.
    comma = encoder.tokenizer.tokenizer.convert_tokens_to_ids(",")
    assert comma in punctuation and any("," in t for t in texts)
    # Settings travel with the index.
    meta = json.loads((tmp_path / "idx" / "index.json").read_text())
    assert meta["settings"]["dim"] == encoder.dim and meta["n_docs"] == 50 and meta["heads"] == ["colbert"]
    assert meta["encoder_fingerprint"] == encoder_fingerprint(encoder)
    assert meta["corpus_fingerprint"] == fingerprint_corpus(ids, texts)
    assert "versions" in meta and meta["backend"]["kind"] == "flat"
    assert not (tmp_path / "idx" / "chunks").exists() and not (tmp_path / "idx.tmp-build").exists()
    assert index.n_tokens == loaded.n_tokens


def test_encode_document_tokens_restores_input_order(tiny_random_colbert, corpus):
    """Documents are encoded sorted by length; the result must come back in input order (vs one-by-one)."""
    encoder = tiny_random_colbert
    _, texts = corpus
    texts = texts[:12]
    with eval_mode(encoder):
        encoded = encode_document_tokens(encoder, texts, batch_size=5, dtype=np.float32)
    offsets = np.concatenate([[0], np.cumsum(encoded.lengths)])
    for i, text in enumerate(texts):
        vectors, token_ids = reference_tokens(encoder, text)
        np.testing.assert_allclose(encoded.embeddings["colbert"][offsets[i]:offsets[i + 1]], vectors, atol=1e-5)
        np.testing.assert_array_equal(encoded.token_ids[offsets[i]:offsets[i + 1]], token_ids)


def test_interrupted_build_reuses_finished_chunks(tiny_random_colbert, corpus, tmp_path, monkeypatch):
    encoder = tiny_random_colbert
    ids, texts = corpus
    clean = build_index(encoder, ids, texts, tmp_path / "clean", batch_size=8, chunk_docs=20, progress=False)

    calls = {"n": 0}
    original = encoder.encode

    def crashing(batch, is_query):
        calls["n"] += 1
        if calls["n"] == 4:  # chunk 0 (20 docs) takes 3 batches of <= 8: die in the first batch of chunk 1
            raise KeyboardInterrupt("simulated crash")
        return original(batch, is_query)

    monkeypatch.setattr(encoder, "encode", crashing)
    with pytest.raises(KeyboardInterrupt):
        build_index(encoder, ids, texts, tmp_path / "idx", batch_size=8, chunk_docs=20, progress=False)
    assert not (tmp_path / "idx").exists(), "an unfinished build is never visible under the final name"
    with pytest.raises(FileNotFoundError, match="unfinished build"):
        TokenIndex.load(tmp_path / "idx")
    chunk_dir = tmp_path / "idx.tmp-build" / "chunks"
    assert (chunk_dir / "chunk-00000.json").is_file() and not (chunk_dir / "chunk-00001.json").exists()
    # A half-written file of chunk 1 (no metadata) must not be trusted.
    (chunk_dir / "chunk-00001.colbert.npy").write_bytes(b"garbage")

    calls["n"] = -10**6  # no more crashes; count again from zero below
    counted = {"n": 0}

    def counting(batch, is_query):
        counted["n"] += 1
        return original(batch, is_query)

    monkeypatch.setattr(encoder, "encode", counting)
    resumed = build_index(encoder, ids, texts, tmp_path / "idx", batch_size=8, chunk_docs=20, progress=False)
    assert counted["n"] == 3 + 2, "chunk 0 reused; chunk 1 (20 docs, 3 batches) and chunk 2 (10 docs, 2) encoded"
    assert resumed.doc_ids == clean.doc_ids
    np.testing.assert_array_equal(resumed.doc_offsets, clean.doc_offsets)
    np.testing.assert_array_equal(resumed.token_ids, clean.token_ids)
    np.testing.assert_allclose(resumed.embeddings["colbert"].astype(np.float32),
                               clean.embeddings["colbert"].astype(np.float32), atol=1e-3)
    assert not (tmp_path / "idx.tmp-build").exists()


def test_chunk_from_other_encoder_is_not_reused(tiny_random_colbert, corpus, tmp_path, monkeypatch):
    encoder = tiny_random_colbert
    ids, texts = corpus
    original = encoder.encode
    calls = {"n": 0}

    def crash_in_chunk_1(batch, is_query):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return original(batch, is_query)

    monkeypatch.setattr(encoder, "encode", crash_in_chunk_1)
    with pytest.raises(KeyboardInterrupt):
        build_index(encoder, ids, texts, tmp_path / "idx", batch_size=25, chunk_docs=25, progress=False)
    with torch.no_grad():
        encoder.linear.weight.mul_(-1.0)  # another model now
    monkeypatch.setattr(encoder, "encode", original)
    index = build_index(encoder, ids, texts, tmp_path / "idx", batch_size=25, chunk_docs=25, progress=False)
    vectors, _ = reference_tokens(encoder, texts[0])
    np.testing.assert_allclose(index.embeddings["colbert"][: len(vectors)].astype(np.float32), vectors, atol=2e-3)


def test_fingerprint_mismatch_is_refused(tiny_random_colbert, corpus, tmp_path):
    encoder = tiny_random_colbert
    ids, texts = corpus
    build_index(encoder, ids[:10], texts[:10], tmp_path / "idx", progress=False)
    good_corpus, good_encoder = fingerprint_corpus(ids[:10], texts[:10]), encoder_fingerprint(encoder)
    TokenIndex.load(tmp_path / "idx", good_corpus, good_encoder)  # fine
    other_corpus = fingerprint_corpus(ids[:10], texts[1:11])
    with pytest.raises(IndexMismatchError) as error:
        TokenIndex.load(tmp_path / "idx", expect_corpus_fingerprint=other_corpus)
    message = str(error.value)
    assert good_corpus in message and other_corpus in message and str(tmp_path / "idx") in message
    with torch.no_grad():
        encoder.linear.weight[0, 0] += 1e-3
    other_encoder = encoder_fingerprint(encoder)
    assert other_encoder != good_encoder, "a parameter change changes the encoder fingerprint"
    with pytest.raises(IndexMismatchError, match=f"{good_encoder}.*{other_encoder}"):
        TokenIndex.load(tmp_path / "idx", expect_encoder_fingerprint=other_encoder)
    with pytest.raises(FileExistsError):
        build_index(encoder, ids[:10], texts[:10], tmp_path / "idx", progress=False)


def test_open_or_build_reuses_then_rebuilds(tiny_random_colbert, corpus, tmp_path):
    encoder = tiny_random_colbert
    ids, texts = corpus
    first = open_or_build_index(encoder, ids[:10], texts[:10], tmp_path / "idx", progress=False)
    stamp = (tmp_path / "idx" / "colbert.embeddings.npy").stat().st_mtime_ns
    again = open_or_build_index(encoder, ids[:10], texts[:10], tmp_path / "idx", progress=False)
    assert (tmp_path / "idx" / "colbert.embeddings.npy").stat().st_mtime_ns == stamp, "reused, not rebuilt"
    assert again.encoder_fingerprint == first.encoder_fingerprint
    rebuilt = open_or_build_index(encoder, ids[:12], texts[:12], tmp_path / "idx", progress=False)
    assert rebuilt.n_docs == 12 and rebuilt.corpus_fingerprint == fingerprint_corpus(ids[:12], texts[:12])
    ivf = open_or_build_index(encoder, ids[:12], texts[:12], tmp_path / "idx", faiss_kind="ivfflat",
                              faiss_params={"nlist": 2}, progress=False)
    assert ivf.backend_settings["kind"] == "ivfflat" and (tmp_path / "idx" / "colbert.faiss").is_file()
    np.testing.assert_array_equal(ivf.token_ids, rebuilt.token_ids)


@pytest.mark.parametrize("kind, params", [("ivfpq", {"nlist": 4, "m": 4, "nbits": 4}),
                                          ("ivfflat", {"nlist": 4})])
def test_ivf_indexes_build_and_search(tiny_random_colbert, corpus, tmp_path, kind, params):
    encoder = tiny_random_colbert
    ids, texts = corpus
    index = build_index(encoder, ids, texts, tmp_path / "idx", backend=REGISTRY[kind].index_config(**params),
                        progress=False)
    assert index.n_tokens >= 39 * params["nlist"], "enough training points for the chosen nlist"
    assert (tmp_path / "idx" / "colbert.faiss").is_file()
    loaded = TokenIndex.load(tmp_path / "idx")
    ann = open_backend(loaded, IvfSearchConfig(nprobe=4)).faiss_index("colbert")
    assert ann.ntotal == loaded.n_tokens
    queries = np.ascontiguousarray(loaded.embeddings["colbert"][:5].astype(np.float32))
    sims, hits = ann.search(queries, 3)
    assert (hits >= 0).all()
    if kind == "ivfflat":  # nprobe == nlist visits every list: exact search, same similarities as brute force
        brute = np.sort(queries @ loaded.embeddings["colbert"].astype(np.float32).T, axis=1)[:, ::-1][:, :3]
        np.testing.assert_allclose(sims, brute, atol=1e-5)


def test_flat_faiss_is_exact_inner_product(tiny_random_colbert, corpus, tmp_path):
    encoder = tiny_random_colbert
    ids, texts = corpus
    index = build_index(encoder, ids, texts, tmp_path / "idx", progress=False)
    assert not (tmp_path / "idx" / "colbert.faiss").exists(), "flat is rebuilt from the embeddings, not stored"
    vectors = index.embeddings["colbert"].astype(np.float32)
    rng = np.random.default_rng(0)
    queries = rng.standard_normal((4, vectors.shape[1])).astype(np.float32)
    sims, hits = open_backend(index).faiss_index("colbert").search(queries, 5)
    brute = queries @ vectors.T
    np.testing.assert_array_equal(hits, np.argsort(-brute, axis=1, kind="stable")[:, :5])
    np.testing.assert_allclose(sims, np.take_along_axis(brute, hits, axis=1), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused(tiny_random_colbert, tmp_path):
    encoder = tiny_random_colbert
    with pytest.raises(ValueError, match="duplicate"):
        build_index(encoder, ["a", "a"], ["x", "y"], tmp_path / "i1", progress=False)
    with pytest.raises(ValueError, match="2 doc_ids but 1 texts"):
        build_index(encoder, ["a", "b"], ["x"], tmp_path / "i2", progress=False)
    with pytest.raises(ValueError, match="backend must be one of"):
        build_index(encoder, ["a"], ["x"], tmp_path / "i3", backend="hnsw", progress=False)
    with pytest.raises(ValueError, match="nbits"):
        build_index(encoder, ["a"], ["x"], tmp_path / "i4", faiss_kind="ivfflat", faiss_params={"nbits": 4},
                    progress=False)
    (tmp_path / "notindex").mkdir()
    (tmp_path / "notindex" / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a hil token index"):
        build_index(encoder, ["a"], ["x"], tmp_path / "notindex", overwrite=True, progress=False)
    assert (tmp_path / "notindex" / "precious.txt").exists()
