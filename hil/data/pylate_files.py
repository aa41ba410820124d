"""PyLate's distillation data as it is published: the examples (``query_id``, ``document_ids``, ``scores``) and the
two tables (``query_id``, ``text``; ``document_id``, ``text``), each in JSON lines or Parquet -- the layout of
``lightonai/ms-marco-en-bge`` and of PyLate's ``KDProcessing`` (``pylate/utils/processing.py``), which looks the
texts up by ``query_id`` and ``document_id`` and keeps the first ``n_ways`` ids and scores.

Random access by byte offset needs lines, so a Parquet file (read with pyarrow, batch by batch: bounded memory) is
converted once into a file the on-disk readers take -- the examples into JSON lines (:class:`~hil.data.nway_files.
PyLateFile` reads them), a table into ``id TAB text`` (:class:`~hil.data.id_texts.IdTextFile`); a table in JSON
lines is converted the same way; an ``id TAB text`` table is used as it is. A conversion lives beside the line
offsets (:func:`hil.data.line_index.cache_file`), is written atomically under a file lock (ranks that open the
data together convert it once), and is redone when its source changes. Every row is checked while converting;
errors name the source file and its line (JSON lines, blank lines counted) or its 1-based row (Parquet), also for
problems found later in the converted file (an unknown id: line ``i`` of a conversion is row or line ``i`` of its
source).

Texts: a line break (``\\n`` or ``\\r``) inside a text becomes a space (an ``id TAB text`` line cannot hold one;
BERT-style tokenizers split on both alike); an empty or whitespace-only text is refused (PyLate passes it on).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterator

import numpy as np

from hil.data.beir_files import iter_text_lines
from hil.data.example_files import file_key, json_id, parse_json
from hil.data.examples import ExampleReader, ReadSettings
from hil.data.id_texts import IdTextFile
from hil.data.line_index import FileStamp, cache_file, load_cache, save_cache
from hil.data.nway_files import PyLateFile, parse_pylate
from hil.errors import DataFormatError, MissingInputError
from hil.provenance import atomic_output, file_lock, lock_path

EXAMPLE_COLUMNS = ("query_id", "document_ids", "scores")
_CONVERTED_KIND = 11  # header "kind" of a conversion's record
_BATCH_ROWS = 1024    # Parquet rows read at a time
_LINE_BREAKS = str.maketrans({"\n": " ", "\r": " "})


def _existing(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.exists():
        raise MissingInputError(f"{path}: no such file")
    if not path.is_file():
        raise DataFormatError(path, None, "not a file")
    return path


def is_parquet(path: Path) -> bool:
    return path.suffix.lower() == ".parquet"


def is_json_lines(path: Path) -> bool:
    return path.suffix.lower() in (".jsonl", ".json")


def converted(source: Path, what: str, extension: str, write: Callable[[IO[str]], None],
              cache_dir: str | os.PathLike | None) -> Path:
    """The conversion ``what`` of ``source`` (a file ending in ``extension``), written by ``write`` unless a
    conversion of ``source`` as it is now is already there."""
    target = cache_file(source, what, cache_dir).with_suffix(extension)
    record = cache_file(source, f"{what}-record", cache_dir)
    with file_lock(lock_path(target), what=f"converting {source}"):
        stamp = FileStamp.of(source)
        done = load_cache(record, stamp, _CONVERTED_KIND)
        if done is not None and target.is_file() and tuple(int(v) for v in done) == file_key(target):
            return target
        try:
            with atomic_output(target) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as handle:
                write(handle)
        except OSError as error:
            raise DataFormatError(source, None, f"cannot write its conversion {target} ({error})") from None
        save_cache(record, stamp, _CONVERTED_KIND, [np.array(file_key(target), dtype=np.int64)])
    return target


def parquet_rows(path: Path, columns: tuple[str, ...]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based row, {column: value}) of a Parquet file's ``columns``, a batch at a time."""
    import pyarrow
    import pyarrow.parquet as parquet

    try:
        handle = parquet.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as error:
        raise DataFormatError(path, None, f"not a readable Parquet file ({error})") from None
    names = handle.schema_arrow.names
    missing = [column for column in columns if column not in names]
    if missing:
        raise DataFormatError(path, None, f"no column {missing[0]!r} (columns: {', '.join(names)})")
    row = 0
    try:
        for batch in handle.iter_batches(batch_size=_BATCH_ROWS, columns=list(columns)):
            for record in batch.to_pylist():
                row += 1
                yield row, record
    except pyarrow.ArrowException as error:
        raise DataFormatError(path, None, f"cannot read row group after row {row} ({error})") from None


def _json_records(path: Path) -> Iterator[tuple[int, Any]]:
    for line, text in iter_text_lines(path):
        yield line, parse_json(path, line, text)


def _records(path: Path, columns: tuple[str, ...]) -> Iterator[tuple[int, Any]]:
    return parquet_rows(path, columns) if is_parquet(path) else _json_records(path)


def _write_lines(handle: IO[str], rows: Iterator[tuple[int, str]]) -> None:
    """Each (line, text) on that line of the output: blank lines fill the gaps, so line numbers are kept."""
    written = 0
    for line, text in rows:
        handle.write("\n" * (line - written - 1))
        handle.write(text)
        handle.write("\n")
        written = line


def example_rows(path: Path) -> Iterator[tuple[int, str]]:
    """(line or row, one JSON line) of each PyLate example of ``path``, checked (:func:`parse_pylate`) and written
    compactly."""
    for line, record in _records(path, EXAMPLE_COLUMNS):
        qid, pids, scores = parse_pylate(path, line, record)
        yield line, json.dumps({"query_id": qid, "document_ids": pids, "scores": scores}, ensure_ascii=False)


def table_rows(path: Path, id_column: str) -> Iterator[tuple[int, str]]:
    """(line or row, ``id TAB text``) of each record of a PyLate table, checked."""
    for line, record in _records(path, (id_column, "text")):
        if not isinstance(record, dict):
            raise DataFormatError(path, line, f"expected a JSON object with {id_column!r} and 'text'")
        identifier = json_id(path, line, record.get(id_column), id_column)
        text = record.get("text")
        if not isinstance(text, str):
            shown = "missing" if text is None else f"a {type(text).__name__}"
            raise DataFormatError(path, line, f"field 'text' must be a string, got {shown}")
        text = text.translate(_LINE_BREAKS)
        if not text.strip():
            raise DataFormatError(path, line, f"empty text for id {identifier!r}")
        yield line, f"{identifier}\t{text}"


def text_table(path: str | os.PathLike, id_column: str, what: str,
               cache_dir: str | os.PathLike | None = None) -> IdTextFile:
    """A PyLate table by id: ``id TAB text`` as it is, JSON lines or Parquet (``id_column``, ``text``) converted."""
    path = _existing(path)
    if not (is_parquet(path) or is_json_lines(path)):
        return IdTextFile(path, what, cache_dir)
    tsv = converted(path, "texts", ".tsv", lambda handle: _write_lines(handle, table_rows(path, id_column)),
                    cache_dir)
    try:
        table = IdTextFile(tsv, what, cache_dir)
    except DataFormatError as error:  # a repeated id: name the source file, on the same line
        if error.path != str(tsv):
            raise
        raise DataFormatError(path, error.line, error.reason.replace(str(tsv), str(path))) from None
    table.path = path  # errors and descriptions name the source; the texts are read through table.lines
    return table


def open_pylate(path: str | os.PathLike, queries: str | os.PathLike, documents: str | os.PathLike,
                nway: int | None = None, limit: int | None = None, check: bool = True,
                cache_dir: str | os.PathLike | None = None) -> PyLateFile:
    """PyLate's distillation data (see the module docstring) as an indexed source of examples (in a config, the
    reader :class:`PyLateExamples`).

    Args:
        path: the examples, JSON lines or Parquet (``query_id``, ``document_ids``, ``scores``).
        queries: the queries table (``query_id``, ``text``), JSON lines, Parquet or ``id TAB text``.
        documents: the documents table (``document_id``, ``text``), likewise.
        nway, limit, check, cache_dir: as for :class:`~hil.data.nway_files.PyLateFile`.
    """
    path = _existing(path)
    query_table = text_table(queries, "query_id", "queries", cache_dir)
    document_table = text_table(documents, "document_id", "documents", cache_dir)
    if is_parquet(path):
        rows = converted(path, "rows", ".jsonl", lambda handle: _write_lines(handle, example_rows(path)), cache_dir)
        return PyLateFile(rows, query_table, document_table, nway, limit, check, cache_dir, shown_path=path)
    return PyLateFile(path, query_table, document_table, nway, limit, check, cache_dir)


@dataclass(frozen=True)
class PyLateExamples(ExampleReader):
    """PyLate's distillation data (``lightonai/ms-marco-en-bge``'s layout): examples of ``query_id``,
    ``document_ids`` and ``scores``, the texts in two tables, each file JSON lines or Parquet (the tables also
    ``id TAB text``); the first ``data.nway`` documents of each example (:func:`open_pylate`).

    Args:
        path: the examples (``query_id``, ``document_ids``, ``scores``).
        queries: the queries table (``query_id``, ``text``).
        collection: the documents table (``document_id``, ``text``).
    """

    path: str
    queries: str
    collection: str

    def open(self, read: ReadSettings) -> PyLateFile:
        return open_pylate(read.file("PyLateExamples.path", self.path),
                           read.file("PyLateExamples.queries", self.queries),
                           read.file("PyLateExamples.collection", self.collection), read.nway, read.limit,
                           read.check, read.cache_dir)

    def prepare(self, read: ReadSettings) -> None:
        self.open(read)  # the conversions, line offsets and checking pass, once for every rank
