"""Building a token index: encode the corpus (resumably), write its search structures, reuse what still matches.

Building never leaves a half index behind: everything is written into ``<dir>.tmp-build`` (the corpus encoded in
chunks there first: :mod:`hil.retrieval.chunks`), ``index.json`` last (with every other file's size and checksum:
:func:`~hil.retrieval.index.seal_index`), and the folder is renamed to ``<dir>`` only when complete. A process
killed at any point (SIGKILL included) leaves ``<dir>`` as it was; the rerun reuses the finished chunks and writes
the same index as an uninterrupted build. The search structures (FAISS files, PLAID centroids) are written by the
back-end of the chosen ``backend`` (an :class:`~hil.retrieval.backends.configs.IndexConfig`, or a kind name with its
defaults: :mod:`hil.retrieval.backends`); changing only them rewrites them in place
(:func:`rebuild_search_structures`) without encoding the corpus again. Search-time settings are not part of an
index: they are given to each search. The corpus is encoded on the encoder's device, in one
process or several (:mod:`hil.retrieval.corpus_encoding`), in the precision asked (recorded; an index encoded in
another precision is rebuilt by :func:`open_or_build_index`).

One writer at a time: :func:`build_index`, :func:`rebuild_faiss` and :func:`open_or_build_index` hold the lock file
``<dir>.lock`` (:func:`hil.provenance.file_lock`; the kernel releases it when its holder dies). A second process
building the same index waits, with one log line naming the holder, then finds the finished index
(:func:`open_or_build_index` opens it; :func:`build_index` refuses it without ``overwrite``).

:func:`open_or_build_index` treats its folder as a cache: an index found damaged
(:class:`~hil.retrieval.integrity.IndexIntegrityError`) or written before indexes recorded their files' checksums
is rebuilt, with a warning that says why; :meth:`~hil.retrieval.index.TokenIndex.load` refuses a damaged index.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from hil.modeling.contracts import Encoder
from hil.provenance import StageClock, file_lock, lock_path, provenance, replace_directory, write_json_atomic
from hil.retrieval.backends.configs import IndexConfig, configs_from_params, index_config
from hil.retrieval.backends.registry import BACKENDS, backend_class
from hil.retrieval.chunks import collect_chunks, encoding_batch_sizes, join_chunks, kill_if_asked
from hil.retrieval.codec import CompressedEmbeddings
from hil.retrieval.corpus_encoding import (CorpusEncoding, check_processes, check_tokenizer_workers,
                                          encode_corpus)
from hil.retrieval.devices import check_precision
from hil.retrieval.fast_encode import DOCUMENT_ENCODINGS, document_encoding_key
from hil.retrieval.index import (DOC_IDS_JSON, INDEX_FORMAT, INDEX_FORMAT_VERSION, INDEX_JSON, IndexMismatchError,
                                 TokenIndex, embeddings_path, encoder_fingerprint, fingerprint_corpus,
                                 json_normalized, plaid_paths, seal_index, unfinished_build_dir)
from hil.errors import UserError
from hil.retrieval.integrity import IndexIntegrityError, check_verify
from hil.retrieval.store import TokenTable

logger = logging.getLogger(__name__)

CALIBRATION_DOCS = 32  # documents whose activations calibrate int8 document encoding
# Documents per encoder batch when none is given: 32 on a CPU (what every index was built with before), more on a
# GPU, whose time per batch is mostly fixed cost below a few thousand tokens (launches, the sync-free pipeline).
DEFAULT_BATCH_SIZE = {"cpu": 32, "cuda": 128}
CHUNKS_DIR = "chunks"
AUTOCAST_ENCODINGS = (None, "compile")  # document encodings that run PyTorch's own kernels, where autocast applies
_HEAD_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")


# -- search structures ------------------------------------------------------------------------------------------

def backend_from(backend: str | IndexConfig = "flat", faiss_kind: str | None = None,
                 faiss_params: dict[str, Any] | None = None) -> IndexConfig:
    """The build-time settings asked for: ``backend`` (a config, or a kind with its defaults), or, in the spelling
    before 0.2, ``faiss_kind`` and ``faiss_params`` (with a deprecation notice). Search-time keys in
    ``faiss_params`` (``nprobe``, ``ndocs``, ...) are refused: an index no longer holds them, so a search would not
    use them; give them to the search."""
    if faiss_kind is None and faiss_params is None:
        return index_config(backend)
    warnings.warn("faiss_kind / faiss_params are deprecated: pass backend=<kind or IndexConfig> "
                  "(hil.retrieval.backends.configs)", DeprecationWarning, stacklevel=3)
    kind = faiss_kind or (backend.kind if isinstance(backend, IndexConfig) else backend)
    build, search = configs_from_params(kind, faiss_params)
    misplaced = sorted(set(faiss_params or {}) - type(build).field_names())
    if misplaced:
        raise UserError(f"{misplaced} are search-time settings, not part of an index: give them to the search "
                        f"({type(search).__name__}), not to the index build")
    return build


def _remove_stale_files(directory: Path, head: str, kept: set[Path]) -> None:
    """Remove the files every other kind may have left for ``head`` (an earlier build of another kind)."""
    for backend in BACKENDS.values():
        for path in backend.head_files(directory, head):
            if path not in kept:
                path.unlink(missing_ok=True)


def write_search_files(directory: Path, embeddings: dict[str, TokenTable], config: IndexConfig, use_gpu: bool,
                       progress: bool, gpu_device: int = 0, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Write the files of ``config``'s back-end for every head; -> the ``"backend"`` part of ``index.json``.

    ``device``: where the build's torch work may run (the encoder's device: PLAID's k-means there on a GPU); the
    choices that depend on it are recorded as made (:meth:`SearchBackend.resolve_machine_params`). Files of another
    kind left from an earlier build are removed, except, for a head stored compressed only, the centroid files:
    they hold its vectors.
    """
    kind = config.kind
    backend = backend_class(kind)
    device = torch.device(device)
    resolved: dict[str, Any] = {}
    codecs: dict[str, Any] = {}
    for head, vectors in embeddings.items():
        resolved = backend.resolve_machine_params(backend.resolve_params(config, vectors.shape[0], vectors.shape[1]),
                                                  device=device, use_gpu=use_gpu, gpu_device=gpu_device)
        started = time.perf_counter()
        codec = backend.build_head(directory, head, vectors, resolved, use_gpu=use_gpu, gpu_device=gpu_device,
                                   device=device)
        kept = set(backend.head_files(directory, head))
        if isinstance(vectors, CompressedEmbeddings):
            codec = vectors.codec
            kept |= set(plaid_paths(directory, head).values())
        if codec is not None:
            codecs[head] = codec.settings()
        _remove_stale_files(directory, head, kept)
        if progress and backend.stores_files:
            logger.info("%s structures of head %s: %.1f s", kind, head, time.perf_counter() - started)
    settings = {"kind": kind, "params": resolved, "factory": backend.factory(resolved),
                "metric": "inner_product", "stored": backend.stores_files}
    if codecs:
        settings["codecs"] = codecs
    return settings


def rebuild_search_structures(index: TokenIndex, backend: str | IndexConfig, *, use_gpu: bool = False,
                              progress: bool = True, gpu_device: int = 0,
                              device: torch.device | str = "cpu") -> TokenIndex:
    """Replace the search structures of a finished index (the vectors stay), updating ``index.json`` and its file
    records; ``device`` as :func:`write_search_files`'s. In place, under the index's lock: a process killed meanwhile
    leaves files that disagree with ``index.json``, which the next open reports (and :func:`open_or_build_index`
    rebuilds)."""
    with file_lock(lock_path(index.directory), what="rebuilding its search structures"):
        seconds = StageClock()
        settings = write_search_files(index.directory, index.embeddings, index_config(backend), use_gpu, progress,
                                      gpu_device, device)
        seconds.stage("search_structures")
        meta = {key: value for key, value in index.meta.items() if key != "faiss"}
        # The encoding's and join's seconds belong to the earlier build: only what this one did is recorded.
        seal_index(index.directory, dict(meta, backend=settings, build_seconds=seconds.stages))
        # The checksums were just computed from these very files: the sizes say they are the ones recorded.
        return TokenIndex.load(index.directory, mmap=index.memory_mapped, verify="sizes")


def rebuild_faiss(index: TokenIndex, faiss_kind: str, faiss_params: dict[str, Any] | None = None,
                  **kwargs: Any) -> TokenIndex:
    """:func:`rebuild_search_structures` in the spelling before 0.2 (deprecated)."""
    return rebuild_search_structures(index, backend_from(faiss_kind=faiss_kind, faiss_params=faiss_params or {}),
                                     **kwargs)


# -- building ---------------------------------------------------------------------------------------------------

def _check_corpus(doc_ids: Sequence[str], texts: Sequence[str]) -> None:
    if len(doc_ids) != len(texts):
        raise ValueError(f"build_index: {len(doc_ids)} doc_ids but {len(texts)} texts")
    if not doc_ids:
        raise ValueError("build_index: the corpus is empty")
    if len(set(doc_ids)) != len(doc_ids):
        seen: set[str] = set()
        duplicates = [d for d in doc_ids if d in seen or seen.add(d)][:5]
        raise ValueError(f"build_index: duplicate document ids, e.g. {duplicates}")
    bad = [i for i, text in enumerate(texts) if not isinstance(text, str)][:5]
    if bad:
        raise TypeError(f"build_index: texts must be strings; positions {bad} are not")


def _check_request(heads: Sequence[str], batch_size: int, chunk_docs: int, config: IndexConfig) -> None:
    """Refuse a build that cannot succeed, before any work is done."""
    if batch_size < 1 or chunk_docs < 1:
        raise ValueError(f"batch_size and chunk_docs must be >= 1 (got {batch_size}, {chunk_docs})")
    for head in heads:
        if not _HEAD_NAME.match(head):
            raise ValueError(f"head name {head!r} cannot be a file name part (letters, digits, _ and - only)")
    backend_class(config.kind).check_config(config)


def _check_target(directory: Path, overwrite: bool) -> None:
    """Refuse a build that would destroy something (checked under the index's lock: another process may just
    have finished the same index)."""
    if directory.exists() and not overwrite:
        raise FileExistsError(f"{directory} exists; pass overwrite=True to replace it, or use open_or_build_index")
    if directory.exists() and not (directory / INDEX_JSON).is_file() and any(directory.iterdir()):
        raise FileExistsError(f"{directory} exists and is not a hil token index (no {INDEX_JSON}): "
                              "refusing to overwrite it")


def _check_encoding(device: torch.device, processes: int, precision: str, quantize: str | None) -> None:
    """Refuse a precision, process count or precision/quantize pair that cannot run, before any work is done."""
    if quantize is not None and quantize not in DOCUMENT_ENCODINGS:
        raise ValueError(f"quantize must be one of {DOCUMENT_ENCODINGS} (or None), got {quantize!r}")
    check_precision(precision, device)
    check_processes(processes, device)
    if precision != "fp32" and quantize not in AUTOCAST_ENCODINGS:
        raise ValueError(f"precision={precision!r} is autocast of the PyTorch encoder; quantize={quantize!r} has "
                         "arithmetic of its own: pass precision='fp32' with it")


def _calibration_texts(texts: Sequence[str], calibration_docs: int) -> list[str]:
    """The documents a calibrated document encoding (``int8``, ``onnx-int8``) measures its activations on."""
    return list(texts[:max(1, calibration_docs)])


def _start_build_dir(directory: Path) -> Path:
    """``<dir>.tmp-build`` with its ``chunks`` folder; files of an earlier, different attempt are removed, finished
    chunks kept (they are reused when they match)."""
    build = unfinished_build_dir(directory)
    (build / CHUNKS_DIR).mkdir(parents=True, exist_ok=True)
    for leftover in build.iterdir():
        if leftover.name != CHUNKS_DIR:
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    return build


def build_index(encoder: Encoder, doc_ids: Sequence[str], texts: Sequence[str], directory: str | os.PathLike, *,
                batch_size: int | None = None, chunk_docs: int = 2048, backend: str | IndexConfig = "flat",
                corpus_fingerprint: str | None = None, progress: bool = True, overwrite: bool = False,
                use_gpu: bool = False, gpu_device: int = 0, quantize: str | None = None,
                calibration_docs: int = CALIBRATION_DOCS, processes: int = 1, precision: str = "fp32",
                tokenizer_workers: int = 0, faiss_kind: str | None = None,
                faiss_params: dict[str, Any] | None = None) -> TokenIndex:
    """Encode a corpus into a token index at ``directory`` (resumable, finalized atomically; see module docstring).

    ``backend``: the search structures' build-time settings (an :class:`~hil.retrieval.backends.configs.IndexConfig`,
    or a kind name with its defaults; ``faiss_kind`` / ``faiss_params`` are the deprecated spelling).
    ``corpus_fingerprint`` defaults to :func:`fingerprint_corpus` of the ids and texts. ``use_gpu`` trains/fills
    IVF indexes with faiss-gpu (on ``gpu_device``); PLAID's k-means and codes run where
    ``PlaidIndexConfig.kmeans`` says (default ``auto``: faiss-gpu where it sees the GPU, else torch on a GPU
    encoder's device or on ``gpu_device`` with ``use_gpu``, else FAISS on the CPU; recorded as run).
    ``batch_size``: documents per encoder batch (default :data:`DEFAULT_BATCH_SIZE` for the encoder's device kind;
    recorded in ``index.json`` as ``encoding_batch_size``, from the chunks: :func:`~hil.retrieval.chunks.
    encoding_batch_sizes`).

    Where: the corpus is encoded on ``encoder.device`` (move the encoder there first). ``processes`` > 1 encodes
    on that many processes through Lightning Fabric (``ddp_spawn``): one per GPU (``cuda:0`` ..) for a CUDA
    encoder, or that many CPU processes sharing the cores; the index is the same as a one-process build's
    (:mod:`hil.retrieval.corpus_encoding`). ``precision`` (``fp32``, ``fp16`` on a GPU, ``bf16``) is autocast
    over the encoder's forward pass (:func:`hil.retrieval.devices.autocast`); stored vectors are fp16 either way;
    recorded in ``index.json`` as ``encoding_precision``. ``tokenizer_workers`` > 0 tokenizes the chunks in that
    many DataLoader processes (per encoding process) ahead of the encoder, which then only runs the model (for a
    GPU: :mod:`hil.retrieval.token_loader`); the index is the same for any number.

    Memory: at most one chunk of ``chunk_docs`` documents is held while encoding (its fp32 token vectors, about
    ``chunk_docs * 4 * D * tokens_per_doc`` bytes, plus the model's activations for one ``batch_size`` batch);
    the chunks are then streamed into the final memmaps, so ``chunk_docs`` is the memory knob for corpora larger
    than RAM (``bench/README.md`` has measured peak RSS against it). With ``processes`` > 1, per process.

    ``quantize`` picks a cheaper document encoder (queries always keep ``encoder``); recorded in ``index.json`` as
    ``document_encoding``; None (default) encodes with ``encoder`` itself. Measured in bench/README:
    ``"onnx-int8"`` (:mod:`hil.retrieval.onnx_encode`: ONNX Runtime, fused layers, int8 matrix products) is the
    fast one on a CPU, at a small measured cost in nDCG@10; ``"onnx"`` is the same runtime in fp32 (same vectors);
    ``"int8"`` is PyTorch SmoothQuant + dynamic int8 (:mod:`hil.retrieval.fast_encode`, calibrated on the first
    ``calibration_docs`` texts); ``"compile"`` is ``torch.compile`` in fp32 (same vectors). With ``processes`` > 1
    each process builds the same view from its copy of ``encoder``. Only ``None`` and ``"compile"`` take a
    ``precision`` other than fp32.
    """
    _check_corpus(doc_ids, texts)
    directory = Path(directory)
    heads = tuple(encoder.head_names)
    config = backend_from(backend, faiss_kind, faiss_params)
    device = torch.device(encoder.device)
    batch_size = batch_size if batch_size is not None else DEFAULT_BATCH_SIZE.get(device.type, 32)
    _check_request(heads, batch_size, chunk_docs, config)
    _check_encoding(device, processes, precision, quantize)
    check_tokenizer_workers(tokenizer_workers)
    corpus_fp = corpus_fingerprint or fingerprint_corpus(doc_ids, texts)
    encoder_fp = encoder_fingerprint(encoder)
    settings = json_normalized(encoder.settings())
    with file_lock(lock_path(directory), what=f"building {directory.name}"):
        _check_target(directory, overwrite)
        build = _start_build_dir(directory)
        job = CorpusEncoding(encoder, texts, build / CHUNKS_DIR,
                             identity={"settings": settings, "encoder_fingerprint": encoder_fp,
                                       "corpus_fingerprint": corpus_fp, "encoding_precision": precision},
                             chunk_docs=chunk_docs, batch_size=batch_size, quantize=quantize,
                             calibration_texts=_calibration_texts(texts, calibration_docs), precision=precision,
                             progress=progress, description=f"encoding {directory}",
                             tokenizer_workers=tokenizer_workers)
        # index.json's build_seconds: "encode" is tokenizing and encoding the chunks (chunks a resumed build reused
        # cost nothing), "join" the chunks into the arrays, "search_structures" the back-end's files (PLAID: k-means,
        # codes, inverted file). Each stage ends with a host read of its results: on a GPU the time is its own.
        seconds = StageClock()
        identity = encode_corpus(job, processes)
        seconds.stage("encode")
        metas = collect_chunks(build / CHUNKS_DIR, len(texts), chunk_docs, heads, identity)
        n_tokens = join_chunks(build / CHUNKS_DIR, build, heads, metas)
        write_json_atomic(build / DOC_IDS_JSON, list(doc_ids))
        seconds.stage("join")
        kill_if_asked("joined")

        embeddings = {head: np.load(embeddings_path(build, head), mmap_mode="r") for head in heads}
        backend_settings = write_search_files(build, embeddings, config, use_gpu, progress, gpu_device, device)
        seconds.stage("search_structures")
        del embeddings
        shutil.rmtree(build / CHUNKS_DIR)
        dims = metas[0]["dims"]
        document_encoding = identity["document_encoding"]
        meta = provenance(settings, format=INDEX_FORMAT, format_version=INDEX_FORMAT_VERSION, n_docs=len(doc_ids),
                          n_tokens=n_tokens, heads=list(heads), dims=dims,
                          dim=next(iter(dims.values())) if len(set(dims.values())) == 1 else None,
                          embedding_dtype="float16", backend=backend_settings, corpus_fingerprint=corpus_fp,
                          encoder_fingerprint=encoder_fp, encoding_precision=precision,
                          encoding_batch_size=encoding_batch_sizes(metas),
                          encoded_on={"device": str(device) if processes == 1 else device.type,
                                      "processes": processes},
                          build_seconds=seconds.stages,
                          **({"document_encoding": document_encoding} if document_encoding else {}))
        seal_index(build, meta)  # last: its presence marks the folder a finished index
        kill_if_asked("sealed")
        replace_directory(build, directory)
        # The checksums were just computed from these very files: the sizes say they are the ones recorded.
        return TokenIndex.load(directory, verify="sizes")


# -- reuse ------------------------------------------------------------------------------------------------------

def _same_document_encoding(index: TokenIndex, quantize: str | None, n_calibration: int) -> bool:
    wanted = document_encoding_key(quantize, n_calibration)
    recorded = index.meta.get("document_encoding") or {}
    return bool(recorded) == bool(wanted) and all(recorded.get(key) == value for key, value in wanted.items())


def same_search_structures(index: TokenIndex, config: IndexConfig) -> bool:
    """Whether the stored structures are what ``config`` would build (resolved values compared; search-time
    settings are not part of an index); raises on settings that do not fit this index. A wanted value ``auto``
    (PLAID's ``kmeans``) is a choice left to the building machine: any recorded choice satisfies it, so an index
    moved to a machine where ``auto`` would choose otherwise is reused, not rebuilt."""
    backend = backend_class(config.kind)
    wanted = [backend.resolve_params(config, index.n_tokens, dim) for dim in index.dims.values()]
    stored = index.backend_settings
    return stored["kind"] == config.kind and all(_same_build_params(params, stored["params"]) for params in wanted)


def _same_build_params(wanted: dict[str, Any], stored: dict[str, Any]) -> bool:
    """``wanted`` == ``stored``, but for keys whose wanted value is ``auto``: those match any stored value, or none
    (an index from before the setting existed)."""
    machine = {key for key, value in wanted.items() if value == "auto"}
    return ({key: value for key, value in wanted.items() if key not in machine}
            == {key: value for key, value in stored.items() if key not in machine})


def _open_matching(directory: Path, corpus_fp: str, encoder: Encoder, verify: str) -> TokenIndex | None:
    """The index at ``directory`` when it was built from this corpus and encoder and is intact, else None (with a
    warning saying why it is rebuilt)."""
    if not (directory / INDEX_JSON).is_file():
        return None
    try:
        index = TokenIndex.load(directory, expect_corpus_fingerprint=corpus_fp,
                                expect_encoder_fingerprint=encoder_fingerprint(encoder), verify=verify)
    except IndexMismatchError as error:
        logger.warning("%s; rebuilding it", error)
        return None
    except IndexIntegrityError as error:
        logger.warning("damaged index, rebuilding it: %s", error)
        return None
    if index.verified == "none":
        # A cache that cannot say whether it is intact is not trusted: one rebuild records its files.
        logger.warning("%s: rebuilding it so that it records its files' sizes and checksums", directory)
        return None
    return index


def open_or_build_index(encoder: Encoder, doc_ids: Sequence[str], texts: Sequence[str],
                        directory: str | os.PathLike, *, corpus_fingerprint: str | None = None,
                        backend: str | IndexConfig = "flat", use_gpu: bool = False, verify: str = "auto",
                        faiss_kind: str | None = None, faiss_params: dict[str, Any] | None = None,
                        **build_kwargs: Any) -> TokenIndex:
    """Reuse the index at ``directory`` when it matches this corpus, encoder, document encoding and precision, else
    (re)build it; ``build_kwargs`` are :func:`build_index`'s (``processes``, ``precision``, ``quantize``, ...).

    ``verify`` is how much of a found index is checked (:meth:`TokenIndex.load`); a damaged index, or one written
    before indexes recorded their files, is rebuilt with a warning. Under the index's lock: a second process asking
    for the same index waits for the first, then reuses what it built.

    ``backend`` is compared with the build-time settings the index recorded (search-time settings are not part of
    it); when only the search structures differ, only they are rebuilt; a compressed-only index has no fp16 vectors
    to build them from, so it is encoded again.
    """
    directory = Path(directory)
    check_verify(verify)
    corpus_fp = corpus_fingerprint or fingerprint_corpus(doc_ids, texts)
    config = backend_from(backend, faiss_kind, faiss_params)

    def build() -> TokenIndex:
        return build_index(encoder, doc_ids, texts, directory, backend=config, corpus_fingerprint=corpus_fp,
                           use_gpu=use_gpu, overwrite=True, **build_kwargs)

    with file_lock(lock_path(directory), what=f"building {directory.name}"):
        index = _open_matching(directory, corpus_fp, encoder, verify)
        if index is None:
            return _opened(build(), "built")
        reason = _rebuild_reason(index, texts, build_kwargs)
        if reason is not None:
            logger.info("%s: %s: rebuilding it", directory, reason)
            return _opened(build(), f"rebuilt: {reason}")
        if same_search_structures(index, config):
            return _opened(index, "reused")
        if index.compressed_only:
            logger.info("%s: compressed-only index with other settings: rebuilding it", directory)
            return _opened(build(), "rebuilt: a compressed-only index with other settings")
        logger.info("%s: search structures differ (%s -> %s): rebuilding them only", directory,
                    index.backend_settings["kind"], config.kind)
        return _opened(rebuild_search_structures(index, config, use_gpu=use_gpu,
                                                 progress=build_kwargs.get("progress", True),
                                                 gpu_device=build_kwargs.get("gpu_device", 0), device=encoder.device),
                       f"encodings reused, {config.kind} search structures built")


def _opened(index: TokenIndex, how: str) -> TokenIndex:
    index.how_opened = how
    return index


def _rebuild_reason(index: TokenIndex, texts: Sequence[str], build_kwargs: dict[str, Any]) -> str | None:
    """Why the documents of ``index`` must be encoded again (another precision or document encoding), or None."""
    precision = build_kwargs.get("precision", "fp32")
    recorded = index.meta.get("encoding_precision", "fp32")  # indexes from before precision existed: fp32
    if recorded != precision:
        return f"documents were encoded in {recorded}, {precision} wanted"
    n_calibration = len(_calibration_texts(texts, build_kwargs.get("calibration_docs", CALIBRATION_DOCS)))
    if not _same_document_encoding(index, build_kwargs.get("quantize"), n_calibration):
        return (f"documents were encoded with {index.meta.get('document_encoding') or {}}, "
                f"{document_encoding_key(build_kwargs.get('quantize'), n_calibration)} wanted")
    return None
