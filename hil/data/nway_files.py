"""N-way training examples, one JSON value a line, read by byte offset: ColBERTv2's examples files and PyLate's
distillation layout in JSON lines.

**ColBERTv2** (:class:`NWayFile`; in a config :class:`NWayExamples`), the files Stanford ColBERT trains and distils
from (``examples.64.json``), with ``queries.tsv`` (``qid TAB text``) and ``collection.tsv`` (``pid TAB text``)::

    [qid, [pid, score], [pid, score], ...]     a teacher score per passage (distillation)
    [qid, pid, pid, ...]                       no scores: the first passage is the positive

Stanford reads them in ``colbert/data/examples.py`` (``Examples._load_file``: ``ujson.loads(line)[:nway + 1]``,
the whole file into memory) and ``colbert/training/lazy_batcher.py`` (``LazyBatcher.__next__``: ``pids[:nway]``,
then ``zipstar`` splits pairs into pids and scores, and a line of bare pids has no scores): the first ``nway``
passages of each line. A line with fewer than ``nway`` passages is not refused there; it fails
``assert len(passages) == self.nway * self.bsize`` in ``LazyBatcher.collate`` when its batch is built, hours into
training and without naming the line. Here it is a :class:`DataFormatError` naming file and line, found by the
checking pass before training starts. ``nway=None`` takes every passage of each line, and then every line must hold
as many as the first.

**PyLate** (:class:`PyLateFile`): ``{"query_id": ..., "document_ids": [...], "scores": [...]}`` a line, with a
queries table (``query_id``, ``text``) and a documents table (``document_id``, ``text``): the layout of PyLate's
``KDProcessing`` (``pylate/utils/processing.py``), which keeps ``document_ids[:n_ways]`` and ``scores[:n_ways]``
and also accepts each list written as a string (``ast.literal_eval``), as here. Where PyLate gives an unknown
document the text ``""`` with a logged warning, this refuses the line. Parquet files and the tables in other
formats: :mod:`hil.data.pylate_files`.

What is checked, and when. When the reader is built (``check=True``, the default), one pass over the first
``limit`` lines checks each line completely -- valid UTF-8 (:class:`~hil.data.line_index.LineIndex`), valid JSON
(``NaN``/``Infinity`` refused), the shape, each id (a string or an integer, non-empty, no whitespace), each score
(a finite number), the number of documents against ``nway``, and that the query id and every kept document id
(those beyond ``nway`` are never read, as in Stanford's batcher) are in the tables -- and raises for the first bad
line. A passed check is recorded beside the line offsets (keyed by the file, the tables and the settings), so later
opens skip it. Read time repeats the line's own checks (cheap) and looks its texts up: with ``check=False`` the
pass is skipped and a bad line is reported when it is read; an empty text (``IdTextFile``) is reported then too.

Lines follow :func:`hil.data.beir_files.iter_text_lines` (a first-line BOM and the ``\\r`` of CRLF removed, blank
lines skipped but counted in line numbers). Both readers pickle cheaply (paths and memory-mapped offsets).
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

from hil.data.beir_files import iter_text_lines
from hil.data.example_files import (
    ExamplesOnDisk,
    checked_count,
    file_key,
    first_unknown,
    json_id,
    json_score,
    load_checked,
    parse_json,
    save_checked,
    settings_key,
    text_of,
)
from hil.data.examples import ExampleReader, ReadSettings, ScoredExample
from hil.data.id_texts import IdTextFile
from hil.data.line_index import LineIndex
from hil.errors import DataFormatError

# (query id, document ids, teacher scores or None) of one line, before ``nway`` is applied.
Record = tuple[str, list[str], list[float] | None]
_LOOKUPS = 1 << 16  # ids gathered before they are looked up during the checking pass


class JsonLinesExamples(ExamplesOnDisk):
    """Examples one JSON value a line (see the module docstring); subclasses parse a line (:meth:`parse`).

    Args:
        path: the examples file (plain UTF-8; not compressed).
        queries, collection: ``id TAB text`` files of the query and document texts.
        nway: documents per example: the first ``nway`` of each line (None: all, the same number on every line).
        limit: only the first ``limit`` examples.
        check: check every line when the reader is built (see the module docstring).
        cache_dir: where line offsets and checking records go (:func:`hil.data.line_index.cache_file`).
        shown_path: the file errors name, when ``path`` is a conversion of it (a Parquet file's rows; line ``i``
            of ``path`` is then row ``i`` of ``shown_path``).
    """

    layout = "JSON lines"

    def __init__(self, path: str | os.PathLike, queries: str | os.PathLike | IdTextFile,
                 collection: str | os.PathLike | IdTextFile, nway: int | None = None, limit: int | None = None,
                 check: bool = True, cache_dir: str | os.PathLike | None = None,
                 shown_path: str | os.PathLike | None = None):
        self.nway_setting = checked_count("nway", nway, 2)
        limit = checked_count("limit", limit, 0)
        self.lines = LineIndex(path, cache_dir=cache_dir)
        self.path = Path(shown_path) if shown_path is not None else self.lines.path
        if len(self.lines) == 0:
            raise DataFormatError(self.path, None, "no examples")
        self.queries = queries if isinstance(queries, IdTextFile) else IdTextFile(queries, "queries", cache_dir)
        self.collection = (collection if isinstance(collection, IdTextFile)
                           else IdTextFile(collection, "passages", cache_dir))
        self.size = len(self.lines) if limit is None else min(limit, len(self.lines))
        self.nway = self.nway_setting
        if self.nway is None:  # every line must hold as many documents as the first
            self.nway = len(self.parse(*self.lines.line(0))[1])
            if self.nway < 2:
                raise DataFormatError(self.path, self.lines.line_number(0),
                                      f"holds {self.nway} documents; an example needs at least 2")
        if check:
            self._check(cache_dir)

    def parse(self, line: int, text: str) -> Record:
        raise NotImplementedError

    def _cut(self, line: int, record: Record) -> Record:
        """The record's first ``nway`` documents (and scores); an error when it holds fewer (or, without an
        ``nway`` setting, not exactly as many as the first line)."""
        qid, pids, scores = record
        if self.nway_setting is None and len(pids) != self.nway:
            raise DataFormatError(self.path, line, f"holds {len(pids)} documents where the first example holds "
                                                   f"{self.nway}; set nway to take the first N of each")
        if len(pids) < self.nway:
            raise DataFormatError(self.path, line, f"holds {len(pids)} documents, fewer than nway={self.nway}")
        return qid, pids[: self.nway], None if scores is None else scores[: self.nway]

    def _records(self) -> Iterator[tuple[int, Record]]:
        """(line, record cut to ``nway``) of the first ``size`` examples, streaming."""
        for line, text in islice(iter_text_lines(self.lines.path), self.size):
            yield line, self._cut(line, self.parse(line, text))

    def _check(self, cache_dir: str | os.PathLike | None) -> None:
        """Every line checked once (see the module docstring), or the record that it was."""
        key = settings_key(self.layout, self.nway_setting, self.size, str(self.path),
                           file_key(self.queries.lines.path), file_key(self.collection.lines.path))
        if load_checked(self.lines.path, "checked", key, cache_dir) is not None:
            return
        stamp = self.lines.stamp
        wanted_queries: list[tuple[int, str, str]] = []
        wanted_documents: list[tuple[int, str, str]] = []
        refused: DataFormatError | None = None
        records = self._records()
        while True:
            try:
                line, (qid, pids, _) = next(records)
            except StopIteration:
                break
            except DataFormatError as error:
                refused = error
                break
            wanted_queries.append((line, "query id", qid))
            wanted_documents.extend((line, "document id", pid) for pid in pids)
            if len(wanted_documents) >= _LOOKUPS:
                self._raise_unknown(wanted_queries, wanted_documents, None)
                wanted_queries, wanted_documents = [], []
        self._raise_unknown(wanted_queries, wanted_documents, refused)
        save_checked(self.lines.path, stamp, "checked", key, [], cache_dir)

    def _raise_unknown(self, queries: list[tuple[int, str, str]], documents: list[tuple[int, str, str]],
                       refused: DataFormatError | None) -> None:
        """Raise the earliest (by line) of: an unknown query id, an unknown document id, ``refused``."""
        found = [error for error in (first_unknown(self.path, self.queries, queries),
                                     first_unknown(self.path, self.collection, documents), refused)
                 if error is not None]
        if found:
            raise min(found, key=lambda error: error.line or 0)  # stable: a query id before its line's documents

    def __getitem__(self, index: int) -> ScoredExample:
        line, text = self.lines.line(self._position(index))
        qid, pids, scores = self._cut(line, self.parse(line, text))
        query = text_of(self.path, line, "query id", qid, self.queries)
        documents = tuple(text_of(self.path, line, "document id", pid, self.collection) for pid in pids)
        return ScoredExample(query, documents, None if scores is None else tuple(scores), (qid, *pids))

    def example_ids(self) -> Iterator[tuple[int, str, tuple[str, ...]]]:
        return ((line, qid, tuple(pids)) for line, (qid, pids, _) in self._records())

    def describe(self) -> str:
        return (f"{self.path} ({self.size} {self.layout} examples of {self.nway} documents; "
                f"{self.queries.describe()}; {self.collection.describe()})")


class NWayFile(JsonLinesExamples):
    """ColBERTv2's n-way examples: ``[qid, [pid, score], ...]`` or ``[qid, pid, ...]`` a line (module docstring)."""

    layout = "ColBERTv2"
    kind = "n-way examples"

    def parse(self, line: int, text: str) -> Record:
        value = parse_json(self.path, line, text)
        if not isinstance(value, list) or not value:
            raise DataFormatError(self.path, line, "expected a JSON array [qid, [pid, score], ...] or "
                                                   "[qid, pid, ...]")
        qid = json_id(self.path, line, value[0], "query id")
        entries = value[1:]
        scored = bool(entries) and isinstance(entries[0], list)
        pids, scores = [], []
        for number, entry in enumerate(entries, start=1):
            if scored:
                if not isinstance(entry, list) or len(entry) != 2:
                    raise DataFormatError(self.path, line, f"passage {number} must be a [pid, score] pair, as the "
                                                           f"first is")
                pids.append(json_id(self.path, line, entry[0], f"passage id {number}"))
                scores.append(json_score(self.path, line, entry[1], f"score {number}"))
            else:
                if isinstance(entry, list):
                    raise DataFormatError(self.path, line, f"passage {number} is a [pid, score] pair but the first "
                                                           f"is a bare pid")
                pids.append(json_id(self.path, line, entry, f"passage id {number}"))
        return qid, pids, scores if scored else None


@dataclass(frozen=True)
class NWayExamples(ExampleReader):
    """ColBERTv2's n-way examples, ``[qid, [pid, score], ...]`` (teacher scores) or ``[qid, pid, ...]`` (the first
    the positive) a line, their texts looked up by id (:class:`NWayFile`; the first ``data.nway`` of each line).

    Args:
        path: the examples file (``examples.64.json``).
        queries: ``qid TAB text`` (``queries.tsv``).
        collection: ``pid TAB text`` (``collection.tsv``).
    """

    path: str
    queries: str
    collection: str

    def open(self, read: ReadSettings) -> NWayFile:
        return NWayFile(read.file("NWayExamples.path", self.path), read.file("NWayExamples.queries", self.queries),
                        read.file("NWayExamples.collection", self.collection), read.nway, read.limit, read.check,
                        read.cache_dir)

    def prepare(self, read: ReadSettings) -> None:
        self.open(read)  # the line offsets and the checking pass, once for every rank


def _list_field(path: Path, line: int, record: dict[str, Any], name: str) -> list[Any]:
    """A list field of a PyLate record: a JSON array, or a string holding a Python/JSON list literal (PyLate's
    ``KDProcessing`` reads those with ``ast.literal_eval``)."""
    if name not in record:
        raise DataFormatError(path, line, f"no field {name!r} (PyLate's layout: query_id, document_ids, scores)")
    value = record[name]
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise DataFormatError(path, line, f"field {name!r} is a string that is not a list literal") from None
        value = list(value) if isinstance(value, tuple) else value
    if not isinstance(value, list):
        raise DataFormatError(path, line, f"field {name!r} must be a list, got {type(value).__name__}")
    return value


def parse_pylate(path: Path, line: int, record: Any) -> Record:
    """One PyLate record (a JSON object, or a Parquet row as a dict) checked: its query id, document ids and as
    many finite scores."""
    if not isinstance(record, dict):
        raise DataFormatError(path, line, "expected a JSON object with query_id, document_ids and scores")
    if "query_id" not in record:
        raise DataFormatError(path, line, "no field 'query_id' (PyLate's layout: query_id, document_ids, scores)")
    qid = json_id(path, line, record["query_id"], "query_id")
    ids, values = _list_field(path, line, record, "document_ids"), _list_field(path, line, record, "scores")
    if len(ids) != len(values):
        raise DataFormatError(path, line, f"{len(ids)} document_ids but {len(values)} scores")
    pids = [json_id(path, line, value, f"document_ids[{j}]") for j, value in enumerate(ids)]
    scores = [json_score(path, line, value, f"scores[{j}]") for j, value in enumerate(values)]
    return qid, pids, scores


class PyLateFile(JsonLinesExamples):
    """PyLate's distillation layout in JSON lines (module docstring); ``queries`` and ``collection`` are ``id TAB
    text`` files (:func:`hil.data.pylate_files.open_pylate` converts PyLate's own tables and Parquet files; its
    reader is :class:`hil.data.pylate_files.PyLateExamples`)."""

    layout = "PyLate"
    kind = "PyLate examples"

    def parse(self, line: int, text: str) -> Record:
        return parse_pylate(self.path, line, parse_json(self.path, line, text))

