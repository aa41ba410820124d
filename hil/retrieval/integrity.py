"""Indexes that verify themselves, and numbers that cannot come out NaN unnoticed.

**Files.** When an index folder is finished, :func:`record_files` records the size and SHA-256
(:func:`hil.provenance.file_digest`) of every file in it but ``index.json`` (vectors, ids, offsets, token ids,
FAISS files, PLAID centroids / codes / residuals, fitted transforms) under ``"files"`` in ``index.json``.
Opening an index (:func:`check_files`, called by :meth:`hil.retrieval.index.TokenIndex.load` before any array is
memory-mapped) checks, by ``verify``:

- ``"sizes"``: every recorded file exists and has its recorded size (a few ``stat`` calls: always done);
- ``"full"``: also every checksum (reads every byte: about 1 s per GiB on this project's machine, warm cache);
- ``"auto"`` (the default): ``"full"`` when the recorded files total at most :data:`FULL_CHECK_MAX_BYTES`
  (1 GiB: a BEIR-sized index of a 128-dimensional ColBERT, verified in about a second), else ``"sizes"``.

Every ``.npy`` is also checked against its own header (the bytes its shape and dtype need) before it is mapped,
so even an index without records reports a truncated array as damaged instead of numpy's "mmap length is
greater than file size". A difference raises :class:`IndexIntegrityError` naming the file, what differs and how
to rebuild. An index written before the records existed opens with a warning that it cannot be verified
(:func:`hil.retrieval.builder.open_or_build_index` rebuilds it instead).

**Numbers.** A NaN or infinite score is never ranked: search raises :class:`NonFiniteError` naming the queries
and the likely cause (:func:`check_finite_scores`); query vectors (:func:`check_finite_queries`) and document
vectors (when a chunk is written, and when FAISS reads an index's vectors: :func:`check_finite_vectors`) are
checked where they are made or read, so the error says whether the model or the stored index is at fault.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from hil.errors import UserError
from hil.modeling.contracts import EncodedBatch
from hil.provenance import DIGEST, file_digest
from hil.retrieval.choices import check_verify  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

# "auto" reads every byte of an index up to this size (about a second here: sha256 at 650-1100 MiB/s).
FULL_CHECK_MAX_BYTES = 1 << 30
FILES_KEY = "files"
_EXAMPLES = 5  # query ids named in an error


class IndexIntegrityError(UserError):
    """An index file is missing, truncated or altered since the index was written (or unreadable)."""


class NonFiniteError(UserError):
    """A score or a vector came out NaN or infinite: a damaged index or a model producing NaN, never a ranking."""


def rebuild_hint(directory: Path) -> str:
    return (f"rebuild it: delete {directory} and run again (evaluate.py and open_or_build_index rebuild a missing "
            "index), or call build_index(..., overwrite=True)")


# -- recording and checking files -------------------------------------------------------------------------------

def record_files(directory: Path, skip: Sequence[str] = ("index.json",)) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": size, "sha256": digest}}`` of every file of ``directory`` but ``skip`` and hidden ones
    (temporary files of a writer), in name order."""
    records = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name not in skip and not path.name.startswith("."):
            records[path.name] = {"bytes": path.stat().st_size, DIGEST: file_digest(path)}
    return records


def check_files(directory: Path, meta: dict[str, Any], verify: str = "auto") -> str:
    """Check the files ``meta`` records against the disk (module docstring); -> what was checked: ``"full"``,
    ``"sizes"``, or ``"none"`` for an index without records (a warning says it cannot be verified)."""
    check_verify(verify)
    records = meta.get(FILES_KEY)
    if records is None:
        logger.warning("%s: written before hil recorded file sizes and checksums, so it cannot be verified; "
                       "rebuild it to get them", directory)
        return "none"
    for name, record in records.items():
        path = directory / name
        if not path.is_file():
            raise IndexIntegrityError(f"{path}: missing (recorded in {directory / 'index.json'}); "
                                      + rebuild_hint(directory))
        size = path.stat().st_size
        if size != record["bytes"]:
            raise IndexIntegrityError(f"{path}: {size} bytes on disk, {record['bytes']} recorded when the index was "
                                      f"written (truncated or replaced); " + rebuild_hint(directory))
    total = sum(int(record["bytes"]) for record in records.values())
    if verify == "sizes" or (verify == "auto" and total > FULL_CHECK_MAX_BYTES):
        return "sizes"
    for name, record in records.items():
        if file_digest(directory / name) != record[DIGEST]:
            raise IndexIntegrityError(f"{directory / name}: {DIGEST} checksum differs from the one recorded when "
                                      f"the index was written (same size: its bytes were altered); "
                                      + rebuild_hint(directory))
    return "full"


def load_npy(path: Path, mmap_mode: str | None = None) -> np.ndarray:
    """``np.load`` after checking that the file holds the bytes its header promises (so a truncated array is an
    :class:`IndexIntegrityError`, not numpy's "mmap length is greater than file size")."""
    try:
        with open(path, "rb") as handle:
            version = np.lib.format.read_magic(handle)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read_header(handle)
            header_bytes = handle.tell()
    except (ValueError, EOFError, SyntaxError) as error:
        raise IndexIntegrityError(f"{path}: not a readable .npy file ({error}); "
                                  + rebuild_hint(path.parent)) from error
    needed = header_bytes + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    size = os.path.getsize(path)
    if size < needed:
        raise IndexIntegrityError(f"{path}: {size} bytes on disk, its header ({shape} {dtype}) needs {needed} "
                                  "(truncated); " + rebuild_hint(path.parent))
    return np.load(path, mmap_mode=mmap_mode)


# -- finite numbers ---------------------------------------------------------------------------------------------

def _some(qids: Sequence[str]) -> str:
    more = f", ... ({len(qids)} in all)" if len(qids) > _EXAMPLES else ""
    return ", ".join(repr(q) for q in qids[:_EXAMPLES]) + more


def check_finite_queries(queries: EncodedBatch, qids: Sequence[str], model: str) -> None:
    """Refuse query vectors with a NaN or inf at a scored position (the model's output, before any search)."""
    bad = torch.zeros(len(qids), dtype=torch.bool, device=queries.mask.device)
    for vectors in queries.heads.values():  # (B, Lq, D)
        bad |= (~torch.isfinite(vectors).all(dim=-1) & queries.mask.bool()).any(dim=1)
    if bad.any():
        named = [qid for qid, flag in zip(qids, bad.tolist()) if flag]
        raise NonFiniteError(f"{model} encoded {len(named)} queries to non-finite vectors (NaN or inf), e.g. "
                             f"{_some(named)}: the model produces NaN (damaged weights, or an unstable precision "
                             "such as fp16 without autocast); no ranking is made from them")


def non_finite_scores(qids: Sequence[str], where: str) -> NonFiniteError:
    """The error for queries ``qids`` whose scores against ``where`` hold a NaN or inf. Query vectors are checked
    before scoring, so the documents are at fault: stored vectors (damaged), or the model's scoring."""
    return NonFiniteError(f"non-finite scores (NaN or inf) for {len(qids)} queries, e.g. {_some(qids)}, against "
                          f"{where}: its document vectors are damaged (open the index with verify='full' to check its "
                          "files, or rebuild it) or the model's scoring produces NaN; no ranking is made from them")


def check_finite_scores(scores: np.ndarray, qids: Sequence[str], where: str) -> None:
    """Refuse (Q, C) scores (rows: ``qids``) holding a NaN or inf (:func:`non_finite_scores`)."""
    finite = np.isfinite(scores).reshape(len(qids), -1).all(axis=1)
    if not finite.all():
        raise non_finite_scores([qid for qid, ok in zip(qids, finite.tolist()) if not ok], where)


_FINITE_BLOCK = 1 << 20


def _all_finite(vectors: np.ndarray) -> bool:
    """Whether every value of ``vectors`` is finite. fp16 (what indexes store) is tested on its bits, three times
    faster than ``np.isfinite`` (numpy has no native half precision): a NaN or inf is an all-ones exponent."""
    if vectors.dtype == np.float16:
        bits = vectors.reshape(-1).view(np.uint16)
        # In blocks of 2^20 values: small temporaries, reused, instead of two table-sized ones (measured 10x slower
        # in an index build, where the allocator hands fresh pages to each).
        return not any(np.any((bits[start: start + _FINITE_BLOCK] & 0x7C00) == 0x7C00)
                       for start in range(0, len(bits), _FINITE_BLOCK))
    return bool(np.isfinite(vectors).all())


def check_finite_vectors(vectors: np.ndarray, what: str, advice: str, first_row: int = 0) -> None:
    """Refuse a block of (N, D) vectors (rows ``first_row`` onwards of ``what``) holding a NaN or inf; ``advice``
    says what is at fault and what to do."""
    if _all_finite(vectors):
        return
    finite = np.isfinite(vectors).all(axis=tuple(range(1, vectors.ndim)))
    if not finite.all():
        rows = first_row + np.flatnonzero(~finite)
        raise NonFiniteError(f"{what}: {len(rows)} non-finite vectors (NaN or inf), first at row {int(rows[0])}; "
                             + advice)
