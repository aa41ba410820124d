"""Queries through ONNX Runtime for search latency (EvaluationSettings.query_encoding / --encode-queries onnx): the
same vectors as the model's to float rounding, the same ranking, used by full ranking, recorded in the identity."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")

from hil.errors import UserError
from hil.evaluation.evaluate import EvaluationSettings
from hil.evaluation.runner import DatasetSpec, Experiment, ModelSpec, StatisticsSettings, run_experiment
from hil.modeling.contracts import EncodedBatch
from hil.modeling.loading import load_encoder
from hil.retrieval.builder import build_index
from hil.retrieval.full_ranking import full_rank
from hil.retrieval.onnx_encode import onnx_query_encoder

QUERIES = ["what causes the common cold", "p53 mutation in cancer", "a query of a few words, with punctuation!"]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.manual_seed(0)
    return load_encoder(str(tiny_model_dir), dim=16).eval()


def test_onnx_queries_are_the_models_vectors_and_the_model_is_untouched(model):
    view = onnx_query_encoder(model)
    with torch.inference_mode():
        ours, theirs = model.encode_queries(QUERIES), view.encode_queries(QUERIES)
    assert torch.equal(ours.mask, theirs.mask) and torch.equal(ours.input_ids, theirs.input_ids)
    assert (ours.heads["colbert"] - theirs.heads["colbert"]).abs().max() < 1e-5
    assert type(model.backbone).__name__ != "OnnxBackbone" and view.linear is model.linear  # heads shared


def test_full_rank_encodes_queries_with_the_query_encoder(model, tiny_model_dir, tmp_path):
    docs = [f"document {i} about {w}" for i, w in enumerate(["colds", "cancer", "p53", "viruses", "genes"] * 4)]
    index = build_index(model, [f"d{i}" for i in range(len(docs))], docs, tmp_path / "index", progress=False)
    queries = {f"q{i}": text for i, text in enumerate(QUERIES)}
    plain = full_rank(model, index, queries, k=5, progress=False)
    fast = full_rank(model, index, queries, k=5, progress=False, query_encoder=onnx_query_encoder(model))
    assert {q: list(d) for q, d in fast.run.items()} == {q: list(d) for q, d in plain.run.items()}
    for qid in queries:
        assert np.allclose(list(fast.run[qid].values()), list(plain.run[qid].values()), atol=1e-4)

    class Reversed(torch.nn.Module):  # a query encoder that gives other vectors: the ranking must follow it
        def encode_queries(self, texts):
            encoded = model.encode_queries(texts)
            return EncodedBatch({h: -v for h, v in encoded.heads.items()}, encoded.mask, encoded.input_ids)

    other = full_rank(model, index, queries, k=5, progress=False, query_encoder=Reversed())
    assert other.run != plain.run


@pytest.mark.integration
def test_evaluation_with_onnx_queries_is_recorded_and_recomputed(tiny_model_dir, tmp_path):
    def experiment(query_encoding):
        settings = EvaluationSettings(k=20, index_root=str(tmp_path / "indexes"), progress=False,
                                      query_encoding=query_encoding)
        return Experiment([DatasetSpec("scifact", max_queries=8, max_docs=100)],
                          [ModelSpec(str(tiny_model_dir), name="tiny", dim=16)], tmp_path / "out", settings=settings,
                          statistics=StatisticsSettings(enabled=False), quiet=True)

    (plain,) = run_experiment(experiment(None))
    (fast,) = run_experiment(experiment("onnx"))
    record = json.loads((tmp_path / "out" / "scifact" / "tiny.json").read_text())
    assert record["identity"]["evaluation"]["query_encoding"] == "onnx"  # recomputed, not kept
    assert record["details"]["search_stats"]["query_encoding"]["method"].startswith("onnxruntime")
    assert fast.columns[-1].evaluation is not None
    assert fast.columns[-1].record["metrics"]["ndcg@10"] == pytest.approx(
        plain.columns[-1].record["metrics"]["ndcg@10"], abs=1e-9)
    settings = json.loads((tmp_path / "out" / "scifact" / "metrics.json").read_text())["settings"]["evaluation"]
    assert settings["query_encoding"] == "onnx"


@pytest.mark.parametrize("changes, words", [({"query_encoding": "int8"}, "query_encoding must be one of"),
                                            ({"query_encoding": "onnx", "mode": "exhaustive", "index_root": None},
                                             "full-ranking")])
def test_bad_query_encoding_settings_are_refused(changes, words):
    with pytest.raises(UserError, match=words):
        EvaluationSettings(**changes)
