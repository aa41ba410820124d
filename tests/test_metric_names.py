"""Metric names and the depth that measures them (issue 31): ir_measures' spelling is accepted wherever a metric is
named and reported under the package's name; an unknown name is refused when the settings are made, before any
work; a column holds only the metrics its run's depth measures (``recall@1000`` of a top-100 run would repeat
``recall@100`` under another name), said once.

Broken on purpose, each failing here: the ir_measures aliases removed, the settings' name check dropped (the error
then comes after the work, from pytrec_eval's plan), the depth rule dropped, and the depth taken from ``k`` alone
when a first stage's candidates are re-ranked."""

from __future__ import annotations

import json

import pytest
import pytrec_eval

from hil.errors import UserError
from hil.evaluation.evaluate import EvaluationSettings
from hil.evaluation.experiment import DatasetSpec, Experiment, ModelSpec, StatisticsSettings
from hil.evaluation.metrics import canonical_metric, evaluate_run, measurable_metrics
from hil.evaluation.runner import run_experiment


@pytest.mark.parametrize("given, ours", [("RR@10", "mrr@10"), ("R@100", "recall@100"), ("nDCG@10", "ndcg@10"),
                                         ("AP", "map"), ("P@5", "p@5"), ("Success@3", "success@3"), ("RR", "mrr"),
                                         ("AP@100", "map@100"), ("mrr@10", "mrr@10")])
def test_ir_measures_names_are_read_as_ours(given, ours):
    assert canonical_metric(given) == ours


def test_results_are_keyed_by_our_names_and_equal_pytrec_eval():
    qrels = {"q1": {"a": 1, "c": 2}, "q2": {"b": 1}}
    run = {"q1": {"a": 0.1, "b": 0.9, "c": 0.5}, "q2": {"a": 3.0, "b": 2.0}}
    aggregate, per_query = evaluate_run(qrels, run, ["RR@10", "R@2", "nDCG@10", "mrr@10"])
    assert list(aggregate) == ["mrr@10", "recall@2", "ndcg@10"]  # one key per measure, the package's spelling
    direct = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank", "recall.2", "ndcg_cut.10"}).evaluate(run)
    for qid in qrels:
        assert per_query[qid]["mrr@10"] == pytest.approx(direct[qid]["recip_rank"])
        assert per_query[qid]["recall@2"] == pytest.approx(direct[qid]["recall_2"])
        assert per_query[qid]["ndcg@10"] == pytest.approx(direct[qid]["ndcg_cut_10"])


def test_settings_refuse_an_unknown_metric_before_any_work():
    with pytest.raises(UserError, match=r"^metrics: unknown metric 'rrr@10'"):
        EvaluationSettings(metrics=("ndcg@10", "rrr@10"), index_root=None, mode="exhaustive")
    with pytest.raises(UserError, match=r"^statistics.metrics: "):
        StatisticsSettings(metrics=("nope",))
    assert EvaluationSettings(metrics=("RR@10", "R@100"), index_root=None,
                              mode="exhaustive").metrics == ("mrr@10", "recall@100")
    assert StatisticsSettings(metrics=("nDCG@10",)).metrics == ("ndcg@10",)


def test_measurable_metrics_keep_the_cutoffs_the_depth_reaches():
    assert measurable_metrics(("ndcg@10", "recall@100", "recall@1000", "map"), 100) == (
        ("ndcg@10", "recall@100", "map"), ("recall@1000",))
    assert measurable_metrics(("recall@10", "mrr@10", "success@10", "map@10"), 5) == (
        (), ("recall@10", "mrr@10", "success@10", "map@10"))
    # nDCG@10 (ideal DCG over 10) and P@10 (divided by 10) of a top-5 run are not their values at 5: kept
    assert measurable_metrics(("ndcg@10", "p@10", "recall@5"), 5) == (("ndcg@10", "p@10", "recall@5"), ())


def _experiment(tiny_model_dir, out, k, metrics):
    settings = EvaluationSettings(mode="exhaustive", k=k, index_root=None, progress=False, metrics=metrics)
    return Experiment([DatasetSpec("scifact", max_queries=5, max_docs=120, key="set")],
                      [ModelSpec(str(tiny_model_dir), name="tiny", dim=16)], out, settings=settings,
                      statistics=StatisticsSettings(enabled=False), quiet=False)


@pytest.mark.integration
def test_columns_hold_only_the_metrics_their_depth_measures(tiny_model_dir, tmp_path, capsys):
    run_experiment(_experiment(tiny_model_dir, tmp_path / "k50", 50, ("ndcg@10", "R@20", "recall@100",
                                                                      "recall@1000")))
    assert "recall@100, recall@1000 left out (the runs hold 50 documents per query" in capsys.readouterr().err
    record = json.loads((tmp_path / "k50" / "set" / "metrics.json").read_text())
    for column in ("bm25", "tiny"):
        assert list(record["results"][column]["metrics"]) == ["ndcg@10", "recall@20"], column
    # the kept recall@20, by pytrec_eval on the written run and the dataset's judgments
    from hil.data.beir import load_beir
    from hil.evaluation.runs import read_trec_run

    dataset = load_beir("scifact").subset(5, 120, seed=12345)
    run = read_trec_run(tmp_path / "k50" / "set" / "tiny.trec")
    direct = pytrec_eval.RelevanceEvaluator(dataset.qrels, {"recall.20"}).evaluate(run)
    mean = sum(direct[q]["recall_20"] for q in dataset.qrels) / len(dataset.qrels)
    assert record["results"]["tiny"]["metrics"]["recall@20"] == pytest.approx(mean)
    with pytest.raises(UserError, match="no metric measurable on runs of 5 documents"):
        run_experiment(_experiment(tiny_model_dir, tmp_path / "k5", 5, ("recall@100",)))


@pytest.mark.integration
def test_a_reranked_first_stage_limits_the_depth_to_its_candidates(tiny_model_dir, tmp_path):
    """DL19's given BM25 top 100, re-ranked at depth 10 with k = 1000: the runs hold 10 documents per query."""
    run_experiment(Experiment(
        [DatasetSpec("msmarco/dl19", key="set", first_stage_run="bm25-top100.trec", rerank_depth=10, max_queries=4,
                     relevance_level=2)],
        [ModelSpec(str(tiny_model_dir), name="tiny", dim=16)], tmp_path / "dl19",
        settings=EvaluationSettings(mode="rerank", k=1000, index_root=None, progress=False,
                                    metrics=("ndcg@10", "recall@10", "recall@100")),
        statistics=StatisticsSettings(enabled=False), quiet=True))
    record = json.loads((tmp_path / "dl19" / "set" / "metrics.json").read_text())
    assert set(record["results"]) == {"bm25-top100", "tiny"}
    for column in record["results"].values():
        assert list(column["metrics"]) == ["ndcg@10", "recall@10"]
