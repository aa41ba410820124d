"""The paper experiment runner: its pure pieces against obvious references, and the smoke profile end to end."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hil.cli.paper import main
from hil.data.beir import BeirDataset
from hil.evaluation.evaluate import first_stage
from hil.evaluation.runs import read_trec_run
from hil.experiments.paper import head_overlap, relevant_pairs
from hil.experiments.profiles import (
    DATASETS,
    DEFAULT_VARIANTS,
    DIAGNOSTICS,
    FIRST_STAGES,
    PROFILES,
    VARIANTS,
    default_datasets,
)
from hil.experiments.records import NOT_COLUMNS, dataset_column, delta_inter_iso, load_dataset
from hil.modeling.encoder import ColBERTEncoder
from hil.retrieval.encoding import encode_document_tokens, eval_mode
from hil.retrieval.search import score_documents


def _dataset() -> BeirDataset:
    corpus = {f"d{i}": {"title": "", "text": f"document {i}"} for i in range(6)}
    queries = {"q1": "one", "q2": "two", "q3": "three"}
    qrels = {"q1": {"d3": 1, "d1": 2, "d5": 2}, "q2": {"d0": 0, "d4": 1}, "q3": {"d9": 2}}
    return BeirDataset(name="toy", corpus=corpus, queries=queries, qrels=qrels, split="test", source="memory")


def test_relevant_pairs_take_the_highest_grade_then_the_smallest_id_and_skip_unjudged():
    pairs = relevant_pairs(_dataset(), limit=10, seed=0)
    # q1: grade 2 ties between d1 and d5 -> d1; q2: d0 has grade 0 -> d4; q3: d9 is not in the corpus -> none
    assert pairs == [("q1", "d1"), ("q2", "d4")]
    assert len(relevant_pairs(_dataset(), limit=1, seed=0)) == 1


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(2, 30), st.integers(1, 12), st.integers(0, 2 ** 31 - 1))
def test_head_overlap_counts_match_set_arithmetic(n_queries, n_docs, depth, seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(n_queries, n_docs)), rng.normal(size=(n_queries, n_docs))
    result = head_overlap({"L": a, "H": b}, depth)
    d = min(depth, n_docs)
    both = only_a = only_b = 0
    for row in range(n_queries):
        top_a = set(np.argsort(-a[row])[:d].tolist())
        top_b = set(np.argsort(-b[row])[:d].tolist())
        both += len(top_a & top_b)
        only_a += len(top_a - top_b)
        only_b += len(top_b - top_a)
    assert (result["both"], result["only_L"], result["only_H"]) == (both, only_a, only_b)
    assert result["total"] == only_a + only_b + both
    assert only_a + both == only_b + both == n_queries * d
    assert head_overlap({"colbert": a}, depth) is None


def test_delta_inter_iso_is_anisotropic_minus_isotropic():
    assert delta_inter_iso({"L": 0.1, "H": 0.7}) == pytest.approx(0.6)
    assert delta_inter_iso({"iso": 0.3, "aniso": 0.2}) == pytest.approx(-0.1)
    assert delta_inter_iso({"colbert": 0.4}) is None


def test_score_documents_by_head_matches_score(tiny_model_dir):
    torch.manual_seed(0)
    encoder = ColBERTEncoder(backbone=str(tiny_model_dir), dim=16, query_maxlen=8, doc_maxlen=24)
    texts = ["alpha beta gamma", "delta", "epsilon zeta eta theta iota kappa", "lambda mu"]
    with eval_mode(encoder):
        store = encode_document_tokens(encoder, texts, batch_size=2).to_store([f"d{i}" for i in range(4)])
        queries = encoder.encode_queries(["alpha", "mu nu"])
        every = np.arange(4)
        combined = score_documents(encoder, queries, store, every)
        heads = score_documents(encoder, queries, store, every, by_head=True)
    assert list(heads) == ["colbert"]
    np.testing.assert_allclose(heads["colbert"], combined, rtol=0, atol=0)


def test_profiles_cover_every_variant_config():
    repo_root = Path(__file__).resolve().parents[1]
    for delta, _ in VARIANTS.values():
        for part in (delta,) if isinstance(delta, str) else (delta or ()):
            assert (repo_root / "configs" / "variants" / f"{part}.yaml").is_file(), part
    for profile in PROFILES.values():
        assert set(profile.slices) <= set(DATASETS)
        assert (repo_root / "configs" / "presets" / profile.preset).is_file()
    shorter = replace(PROFILES["cpu"], max_steps=3)
    args = shorter.config_args("hil")
    assert args[args.index("--trainer.max_steps") + 1] == "3" and shorter.training.max_steps == 3
    assert "--trainer.max_steps" not in PROFILES["cpu"].config_args("hil")


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profile_budget_is_what_train_py_resolves(name):
    """The budget a report states (read from the YAML files) is what the training command resolves."""
    import contextlib
    import io

    import yaml

    from hil.cli.train import train_main

    profile = PROFILES[name]
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), pytest.raises(SystemExit):
        train_main(["fit", *profile.config_args("hil"), "--print_config"])
    config = yaml.safe_load(buffer.getvalue())
    encoder, budget = config["model"]["encoder"]["init_args"], profile.training
    assert config["model"]["encoder"]["class_path"] == "hil.modeling.hil.HILEncoder"
    assert (budget.backbone, budget.query_maxlen, budget.doc_maxlen) == (encoder["backbone"], encoder["query_maxlen"],
                                                                         encoder["doc_maxlen"])
    assert (budget.triples, budget.max_triples, budget.batch_size) == (config["data"]["source"]["init_args"]["path"],
                                                                       config["data"]["max_triples"],
                                                                       config["data"]["batch_size"])
    assert budget.lr == config["model"]["optimizer"]["init_args"]["lr"]
    assert budget.warmup_steps == config["model"]["lr_scheduler"]["init_args"]["warmup_steps"]
    trainer = config["trainer"]
    assert (budget.max_steps, budget.precision, budget.accelerator) == (trainer["max_steps"], trainer["precision"],
                                                                        trainer["accelerator"])
    assert budget.seed == config["seed_everything"]


@pytest.mark.integration
def test_dl19_is_the_official_bm25_top100_with_graded_qrels(shared_dir):
    """DL19 re-ranks the official BM25 run, whose own row is that run's score: 0.5058 on the whole set."""
    assert DATASETS["dl19"] == ("rerank", "msmarco/dl19") and FIRST_STAGES["dl19"].relevance_level == 2
    dataset, bm25 = load_dataset("dl19", PROFILES["cpu"])
    assert (len(dataset.queries), len(dataset.corpus), dataset.judged_outside_corpus) == (43, 4297, 7003)
    assert dataset.relevance_level == 2 and bm25.name == "bm25"
    assert bm25.aggregate["ndcg@10"] == pytest.approx(0.5058, abs=5e-5)
    given = read_trec_run(shared_dir / "data" / "msmarco" / "dl19" / "bm25-top100.trec")
    assert bm25.run == given and all(len(docs) == 100 for docs in first_stage(bm25, 100).values())
    assert dataset_column("dl19", 100) == "TREC DL19, re-ranking BM25 top 100, graded qrels"
    # a slice keeps its queries' candidates, and BM25's row is the given run on the slice's queries
    small, bm25_small = load_dataset("dl19", PROFILES["smoke"])
    depth = PROFILES["smoke"].rerank_depth
    assert len(small.queries) == 8 and set(bm25_small.run) == set(small.queries)
    assert all(set(docs) <= set(small.corpus) for docs in first_stage(bm25_small, depth).values())
    assert all(bm25_small.run[q] == given[q] for q in small.queries)


@pytest.mark.integration
def test_smoke_dl19_reranks_the_given_bm25_run(tmp_path, capsys):
    """On DL19 BM25's row is the given run (scored on the slice) and a model re-ranks exactly its top 20; a finished
    DL19 evaluation of other data (the old judged pool) is redone, not reused."""
    out = tmp_path / "smoke"
    assert main(["--profile", "smoke", "--output", str(out), "--variants", "colbert", "--datasets", "dl19"]) == 0
    bm25 = json.loads((out / "eval" / "dl19" / "bm25.json").read_text())
    assert bm25["details"]["mode"] == "first-stage" and bm25["details"]["run_file"].endswith("bm25-top100.trec")
    assert bm25["dataset"]["judged_outside_corpus"] > 0 and bm25["dataset"]["relevance_level"] == 2
    _, given = load_dataset("dl19", PROFILES["smoke"])
    # the columns hold the metrics a re-ranking of the top 20 measures (recall@100 and @1000 would repeat @20)
    measured = {m: v for m, v in given.aggregate.items() if m in ("ndcg@10", "mrr@10")}
    assert bm25["metrics"] == measured and read_trec_run(out / "eval" / "dl19" / "bm25.trec") == given.run
    assert set(json.loads((out / "eval" / "dl19" / "colbert.json").read_text())["metrics"]) == set(measured)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["table2"]["bm25"]["dl19"] == pytest.approx(given.aggregate["ndcg@10"])
    colbert = out / "eval" / "dl19" / "colbert.json"
    ranked = read_trec_run(out / "eval" / "dl19" / "colbert.trec")
    depth = PROFILES["smoke"].rerank_depth
    candidates = first_stage(given, depth)
    assert {q: set(d) for q, d in ranked.items()} == {q: set(d) for q, d in candidates.items()}
    assert all(len(d) == depth for d in candidates.values())
    assert "TREC DL19, re-ranking BM25 top 20, graded qrels" in (out / "report.md").read_text()

    # Results of other data (the old judged DL19 pool): the report refuses them, a rerun recomputes them.
    def of_other_data(record: dict) -> dict:
        identity = {**record["identity"], "dataset": {**record["identity"]["dataset"], "fingerprint": "pool"}}
        return {**record, "identity": identity, "dataset": {**record["dataset"], "name": "msmarco-dl19-pool"}}

    (out / "eval" / "dl19" / "bm25.json").write_text(json.dumps(of_other_data(bm25)))
    colbert.write_text(json.dumps({**of_other_data(json.loads(colbert.read_text())), "metrics": {"ndcg@10": 0.99}}))
    assert main(["--profile", "smoke", "--output", str(out), "--report-only"]) == 1  # no report of other data
    assert "dl19/bm25 (msmarco-dl19-pool)" in capsys.readouterr().err
    assert main(["--profile", "smoke", "--output", str(out), "--variants", "colbert", "--datasets", "dl19"]) == 0
    redone = json.loads(colbert.read_text())
    assert redone["dataset"]["name"] == "dl19" and redone["metrics"]["ndcg@10"] != 0.99
    assert json.loads((out / "eval" / "dl19" / "bm25.json").read_text())["dataset"]["name"] == "dl19"


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    assert main(["--profile", "smoke", "--output", str(tmp_path), "--variants", "colbert,nope"]) == 2
    assert "--variants: unknown 'nope'" in capsys.readouterr().err
    assert main(["--profile", "smoke", "--output", str(tmp_path), "--max-steps", "0"]) == 2
    assert main(["--profile", "smoke", "--output", str(tmp_path / "empty"), "--report-only"]) == 2
    assert "no evaluations found" in capsys.readouterr().err


def test_smoke_profile_end_to_end_and_resume(tmp_path):
    """Every variant trains 2 steps and is evaluated on slices; the report has every table; a rerun skips."""
    out = tmp_path / "smoke"
    assert main(["--profile", "smoke", "--output", str(out)]) == 0
    report = (out / "report.md").read_text()
    for heading in ("## Table 2", "## Table 3", "## Table 5", "Figure 2", "Figure 3", "Figure 5", "## Verdict"):
        assert heading in report, heading
    for name in ("ColBERT-lambda", "ColBERT-HIL w/o reg_L, reg_H", "ColBERT-cosreg", "ColBERT-istar", "BM25",
                 "ColBERT-HIL, target-corpus IDF", "ColBERT-HIL (authors' code)",
                 "ColBERT-HIL (authors' code), target-query IDF"):
        assert f"| {name} |" in report, name
    assert "TREC DL19, re-ranking BM25 top 20, graded qrels" in report
    assert "## nDCG@10 by query length" in report
    assert not any((out / "train" / name).exists() for name in DIAGNOSTICS), "diagnostics run only when named"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["table3"]["hil"]["delta_inter_iso"] is not None
    assert summary["table3"]["lambda"]["delta_inter_iso"] is not None
    for key in default_datasets()[0]:  # TREC DL20 only when laid out (not in ../shared)
        for name in list(DEFAULT_VARIANTS) + ["lambda", "bm25", "hil_corpus_idf", "hil_authors_target_idf"]:
            record = json.loads((out / "eval" / key / f"{name}.json").read_text())
            assert 0.0 <= record["metrics"]["ndcg@10"] <= 1.0
    # ColBERT-lambda is the sum of its members' matrices: recompute one query's ranking from the saved scores.
    with np.load(out / "eval" / "scifact" / "iso.scores.npz") as iso, \
            np.load(out / "eval" / "scifact" / "aniso.scores.npz") as aniso:
        total = iso["head_colbert"][0] + aniso["head_colbert"][0]
        best = str(iso["doc_ids"][int(np.argmax(total))])
        qid = str(iso["qids"][0])
    lam = json.loads((out / "eval" / "scifact" / "lambda.json").read_text())
    assert lam["per_query"][qid] is not None
    run_top = [line.split()[2] for line in (out / "eval" / "scifact" / "lambda.trec").read_text().splitlines()
               if line.split()[0] == qid][0]
    assert run_top == best
    figures = sorted(p.name for p in (out / "figures").glob("*.png"))
    assert figures == ["fig2_cosines.png", "fig3_overlap.png", "fig5_layers.png"]

    published = tmp_path / "docs"
    assert main(["--profile", "smoke", "--output", str(out), "--report-only", "--publish", str(published)]) == 0
    assert (published / "report.md").is_file() and (published / "figures" / "fig2_cosines.png").is_file()
    assert (published / "eval" / "dl19" / "hil.json").is_file() and not list(published.rglob("*.npz"))

    def column_records() -> dict[Path, int]:  # metrics.json, the dataset's summary, is rewritten by every run
        return {p: p.stat().st_mtime_ns for p in (out / "eval").rglob("*.json") if p.name not in NOT_COLUMNS}

    before = column_records()
    exports = {p: p.stat().st_mtime_ns for p in (out / "train").glob("*/export/*.json")}
    assert main(["--profile", "smoke", "--output", str(out)]) == 0  # resumes: nothing retrained or re-evaluated
    assert before == column_records()
    assert exports == {p: p.stat().st_mtime_ns for p in (out / "train").glob("*/export/*.json")}
