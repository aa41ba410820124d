"""TREC DL 2019 passage re-ranking (``../shared/data/msmarco/dl19``): the official BM25 top 100 scored by our code
reproduces the published nDCG@10 (0.5058), checked against pytrec_eval fed straight from the files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import pytrec_eval

from hil.data.beir import load_beir
from hil.evaluation.evaluate import evaluate_run_file, first_stage

PUBLISHED_BM25_NDCG10 = 0.5058  # TREC DL 2019 passage, BM25 (Anserini/Pyserini defaults), as in the README of shared/


@pytest.fixture(scope="module")
def dl19_dir(shared_dir: Path) -> Path:
    folder = shared_dir / "data" / "msmarco" / "dl19"
    if not (folder / "bm25-top100.trec").is_file():
        pytest.skip(f"no TREC DL19 set at {folder}")
    return folder


def raw_files(folder: Path) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, float]]]:
    """The qrels and the run read the plainest way, sharing no code with the package."""
    qrels: dict[str, dict[str, int]] = {}
    for line in (folder / "qrels" / "test.tsv").read_text().splitlines()[1:]:
        qid, docid, grade = line.split("\t")
        qrels.setdefault(qid, {})[docid] = int(grade)
    run: dict[str, dict[str, float]] = {}
    for line in (folder / "bm25-top100.trec").read_text().splitlines():
        qid, _, docid, _, score, _ = line.split()
        run.setdefault(qid, {})[docid] = float(score)
    return qrels, run


def reference(qrels, run, measures, level: int = 1) -> dict[str, float]:
    per_query = pytrec_eval.RelevanceEvaluator(qrels, set(measures), relevance_level=level).evaluate(run)
    assert set(per_query) == set(qrels)  # every judged query is in the run: plain means are trec_eval -c means
    return {m: float(np.mean([row[m] for row in per_query.values()])) for m in measures}


@pytest.mark.integration
def test_bm25_top100_reproduces_the_published_ndcg10(dl19_dir):
    dataset = load_beir(dl19_dir, judged_outside_corpus="keep", relevance_level=2)
    bm25 = evaluate_run_file(dl19_dir / "bm25-top100.trec", dataset, metrics=("ndcg@10", "map", "recall@100"))
    assert bm25.aggregate["ndcg@10"] == pytest.approx(PUBLISHED_BM25_NDCG10, abs=5e-5)
    assert bm25.details["depth"] == 100 and len(bm25.per_query) == 43

    qrels, run = raw_files(dl19_dir)
    expected = reference(qrels, run, ("ndcg_cut_10",))
    assert bm25.aggregate["ndcg@10"] == pytest.approx(expected["ndcg_cut_10"], abs=1e-12)
    assert expected["ndcg_cut_10"] == pytest.approx(PUBLISHED_BM25_NDCG10, abs=5e-5)
    # binary metrics at TREC DL's level 2, as pytrec_eval computes them at -l 2
    binary = reference(qrels, run, ("map", "recall_100"), level=2)
    assert bm25.aggregate["map"] == pytest.approx(binary["map"], abs=1e-12)
    assert bm25.aggregate["recall@100"] == pytest.approx(binary["recall_100"], abs=1e-12)
    assert binary["map"] != pytest.approx(reference(qrels, run, ("map",), level=1)["map"], abs=1e-3)


@pytest.mark.integration
def test_judgments_outside_the_top100_count_in_the_ideal_dcg(dl19_dir):
    """Dropping the 7,003 judgments of passages outside BM25's top 100 would inflate nDCG@10 (0.545): they must
    stay, as trec_eval keeps them."""
    dataset = load_beir(dl19_dir, judged_outside_corpus="keep")
    corpus = {json.loads(line)["_id"] for line in (dl19_dir / "corpus.jsonl").read_text().splitlines()}
    qrels, run = raw_files(dl19_dir)
    assert dataset.judged_outside_corpus == sum(d not in corpus for judged in qrels.values() for d in judged) == 7003
    assert dataset.qrels == qrels
    pruned = {q: {d: g for d, g in judged.items() if d in corpus} for q, judged in qrels.items()}
    inflated = reference(pruned, run, ("ndcg_cut_10",))["ndcg_cut_10"]
    bm25 = evaluate_run_file(dl19_dir / "bm25-top100.trec", dataset, metrics=("ndcg@10",))
    assert inflated > bm25.aggregate["ndcg@10"] + 0.03


@pytest.mark.integration
def test_candidates_are_the_runs_top_by_score(dl19_dir):
    dataset = load_beir(dl19_dir, judged_outside_corpus="keep")
    bm25 = evaluate_run_file(dl19_dir / "bm25-top100.trec", dataset, metrics=("ndcg@10",))
    _, run = raw_files(dl19_dir)
    candidates = first_stage(bm25, 20)
    assert set(candidates) == set(run) and all(len(docs) == 20 for docs in candidates.values())
    for qid, docs in candidates.items():
        scores = [run[qid][d] for d in docs]
        assert scores == sorted(scores, reverse=True)
        assert min(scores) >= max(s for d, s in run[qid].items() if d not in docs)
