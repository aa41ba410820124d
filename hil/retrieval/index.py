"""A token index on disk: every document's scored token embeddings (fp16 memmaps) plus search structures per head.

Layout of an index folder ``<dir>``::

    index.json                 settings, counts, fingerprints, search-structure settings ("backend"), provenance,
                               the seconds of each build stage ("build_seconds")
    doc_ids.json               document ids, in corpus order
    doc_offsets.npy            (n_docs + 1,) int64: document i owns tokens [offsets[i], offsets[i+1])
    token_ids.npy              (n_tokens,) int32: the vocabulary id of every stored token (for scores that read
                               them: IDF weights, lexical heads); absent from a compressed-as-encoded index of an
                               encoder whose score reads the vectors alone (``stores_token_ids`` false, as
                               ColBERTv2 stores none: 4 of its ~40 bytes a token)
    <head>.embeddings.npy      (n_tokens, D) float16, one per encoder head, L2-normalized token vectors
    <head>.faiss               the trained FAISS index of an ``ivfflat`` / ``ivfpq`` index
    <head>.centroids.npy       ``plaid``: (C, D) float32 k-means centroids (hil.retrieval.plaid)
    <head>.codes.npy           ``plaid``: (n_tokens,) uint16/int32 nearest centroid of every token
    <head>.ivf_offsets.npy     ``plaid``: (C + 1,) int64 and ``<head>.ivf_docs.npy`` (E,) int32: centroid -> documents
    <head>.residuals.npy       ``plaid`` with ``residual_bits``: (n_tokens, D * bits / 8) uint8 packed residuals
                               (hil.retrieval.codec); with ``keep_embeddings=False`` it replaces the fp16 file

Only tokens that take part in late interaction are stored (the encoder's ``mask``; punctuation and padding are
dropped, as ColBERT does), so scoring a gathered document gives the same number as scoring the encoder's output.
This module reads and checks a finished folder; :mod:`hil.retrieval.builder` writes one, and the search
structures (which files, which settings) belong to the back-ends of :mod:`hil.retrieval.backends`.

Choices:
- An index verifies itself (:mod:`hil.retrieval.integrity`): ``index.json`` records every other file's size and
  SHA-256 under ``"files"`` (:func:`seal_index`); :meth:`TokenIndex.load` checks the sizes always, and the checksums
  when the index is small enough (``verify="auto"``) or when asked (``verify="full"``), before mapping any array.
- A folder is finished when ``index.json`` is in it: builders write everything else first, under
  ``<dir>.tmp-build`` (:func:`unfinished_build_dir`), and rename the folder at the end; every file is written under
  a temporary name and renamed (:func:`save_npy_atomic`), so a reader never sees half a file.
- With ``plaid``'s ``keep_embeddings=False`` a head has no fp16 file: its vectors are read back from the centroid
  codes and residuals (34 bytes per token at 2 bits, D = 128, instead of 256), and :attr:`TokenIndex.embeddings`
  holds a decompressing array-like view (:class:`~hil.retrieval.codec.CompressedEmbeddings`).
- The encoder fingerprint hashes the settings (without the backbone *name*, which is only where the weights came
  from) and every parameter/buffer byte, so the same weights loaded from another folder still match.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from hil.errors import UserError
from hil.modeling.contracts import Encoder
from hil.provenance import atomic_output, fingerprint_strings, write_json_atomic
from hil.retrieval.codec import CompressedEmbeddings, ResidualCodec
from hil.retrieval.integrity import FILES_KEY, IndexIntegrityError, check_files, load_npy, rebuild_hint, record_files
from hil.retrieval.store import TokenStore, TokenTable

INDEX_FORMAT = "hil-token-index"
INDEX_FORMAT_VERSION = 1
INDEX_JSON = "index.json"
DOC_IDS_JSON = "doc_ids.json"
DOC_OFFSETS_NPY = "doc_offsets.npy"
TOKEN_IDS_NPY = "token_ids.npy"
PLAID_FILES = ("centroids", "codes", "ivf_offsets", "ivf_docs", "residuals")
# Search-time settings indexes written before 0.2 kept beside their build-time ones.
LEGACY_SEARCH_PARAMS = ("nprobe", "ndocs", "stage2_docs")


class IndexMismatchError(UserError):
    """An index on disk was built from another corpus or another encoder than the one expected."""


# -- fingerprints -----------------------------------------------------------------------------------------------

def fingerprint_corpus(doc_ids: Sequence[str], texts: Sequence[str]) -> str:
    """Order-sensitive fingerprint of a corpus: every (doc id, text) pair."""
    return fingerprint_strings(item for pair in zip(doc_ids, texts) for item in pair)


def encoder_fingerprint(encoder: Encoder) -> str:
    """SHA-256 of ``encoder.settings()`` (minus the backbone name) and of every parameter and buffer's bytes."""
    settings = {k: v for k, v in encoder.settings().items() if k != "backbone"}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode("utf-8"))
    for name, tensor in sorted(encoder.state_dict().items()):
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{flat.dtype}:{tuple(tensor.shape)}".encode("utf-8"))
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()[:16]


def json_normalized(value: Any) -> Any:
    """What ``value`` becomes after a JSON round trip (tuples -> lists, ...), for comparisons with stored JSON."""
    return json.loads(json.dumps(value, default=str))


# -- files ------------------------------------------------------------------------------------------------------

def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """``np.save`` to a temporary name, then rename: a reader never sees half an array."""
    # Through an open handle: np.save would append ".npy" to the temporary name.
    with atomic_output(path) as tmp, open(tmp, "wb") as handle:
        np.save(handle, array)


def seal_index(directory: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Write ``index.json`` (``meta`` with the size and checksum of every other file of ``directory``): the last
    step of writing an index, once every other file is in place; -> the meta written."""
    meta = {key: value for key, value in meta.items() if key != FILES_KEY}
    meta[FILES_KEY] = record_files(directory, skip=(INDEX_JSON,))
    write_json_atomic(directory / INDEX_JSON, meta)
    return meta


def unfinished_build_dir(directory: Path) -> Path:
    """Where the folder ``directory`` is assembled before it is renamed into place."""
    return directory.with_name(directory.name + ".tmp-build")


def backend_record(meta: dict[str, Any]) -> dict[str, Any]:
    """The back-end part of an index's ``meta``: ``"backend"``, or ``"faiss"`` in an index written before 0.2.
    Its ``params`` are build-time settings only; search-time ones that older indexes stored there (``nprobe``,
    ``ndocs``, ``stage2_docs``) are dropped: searches never read them (:mod:`hil.retrieval.backends.configs`)."""
    record = dict(meta.get("backend") or meta.get("faiss") or {})
    if "params" in record:
        record["params"] = {k: v for k, v in record["params"].items() if k not in LEGACY_SEARCH_PARAMS}
    return record


def embeddings_path(directory: Path, head: str) -> Path:
    return directory / f"{head}.embeddings.npy"


def plaid_paths(directory: Path, head: str) -> dict[str, Path]:
    """The centroid files of ``head`` (see the layout above), by name."""
    return {name: directory / f"{head}.{name}.npy" for name in PLAID_FILES}


def _load_vectors(directory: Path, meta: dict[str, Any], head: str, mode: str | None) -> TokenTable:
    """A head's (n_tokens, D) vectors: the fp16 memmap, or a decompressing view of a compressed-only index."""
    path = embeddings_path(directory, head)
    if path.is_file():
        return load_npy(path, mode)
    codec_settings = backend_record(meta).get("codecs", {}).get(head)
    if codec_settings is None:
        raise FileNotFoundError(f"{path}: missing, and the index stores no compressed vectors for head {head!r}")
    paths = plaid_paths(directory, head)
    codec = ResidualCodec(load_npy(paths["centroids"]), int(codec_settings["nbits"]),
                          np.asarray(codec_settings["cutoffs"], dtype=np.float32),
                          np.asarray(codec_settings["weights"], dtype=np.float32))
    return CompressedEmbeddings(codec, load_npy(paths["codes"], mode), load_npy(paths["residuals"], mode))


def _read_meta(directory: Path) -> dict[str, Any]:
    """``index.json`` of a finished index of this format and version (else a clear error)."""
    meta_path = directory / INDEX_JSON
    if not meta_path.is_file():
        unfinished = unfinished_build_dir(directory)
        hint = f" ({unfinished} holds an unfinished build: rerun build_index to resume it)" \
            if unfinished.exists() else ""
        raise FileNotFoundError(f"{directory}: not a hil token index (no {INDEX_JSON}){hint}")
    try:
        with open(meta_path, encoding="utf-8") as handle:
            meta = json.load(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise IndexIntegrityError(f"{meta_path}: unreadable ({error}); " + rebuild_hint(directory)) from error
    if not isinstance(meta, dict):
        raise IndexIntegrityError(f"{meta_path}: not a JSON object; " + rebuild_hint(directory))
    if meta.get("format") != INDEX_FORMAT or meta.get("format_version") != INDEX_FORMAT_VERSION:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r} version {meta.get('format_version')!r}, "
                         f"expected {INDEX_FORMAT!r} version {INDEX_FORMAT_VERSION}")
    return meta


def _check_fingerprints(directory: Path, meta: dict[str, Any], expected: dict[str, str | None]) -> None:
    """Raise :class:`IndexMismatchError` when the index was built for another corpus or encoder than expected."""
    for what, wanted in expected.items():
        found = meta.get(f"{what}_fingerprint")
        if wanted is not None and found != wanted:
            raise IndexMismatchError(
                f"{directory}: index was built for {what} fingerprint {found}, but {what} fingerprint "
                f"{wanted} was expected; rebuild it (build_index(..., overwrite=True)) or use another folder")


def _inconsistencies(meta: dict[str, Any], doc_ids: list[str], doc_offsets: np.ndarray,
                     embeddings: dict[str, TokenTable], token_ids: np.ndarray | None) -> list[str]:
    """What disagrees between ``index.json``'s counts and the arrays read (empty when all is consistent)."""
    n_tokens = int(meta["n_tokens"])
    problems = []
    if len(doc_ids) != meta["n_docs"] or len(doc_offsets) != meta["n_docs"] + 1:
        problems.append(f"{len(doc_ids)} doc ids / {len(doc_offsets)} offsets for n_docs={meta['n_docs']}")
    n_ids = n_tokens if token_ids is None else len(token_ids)
    if int(doc_offsets[-1]) != n_tokens or n_ids != n_tokens:
        problems.append(f"offsets end at {int(doc_offsets[-1])}, {n_ids} token ids, n_tokens={n_tokens}")
    problems += [f"{head}.embeddings.npy has shape {array.shape}" for head, array in embeddings.items()
                 if array.shape != (n_tokens, meta["dims"][head])]
    return problems


class TokenIndex(TokenStore):
    """A finished index folder, its arrays memory-mapped (see the module docstring for the layout)."""

    def __init__(self, directory: Path, meta: dict[str, Any], doc_ids: list[str], doc_offsets: np.ndarray,
                 embeddings: dict[str, TokenTable], token_ids: np.ndarray | None):
        super().__init__(doc_ids, doc_offsets, embeddings, token_ids)
        self.directory = directory
        self.meta = meta
        # What was checked when it was opened: "full" (sizes and checksums), "sizes", or "none" (an index written
        # before files were recorded).
        self.verified = "none"
        # How :func:`~hil.retrieval.builder.open_or_build_index` got it ("built", "reused", ...): what a command
        # announces.
        self.how_opened = "opened"
        # Search structures a back-end loaded on first use (FAISS indexes, centroid plans), by the back-end's own
        # keys: they live as long as this opened index, so repeated searches do not load them again.
        self.search_structures: dict[tuple[Any, ...], Any] = {}

    @property
    def settings(self) -> dict[str, Any]:
        """The encoder settings the index was built with."""
        return self.meta["settings"]

    @property
    def corpus_fingerprint(self) -> str:
        return self.meta["corpus_fingerprint"]

    @property
    def encoder_fingerprint(self) -> str:
        return self.meta["encoder_fingerprint"]

    @property
    def backend_settings(self) -> dict[str, Any]:
        """The search structures' build-time settings: ``kind`` (the back-end), resolved ``params``, ``factory``,
        ``codecs`` (:func:`backend_record`)."""
        return backend_record(self.meta)

    faiss_settings = backend_settings  # the name before 0.2

    @property
    def compressed_only(self) -> bool:
        """True when the index keeps residual-compressed vectors only (no fp16 rows)."""
        return any(isinstance(array, CompressedEmbeddings) for array in self.embeddings.values())

    @property
    def memory_mapped(self) -> bool:
        """Whether the vectors are read from disk on demand (memmaps or compressed views) rather than held."""
        first = next(iter(self.embeddings.values()))
        return isinstance(first, (np.memmap, CompressedEmbeddings))

    def bytes_per_token(self) -> int:
        """Stored vector bytes per token, all heads together: the fp16 rows, or for a compressed-only index the
        centroid code plus the packed residual (token ids, FAISS / centroid structures not counted)."""
        total = 0
        for array in self.embeddings.values():
            if isinstance(array, CompressedEmbeddings):
                total += int(array.codes.dtype.itemsize + array.codec.packed_bytes)
            else:
                total += int(array.shape[1] * array.dtype.itemsize)
        return total

    def disk_bytes(self) -> int:
        """Bytes of every file in the index folder (vectors, ids, offsets, FAISS / centroid files, JSON)."""
        return int(sum(path.stat().st_size for path in self.directory.iterdir() if path.is_file()))

    def require_head(self, head: str) -> None:
        if head not in self.embeddings:
            raise KeyError(f"{self.directory}: no head {head!r} (heads: {list(self.embeddings)})")

    @classmethod
    def load(cls, directory: str | os.PathLike, expect_corpus_fingerprint: str | None = None,
             expect_encoder_fingerprint: str | None = None, mmap: bool = True, verify: str = "auto") -> "TokenIndex":
        """Open an index folder; refuse it when it was built from another corpus or encoder than expected, or when
        its files differ from what ``index.json`` recorded (:class:`IndexIntegrityError`).

        ``verify``: ``"sizes"`` checks every recorded file's size, ``"full"`` also its checksum, ``"auto"`` the
        checksums of an index of at most :data:`hil.retrieval.integrity.FULL_CHECK_MAX_BYTES` (1 GiB) and the sizes
        of a larger one; all before any array is mapped (:func:`hil.retrieval.integrity.check_files`).
        """
        directory = Path(directory)
        meta = _read_meta(directory)
        _check_fingerprints(directory, meta, {"corpus": expect_corpus_fingerprint,
                                              "encoder": expect_encoder_fingerprint})
        verified = check_files(directory, meta, verify)
        mode = "r" if mmap else None
        try:
            with open(directory / DOC_IDS_JSON, encoding="utf-8") as handle:
                doc_ids = json.load(handle)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise IndexIntegrityError(f"{directory / DOC_IDS_JSON}: unreadable ({error}); "
                                      + rebuild_hint(directory)) from error
        doc_offsets = load_npy(directory / DOC_OFFSETS_NPY)
        embeddings = {head: _load_vectors(directory, meta, head, mode) for head in meta["heads"]}
        token_ids = load_npy(directory / TOKEN_IDS_NPY, mode) if meta.get("stores_token_ids", True) else None
        problems = _inconsistencies(meta, doc_ids, doc_offsets, embeddings, token_ids)
        if problems:
            raise IndexIntegrityError(f"{directory}: inconsistent index files: " + "; ".join(problems) + "; "
                                      + rebuild_hint(directory))
        index = cls(directory, meta, doc_ids, doc_offsets, embeddings, token_ids)
        index.verified = verified
        return index
