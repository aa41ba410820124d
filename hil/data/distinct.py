"""Distinct texts of a stream too big to hold, in first-seen order: what ColBERT-HIL's IDF is counted over when it
comes from the training triples (``data.idf_source: train`` / ``train_queries``).

Keeping every distinct text in a dict (as an in-memory list of triples allows) would hold the whole collection
again. Here a text is remembered by its 64-bit hash only (:class:`SeenHashes`: 8 bytes a distinct text, in sorted
numpy runs; a Python ``set`` of ints would take ~75), so MS MARCO's ~8.8M distinct passages cost ~70 MB (about
twice that while two runs merge). Two different texts with the same hash would count as one: with 64-bit hashes and
n = 10^7 texts the chance that any pair collides is about n^2 / 2^65 ~ 3e-6.
"""

from __future__ import annotations

from itertools import islice
from typing import Callable, Iterable, Iterator

import numpy as np

_CHUNK = 4096  # texts hashed and looked up together


class SeenHashes:
    """A set of int64 values as sorted, disjoint numpy runs whose sizes shrink geometrically (a binary-counter
    merge, as a log-structured merge tree does): adding n values costs O(n log n) in all, a lookup O(log^2 n)."""

    def __init__(self) -> None:
        self.runs: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(int(run.size) for run in self.runs)

    def add_new(self, values: np.ndarray) -> np.ndarray:
        """Add ``values`` (n,) int64; -> (n,) bool, True where a value was not in the set before and is its first
        occurrence in ``values``."""
        unique, first = np.unique(values, return_index=True)
        fresh = np.ones(unique.size, dtype=bool)
        for run in self.runs:
            position = np.minimum(np.searchsorted(run, unique), run.size - 1)
            fresh &= run[position] != unique
        new = np.zeros(values.shape[0], dtype=bool)
        new[first[fresh]] = True
        if fresh.any():
            self.runs.append(unique[fresh])
            while len(self.runs) > 1 and self.runs[-2].size <= self.runs[-1].size:
                last = self.runs.pop()
                self.runs[-1] = np.sort(np.concatenate([self.runs[-1], last]), kind="stable")
        return new


def iter_distinct(texts: Iterable[str], limit: int | None = None) -> Iterator[str]:
    """The distinct ``texts`` in first-seen order, at most ``limit`` (None: all), holding only their hashes.

    Python's own ``hash`` of a string (64-bit SipHash on 64-bit builds) is salted per process, which is fine here:
    the set lives for one pass in one process.
    """
    if limit is not None and limit < 1:
        return
    seen, given = SeenHashes(), 0
    iterator = iter(texts)
    while chunk := list(islice(iterator, _CHUNK)):
        fresh = seen.add_new(np.fromiter((hash(text) for text in chunk), dtype=np.int64, count=len(chunk)))
        for text in (text for text, new in zip(chunk, fresh) if new):
            yield text
            given += 1
            if limit is not None and given >= limit:
                return


class StreamedTexts:
    """Texts read again from their source at every iteration (never held in memory), so the same object can be
    iterated twice and give the same texts -- a generator would silently give nothing the second time.

    ``len()`` counts them by iterating once (a full pass over the source).
    """

    def __init__(self, make: Callable[[], Iterator[str]], description: str = ""):
        self.make = make
        self.description = description

    def __iter__(self) -> Iterator[str]:
        return self.make()

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"StreamedTexts({self.description or self.make!r})"
