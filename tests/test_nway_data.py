"""The on-disk readers of n-way and distillation examples (hil.data.nway_files, pylate_files, run_examples, and
their readers for a config, NWayExamples, PyLateExamples, TrecRun): each parses its format exactly -- item i
equals what a slow, obvious reader (the whole file decoded, split on "\\n", json.loads of every line) gives, with
CRLF, a BOM, blank lines and unicode -- or refuses the first bad line naming file and line (fuzzed against a model
of the format, as tests/test_fuzz_loaders.py does); and each shards over two ranks and resumes exactly through
EpochShuffleSampler, and pickles cheaply."""

from __future__ import annotations

import ast
import json
import math
import pickle
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hil.data import example_files, nway_files
from hil.data.datamodule import EpochShuffleSampler
from hil.data.examples import ExampleSource, ReadSettings, ScoredExample
from hil.data.nway_files import NWayExamples, NWayFile, PyLateFile
from hil.data.pylate_files import PyLateExamples, open_pylate
from hil.data.run_examples import RunExamples, RunSettings, TrecRun
from hil.errors import DataFormatError, MissingInputError, UserError
from test_fuzz_loaders import BAD, BLANK, FUZZ, Expected, Line, blank_lines, check, files, with_bad_bytes

QUERIES = {"1": "what is α?", "2": "query two", "q3": "トークン three"}
PASSAGES = {"10": "passage ten", "11": "passage eleven ünïcode", "12": "p twelve\twith a tab", "d4": "doc four"}


def write_tables(folder: Path) -> tuple[Path, Path]:
    queries, collection = folder / "queries.tsv", folder / "collection.tsv"
    queries.write_text("".join(f"{k}\t{v}\n" for k, v in QUERIES.items()), encoding="utf-8")
    collection.write_text("".join(f"{k}\t{v}\n" for k, v in PASSAGES.items()), encoding="utf-8")
    return queries, collection


def slow_lines(path: Path) -> list[tuple[int, str]]:
    """The obvious reading: decode all, drop a BOM, split on \\n, drop one \\r, skip blank lines."""
    text = path.read_bytes().decode("utf-8").removeprefix("\ufeff")
    pieces = [piece.removesuffix("\r") for piece in text.split("\n")]
    return [(number, piece) for number, piece in enumerate(pieces, start=1) if piece.strip()]


def slow_table(path: Path) -> dict[str, str]:
    return dict(piece.split("\t", 1) for _, piece in slow_lines(path))


def items(source) -> list[ScoredExample]:
    return [source[i] for i in range(len(source))]


def odd_bytes(lines: list[str]) -> bytes:
    """A BOM, CRLF on every other line, blank lines between, no final line break."""
    body = "".join(line + ("\r\n" if i % 2 else "\n") + ("  \n" if i % 3 == 0 else "") for i, line in enumerate(lines))
    return b"\xef\xbb\xbf" + body.rstrip("\n").encode("utf-8")


# -- exact parse against the slow reader -----------------------------------------------------------------------------

NWAY_LINES = ['[1, [10, 1.5], [11, -2], [12, 0], ["d4", 3]]', '["2", [12, 1e3], [10, 2], ["11", 7], [10, 0.25]]',
              '["q3", ["d4", -0.5], [11, 2.5], [12, 1], [10, 1]]', '[2, 12, 10, 11, "d4"]']


def slow_nway(path: Path, queries: Path, collection: Path, nway: int) -> list[ScoredExample]:
    query_texts, passage_texts = slow_table(queries), slow_table(collection)
    examples = []
    for _, piece in slow_lines(path):
        qid, *entries = json.loads(piece)
        entries = entries[:nway]  # Stanford's Examples / LazyBatcher: the first nway passages
        scored = isinstance(entries[0], list)
        pids = [str(entry[0] if scored else entry) for entry in entries]
        scores = tuple(float(entry[1]) for entry in entries) if scored else None
        examples.append(ScoredExample(query_texts[str(qid)], tuple(passage_texts[p] for p in pids), scores,
                                      (str(qid), *pids)))
    return examples


@pytest.mark.parametrize("nway", [2, 3, 4])
def test_nway_file_equals_the_slow_reader(tmp_path, nway):
    queries, collection = write_tables(tmp_path)
    path = tmp_path / "examples.jsonl"
    path.write_bytes(odd_bytes(NWAY_LINES))
    source = NWayFile(path, queries, collection, nway=nway)
    assert isinstance(source, ExampleSource)
    assert items(source) == slow_nway(path, queries, collection, nway)
    assert source[-1] == source[len(source) - 1]
    assert [e.n_documents for e in items(source)] == [nway] * 4
    assert items(source)[3].scores is None  # bare pids: positive first, no scores
    with pytest.raises(IndexError):
        source[len(source)]


def test_nway_none_takes_all_and_needs_equal_lines(tmp_path):
    queries, collection = write_tables(tmp_path)
    path = tmp_path / "examples.jsonl"
    path.write_text("\n".join(NWAY_LINES) + "\n", encoding="utf-8")
    assert [e.n_documents for e in items(NWayFile(path, queries, collection))] == [4] * 4
    path.write_text("\n\n".join(NWAY_LINES[:2] + ['[1, [10, 1], [11, 2]]']), encoding="utf-8")
    with pytest.raises(DataFormatError) as error:
        NWayFile(path, queries, collection)
    assert (error.value.path, error.value.line) == (str(path), 5)
    assert "holds 2 documents where the first example holds 4" in str(error.value)


def test_a_line_shorter_than_nway_is_refused_before_training(tmp_path):
    """Stanford's LazyBatcher would fail an assertion in collate when the batch is built; here, when opening."""
    queries, collection = write_tables(tmp_path)
    path = tmp_path / "examples.jsonl"
    path.write_text("\n".join(NWAY_LINES[:3] + ["", "[1, [10, 1], [11, 2]]"]) + "\n", encoding="utf-8")
    assert len(NWayFile(path, queries, collection, nway=2)) == 4
    with pytest.raises(DataFormatError, match=r"examples.jsonl:5: holds 2 documents, fewer than nway=3"):
        NWayFile(path, queries, collection, nway=3)


def slow_pylate(path: Path, queries: dict[str, str], documents: dict[str, str], nway: int) -> list[ScoredExample]:
    examples = []
    for _, piece in slow_lines(path):
        record = json.loads(piece)
        ids, scores = record["document_ids"], record["scores"]
        ids = ast.literal_eval(ids) if isinstance(ids, str) else ids  # as PyLate's KDProcessing does
        scores = ast.literal_eval(scores) if isinstance(scores, str) else scores
        pids = [str(p) for p in ids[:nway]]
        examples.append(ScoredExample(queries[str(record["query_id"])], tuple(documents[p] for p in pids),
                                      tuple(float(s) for s in scores[:nway]), (str(record["query_id"]), *pids)))
    return examples


PYLATE_LINES = ['{"query_id": 1, "document_ids": [10, "11", 12], "scores": [0.5, 1, -3.25], "extra": null}',
                '{"scores": "[2.0, 1.5, 1.0]", "document_ids": "[\'d4\', \'10\', \'12\']", "query_id": "q3"}',
                '{"query_id": "2", "document_ids": ["12", "10", "11"], "scores": [9, 8, 7]}']


@pytest.mark.parametrize("nway", [2, 3])
def test_pylate_jsonl_equals_the_slow_reader(tmp_path, nway):
    queries, collection = write_tables(tmp_path)
    path = tmp_path / "train.jsonl"
    path.write_bytes(odd_bytes(PYLATE_LINES))
    source = open_pylate(path, queries, collection, nway=nway)
    assert isinstance(source, PyLateFile)
    assert items(source) == slow_pylate(path, QUERIES, PASSAGES, nway)


def test_pylate_parquet_and_tables(tmp_path):
    """Examples and both tables in Parquet (and the queries in JSON lines): converted once, read the same; a text's
    line break becomes a space."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    records = [json.loads(line) for line in PYLATE_LINES]
    for record in records:  # Parquet holds typed lists, not their string form
        for key in ("document_ids", "scores"):
            value = record[key]
            record[key] = [str(v) for v in ast.literal_eval(value)] if isinstance(value, str) else value
    pq.write_table(pa.table({"query_id": [str(r["query_id"]) for r in records],
                             "document_ids": [[str(d) for d in r["document_ids"]] for r in records],
                             "scores": [[float(s) for s in r["scores"]] for r in records]}), tmp_path / "train.parquet")
    pq.write_table(pa.table({"document_id": list(PASSAGES), "text": list(PASSAGES.values())}),
                   tmp_path / "documents.parquet")
    queries = tmp_path / "queries.jsonl"
    queries.write_bytes(odd_bytes([json.dumps({"query_id": k, "text": v + "\nmore"}) for k, v in QUERIES.items()]))
    source = open_pylate(tmp_path / "train.parquet", queries, tmp_path / "documents.parquet", nway=3)
    expected = slow_pylate(_as_jsonl(tmp_path, PYLATE_LINES),
                           {k: v + " more" for k, v in QUERIES.items()}, PASSAGES, 3)
    assert items(source) == expected
    assert source.path == tmp_path / "train.parquet" and "documents.parquet" in source.describe()
    again = open_pylate(tmp_path / "train.parquet", queries, tmp_path / "documents.parquet", nway=3)
    assert items(again) == expected


def _as_jsonl(folder: Path, lines: list[str]) -> Path:
    path = folder / "reference.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_parquet_errors_name_the_row(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    queries, collection = write_tables(tmp_path)
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"query_id": ["1", "2", "q3"], "document_ids": [["10", "11"], ["10", "zz"], ["11", "12"]],
                             "scores": [[1.0, 2.0], [1.0, 2.0], [float("nan"), 1.0]]}), path)
    with pytest.raises(DataFormatError) as error:
        open_pylate(path, queries, collection)
    assert (error.value.path, error.value.line) == (str(path), 3) and "not finite" in str(error.value)
    pq.write_table(pa.table({"query_id": ["1", "2"], "document_ids": [["10", "11"], ["10", "zz"]],
                             "scores": [[1.0, 2.0], [1.0, 2.0]]}), path)
    with pytest.raises(DataFormatError) as error:  # found in the converted file, named by the Parquet row
        open_pylate(path, queries, collection)
    assert (error.value.path, error.value.line) == (str(path), 2) and "'zz'" in str(error.value)
    pq.write_table(pa.table({"query_id": ["1"], "docs": [["10", "11"]], "scores": [[1.0, 2.0]]}), path)
    with pytest.raises(DataFormatError, match="no column 'document_ids'"):
        open_pylate(path, queries, collection)


# -- TREC runs --------------------------------------------------------------------------------------------------------

RUN = """1 Q0 10 1 3.5 teacher
1 Q0 11 2 2.0 teacher
1\tQ0\t12 3 2.0 teacher
1 Q0 d4 4 -1 teacher
2 Q0 12 1 9 teacher
2 Q0 10 2 1e-3 teacher
2 Q0 d4 9 0.5 teacher
q3 Q0 11 1 4 teacher
q3 Q0 10 2 5 teacher
q3 Q0 d4 3 6 teacher"""
QRELS = "1\t11\t1\n1\t12\t1\n1\t10\t0\n2\t10\t2\n2\td4\t1\nq3\td4\t1\n"


def slow_run(path: Path, nway: int, depth: int | None = None) -> list[ScoredExample]:
    """Top ``nway`` of each query's ``depth`` best (score desc, docid desc), scores as targets."""
    run: dict[str, dict[str, float]] = {}
    for _, piece in slow_lines(path):
        qid, _, docid, _, score, _ = piece.split()
        run.setdefault(qid, {})[docid] = float(score)
    examples = []
    for qid, docs in run.items():
        ordered = sorted(docs.items(), key=lambda item: (item[1], item[0]), reverse=True)[:depth][:nway]
        examples.append(ScoredExample(QUERIES[qid], tuple(PASSAGES[d] for d, _ in ordered),
                                      tuple(s for _, s in ordered), (qid, *(d for d, _ in ordered))))
    return examples


@pytest.mark.parametrize("nway,depth", [(2, None), (3, None), (2, 3), (3, 3)])
def test_run_equals_the_slow_reader(tmp_path, nway, depth):
    queries, collection = write_tables(tmp_path)
    path = tmp_path / "teacher.trec"
    path.write_bytes(odd_bytes(RUN.splitlines()))
    source = RunExamples(path, queries, collection, RunSettings(nway, depth))
    assert isinstance(source, ExampleSource)
    assert items(source) == slow_run(path, nway, depth)
    assert items(source)[0].ids == (("1", "10", "12") if nway == 2 else ("1", "10", "12", "11"))  # ties: id desc


def test_run_positives_first_and_qrels_targets(tmp_path):
    queries, collection = write_tables(tmp_path)
    run, qrels = tmp_path / "teacher.trec", tmp_path / "qrels.tsv"
    run.write_text(RUN + "\n", encoding="utf-8")
    qrels.write_text("query-id\tcorpus-id\tscore\n" + QRELS, encoding="utf-8")
    # ranks -- 1: 10 (grade 0), 12 (1), 11 (1), d4; 2: 12, d4 (1), 10 (2); q3: d4 (1), 10, 11
    first = RunExamples(run, queries, collection, RunSettings(2, positives="first"), qrels)
    # the positive: the highest grade, then the best ranked; then the best documents not judged positive
    assert [e.ids for e in items(first)] == [("1", "12", "10"), ("2", "10", "12"), ("q3", "d4", "10")]
    assert items(first)[0].scores == (2.0, 3.5)
    three = RunExamples(run, queries, collection, RunSettings(3, positives="first", short_queries="skip"), qrels)
    # another judged positive is never a negative: query 1 skips 11; query 2 has only 12 besides its positives
    assert [e.ids for e in items(three)] == [("1", "12", "10", "d4"), ("q3", "d4", "10", "11")]
    assert three.skipped == 1
    graded = RunExamples(run, queries, collection, RunSettings(2, positives="first", targets="qrels"), qrels)
    assert [e.scores for e in items(graded)] == [(1.0, 0.0), (2.0, 0.0), (1.0, 0.0)]
    bare = RunExamples(run, queries, collection, RunSettings(2, positives="first", targets="none"), qrels)
    assert [e.scores for e in items(bare)] == [None] * 3 and [e.ids for e in items(bare)] == [e.ids for e in
                                                                                            items(first)]
    # the reader of a config, every path relative to the data folder (qrels found there too), reads the same examples
    reader = TrecRun("teacher.trec", "queries.tsv", "collection.tsv", qrels="qrels.tsv", positives="first")
    assert items(reader.open(ReadSettings(nway=2, data_dir=tmp_path))) == items(first)
    trec = tmp_path / "qrels.trec"  # TREC qrels give the same
    trec.write_text("".join(f"{q} 0 {d} {g}\n" for q, d, g in (line.split("\t") for line in QRELS.splitlines())))
    assert items(RunExamples(run, queries, collection, RunSettings(2, positives="first"), trec)) == items(first)
    # depth 2 cuts query 2's grade-2 positive (10 ranks 3rd): its grade-1 positive leads instead
    shallow = RunExamples(run, queries, collection, RunSettings(2, depth=2, positives="first"), qrels)
    assert [e.ids for e in items(shallow)] == [("1", "12", "10"), ("2", "d4", "12"), ("q3", "d4", "10")]
    qrels.write_text(QRELS.replace("q3\td4\t1\n", ""), encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"teacher.trec:8: query 'q3' has no judged positive .* within depth 2"):
        RunExamples(run, queries, collection, RunSettings(2, depth=2, positives="first"), qrels)


def test_run_sample_is_seeded_and_in_rank_order(tmp_path):
    queries, collection = write_tables(tmp_path)
    run = tmp_path / "teacher.trec"
    run.write_text(RUN + "\n", encoding="utf-8")
    draws = {seed: [e.ids for e in items(RunExamples(run, queries, collection,
                                                      RunSettings(2, selection="sample", seed=seed)))]
             for seed in range(8)}
    assert draws[3] == [e.ids for e in items(RunExamples(run, queries, collection,
                                                         RunSettings(2, selection="sample", seed=3)))]
    assert len({tuple(d) for d in draws.values()}) > 1  # the seed matters
    top = slow_run(run, 4)
    for examples in draws.values():
        for example, full in zip(examples, top):
            ranks = [full.ids.index(doc) for doc in example[1:]]
            assert ranks == sorted(ranks)  # a sample keeps rank order
    deepest = {depth: max(slow_run(run, 4)[0].ids.index(e.ids[2]) for seed in range(12)
                          for e in items(RunExamples(run, queries, collection,
                                                     RunSettings(2, depth=depth, selection="sample", seed=seed)))[:1])
               for depth in (3, None)}
    assert deepest == {3: 3, None: 4}  # query 1's sampled second document: from its best 3, or from all 4


def test_run_refusals(tmp_path):
    queries, collection = write_tables(tmp_path)
    run = tmp_path / "teacher.trec"
    lines = RUN.splitlines()
    cases = [(lines[:4] + lines[7:] + lines[4:7], None, None),
             (lines[:5] + ["2 Q0 10 2 nan x"] + lines[6:], 6, "not finite"),
             (lines[:5] + ["2 Q0 10 2 1.0"] + lines[6:], 6, "expected 6 whitespace-separated fields"),
             (lines[:5] + ["2 Q0 99 2 1.0 t"] + lines[6:], 6, "document id '99' is not in"),
             (lines[:5] + ["2 Q0 12 2 1.0 t"] + lines[6:], 6, "appears twice"),
             (["7 Q0 10 1 1 t"] + lines, 1, "query id '7' is not in"),
             (lines[:4] + lines[7:9] + lines[4:7] + lines[9:], 10, "query 'q3' comes back after other queries"),
             (lines[:4] + ["2 Q0 12 1 9 t"] + lines[7:], 5, "query '2' has 1 documents, fewer than nway=2"),
             (lines[:4] + ["2 Q0 12 1 9 t", "7 Q0 10 1 1 t"] + lines[7:], 5, "query '2' has 1 documents")]
    for content, line, message in cases:
        run.write_text("\n".join(content) + "\n", encoding="utf-8")
        if message is None:  # queries in another order, each together: fine
            assert len(RunExamples(run, queries, collection, RunSettings(2))) == 3
            continue
        with pytest.raises(DataFormatError) as error:
            RunExamples(run, queries, collection, RunSettings(2))
        assert (error.value.path, error.value.line) == (str(run), line) and message in str(error.value), error.value


def test_option_errors_name_the_option(tmp_path):
    queries, collection = write_tables(tmp_path)
    run = tmp_path / "teacher.trec"
    run.write_text(RUN + "\n", encoding="utf-8")
    for settings, message in [(dict(nway=1), "nway must be an integer >= 2"), (dict(nway=3, depth=2), "depth must"),
                              (dict(nway=2, selection="random"), "selection must be one of"),
                              (dict(nway=2, targets="none"), "need positives='first'"),
                              (dict(nway=2, seed=-1), "seed must")]:
        with pytest.raises(UserError, match=message):
            RunSettings(**settings)
    with pytest.raises(UserError, match="needs qrels"):
        RunExamples(run, queries, collection, RunSettings(2, positives="first"))
    # the readers of a config check their settings when the data module is made (resolve), before any file is read
    reader = TrecRun(str(run), str(queries), str(collection))
    with pytest.raises(UserError, match="TrecRun needs data.nway"):
        reader.resolve(ReadSettings())
    with pytest.raises(UserError, match="selection must be one of"):
        TrecRun(str(run), str(queries), str(collection), selection="random").resolve(ReadSettings(nway=2))
    with pytest.raises(UserError, match="positives='first' with targets='scores' needs qrels"):
        TrecRun(str(run), str(queries), str(collection), positives="first").resolve(ReadSettings(nway=2))
    assert reader.resolve(ReadSettings(nway=2)) == (reader, ReadSettings(nway=2))
    examples = tmp_path / "examples.jsonl"
    examples.write_bytes(odd_bytes(NWAY_LINES))
    opened = NWayExamples(str(examples), str(queries), str(collection)).open(ReadSettings(nway=2))
    assert items(opened) == items(NWayFile(examples, queries, collection, nway=2))
    with pytest.raises(TypeError, match="colour"):
        NWayExamples(str(examples), str(queries), str(collection), colour="red")
    with pytest.raises(TypeError, match="collection"):
        NWayExamples(str(examples), str(queries))
    with pytest.raises(MissingInputError, match="NWayExamples.collection: .*nowhere.tsv"):
        NWayExamples(str(examples), str(queries), str(tmp_path / "nowhere.tsv")).open(ReadSettings(nway=2))
    pylate = PyLateExamples(str(examples), str(queries), str(collection))
    assert pylate.record() == {"class_path": "hil.data.pylate_files.PyLateExamples",
                               "init_args": {"path": str(examples), "queries": str(queries),
                                             "collection": str(collection)}}


# -- checking once, reading later -------------------------------------------------------------------------------------

def test_the_check_is_recorded_and_redone_when_a_table_changes(tmp_path, monkeypatch):
    queries, collection = write_tables(tmp_path)
    path = tmp_path / "examples.jsonl"
    path.write_text("\n".join(NWAY_LINES) + "\n", encoding="utf-8")
    NWayFile(path, queries, collection, nway=4)
    calls = []
    original = NWayFile.parse
    monkeypatch.setattr(NWayFile, "parse", lambda self, line, text: calls.append(line) or original(self, line, text))
    NWayFile(path, queries, collection, nway=4)
    assert calls == []  # recorded: no second pass
    NWayFile(path, queries, collection, nway=2)
    assert len(calls) == 4  # other settings: checked again
    collection.write_text("".join(f"{k}\t{v}\n" for k, v in PASSAGES.items() if k != "10"), encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"examples.jsonl:1: document id '10' is not in"):
        NWayFile(path, queries, collection, nway=2)  # the settings recorded last; the collection changed since


def test_without_the_check_a_bad_line_is_refused_when_read(tmp_path):
    queries, collection = write_tables(tmp_path)
    path = tmp_path / "examples.jsonl"
    path.write_text("\n".join(NWAY_LINES[:2] + ["", '[1, [10, 1], [99, 2]]']) + "\n", encoding="utf-8")
    source = NWayFile(path, queries, collection, nway=2, check=False)
    assert source[1].ids == ("2", "12", "10")
    with pytest.raises(DataFormatError) as error:
        source[2]
    assert (error.value.path, error.value.line) == (str(path), 4) and "'99'" in str(error.value)
    with pytest.raises(DataFormatError):
        NWayFile(path, queries, collection, nway=2)


def test_nan_anywhere_on_a_line_is_not_json(tmp_path):
    """Python's json reads NaN and Infinity; JSON has neither: refused even in a field nobody reads."""
    queries, collection = write_tables(tmp_path)
    path = tmp_path / "train.jsonl"
    path.write_text(PYLATE_LINES[0] + "\n" + PYLATE_LINES[2].replace('"scores"', '"extra": Infinity, "scores"'),
                    encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"train.jsonl:2: not valid JSON"):
        open_pylate(path, queries, collection)


def test_queries_and_passages_in_first_seen_order(tmp_path):
    queries, collection = write_tables(tmp_path)
    path = tmp_path / "examples.jsonl"
    path.write_text("\n".join(NWAY_LINES) + "\n", encoding="utf-8")
    source = NWayFile(path, queries, collection, nway=2, limit=3)
    assert list(source.iter_queries()) == [QUERIES["1"], QUERIES["2"], QUERIES["q3"]]
    assert list(source.iter_passages()) == [PASSAGES[p] for p in ("10", "11", "12", "d4")]
    assert len(source) == 3 and "3 ColBERTv2 examples of 2 documents" in source.describe()


# -- shards, resume, pickling ---------------------------------------------------------------------------------------

def many_examples(folder: Path, kind: str, count: int = 12):
    """A source of ``count`` examples of each kind."""
    folder.mkdir(parents=True, exist_ok=True)
    queries, collection = write_tables(folder)
    qids, pids = list(QUERIES), list(PASSAGES)
    if kind == "nway":
        path = folder / "examples.jsonl"
        path.write_text("".join(json.dumps([qids[i % 3]] + [[pids[(i + j) % 4], i - j] for j in range(3)]) + "\n"
                                for i in range(count)), encoding="utf-8")
        return NWayFile(path, queries, collection, nway=3)
    if kind == "pylate":
        path = folder / "train.jsonl"
        path.write_text("".join(json.dumps({"query_id": qids[i % 3], "document_ids": [pids[(i + j) % 4] for j in
                                                                                       range(3)],
                                            "scores": [i, -i, 0.5]}) + "\n" for i in range(count)), encoding="utf-8")
        return open_pylate(path, queries, collection)
    queries.write_text("".join(f"x{i}\tquery {i}\n" for i in range(count)), encoding="utf-8")
    path, qrels = folder / "teacher.trec", folder / "qrels.tsv"
    path.write_text("".join(f"x{i} Q0 {pids[j]} {j + 1} {i * 10 - j} t\n" for i in range(count) for j in range(4)),
                    encoding="utf-8")
    qrels.write_text("".join(f"x{i}\t{pids[i % 4]}\t1\n" for i in range(count)), encoding="utf-8")
    return RunExamples(path, queries, collection, RunSettings(3, positives="first"), qrels)


@pytest.mark.parametrize("kind", ["nway", "pylate", "run"])
def test_two_ranks_disjoint_complete_and_resumable(tmp_path, kind):
    source = many_examples(tmp_path, kind)
    reference = items(source)
    for epoch in (0, 1):
        shards = []
        for rank in (0, 1):
            sampler = EpochShuffleSampler(len(source), seed=5, num_replicas=2, rank=rank)
            sampler.set_epoch(epoch)
            whole = list(sampler)
            resumed = EpochShuffleSampler(len(source), seed=5, num_replicas=2, rank=rank)
            resumed.set_epoch(epoch)
            iterator = iter(resumed)
            head = [next(iterator) for _ in range(2)]
            state = resumed.state_dict()
            again = EpochShuffleSampler(len(source), seed=5, num_replicas=2, rank=rank)
            again.set_epoch(epoch)
            again.load_state_dict(state)
            assert head + list(again) == whole  # exact resume
            assert [source[i] for i in whole] == [reference[i] for i in whole]
            shards.append(whole)
        assert not set(shards[0]) & set(shards[1]) and sorted(shards[0] + shards[1]) == list(range(12))
    assert shards[0] != [i for i in range(12) if i % 2 == 0]  # shuffled


@pytest.mark.parametrize("kind", ["nway", "pylate", "run"])
def test_pickles_cheaply_and_reads_the_same(tmp_path, kind):
    small, large = many_examples(tmp_path / "small", kind), many_examples(tmp_path / "large", kind, 3000)
    blobs = [pickle.dumps(source) for source in (small, large)]
    assert len(blobs[0]) < 4000 and abs(len(blobs[1]) - len(blobs[0])) < 100  # paths and cache places, not data
    for source, blob in zip((small, large), blobs):
        again = pickle.loads(blob)
        assert [again[i] for i in (0, 7, -1)] == [source[i] for i in (0, 7, -1)]


# -- fuzzing: the exact parse, or the first bad line --------------------------------------------------------------

KNOWN_QIDS, KNOWN_PIDS = {"1", "2", "q3"}, {"10", "11", "12", "d4"}
SCORE_VALUES = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(-10 ** 6, 10 ** 6))


@st.composite
def nway_lines(draw) -> Line:
    """A ColBERTv2 line ("meaning": (qid, pids, scores or None)), a blank line, or a bad one."""
    qid = draw(st.sampled_from([1, 2, "q3", "1"] * 6 + [99, "zz"]))
    count = draw(st.sampled_from([3] * 8 + [0, 1, 2, 4]))
    pids = draw(st.lists(st.sampled_from([10, 11, 12, "d4", "10"] * 12 + [98, "zz"]), min_size=count,
                         max_size=count))
    scores = draw(st.lists(SCORE_VALUES, min_size=count, max_size=count))
    scored = draw(st.booleans())
    entries = [[p, s] for p, s in zip(pids, scores)] if scored else list(pids)
    meaning = (str(qid), [str(p) for p in pids], [float(s) for s in scores] if scored and count else None)
    good = Line(json.dumps([qid, *entries], ensure_ascii=draw(st.booleans())).encode("utf-8")
                + draw(st.sampled_from([b"", b" ", b"\t"])), meaning)
    kind = draw(st.sampled_from(["good"] * 30 + ["blank", "truncated", "bad-utf8", "nan", "bool-score",
                                                   "string-score", "float-id", "bad-id", "mixed", "triple",
                                                   "not-array", "trailing"]))
    if kind == "good":
        return good
    if kind == "blank":
        return draw(blank_lines)
    if kind == "truncated":
        return Line(good.raw.rstrip()[: draw(st.integers(1, len(good.raw.rstrip()) - 1))], BAD)
    if kind == "bad-utf8":
        return draw(with_bad_bytes(good))
    if kind == "float-id":
        return Line(json.dumps([1.5, *entries]).encode(), BAD)
    if kind == "bad-id":
        return Line(json.dumps([draw(st.sampled_from(["", " ", "a b", True, None])), *entries]).encode(), BAD)
    if kind == "not-array":
        return Line(draw(st.sampled_from([b'{"a": 1}', b"3", b"null", b"[]", b'"x"'])), BAD)
    if kind == "trailing":
        return Line(good.raw + b" x", BAD)
    if kind == "triple":
        return Line(json.dumps([qid, [10, 1.0, 2.0], *entries]).encode(), BAD)
    if kind == "mixed":
        return Line(json.dumps([qid, [10, 1.0], 11]).encode() if draw(st.booleans())
                    else json.dumps([qid, 10, [11, 1.0]]).encode(), BAD)
    bad_score = {"nan": float("nan"), "bool-score": True, "string-score": "1.5"}[kind]
    return Line(json.dumps([qid, [10, bad_score], *([[p, 1] for p in pids])]).encode(), BAD)


def expected_examples(lines: list[Line], nway: int | None, texts: bool = True) -> Expected:
    """The model: invalid UTF-8 anywhere first (the line offsets are taken first); then line by line, a bad line,
    a line with too few (or, without nway, not as many as the first) documents, an unknown query or kept document
    id; no line at all is a file error."""
    for number, line in enumerate(lines, start=1):
        try:
            line.raw.decode("utf-8")
        except UnicodeDecodeError:
            return Expected(error=True, line=number)
    found, want = [], nway
    for number, line in enumerate(lines, start=1):
        if line.meaning == BLANK:
            continue
        if line.meaning == BAD:
            return Expected(error=True, line=number)
        qid, pids, scores = line.meaning
        if want is None:
            want = len(pids)
            if want < 2:
                return Expected(error=True, line=number)
        if len(pids) < want or (nway is None and len(pids) != want):
            return Expected(error=True, line=number)
        pids, scores = pids[:want], None if scores is None else scores[:want]
        if qid not in KNOWN_QIDS or not set(pids) <= KNOWN_PIDS:
            return Expected(error=True, line=number)
        found.append(ScoredExample(QUERIES[qid], tuple(PASSAGES[p] for p in pids),
                                   None if scores is None else tuple(scores), (qid, *pids)))
    return Expected(found) if found else Expected(error=True, line=None)


@FUZZ
@given(files(st.lists(nway_lines(), max_size=6), gzip_allowed=False), st.sampled_from([None, 2, 3]))
def test_fuzz_nway_file(generated, nway):
    content, lines, _ = generated
    with tempfile.TemporaryDirectory() as folder:
        queries, collection = write_tables(Path(folder))
        check(lambda path: items(NWayFile(path, queries, collection, nway=nway)), content,
              expected_examples(lines, nway), ".jsonl")


@st.composite
def pylate_lines(draw) -> Line:
    """A PyLate JSON line (meaning as for n-way lines, always scored), a blank line, or a bad one."""
    qid = draw(st.sampled_from([1, "2", "q3"] * 6 + [99]))
    count = draw(st.sampled_from([2] * 6 + [1, 3, 4]))
    pids = draw(st.lists(st.sampled_from([10, "11", 12, "d4"] * 12 + ["zz"]), min_size=count, max_size=count))
    scores = draw(st.lists(SCORE_VALUES, min_size=count, max_size=count))
    record = {"query_id": qid, "document_ids": pids, "scores": scores}
    if draw(st.booleans()):
        record["document_ids"] = repr(pids)  # PyLate's string form
    meaning = (str(qid), [str(p) for p in pids], [float(s) for s in scores])
    kind = draw(st.sampled_from(["good"] * 30 + ["blank", "bad-utf8", "missing", "length", "nan", "not-list",
                                                   "bad-literal", "not-object", "bad-id"]))
    if kind == "good":
        return Line(json.dumps(record).encode(), meaning)
    if kind == "blank":
        return draw(blank_lines)
    if kind == "bad-utf8":
        return draw(with_bad_bytes(Line(json.dumps(record).encode(), meaning)))
    if kind == "missing":
        key = draw(st.sampled_from(list(record)))
        return Line(json.dumps({k: v for k, v in record.items() if k != key}).encode(), BAD)
    bad = {"length": {"scores": scores + [1.0]}, "nan": {"scores": [math.nan] * count},
           "not-list": {"scores": 3}, "bad-literal": {"document_ids": "[10, "}, "bad-id": {"query_id": 1.5}}
    if kind == "not-object":
        return Line(json.dumps([qid, pids, scores]).encode(), BAD)
    return Line(json.dumps({**record, **bad[kind]}).encode(), BAD)


@FUZZ
@given(files(st.lists(pylate_lines(), max_size=6), gzip_allowed=False), st.sampled_from([None, 2]))
def test_fuzz_pylate_jsonl(generated, nway):
    content, lines, _ = generated
    with tempfile.TemporaryDirectory() as folder:
        queries, collection = write_tables(Path(folder))
        check(lambda path: items(open_pylate(path, queries, collection, nway=nway)), content,
              expected_examples(lines, nway), ".jsonl")


RUN_SCORES = [("1.5", 1.5), ("-2", -2.0), ("0", 0.0), ("1e-300", 1e-300), ("1_000", 1000.0), ("7", 7.0),
              ("1e400", None), ("inf", None), ("nan", None), ("abc", None), ("0x10", None)]


@st.composite
def run_row(draw, qid: str, docid: str, noisy: bool) -> Line:
    """A run row ("meaning": (qid, docid, score)): good, or when ``noisy`` now and then a bad one (a bad score, a
    field too many or too few, invalid UTF-8) or one with an unknown id."""
    kind = draw(st.sampled_from(["row"] * 30 + ["score", "fields", "bad-utf8", "unknown"])) if noisy else "row"
    score, value = draw(st.sampled_from(RUN_SCORES[:6] if kind != "score" else RUN_SCORES[6:]))
    if kind == "unknown":
        qid, docid = draw(st.sampled_from([(qid, "zz"), ("7", docid)]))
    fields = [qid, "Q0", docid, str(draw(st.integers(0, 99))), score, "t"]
    separator = draw(st.sampled_from([" ", "\t", "  ", "\u3000"]))
    if kind == "fields":
        return Line(separator.join(fields[:5] if draw(st.booleans()) else fields + ["x"]).encode(), BAD)
    line = Line(separator.join(fields).encode("utf-8"), (qid, docid, value) if value is not None else BAD)
    return draw(with_bad_bytes(line)) if kind == "bad-utf8" else line


@st.composite
def run_file_lines(draw) -> list[Line]:
    """Queries with their documents, each query's lines together; then perhaps blank lines, a line moved elsewhere
    (a query split in two, or a document listed twice)."""
    lines, noisy = [], draw(st.booleans())  # half the files have only good rows: their structure is what's tested
    least = int(draw(st.integers(0, 9)) > 0)  # an empty file now and then
    for qid in draw(st.lists(st.sampled_from(["1", "2", "q3"]), unique=True, min_size=least, max_size=3)):
        docs = draw(st.permutations(["10", "11", "12", "d4"]))[: draw(st.sampled_from([3, 3, 4, 2, 1]))]
        lines.extend(draw(run_row(qid, docid, noisy)) for docid in docs)
    for _ in range(draw(st.integers(0, 2))):
        lines.insert(draw(st.integers(0, len(lines))), draw(blank_lines))
    if lines and draw(st.integers(0, 3)) == 0:  # a line repeated somewhere
        lines.insert(draw(st.integers(0, len(lines))), lines[draw(st.integers(0, len(lines) - 1))])
    if draw(st.booleans()):  # a query whose lines come back after others' (or a new one)
        qid = draw(st.sampled_from(["1", "2", "q3"]))
        docs = draw(st.permutations(["10", "11", "12", "d4"]))[: draw(st.sampled_from([3, 4]))]
        lines.extend(draw(run_row(qid, docid, noisy)) for docid in docs)
    if noisy and draw(st.booleans()):  # an unknown query after a query with too few documents
        lines.extend([draw(run_row("1", "10", False)), draw(run_row("7", "11", False))])
    return lines


def expected_run(lines: list[Line], nway: int) -> Expected:
    """The model of the run reader (module docstring of hil.data.run_examples), with dicts: a line's problem when
    it is read; a query's (too few documents) when its lines end, at its first line."""
    for number, line in enumerate(lines, start=1):
        try:
            line.raw.decode("utf-8")
        except UnicodeDecodeError:
            return Expected(error=True, line=number)
    groups: list[tuple[str, int, dict[str, float]]] = []
    for number, line in enumerate(lines, start=1):
        if line.meaning == BLANK:
            continue
        if line.meaning == BAD:
            return Expected(error=True, line=number)
        qid, docid, score = line.meaning
        if not groups or groups[-1][0] != qid:
            if groups and len(groups[-1][2]) < nway:
                return Expected(error=True, line=groups[-1][1])
            if qid in {g[0] for g in groups} or qid not in KNOWN_QIDS:
                return Expected(error=True, line=number)
            groups.append((qid, number, {}))
        if docid not in KNOWN_PIDS or docid in groups[-1][2]:
            return Expected(error=True, line=number)
        groups[-1][2][docid] = score
    if groups and len(groups[-1][2]) < nway:
        return Expected(error=True, line=groups[-1][1])
    if not groups:
        return Expected(error=True, line=None)
    found = []
    for qid, _, docs in groups:
        best = sorted(docs.items(), key=lambda item: (item[1], item[0]), reverse=True)[:nway]
        found.append(ScoredExample(QUERIES[qid], tuple(PASSAGES[d] for d, _ in best), tuple(s for _, s in best),
                                   (qid, *(d for d, _ in best))))
    return Expected(found)


@FUZZ
@given(files(run_file_lines(), gzip_allowed=False), st.sampled_from([2, 3]))
def test_fuzz_run(generated, nway):
    content, lines, _ = generated
    with tempfile.TemporaryDirectory() as folder:
        queries, collection = write_tables(Path(folder))
        check(lambda path: items(RunExamples(path, queries, collection, RunSettings(nway))), content,
              expected_run(lines, nway), ".trec")


def test_modules_share_one_id_rule():
    """JSON ids: strings or integers, as the BEIR readers take them; floats and booleans refused."""
    path = Path("x.jsonl")
    assert example_files.json_id(path, 1, 7, "id") == "7" and example_files.json_id(path, 1, "a-b", "id") == "a-b"
    for bad in (1.0, True, None, "", "a b", [1]):
        with pytest.raises(DataFormatError):
            example_files.json_id(path, 1, bad, "id")
    for bad in (True, "1", None, math.inf, 10 ** 400):
        with pytest.raises(DataFormatError):
            example_files.json_score(path, 1, bad, "score")
    assert nway_files.NWayFile.layout == "ColBERTv2"
