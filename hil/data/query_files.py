"""Queries without judgments, as ``hil search`` takes them: a file (a BEIR ``queries.jsonl``, or ``id TAB text``
lines as MS MARCO's ``queries.*.tsv`` and Pyserini's topics) or texts typed on the command line.

A file is read as :mod:`hil.data.beir_files` reads a dataset's (BOM, CRLF and blank lines; ``.gz``; ids checked by
:func:`~hil.data.beir_files.checked_id`, a repeated id refused naming both lines), and more strictly on one point: a
query whose text is empty or blank is refused with its line, since it would rank documents for nothing. Its format
is told by the name (``.jsonl``, ``.tsv``, ``.txt``, each optionally ``.gz``), else by the first line (``{`` opens
a JSON object).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hil.data.beir_files import checked_id, iter_text_lines, records_to_queries
from hil.errors import DataFormatError, MissingInputError, UserError

JSONL_SUFFIXES = (".jsonl", ".json")
TSV_SUFFIXES = (".tsv", ".txt")


def queries_format(path: Path) -> str:
    """``"jsonl"`` or ``"tsv"``: by the file's name, else by its first non-blank line."""
    name = path.name.lower().removesuffix(".gz")
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TSV_SUFFIXES):
        return "tsv"
    first = next(iter_text_lines(path), (None, ""))[1]
    return "jsonl" if first.lstrip().startswith("{") else "tsv"


def _json_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each line's JSON object, its text checked non-blank (the other fields: :func:`records_to_queries`)."""
    for line, text in iter_text_lines(path):
        try:
            record = json.loads(text)
        except (ValueError, RecursionError) as error:
            raise DataFormatError(path, line, f"malformed JSON ({error}); a queries.jsonl line is "
                                              '{"_id": "...", "text": "..."}') from None
        if not isinstance(record, dict):
            raise DataFormatError(path, line, f"expected a JSON object, got {type(record).__name__}")
        if isinstance(record.get("text"), str) and not record["text"].strip():
            raise DataFormatError(path, line, f"query {record.get('_id')!r} has an empty text")
        yield line, record


def _tsv_queries(path: Path) -> dict[str, str]:
    queries: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for line, text in iter_text_lines(path):
        identifier, tab, rest = text.partition("\t")  # the text keeps any further tab, as load_topics_tsv's
        if not tab:
            raise DataFormatError(path, line, "expected id<TAB>text (no tab on the line)")
        identifier = checked_id(path, line, identifier.strip(), "id")
        if not rest.strip():
            raise DataFormatError(path, line, f"query {identifier!r} has an empty text")
        if identifier in queries:
            raise DataFormatError(path, line, f"duplicate id {identifier!r} (first on line {first_line[identifier]})")
        queries[identifier], first_line[identifier] = rest.strip(), line
    if not queries:
        raise DataFormatError(path, None, "no queries")
    return queries


def read_queries_file(path: str | os.PathLike, option: str = "--queries") -> dict[str, str]:
    """``{query_id: text}`` from a queries file, in file order (see the module docstring); a bad line is a
    :class:`DataFormatError` naming the file and line, a missing file a :class:`MissingInputError` naming
    ``option``."""
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"{option} {path}: " + ("a folder, not a file" if path.is_dir() else "no such file"))
    if queries_format(path) == "tsv":
        return _tsv_queries(path)
    return records_to_queries(path, _json_records(path))


def inline_queries(texts: Sequence[str], option: str = "--query") -> dict[str, str]:
    """Queries typed on the command line, ids ``q1``, ``q2``, ... in the order given (the same ids for the same
    command line); an empty text is refused naming which one."""
    queries = {}
    for number, text in enumerate(texts, start=1):
        if not str(text).strip():
            raise UserError(f"{option}: query {number} of {len(texts)} is empty; give its text")
        queries[f"q{number}"] = str(text).strip()
    return queries
