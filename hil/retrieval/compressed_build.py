"""A PLAID index compressed as the corpus is encoded: no fp16 vector of the corpus is ever written.

Before, an index was encoded into fp16 chunks, joined into one fp16 table (256 bytes a token at D = 128), and only
then given centroids and, if asked, residual codes: MS MARCO needed ~325 GB of disk on the way to a 28 GB index.
ColBERTv2's indexer (stanford-futuredata/ColBERT, ``colbert/indexing/collection_indexer.py``: ``setup``,
``train``, ``index``, ``finalize``) plans from a sample instead, and so does this build, for every index whose
vectors are stored compressed only (``PlaidIndexConfig(residual_bits=b, keep_embeddings=False)``):

1. **sample** -- documents drawn by ColBERTv2's rule (``_sample_pids``: ``1 + 16 sqrt(120 N)`` of the N documents,
   at most N; seeded by the config's ``seed``) are encoded in the drawn order, a chunk at a time, until their tokens
   cover the k-means sample the estimate asks for (``train_size``, by default 32 per centroid, plus
   :data:`~hil.retrieval.backends.centroid.CODEC_SAMPLE` for the residual buckets) or the drawn documents run out.
   The corpus's size is estimated from them (ColBERTv2's ``num_embeddings_est = N * avg_doclen_est``) and the
   number of centroids chosen from the estimate by ColBERTv2's rule (``2 ** floor(log2(16 sqrt(est)))``). The
   sample is kept on disk (``sample.<head>.npy``, fp16): k-means reads it as a memory map, so the build's own memory
   does not grow with it; it is removed once the centroids and buckets are trained (its only readers).
2. **centroids** -- k-means on ``train_size`` of the sampled tokens (exact or two-level: ``assignment``), then the
   residual buckets (:func:`~hil.retrieval.codec.fit_residual_codec`) on the other sampled tokens, as ColBERTv2's
   ``_compute_avg_residual`` fits them on a held-out part of its sample (at most 65,536 tokens here; when the
   corpus has too few tokens, a seeded subset of all of them, as a build from fp16 does).
3. **encode and compress** -- every chunk is encoded and stored as codes and residuals (:mod:`hil.retrieval.
   chunk_codec`), on one process or several, resumable chunk by chunk (:mod:`hil.retrieval.chunks`).
4. **join** -- the chunks' codes, residuals and token ids into the index's arrays, each chunk removed once copied.
   Token ids are kept only for an encoder whose score reads them (``Encoder.scores_repeated_padding`` False: IDF
   weights, lexical heads); a pure MaxSim's index stores none, as ColBERTv2's does (``stores_token_ids``).
5. **inverted file** -- PLAID's centroid -> documents lists, in bounded memory (:func:`hil.retrieval.plaid.
   write_ivf`).

Each stage's end is recorded in the build folder (:class:`~hil.retrieval.build_state.BuildState`), so a build
killed at any point (SIGKILL included) resumes at the stage it was in, and finishes with the same files as an
uninterrupted one. The index has the layout of a compressed-only index made from fp16 (``index.json`` records the
plan: sample, estimate, what was chosen and why), and for the same centroids and buckets the same bytes.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from hil.provenance import atomic_output, write_json_atomic
from hil.retrieval.backends.centroid import CODEC_SAMPLE, PlaidBackend
from hil.retrieval.backends.configs import PlaidIndexConfig
from hil.retrieval.build_state import CHUNKS_DIR, BuildState
from hil.retrieval.chunk_codec import ChunkCodec, HeadCodec
from hil.retrieval.chunks import JOIN_STATE, JoinedTable, collect_chunks, join_tables, kill_if_asked
from hil.retrieval.codec import ResidualCodec, fit_residual_codec
from hil.retrieval.index import DOC_IDS_JSON, DOC_OFFSETS_NPY, TOKEN_IDS_NPY, plaid_paths, save_npy_atomic
from hil.retrieval.kmeans import KMeansEngine, kmeans_engine
from hil.retrieval.plaid import (
    IVF_BLOCK_TOKENS,
    CentroidAssignment,
    assign_codes,
    code_dtype,
    document_blocks,
    sample_rows,
    train_plaid_centroids,
    write_ivf,
)
from hil.retrieval.progress import progress_bar
from hil.retrieval.two_level import CentroidGroups
from hil.retrieval.vector_source import DocumentVectors

logger = logging.getLogger(__name__)

TYPICAL_DOCLEN = 120  # ColBERTv2's _sample_pids: "let's keep sampling independent of the actual doc_maxlen"
_COPY_ROWS = 1 << 18   # sampled rows copied at once (64 MiB of fp16 at D = 128)


def compressed_as_encoded(config: object) -> bool:
    """Whether an index of ``config`` is built by this module: PLAID vectors stored compressed only."""
    return isinstance(config, PlaidIndexConfig) and bool(config.residual_bits) and not config.keep_embeddings


def sample_size(n_docs: int) -> int:
    """ColBERTv2's number of sampled documents: ``min(1 + int(16 sqrt(120 N)), N)``."""
    return min(1 + int(16 * math.sqrt(TYPICAL_DOCLEN * n_docs)), n_docs)


def sampled_documents(n_docs: int, seed: int) -> np.ndarray:
    """The sampled document rows (:func:`sample_size` of them), in the seeded order they are drawn."""
    return np.random.default_rng(seed).choice(n_docs, size=sample_size(n_docs), replace=False).astype(np.int64)


@dataclass
class CompressedBuild:
    """What the stages need: the unfinished folder and its state, the corpus (its size, and its vectors for the
    sample), the settings, and how the chunks get encoded (``encode_chunks(codec)`` encodes every unfinished chunk
    with that compression and returns the chunks' identity; the builder supplies it: one process or several, or a
    precomputed source). ``store_token_ids`` False: the index keeps no token ids (the chunks' are dropped as they
    are joined), for an encoder whose score reads the vectors alone."""

    folder: Path
    state: BuildState
    heads: tuple[str, ...]
    dims: dict[str, int]
    doc_ids: Sequence[str]
    config: PlaidIndexConfig
    sample_vectors: DocumentVectors
    encode_chunks: Callable[[ChunkCodec], dict[str, Any]]
    chunk_docs: int
    engine_device: Any
    store_token_ids: bool = True
    use_gpu: bool = False
    gpu_device: int = 0
    progress: bool = True

    @property
    def n_docs(self) -> int:
        return len(self.doc_ids)


def run(job: CompressedBuild, clock: Any) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Every stage of the module docstring not finished yet; -> (n_tokens, the ``backend`` part of ``index.json``,
    the build's plan record). ``clock`` (:class:`~hil.provenance.StageClock`) gets a stage after each."""
    sample = job.state.done("sample") or _draw_sample(job)
    clock.stage("sample")
    kill_if_asked("sampled")
    trained = job.state.done("centroids") or _train(job, sample)
    _remove_sample(job)  # k-means and the buckets were its only readers: the disk is the index's from here
    clock.stage("kmeans")
    kill_if_asked("trained")
    joined = job.state.done("joined")
    if joined is None:
        encoded = job.state.done("encoded")
        if encoded is None and not (job.folder / JOIN_STATE).exists():
            codec = load_chunk_codec(job, sample["params"], trained)
            encoded = job.state.mark("encoded", identity=job.encode_chunks(codec))
        clock.stage("encode")
        joined = _join(job, sample["params"], encoded["identity"])
        clock.stage("join")
    kill_if_asked("joined")
    ivf = job.state.done("ivf") or _inverted_files(job, sample["params"], joined["n_tokens"])
    clock.stage("inverted_file")
    params = dict(sample["params"])
    codecs = {head: {**trained["codecs"][head], "assignment": trained["assignments"][head]} for head in job.heads}
    backend = {"kind": PlaidBackend.kind, "params": params, "factory": PlaidBackend.factory(params),
               "metric": "inner_product", "stored": True, "codecs": codecs}
    plan = {**{k: v for k, v in sample.items() if k != "params"}, "inverted_file": ivf,
            "sizing_tokens": sample["n_tokens_estimate"], "encoded_identity": joined["identity"]}
    return joined["n_tokens"], backend, plan


# -- 1. the sample ---------------------------------------------------------------------------------------------------

def _sample_path(folder: Path, head: str) -> Path:
    return folder / f"sample.{head}.npy"


def _draw_sample(job: CompressedBuild) -> dict[str, Any]:
    """Stage 1: encode drawn documents until the estimate's k-means and bucket samples are covered; write the
    selected tokens to ``sample.<head>.npy`` (training tokens first, then the held-out ones); -> its record."""
    rows = sampled_documents(job.n_docs, job.config.seed)
    dim = next(iter(job.dims.values()))
    raw = {head: job.folder / f".sample-raw.{head}.bin" for head in job.heads}
    handles = {head: open(path, "wb") for head, path in raw.items()}
    n_tokens = n_docs = 0
    bar = progress_bar(len(rows), "sampling documents", "doc", enabled=job.progress)
    try:
        for start in range(0, len(rows), job.chunk_docs):
            block = np.sort(rows[start: start + job.chunk_docs])
            encoded = job.sample_vectors.vectors(block)
            for head in job.heads:
                handles[head].write(np.ascontiguousarray(encoded.embeddings[head], dtype=np.float16).tobytes())
            n_tokens += int(encoded.lengths.sum())
            n_docs += len(block)
            bar.update(len(block))
            params = _resolved(job, max(1, round(job.n_docs * n_tokens / n_docs)), dim)
            wanted = params["train_size"] + CODEC_SAMPLE
            if n_tokens >= wanted:
                bar.total = n_docs
                break
            # The bar's end (and so its ETA): the documents that should cover what is still wanted, not all drawn
            bar.total = min(len(rows), n_docs + math.ceil((wanted - n_tokens) * n_docs / max(n_tokens, 1)))
            bar.refresh()
    finally:
        bar.close()
        for handle in handles.values():
            handle.close()
    estimate = max(1, round(job.n_docs * n_tokens / max(n_docs, 1)))
    params = _resolved(job, estimate, dim)
    train, heldout = _sample_split(n_tokens, params["train_size"], job.config.seed)
    selected = np.concatenate([train, heldout])
    for head in job.heads:
        collected = np.memmap(raw[head], dtype=np.float16, mode="r", shape=(n_tokens, job.dims[head]))
        with atomic_output(_sample_path(job.folder, head)) as tmp:
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16,
                                            shape=(len(selected), job.dims[head]))
            for start in range(0, len(out), _COPY_ROWS):  # in blocks: the sample never sits in this process
                picked = selected[start: start + _COPY_ROWS]
                out[start: start + len(picked)] = collected[picked]
            out.flush()
            del out
        del collected
        raw[head].unlink()
    logger.info("sampled %d of %d documents (%d tokens): about %d tokens in all, %d centroids", n_docs, job.n_docs,
                n_tokens, estimate, params["n_centroids"])
    return job.state.mark("sample", sampled_docs=n_docs, drawn_docs=len(rows), sampled_tokens=n_tokens,
                          mean_doc_tokens=n_tokens / max(n_docs, 1), n_tokens_estimate=estimate,
                          train_tokens=len(train), heldout_tokens=len(heldout), params=params)


def _resolved(job: CompressedBuild, n_tokens: int, dim: int) -> dict[str, Any]:
    """The PLAID settings for a corpus of ``n_tokens`` (an estimate), machine choices made."""
    params = PlaidBackend.resolve_params(job.config, n_tokens, dim)
    return PlaidBackend.resolve_machine_params(params, device=job.engine_device, use_gpu=job.use_gpu,
                                               gpu_device=job.gpu_device)


def _sample_split(n_tokens: int, train_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the collected tokens for k-means and for the residual buckets, each ascending. With enough tokens
    the two are disjoint (a seeded permutation: the first ``train_size``, then :data:`CODEC_SAMPLE`); otherwise
    k-means takes ``train_size`` seeded rows (all when fewer) and the buckets a seeded subset of all of them,
    which is what a build from fp16 takes (``train_centroids``' and ``_write_residuals``' rows)."""
    if n_tokens >= train_size + CODEC_SAMPLE:
        order = np.random.default_rng(seed).permutation(n_tokens)
        return np.sort(order[:train_size]), np.sort(order[train_size: train_size + CODEC_SAMPLE])
    train = sample_rows(n_tokens, train_size, seed)
    return train, sample_rows(n_tokens, min(n_tokens, CODEC_SAMPLE), seed + 1)


def _remove_sample(job: CompressedBuild) -> None:
    for head in job.heads:
        _sample_path(job.folder, head).unlink(missing_ok=True)
        (job.folder / f".sample-raw.{head}.bin").unlink(missing_ok=True)


# -- 2. centroids and buckets ---------------------------------------------------------------------------------------

def _groups_path(folder: Path, head: str) -> Path:
    return folder / f".groups.{head}.npz"


def _train(job: CompressedBuild, sample: dict[str, Any]) -> dict[str, Any]:
    """Stage 2: each head's centroids (``<head>.centroids.npy``, the index's file) and residual buckets; the groups
    of a two-level assignment beside them (removed at the end); -> its record."""
    params = sample["params"]
    engine = _engine(job, params)
    n_train = sample["train_tokens"]
    codecs, assignments = {}, {}
    # Steps a bar can time: two-level k-means reports level 1 and each coarse cluster of level 2 (n_coarse + 1 of
    # them), flat k-means only its end; one more step per head for the residual buckets.
    two_level = params["assignment"] == "two-level"
    per_head = (max(1, round(params["n_centroids"] ** 0.5)) + 1 if two_level else 1) + 1
    bar = progress_bar(len(job.heads) * per_head, "k-means", "step", enabled=job.progress)
    for head in job.heads:
        tokens = np.load(_sample_path(job.folder, head), mmap_mode="r")
        centroids, assignment = train_plaid_centroids(
            tokens[:n_train], params["n_centroids"], train_size=n_train, niter=params["niter"], seed=params["seed"],
            engine=engine, method=params["assignment"], nprobe=params["assignment_nprobe"] or 0,
            on_cluster=bar.update)
        if not two_level:
            bar.update(1)
        heldout = np.asarray(tokens[n_train:])
        if len(heldout) == 0 or sample["heldout_tokens"] != len(heldout):
            raise RuntimeError(f"{_sample_path(job.folder, head)}: {len(heldout)} held-out tokens, "
                               f"{sample['heldout_tokens']} recorded")
        codes = assign_codes(heldout, centroids, engine=engine, assignment=assignment)
        codec = fit_residual_codec(heldout.astype(np.float32), codes, centroids, params["residual_bits"])
        if assignment.groups is not None:
            groups = assignment.groups
            with atomic_output(_groups_path(job.folder, head)) as tmp, open(tmp, "wb") as handle:
                np.savez(handle, group_centroids=groups.group_centroids.numpy(), members=groups.members.numpy(),
                         offsets=groups.offsets.numpy())
        save_npy_atomic(plaid_paths(job.folder, head)["centroids"], centroids)
        codecs[head], assignments[head] = codec.settings(), assignment.record()
        bar.update(1)
        del tokens
    bar.close()
    return job.state.mark("centroids", codecs=codecs, assignments=assignments)


def _engine(job: CompressedBuild, params: dict[str, Any]) -> KMeansEngine:
    return kmeans_engine(params["kmeans"], job.engine_device, use_gpu=job.use_gpu, gpu_device=job.gpu_device)


def load_chunk_codec(job: CompressedBuild, params: dict[str, Any], trained: dict[str, Any]) -> ChunkCodec:
    """The finished stage 2 as a :class:`ChunkCodec` (read back from its files, as a resumed build does)."""
    import torch

    heads = {}
    for head in job.heads:
        centroids = np.load(plaid_paths(job.folder, head)["centroids"])
        settings = trained["codecs"][head]
        codec = ResidualCodec(centroids, int(settings["nbits"]), np.asarray(settings["cutoffs"], dtype=np.float32),
                              np.asarray(settings["weights"], dtype=np.float32))
        assignment = CentroidAssignment()
        if params["assignment"] == "two-level":
            with np.load(_groups_path(job.folder, head)) as stored:
                groups = CentroidGroups(torch.from_numpy(stored["group_centroids"]),
                                        torch.from_numpy(stored["members"]), torch.from_numpy(stored["offsets"]))
            assignment = CentroidAssignment("two-level", groups, int(params["assignment_nprobe"]))
        heads[head] = HeadCodec(centroids, codec, assignment)
    return ChunkCodec(heads, _engine(job, params))


# -- 4. join, 5. inverted file ----------------------------------------------------------------------------------------

def compressed_tables(folder: Path, heads: Sequence[str], codec_settings: dict[str, Any], n_centroids: int,
                      dims: dict[str, int], token_ids: bool = True) -> list[JoinedTable]:
    """The joined arrays of a compressed-only index: every head's codes and packed residuals, and the token ids
    where they are stored."""
    tables = []
    for head in heads:
        paths = plaid_paths(folder, head)
        packed = dims[head] * int(codec_settings[head]["nbits"]) // 8
        tables += [JoinedTable(f"codes:{head}", paths["codes"], code_dtype(n_centroids)),
                   JoinedTable(f"residuals:{head}", paths["residuals"], np.dtype(np.uint8), (packed,))]
    return tables + ([JoinedTable("token_ids", folder / TOKEN_IDS_NPY, np.dtype(np.int32))] if token_ids else [])


def _join(job: CompressedBuild, params: dict[str, Any], identity: dict[str, Any]) -> dict[str, Any]:
    """Stage 4: the chunks into the index's arrays, each removed once copied; -> its record."""
    chunks = job.folder / CHUNKS_DIR
    metas = collect_chunks(chunks, job.n_docs, job.chunk_docs, job.heads, identity, compressed=True,
                           arrays=not (job.folder / JOIN_STATE).exists())
    codecs = job.state.done("centroids")["codecs"]
    tables = compressed_tables(job.folder, job.heads, codecs, params["n_centroids"], job.dims, job.store_token_ids)
    bar = progress_bar(job.n_docs, "joining chunks", "doc", enabled=job.progress)
    n_tokens = join_tables(chunks, job.folder, job.heads, metas, tables, compressed=True, remove_joined=True,
                           progress_bar=bar)
    bar.close()
    write_json_atomic(job.folder / DOC_IDS_JSON, list(job.doc_ids))
    sizes = sorted({meta["batch_size"] for meta in metas if meta.get("batch_size")})
    return job.state.mark("joined", n_tokens=n_tokens, identity=identity,
                          batch_sizes=sizes[0] if len(sizes) == 1 else (sizes or None))


def _inverted_files(job: CompressedBuild, params: dict[str, Any], n_tokens: int) -> dict[str, Any]:
    """Stage 5: every head's inverted file from its joined codes; -> its record (entries per head)."""
    offsets = np.load(job.folder / DOC_OFFSETS_NPY)
    entries = {}
    for head in job.heads:
        paths = plaid_paths(job.folder, head)
        codes = np.load(paths["codes"], mmap_mode="r")
        n_blocks = len(document_blocks(offsets, IVF_BLOCK_TOKENS))
        bar = progress_bar(2 * n_blocks, f"inverted file ({head})", "block", enabled=job.progress)
        entries[head], _ = write_ivf(codes, offsets, params["n_centroids"], paths["ivf_offsets"], paths["ivf_docs"],
                                     progress_bar=bar)
        bar.close()
        _groups_path(job.folder, head).unlink(missing_ok=True)
        del codes
    return job.state.mark("ivf", entries=entries)
