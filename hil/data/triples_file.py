"""Training triples read from disk on demand, at any size: the map-style datasets of ``TrainingDataModule``.

Two layouts, the same :class:`~hil.data.triples.Triple` objects out:

- **text triples** (:class:`TriplesFile`): ``query TAB positive TAB negative`` a line, MS MARCO's
  ``triples.train.small.tsv`` (40M lines, 27 GB). Item ``i`` is exactly ``read_triples(path)[i]``.
- **id triples** (:class:`IdTriplesFile`): ``qid TAB positive pid TAB negative pid`` a line, MS MARCO's
  ``qidpidtriples.train.full.2.tsv``, with the query texts in ``queries.train.tsv`` (``qid TAB text``) and the
  passages in ``collection.tsv`` (``pid TAB text``): the layout Stanford ColBERT trains from (its ``LazyBatcher``,
  ``colbert/training/lazy_batcher.py``, reads these three files) and the HIL authors' released code uses. Item ``i``
  is the triple of texts line ``i`` names.

Nothing is held but line offsets (:mod:`hil.data.line_index`: 8 bytes a line, memory-mapped and shared through the
page cache by every rank and loader worker) and, for ids that are not ``0..N-1`` in line order, a sorted id array
(:mod:`hil.data.id_texts`). Reading an item is one ``pread`` per file; a malformed line is a
:class:`DataFormatError` naming file and physical line. Every line's UTF-8 and column count are checked when the
offsets are first taken; the rest (an empty column, an unknown id) when the item is read.

Both pickle cheaply (paths and cache locations; the arrays are mapped again in the new process). Their readers,
named by ``class_path`` in ``data.source``: :class:`TextTriples` and :class:`IdTriples`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Iterator

import numpy as np
from torch.utils.data import Dataset

from hil.data.beir_files import checked_id, iter_text_lines
from hil.data.examples import ExampleReader, ReadSettings
from hil.data.id_texts import IdTextFile
from hil.data.line_index import LineIndex, sequence_position
from hil.data.triples import Triple, TripleDataset, parse_triple, read_triples
from hil.errors import DataFormatError, UserError

_CHUNK = 4096  # triples whose ids are looked up together when streaming


def _checked_limit(limit: int | None, available: int) -> int:
    if limit is not None and limit < 0:
        raise UserError(f"limit must be >= 0, got {limit}")
    return available if limit is None else min(limit, available)


class _TriplesOnDisk(Dataset):
    """What both layouts share: a read-only sequence of ``size`` triples (the first ``size`` lines)."""

    size: int

    def __len__(self) -> int:
        return self.size

    def _position(self, index: int) -> int:
        return sequence_position(index, self.size, "triple")

    @property
    def triples(self) -> "_TriplesOnDisk":
        """The triples as a sequence (this object), for code written against an in-memory list."""
        return self

    def _lines(self) -> Iterator[tuple[int, str]]:
        """(line number, text) of the first ``size`` triples in file order, streaming (faster than by index)."""
        return islice(iter_text_lines(self.path), self.size)


class TriplesFile(_TriplesOnDisk):
    """Text triples of a ``query TAB positive TAB negative`` file, read by index (see the module docstring).

    Args:
        path: the triples file (not compressed: a ``.gz`` cannot be read by offsets).
        limit: only the first ``limit`` triples (None: all).
        cache_dir: where the line offsets go (default: :func:`hil.data.line_index.cache_file`).
    """

    def __init__(self, path: str | os.PathLike, limit: int | None = None,
                 cache_dir: str | os.PathLike | None = None):
        self.path = Path(path)
        self.lines = LineIndex(self.path, tabs=(2, 2), bad_columns=self._bad_columns, cache_dir=cache_dir)
        if len(self.lines) == 0:
            raise DataFormatError(self.path, None, "no triples")
        self.size = _checked_limit(limit, len(self.lines))

    def _bad_columns(self, number: int, text: str) -> None:
        parse_triple(self.path, number, text)

    def __getitem__(self, index: int) -> Triple:
        return parse_triple(self.path, *self.lines.line(self._position(index)))

    def __iter__(self) -> Iterator[Triple]:
        return (parse_triple(self.path, number, text) for number, text in self._lines())

    def iter_passages(self) -> Iterator[str]:
        """Positive then negative of each triple in order (repeats included)."""
        for triple in self:
            yield triple.positive
            yield triple.negative

    def iter_queries(self) -> Iterator[str]:
        """The query of each triple in order (repeats included)."""
        return (triple.query for triple in self)

    def describe(self) -> str:
        return f"{self.path} ({self.size} triples)"


class IdTriplesFile(_TriplesOnDisk):
    """Triples of ids (``qid TAB positive pid TAB negative pid``) with their texts looked up by id.

    Args:
        triples: the id triples file (``qidpidtriples.train.full.2.tsv``).
        queries: ``qid TAB text`` (``queries.train.tsv``).
        collection: ``pid TAB text`` (``collection.tsv``).
        limit, cache_dir: as for :class:`TriplesFile`.
    """

    def __init__(self, triples: str | os.PathLike, queries: str | os.PathLike, collection: str | os.PathLike,
                 limit: int | None = None, cache_dir: str | os.PathLike | None = None):
        self.path = Path(triples)
        self.lines = LineIndex(self.path, tabs=(2, 2), bad_columns=self._bad_columns, cache_dir=cache_dir)
        if len(self.lines) == 0:
            raise DataFormatError(self.path, None, "no triples")
        self.queries = IdTextFile(queries, "queries", cache_dir)
        self.collection = IdTextFile(collection, "passages", cache_dir)
        self.size = _checked_limit(limit, len(self.lines))

    def _bad_columns(self, number: int, text: str) -> None:
        self._ids(number, text)

    def _ids(self, number: int, text: str) -> tuple[str, str, str]:
        """(qid, positive pid, negative pid) of one line."""
        columns = text.split("\t")
        if len(columns) != 3:
            raise DataFormatError(self.path, number, f"expected 3 tab-separated columns (query id, positive id, "
                                                     f"negative id), found {len(columns)}")
        qid, positive, negative = columns
        return (checked_id(self.path, number, qid.strip(), "query id"),
                checked_id(self.path, number, positive.strip(), "positive id"),
                checked_id(self.path, number, negative.strip(), "negative id"))

    def _unknown(self, number: int, what: str, identifier: str, table: IdTextFile) -> DataFormatError:
        return DataFormatError(self.path, number, f"{what} {identifier!r} is not in {table.path}")

    def _text(self, number: int, what: str, identifier: str, table: IdTextFile) -> str:
        text = table.text(identifier)
        if text is None:
            raise self._unknown(number, what, identifier, table)
        return text

    def _triple(self, number: int, text: str) -> Triple:
        qid, positive, negative = self._ids(number, text)
        return Triple(self._text(number, "query id", qid, self.queries),
                      self._text(number, "positive id", positive, self.collection),
                      self._text(number, "negative id", negative, self.collection))

    def __getitem__(self, index: int) -> Triple:
        return self._triple(*self.lines.line(self._position(index)))

    def __iter__(self) -> Iterator[Triple]:
        return (self._triple(number, text) for number, text in self._lines())

    def _first_texts(self, table: IdTextFile, columns: tuple[int, ...], names: tuple[str, ...]) -> Iterator[str]:
        """The text of each id of ``columns`` of the triples the first time that id appears (a bool bitmap over
        ``table``'s lines, 1 byte a line, remembers which were given), in file order."""
        seen = np.zeros(len(table), dtype=bool)
        lines = self._lines()
        while chunk := list(islice(lines, _CHUNK)):
            ids = [(number, self._ids(number, text)) for number, text in chunk]
            wanted = [(number, name, found[c]) for number, found in ids for c, name in zip(columns, names)]
            rows = table.find([identifier for _, _, identifier in wanted])
            for (number, name, identifier), row in zip(wanted, rows.tolist()):
                if row < 0:
                    raise self._unknown(number, name, identifier, table)
                if not seen[row]:
                    seen[row] = True
                    text = table.text_at(row, identifier)
                    if text is None:
                        raise self._unknown(number, name, identifier, table)
                    yield text

    def iter_passages(self) -> Iterator[str]:
        """Positive then negative passage of each triple in order, each pid only the first time it appears."""
        return self._first_texts(self.collection, (1, 2), ("positive id", "negative id"))

    def iter_queries(self) -> Iterator[str]:
        """The query of each triple in order, each qid only the first time it appears."""
        return self._first_texts(self.queries, (0,), ("query id",))

    def describe(self) -> str:
        return f"{self.path} ({self.size} triples; {self.queries.describe()}; {self.collection.describe()})"



@dataclass(frozen=True)
class TextTriples(ExampleReader):
    """Text triples, ``query TAB positive TAB negative`` a line (MS MARCO's ``triples.train.small.tsv``), read
    from disk by index (:class:`TriplesFile`: any size in bounded memory); a ``.gz`` file is read into memory.

    Args:
        path: the triples file (a path, or relative to ``HIL_DATA_DIR``).
    """

    path: str
    n_documents = 2

    def open(self, read: ReadSettings) -> TriplesFile | TripleDataset:
        path = read.file("TextTriples.path", self.path)
        if path.suffix == ".gz":  # not readable by offset
            return TripleDataset(read_triples(path, limit=read.limit), str(path))
        return TriplesFile(path, limit=read.limit, cache_dir=read.cache_dir)

    def prepare(self, read: ReadSettings) -> None:
        if not str(self.path).endswith(".gz"):
            self.open(read)  # the line offsets, taken once for every rank


@dataclass(frozen=True)
class IdTriples(ExampleReader):
    """Id triples, ``qid TAB positive pid TAB negative pid`` a line, their texts looked up by id
    (:class:`IdTriplesFile`): the layout Stanford ColBERT and the HIL authors train from.

    Args:
        path: the id triples (``qidpidtriples.train.full.2.tsv``).
        queries: ``qid TAB text`` (``queries.train.tsv``).
        collection: ``pid TAB text`` (``collection.tsv``).
    """

    path: str
    queries: str
    collection: str
    n_documents = 2

    def open(self, read: ReadSettings) -> IdTriplesFile:
        return IdTriplesFile(read.file("IdTriples.path", self.path), read.file("IdTriples.queries", self.queries),
                             read.file("IdTriples.collection", self.collection), limit=read.limit,
                             cache_dir=read.cache_dir)

    def prepare(self, read: ReadSettings) -> None:
        self.open(read)
