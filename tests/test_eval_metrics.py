"""hil.evaluation.metrics and hil.evaluation.runs against hand arithmetic and slow reference implementations."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hil.evaluation.metrics import evaluate_run, parse_metric
from hil.evaluation.runs import candidates_from_run, ranked, read_trec_run, run_depth, top_k, write_trec_run

from reference_metrics import mrr_at_k_reference, ndcg_at_k_reference, recall_at_k_reference

log2 = math.log2

# Three queries with graded judgements.
TOY_QRELS = {
    "q1": {"d1": 1, "d2": 2, "d3": 0},
    "q2": {"d5": 1},
    "q3": {"d8": 3, "d9": 1},
}
TOY_RUN = {
    "q1": {"d1": 0.9, "d4": 0.8, "d2": 0.7, "d3": 0.6},  # ranks: d1 d4 d2 d3
    "q2": {"d6": 0.5, "d7": 0.4, "d5": 0.3},  # ranks: d6 d7 d5
    "q3": {"d9": 0.9, "d8": 0.1},  # ranks: d9 d8
}


def test_toy_ndcg_mrr_recall_by_hand():
    aggregate, per_query = evaluate_run(TOY_QRELS, TOY_RUN, metrics=("ndcg@10", "mrr@10", "recall@2", "p@2"))
    ndcg_q1 = (1 / log2(2) + 2 / log2(4)) / (2 / log2(2) + 1 / log2(3))
    ndcg_q2 = (1 / log2(4)) / (1 / log2(2))
    ndcg_q3 = (1 / log2(2) + 3 / log2(3)) / (3 / log2(2) + 1 / log2(3))
    assert per_query["q1"]["ndcg@10"] == pytest.approx(ndcg_q1, abs=1e-12)
    assert per_query["q2"]["ndcg@10"] == pytest.approx(0.5, abs=1e-12)
    assert per_query["q3"]["ndcg@10"] == pytest.approx(ndcg_q3, abs=1e-12)
    assert aggregate["ndcg@10"] == pytest.approx((ndcg_q1 + ndcg_q2 + ndcg_q3) / 3, abs=1e-12)
    assert aggregate["ndcg@10"] == pytest.approx(0.6856317, abs=1e-6)
    assert aggregate["mrr@10"] == pytest.approx((1 + 1 / 3 + 1) / 3, abs=1e-12)
    # recall@2: q1 has d1 of {d1, d2}; q2 none; q3 both.
    assert per_query["q1"]["recall@2"] == pytest.approx(0.5)
    assert aggregate["recall@2"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert aggregate["p@2"] == pytest.approx((1 / 2 + 0 + 2 / 2) / 3)


def test_mrr_is_cut_at_k():
    qrels = {"q": {"rel": 1}}
    run = {"q": {f"d{i:02d}": 100.0 - i for i in range(10)} | {"rel": 50.0}}  # relevant at rank 11
    aggregate, _ = evaluate_run(qrels, run, metrics=("mrr@10", "mrr@11", "mrr"))
    assert aggregate["mrr@10"] == 0.0
    assert aggregate["mrr@11"] == pytest.approx(1 / 11)
    assert aggregate["mrr"] == pytest.approx(1 / 11)


def test_ties_broken_by_docid_descending_like_trec_eval():
    # Three equal scores: trec_eval ranks c, b, a. P@1 comes from pytrec_eval directly, mrr@1 from our
    # truncation; both must agree with runs.ranked.
    run = {"q": {"a": 1.0, "b": 1.0, "c": 1.0}}
    assert [d for d, _ in ranked(run["q"])] == ["c", "b", "a"]
    for relevant, expected_rank in (("c", 1), ("b", 2), ("a", 3)):
        aggregate, _ = evaluate_run({"q": {relevant: 1}}, run, metrics=("p@1", "mrr@1", "mrr@2", "mrr"))
        assert aggregate["p@1"] == (1.0 if expected_rank == 1 else 0.0)
        assert aggregate["mrr"] == pytest.approx(1 / expected_rank)
        assert aggregate["mrr@1"] == pytest.approx(1.0 if expected_rank == 1 else 0.0)
        assert aggregate["mrr@2"] == pytest.approx(1 / expected_rank if expected_rank <= 2 else 0.0)


def test_self_matches_are_dropped_by_default():
    qrels = {"q1": {"d1": 1}, "q2": {"d2": 1}}
    run = {"q1": {"q1": 10.0, "d1": 1.0}, "q2": {"q2": 5.0}}
    dropped, per_query = evaluate_run(qrels, run, metrics=("mrr@10",))
    assert per_query["q1"]["mrr@10"] == 1.0
    assert per_query["q2"]["mrr@10"] == 0.0  # emptied by dropping: missing -> 0
    assert dropped["mrr@10"] == pytest.approx(0.5)
    kept, _ = evaluate_run(qrels, run, metrics=("mrr@10",), drop_self_matches=False)
    assert kept["mrr@10"] == pytest.approx((0.5 + 0.0) / 2)
    ignored, per_query = evaluate_run(qrels, run, metrics=("mrr@10",), missing_queries="ignore")
    assert set(per_query) == {"q1"} and ignored["mrr@10"] == 1.0


def test_missing_queries_zero_or_ignore_and_unjudged_queries_skipped():
    qrels = {"q1": {"d1": 1}, "q2": {"d2": 1}}
    run = {"q1": {"d1": 1.0}, "unjudged": {"d9": 1.0}}
    zero, per_query = evaluate_run(qrels, run, metrics=("ndcg@10", "recall@100"))
    assert set(per_query) == {"q1", "q2"}
    assert per_query["q2"] == {"ndcg@10": 0.0, "recall@100": 0.0}
    assert zero == {"ndcg@10": 0.5, "recall@100": 0.5}
    ignore, per_query = evaluate_run(qrels, run, metrics=("ndcg@10",), missing_queries="ignore")
    assert set(per_query) == {"q1"} and ignore["ndcg@10"] == 1.0
    empty, _ = evaluate_run(qrels, {}, metrics=("ndcg@10",), missing_queries="ignore")
    assert math.isnan(empty["ndcg@10"])


def test_metric_names_and_bad_inputs():
    assert parse_metric("nDCG@10") == ("ndcg", 10)
    assert parse_metric("P@5") == ("p", 5)
    assert parse_metric("map") == ("map", None)
    for bad in ("foo@10", "recall", "ndcg@", "ndcg@0", "mrr@x"):
        with pytest.raises(ValueError):
            parse_metric(bad)
    with pytest.raises(ValueError, match="missing_queries"):
        evaluate_run(TOY_QRELS, TOY_RUN, missing_queries="drop")
    with pytest.raises(ValueError, match="'q1'.*'d1'.*NaN"):
        evaluate_run({"q1": {"d1": 1}}, {"q1": {"d1": float("nan")}})
    with pytest.raises(ValueError, match="'q1'.*'d1'.*integer"):
        evaluate_run({"q1": {"d1": 0.5}}, {"q1": {"d1": 1.0}})


def test_default_metrics_and_int_ids():
    aggregate, per_query = evaluate_run({1: {2: 1}}, {1: {2: 0.5, 3: 0.7}})
    assert set(aggregate) == {"ndcg@10", "mrr@10", "recall@100", "recall@1000"}
    assert per_query["1"]["mrr@10"] == 0.5


# ----------------------------------------------------------------------------------------------------------
# hypothesis: random runs against slow references


def _p_at_k(qrels_q, ranking, k):
    return sum(1 for d in ranking[:k] if qrels_q.get(d, 0) > 0) / k


def _average_precision(qrels_q, ranking):
    n_rel = sum(1 for r in qrels_q.values() if r > 0)
    hits, total = 0, 0.0
    for i, d in enumerate(ranking):
        if qrels_q.get(d, 0) > 0:
            hits += 1
            total += hits / (i + 1)
    return total / n_rel if n_rel else 0.0


@st.composite
def qrels_and_run(draw, distinct_scores: bool):
    n_queries = draw(st.integers(1, 5))
    docs = [f"d{i}" for i in range(25)]
    qrels, run = {}, {}
    for q in range(n_queries):
        judged = draw(st.lists(st.sampled_from(docs), min_size=1, max_size=8, unique=True))
        qrels[f"q{q}"] = {d: draw(st.integers(0, 3)) for d in judged}
        retrieved = draw(st.lists(st.sampled_from(docs), min_size=0, max_size=20, unique=True))
        if distinct_scores:
            scores = draw(st.permutations(range(len(retrieved))))
            run[f"q{q}"] = {d: float(s) / 7.0 for d, s in zip(retrieved, scores)}
        else:  # many ties
            run[f"q{q}"] = {d: float(draw(st.integers(0, 3))) for d in retrieved}
    return qrels, run


@settings(max_examples=60, deadline=None)
@given(qrels_and_run(distinct_scores=True))
def test_metrics_match_reference_on_random_runs(data):
    qrels, run = data
    metrics = ("ndcg@10", "ndcg@3", "mrr@10", "mrr@3", "recall@5", "p@5", "map", "success@3")
    _, per_query = evaluate_run(qrels, run, metrics=metrics)
    assert set(per_query) == set(qrels)
    for qid, judged in qrels.items():
        # independent of runs.ranked: distinct scores, so sorting by score alone is the ranking
        ranking = sorted(run[qid], key=lambda d: -run[qid][d])
        got = per_query[qid]
        assert got["ndcg@10"] == pytest.approx(ndcg_at_k_reference(judged, ranking, 10), abs=1e-9)
        assert got["ndcg@3"] == pytest.approx(ndcg_at_k_reference(judged, ranking, 3), abs=1e-9)
        assert got["mrr@10"] == pytest.approx(mrr_at_k_reference(judged, ranking, 10), abs=1e-12)
        assert got["mrr@3"] == pytest.approx(mrr_at_k_reference(judged, ranking, 3), abs=1e-12)
        assert got["recall@5"] == pytest.approx(recall_at_k_reference(judged, ranking, 5), abs=1e-12)
        assert got["p@5"] == pytest.approx(_p_at_k(judged, ranking, 5), abs=1e-12)
        assert got["map"] == pytest.approx(_average_precision(judged, ranking), abs=1e-9)
        assert got["success@3"] == float(mrr_at_k_reference(judged, ranking, 3) > 0)


@settings(max_examples=60, deadline=None)
@given(qrels_and_run(distinct_scores=False))
def test_tied_scores_follow_runs_ranked_order(data):
    # pytrec_eval (ndcg, P) and our truncation (mrr@k) must both rank ties the way runs.ranked does.
    qrels, run = data
    _, per_query = evaluate_run(qrels, run, metrics=("ndcg@10", "mrr@3", "p@3"))
    for qid, judged in qrels.items():
        ranking = [d for d, _ in ranked(run[qid])]
        assert per_query[qid]["ndcg@10"] == pytest.approx(ndcg_at_k_reference(judged, ranking, 10), abs=1e-9)
        assert per_query[qid]["mrr@3"] == pytest.approx(mrr_at_k_reference(judged, ranking, 3), abs=1e-12)
        assert per_query[qid]["p@3"] == pytest.approx(_p_at_k(judged, ranking, 3), abs=1e-12)


def test_relevance_level_by_hand():
    """TREC DL's convention (level 2): binary metrics count grades >= 2; nDCG keeps using the grades."""
    metrics = ("ndcg@10", "mrr@10", "recall@2", "p@2", "map", "success@1")
    one, _ = evaluate_run(TOY_QRELS, TOY_RUN, metrics=metrics)
    two, per_query = evaluate_run(TOY_QRELS, TOY_RUN, metrics=metrics, relevance_level=2)
    assert two["ndcg@10"] == one["ndcg@10"] == pytest.approx(0.6856317, abs=1e-6)
    # relevant at level 2: q1 {d2} (rank 3), q2 none (d5 is grade 1), q3 {d8} (rank 2)
    assert two["mrr@10"] == pytest.approx((1 / 3 + 0 + 1 / 2) / 3)
    assert [per_query[q]["recall@2"] for q in ("q1", "q2", "q3")] == [0.0, 0.0, 1.0]
    assert two["p@2"] == pytest.approx((0 + 0 + 1 / 2) / 3)
    assert two["map"] == pytest.approx((1 / 3 + 0 + 1 / 2) / 3)
    assert two["success@1"] == 0.0 and one["success@1"] == pytest.approx(2 / 3)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="relevance_level"):
            evaluate_run(TOY_QRELS, TOY_RUN, relevance_level=bad)


@settings(max_examples=40, deadline=None)
@given(qrels_and_run(distinct_scores=True), st.integers(1, 3))
def test_relevance_level_matches_binarized_references(data, level):
    """At any level, binary metrics equal the level-1 references on qrels binarized at ``grade >= level``, and
    nDCG equals the graded reference (the level never touches gains)."""
    qrels, run = data
    metrics = ("ndcg@10", "mrr@10", "recall@5", "p@5", "map")
    _, per_query = evaluate_run(qrels, run, metrics=metrics, relevance_level=level)
    for qid, judged in qrels.items():
        ranking = sorted(run[qid], key=lambda d: -run[qid][d])
        binary = {d: int(g >= level) for d, g in judged.items()}
        got = per_query[qid]
        assert got["ndcg@10"] == pytest.approx(ndcg_at_k_reference(judged, ranking, 10), abs=1e-9)
        assert got["mrr@10"] == pytest.approx(mrr_at_k_reference(binary, ranking, 10), abs=1e-12)
        assert got["recall@5"] == pytest.approx(recall_at_k_reference(binary, ranking, 5), abs=1e-12)
        assert got["p@5"] == pytest.approx(_p_at_k(binary, ranking, 5), abs=1e-12)
        assert got["map"] == pytest.approx(_average_precision(binary, ranking), abs=1e-9)


def test_ndcg_reference_by_hand():
    judged = {"a": 2, "b": 1, "c": -1}
    assert ndcg_at_k_reference(judged, ["c", "b", "a"], 10) == pytest.approx(
        (0 + 1 / log2(3) + 2 / log2(4)) / (2 / log2(2) + 1 / log2(3)))
    assert ndcg_at_k_reference({"a": 0}, ["a"], 10) == 0.0


# ----------------------------------------------------------------------------------------------------------
# runs.py


def test_top_k_order_and_ties():
    run = {"q": {"a": 0.5, "b": 0.9, "c": 0.5, "d": 0.1}}
    assert list(top_k(run, 3)["q"].items()) == [("b", 0.9), ("c", 0.5), ("a", 0.5)]
    assert list(top_k(run, 10)["q"]) == ["b", "c", "a", "d"]
    assert top_k(run, 0) == {"q": {}}
    with pytest.raises(ValueError):
        top_k(run, -1)


def test_write_read_roundtrip_and_format(tmp_path: Path):
    run = {"q2": {"a": 0.1 + 0.2, "b": 1e-17, "c": -3.5}, "q1": {"x": 2.0, "y": 2.0}}
    path = write_trec_run(tmp_path / "sub" / "run.trec", run, tag="mine")
    lines = path.read_text().splitlines()
    assert lines[0] == "q1 Q0 y 1 2.0 mine"
    assert lines[1] == "q1 Q0 x 2 2.0 mine"
    assert lines[2].split()[:4] == ["q2", "Q0", "a", "1"]
    assert [ln.split()[3] for ln in lines[2:]] == ["1", "2", "3"]
    assert read_trec_run(path) == run  # exact floats survive
    assert os.listdir(path.parent) == ["run.trec"]  # no temporary file left behind
    write_trec_run(path, run, k=1)
    assert read_trec_run(path) == {"q1": {"y": 2.0}, "q2": {"a": 0.1 + 0.2}}


@settings(max_examples=30, deadline=None)
@given(st.dictionaries(st.text("abcXYZ019_-.", min_size=1, max_size=6),
                       st.dictionaries(st.text("abc019:/", min_size=1, max_size=6),
                                       st.floats(allow_nan=False, width=64), max_size=6),
                       max_size=4))
def test_roundtrip_property(run):
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = write_trec_run(Path(tmp) / "r.trec", run)
        back = read_trec_run(path)
    assert back == {q: docs for q, docs in run.items() if docs}  # queries without documents write no line


def test_write_rejects_whitespace_ids_and_leaves_no_file(tmp_path: Path):
    with pytest.raises(ValueError, match="document id 'a b'"):
        write_trec_run(tmp_path / "r.trec", {"q": {"a b": 1.0}})
    with pytest.raises(ValueError, match="query id"):
        write_trec_run(tmp_path / "r.trec", {"q 1": {"a": 1.0}})
    with pytest.raises(ValueError, match="tag"):
        write_trec_run(tmp_path / "r.trec", {"q": {"a": 1.0}}, tag="my tag")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("body, message", [
    ("q1 Q0 d1 1 0.5 t\nq1 Q0 d2 2 0.4\n", r"r\.trec:2: expected 6 fields"),
    ("q1 Q0 d1 1 high t\n", r"r\.trec:1: score 'high' is not a number"),
    ("\nq1 Q0 d1 1 0.5 t\nq1 Q0 d1 2 0.4 t\n", r"r\.trec:3: document 'd1' appears twice"),
    ("q1 Q0 d1 1 nan t\n", r"r\.trec:1: score is NaN"),
])
def test_read_errors_name_file_and_line(tmp_path: Path, body: str, message: str):
    path = tmp_path / "r.trec"
    path.write_text(body)
    with pytest.raises(ValueError, match=message):
        read_trec_run(path)


@pytest.mark.parametrize("body, message", [
    ("q1 Q0 d1 1 0.5 t\nq9 Q0 d1 1 0.5 t\n", r"r\.trec:2: query id 'q9' is not among the dataset's judged queries"),
    ("q1 Q0 d1 1 0.5 t\n\nq1 Q0 d7 2 0.4 t\n", r"r\.trec:3: document id 'd7' \(query 'q1'\) is not in the corpus"),
    ("q1 Q0 d1 1 0.5\n", r"r\.trec:1: expected 6 fields"),
])
def test_read_against_a_dataset_names_unknown_ids(tmp_path: Path, body: str, message: str):
    path = tmp_path / "r.trec"
    path.write_text(body)
    with pytest.raises(ValueError, match=message) as err:
        read_trec_run(path, queries={"q1": "text"}, documents={"d1": {}, "d2": {}})
    assert "\n" not in str(err.value)
    with pytest.raises(FileNotFoundError, match=r"nope\.trec: no such run file"):
        read_trec_run(tmp_path / "nope.trec")


def test_candidates_follow_scores_not_the_file_order_and_stop_at_depth(tmp_path: Path):
    """The rank column and line order are ignored, as trec_eval ignores them: candidates are the best by score
    (ties by document id, descending), cut at ``depth``."""
    path = tmp_path / "r.trec"
    path.write_text("q1 Q0 a 1 0.1 t\nq1 Q0 b 2 0.9 t\nq1 Q0 c 3 0.5 t\nq1 Q0 d 4 0.5 t\nq2 Q0 x 1 3.0 t\n")
    run = read_trec_run(path)
    assert candidates_from_run(run) == {"q1": ["b", "d", "c", "a"], "q2": ["x"]}
    assert candidates_from_run(run, 2) == {"q1": ["b", "d"], "q2": ["x"]}
    assert run_depth(run) == 4 and run_depth({}) == 0
    assert candidates_from_run({"q": {}}, 3) == {}
    with pytest.raises(ValueError, match="depth"):
        candidates_from_run(run, 0)


def test_a_query_judged_only_negative_after_another_scores_zero_without_crashing():
    # pytrec_eval dies with SIGSEGV on these qrels when it computes two measures (issue 39): run in a child process,
    # so the crash is a failed test and not the end of the suite. Expected values by hand: q1's only judged document
    # is first (1 on every measure), q2 has nothing relevant (0), the mean is 0.5; MAP's 1/1 too.
    import subprocess
    import sys
    code = ("from hil.evaluation.metrics import evaluate_run\n"
            "qrels = {'q1': {'d1': 2}, 'q2': {'d1': -2}}\n"
            "run = {'q1': {'d1': 1.0, 'd5': 0.3}, 'q2': {'d1': 1.0, 'd3': 2.0}}\n"
            "mean, per_query = evaluate_run(qrels, run, ['ndcg@10', 'recall@100', 'map', 'mrr@10', 'ndcg'])\n"
            "print(sorted(mean.items())); print(sorted(per_query['q2'].items()))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-500:])
    mean_line, q2_line = done.stdout.strip().splitlines()
    assert mean_line == str(sorted({"map": 0.5, "mrr@10": 0.5, "ndcg": 0.5, "ndcg@10": 0.5,
                                    "recall@100": 0.5}.items()))
    assert q2_line == str(sorted({"map": 0.0, "mrr@10": 0.0, "ndcg": 0.0, "ndcg@10": 0.0,
                                  "recall@100": 0.0}.items()))
