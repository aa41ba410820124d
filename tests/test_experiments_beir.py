"""BEIR in one command (``hil beir``): Table 2's numbers against the results files and
pytrec_eval, CQADupStack as the mean of its forums, averages and relative changes by hand, resume, judgments of
documents outside the corpus, and one-line user errors.

One sweep (module fixture) runs two untrained-head models of the shared tiny BERT over a data dir built in tmp:
slices of SciFact, NFCorpus and TREC DL19 (links to the shared folders), three fake CQADupStack forums of unequal
sizes, and a fake SCIDOCS whose qrels judge a document missing from its corpus.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import pytrec_eval
from scipy import stats as scipy_stats

import hil.cli.beir as beir_cli
import hil.evaluation.runner as runner
from hil.evaluation.runner import column_name
from hil.evaluation.statistics import bootstrap_ci, stratified_bootstrap_ci
from hil.experiments.beir_sets import CQADUPSTACK_FORUMS, select
from hil.experiments.beir_table import Cell, average_row, forum_mean, relative_change

pytestmark = pytest.mark.integration

FORUM_QUERIES = {"android": 2, "english": 3, "gaming": 5}  # unequal: the forum mean is not the pooled mean
WORDS = "battery screen wifi camera keyboard storage update password sound bluetooth".split()
GHOST = "ghost-doc"  # judged, not in the corpus
REPO = Path(__file__).resolve().parents[1]


# -- a fake BEIR data dir ------------------------------------------------------------------------------------------

def write_beir(folder: Path, corpus: dict[str, str], queries: dict[str, str], qrels: list[tuple[str, str, int]]):
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": i, "title": "", "text": t}) + "\n"
                                                 for i, t in corpus.items()))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": i, "text": t}) + "\n" for i, t in queries.items()))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" +
                                               "".join(f"{q}\t{d}\t{s}\n" for q, d, s in qrels))


def forum(folder: Path, name: str, n_queries: int, n_docs: int = 8) -> None:
    corpus = {f"{name}-d{i}": f"{name} {WORDS[i]} {WORDS[(3 * i + 1) % 10]} question about {WORDS[(i + 2) % 10]}"
              for i in range(n_docs)}
    queries = {f"q{j}": f"{WORDS[j]} {WORDS[(j + 5) % 10]} problem" for j in range(n_queries)}
    qrels = [(f"q{j}", f"{name}-d{j}", 1) for j in range(n_queries)]
    qrels += [(f"q{j}", f"{name}-d{(j + 3) % n_docs}", 2) for j in range(0, n_queries, 2)]
    write_beir(folder, corpus, queries, qrels)


def data_dir(root: Path, shared: Path) -> Path:
    (root / "beir").mkdir(parents=True)
    for name in ("scifact", "nfcorpus"):
        (root / "beir" / name).symlink_to(shared / "data" / "beir" / name)
    (root / "msmarco").mkdir()
    (root / "msmarco" / "dl19").symlink_to(shared / "data" / "msmarco" / "dl19")
    for name, n in FORUM_QUERIES.items():
        forum(root / "beir" / "cqadupstack" / name, name, n)
    corpus = {f"d{i}": f"{WORDS[i]} {WORDS[i + 1]} paper abstract" for i in range(6)}
    queries = {"q0": "battery screen", "q1": "screen wifi", "q2": "wifi camera"}
    write_beir(root / "beir" / "scidocs", corpus, queries,
               [("q0", "d0", 1), ("q0", GHOST, 2), ("q1", "d1", 1), ("q2", "d2", 1), ("q2", "d4", 1)])
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model_dir: Path) -> dict[str, str]:
    """Two columns: the bare tiny BERT (a seeded untrained head) and an export of it with another random head."""
    import torch

    from hil.modeling.loading import load_encoder

    torch.manual_seed(7)
    export = tmp_path_factory.mktemp("models") / "other" / "export"
    load_encoder(tiny_model_dir, dim=16).save_pretrained(export)
    return {"tiny": f"tiny={tiny_model_dir}", "other": str(export)}


def sweep_args(data: Path, out: Path, models: dict[str, str], *extra: str) -> list[str]:
    return ["--model", models["tiny"], "--model", models["other"], "--datasets", "all", "--data-dir", str(data),
            "--out", str(out), "--mode", "exhaustive", "--index-root", "none", "--k", "50", "--rerank-depth", "20",
            "--max-queries", "6", "--max-docs", "60", "--dim", "16", "--bootstrap-samples", "200", "--device", "cpu",
            "--quiet", *extra]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, shared_dir: Path, models, one_thread_module) -> dict:
    root = tmp_path_factory.mktemp("beir")
    data, out = data_dir(root / "data", shared_dir), root / "out"
    args = sweep_args(data, out, models)
    assert beir_cli.main(args) == 0
    return {"data": data, "out": out, "args": args, "table": json.loads((out / "table.json").read_text())}


@pytest.fixture(scope="module")
def one_thread_module():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def record(out: Path, part: str, column: str) -> dict:
    return json.loads((out / part / f"{column}.json").read_text())


def row(table: dict, key: str) -> dict:
    return next(r for r in table["rows"] if r["dataset"] == key)


def plain_ndcg10(data: Path, part: str, run_path: Path, qids: list[str]) -> dict[str, float]:
    """nDCG@10 per query from the qrels file and the TREC run, read the plainest way, through pytrec_eval."""
    folder = data / "beir" / part if (data / "beir" / part).exists() else data / part
    qrels: dict[str, dict[str, int]] = {}
    for line in (folder / "qrels" / "test.tsv").read_text().splitlines()[1:]:
        q, d, s = line.split("\t")
        if q in qids:
            qrels.setdefault(q, {})[d] = int(s)
    run: dict[str, dict[str, float]] = {}
    for line in run_path.read_text().splitlines():
        q, _, d, _, score, _ = line.split()
        run.setdefault(q, {})[d] = float(score)
    judged = {q: ranked for q, ranked in run.items() if q in qrels}
    scores = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10"}).evaluate(judged)
    return {q: scores[q]["ndcg_cut_10"] if q in scores else 0.0 for q in qids}


COLUMNS = ("bm25", "tiny", "other")


# -- the table's numbers -------------------------------------------------------------------------------------------

def test_table_cells_are_the_results_files_numbers_and_pytrec_evals(sweep):
    table, out, data = sweep["table"], sweep["out"], sweep["data"]
    assert table["columns"] == list(COLUMNS) and table["baseline"] == "tiny"
    assert [r["dataset"] for r in table["rows"]] == ["dl19", "nfcorpus", "cqadupstack", "scidocs", "scifact"]
    for key, part in (("scifact", "scifact"), ("nfcorpus", "nfcorpus"), ("scidocs", "scidocs")):
        for column in COLUMNS:
            result = record(out, part, column)
            per_query = plain_ndcg10(data, part, out / part / f"{column}.trec", list(result["per_query"]))
            assert row(table, key)["scores"][column] == pytest.approx(np.mean(list(per_query.values())), abs=1e-12)
            assert row(table, key)["scores"][column] == result["metrics"]["ndcg@10"]
            assert {q: v["ndcg@10"] for q, v in result["per_query"].items()} == pytest.approx(per_query, abs=1e-12)
    assert len(record(out, "scifact", "tiny")["per_query"]) == 6  # --max-queries


def test_cqadupstack_row_is_the_mean_of_its_forums(sweep):
    table, out = sweep["table"], sweep["out"]
    cqa = row(table, "cqadupstack")
    assert cqa["forums"] == list(FORUM_QUERIES) and cqa["n_forums"] == len(CQADUPSTACK_FORUMS)
    for column in COLUMNS:
        forums = [record(out, f"cqadupstack/{name}", column) for name in FORUM_QUERIES]
        assert [len(f["per_query"]) for f in forums] == list(FORUM_QUERIES.values())
        assert cqa["scores"][column] == pytest.approx(np.mean([f["metrics"]["ndcg@10"] for f in forums]), abs=1e-12)
    assert cqa["queries"] == sum(FORUM_QUERIES.values())
    assert "3 of 12 forums" in (out / "table.md").read_text()


def test_average_and_relative_changes_by_hand(sweep):
    table = sweep["table"]
    counted = ["nfcorpus", "cqadupstack", "scidocs", "scifact"]  # DL19 is in-domain: not averaged
    assert table["average"]["datasets"] == counted
    avg = {c: np.mean([row(table, k)["scores"][c] for k in counted]) for c in COLUMNS}
    for column in COLUMNS:
        assert table["average"]["scores"][column] == pytest.approx(avg[column], abs=1e-12)
    for column in ("tiny", "other"):
        assert table["average"]["relative_to_bm25"][column] == pytest.approx((avg[column] - avg["bm25"]) / avg["bm25"])
        assert table["average"]["points_vs_bm25"][column] == pytest.approx(avg[column] - avg["bm25"])
    for column in ("bm25", "other"):
        assert table["average"]["relative_to_baseline"][column] == pytest.approx(
            (avg[column] - avg["tiny"]) / avg["tiny"])
    assert table["average"]["relative_to_baseline"]["tiny"] is None
    for r in table["rows"]:
        s = r["scores"]
        assert r["relative_to_bm25"]["other"] == pytest.approx((s["other"] - s["bm25"]) / s["bm25"])
        assert r["relative_to_baseline"]["other"] == pytest.approx((s["other"] - s["tiny"]) / s["tiny"])
        assert r["relative_to_baseline"]["bm25"] == pytest.approx((s["bm25"] - s["tiny"]) / s["tiny"])
    md = (sweep["out"] / "table.md").read_text()
    rel = table["average"]["relative_to_bm25"]["other"]
    assert f"{100 * rel:+.2f}%" in md


def test_paired_tests_are_about_the_numbers_in_the_table(sweep):
    """Each test's mean difference is the difference of the two cells (CQADupStack's too: its pooled values are
    weighted); on a plain dataset the t-test's p is scipy's on the per-query values."""
    table, out = sweep["table"], sweep["out"]
    for r in table["rows"]:
        s = r["scores"]
        assert r["p_vs_baseline"]["other"]["diff"] == pytest.approx(s["other"] - s["tiny"], abs=1e-12)
        assert r["p_vs_bm25"]["tiny"]["diff"] == pytest.approx(s["tiny"] - s["bm25"], abs=1e-12)
        assert r["p_vs_baseline"]["bm25"]["diff"] == pytest.approx(s["bm25"] - s["tiny"], abs=1e-12)
        for column in COLUMNS:
            low, high = r["intervals"][column]
            assert 0.0 <= low <= s[column] + 1e-12 and s[column] <= high + 1e-12 and high <= 1.0 + 1e-12
    a, b = (record(out, "scifact", c)["per_query"] for c in ("other", "tiny"))
    expected = scipy_stats.ttest_rel([a[q]["ndcg@10"] for q in sorted(a)], [b[q]["ndcg@10"] for q in sorted(a)])
    assert row(table, "scifact")["p_vs_baseline"]["other"]["t"] == pytest.approx(expected.pvalue)


def test_dl19_reranks_its_shipped_run_which_is_the_bm25_column(sweep):
    from hil.data.beir import load_beir
    from hil.evaluation.evaluate import evaluate_run_file, subset_with_first_stage

    out, dl19 = sweep["out"], sweep["data"] / "msmarco" / "dl19"
    bm25, tiny = record(out, "msmarco/dl19", "bm25"), record(out, "msmarco/dl19", "tiny")
    dataset = load_beir(dl19, judged_outside_corpus="keep", relevance_level=2)
    given = evaluate_run_file(dl19 / "bm25-top100.trec", dataset, name="bm25")
    _, first, candidates = subset_with_first_stage(dataset, given, 6, 60, seed=12345, depth=20)
    assert bm25["metrics"]["ndcg@10"] == pytest.approx(first.aggregate["ndcg@10"], abs=1e-12)
    assert tiny["details"]["mode"] == "rerank" and tiny["dataset"]["relevance_level"] == 2
    tiny_run = {}
    for line in (out / "msmarco/dl19/tiny.trec").read_text().splitlines():
        tiny_run.setdefault(line.split()[0], set()).add(line.split()[2])
    assert all(docs <= set(candidates[q]) for q, docs in tiny_run.items())  # only BM25's top 20 re-ranked
    assert not row(sweep["table"], "dl19")["in_average"]


# -- judgments of documents outside the corpus ----------------------------------------------------------------------

def test_judgments_outside_the_corpus_are_counted_and_kept_in_the_ideal_dcg(sweep):
    table, out, data = sweep["table"], sweep["out"], sweep["data"]
    for column in COLUMNS:
        result = record(out, "scidocs", column)
        assert result["dataset"]["judged_outside_corpus"] == 1
        kept = plain_ndcg10(data, "scidocs", out / "scidocs" / f"{column}.trec", ["q0", "q1", "q2"])
        assert result["per_query"]["q0"]["ndcg@10"] == pytest.approx(kept["q0"], abs=1e-12)
        assert result["per_query"]["q0"]["ndcg@10"] < 1.0  # the ghost (grade 2) can never be retrieved
    assert row(table, "scidocs")["judged_outside_corpus"] == 1
    assert "1 judgment of documents outside the corpus" in (out / "table.md").read_text()


# -- resume ---------------------------------------------------------------------------------------------------------

def test_resume_skips_finished_pairs_and_recomputes_one_whose_settings_changed(sweep, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(sweep["out"], out)
    calls: list[str] = []
    real_evaluate, real_bm25 = runner.evaluate, runner.evaluate_bm25
    monkeypatch.setattr(runner, "evaluate", lambda encoder, dataset, settings, **kw: calls.append(kw["name"]) or
                        real_evaluate(encoder, dataset, settings, **kw))
    monkeypatch.setattr(runner, "evaluate_bm25", lambda dataset, **kw: calls.append("bm25") or
                        real_bm25(dataset, **kw))
    args = [a if a != str(sweep["out"]) else str(out) for a in sweep["args"]]
    assert beir_cli.main(args) == 0
    assert calls == []
    again = json.loads((out / "table.json").read_text())
    assert [r["scores"] for r in again["rows"]] == [r["scores"] for r in sweep["table"]["rows"]]

    path = out / "cqadupstack" / "english" / "other.json"  # as if made with another k
    changed = json.loads(path.read_text())
    changed["identity"]["evaluation"]["k"] = 7
    path.write_text(json.dumps(changed))
    assert beir_cli.main(args) == 0
    assert calls == ["other"]
    assert json.loads(path.read_text())["identity"]["evaluation"]["k"] == 50

    calls.clear()
    assert beir_cli.main(args[:-1] + ["--datasets", "scidocs", "--precision", "bf16", "--quiet"]) == 0
    assert calls == ["tiny", "other"]  # the models' settings changed, BM25's did not


# -- user errors ----------------------------------------------------------------------------------------------------

def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("HIL_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "hil", "beir", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_unknown_dataset_and_bad_model_path_are_one_line_without_traceback(tmp_path, tiny_model_dir):
    unknown = run_cli("--model", str(tiny_model_dir), "--datasets", "scifact,nope", cwd=REPO)
    bad_model = run_cli("--model", str(tmp_path / "no-such-model"), "--datasets", "scifact", "--out",
                        str(tmp_path / "out"), cwd=REPO)
    for done, option in ((unknown, "--datasets"), (bad_model, "--model")):
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and option in lines[0], done.stderr
    assert "'nope'" in unknown.stderr and "no-such-model" in bad_model.stderr
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize("args, option", [
    (["--model", "=some/path"], "--model"),
    (["--model", "bad name=some/path"], "--model"),
    (["--model", "bm25=some/path"], "--model"),
    (["--model", "a=x", "--model", "a=y"], "--model"),
    (["--model", "a=x", "--baseline", "b"], "--baseline"),
    (["--model", "a=x", "--datasets", ""], "--datasets"),
    (["--model", "a=x", "--index-root", "none"], "--index-root"),
    (["--model", "a=x", "--k", "0"], "--k"),
])
def test_bad_arguments_are_one_line_naming_the_option(args, option, capsys):
    assert beir_cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and option in err[0], err


def test_a_path_that_is_no_model_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk.ckpt").write_text("not a checkpoint")
    for source in (tmp_path / "empty", tmp_path / "junk.ckpt"):
        assert beir_cli.main(["--model", str(source), "--datasets", "scifact", "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--model {source}" in err[0], err


def test_no_dataset_found_and_an_unreachable_named_one_are_one_line(tmp_path, capsys, tiny_model_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert beir_cli.main(["--model", f"t={tiny_model_dir}", "--data-dir", str(empty),
                          "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--datasets" in err[0] and "no BEIR dataset found" in err[0], err
    assert beir_cli.main(["--model", f"t={tiny_model_dir}", "--data-dir", str(empty), "--datasets", "dl19", "--quiet",
                      "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--datasets dl19" in err[0], err
    assert not (tmp_path / "o" / "table.json").exists()


def test_all_names_the_missing_datasets_in_one_notice(sweep, tmp_path, capsys, models):
    out = tmp_path / "out"
    shutil.copytree(sweep["out"], out)
    assert beir_cli.main([a if a != str(sweep["out"]) else str(out) for a in sweep["args"]]) == 0
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice:")]
    assert len(notices) == 1
    for name in ("msmarco", "trec-covid", "cqadupstack/gis", "climate-fever"):
        assert name in notices[0]
    assert "cqadupstack/android" not in notices[0] and "scifact" not in notices[0]
    assert "cqadupstack/wordpress" in sweep["table"]["missing"]


# -- pure pieces ----------------------------------------------------------------------------------------------------

def test_forum_mean_weights_queries_so_the_pooled_mean_is_the_mean_of_forum_means():
    forums = {"a": Cell(0.5, {"q1": 0.0, "q2": 1.0}), "b": Cell(0.1, {"q1": 0.1, "q2": 0.1, "q3": 0.1, "q4": 0.1})}
    combined = forum_mean(forums)
    assert combined.mean == pytest.approx(0.3)
    assert np.mean(list(combined.per_query.values())) == pytest.approx(0.3)
    assert set(combined.per_query) == {"a/q1", "a/q2", "b/q1", "b/q2", "b/q3", "b/q4"}


def test_stratified_bootstrap_keeps_each_forum_weight_and_is_the_plain_bootstrap_for_one():
    strata = {"a": [1.0, 1.0], "b": [0.0, 0.0, 0.0, 0.0, 0.0]}
    result = stratified_bootstrap_ci(strata, n_samples=300, seed=3)
    assert (result.low, result.high, result.observed) == pytest.approx((0.5, 0.5, 0.5))  # pooled: it would vary
    values = [0.1, 0.7, 0.3, 0.9, 0.4]
    one, plain = stratified_bootstrap_ci({"x": values}, n_samples=300, seed=3), bootstrap_ci(values, 300, seed=3)
    assert (one.low, one.high, one.mean) == pytest.approx((plain.low, plain.high, plain.mean))


def test_relative_change_and_an_average_over_the_rows_every_column_has():
    assert relative_change(0.55, 0.5) == pytest.approx(0.1)
    assert relative_change(0.5, 0.0) is None and relative_change(None, 0.5) is None
    rows = [{"dataset": "a", "in_average": True, "scores": {"bm25": 0.4, "m": 0.5}},
            {"dataset": "b", "in_average": True, "scores": {"bm25": 0.2, "m": None}},
            {"dataset": "c", "in_average": False, "scores": {"bm25": 0.9, "m": 0.1}},
            {"dataset": "d", "in_average": True, "scores": {"bm25": 0.6, "m": 0.3}}]
    average = average_row(rows, ["bm25", "m"], "m")
    assert average["datasets"] == ["a", "d"] and average["left_out"] == ["b"]
    assert average["scores"] == pytest.approx({"bm25": 0.5, "m": 0.4})
    assert average["relative_to_bm25"]["m"] == pytest.approx(-0.2)
    assert average["points_vs_baseline"]["bm25"] == pytest.approx(0.1)


def test_selection_uses_local_forums_and_refuses_unknown_names(tmp_path):
    forum(tmp_path / "beir" / "cqadupstack" / "tex", "tex", 2)
    chosen = select("cqadupstack", tmp_path)
    assert chosen.parts == {"cqadupstack": ("cqadupstack/tex",)}
    assert "cqadupstack/unix" in chosen.missing
    hub = select("scifact", tmp_path)  # not local: loaded from the hub
    assert hub.parts == {"scifact": ("scifact",)} and hub.local == {}
    with pytest.raises(ValueError, match="unknown dataset 'sci-fact'"):
        select("sci-fact", tmp_path)
    assert column_name("runs/hil/export") == "hil" and column_name("ckpts/last.ckpt") == "last"
