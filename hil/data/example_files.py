"""What the on-disk readers of n-way and distillation examples share (:mod:`hil.data.nway_files`,
:mod:`hil.data.pylate_files`, :mod:`hil.data.run_examples`).

- JSON values checked as ids (:func:`json_id`: a string or an integer, non-empty, no whitespace) and as teacher
  scores (:func:`json_score`: a JSON number, not a boolean, finite), and :func:`parse_json` that refuses the
  ``NaN``/``Infinity`` constants Python's ``json`` would accept.
- :class:`ExamplesOnDisk`: the indexed-dataset part every reader has (length, negative indices, the queries and
  passages of the examples in first-seen order for an IDF table), over two ``id TAB text`` tables
  (:class:`~hil.data.id_texts.IdTextFile`).
- The record that a file passed its checking pass (:func:`load_checked` / :func:`save_checked`): a small ``.npy``
  beside the line offsets (:func:`hil.data.line_index.cache_file`), keyed by the file's stamp and a hash of the
  settings and of the stamps of the files it was checked against, so a second open (another rank, a loader
  worker, the next run) skips the pass, and any change to any of those files runs it again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from itertools import islice
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
from torch.utils.data import Dataset

from hil.data.beir_files import checked_id
from hil.data.id_texts import IdTextFile
from hil.data.line_index import FileStamp, cache_file, load_cache, save_cache, sequence_position
from hil.errors import DataFormatError, UserError

_CHECKED_KIND = 7        # header "kind" of a checking record
_CHUNK = 4096            # ids looked up together


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(path: Path, line: int, text: str) -> Any:
    """``text`` parsed as JSON (strict: no ``NaN``/``Infinity``); a :class:`DataFormatError` on ``line`` when it is
    not valid JSON."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise DataFormatError(path, line, "not valid JSON (nested too deeply)") from None
    except ValueError as error:  # JSONDecodeError, an integer beyond Python's digit limit, NaN / Infinity
        raise DataFormatError(path, line, f"not valid JSON ({str(error).splitlines()[0][:120]})") from None


def json_id(path: Path, line: int, value: Any, what: str) -> str:
    """A JSON id as a string: a string or an integer (``7`` -> ``"7"``, as Stanford ColBERT writes them),
    non-empty, without whitespace (:func:`hil.data.beir_files.checked_id`)."""
    return checked_id(path, line, value, what)


def json_score(path: Path, line: int, value: Any, what: str) -> float:
    """A JSON number (not a boolean) as a finite float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataFormatError(path, line, f"{what} must be a number, got {type(value).__name__} {value!r}"[:200])
    try:
        score = float(value)
    except OverflowError:  # an integer beyond the float range
        score = math.inf
    if not math.isfinite(score):
        raise DataFormatError(path, line, f"{what} is not finite ({value!r})"[:200])
    return score


def checked_count(name: str, value: int | None, least: int) -> int | None:
    """An optional integer option (``nway``, ``limit``, ``depth``) of at least ``least``; a :class:`UserError` naming
    it otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UserError(f"{name} must be an integer >= {least} (got {value!r})")
    return value


def settings_key(*parts: object) -> int:
    """A 64-bit key of ``parts`` (their ``repr``), the same in every process."""
    digest = hashlib.blake2b(repr(parts).encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def file_key(path: Path) -> tuple[int, ...]:
    """What identifies a file's current content in a settings key: its stamp (size, mtime, sampled hash)."""
    stamp = FileStamp.of(path)
    return (stamp.size, stamp.mtime_ns, stamp.sample)


def load_checked(path: Path, what: str, key: int, cache_dir: str | os.PathLike | None) -> np.ndarray | None:
    """The payload saved by :func:`save_checked` for ``path`` as it is now and these settings; None when there is
    none (or it is stale)."""
    payload = load_cache(cache_file(path, what, cache_dir), FileStamp.of(path), _CHECKED_KIND)
    if payload is None or payload.size < 1 or int(payload[0]) != key:
        return None
    return payload[1:]


def save_checked(path: Path, stamp: FileStamp, what: str, key: int, parts: list[np.ndarray],
                 cache_dir: str | os.PathLike | None) -> np.ndarray:
    """Record that ``path`` (as ``stamp`` says it was when checked) passed with settings ``key``, with ``parts``
    (int64 arrays); -> the payload as :func:`load_checked` gives it (memory-mapped, or in memory when no cache
    location is writable)."""
    head = np.array([key], dtype=np.int64)
    cache = cache_file(path, what, cache_dir)
    if save_cache(cache, stamp, _CHECKED_KIND, [head, *parts]):
        payload = load_cache(cache, stamp, _CHECKED_KIND)
        if payload is not None and int(payload[0]) == key:
            return payload[1:]
    return np.concatenate([np.asarray(part, dtype=np.int64) for part in parts]) if parts else np.empty(0, np.int64)


def unknown(path: Path, line: int, what: str, identifier: str, table: IdTextFile) -> DataFormatError:
    return DataFormatError(path, line, f"{what} {identifier!r} is not in {table.path}")


def text_of(path: Path, line: int, what: str, identifier: str, table: IdTextFile) -> str:
    """The text of ``identifier`` in ``table``; an unknown id is a :class:`DataFormatError` naming the example's
    ``path`` and ``line``."""
    row = table.row(identifier)
    text = None if row < 0 else table.text_at(row, identifier)
    if text is None:
        raise unknown(path, line, what, identifier, table)
    return text


def first_unknown(path: Path, table: IdTextFile, wanted: list[tuple[int, str, str]]) -> DataFormatError | None:
    """The error for the first of ``wanted`` ((line, what, id), in file order) that ``table`` does not hold; None
    when it holds them all. Ids are looked up ``_CHUNK`` at a time (numpy), so checking a whole file is fast."""
    for first in range(0, len(wanted), _CHUNK):
        chunk = wanted[first: first + _CHUNK]
        rows = table.find([identifier for _, _, identifier in chunk])
        missing = np.flatnonzero(rows < 0)
        if missing.size:
            line, what, identifier = chunk[int(missing[0])]
            return unknown(path, line, what, identifier, table)
    return None


def first_texts(path: Path, table: IdTextFile, ids: Iterable[tuple[int, str, str]]) -> Iterator[str]:
    """The text of each id of ``ids`` ((line, what, id) in example order) the first time it appears; a bool bitmap
    over ``table``'s lines (1 byte a line) remembers which were given."""
    seen = np.zeros(len(table), dtype=bool)
    stream = iter(ids)
    while chunk := list(islice(stream, _CHUNK)):
        rows = table.find([identifier for _, _, identifier in chunk])
        for (line, what, identifier), row in zip(chunk, rows.tolist()):
            if row < 0:
                raise unknown(path, line, what, identifier, table)
            if not seen[row]:
                seen[row] = True
                text = table.text_at(row, identifier)
                if text is None:
                    raise unknown(path, line, what, identifier, table)
                yield text


class ExamplesOnDisk(Dataset):
    """An indexed, read-only sequence of ``size`` :class:`~hil.data.examples.ScoredExample` read from ``path``, the
    texts looked up by id in ``queries`` and ``collection``. Subclasses give ``__getitem__`` and :meth:`example_ids`.
    """

    path: Path
    size: int
    queries: IdTextFile
    collection: IdTextFile
    kind: str = "examples"

    def __len__(self) -> int:
        return self.size

    def _position(self, index: int) -> int:
        return sequence_position(index, self.size, "example")

    def example_ids(self) -> Iterator[tuple[int, str, tuple[str, ...]]]:
        """(line, query id, document ids) of every example in order, without reading texts."""
        raise NotImplementedError

    def iter_queries(self) -> Iterator[str]:
        """The query of each example in order, each query id only the first time it appears."""
        ids = ((line, "query id", qid) for line, qid, _ in self.example_ids())
        return first_texts(self.path, self.queries, ids)

    def iter_passages(self) -> Iterator[str]:
        """The documents of each example in order, each document id only the first time it appears."""
        ids = ((line, "document id", pid) for line, _, pids in self.example_ids() for pid in pids)
        return first_texts(self.path, self.collection, ids)

    def describe(self) -> str:
        return f"{self.path} ({self.size} {self.kind}; {self.queries.describe()}; {self.collection.describe()})"
