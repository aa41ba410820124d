"""Re-ranking a first stage given as a TREC run file, through the Python API and ``evaluate.py --first-stage-run``,
on a toy re-ranking set whose qrels also judge documents outside its corpus."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hil.cli.evaluate_script import main
from hil.data.beir import load_beir
from hil.evaluation.evaluate import EvaluationSettings, evaluate, evaluate_run_file, first_stage
from hil.evaluation.runs import read_trec_run
from hil.modeling.encoder import ColBERTEncoder

from conftest import random_bert

WORDS = ["gene", "cell", "protein", "cancer", "heart", "brain", "water", "climate", "energy", "virus", "bone",
         "blood", "sugar", "sleep", "light"]
N_DOCS, N_QUERIES, DEPTH = 12, 4, 8


def write_rerank_set(folder: Path) -> tuple[Path, Path]:
    """A BEIR folder (12 documents, 4 queries) whose qrels judge 2 documents per query outside the corpus, and a
    run file of 8 documents per query whose lines and rank column run against its scores (worst first)."""
    rng = np.random.default_rng(0)
    (folder / "qrels").mkdir(parents=True)
    with open(folder / "corpus.jsonl", "w") as handle:
        for i in range(N_DOCS):
            text = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 10))))
            handle.write(json.dumps({"_id": f"d{i:02d}", "title": "", "text": text}) + "\n")
    with open(folder / "queries.jsonl", "w") as handle:
        handle.writelines(json.dumps({"_id": f"q{q}", "text": " ".join(rng.choice(WORDS, size=3))}) + "\n"
                          for q in range(N_QUERIES))
    lines, run_lines = ["query-id\tcorpus-id\tscore"], []
    for q in range(N_QUERIES):
        docs = rng.choice(N_DOCS, DEPTH, replace=False)
        for j, grade in zip(docs[:3], (3, 2, 1)):
            lines.append(f"q{q}\td{int(j):02d}\t{grade}")
        lines += [f"q{q}\tfar{q}a\t3", f"q{q}\tfar{q}b\t2"]  # judged, not in the corpus
        scores = rng.permutation(DEPTH).astype(float) + 0.5
        order = np.argsort(scores)  # worst first in the file, rank column 1..8 as written
        run_lines += [f"q{q} Q0 d{int(docs[i]):02d} {rank} {scores[i]} bm25" for rank, i in enumerate(order, 1)]
    (folder / "qrels" / "test.tsv").write_text("\n".join(lines) + "\n")
    (folder / "run.trec").write_text("\n".join(run_lines) + "\n")
    return folder, folder / "run.trec"


def best_by_score(run_file: Path, depth: int) -> dict[str, set[str]]:
    run: dict[str, dict[str, float]] = {}
    for line in run_file.read_text().splitlines():
        qid, _, docid, _, score, _ = line.split()
        run.setdefault(qid, {})[docid] = float(score)
    return {q: set(sorted(docs, key=lambda d: -docs[d])[:depth]) for q, docs in run.items()}


@pytest.fixture
def rerank_set(tmp_path) -> tuple[Path, Path]:
    return write_rerank_set(tmp_path / "rerank")


def test_python_api_reranks_exactly_the_runs_best_candidates(rerank_set, hf_tokenizer):
    folder, run_file = rerank_set
    dataset = load_beir(folder, judged_outside_corpus="keep", relevance_level=2)
    assert dataset.judged_outside_corpus == 2 * N_QUERIES
    given = evaluate_run_file(run_file, dataset)
    assert given.name == "run" and given.details["depth"] == DEPTH
    candidates = first_stage(given, 3)
    assert {q: set(docs) for q, docs in candidates.items()} == best_by_score(run_file, 3)
    torch.manual_seed(0)
    encoder = ColBERTEncoder("random-bert", dim=16, query_maxlen=8, doc_maxlen=16,
                             _loaded=(random_bert(), hf_tokenizer)).eval()
    evaluation = evaluate(encoder, dataset, EvaluationSettings(mode="rerank", k=10, index_root=None, progress=False),
                          candidates=candidates)
    assert {q: set(docs) for q, docs in evaluation.run.items()} == best_by_score(run_file, 3)


def cli(*args: str) -> list[str]:
    return ["--model", "bert-tiny-splade", "--dim", "16", "--doc-maxlen", "32", "--quiet", "--no-stats", *args]


@pytest.mark.integration
def test_cli_reranks_the_run_file_and_records_the_outside_judgments(rerank_set, tmp_path, caplog, shared_dir):
    folder, run_file = rerank_set
    out = tmp_path / "out"
    with caplog.at_level("WARNING", logger="hil.data.beir"):
        assert main(cli("--dataset", str(folder), "--first-stage-run", str(run_file), "--rerank-depth", "3",
                        "--relevance-level", "2", "--index-root", str(tmp_path / "idx"), "--output", str(out))) == 0
    assert any("8 of 20 judgments name documents outside the corpus" in r.getMessage() for r in caplog.records)
    record = json.loads((out / "metrics.json").read_text())
    assert record["dataset"]["judged_outside_corpus"] == 8 and record["dataset"]["relevance_level"] == 2
    assert set(record["results"]) == {"run", "colbert-rerank"}  # the run file is the baseline, no BM25
    assert record["results"]["run"]["mode"] == "first-stage" and record["results"]["run"]["rerank_depth"] == 3
    reranked = read_trec_run(out / "colbert-rerank.trec")
    assert {q: set(docs) for q, docs in reranked.items()} == best_by_score(run_file, 3)
    # without --rerank-depth: every document of the run
    assert main(cli("--dataset", str(folder), "--first-stage-run", str(run_file), "--index-root",
                    str(tmp_path / "idx"), "--output", str(tmp_path / "all"))) == 0
    reranked = read_trec_run(tmp_path / "all" / "colbert-rerank.trec")
    assert {q: set(docs) for q, docs in reranked.items()} == best_by_score(run_file, DEPTH)


@pytest.mark.parametrize("body, where", [
    (None, "missing.trec: no such run file"),
    ("q0 Q0 d00 1 1.0 t\nq0 Q0 d01 2 bm25\n", "bad.trec:2: expected 6 fields"),
    ("q0 Q0 d00 1 1.0 t\nq0 Q0 d01 2 0.5 t\nq7 Q0 d00 1 1.0 t\n", "bad.trec:3: query id 'q7'"),
    ("q0 Q0 nowhere 1 1.0 t\n", "bad.trec:1: document id 'nowhere'"),
])
def test_cli_bad_run_files_are_one_line_errors(rerank_set, tmp_path, capsys, body, where):
    folder, _ = rerank_set
    path = tmp_path / ("missing.trec" if body is None else "bad.trec")
    if body is not None:
        path.write_text(body)
    assert main(cli("--dataset", str(folder), "--first-stage-run", str(path), "--output", str(tmp_path / "o"))) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and where in err and err.startswith("evaluate.py: error: "), err
    assert not (tmp_path / "o").exists()


def test_cli_refuses_a_first_stage_run_with_full_ranking(rerank_set, tmp_path, capsys):
    folder, run_file = rerank_set
    assert main(cli("--dataset", str(folder), "--first-stage-run", str(run_file), "--mode", "full")) == 2
    assert "needs --mode rerank or exhaustive" in capsys.readouterr().err
    # without a first stage, the outside judgments are kept too (as BEIR and trec_eval keep them) and counted
    assert main(cli("--dataset", str(folder), "--mode", "bm25", "--output", str(tmp_path / "o"))) == 0
    metrics = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert metrics["dataset"]["judged_outside_corpus"] == 8
