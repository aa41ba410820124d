"""Random access to the lines of a big text file: the byte offset of every non-blank line, found in one pass and
cached on disk, so that line ``i`` is one ``pread`` away without holding the file (MS MARCO's 27 GB
``triples.train.small.tsv`` costs 8 bytes a line: 320 MB of offsets for its 40M lines, memory-mapped).

Lines are those of :func:`hil.data.beir_files.iter_text_lines`, exactly: split on ``\\n`` only; a first-line UTF-8
BOM and the ``\\r`` of CRLF removed; blank (whitespace-only, ``str.strip`` sense) lines skipped but counted in line
numbers; a last line without a newline kept; invalid UTF-8 an error. So item ``i`` of a :class:`LineIndex` is the
``i``-th pair that ``iter_text_lines`` yields, and its physical line number is the same.

The one pass reads blocks of 16 MiB and finds line breaks and tabs with numpy; it also validates the whole file's
UTF-8 and the number of tab-separated columns of every line (``tabs``), so a malformed line is reported before
training starts, not hours into it. Only lines starting with whitespace or a non-ASCII byte are looked at one by one
(to tell a blank line from a line starting with, say, U+00A0 and text).

Cache: one ``.npy`` (int64) holding a header -- the file's size, mtime and a hash of its first and last 64 KiB,
and the column check -- then the offsets. A cache whose header does not match the file as it is now is never used
(it is rebuilt). It lives, in this order of preference: in ``cache_dir`` when given, in ``$HIL_CACHE_DIR`` when
set, beside the data (``.<name>.lines.npy``) when that folder is writable, else in ``~/.cache/hil``; a folder whose
permission bits say read-only counts as not writable even for root. Writes are atomic
(:func:`hil.provenance.atomic_output`), so ranks or workers that build it at the same time do no harm. When no
location is writable the offsets stay in memory (and are copied into each loader worker).

A :class:`LineIndex` pickles without its arrays and without an open file (it re-opens both lazily in the new
process), so DataLoader workers and DDP ranks share the page cache instead of holding copies.
"""

from __future__ import annotations

import hashlib
import os
import stat
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from hil.errors import DataFormatError, MissingInputError
from hil.paths import CACHE_DIR_ENV
from hil.provenance import atomic_output

_BOM = b"\xef\xbb\xbf"
_BLOCK = 1 << 24            # bytes read per step of the scan
_SAMPLE = 1 << 16           # bytes hashed at each end of the file for its stamp
_MAGIC = 0x48494C4C494E4553  # "HILLINES"
_FORMAT = 1
# Bytes that certainly start a non-blank line: ASCII, not whitespace in the str.isspace sense (which includes
# \x1c-\x1f). Lines starting with anything else are decoded and stripped one by one.
_CERTAIN_TEXT = np.array([b < 128 and not chr(b).isspace() for b in range(256)])

BadColumns = Callable[[int, str], None]  # (line number, text) -> raises the reader's own DataFormatError


@dataclass(frozen=True)
class FileStamp:
    """What a cache is keyed by besides the path: size, modification time (ns), hash of the first and last 64 KiB
    (which catches a rewrite that kept size and mtime, e.g. ``cp -p`` of another version)."""

    size: int
    mtime_ns: int
    sample: int

    @classmethod
    def of(cls, path: Path) -> "FileStamp":
        info = path.stat()
        digest = hashlib.blake2b(digest_size=8)
        with open(path, "rb") as handle:
            digest.update(handle.read(_SAMPLE))
            if info.st_size > _SAMPLE:
                handle.seek(max(_SAMPLE, info.st_size - _SAMPLE))
                digest.update(handle.read(_SAMPLE))
        return cls(info.st_size, info.st_mtime_ns, int.from_bytes(digest.digest(), "little", signed=True))

    def header(self, kind: int) -> np.ndarray:
        return np.array([_MAGIC, _FORMAT, self.size, self.mtime_ns, self.sample, kind], dtype=np.int64)


_HEADER = 6


def _writable(folder: Path) -> bool:
    try:
        mode = folder.stat().st_mode
    except OSError:
        return False
    return bool(stat.S_IMODE(mode) & 0o222) and os.access(folder, os.W_OK | os.X_OK)


def cache_file(path: Path, suffix: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the cache ``suffix`` (``"lines"``, ``"ids"``) of data file ``path`` lives (see the module docstring)."""
    path = path.resolve()
    folder = cache_dir if cache_dir is not None else os.environ.get(CACHE_DIR_ENV)
    if folder is None and _writable(path.parent):
        return path.parent / f".{path.name}.{suffix}.npy"
    if folder is None:
        folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hil"
    key = hashlib.sha1(str(path).encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return Path(folder).expanduser() / f"{path.name}.{key}.{suffix}.npy"


def load_cache(cache: Path, stamp: FileStamp, kind: int) -> np.ndarray | None:
    """The payload of ``cache`` (memory-mapped, read-only) when its header matches ``stamp`` and ``kind``; else None."""
    try:
        array = np.load(cache, mmap_mode="r")
    except (OSError, ValueError):
        return None
    if array.dtype != np.int64 or array.ndim != 1 or array.shape[0] < _HEADER:
        return None
    if not np.array_equal(array[:_HEADER], stamp.header(kind)):
        return None
    return np.asarray(array[_HEADER:])  # a plain ndarray over the mapping: np.memmap's indexing is slow


def save_cache(cache: Path, stamp: FileStamp, kind: int, parts: list[np.ndarray]) -> bool:
    """Write header + ``parts`` (int64) as one ``.npy`` without concatenating them; False when it cannot be written."""
    total = _HEADER + sum(int(part.size) for part in parts)
    try:
        with atomic_output(cache) as tmp, open(tmp, "wb") as handle:
            np.lib.format.write_array_header_1_0(handle, {"descr": "<i8", "fortran_order": False, "shape": (total,)})
            for part in [stamp.header(kind), *parts]:
                handle.write(np.ascontiguousarray(part, dtype="<i8").data)  # no copy of the offsets
    except OSError as error:
        warnings.warn(f"{cache}: cannot write the cache ({error}); keeping it in memory", stacklevel=3)
        return False
    return True


def _raise_utf8(path: Path, number: int, raw: bytes) -> None:
    """The error :func:`hil.data.beir_files.iter_text_lines` gives for line ``number`` (``raw``: without BOM and
    ``\\n``)."""
    raw = raw[:-1] if raw.endswith(b"\r") else raw
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataFormatError(path, number, f"invalid UTF-8 at byte {err.start} of the line ({err.reason})") from None


def _decode(raw: bytes) -> str | None:
    """A line's text as ``iter_text_lines`` reads it (one trailing ``\\r`` removed); None for invalid UTF-8."""
    try:
        return (raw[:-1] if raw.endswith(b"\r") else raw).decode("utf-8")
    except UnicodeDecodeError:
        return None


@dataclass
class _Scan:
    """Running state of the one pass over a file."""

    path: Path
    tabs: tuple[int, int | None]
    bad_columns: BadColumns
    lines: int = 0                       # physical lines finished so far
    items: int = 0                       # non-blank lines so far
    starts: list[np.ndarray] = field(default_factory=list)  # per block: offsets of the non-blank lines
    blanks: list[np.ndarray] = field(default_factory=list)  # per block: items before each blank line

    def block(self, data: memoryview, offset: int, final: bool) -> None:
        """Index the whole lines of ``data`` (file bytes from ``offset``; each ends with ``\\n`` unless ``final``)."""
        array = np.frombuffer(data, dtype=np.uint8)
        control = np.flatnonzero(array <= 10)  # one pass finds both line breaks and tabs (and rare other controls)
        kinds = array[control]
        ends, tab_at = control[kinds == 10], control[kinds == 9]  # (lines,) position of each line's \n; tabs
        if final and (ends.size == 0 or ends[-1] != len(data) - 1):
            ends = np.append(ends, len(data))  # the last line has no \n
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
        if offset == 0 and bytes(data[: len(_BOM)]) == _BOM:
            starts[0] = len(_BOM)
        first = np.where(starts < ends, array[np.minimum(starts, len(data) - 1)], 10)
        blank = ~_CERTAIN_TEXT[first]
        for j in np.flatnonzero(blank):  # the few lines that start with whitespace or a non-ASCII byte
            text = _decode(bytes(data[starts[j]: ends[j]]))
            blank[j] = text is not None and not text.strip()
        columns = np.searchsorted(tab_at, ends) - np.searchsorted(tab_at, starts)  # (lines,) tabs per line
        low, high = self.tabs
        wrong = ~blank & ((columns < low) | ((columns > high) if high is not None else False))
        self._check(data, starts, ends, wrong)
        self.starts.append(starts[~blank] + offset)
        kept_before = np.cumsum(~blank) - ~blank  # non-blank lines of this block before each line
        self.blanks.append(self.items + kept_before[blank])
        self.items += int((~blank).sum())
        self.lines += len(ends)

    def _check(self, data: memoryview, starts: np.ndarray, ends: np.ndarray, wrong: np.ndarray) -> None:
        """Raise for the first line of the block with invalid UTF-8 or the wrong number of columns."""
        bad_utf8 = len(ends)
        try:
            str(data, "utf-8")
        except UnicodeDecodeError as err:
            bad_utf8 = int(np.searchsorted(ends, err.start))
        bad_columns = int(np.argmax(wrong)) if wrong.any() else len(ends)
        if bad_utf8 <= bad_columns and bad_utf8 < len(ends):
            number = self.lines + bad_utf8 + 1
            _raise_utf8(self.path, number, bytes(data[starts[bad_utf8]: ends[bad_utf8]]))
            raise DataFormatError(self.path, number, "invalid UTF-8")
        if bad_columns < len(ends):
            number = self.lines + bad_columns + 1
            text = _decode(bytes(data[starts[bad_columns]: ends[bad_columns]])) or ""
            self.bad_columns(number, text)
            found = text.count("\t") + 1
            raise DataFormatError(self.path, number, f"expected {columns_text(self.tabs)}, found {found}")


def columns_text(tabs: tuple[int, int | None]) -> str:
    low, high = tabs
    if high is None:
        return f"at least {low + 1} tab-separated columns"
    return f"{low + 1} tab-separated columns" if low == high else f"{low + 1} to {high + 1} tab-separated columns"


def scan_lines(path: Path, tabs: tuple[int, int | None],
               bad_columns: BadColumns) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One pass over ``path``: (starts, blanks), int64 arrays block by block (joined only if they must stay in
    memory, so a build holds 8 bytes a line once) -- the byte offset where each non-blank line's text begins, and
    for each blank line the number of non-blank lines before it (what turns an item index into a line number).

    Raises :class:`DataFormatError` for invalid UTF-8, and calls ``bad_columns(line, text)`` (which should raise) for
    a non-blank line whose tab count lies outside ``tabs`` = (least, most or None), whichever comes first.
    """
    scan = _Scan(path, tabs, bad_columns)
    offset, want = 0, _BLOCK
    with open(path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        while offset < size:
            # Each read starts at a line start: the partial line at the end of a block is read again with the next
            # (a few hundred bytes), which is cheaper than joining it to the next block.
            data = os.pread(handle.fileno(), want, offset)
            if not data:  # the file shrank meanwhile (its stamp will not match the next time)
                break
            final = offset + len(data) >= size
            cut = len(data) if final else data.rfind(b"\n") + 1
            if cut == 0:  # no line ends in this block: a line longer than the block
                want *= 2
                continue
            scan.block(memoryview(data)[:cut], offset, final=final)
            offset, want = offset + cut, _BLOCK
    return scan.starts, scan.blanks


def _kind(tabs: tuple[int, int | None]) -> int:
    """The column check as one header number (a cache built for another check is rebuilt)."""
    low, high = tabs
    return low * 1_000_003 + (high + 1 if high is not None else 0)


class LineIndex:
    """The non-blank lines of a text file by index: ``line(i) -> (line number, text)`` (see the module docstring).

    Args:
        path: a plain (not compressed) UTF-8 file.
        tabs: (least, most) tabs a non-blank line must hold (None: no most), checked for every line at build time.
        bad_columns: called with (line number, text) of the first line outside ``tabs``; it should raise the
            reader's own :class:`DataFormatError`.
        cache_dir: where to keep the offsets instead of the default places.
    """

    def __init__(self, path: str | os.PathLike, tabs: tuple[int, int | None] = (0, None),
                 bad_columns: BadColumns | None = None, cache_dir: str | os.PathLike | None = None):
        self.path = Path(path)
        if not self.path.exists():
            raise MissingInputError(f"{self.path}: no such file")
        if not self.path.is_file():
            raise DataFormatError(self.path, None, "not a file")
        if self.path.suffix == ".gz":
            raise DataFormatError(self.path, None, "a compressed file cannot be read by line offsets; decompress it")
        self.tabs = tabs
        self.stamp = FileStamp.of(self.path)
        self.cache = cache_file(self.path, "lines", cache_dir)
        payload = load_cache(self.cache, self.stamp, _kind(tabs))
        if payload is None:
            starts, blanks = scan_lines(self.path, tabs, bad_columns or self._default_bad_columns)
            counts = [sum(piece.size for piece in starts), sum(piece.size for piece in blanks)]
            parts = [np.array(counts, dtype=np.int64), *starts, *blanks]
            if save_cache(self.cache, self.stamp, _kind(tabs), parts):
                payload = load_cache(self.cache, self.stamp, _kind(tabs))
            if payload is None:  # not writable (or replaced meanwhile): keep the arrays of this scan
                self.cache, payload = None, np.concatenate(parts)
        self._attach(payload)
        self._fd: int | None = None
        self._pid = os.getpid()

    def _default_bad_columns(self, number: int, text: str) -> None:
        found = text.count("\t") + 1
        raise DataFormatError(self.path, number, f"expected {columns_text(self.tabs)}, found {found}")

    def _attach(self, payload: np.ndarray) -> None:
        n_items, n_blanks = int(payload[0]), int(payload[1])
        self.starts = payload[2: 2 + n_items]                    # (items,) byte offset of each line's text
        self.blanks = payload[2 + n_items: 2 + n_items + n_blanks]  # (blank lines,) items before each

    def __len__(self) -> int:
        return int(self.starts.shape[0])

    def line_number(self, index: int) -> int:
        """The physical (1-based, blank lines counted) line number of item ``index``."""
        return index + 1 + (int(self.blanks.searchsorted(index, side="right")) if self.blanks.size else 0)

    def _descriptor(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return self._fd

    def raw(self, index: int) -> bytes:
        """The bytes of item ``index``'s line: without BOM and ``\\n``, with any ``\\r`` still there."""
        start = int(self.starts[index])
        stop = int(self.starts[index + 1]) if index + 1 < len(self) else self.stamp.size
        fd, data, position = self._descriptor(), b"", start
        while position < stop:  # one read, unless blank lines lie between this line and the next
            chunk = os.pread(fd, min(stop - position, 1 << 20), position)
            if not chunk:
                break
            end = chunk.find(b"\n")
            if end >= 0:
                return data + chunk[:end]
            data, position = data + chunk, position + len(chunk)
        return data

    def span(self, first: int, stop: int) -> bytes:
        """The file's bytes from item ``first``'s text up to item ``stop``'s (the end of the file when ``stop`` is
        the number of items): many lines in one read."""
        begin = int(self.starts[first])
        end = int(self.starts[stop]) if stop < len(self) else self.stamp.size
        return os.pread(self._descriptor(), end - begin, begin)

    def line(self, index: int) -> tuple[int, str]:
        """(line number, text) of item ``index``: what ``iter_text_lines`` yields for it."""
        raw = self.raw(index)
        text = _decode(raw)
        if text is None:  # the file was validated when indexed: it changed since
            _raise_utf8(self.path, self.line_number(index), raw)
        return self.line_number(index), text

    def check_unchanged(self) -> None:
        """Raise when the file is no longer the one indexed (offsets would point into other lines)."""
        if FileStamp.of(self.path) != self.stamp:
            raise DataFormatError(self.path, None, "changed since its line offsets were taken; start again")

    def __getstate__(self) -> dict:
        state = dict(self.__dict__, _fd=None)
        if self.cache is not None:  # the new process maps the cache file again
            state.update(starts=None, blanks=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.check_unchanged()
        if self.starts is None:
            payload = load_cache(self.cache, self.stamp, _kind(self.tabs))
            if payload is None:
                raise DataFormatError(self.path, None, f"its line-offset cache {self.cache} disappeared or changed")
            self._attach(payload)

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None and self._pid == os.getpid():
            os.close(self._fd)


def sequence_position(index: int, size: int, what: str) -> int:
    """``index`` of a sequence of ``size`` items (negative from the end) as a position in ``[0, size)``; an
    ``IndexError`` naming ``what`` otherwise."""
    index = int(index)
    position = index + size if index < 0 else index
    if not 0 <= position < size:
        raise IndexError(f"{what} {index} of {size}")
    return position
