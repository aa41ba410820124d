"""A corpus's texts on disk, read by byte offsets: what each rank of a multi-process build reads its share from.

``build_index`` receives the corpus as an in-memory list (the data layer holds a BEIR corpus in a dict), and
Fabric's ``ddp_spawn`` launcher sends every rank the same pickled arguments: before, every rank received the whole
corpus's texts (MS MARCO's 8.8M passages are ~3.8 GB of Python strings, per rank). Instead the main process writes
the texts once into the build's ``chunks`` folder -- their UTF-8 bytes one after another, and the byte offset where
each begins -- and sends the ranks a :class:`CorpusTextsFile`, which pickles as two paths. A rank reads a chunk's
texts with one ``pread`` when it tokenizes that chunk, so it holds only the chunks in flight, never the corpus, and
reads from disk only its own chunks' bytes (round robin: :mod:`hil.retrieval.chunks`). Writing costs one
sequential pass (~3.4 GB for MS MARCO); the files go with the chunks folder. A one-process build reads the
caller's list directly and writes nothing.

Exactness: texts are encoded with ``surrogatepass``, so any Python string comes back equal (a lone surrogate
included); the offsets file holds ``n + 1`` int64 offsets, the last being the file's size, checked when opened.
"""

from __future__ import annotations

import os
from array import array
from pathlib import Path
from typing import Iterable, overload

import numpy as np

from hil.provenance import atomic_output

TEXTS_NAME = "corpus-texts.utf8"
OFFSETS_NAME = "corpus-texts.offsets.npy"
_ENCODING, _ERRORS = "utf-8", "surrogatepass"
_WRITE_BUFFER = 1 << 22


class CorpusTextsFile:
    """Texts written by :func:`write_corpus_texts`, read back on demand: ``len``, ``[i]`` and ``[start:end]``.

    Pickles without its open file and without its offsets (the new process opens and maps them again). Not a
    registered ``collections.abc.Sequence`` on purpose: Fabric's launcher rebuilds every Sequence among the
    arguments element by element (``apply_to_collection``), which would read the whole corpus into each rank."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self._offsets: np.ndarray | None = None
        self._fd: int | None = None
        self._pid: int | None = None

    @property
    def offsets(self) -> np.ndarray:
        """(n + 1,) int64, memory-mapped: text ``i`` is bytes ``offsets[i]:offsets[i + 1]``."""
        if self._offsets is None:
            offsets = np.load(self.folder / OFFSETS_NAME, mmap_mode="r")
            size = (self.folder / TEXTS_NAME).stat().st_size
            if offsets.ndim != 1 or offsets.shape[0] < 1 or int(offsets[-1]) != size:
                raise ValueError(f"{self.folder / OFFSETS_NAME} does not describe {self.folder / TEXTS_NAME} "
                                 f"({size} bytes): written by another build?")
            self._offsets = offsets
        return self._offsets

    def _descriptor(self) -> int:
        if self._fd is None or self._pid != os.getpid():  # a forked loader worker opens its own
            self._fd, self._pid = os.open(self.folder / TEXTS_NAME, os.O_RDONLY), os.getpid()
        return self._fd

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def _read(self, begin: int, end: int) -> bytes:
        fd, parts, position = self._descriptor(), [], begin
        while position < end:  # pread may return less than asked (e.g. above 2 GiB)
            part = os.pread(fd, end - position, position)
            if not part:
                raise ValueError(f"{self.folder / TEXTS_NAME} is shorter than its offsets say")
            parts.append(part)
            position += len(part)
        return b"".join(parts)

    @overload
    def __getitem__(self, item: int) -> str: ...

    @overload
    def __getitem__(self, item: slice) -> list[str]: ...

    def __getitem__(self, item: int | slice) -> str | list[str]:
        n = len(self)
        if isinstance(item, slice):
            start, stop, step = item.indices(n)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            stop = max(start, stop)
            bounds = np.asarray(self.offsets[start: stop + 1], dtype=np.int64)
            if stop == start:
                return []
            data, base = self._read(int(bounds[0]), int(bounds[-1])), int(bounds[0])
            cuts = (bounds - base).tolist()
            return [data[cuts[i]: cuts[i + 1]].decode(_ENCODING, _ERRORS) for i in range(stop - start)]
        index = item + n if item < 0 else item
        if not 0 <= index < n:
            raise IndexError(f"text {item} of {n}")
        return self[index: index + 1][0]

    def remove(self) -> None:
        """Delete both files (what :func:`write_corpus_texts` wrote)."""
        self.close()
        for name in (TEXTS_NAME, OFFSETS_NAME):
            (self.folder / name).unlink(missing_ok=True)

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = self._pid = None
        self._offsets = None

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "_offsets": None, "_fd": None, "_pid": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None and self._pid == os.getpid():
            os.close(self._fd)


def write_corpus_texts(texts: Iterable[str], folder: str | os.PathLike) -> CorpusTextsFile:
    """Write ``texts`` into ``folder`` (:data:`TEXTS_NAME`, then :data:`OFFSETS_NAME`, each atomically) in one
    streaming pass; -> the file to read them back from (what multi-process encoding sends its ranks)."""
    folder = Path(folder)
    lengths = array("q")  # 8 bytes a text (a list of ints would cost ~36)
    with atomic_output(folder / TEXTS_NAME) as tmp, open(tmp, "wb", buffering=_WRITE_BUFFER) as handle:
        for text in texts:
            data = text.encode(_ENCODING, _ERRORS)
            handle.write(data)
            lengths.append(len(data))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.frombuffer(lengths, dtype=np.int64), out=offsets[1:])
    del lengths
    with atomic_output(folder / OFFSETS_NAME) as tmp, open(tmp, "wb") as handle:
        np.save(handle, offsets)
    return CorpusTextsFile(folder)
