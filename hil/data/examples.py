"""One training example of any shape: a query and N documents, positive first or all graded by a teacher.

A triple (:class:`hil.data.triples.Triple`) is the N = 2 case without teacher scores. Every training source (text
or id triples, ColBERTv2 n-way files, TREC runs with teacher scores, PyLate's layout) yields these; the collate
step turns B of them into a batch of B queries x N documents (``hil.data.datamodule``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol, runtime_checkable


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
    """What training reads examples from (indexed, so a sampler can shard and resume it exactly)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> ScoredExample: ...

    def iter_queries(self) -> Iterator[str]: ...

    def iter_passages(self) -> Iterator[str]: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class ExampleReader:
    """A format of training examples: the data module's key that names its file (``data.<key>``), the function that
    opens it -- ``open(source, queries, collection, *, nway, limit, check, cache_dir, seed, **settings)`` -> an
    :class:`ExampleSource` -- the settings only this format takes, with their defaults (another format refuses one
    that a user set), and which of those are files (found under ``data_dir`` like the source)."""

    key: str
    open: Callable[..., ExampleSource]
    settings: Mapping[str, Any] = field(default_factory=dict)
    files: tuple[str, ...] = ()


EXAMPLE_READERS: dict[str, ExampleReader] = {}  # key -> reader; filled by @example_reader where each reader lives


def example_reader(key: str, files: tuple[str, ...] = (), **settings: Any) -> Callable[[Callable[..., ExampleSource]],
                                                                                   Callable[..., ExampleSource]]:
    """Register the decorated opener as the reader of ``data.<key>`` files (:class:`ExampleReader`): a new format
    is its reader module and its key among the data module's arguments, nothing else."""

    def register(opener: Callable[..., ExampleSource]) -> Callable[..., ExampleSource]:
        known = EXAMPLE_READERS.get(key)
        if known is not None and (known.open.__module__, known.open.__qualname__) != \
                (opener.__module__, opener.__qualname__):  # a module imported again replaces its own
            raise ValueError(f"two example readers are registered as {key!r}")
        EXAMPLE_READERS[key] = ExampleReader(key, opener, settings, files)
        return opener

    return register

