"""Datasets through ir_datasets (``irds:<id>``, :mod:`hil.data.irds`): a small dataset registered with ir_datasets'
own API over local files (TsvDocs, TsvQueries, TrecQrels over LocalDownload; nothing downloaded) arrives whole in a
``BeirDataset`` and measures exactly as the same data written as a BEIR folder; its relevance level is the one its
official measures state; what cannot be read is one line."""

from __future__ import annotations

import dataclasses
import json
import sys
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest

ir_datasets = pytest.importorskip("ir_datasets")

from ir_datasets.datasets.base import Dataset  # noqa: E402
from ir_datasets.formats import TrecQrels, TsvDocs, TsvQueries  # noqa: E402
from ir_datasets.util import LocalDownload  # noqa: E402

from hil.cli.evaluate_script import main as evaluate_main  # noqa: E402
from hil.data.beir import load_beir  # noqa: E402
from hil.errors import DataFormatError, MissingInputError, UserError  # noqa: E402
from hil.evaluation.evaluate import evaluate_bm25, score_run  # noqa: E402

# (title, text): titled and untitled documents, so that the BEIR join ("title text", or the text alone) is checked.
CORPUS = {
    "d1": ("Flea life cycle", "a flea lives up to a year depending on its hosts"),
    "d2": ("", "concrete flooring costs depend on the finish and the area"),
    "d3": ("Declaratory judgment", "a court states the rights of the parties without ordering anything"),
    "d4": ("", "fleas lay eggs on pets and the eggs fall into carpets"),
    "d5": ("Interior floors", "polished concrete floors inside a house"),
    "d6": ("", "judgment of a court in a civil case"),
}
QUERIES = {"q1": "how long do fleas live", "q2": "cost of interior concrete flooring",
           "q3": "definition declaratory judgment", "q4": "a query nobody judged"}
QRELS = [("q1", "d1", 3), ("q1", "d4", 1), ("q1", "ghost", 2),  # "ghost" is judged but not in the corpus
         ("q2", "d2", 2), ("q2", "d5", 1), ("q2", "d1", 0),
         ("q3", "d3", 2), ("q3", "d6", 1)]
TREC_DL_MEASURES = ["nDCG@10", "RR(rel=2)", "AP(rel=2)"]  # ir_datasets' msmarco-passage/trec-dl-2019 documentation


class TitledDoc(NamedTuple):
    doc_id: str
    title: str
    text: str

    def default_text(self) -> str:
        return f"{self.title} {self.text}"


class Documentation:
    """An ir_datasets documentation component (what ``documentation()`` of a registered dataset returns)."""

    def __init__(self, measures: list[str]) -> None:
        self.measures = measures

    def documentation(self) -> dict:
        return {"official_measures": self.measures}


def register(folder: Path, measures: list[str] | None = None, docs: str | None = None, qrels: bool = True) -> str:
    """A dataset registered in ir_datasets' registry from local files; -> its id (unique per call)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "docs.tsv").write_text(docs if docs is not None else
                                     "".join(f"{d}\t{title}\t{text}\n" for d, (title, text) in CORPUS.items()))
    (folder / "queries.tsv").write_text("".join(f"{q}\t{text}\n" for q, text in QUERIES.items()))
    (folder / "qrels.txt").write_text("".join(f"{q} 0 {d} {grade}\n" for q, d, grade in QRELS))
    parts = [TsvDocs(LocalDownload(folder / "docs.tsv"), doc_cls=TitledDoc),
             TsvQueries(LocalDownload(folder / "queries.tsv"))]
    if qrels:
        parts.append(TrecQrels(LocalDownload(folder / "qrels.txt"), {0: "no", 1: "related", 2: "highly", 3: "perfect"}))
    if measures is not None:
        parts.append(Documentation(measures))
    dataset_id = f"hil-test/{uuid.uuid4().hex[:8]}"
    ir_datasets.registry.register(dataset_id, Dataset(*parts))
    return dataset_id


def beir_folder(folder: Path) -> Path:
    """The same data as a BEIR folder, written independently of the ir_datasets files."""
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": d, "title": title, "text": text}) + "\n"
                                                 for d, (title, text) in CORPUS.items()))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in QUERIES.items()))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" +
                                               "".join(f"{q}\t{d}\t{g}\n" for q, d, g in QRELS))
    return folder


def test_every_document_query_and_judgment_arrives(tmp_path):
    dataset_id = register(tmp_path / "irds")
    dataset = load_beir(f"irds:{dataset_id}")
    assert dataset.corpus == {d: {"title": title, "text": text} for d, (title, text) in CORPUS.items()}
    assert dataset.queries == {q: t for q, t in QUERIES.items() if q != "q4"}  # judged queries only (BEIR's rule)
    expected: dict[str, dict[str, int]] = {}
    for q, d, grade in QRELS:
        expected.setdefault(q, {})[d] = grade
    assert dataset.qrels == expected and dataset.judged_outside_corpus == 1
    assert dataset.doc_text("d1") == "Flea life cycle a flea lives up to a year depending on its hosts"
    assert dataset.doc_text("d2") == CORPUS["d2"][1]  # no title: the text alone, as BEIR joins them
    assert (dataset.split, dataset.source, dataset.relevance_level) == (dataset_id, f"irds:{dataset_id}", 1)
    assert dataset.name == dataset_id.replace("/", "-")

    folder = load_beir(beir_folder(tmp_path / "beir"))
    assert (folder.corpus, folder.queries, folder.qrels) == (dataset.corpus, dataset.queries, dataset.qrels)
    assert dataclasses.replace(dataset, split="test").fingerprint() == folder.fingerprint()  # same content


def test_metrics_equal_those_of_the_same_data_from_a_beir_folder(tmp_path):
    dataset = load_beir(f"irds:{register(tmp_path / 'irds')}")
    folder = load_beir(beir_folder(tmp_path / "beir"))
    ours, theirs = evaluate_bm25(dataset, k=5), evaluate_bm25(folder, k=5)
    assert ours.run == theirs.run
    assert ours.aggregate == theirs.aggregate and ours.per_query == theirs.per_query
    assert 0.0 < ours.aggregate["ndcg@10"] < 1.0


def test_the_relevance_level_is_the_official_measures_and_changes_the_binary_metrics(tmp_path):
    documented = load_beir(f"irds:{register(tmp_path / 'dl', measures=TREC_DL_MEASURES)}")
    assert documented.relevance_level == 2
    assert load_beir(f"irds:{register(tmp_path / 'plain', measures=['nDCG@10'])}").relevance_level == 1
    assert load_beir(f"irds:{register(tmp_path / 'asked', measures=TREC_DL_MEASURES)}",
                     relevance_level=1).relevance_level == 1  # an explicit level wins
    run = {"q1": {"d4": 3.0, "d1": 2.0}, "q2": {"d5": 3.0, "d2": 1.0}, "q3": {"d6": 2.0, "d3": 1.0}}
    folder = beir_folder(tmp_path / "beir")
    at_2 = score_run("run", load_beir(folder, relevance_level=2), run).aggregate
    at_1 = score_run("run", load_beir(folder, relevance_level=1), run).aggregate
    assert score_run("run", documented, run).aggregate == at_2 and at_2["mrr@10"] != at_1["mrr@10"]


def test_ir_datasets_own_trec_dl_and_beir_ids_resolve_with_their_levels():
    """The real registry, read without downloading anything: TREC DL's official measures count grade >= 2."""
    from hil.data.irds import open_irds, relevance_level

    assert relevance_level(open_irds("msmarco-passage/trec-dl-2019/judged")) == 2
    assert relevance_level(open_irds("msmarco-passage/trec-dl-2020/judged")) == 2
    assert relevance_level(open_irds("beir/scifact/test")) == 1


def test_evaluate_py_takes_an_irds_name_and_records_its_level(tmp_path, capsys):
    dataset_id = register(tmp_path / "irds", measures=TREC_DL_MEASURES)
    folder = beir_folder(tmp_path / "beir")
    common = ["--model", "unused", "--mode", "bm25", "--k", "5", "--no-stats", "--quiet"]
    assert evaluate_main([*common, "--dataset", f"irds:{dataset_id}", "--output", str(tmp_path / "a")]) == 0
    assert evaluate_main([*common, "--dataset", str(folder), "--relevance-level", "2",
                          "--output", str(tmp_path / "b")]) == 0
    ours, theirs = (json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("a", "b"))
    assert ours["results"]["bm25"]["metrics"] == theirs["results"]["bm25"]["metrics"]
    assert ours["dataset"]["relevance_level"] == 2


def test_what_cannot_be_read_is_one_line(tmp_path, monkeypatch, capsys):
    with pytest.raises(MissingInputError, match="no ir_datasets dataset with id 'beir/scifakt/test'.*beir/scifact"):
        load_beir("irds:beir/scifakt/test")
    with pytest.raises(UserError, match="has no qrels"):
        load_beir(f"irds:{register(tmp_path / 'noqrels', qrels=False)}")
    repeated = register(tmp_path / "dup", docs="d1\tA\tone\nd1\tB\ttwo\n")
    with pytest.raises(DataFormatError, match=r"irds:hil-test/\w+/docs:2: duplicate _id 'd1' \(first on line 1\)"):
        load_beir(f"irds:{repeated}")
    damaged = register(tmp_path / "gone")
    (tmp_path / "gone" / "docs.tsv").unlink()  # an interrupted download, say: ir_datasets' own error, one line
    with pytest.raises(MissingInputError, match=rf"irds:{damaged}: ir_datasets could not read it \(FileNotFoundError"):
        load_beir(f"irds:{damaged}")
    with pytest.raises(UserError, match="split 'dev' does not apply"):
        load_beir("irds:beir/scifact/test", split="dev")
    with pytest.raises(UserError, match="give an ir_datasets id"):
        load_beir("irds:")

    monkeypatch.setitem(sys.modules, "ir_datasets", None)  # as if it were not installed
    with pytest.raises(UserError, match=r"irds:beir/scifact/test: ir_datasets is not installed \(pip install "
                                        r"ir_datasets\)"):
        load_beir("irds:beir/scifact/test")
    assert evaluate_main(["--model", "m", "--dataset", "irds:beir/scifact/test", "--mode", "bm25"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install ir_datasets" in err[0], err
