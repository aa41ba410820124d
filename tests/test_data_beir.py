"""BEIR / TSV / TREC loaders: clean files, every kind of bad input, BOM/CRLF invariance, and the real shared data."""

from __future__ import annotations

import gzip
import json
import os
import sys
import tempfile
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hil.data.beir import (
    BeirDataset,
    drop_self_matches,
    load_beir,
    load_collection_tsv,
    load_topics_tsv,
    load_trec_qrels,
    read_corpus_jsonl,
    read_qrels_tsv,
    read_queries_jsonl,
)
from hil.errors import DataFormatError
from hil.provenance import fingerprint_strings

SHARED = Path(os.environ.get("HIL_SHARED_DIR", Path(__file__).resolve().parents[1].parent / "shared"))

CORPUS = [
    {"_id": "d1", "title": "Alpha", "text": "first document"},
    {"_id": "d2", "title": "", "text": "second document "},
    {"_id": "d3", "text": "  no title here"},
    {"_id": "d4", "title": "Delta", "text": ""},
]
QUERIES = [{"_id": "q1", "text": "first?"}, {"_id": "q2", "text": "second?"}, {"_id": "q3", "text": "unjudged"}]
QRELS = "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td4\t0\nq2\td2\t2\n"


def jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(record) + "\n" for record in records)


def write_dataset(folder: Path, corpus: str | bytes | None = None, queries: str | bytes | None = None,
                  qrels: str | bytes | None = None, split: str = "test") -> Path:
    """A BEIR folder; each file given as text or raw bytes (defaults: the clean fixtures above)."""
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    for name, content, default in (("corpus.jsonl", corpus, jsonl(CORPUS)), ("queries.jsonl", queries, jsonl(QUERIES)),
                                   (f"qrels/{split}.tsv", qrels, QRELS)):
        content = default if content is None else content
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return folder


def bom_crlf(text: str) -> bytes:
    return b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode("utf-8")


def assert_names(err: pytest.ExceptionInfo, path: Path, line: int | None) -> None:
    assert isinstance(err.value, DataFormatError)
    assert err.value.path == str(path)
    assert err.value.line == line
    prefix = f"{path}:{line}: " if line is not None else f"{path}: "
    assert str(err.value).startswith(prefix), str(err.value)


# ---------------------------------------------------------------------------------------------------------------------
# Clean input


def test_clean_dataset_loads_with_beir_conventions(tmp_path):
    data = load_beir(write_dataset(tmp_path / "toy"))
    assert data.name == "toy" and data.split == "test" and data.source == str(tmp_path / "toy")
    assert data.doc_ids() == ["d1", "d2", "d3", "d4"]
    assert data.corpus["d3"] == {"title": "", "text": "  no title here"}
    # Only judged queries stay; score-0 judgments stay in qrels.
    assert data.queries == {"q1": "first?", "q2": "second?"}
    assert data.qrels == {"q1": {"d1": 1, "d4": 0}, "q2": {"d2": 2}}
    assert data.documents() == ["Alpha first document", "second document", "no title here", "Delta"]
    assert [data.doc_text(doc_id) for doc_id in data.doc_ids()] == data.documents()


def test_error_message_format():
    assert str(DataFormatError("a/b.tsv", 3, "bad")) == "a/b.tsv:3: bad"
    assert str(DataFormatError("a/b.tsv", None, "bad")) == "a/b.tsv: bad"
    assert isinstance(DataFormatError("x", 1, "y"), ValueError)
    import pickle
    copy = pickle.loads(pickle.dumps(DataFormatError("x", 2, "why")))
    assert (copy.path, copy.line, copy.reason, str(copy)) == ("x", 2, "why", "x:2: why")


def test_header_row_is_optional(tmp_path):
    with_header = load_beir(write_dataset(tmp_path / "a"))
    without = load_beir(write_dataset(tmp_path / "b", qrels=QRELS.split("\n", 1)[1]))
    assert with_header.qrels == without.qrels


def test_bom_crlf_and_blank_lines_parse_identically(tmp_path):
    clean = load_beir(write_dataset(tmp_path / "clean"))
    noisy = load_beir(write_dataset(tmp_path / "noisy", corpus=bom_crlf("\n" + jsonl(CORPUS).replace("\n", "\n\n")),
                                    queries=bom_crlf(jsonl(QUERIES) + "  \n"), qrels=bom_crlf(QRELS + "\n\n")))
    assert (noisy.corpus, noisy.queries, noisy.qrels) == (clean.corpus, clean.queries, clean.qrels)
    assert noisy.fingerprint() == clean.fingerprint()


def test_numeric_ids_become_strings_and_missing_or_null_title_is_empty(tmp_path):
    corpus = jsonl([{"_id": 7, "text": "seven"}, {"_id": "8", "title": None, "text": "eight"}])
    data = load_beir(write_dataset(tmp_path / "n", corpus=corpus, queries=jsonl([{"_id": 1, "text": "q"}]),
                                   qrels="1\t7\t1\n1\t8\t0\n"))
    assert data.corpus == {"7": {"title": "", "text": "seven"}, "8": {"title": "", "text": "eight"}}
    assert data.queries == {"1": "q"} and data.qrels == {"1": {"7": 1, "8": 0}}


def test_gzip_files_are_read(tmp_path):
    folder = tmp_path / "gz"
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl.gz").write_bytes(gzip.compress(jsonl(CORPUS).encode()))
    (folder / "queries.jsonl.gz").write_bytes(gzip.compress(jsonl(QUERIES).encode()))
    (folder / "qrels" / "test.tsv.gz").write_bytes(gzip.compress(QRELS.encode()))
    assert load_beir(folder).qrels == load_beir(write_dataset(tmp_path / "plain")).qrels


def test_huge_line_is_parsed(tmp_path):
    big = "word " * 1_000_000  # a 5 MB line
    data = load_beir(write_dataset(tmp_path / "big", corpus=jsonl([{"_id": "d1", "text": big}, *CORPUS[1:]])))
    assert data.corpus["d1"]["text"] == big


def test_fingerprint_tracks_content(tmp_path):
    data = load_beir(write_dataset(tmp_path / "f"))
    same = load_beir(write_dataset(tmp_path / "g"))
    assert data.fingerprint() == same.fingerprint() and len(data.fingerprint()) == 16
    same.corpus["d2"]["text"] += "!"
    assert data.fingerprint() != same.fingerprint()
    other = load_beir(write_dataset(tmp_path / "h", qrels=QRELS.replace("q2\td2\t2", "q2\td2\t1")))
    assert data.fingerprint() != other.fingerprint()
    assert data.fingerprint() != fingerprint_strings([])


def test_missing_files_and_split(tmp_path):
    folder = write_dataset(tmp_path / "s")
    with pytest.raises(FileNotFoundError, match=r"no qrels/dev\.tsv \(splits found: test\)"):
        load_beir(folder, split="dev")
    (folder / "queries.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="queries.jsonl"):
        load_beir(folder)
    with pytest.raises(FileNotFoundError, match="no such dataset folder"):
        load_beir(str(tmp_path / "absent"))


def test_names_resolve_through_data_dir(tmp_path, monkeypatch):
    write_dataset(tmp_path / "beir" / "toy")
    assert load_beir("toy", data_dir=tmp_path).source == str(tmp_path / "beir" / "toy")
    monkeypatch.setenv("HIL_DATA_DIR", str(tmp_path))
    assert load_beir("toy").qrels == load_beir("BeIR/toy").qrels == load_beir(tmp_path / "beir" / "toy").qrels


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: each names the file and the line


CORPUS_LINES = [json.dumps(record) for record in CORPUS]


@pytest.mark.parametrize("bad_line, reason", [
    (b'{"_id": "x", "text": "caf\xe9"}', "invalid UTF-8"),
    (b'{"_id": "x", "text": "unterminated}', "malformed JSON"),
    (b'{"_id": "x", "text": "a"} trailing', "malformed JSON"),
    (b'["_id", "text"]', "expected a JSON object, got list"),
    (b'"just a string"', "expected a JSON object, got str"),
    (b'{"text": "no id"}', "missing field '_id'"),
    (b'{"_id": "", "text": "empty id"}', "field '_id' is empty"),
    (b'{"_id": "   ", "text": "blank id"}', "field '_id' is empty"),
    (b'{"_id": 1.5, "text": "float id"}', "must be a string"),
    (b'{"_id": true, "text": "bool id"}', "must be a string"),
    (b'{"_id": null, "text": "null id"}', "must be a string"),
    (b'{"_id": ["a"], "text": "list id"}', "must be a string"),
    (b'{"_id": "a b", "text": "space in id"}', "contains whitespace"),
    (b'{"_id": "x", "title": "no text"}', "missing field 'text'"),
    (b'{"_id": "x", "text": null}', "missing field 'text'"),
    (b'{"_id": "x", "text": 12}', "field 'text' must be a string"),
    (b'{"_id": "x", "title": ["t"], "text": "a"}', "field 'title' must be a string"),
    (b'{"_id": "x", "text": "\\ud800 lone surrogate"}', "unpaired UTF-16 surrogate"),
    (b"[" * 100_000, "malformed JSON"),
    (b'{"_id": "x", "text": "a", "n": ' + b"9" * 5000 + b"}", "malformed JSON"),
], ids=lambda value: value[:24].decode("utf-8", "replace") if isinstance(value, bytes) else None)
def test_bad_corpus_line_is_named(tmp_path, bad_line, reason):
    # Line 4 counts the blank line 2: numbers are physical lines.
    content = (CORPUS_LINES[0] + "\n\n" + CORPUS_LINES[1] + "\n").encode() + bad_line + b"\n"
    folder = write_dataset(tmp_path / "bad", corpus=content)
    with pytest.raises(DataFormatError, match=reason) as err:
        load_beir(folder)
    assert_names(err, folder / "corpus.jsonl", 4)


def test_invalid_utf8_inside_crlf_file_names_the_line(tmp_path):
    content = bom_crlf(jsonl(CORPUS[:2])) + b'{"_id": "x", "text": "\xff\xfe"}\r\n'
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataFormatError, match="invalid UTF-8") as err:
        read_corpus_jsonl(path)
    assert_names(err, path, 3)


def test_duplicate_document_id_names_both_lines(tmp_path):
    folder = write_dataset(tmp_path / "dup", corpus=jsonl(CORPUS) + jsonl([{"_id": "d2", "text": "again"}]))
    with pytest.raises(DataFormatError, match=r"duplicate _id 'd2' \(first on line 2\)") as err:
        load_beir(folder)
    assert_names(err, folder / "corpus.jsonl", 5)


def test_duplicate_query_id_names_both_lines(tmp_path):
    folder = write_dataset(tmp_path / "dupq", queries=jsonl(QUERIES + [{"_id": "q1", "text": "again"}]))
    with pytest.raises(DataFormatError, match=r"duplicate _id 'q1' \(first on line 1\)") as err:
        load_beir(folder)
    assert_names(err, folder / "queries.jsonl", 4)


@pytest.mark.parametrize("content", ["", "\n\n  \n", "\ufeff\r\n"])
def test_empty_corpus_and_queries(tmp_path, content):
    folder = write_dataset(tmp_path / "e1", corpus=content)
    with pytest.raises(DataFormatError, match="no documents") as err:
        load_beir(folder)
    assert_names(err, folder / "corpus.jsonl", None)
    folder = write_dataset(tmp_path / "e2", queries=content)
    with pytest.raises(DataFormatError, match="no queries") as err:
        load_beir(folder)
    assert_names(err, folder / "queries.jsonl", None)


def test_query_missing_text(tmp_path):
    folder = write_dataset(tmp_path / "qt", queries=jsonl([{"_id": "q1"}]))
    with pytest.raises(DataFormatError, match="missing field 'text'") as err:
        load_beir(folder)
    assert_names(err, folder / "queries.jsonl", 1)


@pytest.mark.parametrize("row, reason", [
    ("q1\td1", "expected 3 tab-separated columns .* found 2"),
    ("q1\td1\t1\textra", "found 4"),
    ("q1 d1 1", "found 1"),
    ("q1\td1\tone", "score 'one' is not an integer"),
    ("q1\td1\t1.5", "score '1.5' is not an integer"),
    ("q1\td1\t", "score '' is not an integer"),
    ("q9\td1\t1", "query id 'q9' is not in the queries"),
    ("q1\td9\t1", "corpus id 'd9' is not in the corpus"),
    ("\td1\t1", "field 'query-id' is empty"),
    ("q1\td1\t3", r"\('q1', 'd1'\) judged 3 here but 1 on line 2"),
])
def test_bad_qrels_row_is_named(tmp_path, row, reason):
    folder = write_dataset(tmp_path / "q", qrels=QRELS + row + "\n")
    with pytest.raises(DataFormatError, match=reason) as err:
        load_beir(folder, judged_outside_corpus="error")
    assert_names(err, folder / "qrels" / "test.tsv", 5)


def test_repeated_identical_judgment_is_ignored(tmp_path):
    assert load_beir(write_dataset(tmp_path / "r", qrels=QRELS + "q1\td1\t1\n")).qrels["q1"] == {"d1": 1, "d4": 0}


@pytest.mark.parametrize("content", ["query-id\tcorpus-id\tscore\n", ""])
def test_qrels_without_judgments(tmp_path, content):
    folder = write_dataset(tmp_path / "nj", qrels=content)
    with pytest.raises(DataFormatError, match="no judgments") as err:
        load_beir(folder)
    assert_names(err, folder / "qrels" / "test.tsv", None)


def test_only_first_line_may_be_a_header(tmp_path):
    folder = write_dataset(tmp_path / "h2", qrels=QRELS + "query-id\tcorpus-id\tscore\n")
    with pytest.raises(DataFormatError, match="score 'score' is not an integer") as err:
        load_beir(folder)
    assert_names(err, folder / "qrels" / "test.tsv", 5)


def test_corrupt_gzip_is_a_data_format_error(tmp_path):
    path = tmp_path / "topics.tsv.gz"
    path.write_bytes(gzip.compress(b"1\thello\n" * 100)[:-20])
    with pytest.raises(DataFormatError) as err:
        load_topics_tsv(path)
    assert err.value.path == str(path)


# ---------------------------------------------------------------------------------------------------------------------
# TSV topics, collections and TREC qrels


def test_topics_collection_and_trec_qrels(tmp_path):
    topics = tmp_path / "topics.tsv.gz"
    topics.write_bytes(gzip.compress("\ufeff1\twhat is x\r\n\n2\tsplit\tby a tab\n".encode()))
    assert load_topics_tsv(topics) == {"1": "what is x", "2": "split\tby a tab"}
    collection = tmp_path / "collection.tsv"
    collection.write_text("10\tpassage ten\n11\t\n")
    assert load_collection_tsv(collection) == {"10": {"title": "", "text": "passage ten"},
                                               "11": {"title": "", "text": ""}}
    qrels = tmp_path / "qrels.txt"
    qrels.write_text("1 0 10 1\n1\tQ0\t11\t0\n2 0 10 3\n")
    assert load_trec_qrels(qrels) == {"1": {"10": 1, "11": 0}, "2": {"10": 3}}


@pytest.mark.parametrize("loader, content, line, reason", [
    (load_topics_tsv, "1\tok\nno tab here\n", 2, "expected 2 tab-separated columns"),
    (load_topics_tsv, "1\tok\n\n1\tagain\n", 3, r"duplicate id '1' \(first on line 1\)"),
    (load_topics_tsv, "1\tok\n\tno id\n", 2, "field 'id' is empty"),
    (load_trec_qrels, "1 0 10 1\n1 0 11\n", 2, "expected 4 whitespace-separated columns"),
    (load_trec_qrels, "1 0 10 yes\n", 1, "score 'yes' is not an integer"),
])
def test_bad_tsv_and_trec_lines_are_named(tmp_path, loader, content, line, reason):
    path = tmp_path / "file.txt"
    path.write_text(content)
    with pytest.raises(DataFormatError, match=reason) as err:
        loader(path)
    assert_names(err, path, line)


# Outside judgments: d9 and d8 are not in the corpus (a re-ranking set's qrels judge documents beyond its corpus).
RERANK_QRELS = "q1\td1\t1\nq1\td9\t3\nq1\td9\t3\nq2\td2\t2\nq2\td8\t0\n"


def test_judgments_outside_the_corpus_are_an_error_when_asked(tmp_path):
    folder = write_dataset(tmp_path / "rerank", qrels=RERANK_QRELS)
    assert load_beir(folder).judged_outside_corpus == 2  # kept by default, as BEIR and trec_eval keep them
    with pytest.raises(DataFormatError, match="corpus id 'd9' is not in the corpus") as err:
        load_beir(folder, judged_outside_corpus="error")
    assert_names(err, folder / "qrels" / "test.tsv", 2)
    with pytest.raises(DataFormatError, match="corpus id 'd9'"):
        load_trec_qrels(write_text(tmp_path / "q.txt", "q1 0 d1 1\nq1 0 d9 2\n"), corpus={"d1": {}})


def test_judgments_outside_the_corpus_are_kept_for_a_reranking_set(tmp_path, caplog):
    folder = write_dataset(tmp_path / "rerank", qrels=RERANK_QRELS)
    with caplog.at_level("WARNING", logger="hil.data.beir"):
        data = load_beir(folder, judged_outside_corpus="keep", relevance_level=2)
    assert data.qrels == {"q1": {"d1": 1, "d9": 3}, "q2": {"d2": 2, "d8": 0}}  # kept; the repeated pair once
    assert data.judged_outside_corpus == 2 and data.relevance_level == 2
    (record,) = [r for r in caplog.records if r.name == "hil.data.beir"]
    assert "\n" not in record.getMessage() and "2 of 4 judgments" in record.getMessage()
    assert str(folder / "qrels" / "test.tsv") in record.getMessage()
    # every other check stays: an unknown query, a conflicting grade, a bad score
    for bad, line, reason in (("q1\td1\t1\nq7\td9\t1\n", 2, "query id 'q7' is not in the queries"),
                              ("q1\td9\t1\nq1\td9\t2\n", 2, "judged 2 here but 1 on line 1"),
                              ("q1\td9\thigh\nq1\td9\t1\n", 1, None),  # a header row, then fine
                              ("q1\td1\t1\nq1\td9\tx\n", 2, "score 'x' is not an integer")):
        write_dataset(folder, qrels=bad)
        if reason is None:
            assert load_beir(folder, judged_outside_corpus="keep").qrels == {"q1": {"d9": 1}}
            continue
        with pytest.raises(DataFormatError, match=reason) as err:
            load_beir(folder, judged_outside_corpus="keep")
        assert_names(err, folder / "qrels" / "test.tsv", line)
    with pytest.raises(ValueError, match="judged_outside_corpus must be"):
        load_beir(folder, judged_outside_corpus="drop")
    with pytest.raises(ValueError, match="relevance_level must be"):
        load_beir(folder, relevance_level=0)


def test_subset_of_a_reranking_set_keeps_its_candidates_and_counts(tmp_path):
    data = load_beir(write_dataset(tmp_path / "rerank", qrels=RERANK_QRELS), judged_outside_corpus="keep",
                     relevance_level=2)
    small = data.subset(n_queries=1, n_docs=1, seed=0, candidates={"q1": ["d3", "d1"], "q2": ["d4", "d2"]})
    (query_id,) = small.queries
    expected = {"q1": {"d1", "d3"}, "q2": {"d2", "d4"}}[query_id]  # judged + candidates, past n_docs
    assert set(small.corpus) == expected and small.qrels[query_id] == data.qrels[query_id]
    assert small.judged_outside_corpus == 1 and small.relevance_level == 2
    assert len(data.subset(n_queries=1, n_docs=1, seed=0).corpus) == 1  # without candidates: the judged one


def write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Subsets and self matches


def make_dataset(n_docs: int = 50, n_queries: int = 10) -> BeirDataset:
    corpus = {f"d{i}": {"title": "", "text": f"document {i}"} for i in range(n_docs)}
    queries = {f"q{i}": f"query {i}" for i in range(n_queries)}
    qrels = {f"q{i}": {f"d{i}": 1, f"d{i + 20}": 0} for i in range(n_queries)}
    return BeirDataset("synthetic", corpus, queries, qrels, "test", "memory")


def test_subset_keeps_judged_documents_and_is_deterministic():
    data = make_dataset()
    small = data.subset(n_queries=3, n_docs=10, seed=1)
    assert len(small.queries) == 3 and len(small.corpus) == 10
    assert set(small.qrels) == set(small.queries)
    for query_id, judged in small.qrels.items():
        assert judged == data.qrels[query_id] and set(judged) <= set(small.corpus)
    assert list(small.corpus) == [doc_id for doc_id in data.corpus if doc_id in small.corpus]  # order kept
    assert small.fingerprint() == data.subset(n_queries=3, n_docs=10, seed=1).fingerprint()
    assert {frozenset(data.subset(3, 10, seed=s).queries) for s in range(8)}.__len__() > 1
    # Judged documents are never dropped, even past n_docs.
    assert len(data.subset(n_queries=10, n_docs=5).corpus) == 20
    assert data.subset().corpus == data.corpus and data.subset(n_docs=1000).corpus == data.corpus


def test_drop_self_matches():
    run = {"a": {"a": 9.0, "b": 1.0}, "b": {"c": 2.0}}
    assert drop_self_matches(run) == {"a": {"b": 1.0}, "b": {"c": 2.0}}


# ---------------------------------------------------------------------------------------------------------------------
# The Hugging Face hub path (no network here: a stand-in `datasets` module)


def fake_datasets(tables: dict) -> types.ModuleType:
    module = types.ModuleType("datasets")

    def load_dataset(path, name=None, split=None):
        if path.endswith("-qrels"):
            return tables["qrels"][split]
        return {name: tables[name]}

    module.load_dataset = load_dataset
    return module


def test_hub_fallback_builds_the_same_dataset(tmp_path, monkeypatch):
    tables = {"corpus": [dict(record, title=record.get("title", "")) for record in CORPUS],
              "queries": QUERIES,
              "qrels": {"test": [{"query-id": "q1", "corpus-id": "d1", "score": 1},
                                 {"query-id": "q1", "corpus-id": "d4", "score": 0},
                                 {"query-id": "q2", "corpus-id": "d2", "score": 2}]}}
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(tables))
    monkeypatch.delenv("HIL_DATA_DIR", raising=False)
    hub = load_beir("BeIR/toy")
    local = load_beir(write_dataset(tmp_path / "toy"))
    assert (hub.corpus, hub.queries, hub.qrels, hub.name) == (local.corpus, local.queries, local.qrels, "toy")
    assert hub.source == "hf://BeIR/toy"
    tables["qrels"]["test"].append({"query-id": "q1", "corpus-id": "nope", "score": 1})
    assert load_beir("BeIR/toy").judged_outside_corpus == 1  # kept by default
    with pytest.raises(DataFormatError, match="corpus id 'nope'") as err:
        load_beir("toy", judged_outside_corpus="error")
    assert_names(err, Path("hf://BeIR/toy-qrels/test"), 4)


def test_hub_failure_names_dataset_and_data_dir(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    monkeypatch.setenv("HIL_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"'nfcorpus'.*HIL_DATA_DIR=.*BeIR/nfcorpus.*ModuleNotFoundError"):
        load_beir("nfcorpus")


# ---------------------------------------------------------------------------------------------------------------------
# Properties: any bytes either parse or raise DataFormatError; BOM/CRLF never change the result

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
json_fragments = st.sampled_from(['{"_id": "a", "text": "x"}', '{"_id": 3, "text": ""}', '{"_id": "b"}', "[", "}",
                                  '{"_id": "a", "title": null, "text": "y"}', "null", '"s"', "\t", "\r", "\ufeff",
                                  '{"_id": "c d", "text": "z"}', "{}", '{"_id": "e", "text": "\\ud83d"}'])
fuzz_lines = st.lists(st.one_of(json_fragments, st.text(max_size=30)), max_size=8).map("\n".join)
tsv_lines = st.lists(st.lists(st.sampled_from(["q1", "d1", "1", "0", "x", "", " ", "-2", "q2", "d2", "d4"]),
                              max_size=5).map("\t".join), max_size=6).map("\n".join)


def parse_or_format_error(reader, content: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "file"
        path.write_bytes(content)
        try:
            reader(path)
        except DataFormatError as err:
            assert err.path == str(path) and str(err).startswith(str(path))


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_parse_or_raise_data_format_error(content):
    for reader in (read_corpus_jsonl, read_queries_jsonl, read_qrels_tsv, load_topics_tsv, load_trec_qrels):
        parse_or_format_error(reader, content)


@FUZZ
@given(fuzz_lines)
def test_random_json_lines_parse_or_raise_data_format_error(text):
    for encoding in ("utf-8", "utf-16"):
        for reader in (read_corpus_jsonl, read_queries_jsonl):
            parse_or_format_error(reader, text.encode(encoding, "surrogatepass"))


@FUZZ
@given(tsv_lines)
def test_random_qrels_parse_or_raise_data_format_error(text):
    queries = {"q1": "a", "q2": "b"}
    corpus = {"d1": {}, "d2": {}}
    parse_or_format_error(lambda path: read_qrels_tsv(path, queries=queries, corpus=corpus), text.encode())


ids = st.text(st.characters(blacklist_categories=("Cs", "Zs", "Zl", "Zp", "Cc")), min_size=1, max_size=6)
texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)


@FUZZ
@given(st.dictionaries(ids, st.tuples(texts, texts), min_size=1, max_size=6), st.integers(0, 3))
def test_bom_crlf_variants_parse_identically(documents, blank_lines):
    records = [{"_id": doc_id, "title": title, "text": text} for doc_id, (title, text) in documents.items()]
    clean = jsonl(records)
    noisy = bom_crlf("\n" * blank_lines + clean.replace("\n", "\n" + "\n" * blank_lines))
    with tempfile.TemporaryDirectory() as folder:
        a, b = Path(folder) / "a.jsonl", Path(folder) / "b.jsonl"
        a.write_text(clean, encoding="utf-8")
        b.write_bytes(noisy)
        assert read_corpus_jsonl(a) == read_corpus_jsonl(b) == {
            doc_id: {"title": title, "text": text} for doc_id, (title, text) in documents.items()}


# ---------------------------------------------------------------------------------------------------------------------
# The real shared data


@pytest.fixture
def shared_data() -> Path:
    if not (SHARED / "data").is_dir():
        pytest.skip(f"no shared data at {SHARED} (set HIL_SHARED_DIR)")
    return SHARED / "data"


@pytest.mark.integration
def test_real_scifact(shared_data):
    test = load_beir(shared_data / "beir" / "scifact")
    assert (len(test.corpus), len(test.queries), sum(map(len, test.qrels.values()))) == (5183, 300, 339)
    train = load_beir("scifact", split="train", data_dir=shared_data)
    assert (len(train.queries), sum(map(len, train.qrels.values()))) == (809, 919)
    assert test.corpus == train.corpus and test.fingerprint() != train.fingerprint()
    assert len(test.documents()) == 5183 and all(test.documents())


@pytest.mark.integration
def test_real_nfcorpus_dl19_and_topics(shared_data):
    nfcorpus = load_beir(shared_data / "beir" / "nfcorpus")
    assert (len(nfcorpus.corpus), len(nfcorpus.queries), sum(map(len, nfcorpus.qrels.values()))) == (3633, 323, 12334)
    dl19 = load_beir(shared_data / "msmarco" / "dl19", judged_outside_corpus="keep", relevance_level=2)
    assert (len(dl19.corpus), len(dl19.queries), sum(map(len, dl19.qrels.values()))) == (4297, 43, 9260)
    assert dl19.judged_outside_corpus == 9260 - 2257  # the README: 2,257 judgments fall inside the top 100
    assert sorted({g for judged in dl19.qrels.values() for g in judged.values()}) == [0, 1, 2, 3]
    with pytest.raises(DataFormatError, match="is not in the corpus"):
        load_beir("msmarco/dl19", data_dir=shared_data, judged_outside_corpus="error")
    topics = load_topics_tsv(shared_data / "beir-test-topics" / "topics.beir-v1.0.0-scifact.test.tsv.gz")
    trec = load_trec_qrels(shared_data / "beir-test-topics" / "qrels.beir-v1.0.0-scifact.test.txt")
    assert set(topics) == set(trec) == set(load_beir(shared_data / "beir" / "scifact").qrels)
    assert len(load_topics_tsv(shared_data / "msmarco" / "queries.dev.small.tsv")) == 6980
