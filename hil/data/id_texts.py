"""``id TAB text`` files looked up by id without holding their texts: MS MARCO's ``collection.tsv`` (8.8M passages,
``pid TAB text``) and ``queries.train.tsv`` (``qid TAB text``), the files Stanford ColBERT and the HIL authors train
from together with ``qidpidtriples.train.full.2.tsv``.

Lines are read as :func:`hil.data.beir_files.load_topics_tsv` reads them (BOM, CRLF, blank lines; the id is the text
before the first tab, stripped, non-empty and without whitespace; the text is the rest, tabs included) but through a
:class:`~hil.data.line_index.LineIndex`: a text is one ``pread`` away. The id -> line lookup is one of three:

- **dense**: the ids are ``0, 1, ..., N-1`` in line order (MS MARCO's collection): the line is the id; no array.
- **integer**: every id is a decimal integer (no sign, no leading zero, at most 18 digits): a sorted int64 array of
  ids and the line of each, searched with ``np.searchsorted`` (16 bytes an id).
- **hashed**: any other ids: the same two arrays over a 64-bit BLAKE2b hash of each id. Every lookup checks the id
  written on the line it lands on, so a hash collision can never give a wrong text; two ids of the file with the
  same hash are refused when the arrays are built (chance ~ n^2 / 2^65).

The arrays are cached beside the line offsets (``.<name>.ids.npy``, the same keys and places as
:mod:`hil.data.line_index`) and memory-mapped.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Sequence

import numpy as np

from hil.data.beir_files import checked_id
from hil.data.line_index import LineIndex, cache_file, load_cache, save_cache
from hil.errors import DataFormatError

DENSE, INTEGER, HASHED = 0, 1, 2
_MODES = {DENSE: "dense", INTEGER: "integer", HASHED: "hashed"}
_IDS_FORMAT = 1          # header "kind" of the ids cache
_CHUNK = 1 << 16         # lines whose ids are parsed together
_CANONICAL = re.compile(rb"(?:0|[1-9][0-9]{0,17})")


def hashed_id(identifier: str) -> int:
    """A 64-bit key of an id, the same in every process (unlike ``hash``): BLAKE2b's first 8 bytes."""
    digest = hashlib.blake2b(identifier.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def integer_id(identifier: str) -> int | None:
    """The id as an integer when written canonically (``"7"``, not ``"07"`` or ``"+7"``); else None."""
    raw = identifier.encode("utf-8", "surrogatepass")
    return int(raw) if _CANONICAL.fullmatch(raw) else None


def line_id(path: Path, line: int, text: str) -> str:
    """The id of an ``id TAB text`` line: the text before the first tab, stripped (:func:`checked_id`)."""
    return checked_id(path, line, text.partition("\t")[0].strip(), "id")


def _raw_integer_ids(region: bytes, starts: np.ndarray) -> np.ndarray | None:
    """The integer ids of the lines starting at ``starts`` (offsets into ``region``), read with numpy; None when
    one is not written canonically (the caller then reads the ids one by one). Every line holds a tab."""
    array = np.frombuffer(region, dtype=np.uint8)
    tabs = np.flatnonzero(array == 9)
    width = tabs[np.searchsorted(tabs, starts)] - starts  # (k,) bytes before each line's first tab
    if width.size == 0 or width.min() < 1 or width.max() > 18:
        return None
    values = np.zeros(starts.size, dtype=np.int64)
    for column in range(int(width.max())):
        inside = column < width
        digit = array[np.minimum(starts + column, array.size - 1)].astype(np.int64) - 48
        if ((digit < 0) | (digit > 9))[inside].any():
            return None
        values = np.where(inside, values * 10 + digit, values)
    if ((array[starts] == 48) & (width > 1)).any():  # a leading zero: "07" is not the integer 7 as an id
        return None
    return values


class IdTextFile:
    """The texts of an ``id TAB text`` file by id (see the module docstring); ``what`` names them in errors."""

    def __init__(self, path: str | os.PathLike, what: str = "texts", cache_dir: str | os.PathLike | None = None):
        self.path, self.what = Path(path), what
        self.lines = LineIndex(self.path, tabs=(1, None), bad_columns=self._bad_columns, cache_dir=cache_dir)
        if len(self.lines) == 0:
            raise DataFormatError(self.path, None, f"no {what}")
        stamp, cache = self.lines.stamp, cache_file(self.path, "ids", cache_dir)
        payload = load_cache(cache, stamp, _IDS_FORMAT)
        if payload is None:
            parts = self._build()
            payload = load_cache(cache, stamp, _IDS_FORMAT) if save_cache(cache, stamp, _IDS_FORMAT, parts) else None
            if payload is None:
                cache, payload = None, np.concatenate(parts)
        self.cache = cache
        self._attach(payload)

    def _bad_columns(self, number: int, text: str) -> None:
        raise DataFormatError(self.path, number, "expected 2 tab-separated columns (id, text), found 1")

    def _attach(self, payload: np.ndarray) -> None:
        self.mode, n = int(payload[0]), int(payload[1])
        self.keys = payload[2: 2 + n]          # (n,) sorted keys (empty when dense)
        self.rows = payload[2 + n: 2 + 2 * n]  # (n,) the line (item) of each key

    def __len__(self) -> int:
        return len(self.lines)

    def _ids(self, first: int, stop: int) -> list[str]:
        """The checked ids of items [first, stop), read one by one."""
        return [line_id(self.path, number, text) for number, text in (self.lines.line(i) for i in range(first, stop))]

    def _chunks(self) -> list[tuple[int, int]]:
        return [(first, min(first + _CHUNK, len(self))) for first in range(0, len(self), _CHUNK)]

    def _fast_integer_keys(self) -> np.ndarray | None:
        """Every id as an integer, read with numpy; None as soon as one is not a canonical integer."""
        starts, keys = self.lines.starts, np.empty(len(self), dtype=np.int64)
        for first, stop in self._chunks():
            values = _raw_integer_ids(self.lines.span(first, stop), starts[first:stop] - int(starts[first]))
            if values is None:
                return None
            keys[first:stop] = values
        return keys

    def _slow_keys(self) -> tuple[np.ndarray, bool]:
        """(keys, hashed): every id checked one by one; integers when all are, else all hashed."""
        keys = np.empty(len(self), dtype=np.int64)
        for first, stop in self._chunks():
            values = [integer_id(identifier) for identifier in self._ids(first, stop)]
            if None in values:
                break
            keys[first:stop] = values
        else:
            return keys, False
        for first, stop in self._chunks():
            keys[first:stop] = [hashed_id(identifier) for identifier in self._ids(first, stop)]
        return keys, True

    def _build(self) -> list[np.ndarray]:
        """[mode and count, sorted keys, rows]: what the ids cache holds."""
        keys, hashed = self._fast_integer_keys(), False
        if keys is None:
            keys, hashed = self._slow_keys()
        if not hashed and np.array_equal(keys, np.arange(len(self))):
            return [np.array([DENSE, 0], dtype=np.int64)]
        order = np.argsort(keys, kind="stable")
        ordered = keys[order]
        self._refuse_duplicates(ordered, order, hashed)
        return [np.array([HASHED if hashed else INTEGER, len(self)], dtype=np.int64), ordered, order.astype(np.int64)]

    def _refuse_duplicates(self, ordered: np.ndarray, order: np.ndarray, hashed: bool) -> None:
        same = np.flatnonzero(ordered[1:] == ordered[:-1])
        if same.size == 0:
            return
        j = same[np.argmin(order[same + 1])]  # the earliest line that repeats a key
        first_line, (line, text) = self.lines.line_number(int(order[j])), self.lines.line(int(order[j + 1]))
        identifier = line_id(self.path, line, text)
        other = line_id(self.path, first_line, self.lines.line(int(order[j]))[1])
        if identifier == other or not hashed:
            raise DataFormatError(self.path, line, f"duplicate id {identifier!r} (first on line {first_line})")
        raise DataFormatError(self.path, line, f"ids {identifier!r} and {other!r} (line {first_line}) have the same "
                                               f"64-bit hash; rename one")

    def find(self, identifiers: Sequence[str]) -> np.ndarray:
        """The item (line) index of each id, -1 for an id the file does not hold. -> (len(identifiers),) int64"""
        if self.mode == HASHED:
            keys = np.array([hashed_id(i) for i in identifiers], dtype=np.int64)
        else:
            keys = np.array([-1 if (v := integer_id(i)) is None else v for i in identifiers], dtype=np.int64)
        if self.mode == DENSE:
            return np.where(keys < len(self), keys, -1)
        position = np.minimum(np.searchsorted(self.keys, keys), self.keys.size - 1)
        return np.where(self.keys[position] == keys, self.rows[position], -1)

    def text_at(self, row: int, identifier: str | None = None) -> str | None:
        """The text on item ``row``; None when ``identifier`` is given and is not the id written there (a hashed
        id's collision). An empty text is a :class:`DataFormatError` naming the line."""
        number, line = self.lines.line(row)
        written, _, text = line.partition("\t")
        if identifier is not None and written.strip() != identifier:  # a hashed id's collision
            return None
        if not text.strip():
            raise DataFormatError(self.path, number, f"empty text for id {written.strip()!r}")
        return text

    def row(self, identifier: str) -> int:
        """The item (line) index of one id, -1 when the file does not hold it: :meth:`find` for one id, without
        numpy's per-call overhead (three of these a triple)."""
        if self.mode == HASHED:
            key = hashed_id(identifier)
        else:
            key = integer_id(identifier)
            if key is None or self.mode == DENSE:
                return -1 if key is None or key >= len(self) else key
        position = int(self.keys.searchsorted(key))
        return int(self.rows[position]) if position < self.keys.size and int(self.keys[position]) == key else -1

    def text(self, identifier: str) -> str | None:
        """The text of ``identifier``; None when the file does not hold it."""
        row = self.row(identifier)
        return None if row < 0 else self.text_at(row, identifier)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self.cache is not None:  # the new process maps the cache file again
            state.update(keys=None, rows=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.keys is None:
            payload = load_cache(self.cache, self.lines.stamp, _IDS_FORMAT)
            if payload is None:
                raise DataFormatError(self.path, None, f"its id cache {self.cache} disappeared or changed")
            self._attach(payload)

    def describe(self) -> str:
        return f"{self.path.name} ({len(self)} {self.what}, {_MODES[self.mode]} ids)"
