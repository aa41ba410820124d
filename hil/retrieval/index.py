"""A token index: every document's scored token embeddings on disk (fp16 memmaps) plus a FAISS index per head.

Layout of an index folder ``<dir>``::

    index.json                 settings, counts, fingerprints, FAISS settings, provenance
    doc_ids.json               document ids, in corpus order
    doc_offsets.npy            (n_docs + 1,) int64: document i owns tokens [offsets[i], offsets[i+1])
    token_ids.npy              (n_tokens,) int32: the vocabulary id of every stored token (for analysis / IDF)
    <head>.embeddings.npy      (n_tokens, D) float16, one per encoder head, L2-normalized token vectors
    <head>.faiss               the trained FAISS index of an ``ivfflat`` / ``ivfpq`` index
    <head>.centroids.npy       ``plaid``: (C, D) float32 k-means centroids (hil.retrieval.plaid)
    <head>.codes.npy           ``plaid``: (n_tokens,) uint16/int32 nearest centroid of every token
    <head>.ivf_offsets.npy     ``plaid``: (C + 1,) int64 and ``<head>.ivf_docs.npy`` (E,) int32: centroid -> documents
    <head>.residuals.npy       ``plaid`` with ``residual_bits``: (n_tokens, D * bits / 8) uint8 packed residuals
                               (hil.retrieval.codec); with ``keep_embeddings=False`` it replaces the fp16 file

Only tokens that take part in late interaction are stored (the encoder's ``mask``; punctuation and padding are
dropped, as ColBERT does), so scoring a gathered document gives the same number as scoring the encoder's output.

Choices (the paper only says "ANN search, then late-interaction re-ranking"; these follow ColBERT v1):
- Building is resumable and never leaves a half index behind: the corpus is encoded in chunks of ``chunk_docs``
  documents into ``<dir>.tmp-build/chunks`` (each file written under a temporary name, then renamed; a chunk's
  metadata JSON is written last and marks it finished), the chunks are concatenated into the final memmaps, and
  the folder is renamed to ``<dir>`` only when everything, ``index.json`` included, is written.
- ``faiss_kind="flat"`` is exact inner-product search (``IndexFlatIP``). Its content is exactly the fp16
  embeddings widened to fp32, so it is *not* written to disk (that would double the index size for nothing):
  :meth:`TokenIndex.faiss_index` rebuilds it in memory from the embeddings on first use. ``ivfflat`` / ``ivfpq``
  are trained on a random sample of tokens and written as ``<head>.faiss``.
- ``faiss_kind="plaid"`` is PLAID / ColBERTv2-style centroid pruning (no FAISS search at query time; see
  :mod:`hil.retrieval.plaid`), optionally with ColBERTv2 residual compression at 34 bytes per token (2 bits,
  D = 128) instead of 256 for fp16: then :attr:`TokenStore.embeddings` holds a decompressing array-like view.
- The encoder fingerprint hashes the settings (without the backbone *name*, which is only where the weights came
  from) and every parameter/buffer byte, so the same weights loaded from another folder still match.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from hil.provenance import fingerprint_strings, provenance, write_json_atomic
from hil.retrieval.fast_encode import document_encoder as encoder_for_documents, document_encoding_key

logger = logging.getLogger(__name__)

INDEX_FORMAT = "hil-token-index"
INDEX_FORMAT_VERSION = 1
INDEX_JSON = "index.json"
CALIBRATION_DOCS = 32  # documents whose activations calibrate int8 document encoding
DOC_IDS_JSON = "doc_ids.json"
DOC_OFFSETS_NPY = "doc_offsets.npy"
TOKEN_IDS_NPY = "token_ids.npy"
CHUNKS_DIR = "chunks"
FAISS_KINDS = ("flat", "ivfflat", "ivfpq", "plaid")
# Settings that only steer search, not what is stored: changing them never rebuilds anything.
SEARCH_TIME_PARAMS = frozenset({"nprobe", "ndocs", "stage2_docs"})
_HEAD_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")


class IndexMismatchError(ValueError):
    """An index on disk was built from another corpus or another encoder than the one expected."""


# -- fingerprints -----------------------------------------------------------------------------------------------

def fingerprint_corpus(doc_ids: Sequence[str], texts: Sequence[str]) -> str:
    """Order-sensitive fingerprint of a corpus: every (doc id, text) pair."""
    return fingerprint_strings(item for pair in zip(doc_ids, texts) for item in pair)


def encoder_fingerprint(encoder: torch.nn.Module) -> str:
    """SHA-256 of ``encoder.settings()`` (minus the backbone name) and of every parameter and buffer's bytes."""
    settings = {k: v for k, v in encoder.settings().items() if k != "backbone"}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode("utf-8"))
    for name, tensor in sorted(encoder.state_dict().items()):
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{flat.dtype}:{tuple(tensor.shape)}".encode("utf-8"))
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()[:16]


def _json_normalized(value: Any) -> Any:
    """What ``value`` becomes after a JSON round trip (tuples -> lists, ...), for comparisons with stored JSON."""
    return json.loads(json.dumps(value, default=str))


# -- small file helpers -----------------------------------------------------------------------------------------

def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """``np.save`` to a temporary name, then rename: a reader never sees half an array."""
    tmp = _tmp_name(path)
    with open(tmp, "wb") as handle:
        np.save(handle, array)
    os.replace(tmp, path)


def _write_faiss_atomic(index: Any, path: Path) -> None:
    import faiss

    tmp = _tmp_name(path)
    faiss.write_index(index, str(tmp))
    os.replace(tmp, path)


@contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Evaluation mode (no dropout) and no autograd for the duration; the training flag is restored after."""
    was_training = module.training
    # eval() / train() set a flag on every submodule (~2 ms for a BERT, per query in full ranking): skip both when
    # everything is already in eval mode, which is then exactly what they would have left.
    switch = any(m.training for m in module.modules())
    if switch:
        module.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        if switch:
            module.train(was_training)


# -- token stores -----------------------------------------------------------------------------------------------

class TokenStore:
    """Documents as flat token arrays: ``embeddings[head]`` (n_tokens, D) and ``doc_offsets`` (n_docs + 1,).

    The in-memory form (re-ranking texts encoded on the fly) and the base of :class:`TokenIndex`.
    """

    def __init__(self, doc_ids: list[str], doc_offsets: np.ndarray, embeddings: dict[str, np.ndarray],
                 token_ids: np.ndarray):
        self.doc_ids = list(doc_ids)
        self.doc_offsets = np.asarray(doc_offsets, dtype=np.int64)
        self.embeddings = embeddings
        self.token_ids = token_ids
        if len(self.doc_offsets) != len(self.doc_ids) + 1:
            raise ValueError(f"doc_offsets has {len(self.doc_offsets)} entries for {len(self.doc_ids)} documents "
                             "(expected n_docs + 1)")

    @property
    def head_names(self) -> tuple[str, ...]:
        return tuple(self.embeddings)

    @property
    def n_docs(self) -> int:
        return len(self.doc_ids)

    @property
    def n_tokens(self) -> int:
        return int(self.doc_offsets[-1])

    @property
    def dims(self) -> dict[str, int]:
        return {head: int(array.shape[1]) for head, array in self.embeddings.items()}

    def torch_view(self, name: str) -> torch.Tensor:
        """A CPU tensor sharing memory with ``embeddings[name]`` (or ``token_ids`` for ``"token_ids"``), cached.

        Read-only memmaps become read-only-backed tensors (torch warns about that once; the tensors are only read).
        """
        views = self.__dict__.setdefault("_torch_views", {})
        if name not in views:
            array = self.token_ids if name == "token_ids" else self.embeddings[name]
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*not writable.*")
                views[name] = torch.from_numpy(array)
        return views[name]

    @cached_property
    def doc_lengths(self) -> np.ndarray:
        """(n_docs,) int64: stored (scored) tokens per document."""
        return np.diff(self.doc_offsets)

    @cached_property
    def token_doc(self) -> np.ndarray:
        """(n_tokens,) int32: the document index of every stored token."""
        return np.repeat(np.arange(self.n_docs, dtype=np.int32), self.doc_lengths)

    @cached_property
    def doc_index(self) -> dict[str, int]:
        """Document id -> row."""
        return {doc_id: i for i, doc_id in enumerate(self.doc_ids)}

    @cached_property
    def doc_id_rank(self) -> np.ndarray:
        """(n_docs,) int64: the position of each document id in sorted id order (to break score ties by id)."""
        rank = np.empty(self.n_docs, dtype=np.int64)
        rank[np.argsort(np.array(self.doc_ids, dtype=str), kind="stable")] = np.arange(self.n_docs)
        return rank


@dataclass
class EncodedTokens:
    """Scored tokens of a list of documents, in the input order: the content of a :class:`TokenStore`."""

    embeddings: dict[str, np.ndarray]  # head -> (n_tokens, D)
    token_ids: np.ndarray              # (n_tokens,) int32
    lengths: np.ndarray                # (n_docs,) int64

    def to_store(self, doc_ids: list[str]) -> TokenStore:
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=offsets[1:])
        return TokenStore(doc_ids, offsets, self.embeddings, self.token_ids)


def document_token_lengths(encoder: Any, texts: Sequence[str]) -> np.ndarray:
    """Tokens per document after the encoder's tokenization (markers included), used to sort into batches."""
    return encoder.tokenizer.encode_documents(list(texts)).attention_mask.sum(dim=1).numpy()


def encode_document_tokens(encoder: Any, texts: Sequence[str], *, batch_size: int = 32,
                           dtype: np.dtype | type = np.float16, progress_bar: Any = None) -> EncodedTokens:
    """Encode ``texts`` and keep only the scored tokens of each document, flattened in input order.

    Documents are sorted by token length (longest first, so running out of memory shows up at once) and cut
    into batches: little padding. Call inside :func:`eval_mode`. ``progress_bar`` (tqdm) is advanced per batch.
    """
    n = len(texts)
    order = np.argsort(-document_token_lengths(encoder, texts), kind="stable")
    parts: dict[str, list[np.ndarray]] = {head: [] for head in encoder.head_names}
    id_parts: list[np.ndarray] = []
    sorted_lengths = np.zeros(n, dtype=np.int64)
    for start in range(0, n, batch_size):
        rows = order[start: start + batch_size]
        batch = encoder.encode_documents([texts[i] for i in rows])
        mask = batch.mask.bool()  # (B, L)
        for head in encoder.head_names:
            # Boolean indexing walks (B, L) row by row: the tokens of each document stay contiguous and in order.
            parts[head].append(batch.heads[head][mask].detach().to("cpu", torch.float32).numpy().astype(dtype))
        id_parts.append(batch.input_ids[mask].detach().cpu().numpy().astype(np.int32))
        sorted_lengths[start: start + len(rows)] = mask.sum(dim=1).cpu().numpy()
        if progress_bar is not None:
            progress_bar.update(len(rows))

    # Put documents back in input order with one gather: new token t of document i comes from its sorted block.
    sorted_offsets = np.concatenate([[0], np.cumsum(sorted_lengths)])
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    lengths = sorted_lengths[position]
    new_offsets = np.concatenate([[0], np.cumsum(lengths)])
    gather = np.repeat(sorted_offsets[position] - new_offsets[:-1], lengths) + np.arange(new_offsets[-1])
    dims = {head: int(encoder.dim) for head in encoder.head_names}
    embeddings = {}
    for head, chunks in parts.items():
        flat = np.concatenate(chunks) if chunks else np.zeros((0, dims[head]), dtype=dtype)
        embeddings[head] = flat[gather]
    token_ids = np.concatenate(id_parts)[gather] if id_parts else np.zeros(0, dtype=np.int32)
    return EncodedTokens(embeddings, token_ids, lengths)


# -- FAISS ------------------------------------------------------------------------------------------------------

def _largest_divisor_at_most(value: int, limit: int) -> int:
    return max(d for d in range(1, min(value, limit) + 1) if value % d == 0)


def check_faiss_options(kind: str, params: dict[str, Any] | None) -> dict[str, Any]:
    """Reject an unknown FAISS kind or a parameter that does not apply to it (before any work is done)."""
    if kind not in FAISS_KINDS:
        raise ValueError(f"faiss_kind must be one of {FAISS_KINDS}, got {kind!r}")
    params = dict(params or {})
    known = {"flat": set(), "ivfflat": {"nlist", "nprobe", "train_size", "seed"},
             "ivfpq": {"nlist", "nprobe", "train_size", "seed", "m", "nbits"},
             "plaid": {"n_centroids", "train_size", "niter", "seed", "nprobe", "ndocs", "stage2_docs",
                       "residual_bits", "keep_embeddings"}}[kind]
    unknown = set(params) - known
    if unknown:
        raise ValueError(f"faiss_params {sorted(unknown)} do not apply to faiss_kind={kind!r} (known: {sorted(known)})")
    return params


def resolve_faiss_params(kind: str, params: dict[str, Any] | None, n_tokens: int, dim: int) -> dict[str, Any]:
    """Complete FAISS settings with defaults, checking them against the number of tokens and the dimension.

    Defaults: ``nlist = min(4 sqrt(n_tokens), n_tokens / 39)`` (FAISS wants >= 39 training points per list),
    ``m`` = the largest divisor of D up to 16 (16 bytes per token with ``nbits=8``, ColBERT v1's setting),
    ``nbits = 8``, ``nprobe = 32`` (a search-time setting), ``train_size = min(n_tokens, max(100 nlist, 65536))``.
    """
    params = check_faiss_options(kind, params)
    if kind == "flat":
        return {}
    if kind == "plaid":
        return resolve_plaid_params(params, n_tokens, dim)
    nlist = int(params.get("nlist") or max(1, min(int(4 * math.sqrt(n_tokens)), n_tokens // 39)))
    resolved: dict[str, Any] = {"nlist": nlist, "nprobe": int(params.get("nprobe", 32)),
                                "train_size": int(params.get("train_size") or min(n_tokens, max(100 * nlist, 65536))),
                                "seed": int(params.get("seed", 0))}
    resolved["train_size"] = min(resolved["train_size"], n_tokens)
    if resolved["train_size"] < nlist:
        raise ValueError(f"faiss {kind}: nlist={nlist} needs at least {nlist} training tokens, the index has "
                         f"{n_tokens} tokens and train_size={resolved['train_size']}; lower faiss_params['nlist']")
    if kind == "ivfpq":
        m = int(params.get("m") or _largest_divisor_at_most(dim, 16))
        nbits = int(params.get("nbits", 8))
        if dim % m:
            raise ValueError(f"faiss ivfpq: m={m} must divide the embedding dimension {dim}")
        if not 1 <= nbits <= 16:
            raise ValueError(f"faiss ivfpq: nbits must be in 1..16, got {nbits}")
        if resolved["train_size"] < 2 ** nbits:
            raise ValueError(f"faiss ivfpq: nbits={nbits} needs at least {2 ** nbits} training tokens, got "
                             f"{resolved['train_size']}; lower faiss_params['nbits']")
        resolved.update(m=m, nbits=nbits)
    return resolved


def resolve_plaid_params(params: dict[str, Any], n_tokens: int, dim: int) -> dict[str, Any]:
    """Complete the settings of a ``plaid`` index (centroid pruning, :mod:`hil.retrieval.plaid`).

    Stored structure: ``n_centroids`` (default ColBERTv2's ``2**floor(log2(16 sqrt(n_tokens)))``), k-means on
    ``train_size`` sampled tokens (default ``min(n_tokens, 32 n_centroids)``) for ``niter`` iterations (default 4,
    ColBERTv2's),
    ``seed``; ``residual_bits`` (0 = none; 1, 2, 4 or 8) adds ColBERTv2 residual codes, and ``keep_embeddings=False``
    (only with residuals) then drops the fp16 vectors: search scores decompressed vectors.
    Search-time defaults: ``nprobe`` centroids per query token, ``stage2_docs`` documents kept by the probed-cells
    bound, ``ndocs`` documents kept by the centroid interaction and scored exactly (per head).
    """
    from hil.retrieval.codec import NBITS
    from hil.retrieval.plaid import default_n_centroids

    n_centroids = int(params.get("n_centroids") or default_n_centroids(n_tokens))
    if not 1 <= n_centroids <= max(1, n_tokens):
        raise ValueError(f"plaid: n_centroids={n_centroids} must lie in 1..n_tokens={n_tokens}")
    resolved: dict[str, Any] = {
        "n_centroids": n_centroids,
        "train_size": min(n_tokens, int(params.get("train_size") or 32 * n_centroids)),
        "niter": int(params.get("niter", 4)), "seed": int(params.get("seed", 0)),
        "nprobe": int(params.get("nprobe", 8)), "ndocs": int(params.get("ndocs", 256)),
        "stage2_docs": int(params.get("stage2_docs", 1024)),
        "residual_bits": int(params.get("residual_bits") or 0),
        "keep_embeddings": bool(params.get("keep_embeddings", True))}
    if resolved["train_size"] < n_centroids:
        raise ValueError(f"plaid: n_centroids={n_centroids} needs at least as many training tokens "
                         f"(train_size={resolved['train_size']})")
    for name in ("nprobe", "ndocs", "stage2_docs", "niter"):
        if resolved[name] < 1:
            raise ValueError(f"plaid: {name} must be >= 1, got {resolved[name]}")
    bits = resolved["residual_bits"]
    if bits and (bits not in NBITS or dim * bits % 8):
        raise ValueError(f"plaid: residual_bits must be 0 or one of {NBITS} (with D * bits a multiple of 8), got {bits}")
    if not resolved["keep_embeddings"] and not bits:
        raise ValueError("plaid: keep_embeddings=False needs residual_bits (the vectors must be stored somehow)")
    return resolved


def _factory_string(kind: str, params: dict[str, Any]) -> str:
    if kind == "flat":
        return "Flat"
    if kind == "plaid":
        return f"PLAID{params['n_centroids']}" + (f",R{params['residual_bits']}" if params["residual_bits"] else "")
    if kind == "ivfflat":
        return f"IVF{params['nlist']},Flat"
    return f"IVF{params['nlist']},PQ{params['m']}x{params['nbits']}"


def _to_gpu(index: Any) -> Any:
    import faiss

    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        logger.warning("use_gpu=True but faiss sees no GPU (faiss-cpu installed?): staying on the CPU")
        return index
    resources = faiss.StandardGpuResources()
    gpu_index = faiss.index_cpu_to_gpu(resources, 0, index)
    gpu_index.hil_resources = resources  # keep the resources alive as long as the index
    return gpu_index


def _is_gpu_index(index: Any) -> bool:
    return type(index).__name__.startswith("Gpu")


def set_nprobe(index: Any, nprobe: int) -> None:
    """Set the number of inverted lists visited per query vector (IVF indexes; a no-op for flat ones)."""
    import faiss

    try:
        faiss.extract_index_ivf(index).nprobe = int(nprobe)
    except RuntimeError:
        if hasattr(index, "nprobe"):
            index.nprobe = int(nprobe)


def build_faiss_index(embeddings: np.ndarray, kind: str = "flat", params: dict[str, Any] | None = None, *,
                      use_gpu: bool = False, block_tokens: int = 1 << 18) -> Any:
    """An inner-product FAISS index over ``embeddings`` (n_tokens, D), added in fp32 blocks from the memmap.

    IVF kinds are trained on ``train_size`` tokens drawn without replacement (seeded). Returns a CPU index unless
    ``use_gpu`` (then whatever :func:`_to_gpu` made of it).
    """
    import faiss

    n_tokens, dim = embeddings.shape
    params = resolve_faiss_params(kind, params, n_tokens, dim)
    index = faiss.index_factory(dim, _factory_string(kind, params), faiss.METRIC_INNER_PRODUCT)
    if use_gpu:
        index = _to_gpu(index)
    if kind != "flat":
        rng = np.random.default_rng(params["seed"])
        sample = np.sort(rng.choice(n_tokens, size=params["train_size"], replace=False))
        index.train(np.ascontiguousarray(embeddings[sample], dtype=np.float32))
        set_nprobe(index, params["nprobe"])
    for start in range(0, n_tokens, block_tokens):
        index.add(np.ascontiguousarray(embeddings[start: start + block_tokens], dtype=np.float32))
    return index


# -- the index on disk ------------------------------------------------------------------------------------------

_PLAID_FILES = ("centroids", "codes", "ivf_offsets", "ivf_docs", "residuals")


def _plaid_paths(directory: Path, head: str) -> dict[str, Path]:
    return {name: directory / f"{head}.{name}.npy" for name in _PLAID_FILES}


def _load_vectors(directory: Path, meta: dict[str, Any], head: str, mode: str | None) -> Any:
    """A head's (n_tokens, D) vectors: the fp16 memmap, or a decompressing view of a compressed-only index."""
    path = directory / f"{head}.embeddings.npy"
    if path.is_file():
        return np.load(path, mmap_mode=mode)
    codec_settings = meta.get("faiss", {}).get("codecs", {}).get(head)
    if codec_settings is None:
        raise FileNotFoundError(f"{path}: missing, and the index stores no compressed vectors for head {head!r}")
    from hil.retrieval.codec import CompressedEmbeddings, ResidualCodec

    paths = _plaid_paths(directory, head)
    codec = ResidualCodec(np.load(paths["centroids"]), int(codec_settings["nbits"]),
                          np.asarray(codec_settings["cutoffs"], dtype=np.float32),
                          np.asarray(codec_settings["weights"], dtype=np.float32))
    return CompressedEmbeddings(codec, np.load(paths["codes"], mmap_mode=mode),
                                np.load(paths["residuals"], mmap_mode=mode))


class TokenIndex(TokenStore):
    """A finished index folder, its arrays memory-mapped (see the module docstring for the layout)."""

    def __init__(self, directory: Path, meta: dict[str, Any], doc_ids: list[str], doc_offsets: np.ndarray,
                 embeddings: dict[str, np.ndarray], token_ids: np.ndarray):
        super().__init__(doc_ids, doc_offsets, embeddings, token_ids)
        self.directory = directory
        self.meta = meta
        self._faiss: dict[tuple[str, bool], Any] = {}

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
    def faiss_settings(self) -> dict[str, Any]:
        return self.meta["faiss"]

    def bytes_per_token(self) -> int:
        """Stored vector bytes per token, all heads together: the fp16 rows, or for a compressed-only index the
        centroid code plus the packed residual (token ids, FAISS / centroid structures not counted)."""
        total = 0
        for head, array in self.embeddings.items():
            if getattr(array, "codec", None) is not None:  # CompressedEmbeddings
                total += int(array.codes.dtype.itemsize + array.codec.packed_bytes)
            else:
                total += int(array.shape[1] * array.dtype.itemsize)
        return total

    def disk_bytes(self) -> int:
        """Bytes of every file in the index folder (vectors, ids, offsets, FAISS / centroid files, JSON)."""
        return int(sum(path.stat().st_size for path in self.directory.iterdir() if path.is_file()))

    @property
    def compressed_only(self) -> bool:
        """True when the index keeps residual-compressed vectors only (no fp16 rows)."""
        return any(getattr(array, "codec", None) is not None for array in self.embeddings.values())

    def plan(self, head: str) -> Any:
        """The :class:`~hil.retrieval.plaid.CentroidPlan` of ``head`` (``plaid`` indexes), loaded on first use."""
        from hil.retrieval.plaid import CentroidPlan

        if self.faiss_settings["kind"] != "plaid":
            raise ValueError(f"{self.directory}: a {self.faiss_settings['kind']!r} index has no centroid plan "
                             "(build it with faiss_kind='plaid')")
        if head not in self.embeddings:
            raise KeyError(f"{self.directory}: no head {head!r} (heads: {list(self.embeddings)})")
        plans = self.__dict__.setdefault("_plans", {})
        if head not in plans:
            paths = _plaid_paths(self.directory, head)
            plans[head] = CentroidPlan(np.load(paths["centroids"]), np.load(paths["codes"], mmap_mode="r"),
                                       np.load(paths["ivf_offsets"]), np.load(paths["ivf_docs"]), self.doc_offsets)
        return plans[head]

    @classmethod
    def load(cls, directory: str | os.PathLike, expect_corpus_fingerprint: str | None = None,
             expect_encoder_fingerprint: str | None = None, mmap: bool = True) -> "TokenIndex":
        """Open an index folder; refuse it when it was built from another corpus or encoder than expected."""
        directory = Path(directory)
        meta_path = directory / INDEX_JSON
        if not meta_path.is_file():
            unfinished = directory.with_name(directory.name + ".tmp-build")
            hint = f" ({unfinished} holds an unfinished build: rerun build_index to resume it)" \
                if unfinished.exists() else ""
            raise FileNotFoundError(f"{directory}: not a hil token index (no {INDEX_JSON}){hint}")
        with open(meta_path, encoding="utf-8") as handle:
            meta = json.load(handle)
        if meta.get("format") != INDEX_FORMAT or meta.get("format_version") != INDEX_FORMAT_VERSION:
            raise ValueError(f"{meta_path}: format {meta.get('format')!r} version {meta.get('format_version')!r}, "
                             f"expected {INDEX_FORMAT!r} version {INDEX_FORMAT_VERSION}")
        for what, expected in (("corpus", expect_corpus_fingerprint), ("encoder", expect_encoder_fingerprint)):
            found = meta.get(f"{what}_fingerprint")
            if expected is not None and found != expected:
                raise IndexMismatchError(
                    f"{directory}: index was built for {what} fingerprint {found}, but {what} fingerprint "
                    f"{expected} was expected; rebuild it (build_index(..., overwrite=True)) or use another folder")
        mode = "r" if mmap else None
        with open(directory / DOC_IDS_JSON, encoding="utf-8") as handle:
            doc_ids = json.load(handle)
        doc_offsets = np.load(directory / DOC_OFFSETS_NPY)
        embeddings = {head: _load_vectors(directory, meta, head, mode) for head in meta["heads"]}
        token_ids = np.load(directory / TOKEN_IDS_NPY, mmap_mode=mode)
        n_tokens = int(meta["n_tokens"])
        problems = []
        if len(doc_ids) != meta["n_docs"] or len(doc_offsets) != meta["n_docs"] + 1:
            problems.append(f"{len(doc_ids)} doc ids / {len(doc_offsets)} offsets for n_docs={meta['n_docs']}")
        if int(doc_offsets[-1]) != n_tokens or len(token_ids) != n_tokens:
            problems.append(f"offsets end at {int(doc_offsets[-1])}, {len(token_ids)} token ids, n_tokens={n_tokens}")
        problems += [f"{head}.embeddings.npy has shape {array.shape}" for head, array in embeddings.items()
                     if array.shape != (n_tokens, meta["dims"][head])]
        if problems:
            raise ValueError(f"{directory}: inconsistent index files: " + "; ".join(problems))
        return cls(directory, meta, doc_ids, doc_offsets, embeddings, token_ids)

    def faiss_index(self, head: str, *, use_gpu: bool = False, nprobe: int | None = None) -> Any:
        """The FAISS index of ``head``, loaded (or, for ``flat``, rebuilt from the embeddings) on first use."""
        if head not in self.embeddings:
            raise KeyError(f"{self.directory}: no head {head!r} (heads: {list(self.embeddings)})")
        key = (head, use_gpu)
        if key not in self._faiss:
            kind = self.faiss_settings["kind"]
            if kind == "plaid":
                raise ValueError(f"{self.directory}: a 'plaid' index searches centroids, not FAISS (use "
                                 "TokenIndex.plan(head), or full_rank which does)")
            if kind == "flat":
                index = build_faiss_index(self.embeddings[head], "flat", use_gpu=use_gpu)
            else:
                import faiss

                index = faiss.read_index(str(self.directory / f"{head}.faiss"))
                if use_gpu:
                    index = _to_gpu(index)
                set_nprobe(index, self.faiss_settings["params"]["nprobe"])
            self._faiss[key] = index
        index = self._faiss[key]
        if nprobe is not None:
            set_nprobe(index, nprobe)
        return index


def _build_faiss_files(directory: Path, embeddings: dict[str, np.ndarray], kind: str,
                       params: dict[str, Any] | None, use_gpu: bool, progress: bool) -> dict[str, Any]:
    """Write ``<head>.faiss`` for each head (IVF kinds) or the centroid files (``plaid``); return the FAISS part
    of ``index.json``. Files of another kind left from an earlier build are removed."""
    import faiss

    resolved = {}
    codecs: dict[str, Any] = {}
    for head, array in embeddings.items():
        resolved = resolve_faiss_params(kind, params, array.shape[0], array.shape[1])
        stale = directory / f"{head}.faiss"
        compressed = getattr(array, "codec", None)
        if compressed is not None:  # the centroid files hold the vectors themselves: keep them as they are
            if kind == "plaid":
                raise ValueError(f"{directory}: head {head!r} is stored compressed only; new centroids would need "
                                 "the original vectors: build the index again (build_index(..., overwrite=True))")
            codecs[head] = compressed.settings()
        elif kind != "plaid":
            for path in _plaid_paths(directory, head).values():
                path.unlink(missing_ok=True)
        if kind == "flat":
            stale.unlink(missing_ok=True)
            continue
        started = time.perf_counter()
        if kind == "plaid":
            stale.unlink(missing_ok=True)
            codec = _build_plaid_files(directory, head, array, resolved)
            if codec is not None:
                codecs[head] = codec.settings()
        else:
            index = build_faiss_index(array, kind, resolved, use_gpu=use_gpu)
            if _is_gpu_index(index):
                index = faiss.index_gpu_to_cpu(index)
            _write_faiss_atomic(index, directory / f"{head}.faiss")
        if progress:
            logger.info("faiss %s index of head %s: %.1f s", kind, head, time.perf_counter() - started)
    settings = {"kind": kind, "params": resolved, "factory": _factory_string(kind, resolved),
                "metric": "inner_product", "stored": kind != "flat"}
    if codecs:
        settings["codecs"] = codecs
    return settings


def _build_plaid_files(directory: Path, head: str, embeddings: Any, params: dict[str, Any]) -> Any:
    """Centroids, codes and inverted file of one head (and residual codes when asked); returns the codec or None.

    Every file is written under a temporary name, then renamed. With ``keep_embeddings=False`` the fp16 file
    is removed last, once the compressed vectors are in place.
    """
    from hil.retrieval.codec import fit_residual_codec
    from hil.retrieval.plaid import assign_codes, build_ivf, code_dtype, sample_rows, train_centroids

    n_tokens, dim = embeddings.shape
    paths = _plaid_paths(directory, head)
    centroids = train_centroids(embeddings, params["n_centroids"], train_size=params["train_size"],
                                niter=params["niter"], seed=params["seed"])
    codes_tmp = _tmp_name(paths["codes"])
    codes = np.lib.format.open_memmap(codes_tmp, mode="w+", dtype=code_dtype(len(centroids)), shape=(n_tokens,))
    assign_codes(embeddings, centroids, out=codes)
    codes.flush()
    doc_offsets = np.load(directory / DOC_OFFSETS_NPY)
    ivf_offsets, ivf_docs = build_ivf(np.asarray(codes), doc_offsets, len(centroids))
    codec = None
    if params["residual_bits"]:
        rows = sample_rows(n_tokens, min(n_tokens, 1 << 16), params["seed"] + 1)
        codec = fit_residual_codec(np.asarray(embeddings[rows], dtype=np.float32), np.asarray(codes[rows]),
                                   centroids, params["residual_bits"])
        residual_tmp = _tmp_name(paths["residuals"])
        packed = np.lib.format.open_memmap(residual_tmp, mode="w+", dtype=np.uint8,
                                           shape=(n_tokens, codec.packed_bytes))
        codec.compress_into(embeddings, codes, packed)
        packed.flush()
        del packed
        os.replace(residual_tmp, paths["residuals"])
    else:
        paths["residuals"].unlink(missing_ok=True)
    del codes
    os.replace(codes_tmp, paths["codes"])
    save_npy_atomic(paths["centroids"], centroids)
    save_npy_atomic(paths["ivf_offsets"], ivf_offsets)
    save_npy_atomic(paths["ivf_docs"], ivf_docs)
    if not params["keep_embeddings"]:
        (directory / f"{head}.embeddings.npy").unlink(missing_ok=True)
    return codec


def rebuild_faiss(index: TokenIndex, faiss_kind: str, faiss_params: dict[str, Any] | None = None, *,
                  use_gpu: bool = False, progress: bool = True) -> TokenIndex:
    """Replace the FAISS part of a finished index (the embeddings stay), updating ``index.json``."""
    settings = _build_faiss_files(index.directory, index.embeddings, faiss_kind, faiss_params, use_gpu, progress)
    meta = dict(index.meta, faiss=settings)
    write_json_atomic(index.directory / INDEX_JSON, meta)
    first = next(iter(index.embeddings.values()))
    return TokenIndex.load(index.directory, mmap=isinstance(first, np.memmap) or getattr(first, "codec", None) is not None)


# -- building ---------------------------------------------------------------------------------------------------

def _chunk_paths(chunks: Path, number: int, heads: Sequence[str]) -> dict[str, Path]:
    stem = f"chunk-{number:05d}"
    paths = {f"emb:{head}": chunks / f"{stem}.{head}.npy" for head in heads}
    paths.update(token_ids=chunks / f"{stem}.token_ids.npy", lengths=chunks / f"{stem}.lengths.npy",
                 meta=chunks / f"{stem}.json")
    return paths


def _finished_chunk(paths: dict[str, Path], expected: dict[str, Any]) -> dict[str, Any] | None:
    """The metadata of a finished chunk matching ``expected`` (index, doc range, settings, fingerprints), or None."""
    if not paths["meta"].is_file():
        return None
    try:
        with open(paths["meta"], encoding="utf-8") as handle:
            meta = json.load(handle)
    except (OSError, json.JSONDecodeError):
        return None
    if any(meta.get(key) != value for key, value in expected.items()):
        return None
    if not all(path.is_file() for path in paths.values()):
        return None
    return meta


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


def _calibration_texts(texts: Sequence[str], calibration_docs: int) -> list[str]:
    """The documents a calibrated document encoding (``int8``, ``onnx-int8``) measures its activations on."""
    return list(texts[:max(1, calibration_docs)])


def build_index(encoder: Any, doc_ids: Sequence[str], texts: Sequence[str], directory: str | os.PathLike, *,
                batch_size: int = 32, chunk_docs: int = 2048, faiss_kind: str = "flat",
                faiss_params: dict[str, Any] | None = None, corpus_fingerprint: str | None = None,
                progress: bool = True, overwrite: bool = False, use_gpu: bool = False,
                quantize: str | None = None, calibration_docs: int = CALIBRATION_DOCS) -> TokenIndex:
    """Encode a corpus into a token index at ``directory`` (resumable, finalized atomically; see module docstring).

    ``corpus_fingerprint`` defaults to :func:`fingerprint_corpus` of the ids and texts. ``use_gpu`` trains/fills
    IVF indexes with faiss-gpu.

    Memory: at most one chunk of ``chunk_docs`` documents is held while encoding (its fp32 token vectors, about
    ``chunk_docs * 4 * D * tokens_per_doc`` bytes, plus the model's activations for one ``batch_size`` batch);
    the chunks are then streamed into the final memmaps, so ``chunk_docs`` is the memory knob for corpora larger
    than RAM (``bench/README.md`` has measured peak RSS against it).

    ``quantize`` picks a cheaper document encoder (queries always keep ``encoder``); recorded in ``index.json`` as
    ``document_encoding``; None (default) encodes with ``encoder`` itself. Measured in bench/README:
    ``"onnx-int8"`` (:mod:`hil.retrieval.onnx_encode`: ONNX Runtime, fused layers, int8 matrix products) is the
    fast one on a CPU, at a small measured cost in nDCG@10; ``"onnx"`` is the same runtime in fp32 (same vectors);
    ``"int8"`` is PyTorch SmoothQuant + dynamic int8 (:mod:`hil.retrieval.fast_encode`, calibrated on the first
    ``calibration_docs`` texts); ``"compile"`` is ``torch.compile`` in fp32 (same vectors).
    """
    from tqdm.auto import tqdm

    _check_corpus(doc_ids, texts)
    if batch_size < 1 or chunk_docs < 1:
        raise ValueError(f"batch_size and chunk_docs must be >= 1 (got {batch_size}, {chunk_docs})")
    heads = tuple(encoder.head_names)
    for head in heads:
        if not _HEAD_NAME.match(head):
            raise ValueError(f"head name {head!r} cannot be a file name part (letters, digits, _ and - only)")
    check_faiss_options(faiss_kind, faiss_params)
    directory = Path(directory)
    if directory.exists() and not overwrite:
        raise FileExistsError(f"{directory} exists; pass overwrite=True to replace it, or use open_or_build_index")
    if directory.exists() and not (directory / INDEX_JSON).is_file() and any(directory.iterdir()):
        raise FileExistsError(f"{directory} exists and is not a hil token index (no {INDEX_JSON}): "
                              "refusing to overwrite it")
    corpus_fp = corpus_fingerprint or fingerprint_corpus(doc_ids, texts)
    encoder_fp = encoder_fingerprint(encoder)
    settings = _json_normalized(encoder.settings())
    document_encoder = encoder_for_documents(encoder, quantize,
                                             calibration_texts=_calibration_texts(texts, calibration_docs))
    document_encoding = document_encoder.document_encoding if quantize is not None else None

    build = directory.with_name(directory.name + ".tmp-build")
    chunks = build / CHUNKS_DIR
    chunks.mkdir(parents=True, exist_ok=True)
    for leftover in build.iterdir():  # files of an earlier, different attempt; finished chunks are kept
        if leftover.name != CHUNKS_DIR:
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()

    n_docs = len(doc_ids)
    starts = list(range(0, n_docs, chunk_docs))
    chunk_metas: list[dict[str, Any]] = []
    bar = tqdm(total=n_docs, unit="doc", desc=f"encoding {directory.name}", disable=not progress)
    with eval_mode(document_encoder):
        for number, start in enumerate(starts):
            end = min(start + chunk_docs, n_docs)
            paths = _chunk_paths(chunks, number, heads)
            expected = {"format_version": INDEX_FORMAT_VERSION, "chunk": number, "doc_start": start, "doc_end": end,
                        "heads": list(heads), "settings": settings, "encoder_fingerprint": encoder_fp,
                        "corpus_fingerprint": corpus_fp, "document_encoding": document_encoding}
            meta = _finished_chunk(paths, expected)
            if meta is not None:
                bar.update(end - start)
            else:
                encoded = encode_document_tokens(document_encoder, texts[start:end], batch_size=batch_size,
                                                 progress_bar=bar)
                for head in heads:
                    save_npy_atomic(paths[f"emb:{head}"], encoded.embeddings[head])
                save_npy_atomic(paths["token_ids"], encoded.token_ids)
                save_npy_atomic(paths["lengths"], encoded.lengths)
                meta = dict(expected, n_tokens=int(encoded.lengths.sum()),
                            dims={head: int(encoded.embeddings[head].shape[1]) for head in heads})
                write_json_atomic(paths["meta"], meta)  # last: its presence marks the chunk finished
                del encoded
            chunk_metas.append(meta)
    bar.close()

    # Concatenate the chunks into the final memmaps.
    n_tokens = sum(meta["n_tokens"] for meta in chunk_metas)
    dims = chunk_metas[0]["dims"]
    targets = {head: np.lib.format.open_memmap(build / f"{head}.embeddings.npy", mode="w+", dtype=np.float16,
                                               shape=(n_tokens, dims[head])) for head in heads}
    token_ids = np.lib.format.open_memmap(build / TOKEN_IDS_NPY, mode="w+", dtype=np.int32, shape=(n_tokens,))
    lengths = np.zeros(n_docs, dtype=np.int64)
    cursor = 0
    for number, (start, meta) in enumerate(zip(starts, chunk_metas)):
        paths = _chunk_paths(chunks, number, heads)
        count = meta["n_tokens"]
        for head in heads:
            targets[head][cursor: cursor + count] = np.load(paths[f"emb:{head}"], mmap_mode="r")
        token_ids[cursor: cursor + count] = np.load(paths["token_ids"], mmap_mode="r")
        lengths[start: meta["doc_end"]] = np.load(paths["lengths"])
        cursor += count
    for array in (*targets.values(), token_ids):
        array.flush()
    del targets, token_ids
    offsets = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    save_npy_atomic(build / DOC_OFFSETS_NPY, offsets)
    write_json_atomic(build / DOC_IDS_JSON, list(doc_ids))

    embeddings = {head: np.load(build / f"{head}.embeddings.npy", mmap_mode="r") for head in heads}
    faiss_settings = _build_faiss_files(build, embeddings, faiss_kind, faiss_params, use_gpu, progress)
    del embeddings
    shutil.rmtree(chunks)
    meta = provenance(settings, format=INDEX_FORMAT, format_version=INDEX_FORMAT_VERSION, n_docs=n_docs,
                      n_tokens=n_tokens, heads=list(heads), dims=dims,
                      dim=next(iter(dims.values())) if len(set(dims.values())) == 1 else None,
                      embedding_dtype="float16", faiss=faiss_settings, corpus_fingerprint=corpus_fp,
                      encoder_fingerprint=encoder_fp,
                      **({"document_encoding": document_encoding} if document_encoding else {}))
    write_json_atomic(build / INDEX_JSON, meta)

    if directory.exists():  # overwrite: swap in the new folder, then drop the old one
        old = directory.with_name(directory.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(directory, old)
        os.replace(build, directory)
        shutil.rmtree(old)
    else:
        os.replace(build, directory)
    return TokenIndex.load(directory)


def open_or_build_index(encoder: Any, doc_ids: Sequence[str], texts: Sequence[str], directory: str | os.PathLike,
                        *, corpus_fingerprint: str | None = None, faiss_kind: str = "flat",
                        faiss_params: dict[str, Any] | None = None, use_gpu: bool = False,
                        **build_kwargs: Any) -> TokenIndex:
    """Reuse the index at ``directory`` when it matches this corpus and encoder, else (re)build it.

    When only the FAISS settings differ (``nprobe`` aside, a search-time setting), only the FAISS part is rebuilt.
    """
    directory = Path(directory)
    corpus_fp = corpus_fingerprint or fingerprint_corpus(doc_ids, texts)
    if (directory / INDEX_JSON).is_file():
        try:
            index = TokenIndex.load(directory, expect_corpus_fingerprint=corpus_fp,
                                    expect_encoder_fingerprint=encoder_fingerprint(encoder))
        except IndexMismatchError as error:
            logger.warning("%s; rebuilding it", error)
        else:
            stored = index.faiss_settings
            calibration = _calibration_texts(texts, build_kwargs.get("calibration_docs", CALIBRATION_DOCS))
            wanted_encoding = document_encoding_key(build_kwargs.get("quantize"), len(calibration))
            recorded = index.meta.get("document_encoding") or {}
            if bool(recorded) != bool(wanted_encoding) or any(
                    recorded.get(key) != value for key, value in wanted_encoding.items()):
                logger.info("%s: documents were encoded with %s, %s wanted: rebuilding it", directory,
                            recorded, wanted_encoding)
                return build_index(encoder, doc_ids, texts, directory, faiss_kind=faiss_kind,
                                   faiss_params=faiss_params, corpus_fingerprint=corpus_fp, use_gpu=use_gpu,
                                   overwrite=True, **build_kwargs)
            wanted = {head: resolve_faiss_params(faiss_kind, faiss_params, index.n_tokens, dim)
                      for head, dim in index.dims.items()}
            stored_params = {k: v for k, v in stored["params"].items() if k not in SEARCH_TIME_PARAMS}
            if stored["kind"] == faiss_kind and all(
                    {k: v for k, v in params.items() if k not in SEARCH_TIME_PARAMS} == stored_params
                    for params in wanted.values()):
                return index
            if index.compressed_only:  # no fp16 vectors to build other structures from: encode again
                logger.info("%s: compressed-only index with other settings: rebuilding it", directory)
                return build_index(encoder, doc_ids, texts, directory, faiss_kind=faiss_kind,
                                   faiss_params=faiss_params, corpus_fingerprint=corpus_fp, use_gpu=use_gpu,
                                   overwrite=True, **build_kwargs)
            logger.info("%s: FAISS settings differ (%s -> %s): rebuilding the FAISS part only", directory,
                        stored["kind"], faiss_kind)
            return rebuild_faiss(index, faiss_kind, faiss_params, use_gpu=use_gpu,
                                 progress=build_kwargs.get("progress", True))
    return build_index(encoder, doc_ids, texts, directory, faiss_kind=faiss_kind, faiss_params=faiss_params,
                       corpus_fingerprint=corpus_fp, use_gpu=use_gpu, overwrite=True, **build_kwargs)
