"""One engine, one answer (issue 39, Build 3): ``hil evaluate`` scores a CQADupStack parent folder as ``hil beir``
does (each forum, then the mean of the forums' means); a dataset's default split is the same in every command
(``dev`` for BEIR's ``msmarco``, ``test`` otherwise; an explicit split wins); a misspelled dataset is refused before
any model or torch code is imported.

Data: tiny BEIR folders written into tmp_path (three forums of unequal sizes, so that the mean of the forum means
is not the pooled mean; an ``msmarco`` folder whose ``dev`` and ``test`` qrels judge different queries).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hil.cli import beir as beir_cli
from hil.cli.main import main as hil_main
from hil.data.beir import default_split, forum_folders, load_beir

FORUM_QUERIES = {"android": 2, "english": 3, "gaming": 5}  # unequal: the forum mean is not the pooled mean
WORDS = "battery screen wifi camera keyboard storage update password sound bluetooth".split()
REPO = Path(__file__).resolve().parents[1]


def write_beir(folder: Path, corpus: dict[str, str], queries: dict[str, str],
               qrels: dict[str, list[tuple[str, str, int]]]) -> Path:
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": i, "title": "", "text": t}) + "\n"
                                                 for i, t in corpus.items()))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": i, "text": t}) + "\n" for i, t in queries.items()))
    for split, rows in qrels.items():
        (folder / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" +
                                                       "".join(f"{q}\t{d}\t{s}\n" for q, d, s in rows))
    return folder


def forum(folder: Path, name: str, n_queries: int, n_docs: int = 8) -> None:
    corpus = {f"{name}-d{i}": f"{name} {WORDS[i]} {WORDS[(3 * i + 1) % 10]} question about {WORDS[(i + 2) % 10]}"
              for i in range(n_docs)}
    queries = {f"q{j}": f"{WORDS[j]} {WORDS[(j + 5) % 10]} problem" for j in range(n_queries)}
    qrels = [(f"q{j}", f"{name}-d{j}", 1) for j in range(n_queries)]
    qrels += [(f"q{j}", f"{name}-d{(j + 3) % n_docs}", 2) for j in range(0, n_queries, 2)]
    write_beir(folder, corpus, queries, {"test": qrels})


def two_split_folder(folder: Path) -> Path:
    """A BEIR folder whose dev qrels judge q0 and q1, its test qrels q2 only."""
    corpus = {f"d{i}": f"{WORDS[i]} {WORDS[(i + 1) % 10]} passage" for i in range(6)}
    queries = {f"q{j}": f"{WORDS[j]} {WORDS[(j + 1) % 10]}" for j in range(3)}
    return write_beir(folder, corpus, queries, {"dev": [("q0", "d0", 1), ("q1", "d1", 1)], "test": [("q2", "d2", 1)]})


@pytest.fixture
def cqadupstack(tmp_path: Path) -> Path:
    """A data dir holding beir/cqadupstack/{android,english,gaming}; -> the data dir."""
    for name, n in FORUM_QUERIES.items():
        forum(tmp_path / "data" / "beir" / "cqadupstack" / name, name, n)
    return tmp_path / "data"


def json_of(path: Path) -> dict:
    return json.loads(path.read_text())


# -- 1. a CQADupStack parent: hil evaluate's row is hil beir's --------------------------------------------------

@pytest.mark.integration
def test_hil_evaluate_scores_a_cqadupstack_parent_as_hil_beir_does(cqadupstack, tmp_path, tiny_model_dir, capsys):
    data, parent = cqadupstack, cqadupstack / "beir" / "cqadupstack"
    beir_out, evaluate_out = tmp_path / "beir", tmp_path / "evaluate"
    assert beir_cli.main(["--model", f"tiny={tiny_model_dir}", "--datasets", "cqadupstack", "--data-dir", str(data),
                          "--out", str(beir_out), "--mode", "exhaustive", "--index-root", "none", "--dim", "16",
                          "--device", "cpu", "--bootstrap-samples", "50", "--quiet"]) == 0
    config = tmp_path / "evaluate.yaml"
    config.write_text(json.dumps({
        "models": [{"source": str(tiny_model_dir), "name": "tiny", "dim": 16}],
        "datasets": [{"name": str(parent), "key": "cqadupstack"}],
        "settings": {"mode": "exhaustive", "index_root": None, "device": "cpu"},
        "statistics": {"bootstrap_samples": 50, "permutations": 100}, "quiet": True}))
    capsys.readouterr()
    assert hil_main(["evaluate", "--config", str(config), "--output", str(evaluate_out)]) == 0
    assert "cqadupstack (the mean of 3 forums, as BEIR reports it: android, english, gaming" in capsys.readouterr().out

    table_row = next(row for row in json_of(beir_out / "table.json")["rows"] if row["dataset"] == "cqadupstack")
    mean_row = json_of(evaluate_out / "cqadupstack" / "metrics.json")
    assert list(mean_row["dataset"]["forums"]) == list(FORUM_QUERIES)
    assert mean_row["dataset"]["queries"] == sum(FORUM_QUERIES.values())
    for column in ("bm25", "tiny"):
        forums = {name: json_of(evaluate_out / "cqadupstack" / name / f"{column}.json")["metrics"]
                  for name in FORUM_QUERIES}
        for name, metrics in forums.items():  # the same engine per forum, and its figures kept in the row
            assert metrics == json_of(beir_out / "cqadupstack" / name / f"{column}.json")["metrics"]
            assert mean_row["results"][column]["forums"][name] == metrics
        ndcg = mean_row["results"][column]["metrics"]["ndcg@10"]
        assert ndcg == table_row["scores"][column]  # one rule, one number
        assert ndcg == pytest.approx(sum(m["ndcg@10"] for m in forums.values()) / len(forums), abs=1e-12)
        pooled = [v["ndcg@10"] for name in FORUM_QUERIES
                  for v in json_of(evaluate_out / "cqadupstack" / name / f"{column}.json")["per_query"].values()]
        assert len(pooled) == sum(FORUM_QUERIES.values())
        for metric, value in mean_row["results"][column]["metrics"].items():  # every metric, not only nDCG@10
            assert value == pytest.approx(sum(m[metric] for m in forums.values()) / len(forums), abs=1e-12)
    intervals = mean_row["statistics"]["bootstrap"]["tiny"]["ndcg@10"]
    assert intervals["observed"] == pytest.approx(mean_row["results"]["tiny"]["metrics"]["ndcg@10"], abs=1e-12)


def test_a_parent_is_one_dataset_nowhere_else(cqadupstack, tmp_path):
    """A forum folder loaded as one dataset names its forums and where the folder is taken whole."""
    from hil.errors import MissingInputError

    with pytest.raises(MissingInputError, match="a folder of 3 BEIR datasets .android, english, gaming.*hil evaluate"):
        load_beir(cqadupstack / "beir" / "cqadupstack")


def test_only_cqadupstack_is_averaged_over_its_folders(tmp_path):
    """A folder that is no BEIR dataset but holds some (MS MARCO's triples beside ``dl19/``) is refused as before,
    never scored as the mean of what it holds."""
    msmarco = tmp_path / "msmarco"
    two_split_folder(msmarco / "dl19")
    (msmarco / "triples.train.small.tsv").write_text("q\tpos\tneg\n")
    assert forum_folders(msmarco) == ()
    assert hil_main(["evaluate", "--dataset", str(msmarco), "--output", str(tmp_path / "out"), "--quiet", "true"]) == 2
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("metrics.json"))


# -- 2. one default split in every command --------------------------------------------------------------------

def test_the_default_split_lives_in_the_data_layer_and_an_explicit_one_wins(tmp_path):
    msmarco, other = two_split_folder(tmp_path / "msmarco"), two_split_folder(tmp_path / "nfcorpus")
    assert [default_split(name) for name in ("msmarco", "BeIR/msmarco", "beir/msmarco", msmarco, "scifact",
                                             "msmarco/dl19", other)] == ["dev"] * 4 + ["test"] * 3
    loaded = load_beir(msmarco)
    assert (loaded.split, sorted(loaded.queries)) == ("dev", ["q0", "q1"])
    explicit = load_beir(msmarco, split="test")
    assert (explicit.split, sorted(explicit.queries)) == ("test", ["q2"])
    assert load_beir(other).split == "test" and sorted(load_beir(other).queries) == ["q2"]


@pytest.mark.parametrize("name, split, queries", [("msmarco", "dev", 2), ("nfcorpus", "test", 1)])
def test_hil_evaluate_and_hil_beir_load_the_same_default_split(tmp_path, name, split, queries):
    data = tmp_path / "data"
    folder = two_split_folder(data / "beir" / name)
    out = tmp_path / "out"
    assert hil_main(["evaluate", "--dataset", str(folder), "--output", str(out), "--quiet", "true",
                     "--statistics.enabled", "false"]) == 0  # BM25 alone: no model
    (record,) = out.glob("*/bm25.json")
    assert (json_of(record)["dataset"]["split"], json_of(record)["dataset"]["queries"]) == (split, queries)

    from hil.evaluation.runner import DatasetRun
    from hil.experiments import beir

    args = beir_cli.build_parser().parse_args(["--model", "m", "--datasets", name, "--data-dir", str(data),
                                               "--out", str(tmp_path / "beir"), "--quiet"])
    experiment, _, _ = beir.prepare(args)
    (spec,) = experiment.datasets
    loaded = DatasetRun(experiment, spec).dataset  # as hil beir's runner loads it
    assert (loaded.split, len(loaded.queries)) == (split, queries)


# -- 3. a dataset name checked before any model or torch code --------------------------------------------------

PROBE = ("import sys; from hil.cli.main import main; rc = main(sys.argv[1:]); print('torch' in sys.modules); "
         "sys.exit(rc)")


def refusal(tmp_path: Path, *argv: str, torch_free: bool = True) -> tuple[str, float]:
    """Run ``hil <argv>`` in a fresh interpreter; -> its one error line and its wall time (it must exit 2, and
    without having imported torch when ``torch_free``)."""
    env = {**os.environ, "HIL_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    seconds = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    assert not torch_free or done.stdout.strip().splitlines()[-1] == "False", "torch imported before the refusal"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0], seconds


@pytest.mark.parametrize("argv", [
    ["evaluate", "--model", "m", "--dataset", "scifcat"],
    ["index", "--model", "m", "--dataset", "scifcat", "--settings.index_root", "{tmp}/indexes"],
    ["search", "--model", "m", "--dataset", "scifcat", "--output", "{tmp}/run.trec"],
    ["beir", "--model", "m", "--datasets", "scifcat"],
], ids=lambda argv: argv[0])
def test_a_misspelled_dataset_is_refused_before_any_torch_import(tmp_path, argv):
    (tmp_path / "data").mkdir()
    line, seconds = refusal(tmp_path, *(arg.replace("{tmp}", str(tmp_path)) for arg in argv))
    assert "scifcat" in line and "scifact" in line  # named, and the close name offered
    assert seconds < 30  # no model import (17-23 s on a busy machine); an interpreter and the parser only


@pytest.mark.parametrize("command, output", [("index", "--settings.index_root"), ("search", "--output")])
def test_index_and_search_refuse_a_forum_folder_in_one_line(cqadupstack, tmp_path, command, output):
    """One index and one run are one dataset's: the folder's forums are named, and where it is taken whole."""
    line, _ = refusal(tmp_path, command, "--model", "m", "--dataset", str(cqadupstack / "beir" / "cqadupstack"),
                      output, str(tmp_path / "out.trec"), torch_free=False)  # after the model names are checked
    assert "a folder of 3 (android, english, gaming)" in line and "hil evaluate takes the folder whole" in line
