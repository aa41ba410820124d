"""The files of a BEIR dataset, read line by line with every problem reported as a :class:`DataFormatError` naming
file and line: ``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv``, TREC qrels, and ``id TAB text`` files (MS
MARCO queries and collection, Pyserini topics). ``.gz`` variants are read too. :mod:`hil.data.beir` puts them
together into a dataset.

Choices where BEIR itself is loose (each checked):

* Files are read as a stream of lines split on ``\\n`` only; a UTF-8 byte order mark on the first line and a ``\\r``
  before the newline are removed; blank (whitespace-only) lines are skipped; invalid UTF-8 is an error.
* ``_id`` must be a non-empty string without whitespace (run files and TREC qrels are whitespace-separated). JSON
  integers are accepted and turned into their decimal string (``7`` -> ``"7"``), since some exports write numeric
  ids; floats, booleans and null are errors. A repeated id is an error naming both lines.
* Documents: ``"text"`` must be present and a string (it may be empty); a missing or null ``"title"`` is ``""``.
  Queries: ``"text"`` must be present and a string. Strings with unpaired surrogates (``"\\ud800"``) are errors.
* Qrels: exactly three tab-separated columns; the score must be an integer (graded, 0 and negative kept) within
  the 32-bit range trec_eval's relevance holds (pytrec_eval fails on larger ones). The first non-blank line is taken
  as a header when its score column is not an integer (BEIR's own loader skips line 1 unconditionally, which silently
  drops a judgment from header-less files). Every query id must exist in the queries given; a document id outside
  the corpus given is an error or counted, as ``judged_outside_corpus`` says. A repeated (query, doc) pair with the
  same score is ignored; with a different score, an error.
* A file without any record (only blank lines, or only a header) is an error without a line number.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import zlib
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Literal, Mapping, TypeVar

from hil.errors import DataFormatError, MissingInputError, UserError

V = TypeVar("V")
OutsideCorpus = Literal["error", "keep"]
logger = logging.getLogger("hil.data.beir")  # the dataset's logger: one place to silence or capture its warnings

_BOM = b"\xef\xbb\xbf"
_SURROGATE = re.compile("[\ud800-\udfff]")
_INTEGER = re.compile(r"[+-]?[0-9]+")
_WHITESPACE = re.compile(r"\s")
_DIGIT = re.compile(r"[0-9]")
# trec_eval reads relevance into a C long and pytrec_eval into a 32-bit int on some builds; a larger grade is
# certainly a typo, and would be a crash (SystemError) or a silently wrapped number.
SCORE_RANGE = (-(2 ** 31), 2 ** 31 - 1)


def _open_binary(path: Path) -> IO[bytes]:
    try:
        return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    except FileNotFoundError:
        raise MissingInputError(f"{path}: no such file") from None
    except OSError as err:  # a folder, no permission
        raise DataFormatError(path, None, f"cannot read file: {err.strerror or err}") from None


def iter_text_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """``(line_number, text)`` for each non-blank line of a UTF-8 file (``.gz`` decompressed), streaming.

    Lines are split on ``\\n`` only (so a stray ``\\r`` or form feed inside a field stays inside it); a first-line BOM
    and the ``\\r`` of CRLF endings are removed. Line numbers are 1-based and count blank lines.
    """
    path = Path(path)
    with _open_binary(path) as handle:
        try:
            for number, raw in enumerate(handle, start=1):
                if number == 1 and raw.startswith(_BOM):
                    raw = raw[len(_BOM):]
                raw = raw.rstrip(b"\n")
                if raw.endswith(b"\r"):
                    raw = raw[:-1]
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DataFormatError(path, number, f"invalid UTF-8 at byte {err.start} of the line "
                                                        f"({err.reason})") from None
                if text.strip():
                    yield number, text
        except (OSError, EOFError, zlib.error) as err:  # a corrupt or truncated .gz
            raise DataFormatError(path, None, f"cannot read file: {err}") from None


def _check_no_surrogates(path: Path, line: int | None, name: str, value: str) -> None:
    # Only "\ud800"-style JSON escapes can produce these (strict UTF-8 decoding rejects them in raw bytes).
    if _SURROGATE.search(value):
        raise DataFormatError(path, line, f"field {name!r} contains an unpaired UTF-16 surrogate")


def _iter_json_objects(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    for number, text in iter_text_lines(path):
        try:
            value = json.loads(text)
        except RecursionError:
            raise DataFormatError(path, number, "malformed JSON: nested too deeply") from None
        except ValueError as err:  # json.JSONDecodeError, and over-long integer literals
            detail = f"{err.msg} at column {err.colno}" if isinstance(err, json.JSONDecodeError) else str(err)
            raise DataFormatError(path, number, f"malformed JSON: {detail}") from None
        if not isinstance(value, dict):
            raise DataFormatError(path, number, f"expected a JSON object, got {type(value).__name__}")
        yield number, value


def checked_id(path: Path, line: int | None, value: Any, name: str = "_id") -> str:
    """An id as read from any data file (JSON, TSV, TREC, ir_datasets), the one check of them all: a string or an
    integer (``7`` -> ``"7"``), non-empty, without whitespace (it must fit a run or qrels line) and without unpaired
    surrogates; else a :class:`DataFormatError` naming ``path``, ``line`` and the field ``name``. Not stripped
    here: readers of ``id TAB text`` lines strip the id first (as MS MARCO's files are read)."""
    if isinstance(value, bool) or value is None or not isinstance(value, (str, int)):
        shown = "missing" if value is None else f"a {type(value).__name__}"
        raise DataFormatError(path, line, f"field {name!r} must be a string (or integer), got {shown}")
    identifier = str(value)
    if not identifier.strip():
        raise DataFormatError(path, line, f"field {name!r} is empty")
    if _WHITESPACE.search(identifier):
        raise DataFormatError(path, line, f"{name} {identifier!r} contains whitespace, which run and qrels files "
                                          f"cannot hold")
    _check_no_surrogates(path, line, name, identifier)
    return identifier


def _checked_text(path: Path, line: int | None, record: Mapping[str, Any], name: str, required: bool) -> str:
    if name not in record or record[name] is None:
        if required:
            raise DataFormatError(path, line, f"missing field {name!r}")
        return ""
    value = record[name]
    if not isinstance(value, str):
        raise DataFormatError(path, line, f"field {name!r} must be a string, got {type(value).__name__}")
    _check_no_surrogates(path, line, name, value)
    return value


def _records_by_id(path: Path, records: Iterable[tuple[int, Mapping[str, Any]]], what: str,
                   value: Callable[[int, Mapping[str, Any]], V]) -> dict[str, V]:
    """``{_id: value(line, record)}`` of JSON records: every ``_id`` present, valid and unique, at least one."""
    found: dict[str, V] = {}
    first_line: dict[str, int] = {}
    for line, record in records:
        if "_id" not in record:
            raise DataFormatError(path, line, "missing field '_id'")
        record_id = checked_id(path, line, record["_id"])
        if record_id in found:
            raise DataFormatError(path, line, f"duplicate _id {record_id!r} (first on line {first_line[record_id]})")
        found[record_id] = value(line, record)
        first_line[record_id] = line
    if not found:
        raise DataFormatError(path, None, f"no {what}")
    return found


def records_to_corpus(path: Path, records: Iterable[tuple[int, Mapping[str, Any]]]) -> dict[str, dict[str, str]]:
    def document(line: int, record: Mapping[str, Any]) -> dict[str, str]:
        text = _checked_text(path, line, record, "text", required=True)  # the required field is checked first
        return {"title": _checked_text(path, line, record, "title", required=False), "text": text}

    return _records_by_id(path, records, "documents", document)


def records_to_queries(path: Path, records: Iterable[tuple[int, Mapping[str, Any]]]) -> dict[str, str]:
    return _records_by_id(path, records, "queries",
                          lambda line, record: _checked_text(path, line, record, "text", required=True))


def read_corpus_jsonl(path: str | os.PathLike) -> dict[str, dict[str, str]]:
    """``{doc_id: {"title", "text"}}`` from a BEIR ``corpus.jsonl`` (rules in the module docstring)."""
    path = Path(path)
    return records_to_corpus(path, _iter_json_objects(path))


def read_queries_jsonl(path: str | os.PathLike) -> dict[str, str]:
    """``{query_id: text}`` from a BEIR ``queries.jsonl``."""
    path = Path(path)
    return records_to_queries(path, _iter_json_objects(path))


def check_options(judged_outside_corpus: str = "error", relevance_level: int = 1) -> None:
    if judged_outside_corpus not in ("error", "keep"):
        raise UserError(f"judged_outside_corpus must be 'error' or 'keep', got {judged_outside_corpus!r}")
    if isinstance(relevance_level, bool) or not isinstance(relevance_level, int) or relevance_level < 1:
        raise UserError(f"relevance_level must be an integer >= 1, got {relevance_level!r}")


class QrelsBuilder:
    """Collects judgments, checking ids against the corpus/queries (see ``judged_outside_corpus``) and repeats."""

    def __init__(self, path: Path, queries: Mapping[str, str] | None, corpus: Mapping[str, Any] | None,
                 outside_corpus: OutsideCorpus = "error") -> None:
        check_options(outside_corpus)
        self.path, self.queries, self.corpus, self.outside_corpus = path, queries, corpus, outside_corpus
        self.qrels: dict[str, dict[str, int]] = {}
        self.first_line: dict[tuple[str, str], int] = {}
        self.n_outside = 0

    def add(self, line: int | None, query_id: str, doc_id: str, score: int) -> None:
        if self.queries is not None and query_id not in self.queries:
            raise DataFormatError(self.path, line, f"query id {query_id!r} is not in the queries")
        outside = self.corpus is not None and doc_id not in self.corpus
        if outside and self.outside_corpus == "error":
            raise DataFormatError(self.path, line, f"corpus id {doc_id!r} is not in the corpus (a re-ranking set "
                                                   f"whose qrels judge documents outside its corpus loads with "
                                                   f"judged_outside_corpus='keep')")
        judged = self.qrels.setdefault(query_id, {})
        if doc_id in judged:
            if judged[doc_id] != score:
                first = self.first_line[(query_id, doc_id)]
                raise DataFormatError(self.path, line, f"({query_id!r}, {doc_id!r}) judged {score} here but "
                                                       f"{judged[doc_id]} on line {first}")
            return
        judged[doc_id] = score
        self.first_line[(query_id, doc_id)] = line if line is not None else 0
        self.n_outside += outside

    def result(self) -> dict[str, dict[str, int]]:
        if not self.qrels:
            raise DataFormatError(self.path, None, "no judgments")
        if self.n_outside:
            logger.warning("%s: %d of %d judgments name documents outside the corpus; kept (they count in the ideal "
                           "DCG, as in trec_eval)", self.path, self.n_outside, sum(map(len, self.qrels.values())))
        return self.qrels


def parse_score(path: Path, line: int | None, value: str) -> int:
    if not _INTEGER.fullmatch(value):
        raise DataFormatError(path, line, f"score {value!r} is not an integer")
    low, high = SCORE_RANGE
    if not low <= int(value) <= high:
        raise DataFormatError(path, line, f"score {value} is outside the range trec_eval holds ({low}..{high})")
    return int(value)


def read_qrels_tsv(path: str | os.PathLike, queries: Mapping[str, str] | None = None,
                   corpus: Mapping[str, Any] | None = None,
                   judged_outside_corpus: OutsideCorpus = "error") -> dict[str, dict[str, int]]:
    """``{query_id: {doc_id: score}}`` from a BEIR qrels TSV; ids are checked when ``queries``/``corpus`` are given
    (documents outside ``corpus`` as ``judged_outside_corpus`` says: see the module docstring)."""
    path = Path(path)
    builder = QrelsBuilder(path, queries, corpus, judged_outside_corpus)
    first = True
    for line, text in iter_text_lines(path):
        columns = [column.strip() for column in text.split("\t")]
        if len(columns) != 3:
            raise DataFormatError(path, line, f"expected 3 tab-separated columns (query-id, corpus-id, score), "
                                              f"found {len(columns)}")
        if first and not _DIGIT.search(columns[2]):
            first = False
            continue  # header row (BEIR's "score"); a first judgment scored "1.5" is an error, not a header
        first = False
        query_id = checked_id(path, line, columns[0], "query-id")
        doc_id = checked_id(path, line, columns[1], "corpus-id")
        builder.add(line, query_id, doc_id, parse_score(path, line, columns[2]))
    return builder.result()


def load_trec_qrels(path: str | os.PathLike, queries: Mapping[str, str] | None = None,
                    corpus: Mapping[str, Any] | None = None,
                    judged_outside_corpus: OutsideCorpus = "error") -> dict[str, dict[str, int]]:
    """``{query_id: {doc_id: relevance}}`` from TREC qrels (``qid iteration docid relevance``, whitespace-separated);
    ids checked as :func:`read_qrels_tsv` does."""
    path = Path(path)
    builder = QrelsBuilder(path, queries, corpus, judged_outside_corpus)
    for line, text in iter_text_lines(path):
        columns = text.split()
        if len(columns) != 4:
            raise DataFormatError(path, line, f"expected 4 whitespace-separated columns (query-id, iteration, "
                                              f"doc-id, relevance), found {len(columns)}")
        query_id = checked_id(path, line, columns[0], "query-id")
        doc_id = checked_id(path, line, columns[2], "doc-id")
        builder.add(line, query_id, doc_id, parse_score(path, line, columns[3]))
    return builder.result()


def _read_id_text_tsv(path: Path, what: str) -> tuple[dict[str, str], dict[str, int]]:
    values: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for line, text in iter_text_lines(path):
        # Split at the first tab only: the text keeps any tab it holds (robust04's topic 350 does), as is.
        identifier, tab, rest = text.partition("\t")
        if not tab:
            raise DataFormatError(path, line, "expected 2 tab-separated columns (id, text), found 1")
        identifier = checked_id(path, line, identifier.strip(), "id")
        if identifier in values:
            raise DataFormatError(path, line, f"duplicate id {identifier!r} (first on line {first_line[identifier]})")
        values[identifier] = rest
        first_line[identifier] = line
    if not values:
        raise DataFormatError(path, None, f"no {what}")
    return values, first_line


def load_topics_tsv(path: str | os.PathLike) -> dict[str, str]:
    """``{query_id: text}`` from ``qid TAB text`` lines (``.gz`` allowed): MS MARCO queries, Pyserini BEIR topics."""
    return _read_id_text_tsv(Path(path), "queries")[0]


def load_collection_tsv(path: str | os.PathLike) -> dict[str, dict[str, str]]:
    """``{doc_id: {"title": "", "text"}}`` from an MS MARCO style ``pid TAB text`` collection."""
    passages = _read_id_text_tsv(Path(path), "documents")[0]
    return {doc_id: {"title": "", "text": text} for doc_id, text in passages.items()}


