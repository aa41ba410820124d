"""Fuzzing the loaders against a model of what they must do.

Each test generates a file line by line from valid lines (documents, queries, judgments, triples, run rows) and
mutations of them (truncated, a field of the wrong type or missing, a column too many or too few, invalid UTF-8,
blank lines, repeated ids, huge integers, NaN scores, a byte order mark, CRLF endings, gzip), and knows, line by
line, what each is: blank (skipped), bad (an error on that line), or a record with its parsed value. From that the
test computes what the loader must answer -- the parse, exactly, or a :class:`DataFormatError` whose ``path`` is
the file and whose ``line`` is the first bad line (None when the file as a whole holds nothing) -- and checks it.
Any other exception fails the test.
"""

from __future__ import annotations

import gzip
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from unittest import mock

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hil.data import line_index
from hil.data.beir import read_corpus_jsonl, read_qrels_tsv, read_queries_jsonl
from hil.data.triples import Triple, read_triples
from hil.data.triples_file import TriplesFile
from hil.errors import DataFormatError
from hil.evaluation.runs import read_trec_run

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

BLANK = "blank"  # a line the loader skips
BAD = "bad"      # a line the loader must refuse, naming it


@dataclass(frozen=True)
class Line:
    """One generated line: its bytes (without the line break) and what it is (BLANK, BAD, or a record)."""

    raw: bytes
    meaning: Any


@dataclass(frozen=True)
class Expected:
    """What the loader must do with a file: return ``value``, or raise for ``line`` (None: the file as a whole)."""

    value: Any = None
    error: bool = False
    line: int | None = None


# -- pieces shared by every format ------------------------------------------------------------------------------------

texts = st.text(max_size=12)  # no surrogates: hypothesis leaves them out unless asked
# Whitespace that makes a line blank (str.strip), and that survives as one line (no \n).
blank_lines = st.sampled_from(["", " ", "\t", "  \t ", "\r", "\x0b", "\x0c", "\u3000", "\x1c"]).map(
    lambda text: Line(text.encode("utf-8"), BLANK))
bad_utf8 = st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xe2\x82", b"\xc0\xaf"])


@st.composite
def with_bad_bytes(draw, line: Line) -> Line:
    """``line`` with invalid UTF-8 inserted somewhere: always an error on that line."""
    position = draw(st.integers(0, len(line.raw)))
    return Line(line.raw[:position] + draw(bad_utf8) + line.raw[position:], BAD)


@st.composite
def files(draw, lines: st.SearchStrategy[list[Line]], gzip_allowed: bool = True) -> tuple[bytes, list[Line], bool]:
    """The file's bytes from ``lines`` (a BOM perhaps, LF or CRLF endings, perhaps no final line break, perhaps
    gzip), the lines, and whether it is gzip-compressed."""
    generated = draw(lines)
    endings = [draw(st.sampled_from([b"\n", b"\r\n"])) for _ in generated]
    if generated and draw(st.booleans()):
        endings[-1] = b""  # a last line without a line break
    content = b"".join(line.raw + ending for line, ending in zip(generated, endings))
    # A first line that itself starts with a byte order mark gets the file's: only that one is skipped.
    if draw(st.booleans()) or (generated and generated[0].raw.startswith(b"\xef\xbb\xbf")):
        content = b"\xef\xbb\xbf" + content
    compressed = gzip_allowed and draw(st.booleans())
    return (gzip.compress(content) if compressed else content), generated, compressed


def walk(lines: list[Line], take: Callable[[int, Any], bool], empty: bool) -> Expected | None:
    """The first bad line (BAD, or a record ``take`` refuses) as an Expected error; a file-level error when no
    record was taken and ``empty`` says that is one; None when every line is fine."""
    taken = 0
    for number, line in enumerate(lines, start=1):
        if line.meaning == BLANK:
            continue
        if line.meaning == BAD or not take(number, line.meaning):
            return Expected(error=True, line=number)
        taken += 1
    if taken == 0 and empty:
        return Expected(error=True, line=None)
    return None


def check(loader: Callable[[Path], Any], content: bytes, expected: Expected, suffix: str) -> None:
    """Run ``loader`` on ``content`` and compare with ``expected``: any other outcome fails."""
    # What the examples exercised (pytest --hypothesis-show-statistics).
    event("parsed" if not expected.error else "refused a line" if expected.line else "refused the file")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"file{suffix}"
        path.write_bytes(content)
        try:
            value = loader(path)
        except DataFormatError as error:
            assert expected.error, f"refused a good file: {error}"
            assert error.path == str(path), error
            assert error.line == expected.line, f"{error} (expected line {expected.line})"
            assert str(error).startswith(f"{path}:{expected.line}:" if expected.line else f"{path}: "), error
            return
    assert not expected.error, f"accepted a file bad on line {expected.line}: {value!r}"
    assert value == expected.value
    if isinstance(value, dict):
        assert list(value) == list(expected.value)  # file order kept


# -- corpus.jsonl and queries.jsonl ------------------------------------------------------------------------------------

POOL_IDS = ["d1", "d2", "D-3", "x.4", "7", "doc/5", "é6"]
ids = st.one_of(st.sampled_from(POOL_IDS), st.integers(-10 ** 30, 10 ** 30))


@st.composite
def valid_records(draw, kind: str) -> tuple[dict[str, Any], Any]:
    """A good JSON record and its parsed (id, value)."""
    record_id, text = draw(ids), draw(texts)
    record: dict[str, Any] = {"_id": record_id, "text": text}
    value: Any = text
    if kind == "corpus":
        title = draw(st.one_of(st.none(), st.just("absent"), texts))
        if title != "absent":
            record["title"] = title
        value = {"title": title if isinstance(title, str) and title != "absent" else "", "text": text}
    if draw(st.booleans()):
        record["metadata"] = {"extra": draw(st.integers()), "list": [1, "a"]}
    keys = draw(st.permutations(list(record)))
    return {key: record[key] for key in keys}, (str(record_id), value)


def json_line(record: dict[str, Any], ascii_only: bool, padding: str = "") -> bytes:
    return (json.dumps(record, ensure_ascii=ascii_only) + padding).encode("utf-8")


@st.composite
def json_lines(draw, kind: str) -> Line:
    """A good record line, a blank line, or a bad one (each mutation below is an error on its line)."""
    record, parsed = draw(valid_records(kind))
    ascii_only = draw(st.booleans())
    good = Line(json_line(record, ascii_only, draw(st.sampled_from(["", " ", "\t", " \r"]))), parsed)
    mutation = draw(st.sampled_from(["good"] * 15 + ["blank", "truncated", "bad-utf8", "wrong-type", "missing",
                                                    "bad-id", "surrogate", "not-object", "nan", "huge-int",
                                                    "trailing-garbage", "inner-bom"]))
    if mutation == "good":
        return good
    if mutation == "blank":
        return draw(blank_lines)
    if mutation == "truncated":  # a prefix of an object is never valid JSON, and never blank (it starts with "{")
        whole = json_line(record, ascii_only)
        return Line(whole[: draw(st.integers(1, len(whole) - 1))], BAD)
    if mutation == "bad-utf8":
        return draw(with_bad_bytes(good))
    if mutation == "wrong-type":
        field = draw(st.sampled_from(["_id", "text"] + (["title"] if kind == "corpus" else [])))
        wrong = [1.5, True, [], {"a": 1}] + ([None] if field != "title" else []) + ([7] if field != "_id" else [])
        return Line(json_line({**record, field: draw(st.sampled_from(wrong))}, True), BAD)
    if mutation == "missing":
        field = draw(st.sampled_from(["_id", "text"]))
        return Line(json_line({k: v for k, v in record.items() if k != field}, True), BAD)
    if mutation == "bad-id":
        return Line(json_line({**record, "_id": draw(st.sampled_from(["", " ", "a b", "a\tb", "x\u2028y"]))},
                              draw(st.booleans())), BAD)
    if mutation == "surrogate":
        return Line(json_line({**record, "text": "ok\ud800"}, True), BAD)  # "\ud800" escaped: valid JSON, not text
    if mutation == "not-object":
        return Line(draw(st.sampled_from([b"[1, 2]", b'"text"', b"null", b"3", b"true"])), BAD)
    if mutation == "nan":
        return Line(f'{{"_id": "n1", "text": {draw(st.sampled_from(["NaN", "Infinity", "1e400"]))}}}'.encode(), BAD)
    if mutation == "huge-int":  # beyond Python's 4300-digit limit for int(str)
        return Line(b'{"_id": 1' + b"0" * 5000 + b', "text": "t"}', BAD)
    if mutation == "trailing-garbage":
        return Line(good.raw + draw(st.sampled_from([b" x", b"}", b",", b" {}"])), BAD)
    return Line(b"\xef\xbb\xbf" + good.raw, BAD)  # a byte order mark is only skipped at the start of the file


def expected_records(lines: list[Line]) -> Expected:
    """Records by id in file order; a repeated id is an error on its second line; no record at all, a file error."""
    found: dict[str, Any] = {}

    def take(number: int, parsed: tuple[str, Any]) -> bool:
        record_id, value = parsed
        if record_id in found:
            return False
        found[record_id] = value
        return True

    return walk(lines, take, empty=True) or Expected(found)


@FUZZ
@given(files(st.lists(json_lines("corpus"), max_size=8)))
def test_corpus_jsonl(generated):
    content, lines, compressed = generated
    check(read_corpus_jsonl, content, expected_records(lines), ".jsonl.gz" if compressed else ".jsonl")


@FUZZ
@given(files(st.lists(json_lines("queries"), max_size=8)))
def test_queries_jsonl(generated):
    content, lines, compressed = generated
    check(read_queries_jsonl, content, expected_records(lines), ".jsonl.gz" if compressed else ".jsonl")


# -- qrels/<split>.tsv -------------------------------------------------------------------------------------------------

QUERIES = {"q1": "a", "q2": "b", "q3": "c"}
CORPUS = {"d1": {}, "d2": {}, "d3": {}, "d4": {}}
# (score column, its value; None: not an integer, or outside the 32-bit range)
SCORES = [("0", 0), ("1", 1), ("2", 2), ("-1", -1), (" 3 ", 3), ("+2", 2), ("007", 7), ("2147483647", 2147483647),
          ("-2147483648", -2147483648), ("2147483648", None), ("99999999999999999999", None), ("1.5", None),
          ("1e3", None), ("NaN", None), ("x", None), ("", None), ("\u0663", None), ("1 2", None)]


@st.composite
def qrels_lines(draw) -> Line:
    """A line and its meaning, (kind, query id, doc id, score column, its value or None): a judgment, a header, a
    bad id; or a blank line, or a bad one (a wrong column count, invalid UTF-8)."""
    query_id = draw(st.sampled_from(["q1", "q2", "q3", " q1 "] * 3 + ["q9"]))  # q9: unknown; ids are stripped
    doc_id = draw(st.sampled_from(["d1", "d2", "d3", "d4"] * 3 + ["d9"]))     # d9: outside the corpus
    score, value = draw(st.sampled_from(SCORES[:9] * 3 + SCORES))
    columns = [query_id, doc_id, score]
    kind = draw(st.sampled_from(["judgment"] * 12 + ["header", "blank", "columns", "bad-id", "bad-utf8"]))
    if kind == "blank":
        return draw(blank_lines)
    if kind == "header":
        return Line(b"query-id\tcorpus-id\tscore", ("header", "query-id", "corpus-id", "score", None))
    if kind == "columns":
        columns = columns[: draw(st.sampled_from([1, 2]))] if draw(st.booleans()) else columns + ["extra"]
        return Line("\t".join(columns).encode("utf-8"), BAD)
    if kind == "bad-id":
        columns[draw(st.sampled_from([0, 1]))] = draw(st.sampled_from(["", "a b", "q\u00a0x"]))
        return Line("\t".join(columns).encode("utf-8"), ("bad-id", *columns, value))
    line = Line("\t".join(columns).encode("utf-8"), ("judgment", query_id.strip(), doc_id, score, value))
    return draw(with_bad_bytes(line)) if kind == "bad-utf8" else line


def expected_qrels(lines: list[Line], outside: str) -> Expected:
    """The loader's rules (hil.data.beir_files): the first non-blank line is a header when its score column holds
    no digit; every query id known; a document outside the corpus refused or kept; a repeated pair with another
    score refused."""
    qrels: dict[str, dict[str, int]] = {}
    first = [True]

    def take(number: int, meaning: tuple) -> bool:
        kind, query_id, doc_id, score, value = meaning
        if first[0]:
            first[0] = False
            if not any(character in "0123456789" for character in score.strip()):
                return True  # the header row
        if kind in ("header", "bad-id"):
            return False
        if value is None or query_id not in QUERIES or (doc_id not in CORPUS and outside == "error"):
            return False
        judged = qrels.setdefault(query_id, {})
        if judged.get(doc_id, value) != value:
            return False
        judged[doc_id] = value
        return True

    refused = walk(lines, take, empty=False)
    if refused is not None:
        return refused
    return Expected(qrels) if qrels else Expected(error=True, line=None)


@FUZZ
@given(files(st.lists(qrels_lines(), max_size=8)), st.sampled_from(["error", "keep"]))
def test_qrels_tsv(generated, outside):
    content, lines, compressed = generated
    check(lambda path: read_qrels_tsv(path, queries=QUERIES, corpus=CORPUS, judged_outside_corpus=outside),
          content, expected_qrels(lines, outside), ".tsv.gz" if compressed else ".tsv")


# -- training triples ------------------------------------------------------------------------------------------------

columns_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\t\n\r"), min_size=1,
                       max_size=10)


@st.composite
def triple_lines(draw) -> Line:
    """A triple (kept exactly as written, spaces included), a blank line, or a bad line: ("columns", BAD) for a
    wrong column count or invalid UTF-8 (found when the offsets are taken), ("empty",) for a blank column (found
    when the triple is read)."""
    columns = [draw(columns_text) for _ in range(3)]
    kind = draw(st.sampled_from(["triple"] * 8 + ["blank", "columns", "empty", "bad-utf8"]))
    if kind == "blank":
        return draw(blank_lines)
    if kind == "columns":
        columns = columns[:2] if draw(st.booleans()) else columns + [draw(columns_text)]
    if kind == "empty":
        columns[draw(st.integers(0, 2))] = draw(st.sampled_from(["", " ", "\u3000"]))
    text = "\t".join(columns)
    if not text.strip():
        return Line(text.encode("utf-8"), BLANK)  # every column blank: a blank line, whatever its tabs
    if kind == "columns":
        return Line(text.encode("utf-8"), BAD)
    if kind == "bad-utf8":
        return draw(with_bad_bytes(Line(text.encode("utf-8"), BAD)))
    if any(not column.strip() for column in columns):
        return Line(text.encode("utf-8"), ("empty",))
    return Line(text.encode("utf-8"), Triple(*columns))


def expected_triples(lines: list[Line], structure_first: bool) -> Expected:
    """``read_triples`` reads line by line: the first bad line. ``TriplesFile`` checks UTF-8 and column counts of
    every line when it takes the offsets, then a blank column when it reads that triple."""
    if structure_first:
        refused = walk([line if line.meaning == BAD else Line(line.raw, BLANK) for line in lines],
                       lambda number, meaning: True, empty=False)
        if refused is not None:
            return refused
    found: list[Triple] = []
    refused = walk(lines, lambda number, meaning: isinstance(meaning, Triple) and not found.append(meaning),
                   empty=True)
    return refused or Expected(found)


@FUZZ
@given(files(st.lists(triple_lines(), max_size=8)))
def test_read_triples(generated):
    content, lines, compressed = generated
    check(read_triples, content, expected_triples(lines, structure_first=False), ".tsv.gz" if compressed else ".tsv")


@FUZZ
@given(files(st.lists(triple_lines(), max_size=8), gzip_allowed=False), st.sampled_from([7, 64, 1 << 24]))
def test_triples_file_by_offsets(generated, block):
    """The same through the line-offset index, with reads of ``block`` bytes (lines longer than a read, lines split
    across reads)."""
    content, lines, _ = generated
    with tempfile.TemporaryDirectory() as cache, mock.patch.object(line_index, "_BLOCK", block):
        check(lambda path: list(TriplesFile(path, cache_dir=cache)), content,
              expected_triples(lines, structure_first=True), ".tsv")


# -- TREC run files --------------------------------------------------------------------------------------------------

# (score field, its value; None: not a number, or NaN)
RUN_SCORES = [("1.5", 1.5), ("-2", -2.0), ("0", 0.0), ("1e-300", 1e-300), ("1e400", math.inf), ("inf", math.inf),
              ("-Infinity", -math.inf), ("1_000", 1000.0), ("nan", None), ("NaN", None), ("-nan", None),
              ("abc", None), ("1.2.3", None), ("0x10", None)]
RUN_QUERIES, RUN_DOCS = {"q1", "q2"}, {"d1", "d2", "d3"}


@st.composite
def run_lines(draw) -> Line:
    """A run row ("meaning": (qid, docid, score or None)), a blank line, or a bad one."""
    qid, docid = draw(st.sampled_from(["q1", "q2", "q7"])), draw(st.sampled_from(["d1", "d2", "d3", "d8"]))
    score, value = draw(st.one_of(st.sampled_from(RUN_SCORES[:8] * 2 + RUN_SCORES),
                                  st.floats(allow_nan=False, allow_infinity=False).map(lambda x: (repr(x), x))))
    fields = [qid, "Q0", docid, str(draw(st.integers(0, 10 ** 20))), score, draw(st.sampled_from(["bm25", "t"]))]
    kind = draw(st.sampled_from(["row"] * 8 + ["blank", "fields", "bad-utf8"]))
    separator = draw(st.sampled_from([" ", "\t", "  ", " \t", "\u3000"]))
    if kind == "blank":
        return draw(blank_lines)
    if kind == "fields":
        fields = fields[:5] if draw(st.booleans()) else fields + ["extra"]
        return Line(separator.join(fields).encode("utf-8"), BAD)
    line = Line(separator.join(fields).encode("utf-8"), (qid, docid, value))
    return draw(with_bad_bytes(line)) if kind == "bad-utf8" else line


def expected_run(lines: list[Line], against_dataset: bool) -> Expected:
    run: dict[str, dict[str, float]] = {}

    def take(number: int, meaning: tuple) -> bool:
        qid, docid, value = meaning
        if value is None or docid in run.get(qid, {}):
            return False
        if against_dataset and (qid not in RUN_QUERIES or docid not in RUN_DOCS):
            return False
        run.setdefault(qid, {})[docid] = value
        return True

    return walk(lines, take, empty=False) or Expected(run)  # an empty run is an empty dict


@FUZZ
@given(files(st.lists(run_lines(), max_size=8)), st.booleans())
def test_trec_run(generated, against_dataset):
    content, lines, compressed = generated
    known = {"queries": RUN_QUERIES, "documents": RUN_DOCS} if against_dataset else {}
    check(lambda path: read_trec_run(path, **known), content, expected_run(lines, against_dataset),
          ".trec.gz" if compressed else ".trec")
