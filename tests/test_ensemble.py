"""ColBERT-lambda (EnsembleEncoder): score = w_iso * score_iso + w_aniso * score_aniso, loading, retrieval surface."""

from __future__ import annotations

import pytest
import torch

from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.ensemble import EnsembleEncoder
from hil.modeling.hil import HILEncoder
from hil.modeling.loading import load_encoder, split_ensemble_source
from hil.retrieval.builder import build_index
from hil.retrieval.full_ranking import full_rank
from hil.retrieval.search import exact_rank

from conftest import random_bert

QUERIES = ["what causes fever", "effects of caffeine on sleep", "cat"]
DOCS = ["Fever is caused by infection.", "Caffeine is a stimulant, found in coffee; it delays sleep.", "",
        "Cats are small domesticated carnivores that sleep a lot."]


def colbert(hf_tokenizer, seed: int, **settings) -> ColBERTEncoder:
    torch.manual_seed(seed)
    options = {"dim": 16, "query_maxlen": 12, "doc_maxlen": 24, **settings}
    return ColBERTEncoder("random-bert", _loaded=(random_bert(seed=seed), hf_tokenizer), **options).eval()


@pytest.fixture
def members(hf_tokenizer) -> tuple[ColBERTEncoder, ColBERTEncoder]:
    return colbert(hf_tokenizer, 1), colbert(hf_tokenizer, 2)


def test_score_is_the_weighted_sum_of_the_members_scores(members):
    iso, aniso = members
    with torch.no_grad():
        expected = {name: m.score(m.encode_queries(QUERIES), m.encode_documents(DOCS))
                    for name, m in (("iso", iso), ("aniso", aniso))}
        for weights in ((1.0, 1.0), (0.25, 2.0)):
            ensemble = EnsembleEncoder(iso, aniso, weights=weights).eval()
            q, d = ensemble.encode_queries(QUERIES), ensemble.encode_documents(DOCS)
            assert set(q.heads) == {"iso", "aniso"} and ensemble.head_names == ("iso", "aniso")
            scores = ensemble.score(q, d)
            torch.testing.assert_close(scores, weights[0] * expected["iso"] + weights[1] * expected["aniso"],
                                       rtol=1e-6, atol=1e-6)
            heads = ensemble.score_heads(q, d)
            torch.testing.assert_close(heads["iso"], expected["iso"], rtol=1e-6, atol=1e-6)
            index = torch.tensor([0, 1, 2, 0])
            torch.testing.assert_close(ensemble.score_pairs(q.select(index), d), scores[index, torch.arange(4)])
    # the head vectors are exactly each member's own
    with torch.no_grad():
        q = ensemble.encode_queries(QUERIES)
        torch.testing.assert_close(q.heads["aniso"], aniso.encode_queries(QUERIES).heads["colbert"])


def test_surface_and_settings(members):
    iso, aniso = members
    ensemble = EnsembleEncoder(iso, aniso, sources=("runs/iso/last.ckpt", "runs/aniso/last.ckpt"))
    settings = ensemble.settings()
    assert settings["architecture"] == "ensemble" and ensemble.architecture == "ensemble"
    assert settings["backbone"] == {"iso": "runs/iso/last.ckpt", "aniso": "runs/aniso/last.ckpt"}
    assert settings["query_maxlen"] == 12 and settings["doc_maxlen"] == 24 and settings["dim"] == 16
    assert settings["weights"] == {"iso": 1.0, "aniso": 1.0}
    assert settings["members"]["iso"]["architecture"] == "colbert" and "backbone" not in settings["members"]["iso"]
    assert ensemble.tokenizer is iso.tokenizer and ensemble.device == torch.device("cpu") and ensemble.dim == 16
    ensemble.train()
    assert iso.training and aniso.training
    ensemble.eval()
    assert not iso.training


def test_members_that_do_not_fit_are_refused(hf_tokenizer, members):
    iso, _ = members
    with pytest.raises(ValueError, match="query_maxlen: 12 vs 16"):
        EnsembleEncoder(iso, colbert(hf_tokenizer, 3, query_maxlen=16))
    with pytest.raises(ValueError, match="doc_maxlen"):
        EnsembleEncoder(iso, colbert(hf_tokenizer, 3, doc_maxlen=30))
    with pytest.raises(ValueError, match="mask_punctuation"):
        EnsembleEncoder(iso, colbert(hf_tokenizer, 3, mask_punctuation=False))
    with pytest.raises(ValueError, match="dimensions differ"):
        EnsembleEncoder(iso, colbert(hf_tokenizer, 3, dim=8))
    hil = HILEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24, _loaded=(random_bert(), hf_tokenizer))
    with pytest.raises(ValueError, match="exactly one head"):
        EnsembleEncoder(iso, hil)
    with pytest.raises(ValueError, match="w_iso, w_aniso"):
        EnsembleEncoder(iso, members[1], weights=(1.0,))


def test_split_ensemble_source(tmp_path):
    assert split_ensemble_source("a.ckpt+b.ckpt") == ["a.ckpt", "b.ckpt"]
    assert split_ensemble_source(["a", tmp_path]) == ["a", str(tmp_path)]
    assert split_ensemble_source("runs/colbert/last.ckpt") is None
    odd = tmp_path / "with+plus"
    odd.mkdir()
    assert split_ensemble_source(str(odd)) is None  # an existing path is never split
    with pytest.raises(ValueError, match="exactly two"):
        load_encoder("a+b+c")


def test_load_encoder_builds_the_ensemble_from_exports_and_saves_it(members, tmp_path):
    iso, aniso = members
    iso.save_pretrained(tmp_path / "iso")
    aniso.save_pretrained(tmp_path / "aniso")
    spec = f"{tmp_path / 'iso'}+{tmp_path / 'aniso'}"
    with torch.no_grad():
        direct = EnsembleEncoder(iso, aniso)
        expected = direct.score(direct.encode_queries(QUERIES), direct.encode_documents(DOCS))
        for source, options in ((spec, {}), ([tmp_path / "iso", tmp_path / "aniso"], {"weights": (1.0, 1.0)})):
            loaded = load_encoder(source, **options)
            assert isinstance(loaded, EnsembleEncoder) and not loaded.training
            assert loaded.settings()["backbone"]["iso"] == str(tmp_path / "iso")
            got = loaded.score(loaded.encode_queries(QUERIES), loaded.encode_documents(DOCS))
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        weighted = load_encoder(spec, weights=(2.0, 0.5))
        weighted.save_pretrained(tmp_path / "lambda")
        reloaded = load_encoder(tmp_path / "lambda")
        assert isinstance(reloaded, EnsembleEncoder) and reloaded.weights == (2.0, 0.5)
        got = reloaded.score(reloaded.encode_queries(QUERIES), reloaded.encode_documents(DOCS))
        torch.testing.assert_close(got, weighted.score(weighted.encode_queries(QUERIES),
                                                       weighted.encode_documents(DOCS)), rtol=0, atol=0)
    with pytest.raises(ValueError, match="keep their own settings"):
        load_encoder(spec, dim=32)


def test_retrieval_indexes_both_heads_and_reports_which_retrieved(members, tmp_path):
    ensemble = EnsembleEncoder(*members).eval()
    doc_ids = [f"d{i}" for i in range(len(DOCS))]
    index = build_index(ensemble, doc_ids, DOCS, tmp_path / "index", progress=False)
    assert set(index.head_names) == {"iso", "aniso"}
    queries = {f"q{i}": text for i, text in enumerate(QUERIES)}
    full = full_rank(ensemble, index, queries, k=10, ncandidates=64, progress=False)
    exact = exact_rank(ensemble, index, queries, k=10, progress=False)
    with torch.no_grad():
        reference = ensemble.score(ensemble.encode_queries(QUERIES), ensemble.encode_documents(DOCS))
    for i in range(len(QUERIES)):
        qid = f"q{i}"
        assert set(full.run[qid]) == set(exact.run[qid])  # a tiny corpus: every document is a candidate
        for doc, score in exact.run[qid].items():
            assert score == pytest.approx(reference[i, doc_ids.index(doc)].item(), abs=2e-2)  # fp16 index
        for doc, heads in full.sources[qid].items():
            assert heads and set(heads) <= {"iso", "aniso"}
