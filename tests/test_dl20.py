"""TREC DL 2020 passage beside DL19: a re-ranking set of the one table
(:data:`hil.experiments.profiles.RERANKING_SETS`), handled by the BEIR command and the paper experiment exactly as DL19.
``msmarco/dl20`` is not in ``../shared``, so a
small fixture in its layout (corpus.jsonl, queries.jsonl, graded qrels/test.tsv judging passages outside the corpus,
bm25-top100.trec) stands in for it under a data dir of its own; the numbers are checked against the slow reference
metrics fed straight from the fixture's own values."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import hil.cli.beir as beir_cli
import hil.experiments.paper as paper
from hil.errors import MissingInputError
from hil.experiments.beir_sets import BEIR_SETS, BY_KEY, select
from hil.experiments.profiles import DATASETS, FIRST_STAGES, PROFILES, RERANKING_SETS, default_datasets
from hil.experiments.records import dataset_column, load_dataset

from reference_metrics import mrr_at_k_reference, ndcg_at_k_reference, recall_at_k_reference

WORDS = ("flea", "life", "cycle", "concrete", "floor", "cost", "court", "judgment", "rights", "pets", "eggs", "house")
QUERIES = {"1030303": "flea life cycle", "1037496": "concrete floor cost", "1043135": "court judgment rights",
           "1045109": "pets eggs house"}
# Graded 0-3 (TREC DL); p-ghost* are judged but not among the run's passages (outside the corpus). 1045109 has only
# grade-1 judgments inside the run: relevant for nDCG, not for the binary metrics at level 2.
QRELS = {"1030303": {"p0": 3, "p2": 1, "p5": 0, "p-ghost1": 2},
         "1037496": {"p7": 2, "p6": 0, "p9": 3},
         "1043135": {"p12": 1, "p14": 2, "p-ghost2": 3, "p-ghost3": 1},
         "1045109": {"p19": 1, "p20": 1, "p-ghost4": 2}}
RUN_DEPTH = 6


def passage(i: int) -> str:
    return " ".join(WORDS[(i * k + 1) % len(WORDS)] for k in (1, 2, 3, 5)) + f" passage {i}"


def run_lines() -> dict[str, list[tuple[str, float]]]:
    """Each query's BM25 list: 6 passages with distinct falling scores (p<6q>..p<6q+5>)."""
    return {qid: [(f"p{6 * q + r}", round(20.0 - r - 0.25 * q, 4)) for r in range(RUN_DEPTH)]
            for q, qid in enumerate(QUERIES)}


def write_dl20(root: Path) -> Path:
    folder = root / "msmarco" / "dl20"
    (folder / "qrels").mkdir(parents=True)
    passages = sorted({doc for ranked in run_lines().values() for doc, _ in ranked}, key=lambda d: int(d[1:]))
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": d, "title": "", "text": passage(int(d[1:]))})
                                                 + "\n" for d in passages))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in QUERIES.items()))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{q}\t{d}\t{g}\n" for q, judged in QRELS.items() for d, g in judged.items()))
    (folder / "bm25-top100.trec").write_text("".join(
        f"{q} Q0 {d} {rank} {score} bm25-flat\n" for q, ranked in run_lines().items()
        for rank, (d, score) in enumerate(ranked, start=1)))
    return root


def reference(ranked: dict[str, list[str]], level: int = 2) -> dict[str, float]:
    """Mean nDCG@10 (grades as gains), MRR@10 and recall@100 (relevant: grade >= ``level``) over the judged queries."""
    binary = {q: {d: int(g >= level) for d, g in judged.items()} for q, judged in QRELS.items()}
    return {"ndcg@10": float(np.mean([ndcg_at_k_reference(QRELS[q], ranked.get(q, []), 10) for q in QRELS])),
            "mrr@10": float(np.mean([mrr_at_k_reference(binary[q], ranked.get(q, []), 10) for q in QRELS])),
            "recall@100": float(np.mean([recall_at_k_reference(binary[q], ranked.get(q, []), 100) for q in QRELS]))}


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch) -> Path:
    root = write_dl20(tmp_path / "data")
    monkeypatch.setenv("HIL_DATA_DIR", str(root))
    return root


def test_dl20_is_a_row_of_the_reranking_table_like_dl19():
    assert set(RERANKING_SETS) >= {"dl19", "dl20"}
    dl19, dl20 = RERANKING_SETS["dl19"], RERANKING_SETS["dl20"]
    assert dl20.folder == "msmarco/dl20" and dl20.first_stage == dl19.first_stage
    assert (dl20.first_stage.run_file, dl20.first_stage.relevance_level) == ("bm25-top100.trec", 2)
    assert dl20.first_stage.judged_outside_corpus == "keep" and dl20.optional and not dl19.optional
    assert DATASETS["dl20"] == ("rerank", "msmarco/dl20") and FIRST_STAGES["dl20"] is dl20.first_stage
    keys = [s.key for s in BEIR_SETS]
    assert keys[:3] == ["msmarco", "dl19", "dl20"]  # beside MS MARCO, in-domain, not averaged
    assert BY_KEY["dl20"].first_stage is dl20.first_stage and not BY_KEY["dl20"].in_average
    assert BY_KEY["dl20"].parts == ("msmarco/dl20",)


def test_the_paper_reads_dl20_with_its_run_as_bm25_and_graded_qrels(data_dir):
    dataset, bm25 = load_dataset("dl20", PROFILES["cpu"])
    assert dataset.relevance_level == 2 and dataset.judged_outside_corpus == 4 and bm25.name == "bm25"
    assert set(dataset.queries) == set(QUERIES) and len(dataset.corpus) == len(QUERIES) * RUN_DEPTH
    ranked = {q: [d for d, _ in docs] for q, docs in run_lines().items()}
    expected = reference(ranked)
    for metric, value in expected.items():
        assert bm25.aggregate[metric] == pytest.approx(value, abs=1e-12), metric
    assert bm25.aggregate["recall@100"] != pytest.approx(reference(ranked, level=1)["recall@100"])  # level 2 used
    assert dataset_column("dl20", 20) == "TREC DL20, re-ranking BM25 top 20, graded qrels"


def test_dl20_is_in_the_default_datasets_only_when_laid_out(data_dir, tmp_path, monkeypatch):
    assert default_datasets() == (["scifact", "nfcorpus", "dl19", "dl20"], [])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert default_datasets(empty) == (["scifact", "nfcorpus", "dl19"], ["dl20"])
    monkeypatch.setenv("HIL_DATA_DIR", str(empty))
    with pytest.raises(MissingInputError, match="msmarco/dl20: not found under .*docs/guide.md"):
        load_dataset("dl20", PROFILES["smoke"])  # named but not there: one line, never the hub


def test_the_paper_experiment_reranks_dl20_and_reports_it(data_dir, tmp_path, monkeypatch, tiny_model_dir,
                                                           capsys):
    """The paper's evaluation and report on DL20 (training replaced by an untrained-head export: the stages under
    test are the dataset's): BM25's row is the shipped run, the model re-ranks only its top ``rerank_depth``."""
    import torch

    from hil.modeling.loading import load_encoder

    torch.manual_seed(3)
    export = tmp_path / "colbert" / "export"
    load_encoder(tiny_model_dir, dim=16).save_pretrained(export)
    monkeypatch.setattr(paper, "train_variant", lambda name, profile, out, force=False: export)
    profile = PROFILES["smoke"]
    out = tmp_path / "out"
    # No --datasets: the run takes default_datasets() (faked here to "only DL20 is laid out", to stay on one
    # dataset) and names the ones it leaves out.
    monkeypatch.setattr(paper, "default_datasets", lambda: (["dl20"], ["dl19"]))
    paper.run_profile(profile, out, variants=["colbert"])
    assert "dl19: msmarco/dl19 not found under $HIL_DATA_DIR, left out" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "eval").iterdir()) == ["dl20"]
    bm25 = json.loads((out / "eval" / "dl20" / "bm25.json").read_text())
    assert bm25["details"]["mode"] == "first-stage" and bm25["dataset"]["relevance_level"] == 2
    assert bm25["dataset"]["judged_outside_corpus"] == 4
    assert bm25["metrics"]["ndcg@10"] == pytest.approx(reference({q: [d for d, _ in docs]
                                                                  for q, docs in run_lines().items()})["ndcg@10"])
    colbert = json.loads((out / "eval" / "dl20" / "colbert.json").read_text())
    ranked: dict[str, list[str]] = {}
    for line in (out / "eval" / "dl20" / "colbert.trec").read_text().splitlines():
        ranked.setdefault(line.split()[0], []).append(line.split()[2])
    assert {q: set(docs) for q, docs in ranked.items()} == {q: {d for d, _ in docs} for q, docs in
                                                           run_lines().items()}  # depth 20 > 6: every passage
    assert colbert["metrics"]["ndcg@10"] == pytest.approx(reference(ranked)["ndcg@10"], abs=1e-12)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["table2"]["bm25"]["dl20"] == pytest.approx(bm25["metrics"]["ndcg@10"])
    assert "TREC DL20, re-ranking BM25 top 20, graded qrels" in (out / "report.md").read_text()


def test_the_beir_command_reranks_dl20s_run_which_is_its_bm25_column(data_dir, tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    assert select("all", data_dir).parts == {"dl20": ("msmarco/dl20",)}
    assert beir_cli.main(["--model", f"tiny={tiny_model_dir}", "--datasets", "dl20", "--data-dir", str(data_dir),
                      "--out", str(out), "--mode", "exhaustive", "--index-root", "none", "--k", "10",
                      "--rerank-depth", "3", "--dim", "16", "--device", "cpu", "--bootstrap-samples", "50",
                      "--quiet"]) == 0
    bm25 = json.loads((out / "msmarco" / "dl20" / "bm25.json").read_text())
    tiny = json.loads((out / "msmarco" / "dl20" / "tiny.json").read_text())
    given = {q: [d for d, _ in docs] for q, docs in run_lines().items()}
    # re-ranking 3 candidates: the depth-bound metrics above 3 (mrr@10, recall@100, recall@1000) are left out
    assert set(bm25["metrics"]) == set(tiny["metrics"]) == {"ndcg@10"}
    for metric, value in reference(given).items():
        if metric in bm25["metrics"]:
            assert bm25["metrics"][metric] == pytest.approx(value, abs=1e-12), metric
    assert bm25["model"]["run_file"] == "bm25-top100.trec"
    assert tiny["details"]["mode"] == "rerank" and tiny["dataset"]["relevance_level"] == 2
    assert tiny["dataset"]["judged_outside_corpus"] == 4
    ranked: dict[str, list[str]] = {}
    for line in (out / "msmarco" / "dl20" / "tiny.trec").read_text().splitlines():
        ranked.setdefault(line.split()[0], []).append(line.split()[2])
    assert {q: set(docs) for q, docs in ranked.items()} == {q: set(docs[:3]) for q, docs in given.items()}
    assert tiny["metrics"]["ndcg@10"] == pytest.approx(reference(ranked)["ndcg@10"], abs=1e-12)
    table = json.loads((out / "table.json").read_text())
    (row,) = [r for r in table["rows"] if r["dataset"] == "dl20"]
    assert row["first_stage"] == "bm25-top100.trec" and not row["in_average"]
