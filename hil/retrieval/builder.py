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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from hil.modeling.contracts import Encoder
from hil.provenance import StageClock, file_lock, lock_path, provenance, replace_directory, write_json_atomic
from hil.retrieval import compressed_build
from hil.retrieval.backends.configs import IndexConfig
from hil.retrieval.backends.registry import backend_class
from hil.retrieval.build_state import CHUNKS_DIR, BuildState
from hil.retrieval.chunk_codec import ChunkCodec
from hil.retrieval.chunks import (
    JOIN_STATE,
    collect_chunks,
    encoding_batch_sizes,
    join_chunks,
    kill_if_asked,
    store_source_chunks,
)
from hil.retrieval.compressed_build import CompressedBuild, compressed_as_encoded
from hil.retrieval.corpus_encoding import CorpusEncoding, check_processes, check_tokenizer_workers, encode_corpus
from hil.retrieval.devices import autocast, check_precision
from hil.retrieval.disk_plan import CorpusLengths, check_disk, check_memory, sized_config, stores_token_ids
from hil.retrieval.encoding import EncodedTokens, eval_mode
from hil.retrieval.fast_encode import DOCUMENT_ENCODINGS, document_encoder, document_encoding_key
from hil.retrieval.index import (
    DOC_IDS_JSON,
    INDEX_FORMAT,
    INDEX_FORMAT_VERSION,
    INDEX_JSON,
    IndexMismatchError,
    TokenIndex,
    embeddings_path,
    encoder_fingerprint,
    fingerprint_corpus,
    json_normalized,
    seal_index,
    unfinished_build_dir,
)
from hil.retrieval.integrity import IndexIntegrityError, check_verify
from hil.retrieval.progress import progress_bar
from hil.retrieval.structures import backend_from, rebuild_faiss, rebuild_search_structures, write_search_files  # noqa: F401
from hil.retrieval.vector_source import DocumentVectors, EncodedDocuments, VectorSource

logger = logging.getLogger(__name__)

CALIBRATION_DOCS = 32  # documents whose activations calibrate int8 document encoding
# Documents per encoder batch when none is given: 32 on a CPU (what every index was built with before), more on a
# GPU, whose time per batch is mostly fixed cost below a few thousand tokens (launches, the sync-free pipeline).
DEFAULT_BATCH_SIZE = {"cpu": 32, "cuda": 128}
AUTOCAST_ENCODINGS = (None, "compile")  # document encodings that run PyTorch's own kernels, where autocast applies
_HEAD_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")


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


def _check_vectors(vectors: VectorSource, doc_ids: Sequence[str], processes: int, quantize: str | None) -> None:
    """Refuse a precomputed-vector build that cannot be, before any work."""
    if len(doc_ids) != vectors.n_docs:
        raise ValueError(f"build_index: {len(doc_ids)} doc_ids but the vector source holds {vectors.n_docs}")
    if not doc_ids:
        raise ValueError("build_index: the corpus is empty")
    if len(set(doc_ids)) != len(doc_ids):
        raise ValueError("build_index: duplicate document ids")
    if processes != 1 or quantize is not None:
        raise ValueError("build_index: precomputed vectors are read, not encoded: processes=1 and quantize=None")


@dataclass
class _Build:
    """One build's inputs, as the two ways of building read them (fp16 first, or compressed as encoded)."""

    encoder: Encoder
    doc_ids: Sequence[str]
    texts: Sequence[str] | None
    vectors: VectorSource | None
    folder: Path
    config: IndexConfig
    identity: dict[str, Any]     # what every chunk records: settings, fingerprints, precision
    chunk_docs: int
    batch_size: int
    quantize: str | None
    calibration_docs: int
    precision: str
    processes: int
    tokenizer_workers: int
    progress: bool
    device: torch.device
    use_gpu: bool
    gpu_device: int
    description: str

    @property
    def heads(self) -> tuple[str, ...]:
        return tuple(self.encoder.head_names)

    def state_identity(self, way: str, **more: Any) -> dict[str, Any]:
        """What the unfinished folder's state must match to be resumed (:mod:`hil.retrieval.build_state`)."""
        n_calibration = 0 if self.texts is None else len(_calibration_texts(self.texts, self.calibration_docs))
        return {"way": way, **self.identity, "n_docs": len(self.doc_ids), "chunk_docs": self.chunk_docs,
                "heads": list(self.heads), "document_encoding": document_encoding_key(self.quantize, n_calibration),
                "vectors": self.vectors.record() if self.vectors is not None else None, **more}

    def encode(self, identity: dict[str, Any], compression: ChunkCodec | None = None) -> dict[str, Any]:
        """Every unfinished chunk encoded (or read from the vector source) and stored; -> the chunks' identity."""
        chunks = self.folder / CHUNKS_DIR
        if self.vectors is not None:
            bar = progress_bar(len(self.doc_ids), f"storing {self.description}", "doc", enabled=self.progress)
            store_source_chunks(self.vectors, chunks, dict(identity, document_encoding=None),
                                n_docs=len(self.doc_ids), chunk_docs=self.chunk_docs, heads=self.heads,
                                progress_bar=bar, compression=compression)
            bar.close()
            return dict(identity, document_encoding=None)
        job = CorpusEncoding(self.encoder, self.texts, chunks, identity=identity, chunk_docs=self.chunk_docs,
                             batch_size=self.batch_size, quantize=self.quantize,
                             calibration_texts=_calibration_texts(self.texts, self.calibration_docs),
                             precision=self.precision, progress=self.progress,
                             description=f"encoding {self.description}", tokenizer_workers=self.tokenizer_workers,
                             compression=compression)
        return encode_corpus(job, self.processes)


def build_index(encoder: Encoder, doc_ids: Sequence[str], texts: Sequence[str] | None,
                directory: str | os.PathLike, *,
                batch_size: int | None = None, chunk_docs: int = 2048, backend: str | IndexConfig = "flat",
                corpus_fingerprint: str | None = None, progress: bool = True, overwrite: bool = False,
                use_gpu: bool = False, gpu_device: int = 0, quantize: str | None = None,
                calibration_docs: int = CALIBRATION_DOCS, processes: int = 1, precision: str = "fp32",
                tokenizer_workers: int = 0, vectors: VectorSource | None = None, faiss_kind: str | None = None,
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

    How: a PLAID index stored compressed only (``residual_bits`` with ``keep_embeddings=False``) is compressed as it
    is encoded (:mod:`hil.retrieval.compressed_build`: sample, centroids, then codes and residuals chunk by chunk;
    no fp16 vector is written); every other index is encoded into fp16 chunks, joined, then given its search
    structures. Both resume after a crash at any stage (:mod:`hil.retrieval.build_state`). Before any encoding, an
    index that would not fit on its disk is refused (:func:`hil.retrieval.disk_plan.check_disk`).

    Where: the corpus is encoded on ``encoder.device`` (move the encoder there first). ``processes`` > 1 encodes
    on that many processes through Lightning Fabric (``ddp_spawn``): one per GPU (``cuda:0`` ..) for a CUDA
    encoder, or that many CPU processes sharing the cores; the index is the same as a one-process build's
    (:mod:`hil.retrieval.corpus_encoding`). ``precision`` (``fp32``, ``fp16`` on a GPU, ``bf16``) is autocast
    over the encoder's forward pass (:func:`hil.retrieval.devices.autocast`); stored vectors are fp16 either way;
    recorded in ``index.json`` as ``encoding_precision``. ``tokenizer_workers`` > 0 tokenizes the chunks in that
    many DataLoader processes (per encoding process) ahead of the encoder, which then only runs the model (for a
    GPU: :mod:`hil.retrieval.token_loader`); the index is the same for any number.

    ``vectors``: precomputed document vectors (a :class:`~hil.retrieval.vector_source.VectorSource`, e.g. a tiling
    of an index for a scale benchmark) stored instead of encoding ``texts`` (which may then be None); the index
    records the source and carries ``encoder``'s settings and fingerprint, so that ``encoder``'s queries search it.

    Memory: at most one chunk of ``chunk_docs`` documents is held while encoding (its fp32 token vectors, about
    ``chunk_docs * 4 * D * tokens_per_doc`` bytes, plus the model's activations for one ``batch_size`` batch);
    the chunks are then streamed into the final memmaps, so ``chunk_docs`` is the memory knob for corpora larger
    than RAM (``bench/README.md`` has measured peak RSS against it). With ``processes`` > 1, per process. Disk:
    the finished index plus one chunk (each chunk is removed once joined), and for a compressed build its sample.

    ``quantize`` picks a cheaper document encoder (queries always keep ``encoder``); recorded in ``index.json`` as
    ``document_encoding``; None (default) encodes with ``encoder`` itself. Measured in bench/README:
    ``"onnx-int8"`` (:mod:`hil.retrieval.onnx_encode`: ONNX Runtime, fused layers, int8 matrix products) is the
    fast one on a CPU, at a small measured cost in nDCG@10; ``"onnx"`` is the same runtime in fp32 (same vectors);
    ``"int8"`` is PyTorch SmoothQuant + dynamic int8 (:mod:`hil.retrieval.fast_encode`, calibrated on the first
    ``calibration_docs`` texts); ``"compile"`` is ``torch.compile`` in fp32 (same vectors). With ``processes`` > 1
    each process builds the same view from its copy of ``encoder``. Only ``None`` and ``"compile"`` take a
    ``precision`` other than fp32.
    """
    if vectors is None:
        _check_corpus(doc_ids, texts)
    else:
        _check_vectors(vectors, doc_ids, processes, quantize)
    directory = Path(directory)
    heads = tuple(encoder.head_names)
    config = backend_from(backend, faiss_kind, faiss_params)
    device = torch.device(encoder.device)
    batch_size = batch_size if batch_size is not None else DEFAULT_BATCH_SIZE.get(device.type, 32)
    _check_request(heads, batch_size, chunk_docs, config)
    lengths = CorpusLengths(encoder, texts, vectors)
    config, storage_choice = sized_config(config, encoder, len(doc_ids), lengths)
    _check_encoding(device, processes, precision, quantize)
    check_tokenizer_workers(tokenizer_workers)
    corpus_fp = corpus_fingerprint or (vectors.fingerprint() if vectors is not None
                                       else fingerprint_corpus(doc_ids, texts))
    encoder_fp = encoder_fingerprint(encoder)
    settings = json_normalized(encoder.settings())
    job = _Build(encoder, doc_ids, texts, vectors, unfinished_build_dir(directory), config,
                 {"settings": settings, "encoder_fingerprint": encoder_fp, "corpus_fingerprint": corpus_fp,
                  "encoding_precision": precision}, chunk_docs, batch_size, quantize, calibration_docs, precision,
                 processes, tokenizer_workers, progress, device, use_gpu, gpu_device, str(directory))
    with file_lock(lock_path(directory), what=f"building {directory.name}"):
        _check_target(directory, overwrite)
        check_disk(directory, encoder, config, doc_ids, lengths)
        if device.type == "cpu" and not use_gpu:  # searched on this machine's host memory
            check_memory(directory, encoder, config, len(doc_ids), lengths)
        # index.json's build_seconds: each stage's wall time (a stage a resumed build skipped costs ~0); each stage
        # ends with a host read of its results, so on a GPU the time is its own.
        seconds = StageClock()
        if compressed_as_encoded(config):
            n_tokens, backend_settings, extra, state = _build_compressed(job, seconds)
        else:
            n_tokens, backend_settings, extra, state = _build_fp16_first(job, seconds)
        shutil.rmtree(job.folder / CHUNKS_DIR, ignore_errors=True)
        dims, identity = extra.pop("dims"), extra.pop("identity")
        document_encoding = identity.get("document_encoding")
        meta = provenance(settings, format=INDEX_FORMAT, format_version=INDEX_FORMAT_VERSION, n_docs=len(doc_ids),
                          n_tokens=n_tokens, heads=list(heads), dims=dims,
                          dim=next(iter(dims.values())) if len(set(dims.values())) == 1 else None,
                          embedding_dtype="float16", backend=backend_settings, corpus_fingerprint=corpus_fp,
                          encoder_fingerprint=encoder_fp, encoding_precision=precision,
                          encoding_batch_size=extra.pop("batch_sizes"),
                          encoded_on={"device": str(device) if processes == 1 else device.type,
                                      "processes": processes},
                          build_seconds=seconds.stages,
                          **({"document_encoding": document_encoding} if document_encoding else {}),
                          **({"storage_choice": storage_choice} if storage_choice else {}),
                          **({"vector_source": vectors.record()} if vectors is not None else {}), **extra)
        seal_index(job.folder, meta)  # last: its presence marks the folder a finished index
        kill_if_asked("sealed")
        state.remove()
        replace_directory(job.folder, directory)
        # The checksums were just computed from these very files: the sizes say they are the ones recorded.
        return TokenIndex.load(directory, verify="sizes")


def _build_fp16_first(job: _Build, seconds: StageClock) -> tuple[int, dict[str, Any], dict[str, Any], BuildState]:
    """Encode into fp16 chunks, join them, write the back-end's structures from the joined vectors; -> (n_tokens,
    the back-end's record, what index.json adds, the state)."""
    state = BuildState(job.folder, job.state_identity("fp16"))
    state.start()
    joined = state.done("joined")
    if joined is None:
        encoded = state.done("encoded") or state.mark("encoded", identity=job.encode(job.identity))
        seconds.stage("encode")
        chunks = job.folder / CHUNKS_DIR
        metas = collect_chunks(chunks, len(job.doc_ids), job.chunk_docs, job.heads, encoded["identity"],
                               arrays=not (job.folder / JOIN_STATE).exists())
        n_tokens = join_chunks(chunks, job.folder, job.heads, metas, remove_joined=True)
        write_json_atomic(job.folder / DOC_IDS_JSON, list(job.doc_ids))
        joined = state.mark("joined", n_tokens=n_tokens, dims=metas[0]["dims"], identity=encoded["identity"],
                            batch_sizes=encoding_batch_sizes(metas))
        seconds.stage("join")
    kill_if_asked("joined")
    embeddings = {head: np.load(embeddings_path(job.folder, head), mmap_mode="r") for head in job.heads}
    backend_settings = write_search_files(job.folder, embeddings, job.config, job.use_gpu, job.progress,
                                          job.gpu_device, job.device)
    seconds.stage("search_structures")
    del embeddings
    extra = {key: joined[key] for key in ("dims", "identity", "batch_sizes")}
    return joined["n_tokens"], backend_settings, extra, state


def _build_compressed(job: _Build, seconds: StageClock) -> tuple[int, dict[str, Any], dict[str, Any], BuildState]:
    """:mod:`hil.retrieval.compressed_build`'s stages for this build; -> as :func:`_build_fp16_first`."""
    state = BuildState(job.folder, job.state_identity("compressed", backend=job.config.record(),
                                                      token_ids=stores_token_ids(job.encoder, job.config)))
    state.start()
    dims = {head: int(job.encoder.dim) for head in job.heads}
    if job.vectors is not None:
        sample_vectors: DocumentVectors = job.vectors
    else:
        view = document_encoder(job.encoder, job.quantize,
                                calibration_texts=_calibration_texts(job.texts, job.calibration_docs))
        sample_vectors = _ViewDocuments(EncodedDocuments(view, job.texts, job.batch_size), job.device, job.precision)

    def encode_chunks(codec: ChunkCodec) -> dict[str, Any]:
        return job.encode(dict(job.identity, compression=codec.fingerprint()), codec)

    compressed = CompressedBuild(job.folder, state, job.heads, dims, job.doc_ids, job.config, sample_vectors,
                                 encode_chunks, job.chunk_docs, job.device, stores_token_ids(job.encoder, job.config),
                                 job.use_gpu, job.gpu_device, job.progress)
    n_tokens, backend_settings, plan = compressed_build.run(compressed, seconds)
    identity = plan.pop("encoded_identity")
    extra = {"dims": dims, "identity": identity, "batch_sizes": state.done("joined")["batch_sizes"],
             "build_plan": plan, "sizing_tokens": plan["sizing_tokens"],
             "stores_token_ids": stores_token_ids(job.encoder, job.config)}
    return n_tokens, backend_settings, extra, state


class _ViewDocuments:
    """The sample's documents through the document view, in evaluation mode and the build's autocast."""

    def __init__(self, documents: EncodedDocuments, device: torch.device, precision: str):
        self.documents, self.device, self.precision = documents, device, precision

    def vectors(self, rows: np.ndarray) -> EncodedTokens:
        with eval_mode(self.documents.encoder), autocast(self.device, self.precision):
            return self.documents.vectors(rows)


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
    # A compressed build resolved its settings for the corpus size it estimated from its sample (sizing_tokens).
    n_tokens = int(index.meta.get("sizing_tokens", index.n_tokens))
    wanted = [backend.resolve_params(config, n_tokens, dim) for dim in index.dims.values()]
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
