"""Every model config in configs/*.yaml trains through the CLI (2 steps, smoke preset), exports, loads, and evaluates
on a SciFact slice; ColBERT-lambda is evaluated from the iso and aniso exports."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from hil.cli import train_main
from hil.data.beir import load_beir
from hil.evaluation.pipeline import evaluate_retriever
from hil.modeling.ensemble import EnsembleEncoder
from hil.modeling.loading import load_encoder

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
PAPER_LAMBDAS = {  # HIL Appendix A.3
    "colbert_iso": ("interiso", 0.4), "colbert_aniso": ("interiso", -0.1),
    "colbert_cosreg_iso": ("cosreg", 0.2), "colbert_cosreg_aniso": ("cosreg", -0.1),
    "colbert_istar_iso": ("istar", 0.2), "colbert_istar_aniso": ("istar", -0.6),
}
HIL_ABLATIONS = {"colbert_hil": (True, True), "colbert_hil_no_reg_l": (False, True),
                 "colbert_hil_no_reg_h": (True, False), "colbert_hil_no_reg": (False, False)}


def read_config(name: str) -> dict:
    with open(REPO / "configs" / f"{name}.yaml", encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def test_every_paper_variant_has_a_config_with_its_settings():
    assert set(PAPER_LAMBDAS) | set(HIL_ABLATIONS) | {"colbert"} <= set(CONFIGS)
    reference = read_config("colbert")
    for name in CONFIGS:
        config = read_config(name)
        assert config["trainer"]["default_root_dir"] == f"runs/{name}", name
        assert config["data"] == reference["data"], name
        assert {k: v for k, v in config["trainer"].items() if k != "default_root_dir"} == \
            {k: v for k, v in reference["trainer"].items() if k != "default_root_dir"}, name
        args = config["model"]["init_args"]
        assert (args["query_maxlen"], args["doc_maxlen"], args["lr"], args["dim"]) == (32, 180, 3e-6, 128), name
    for name, (kind, lam) in PAPER_LAMBDAS.items():
        args = read_config(name)["model"]["init_args"]
        assert (args["regularizer"], args["reg_weight"]) == (kind, lam), name
    for name, (reg_l, reg_h) in HIL_ABLATIONS.items():
        config = read_config(name)
        assert config["model"]["class_path"] == "hil.modeling.hil.HILModule"
        args = config["model"]["init_args"]
        assert (args["reg_weight"], args["reg_l"], args["reg_h"]) == (-0.3, reg_l, reg_h), name


@pytest.fixture(scope="module")
def scifact_slice(shared_dir):
    return load_beir("scifact").subset(n_queries=10, n_docs=200)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_dir):
    """Train a config once per module (2 steps, smoke preset) and return its export directory."""
    exports: dict[str, Path] = {}

    def train(name: str) -> Path:
        if name not in exports:
            root = tmp_path_factory.mktemp(name)
            cli = train_main(["fit", "--config", str(REPO / "configs" / f"{name}.yaml"),
                              "--config", str(REPO / "configs/presets/smoke.yaml"),
                              "--trainer.default_root_dir", str(root), "--trainer.logger", "false",
                              "--trainer.max_steps", "2", "--trainer.enable_checkpointing", "false",
                              "--trainer.callbacks", "[]", "--data.max_triples", "8", "--data.batch_size", "4",
                              "--export_dir", str(root / "export")])
            assert cli.trainer.global_step == 2, name
            exports[name] = root / "export"
        return exports[name]

    return train


def check_evaluation(encoder, dataset, tmp_path: Path) -> dict[str, float]:
    evaluation = evaluate_retriever(encoder, dataset, mode="full", k=100, index_root=tmp_path / "indexes",
                                    progress=False)
    assert set(evaluation.run) == set(dataset.queries)
    for metric, value in evaluation.aggregate.items():
        assert math.isfinite(value) and 0.0 <= value <= 1.0, (metric, value)
    return evaluation.aggregate


@pytest.mark.parametrize("name", CONFIGS)
def test_config_trains_exports_and_evaluates(name, trained, scifact_slice, tmp_path):
    encoder = load_encoder(trained(name))
    settings = encoder.settings()
    assert (settings["query_maxlen"], settings["doc_maxlen"]) == (16, 48)  # the smoke preset applied on top
    if name in HIL_ABLATIONS:
        assert encoder.head_names == ("L", "H")
        assert encoder.has_idf, "IDF is computed at setup and exported with the model"
        assert int(encoder.zscore["L"].updates) == 2
    else:
        assert encoder.architecture == "colbert"
    check_evaluation(encoder, scifact_slice, tmp_path)


def test_colbert_lambda_from_the_iso_and_aniso_exports(trained, scifact_slice, tmp_path):
    encoder = load_encoder(f"{trained('colbert_iso')}+{trained('colbert_aniso')}")
    assert isinstance(encoder, EnsembleEncoder)
    aggregate = check_evaluation(encoder, scifact_slice, tmp_path)
    assert "ndcg@10" in aggregate


def test_evaluate_cli_recomputes_hil_idf_on_the_target_corpus(trained, tmp_path):
    """``--idf corpus`` replaces the IDF learnt from the training triples with the evaluated corpus's."""
    from hil.evaluation.cli import main

    export = trained("colbert_hil")
    common = ["--dataset", "scifact", "--max-queries", "6", "--max-docs", "60", "--no-bm25", "--no-stats",
              "--quiet", "--k", "20", "--index-root", str(tmp_path / "indexes")]
    runs = {}
    for idf in ("model", "corpus"):
        assert main(["--model", str(export), "--idf", idf, "--output", str(tmp_path / idf), *common]) == 0
        record = json.loads((tmp_path / idf / "metrics.json").read_text())
        (model,) = record["models"].values()
        runs[idf] = model
    assert "scifact corpus" in runs["corpus"]["settings"]["idf_source"]
    assert "scifact" not in runs["model"]["settings"]["idf_source"]
    assert runs["model"]["fingerprint"] != runs["corpus"]["fingerprint"]
    with pytest.raises(SystemExit, match="needs a model with IDF weights"):
        main(["--model", str(trained("colbert")), "--idf", "corpus", "--output", str(tmp_path / "c"), *common])


def test_evaluate_cli_encodes_documents_with_onnx_int8(trained, tmp_path):
    """``--encode-documents onnx-int8``: the corpus goes through ONNX Runtime int8, in an index folder of its own,
    and the results record how; the nDCG stays near the fp32 run's on the same slice."""
    pytest.importorskip("onnxruntime")
    from hil.evaluation.cli import main

    common = ["--model", str(trained("colbert")), "--dataset", "scifact", "--max-queries", "20", "--max-docs", "150",
              "--no-bm25", "--no-stats", "--quiet", "--k", "20", "--index-root", str(tmp_path / "indexes")]
    records = {}
    for encoding in ("fp32", "onnx-int8"):
        assert main([*common, "--encode-documents", encoding, "--output", str(tmp_path / encoding)]) == 0
        records[encoding] = json.loads((tmp_path / encoding / "metrics.json").read_text())
    (fp32,) = records["fp32"]["results"].values()
    (int8,) = records["onnx-int8"]["results"].values()
    assert fp32["document_encoding"] is None
    assert int8["document_encoding"]["quantize"] == "onnx-int8"
    assert int8["index_dir"] != fp32["index_dir"] and int8["index_dir"].endswith("-onnx-int8")
    assert abs(int8["metrics"]["ndcg@10"] - fp32["metrics"]["ndcg@10"]) < 0.05
