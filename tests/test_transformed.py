"""Post-hoc transforms at evaluation time: TransformedEncoder, fitting on an index, derived indexes, evaluate.py."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hil.isotropy.postprocess import fit_transform_from_config, fit_whitening
from hil.modeling.contracts import EncodedBatch, Encoder
from hil.modeling.scoring import late_interaction_matrix
from hil.retrieval.builder import build_index
from hil.retrieval.encoding import encode_document_tokens, eval_mode
from hil.retrieval.index import INDEX_JSON, encoder_fingerprint
from hil.retrieval.transformed import (
    TransformedEncoder,
    derive_transformed_index,
    encode_sample,
    fit_head_transforms,
    fit_transformed_encoder,
    load_transforms,
    open_or_derive_index,
    sample_sequence_vectors,
    transform_file_name,
    transform_fingerprint,
    unnormalized_transform,
)

TEXTS = ["the cat sat on the mat", "dogs chase cats in the park", "a quick brown fox jumps over the lazy dog",
         "proteins fold into three dimensional structures", "the stock market fell sharply on monday",
         "vaccines train the immune system", "rain is expected over the weekend", "neurons fire action potentials",
         "the court ruled in favour of the plaintiff", "graphene conducts electricity very well"] * 3
QUERIES = ["what do cats do", "how do vaccines work", "market crash monday"]


def slow_maxsim(q: torch.Tensor, d: torch.Tensor, qm: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """sum_i max_j q_i . d_j over valid tokens, by loops (the obvious reference)."""
    out = torch.zeros(q.shape[0], d.shape[0])
    for a in range(q.shape[0]):
        for b in range(d.shape[0]):
            total = 0.0
            for i in range(q.shape[1]):
                if not qm[a, i]:
                    continue
                total += max(float(q[a, i] @ d[b, j]) for j in range(d.shape[1]) if dm[b, j])
            out[a, b] = total
    return out


@pytest.fixture
def whitened(tiny_random_colbert):
    store = encode_sample(tiny_random_colbert, TEXTS, max_docs=1000)
    transforms = fit_head_transforms(store, "whitening", mode="token")
    return TransformedEncoder(tiny_random_colbert, transforms, spec="whitening"), store


def test_surface_settings_and_fingerprint(whitened, tiny_random_colbert):
    encoder, _ = whitened
    assert encoder.head_names == tiny_random_colbert.head_names == ("colbert",)
    assert encoder.architecture == "colbert" and encoder.tokenizer is tiny_random_colbert.tokenizer
    assert encoder.dim == 16 and encoder.device == tiny_random_colbert.device
    settings = encoder.settings()
    assert settings["post_transform"]["spec"] == "whitening"
    assert settings["post_transform"]["heads"]["colbert"]["fingerprint"] == transform_fingerprint(
        encoder.transforms["colbert"])
    assert encoder_fingerprint(encoder) != encoder_fingerprint(tiny_random_colbert)
    # nothing is forwarded: the wrapped model's own attributes are reached through ``inner``
    assert not hasattr(encoder, "backbone") and encoder.inner.backbone is tiny_random_colbert.backbone
    # another fit (different data) gives another fingerprint
    other = fit_head_transforms(encode_sample(tiny_random_colbert, TEXTS[:12]), "whitening")
    assert encoder_fingerprint(TransformedEncoder(tiny_random_colbert, other, spec="whitening")) != \
        encoder_fingerprint(encoder)


def test_encode_applies_the_transform_and_keeps_the_mask(whitened, tiny_random_colbert):
    encoder, _ = whitened
    whitening = encoder.transforms["colbert"].steps[0]
    with eval_mode(encoder):
        base = tiny_random_colbert.encode_documents(TEXTS[:4])
        out = encoder.encode_documents(TEXTS[:4])
        queries = encoder.encode_queries(QUERIES)
    mask = out.mask.bool()
    assert torch.equal(out.mask, base.mask) and torch.equal(out.input_ids, base.input_ids)
    assert torch.all(out.heads["colbert"][~mask] == 0)
    # reference: z = normalize((x - mu) W), written out by hand
    x = base.heads["colbert"][mask].double()
    expected = F.normalize((x - whitening.mean) @ whitening.projection, dim=-1).float()
    assert torch.allclose(out.heads["colbert"][mask], expected, atol=1e-5)
    # scoring is the wrapped model's MaxSim on the transformed vectors
    scores = encoder.score(queries, out)
    reference = slow_maxsim(queries.heads["colbert"], out.heads["colbert"], queries.mask, out.mask)
    assert torch.allclose(scores, reference, atol=1e-4)
    assert torch.allclose(scores, late_interaction_matrix(queries.heads["colbert"], out.heads["colbert"],
                                                          queries.mask, out.mask), atol=1e-5)


def test_whitening_of_the_fitting_sample_has_identity_covariance(whitened):
    encoder, store = whitened
    vectors = torch.from_numpy(np.asarray(store.embeddings["colbert"], dtype=np.float64))
    z = unnormalized_transform(encoder.transforms["colbert"], vectors)  # before the final normalization
    assert torch.allclose(z.mean(0), torch.zeros(z.shape[1], dtype=z.dtype), atol=1e-6)
    covariance = torch.cov(z.T)
    assert torch.allclose(covariance, torch.eye(z.shape[1], dtype=z.dtype), atol=0.02)
    # the raw vectors were far from it (an anisotropic cloud)
    assert not torch.allclose(torch.cov(vectors.T), torch.eye(vectors.shape[1], dtype=vectors.dtype), atol=0.5)


def test_construction_errors(tiny_random_colbert):
    store = encode_sample(tiny_random_colbert, TEXTS)
    fitted = fit_head_transforms(store, "whitening")
    with pytest.raises(ValueError, match="unknown head"):
        TransformedEncoder(tiny_random_colbert, {"L": fitted["colbert"]})
    with pytest.raises(ValueError, match="mode"):
        TransformedEncoder(tiny_random_colbert, fitted, mode="pooled")
    with pytest.raises(ValueError, match="no transform"):
        TransformedEncoder(tiny_random_colbert, {})
    narrow = fit_transform_from_config("whitening", torch.randn(50, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="8-d"):
        TransformedEncoder(tiny_random_colbert, {"colbert": narrow})
    with pytest.raises(ValueError, match="token store .index. or document texts"):
        fit_transformed_encoder(tiny_random_colbert, "whitening")


def test_sequence_mode_fits_on_document_means(tiny_random_colbert):
    store = encode_sample(tiny_random_colbert, TEXTS)
    pooled = sample_sequence_vectors(store, "colbert")
    assert pooled.shape == (store.n_docs, 16)
    first = np.asarray(store.embeddings["colbert"][store.doc_offsets[0]: store.doc_offsets[1]]).mean(0)
    assert np.allclose(pooled[0].numpy(), first, atol=1e-6)
    encoder = fit_transformed_encoder(tiny_random_colbert, "standardize", store=store, mode="sequence")
    assert encoder.mode == "sequence" and encoder.transforms["colbert"].fit_info["n_vectors"] == store.n_docs


def test_whitening_k_reduces_the_dimension(tiny_random_colbert):
    encoder = fit_transformed_encoder(tiny_random_colbert, "whitening:k=8", texts=TEXTS)
    assert encoder.dim == encoder.settings()["dim"] == 8 and tiny_random_colbert.settings()["dim"] == 16
    with eval_mode(encoder):
        out = encoder.encode_queries(QUERIES)
    assert out.heads["colbert"].shape[-1] == 8
    assert torch.allclose(out.heads["colbert"].norm(dim=-1), torch.ones(out.mask.shape), atol=1e-5)


# -- on an index of the SciFact slice ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scifact(shared_dir):
    from hil.data.beir import load_beir

    return load_beir("scifact").subset(n_queries=10, n_docs=200)


@pytest.fixture(scope="module")
def tiny_colbert(shared_dir):
    from hil.modeling.loading import load_encoder

    torch.manual_seed(12345)
    return load_encoder("bert-tiny-splade", dim=32, doc_maxlen=64)


@pytest.fixture(scope="module")
def index_root(tmp_path_factory):
    return tmp_path_factory.mktemp("indexes")


@pytest.mark.integration
def test_derived_index_whitens_stored_vectors(tiny_colbert, scifact, index_root):
    from hil.evaluation.evaluate import index_dir as default_index_dir

    base = build_index(tiny_colbert, scifact.doc_ids(), scifact.documents(),
                       default_index_dir(index_root, scifact, tiny_colbert), progress=False,
                       corpus_fingerprint=scifact.fingerprint())
    stored = torch.from_numpy(np.asarray(base.embeddings["colbert"], dtype=np.float64))
    assert base.n_tokens < 200_000  # so every stored token is in the fitting sample
    encoder = fit_transformed_encoder(tiny_colbert, "whitening", store=base)
    z = unnormalized_transform(encoder.transforms["colbert"], stored)
    assert torch.allclose(torch.cov(z.T), torch.eye(32, dtype=z.dtype), atol=0.02)

    derived = derive_transformed_index(base, encoder, default_index_dir(index_root, scifact, encoder))
    assert derived.directory != base.directory
    assert derived.encoder_fingerprint == encoder_fingerprint(encoder) != base.encoder_fingerprint
    assert derived.corpus_fingerprint == base.corpus_fingerprint
    assert derived.doc_ids == base.doc_ids and np.array_equal(derived.doc_offsets, base.doc_offsets)
    assert np.array_equal(np.asarray(derived.token_ids), np.asarray(base.token_ids))
    new = np.asarray(derived.embeddings["colbert"], dtype=np.float32)
    assert not np.allclose(new, np.asarray(base.embeddings["colbert"], dtype=np.float32), atol=0.05)
    assert np.allclose(np.linalg.norm(new, axis=1), 1.0, atol=2e-3)
    # the same vectors as encoding the corpus with the transformed encoder (up to fp16 rounding)
    with eval_mode(encoder):
        direct = encode_document_tokens(encoder, scifact.documents()[:20], dtype=np.float32)
    rows = slice(0, int(direct.lengths.sum()))
    assert np.allclose(new[rows], direct.embeddings["colbert"], atol=5e-3)
    # fitted parameters saved beside the index, recorded in index.json, loadable
    assert (derived.directory / transform_file_name("colbert")).is_file()
    meta = json.loads((derived.directory / INDEX_JSON).read_text())
    assert meta["derived_from"]["encoder_fingerprint"] == base.encoder_fingerprint
    assert meta["settings"]["post_transform"]["spec"] == "whitening"
    transforms, record = load_transforms(derived.directory)
    assert transform_fingerprint(transforms["colbert"]) == record["heads"]["colbert"]["fingerprint"]
    again = TransformedEncoder.from_directory(tiny_colbert, derived.directory)
    assert encoder_fingerprint(again) == encoder_fingerprint(encoder)
    # reused when it matches; refused for an index of another encoder
    stamp = (derived.directory / INDEX_JSON).stat().st_mtime_ns
    assert open_or_derive_index(base, again, derived.directory).directory == derived.directory
    assert (derived.directory / INDEX_JSON).stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="built by encoder"):
        derive_transformed_index(derived, again, index_root / "elsewhere")
    with pytest.raises(FileExistsError):
        derive_transformed_index(base, encoder, derived.directory)


@pytest.mark.integration
def test_evaluate_transformed_runs_and_differs(tiny_colbert, scifact, index_root):
    from hil.evaluation.evaluate import EvaluationSettings, evaluate, evaluate_transformed
    from hil.evaluation.results import evaluation_statistics

    settings = EvaluationSettings(k=100, index_root=index_root, progress=False)
    plain = evaluate(tiny_colbert, scifact, settings)
    whitened, encoder = evaluate_transformed(tiny_colbert, scifact, "whitening", settings)
    assert set(whitened.run) == set(scifact.queries)
    assert whitened.details["index_dir"] != plain.details["index_dir"]
    assert whitened.details["transform"]["files"] == ["transform_colbert.pt"]
    assert whitened.name == "colbert+whitening-token-full"
    assert any(whitened.run[q] != plain.run[q] for q in scifact.queries)
    for value in whitened.aggregate.values():
        assert math.isfinite(value) and 0.0 <= value <= 1.0
    stats = evaluation_statistics([plain, whitened], n_bootstrap=200, n_permutations=500)
    (row,) = stats["paired"]
    assert (row["a"], row["b"], row["n"]) == (whitened.name, plain.name, 10)
    assert row["mean_diff"] == pytest.approx(whitened.aggregate["ndcg@10"] - plain.aggregate["ndcg@10"], abs=1e-9)
    assert 0.0 <= row["p_t_test"] <= 1.0 and 0.0 < row["p_permutation"] <= 1.0
    low, high = stats["bootstrap"][plain.name]["ndcg@10"]["low"], stats["bootstrap"][plain.name]["ndcg@10"]["high"]
    assert low <= plain.aggregate["ndcg@10"] <= high


@pytest.mark.integration
def test_evaluate_cli_with_transform(scifact, index_root, tmp_path, shared_dir):
    from hil.cli.evaluate_script import main

    out = tmp_path / "results"
    assert main(["--model", "bert-tiny-splade", "--dataset", "scifact", "--max-queries", "10", "--max-docs", "200",
                 "--seed", "0", "--dim", "32", "--doc-maxlen", "64", "--k", "100", "--index-root", str(index_root),
                 "--output", str(out), "--transform", "whitening", "--quiet", "--bootstrap-samples", "200"]) == 0
    record = json.loads((out / "metrics.json").read_text())
    assert set(record["results"]) == {"bm25", "colbert-full", "colbert+whitening-token-full"}
    assert record["results"]["colbert+whitening-token-full"]["transform"]["spec"] == "whitening"
    pairs = {(r["a"], r["b"], r["metric"]) for r in record["statistics"]["paired"]}
    assert ("colbert+whitening-token-full", "colbert-full", "ndcg@10") in pairs
    assert ("colbert-full", "bm25", "ndcg@10") in pairs
    assert "bm25_easy" in record["statistics"]
    assert (out / "colbert+whitening-token-full.trec").is_file()


def test_hil_heads_are_transformed_each_with_its_own_fit(hf_tokenizer):
    from hil.modeling.hil import HILEncoder

    from conftest import random_bert

    torch.manual_seed(0)
    hil = HILEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24,
                     _loaded=(random_bert(), hf_tokenizer)).eval()
    encoder = fit_transformed_encoder(hil, "whitening", texts=TEXTS)
    assert encoder.head_names == ("L", "H") and set(encoder.transforms) == {"L", "H"}
    assert not torch.allclose(encoder.transforms["L"].steps[0].mean, encoder.transforms["H"].steps[0].mean)
    assert encoder.inner.has_idf == hil.has_idf and not hasattr(encoder, "has_idf")  # no forwarding
    with eval_mode(encoder):
        queries, docs = encoder.encode_queries(QUERIES), encoder.encode_documents(TEXTS[:4])
        base_docs = hil.encode_documents(TEXTS[:4])
        scores = encoder.score(queries, docs)
        pairs = encoder.score_pairs(queries, docs.select(slice(0, 3)))
    for head in ("L", "H"):
        mask = docs.mask.bool()
        expected = encoder.transforms[head].transform(base_docs.heads[head][mask])
        assert torch.allclose(docs.heads[head][mask], expected, atol=1e-5)
    # HIL's own scoring (IDF-weighted L + H with its z-scores) on the transformed vectors
    assert torch.allclose(scores, hil.score(queries, docs), atol=1e-6)
    assert torch.allclose(pairs, torch.diagonal(scores[:, :3]), atol=1e-4)


# -- the Encoder contract, implemented by the wrapper itself -----------------------------------------------------

ENCODER_MEMBERS = ("architecture", "head_names", "dim", "tokenizer", "device", "encode", "encode_queries",
                   "encode_documents", "score_heads", "score", "score_pairs", "settings")


def whiten_by_hand(batch: EncodedBatch, encoder: TransformedEncoder) -> EncodedBatch:
    """Each head: z = normalize((x - mu) W) at valid tokens, 0 elsewhere (000 Eq. 10 and the cosine aggregator)."""
    heads = {}
    for head, x in batch.heads.items():
        whitening = encoder.transforms[head].steps[0]
        z = F.normalize((x.double() - whitening.mean) @ whitening.projection, dim=-1).to(x.dtype)
        heads[head] = z * batch.mask.unsqueeze(-1).to(x.dtype)
    return EncodedBatch(heads, batch.mask, batch.input_ids)


def test_every_encoder_member_is_the_wrappers_own_and_equals_the_transform_by_hand(hf_tokenizer, monkeypatch):
    from hil.modeling.hil import HILEncoder

    from conftest import random_bert

    torch.manual_seed(0)
    hil = HILEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24,
                     _loaded=(random_bert(), hf_tokenizer)).eval()
    encoder = fit_transformed_encoder(hil, "whitening", texts=TEXTS)
    assert isinstance(encoder, Encoder) and "__getattr__" not in vars(TransformedEncoder)
    for member in ENCODER_MEMBERS:
        assert member in vars(TransformedEncoder) or member in vars(encoder), member
    assert not hasattr(encoder, "idf") and not hasattr(encoder, "set_idf_from_texts")  # HIL's own: via .inner
    assert (encoder.architecture, encoder.head_names, encoder.dim) == (hil.architecture, hil.head_names, 16)
    assert encoder.tokenizer is hil.tokenizer and encoder.device == hil.device
    assert encoder.settings() == {**hil.settings(), "dim": 16, "post_transform": encoder.transform_settings()}
    with eval_mode(encoder):
        queries, docs = encoder.encode_queries(QUERIES), encoder.encode_documents(TEXTS[:3])
        via_encode = encoder.encode(hil.tokenizer.encode_queries(QUERIES), is_query=True)
        hand_q = whiten_by_hand(hil.encode_queries(QUERIES), encoder)
        hand_d = whiten_by_hand(hil.encode_documents(TEXTS[:3]), encoder)
        for got, expected in ((queries, hand_q), (via_encode, hand_q), (docs, hand_d)):
            assert torch.equal(got.mask, expected.mask) and torch.equal(got.input_ids, expected.input_ids)
            for head in ("L", "H"):
                assert torch.allclose(got.heads[head], expected.heads[head], atol=1e-5), head
        # scoring is the wrapped model's, on the transformed vectors
        assert torch.allclose(encoder.score(queries, docs), hil.score(hand_q, hand_d), atol=1e-4)
        assert torch.allclose(encoder.score_pairs(queries, docs), hil.score_pairs(hand_q, hand_d), atol=1e-4)
        for all_pairs in (True, False):
            got = encoder.score_heads(queries, docs, all_pairs=all_pairs)
            expected = hil.score_heads(hand_q, hand_d, all_pairs=all_pairs)
            assert set(got) == set(expected) == {"L", "H"}
            for head in got:
                assert got[head].shape == expected[head].shape
                assert torch.allclose(got[head], expected[head], atol=1e-4), (head, all_pairs)
    # encode passes is_query through (the encoders here give the same vectors either way, so record the calls)
    calls, inner_encode = [], hil.encode
    monkeypatch.setattr(hil, "encode", lambda batch, is_query: calls.append(is_query) or inner_encode(batch, is_query))
    with eval_mode(encoder):
        encoder.encode(hil.tokenizer.encode_queries(QUERIES), is_query=True)
        encoder.encode(hil.tokenizer.encode_documents(TEXTS[:2]), is_query=False)
    assert calls == [True, False]
    with pytest.raises(TypeError, match="expected an Encoder"):
        TransformedEncoder(torch.nn.Linear(16, 16), encoder.transforms)


@pytest.mark.integration
def test_transform_batch_on_a_colbert_batch(tiny_random_colbert):
    docs = ["isotropy of token embeddings", "whitening makes the covariance the identity matrix",
            "a normalizing flow maps data to a gaussian", "late interaction sums maxsim scores"] * 4
    with torch.no_grad():
        encoded = tiny_random_colbert.encode_documents(docs)
    emb = encoded.heads["colbert"]
    whitening = fit_whitening(emb, mode="token", mask=encoded.mask)
    out = TransformedEncoder(tiny_random_colbert, {"colbert": whitening}).transform_batch(encoded)
    new = out.heads["colbert"]
    assert new.shape == emb.shape and torch.equal(out.mask, encoded.mask)
    assert torch.all(new[~encoded.mask] == 0)
    assert torch.allclose(new[encoded.mask].norm(dim=-1), torch.ones(int(encoded.mask.sum())), atol=1e-5)

    def avgcos(v: torch.Tensor) -> float:  # 000 Eq. 4 over distinct pairs
        sims = v @ v.T
        n = len(v)
        return float((sims.sum() - sims.diagonal().sum()) / (n * (n - 1)))

    assert avgcos(new[encoded.mask]) < avgcos(emb[encoded.mask])
