"""Every model config in configs/*.yaml trains through the CLI (2 steps, smoke preset), exports, loads, and evaluates
on a SciFact slice; ColBERT-lambda is evaluated from the iso and aniso exports."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
from pathlib import Path

import pytest
import yaml

from hil.cli.train import train_main
from hil.data.beir import load_beir
from hil.evaluation.evaluate import EvaluationSettings, evaluate
from hil.modeling.ensemble import EnsembleEncoder
from hil.modeling.loading import load_encoder

from nway_examples import write_nway_examples

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
VARIANTS = sorted(p.stem for p in (REPO / "configs" / "variants").glob("*.yaml"))
CONFIGS = ["colbert", *VARIANTS]  # the base config alone is ColBERT
AUTHORS = [name for name in VARIANTS if name.endswith("_authors")]  # issue 13: the HIL authors' released recipes
DISTILLED = [name for name in VARIANTS if "distill" in name]         # issue 22: trained from n-way examples
LEGACY = [name for name in CONFIGS if name not in AUTHORS + DISTILLED]  # the configs 21203ed had
# `train.py fit --config <config> [--config <preset>] --print_config` of every config as main resolved it at commit
# 21203ed, before configs became a base plus deltas (each variant then a full copy of configs/colbert.yaml).
BEFORE = json.loads((REPO / "tests" / "fixtures" / "print_config_21203ed.json").read_text())
PAPER_LAMBDAS = {  # HIL Appendix A.3
    "colbert_iso": ("interiso", 0.4), "colbert_aniso": ("interiso", -0.1),
    "colbert_cosreg_iso": ("cosreg", 0.2), "colbert_cosreg_aniso": ("cosreg", -0.1),
    "colbert_istar_iso": ("istar", 0.2), "colbert_istar_aniso": ("istar", -0.6),
}
HIL_ABLATIONS = {"colbert_hil": (True, True), "colbert_hil_no_reg_l": (False, True),
                 "colbert_hil_no_reg_h": (True, False), "colbert_hil_no_reg": (False, False)}
BEIR_MINING_UNSET = {"beir": None, "beir_split": "train", "negatives_per_query": 1, "bm25_depth": 100}  # 21203ed's
REGULARIZER_KINDS = {None: "none", "hil.isotropy.regularizers.InterIsoRegularizer": "interiso",
                     "hil.isotropy.regularizers.CosRegRegularizer": "cosreg",
                     "hil.isotropy.regularizers.IStarRegularizer": "istar"}


def config_args(name: str, preset: str | None = None) -> list[str]:
    args = ["--config", str(REPO / "configs" / "colbert.yaml")]
    if name != "colbert":
        args += ["--config", str(REPO / "configs" / "variants" / f"{name}.yaml")]
    return args + (["--config", str(REPO / "configs" / "presets" / f"{preset}.yaml")] if preset else [])


def print_config(args: list[str]) -> dict:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), pytest.raises(SystemExit) as done:
        train_main(["fit", *args, "--print_config"])
    assert done.value.code in (0, None)
    return yaml.safe_load(buffer.getvalue())


def as_before(new: dict) -> dict:
    """A resolved config of today in the layout of 21203ed: one flat ``model.init_args`` of ColBERTModule or
    HILModule (encoder settings, optimizer, schedule, loss and regularizer settings side by side), the non-finite
    policy in the model, IDF sourcing in the model, no callbacks group. Anything that moved is checked on the way."""
    new = copy.deepcopy(new)
    model, data = new.pop("model"), new.pop("data")
    # Added since (issue 14): the line-offsets cache folder, unset by every config; (issue 22) documents per example,
    # unset (triples are N = 2).
    assert (data.pop("cache_dir"), data.pop("nway")) == (None, None)
    # Since issue 39 the source is one reader chosen by class_path (data.source), in place of a key per reader and
    # per reader setting; every config here reads text triples: 21203ed's keys are its path and the BEIR-mining
    # defaults, which chose nothing.
    source = data.pop("source")
    assert source["class_path"] == "hil.data.triples_file.TextTriples" and set(source["init_args"]) == {"path"}
    data.update(triples=source["init_args"]["path"], **BEIR_MINING_UNSET)
    # Added since (issue 22): the objective's further terms and GradCache, unset; every loss got a `weight`
    # (1: the objective is the loss as it was; tests/test_terms.py checks the N = 2 training is bit-identical).
    assert (model.pop("terms"), model.pop("gradcache_chunk_size")) == (None, None)
    assert model["loss"].setdefault("init_args", {}).pop("weight") == 1.0
    if not model["loss"]["init_args"]:
        del model["loss"]["init_args"]
    new.pop("progress_lines", None)  # added since (train.py's progress-line callback), not a training setting
    # Added since (issue 29): torch's fp32 matmul precision, unset (torch's default) but by presets/gpu.yaml.
    assert new.pop("float32_matmul_precision", None) is None
    # Added since (issue 40): what fit does when its root holds an interrupted run, unset (stop and say so).
    assert new.pop("resume", None) is None
    assert new.pop("step_reseed") == {"seed": None}
    # Deliberate changes since (issue 13, ColBERT v1's conventions): clipping at 2.0, [MASK] padding not attended,
    # BERT-style head init. Checked here, then set back to what 21203ed had.
    assert new["trainer"]["gradient_clip_val"] == 2.0
    new["trainer"]["gradient_clip_val"] = None
    encoder = model["encoder"]
    assert encoder["init_args"]["attend_to_mask_tokens"] is False and encoder["init_args"]["head_init"] == "bert"
    old = {k: encoder["init_args"][k] for k in ("backbone", "dim", "query_maxlen", "doc_maxlen", "query_marker",
                                                 "doc_marker", "mask_punctuation")}
    optimizer, schedule = model["optimizer"], model["lr_scheduler"]
    assert optimizer["class_path"] == "torch.optim.AdamW" and optimizer["init_args"]["betas"] == [0.9, 0.999]
    assert not optimizer["init_args"]["amsgrad"] and schedule["class_path"] == "hil.modeling.module.LinearWarmup"
    old.update(lr=optimizer["init_args"]["lr"], adam_eps=optimizer["init_args"]["eps"],
               weight_decay=optimizer["init_args"]["weight_decay"], warmup_steps=schedule["init_args"]["warmup_steps"],
               init_from=model["init_from"], on_nonfinite_loss=new.pop("nonfinite_guard")["policy"])
    idf = {"idf_source": data.pop("idf_source"), "idf_max_docs": data.pop("idf_max_docs")}
    if encoder["class_path"] == "hil.modeling.hil.HILEncoder":
        assert model["loss"]["class_path"] == "hil.modeling.losses.HILLoss" and model["regularizer"] is None
        assert encoder["init_args"]["idf_source"] is None  # a label the IDF table writes, not a setting
        old.update(idf, **model["loss"]["init_args"], zscore_momentum=encoder["init_args"]["zscore_momentum"],
                   zscore_eps=encoder["init_args"]["zscore_eps"])
        class_path = "hil.modeling.hil.HILModule"
    else:
        assert encoder["class_path"] == "hil.modeling.encoder.ColBERTEncoder"
        loss = model["loss"]["class_path"]
        assert loss in ("hil.modeling.losses.PairwiseCE", "hil.modeling.losses.InBatchCE")
        regularizer = model["regularizer"] or {"init_args": {}}
        reg_args = regularizer["init_args"]
        old.update(in_batch_negatives=loss.endswith("InBatchCE"),
                   regularizer=REGULARIZER_KINDS[regularizer.get("class_path")],
                   reg_weight=reg_args.get("weight", 0.0), reg_zeta=reg_args.get("zeta", 0.2),
                   reg_shrinkage_target=reg_args.get("shrinkage_target", "identity"),
                   reg_momentum=reg_args.get("momentum", 0.1))
        class_path = "hil.modeling.colbert.ColBERTModule"
    return {**new, "model": {"class_path": class_path, "init_args": old}, "data": data}


@pytest.mark.parametrize("key", sorted(BEFORE))
def test_print_config_resolves_every_variant_as_before(key):
    """Base config + delta (+ preset) resolves to the settings the full-copy config had, key for key; only the
    top-level optimizer / lr_scheduler groups (always null, now the model's) are gone."""
    name, _, preset = key.partition("+")
    before = {k: v for k, v in BEFORE[key].items() if k not in ("optimizer", "lr_scheduler")}
    assert as_before(print_config(config_args(name, preset or None))) == before


def test_variant_configs_are_short_deltas():
    assert set(BEFORE) == {f"{name}{suffix}" for name in LEGACY for suffix in ("", "+cpu", "+smoke")}
    for name in VARIANTS:
        lines = [line for line in (REPO / "configs" / "variants" / f"{name}.yaml").read_text().splitlines()
                 if line.strip() and not line.lstrip().startswith("#")]
        assert len(lines) <= 15, (name, len(lines))


def test_distilled_configs_train_from_nway_examples_with_a_kl_term():
    """Issue 22: the distilled deltas select the KL term and an n-way source; the isotropy family on top is a
    regularizer (ColBERT) or ColBERT-HIL's own term beside the KL on each head."""
    assert set(DISTILLED) == {"colbert_distill", "colbert_distill_iso", "colbert_distill_aniso", "colbert_hil_distill"}
    regularizers = {"colbert_distill": None, "colbert_distill_iso": 0.4, "colbert_distill_aniso": -0.1,
                    "colbert_hil_distill": None}
    for name in DISTILLED:
        resolved = print_config(config_args(name))
        model, data = resolved["model"], resolved["data"]
        assert model["loss"]["class_path"] == "hil.modeling.losses.KLDistillation", name
        # what `hil teacher` wrote, alone: its texts and nway come from its .meta.json
        assert data["source"] == {"class_path": "hil.data.teacher_output.TeacherOutput",
                                  "init_args": {"path": "distill/examples.jsonl"}} and data["nway"] is None, name
        weight = regularizers[name]
        assert (model["regularizer"] or {}).get("init_args", {}).get("weight") == weight, name
    model = print_config(config_args("colbert_hil_distill"))["model"]
    assert model["encoder"]["class_path"] == "hil.modeling.hil.HILEncoder"
    assert model["loss"]["init_args"]["heads"] == "each"
    assert model["terms"] == [{"class_path": "hil.modeling.terms.HILIsotropy",
                               "init_args": {"weight": -0.3, "reg_l": True, "reg_h": True}}]


def test_authors_configs_select_the_released_code():
    """docs/fidelity.md's "authors' code" column, as the CLI resolves it."""
    model = print_config(config_args("colbert_hil_authors"))["model"]
    assert model["loss"] == {"class_path": "hil.modeling.losses.HILAuthorsLoss",
                             "init_args": {"reg_weight": -0.3, "weight": 1.0}}
    settings = model["encoder"]["init_args"]
    assert {k: settings[k] for k in ("query_maxlen", "doc_maxlen", "lexical_input", "idf_formula",
                                     "lexical_query_tokens", "zscore_std", "zscore_eval", "attend_to_mask_tokens")} == {
        "query_maxlen": 300, "doc_maxlen": 300, "lexical_input": "embedding_output", "idf_formula": "authors",
        "lexical_query_tokens": "all", "zscore_std": "unbiased", "zscore_eval": "per_query",
        "attend_to_mask_tokens": False}
    assert print_config(config_args("colbert_hil_authors"))["data"]["idf_source"] == "train_queries"
    for name, weight in (("colbert_iso_authors", 0.4), ("colbert_aniso_authors", -0.1)):
        regularizer = print_config(config_args(name))["model"]["regularizer"]
        assert regularizer["class_path"] == "hil.isotropy.regularizers.ConditionalIsotropyRegularizer"
        assert regularizer["init_args"]["weight"] == weight


def test_every_paper_variant_has_its_settings():
    assert set(PAPER_LAMBDAS) | set(HIL_ABLATIONS) <= set(VARIANTS)
    for name in LEGACY:
        args = as_before(print_config(config_args(name)))["model"]["init_args"]
        assert (args["query_maxlen"], args["doc_maxlen"], args["lr"], args["dim"]) == (32, 180, 3e-6, 128), name
    for name, (kind, lam) in PAPER_LAMBDAS.items():
        args = as_before(print_config(config_args(name)))["model"]["init_args"]
        assert (args["regularizer"], args["reg_weight"]) == (kind, lam), name
    for name, (reg_l, reg_h) in HIL_ABLATIONS.items():
        args = as_before(print_config(config_args(name)))["model"]["init_args"]
        assert (args["reg_weight"], args["reg_l"], args["reg_h"]) == (-0.3, reg_l, reg_h), name


@pytest.fixture(scope="module")
def scifact_slice(shared_dir):
    return load_beir("scifact").subset(n_queries=10, n_docs=200)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_dir):
    """Train a config once per module (2 steps, smoke preset; the distilled ones from a small n-way file) and
    return its export directory."""
    exports: dict[str, Path] = {}

    def train(name: str) -> Path:
        if name not in exports:
            root = tmp_path_factory.mktemp(name)
            # the distilled variants read `hil teacher`'s output (TeacherOutput): this small file's reader replaces it
            data = write_nway_examples(root) if name in DISTILLED else []
            cli = train_main(["fit", *config_args(name, "smoke"), *data,
                              "--trainer.default_root_dir", str(root), "--trainer.logger", "false",
                              "--trainer.max_steps", "2", "--trainer.enable_checkpointing", "false",
                              "--trainer.callbacks", "[]", "--data.max_triples", "8", "--data.batch_size", "4",
                              "--export_dir", str(root / "export")])
            assert cli.trainer.global_step == 2, name
            exports[name] = root / "export"
        return exports[name]

    return train


def check_evaluation(encoder, dataset, tmp_path: Path) -> dict[str, float]:
    evaluation = evaluate(encoder, dataset, EvaluationSettings(mode="full", k=100, index_root=tmp_path / "indexes",
                                                               progress=False))
    assert set(evaluation.run) == set(dataset.queries)
    for metric, value in evaluation.aggregate.items():
        assert math.isfinite(value) and 0.0 <= value <= 1.0, (metric, value)
    return evaluation.aggregate


@pytest.mark.parametrize("name", CONFIGS)
def test_config_trains_exports_and_evaluates(name, trained, scifact_slice, tmp_path):
    encoder = load_encoder(trained(name))
    settings = encoder.settings()
    assert (settings["query_maxlen"], settings["doc_maxlen"]) == (16, 48)  # the smoke preset applied on top
    if name in HIL_ABLATIONS or name in ("colbert_hil_authors", "colbert_hil_distill"):
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


def test_evaluate_cli_recomputes_hil_idf_on_the_target_corpus(trained, tmp_path, capsys):
    """``--idf corpus`` replaces the IDF learnt from the training triples with the evaluated corpus's."""
    from hil.cli.evaluate_script import main

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
    capsys.readouterr()
    assert main(["--model", str(trained("colbert")), "--idf", "corpus", "--output", str(tmp_path / "c"), *common]) == 2
    assert "needs a model with IDF weights" in capsys.readouterr().err


def test_evaluate_cli_encodes_documents_with_onnx_int8(trained, tmp_path):
    """``--encode-documents onnx-int8``: the corpus goes through ONNX Runtime int8, in an index folder of its own,
    and the results record how; the nDCG stays near the fp32 run's on the same slice."""
    pytest.importorskip("onnxruntime")
    from hil.cli.evaluate_script import main

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


def test_diagnostic_deltas_change_one_setting_of_the_model_they_stack_on():
    """configs/variants/diagnostics/*.yaml, stacked after colbert_hil.yaml as the paper experiment does."""
    from hil.experiments.profiles import PROFILES

    profile = PROFILES["smoke"]
    paper = print_config(profile.config_args("hil")[:-2])["model"]["encoder"]["init_args"]
    changed = {"hil_detach_h": {"zscore_detach": ["H"]}, "hil_fixed_temperature": {"zscore_temperature": 1.0},
               "hil_attend_mask": {"attend_to_mask_tokens": True}, "hil_torch_init": {"head_init": "torch"},
               "hil_no_clip": {}}
    for name, expected in changed.items():
        resolved = print_config(profile.config_args(name)[:-2])
        args = resolved["model"]["encoder"]["init_args"]
        assert {k: v for k, v in args.items() if paper.get(k) != v} == expected, name
        assert resolved["trainer"]["gradient_clip_val"] == (None if name == "hil_no_clip" else 2.0), name
