"""One training example of any shape: a query and N documents, positive first or all graded by a teacher.

A triple (:class:`hil.data.triples.Triple`) is the N = 2 case without teacher scores. Every training source (text
or id triples, ColBERTv2 n-way files, TREC runs with teacher scores, PyLate's layout) yields these; the collate
step turns B of them into a batch of B queries x N documents (``hil.data.datamodule``). Each source is an
:class:`ExampleReader` (its typed settings, chosen in a config by ``class_path``) that opens an
:class:`ExampleSource` with the data module's :class:`ReadSettings`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol, runtime_checkable

from hil.errors import MissingInputError
from hil.paths import resolve_data_file


@dataclass(frozen=True)
class ScoredExample:
    """A query and its N >= 2 documents (texts).

    Without ``scores`` the first document is the positive and the others are negatives (n-way contrastive
    training); with ``scores`` (one teacher score per document, larger = more relevant) the documents are graded
    and the order carries no meaning of its own (distillation). ``ids`` optionally names the query and documents
    (``(qid, pid_1, ..., pid_N)``) for logs and checks.
    """

    query: str
    documents: tuple[str, ...]
    scores: tuple[float, ...] | None = None
    ids: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.documents) < 2:
            raise ValueError(f"an example needs at least 2 documents, got {len(self.documents)}")
        if self.scores is not None:
            if len(self.scores) != len(self.documents):
                raise ValueError(f"{len(self.scores)} teacher scores for {len(self.documents)} documents")
            if not all(math.isfinite(s) for s in self.scores):
                raise ValueError("teacher scores must be finite")
        if self.ids is not None and len(self.ids) != len(self.documents) + 1:
            raise ValueError(f"ids name the query and each document: {len(self.documents) + 1} expected, "
                             f"got {len(self.ids)}")

    @property
    def n_documents(self) -> int:
        return len(self.documents)


@runtime_checkable
class ExampleSource(Protocol):
    """What training reads examples from (indexed, so a sampler can shard and resume it exactly); triples'
    items are :class:`~hil.data.triples.Triple`, the N = 2 case."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> ScoredExample: ...

    def iter_queries(self) -> Iterator[str]: ...

    def iter_passages(self) -> Iterator[str]: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class ReadSettings:
    """The data module's own settings, shared by every reader (``data.nway``, ``data.max_triples``, ...): what a
    reader opens its files with, besides its own settings.

    Args:
        nway: documents per example (the first ``nway`` of each example; None: the reader's own number).
        limit: the first ``limit`` examples only (``data.max_triples``).
        seed: the data's seed, for a reader that samples (a run's random selection, BM25 mining).
        cache_dir: where line offsets, checking records and conversions go.
        data_dir: where relative paths are also looked for (default ``$HIL_DATA_DIR``).
        check: check every line when opening (the readers that check up front).
    """

    nway: int | None = None
    limit: int | None = None
    seed: int = 0
    cache_dir: str | os.PathLike | None = None
    data_dir: str | os.PathLike | None = None
    check: bool = True

    def file(self, option: str, value: str | os.PathLike) -> Path:
        """``value`` as a path, or under ``data_dir`` (``HIL_DATA_DIR``); a missing file is a
        :class:`~hil.errors.MissingInputError` naming ``option``."""
        try:
            return resolve_data_file(value, self.data_dir)
        except FileNotFoundError as error:
            raise MissingInputError(f"{option}: {error}") from None


class ExampleReader(ABC):
    """Where training examples come from and how they are read: the data module's ``data.source``, chosen by
    ``class_path`` as Lightning IR chooses its datasets, e.g. ::

        data:
          source:
            class_path: hil.data.triples_file.TextTriples
            init_args: {path: msmarco/triples.train.small.tsv}

    A reader is a class (a frozen dataclass for the built-ins) whose typed ``__init__`` holds the settings only it
    takes, documented in its docstring's ``Args:`` (``hil fit --help`` shows them), and :meth:`open`, which gives
    its examples as an indexed :class:`ExampleSource` under the data module's shared :class:`ReadSettings`. Making a
    reader does no work. A new format is one module: its dataset and its reader, named by ``class_path`` in a config
    (``tests/test_extension_points.py`` trains through ``hil fit`` from one defined outside the package).
    """

    # a fixed N of every example (triples: 2); None: ``data.nway`` applies. Not a ClassVar annotation: a parser
    # resolves a reader's annotations in the reader's module, which need not import ClassVar
    n_documents: int | None = None

    def resolve(self, read: ReadSettings) -> tuple[ExampleReader, ReadSettings]:
        """The reader that reads and the settings it reads with, checked when the data module is made (before any
        model is loaded): a wrong combination is a :class:`~hil.errors.UserError` naming it. The default: this
        reader, ``read`` as given."""
        return self, read

    @abstractmethod
    def open(self, read: ReadSettings) -> ExampleSource:
        """The examples, indexed (a sampler shards and resumes them); bad data is a
        :class:`~hil.errors.DataFormatError` naming file and line."""

    def prepare(self, read: ReadSettings) -> None:
        """Work every rank would otherwise repeat (line offsets, conversions), done once per node before the ranks
        open the examples. The default: nothing."""

    def settings(self) -> dict[str, Any]:
        """The reader's own settings by name (a dataclass's fields; else its ``__init__`` parameters read back)."""
        if dataclasses.is_dataclass(self):
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        names = [name for name, parameter in inspect.signature(type(self)).parameters.items()
                 if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)]
        return {name: getattr(self, name, None) for name in names}

    def record(self) -> dict[str, Any]:
        """``{"class_path": ..., "init_args": ...}``: how a config names this reader (what a run records)."""
        return {"class_path": f"{type(self).__module__}.{type(self).__qualname__}", "init_args": self.settings()}

    def describe(self) -> str:
        """``Name(setting=value, ...)``: the reader and every one of its settings, for messages."""
        return f"{type(self).__name__}({', '.join(f'{k}={v}' for k, v in self.settings().items())})"
