"""Centroid pruning for full ranking (PLAID / ColBERTv2-style): k-means centroids over the document token vectors,
an inverted file from centroids to documents, and cheap approximate MaxSim from centroid scores.

Santhanam et al. 2022 (ColBERTv2, Sec. 3.4; PLAID, Sec. 4) replace ColBERT v1's token-level ANN search by
centroids: every stored token ``d_j`` is represented by its nearest centroid ``c(j)``, and

    approx(q, d) = sum_i max_j  q_i . C_{c(j)}                                   (centroid interaction, PLAID Eq. 3)

is an estimate of Eq. 1 (``sum_i max_j q_i . d_j``) that costs one (Lq, n_centroids) matrix product per query
plus table look-ups. Full ranking then runs in stages, each keeping fewer documents:

1. *probe*: each query token picks its ``nprobe`` best centroids; the candidates are the documents owning a token
   in any probed centroid (the inverted file ``ivf``).
2. *cell score*: a lower bound of the centroid interaction that only looks at probed centroids,
   ``sum_i max_{c in probe(i), d in ivf(c)} q_i . C_c`` (one scatter-max over the probed lists); the best
   ``stage2_docs`` candidates go on.
3. *centroid interaction* over every token of those documents (the formula above); the best ``ndocs`` go on.
4. exact late interaction (``encoder.score``) over the stored vectors (fp16, or decompressed residuals).

Choices (the papers give the idea; the numbers here are ours, measured on SciFact in ``bench/``):
- ``n_centroids`` defaults to ColBERTv2's ``2 ** floor(log2(16 sqrt(n_tokens)))`` capped by ``n_tokens / 8``;
  k-means is spherical (centroids are L2-normalized after every iteration, as the vectors are), trained on a
  seeded sample of ``train_size`` tokens for ``niter`` iterations (ColBERTv2 uses 4-20), by FAISS or by the same
  algorithm in torch on the build's GPU (:mod:`hil.retrieval.kmeans`; ``PlaidIndexConfig.kmeans``).
- Stage 2 replaces PLAID's score threshold by a fixed count (``stage2_docs``): its cost is then bounded per query
  whatever the corpus, and a count is easier to reason about than a score threshold across models.
- Documents with no stored token score 0 at every stage, as in Eq. 1 with an empty document.

Where it runs: the search stages are :mod:`hil.retrieval.plaid_search` (torch on one device, for a batch of
queries at once; one query is the batch of one); the plan's arrays are uploaded to that device once per opened
index (:meth:`CentroidPlan.tables`). The centroid scores are one exact torch product on that device, not a FAISS
search (faiss-gpu or not): stage 3 reads the score of *every* centroid, which a k-nearest-centroid search would
not give.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from hil.provenance import atomic_output
from hil.retrieval.backends.configs import ASSIGNMENTS
from hil.retrieval.devices import canonical_device, host_tensor, upload_rows
from hil.retrieval.index import save_npy_atomic
from hil.retrieval.kmeans import FAISS_ON_CPU, KMeansEngine, nearest_centroids, spherical_kmeans
from hil.retrieval.two_level import CentroidGroups, assign_codes_coarse, two_level_kmeans

# Rows of the (n_tokens, D) table handled at once when assigning codes: bounds the fp32 copy (16 MiB at D=128).
_ASSIGN_BLOCK = 1 << 15
# The same on a GPU (torch): 256 MiB of fp16 rows at D=128 per copy, few copies; the scores are blocked there again.
_ASSIGN_BLOCK_DEVICE = 1 << 20
# Tokens per block of the inverted file's build (write_ivf): bounds its temporaries (~150 MB at 8M tokens).
IVF_BLOCK_TOKENS = 1 << 23
# Above this many tokens stage 3 reads each document's stored codes instead of its distinct centroids (document_codes).
DISTINCT_CODES_MAX_TOKENS = 1 << 25


def default_n_centroids(n_tokens: int) -> int:
    """ColBERTv2's partition count ``2 ** floor(log2(16 sqrt(n_tokens)))``, at most ``n_tokens // 8``, at least 1."""
    if n_tokens < 1:
        return 1
    count = 2 ** int(math.floor(math.log2(16 * math.sqrt(n_tokens))))
    return int(max(1, min(count, n_tokens // 8)))


def sample_rows(n_rows: int, size: int, seed: int) -> np.ndarray:
    """``size`` distinct row numbers out of ``n_rows``, ascending (memmap reads stay sequential), seeded."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n_rows, size=min(size, n_rows), replace=False))


@dataclass(frozen=True)
class CentroidAssignment:
    """How a token's centroid is found (``PlaidIndexConfig.assignment``): ``exact`` scores every centroid (FAISS's
    ``IndexFlatIP`` or :func:`~hil.retrieval.kmeans.nearest_centroids` on the engine's device); ``two-level`` takes
    the best member of the ``nprobe`` groups nearest to the token (:mod:`hil.retrieval.two_level`: ~sqrt(C) groups,
    each scoring ~sqrt(C) centroids, instead of all C), the groups those of the two-level k-means that trained the
    centroids."""

    method: str = "exact"
    groups: CentroidGroups | None = None
    nprobe: int = 0

    def __post_init__(self) -> None:
        if self.method not in ASSIGNMENTS[1:]:
            raise ValueError(f"assignment method must be one of {ASSIGNMENTS[1:]}, got {self.method!r}")
        if self.method == "two-level" and (self.groups is None or self.nprobe < 1):
            raise ValueError("a two-level assignment needs the centroids' groups and nprobe >= 1")

    def record(self) -> dict[str, Any]:
        if self.method == "exact":
            return {"method": "exact"}
        return {"method": self.method, "nprobe": self.nprobe, "n_groups": self.groups.n_groups}


EXACT = CentroidAssignment()


def train_centroids(embeddings: np.ndarray, n_centroids: int, *, train_size: int, niter: int = 10,
                    seed: int = 0, engine: KMeansEngine = FAISS_ON_CPU) -> np.ndarray:
    """Spherical k-means on a seeded sample of token vectors. embeddings (n_tokens, D) -> (C, D) float32.

    The centroids are L2-normalized, so ``q . C_c`` is a cosine like every score in late interaction. ``engine``
    (:func:`hil.retrieval.kmeans.kmeans_engine`): FAISS's ``Kmeans`` (on every GPU faiss-gpu sees when
    ``engine.faiss_gpu`` is set: MS MARCO's 2^18 centroids, bench/README.md), or the same algorithm in torch on
    ``engine.device`` (:func:`~hil.retrieval.kmeans.spherical_kmeans`, the sample kept in its stored dtype).
    """
    centroids, _ = train_plaid_centroids(embeddings, n_centroids, train_size=train_size, niter=niter, seed=seed,
                                         engine=engine)
    return centroids


def train_plaid_centroids(embeddings: np.ndarray, n_centroids: int, *, train_size: int, niter: int = 10,
                          seed: int = 0, engine: KMeansEngine = FAISS_ON_CPU, method: str = "exact",
                          nprobe: int = 0, on_cluster: Callable[[int], None] | None = None
                          ) -> tuple[np.ndarray, CentroidAssignment]:
    """:func:`train_centroids`, and how tokens are then assigned to the centroids: ``method="exact"`` trains by
    flat k-means (FAISS or torch, as ``engine``) and assigns exactly; ``"two-level"`` trains by coarse-to-fine
    k-means in torch on ``engine.device`` (:func:`~hil.retrieval.two_level.two_level_kmeans`: ~sqrt(C) coarse
    clusters, then each one's share of the C centroids; FAISS's ``contrib/clustering.py two_level_clustering``)
    and assigns through its groups, ``nprobe`` of them per token. -> (centroids (C, D) float32, the assignment).

    The sample is every row when ``train_size`` covers the table (the compressed build passes its sample as the
    table: nothing is copied from a memory map but what k-means reads). ``on_cluster``: two-level's progress
    (:func:`~hil.retrieval.two_level.two_level_kmeans`)."""
    n_tokens, dim = embeddings.shape
    if not 1 <= n_centroids <= n_tokens:
        raise ValueError(f"n_centroids must lie in 1..n_tokens={n_tokens}, got {n_centroids}")
    whole = max(train_size, n_centroids) >= n_tokens
    rows = None if whole else sample_rows(n_tokens, max(train_size, n_centroids), seed)
    assignment = EXACT
    if method == "two-level":
        sample = host_tensor(embeddings if whole else embeddings[rows]).to(engine.device)  # (S, D), stored dtype
        result = two_level_kmeans(sample, n_centroids, niter=niter, seed=seed, on_cluster=on_cluster)
        centroids = result.centroids.cpu().numpy()
        groups = CentroidGroups.from_two_level(result)
        assignment = CentroidAssignment("two-level", CentroidGroups(groups.group_centroids.cpu(), groups.members,
                                                                    groups.offsets), nprobe)
    elif engine.name == "torch":
        sample = host_tensor(embeddings if whole else embeddings[rows]).to(engine.device)  # (S, D)
        centroids = spherical_kmeans(sample, n_centroids, niter=niter, seed=seed).centroids.cpu().numpy()
    else:
        centroids = _faiss_kmeans(np.ascontiguousarray(embeddings if whole else embeddings[rows], dtype=np.float32),
                                  n_centroids, niter=niter, seed=seed, gpu=engine.faiss_gpu is not None)
    norms = np.linalg.norm(centroids, axis=1, keepdims=True)
    return centroids / np.maximum(norms, 1e-12), assignment


def _faiss_kmeans(sample: np.ndarray, n_centroids: int, *, niter: int, seed: int, gpu: bool) -> np.ndarray:
    """FAISS's spherical ``Kmeans`` on ``sample`` (S, D) float32 -> (C, D) float32 (``gpu``: every GPU it sees)."""
    import faiss

    # FAISS subsamples to max_points_per_centroid * k on its own; the sample is already what we want.
    gpus = faiss.get_num_gpus() if gpu and hasattr(faiss, "StandardGpuResources") else 0
    kmeans = faiss.Kmeans(sample.shape[1], n_centroids, niter=niter, seed=seed, spherical=True, verbose=False,
                          max_points_per_centroid=max(256, len(sample) // n_centroids + 1),
                          **({"gpu": gpus} if gpus else {}))
    kmeans.train(sample)
    return np.asarray(kmeans.centroids, dtype=np.float32).reshape(n_centroids, sample.shape[1])


def code_dtype(n_centroids: int) -> np.dtype:
    """The smallest unsigned type holding a centroid number: uint16 up to 65,536 centroids, else int32."""
    return np.dtype(np.uint16) if n_centroids <= 1 << 16 else np.dtype(np.int32)


def assign_codes(embeddings: np.ndarray, centroids: np.ndarray, *, block_tokens: int | None = None,
                 out: np.ndarray | None = None, engine: KMeansEngine = FAISS_ON_CPU,
                 assignment: CentroidAssignment = EXACT) -> np.ndarray:
    """The nearest centroid (largest inner product; ties: the lowest number) of every token. -> (n_tokens,)
    ``code_dtype``.

    Reads ``embeddings`` (a memmap is fine) in blocks of ``block_tokens`` rows; ``out`` may be a memmap too.
    ``engine``: FAISS's ``IndexFlatIP`` (on ``engine.faiss_gpu`` where faiss-gpu sees it, else the CPU), or torch
    on ``engine.device`` (:func:`~hil.retrieval.kmeans.nearest_centroids`: fp32 products, the same choice as
    FAISS's but for scores equal to rounding). A block is one copy to the device and one back. A ``two-level``
    ``assignment`` searches the centroids' groups instead (:func:`~hil.retrieval.two_level.assign_codes_coarse`,
    torch on ``engine.device``; the nearest centroid among the probed groups' members).
    """
    n_tokens = embeddings.shape[0]
    codes = out if out is not None else np.empty(n_tokens, dtype=code_dtype(len(centroids)))
    if assignment.method == "two-level":
        return assign_codes_coarse(embeddings, centroids, assignment.groups, nprobe=assignment.nprobe, out=codes,
                                   device=engine.device if engine.name == "torch" else "cpu")
    if engine.name == "torch":
        block_tokens = block_tokens or (_ASSIGN_BLOCK_DEVICE if engine.device.type != "cpu" else _ASSIGN_BLOCK)
        table = host_tensor(centroids, np.float32).to(engine.device)
        for start in range(0, n_tokens, block_tokens):
            block = host_tensor(embeddings[start: start + block_tokens])
            nearest, _ = nearest_centroids(block.to(engine.device), table)  # stored dtype up, fp32 products there
            codes[start: start + len(block)] = nearest.cpu().numpy()
        return codes
    return _faiss_assign(embeddings, centroids, codes, block_tokens or _ASSIGN_BLOCK, engine.faiss_gpu)


def _faiss_assign(embeddings: np.ndarray, centroids: np.ndarray, codes: np.ndarray, block_tokens: int,
                  gpu_device: int | None) -> np.ndarray:
    """:func:`assign_codes` by FAISS's ``IndexFlatIP``, on GPU ``gpu_device`` where faiss-gpu sees it."""
    import faiss

    search = faiss.IndexFlatIP(centroids.shape[1])
    resources = None
    if gpu_device is not None and hasattr(faiss, "StandardGpuResources") and gpu_device < faiss.get_num_gpus():
        resources = faiss.StandardGpuResources()  # kept alive while the GPU index is used
        search = faiss.index_cpu_to_gpu(resources, int(gpu_device), search)
    search.add(np.ascontiguousarray(centroids, dtype=np.float32))
    for start in range(0, len(codes), block_tokens):
        block = np.ascontiguousarray(embeddings[start: start + block_tokens], dtype=np.float32)
        _, nearest = search.search(block, 1)  # (b, 1)
        codes[start: start + len(block)] = nearest[:, 0]
    return codes


def build_ivf(codes: np.ndarray, doc_offsets: np.ndarray, n_centroids: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverted file: for each centroid, the documents owning at least one of its tokens (ascending).

    codes (n_tokens,), doc_offsets (n_docs + 1,) -> (ivf_offsets (C + 1,) int64, ivf_docs (E,) int32): centroid c
    lists ``ivf_docs[ivf_offsets[c]: ivf_offsets[c + 1]]``.
    """
    n_docs = len(doc_offsets) - 1
    token_doc = np.repeat(np.arange(n_docs, dtype=np.int32), np.diff(doc_offsets))
    # Tokens are stored document after document, so a stable sort by centroid keeps each centroid's documents
    # ascending: (centroid, document) order without sorting 64-bit keys (np.unique did: 25x slower on SciFact; a
    # stable sort of uint16 codes is a radix sort). Then one entry per run of equal pairs.
    order = np.argsort(codes, kind="stable")
    cells, docs = codes[order], token_doc[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = (cells[1:] != cells[:-1]) | (docs[1:] != docs[:-1])
    offsets = np.zeros(n_centroids + 1, dtype=np.int64)
    np.cumsum(np.bincount(cells[first], minlength=n_centroids), out=offsets[1:])
    return offsets, docs[first]


def document_blocks(doc_offsets: np.ndarray, block_tokens: int) -> list[tuple[int, int]]:
    """Consecutive ``[first, end)`` document ranges of about ``block_tokens`` tokens each (whole documents)."""
    n_docs, n_tokens = len(doc_offsets) - 1, int(doc_offsets[-1])
    cuts = np.searchsorted(doc_offsets, np.arange(block_tokens, n_tokens, block_tokens), side="right") - 1
    bounds = np.unique(np.concatenate([[0], cuts, [n_docs]]))
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def write_ivf(codes: np.ndarray, doc_offsets: np.ndarray, n_centroids: int, offsets_path: Path, docs_path: Path, *,
              block_tokens: int = IVF_BLOCK_TOKENS, progress_bar: Any = None) -> tuple[int, int]:
    """:func:`build_ivf` written to ``offsets_path`` / ``docs_path`` (``.npy``, each atomically) in bounded memory:
    the same two arrays, computed in blocks of whole documents of about ``block_tokens`` tokens, twice over the
    codes (a memmap is fine): once counting each centroid's entries, once placing them. Blocks follow the
    documents, so each centroid's documents stay ascending. -> (n_entries, blocks); ``progress_bar`` advances by
    2 per block."""
    blocks = document_blocks(np.asarray(doc_offsets), block_tokens)
    counts = np.zeros(n_centroids, dtype=np.int64)
    for first, end in blocks:
        cells, _ = _block_entries(codes, doc_offsets, first, end)
        counts += np.bincount(cells, minlength=n_centroids)
        if progress_bar is not None:
            progress_bar.update(1)
    offsets = np.zeros(n_centroids + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    n_entries = int(offsets[-1])
    cursor = offsets[:-1].copy()
    with atomic_output(docs_path) as tmp:
        docs_out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int32, shape=(n_entries,))
        for first, end in blocks:
            cells, docs = _block_entries(codes, doc_offsets, first, end)  # sorted by (cell, document)
            run_start = np.flatnonzero(np.concatenate([[True], cells[1:] != cells[:-1]]))
            rank = np.arange(len(cells)) - np.repeat(run_start, np.diff(np.append(run_start, len(cells))))
            docs_out[cursor[cells] + rank] = docs
            cursor += np.bincount(cells, minlength=n_centroids)
            if progress_bar is not None:
                progress_bar.update(1)
        docs_out.flush()
        del docs_out
    save_npy_atomic(offsets_path, offsets)
    return n_entries, len(blocks)


def _block_entries(codes: np.ndarray, doc_offsets: np.ndarray, first: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (centroid, document) pairs of documents ``[first, end)``, sorted by centroid then document."""
    lo, hi = int(doc_offsets[first]), int(doc_offsets[end])
    block = np.asarray(codes[lo:hi])
    token_doc = np.repeat(np.arange(first, end, dtype=np.int32), np.diff(doc_offsets[first: end + 1]))
    order = np.argsort(block, kind="stable")  # tokens are in document order: documents stay ascending per cell
    cells, docs = block[order], token_doc[order]
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = (cells[1:] != cells[:-1]) | (docs[1:] != docs[:-1])
    return cells[keep].astype(np.int64), docs[keep]


def distinct_doc_codes(ivf_offsets: np.ndarray, ivf_docs: np.ndarray, n_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """Each document's distinct centroids, ascending: the inverted file read by document instead of by centroid
    (its entries are exactly the distinct (centroid, document) pairs). -> (doc_codes (E,) int32, doc_code_offsets
    (n_docs + 1,) int64): document d's centroids are ``doc_codes[doc_code_offsets[d]: doc_code_offsets[d + 1]]``.

    Why: stage 3's ``max_j q_i . C_{c(j)}`` over a document's tokens is the max over its distinct centroids, and a
    document repeats centroids a lot (SciFact, MiniLM, 8,192 centroids: 454,310 distinct of 815,632 tokens, 56%),
    so centroid interaction reads about half the scores for the same values. Costs one stable sort of the E
    entries at the first search of an opened index.
    """
    cells = np.repeat(np.arange(len(ivf_offsets) - 1, dtype=np.int32), np.diff(ivf_offsets))
    order = np.argsort(ivf_docs, kind="stable")  # by document; centroids stay ascending within one
    offsets = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(np.bincount(ivf_docs, minlength=n_docs), out=offsets[1:])
    return cells[order], offsets


def document_codes(plan: "CentroidPlan") -> tuple[np.ndarray, np.ndarray]:
    """What stage 3 reads for each document: its distinct centroids (:func:`distinct_doc_codes`), or, for an index
    of more than :data:`DISTINCT_CODES_MAX_TOKENS` tokens, its tokens' codes as stored (``codes``, ``doc_offsets``:
    the same maxima, as a repeated centroid changes no max). The distinct form reads fewer scores but costs a sort
    of the inverted file held in memory (an int64 order of every entry: 1.2 GB at 150M entries), which a large
    index does not have to spare: its codes are read from the memory map instead."""
    if plan.n_tokens > DISTINCT_CODES_MAX_TOKENS:
        return plan.codes, plan.doc_offsets
    return distinct_doc_codes(plan.ivf_offsets, plan.ivf_docs, len(plan.doc_offsets) - 1)


def stage3_codes(codes: np.ndarray) -> tuple[np.ndarray, type[np.generic]]:
    """Stage 3's code table as uploaded, and its dtype: 16-bit codes (up to 2^16 centroids, read from the memory
    map above :data:`DISTINCT_CODES_MAX_TOKENS`) are viewed as int16, the same bytes, so that the table stays the
    file's pages instead of an int32 copy of every token (4 B a token of the search's own memory: 209 MB at
    SciFact x64, bench/scale.py); torch cannot gather uint16, and stage 3 reads them back with
    :func:`unsigned_codes`. Anything else as int32."""
    if codes.dtype == np.uint16:
        return codes.view(np.int16), np.int16
    return codes, np.int32


def unsigned_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes gathered from a :func:`stage3_codes` table as int32: an int16 table holds uint16 centroid numbers."""
    if codes.dtype == torch.int16:
        return codes.to(torch.int32) & 0xFFFF
    return codes


@dataclass(frozen=True)
class PlanTables:
    """A :class:`CentroidPlan`'s arrays as tensors on one device: what every search stage reads."""

    centroids: torch.Tensor         # (C, D) float32
    doc_codes: torch.Tensor         # (E,) int32 (int16: uint16 codes, stage3_codes) each document's centroids
    doc_code_offsets: torch.Tensor  # (n_docs + 1,) int64
    ivf_offsets: torch.Tensor       # (C + 1,) int64
    ivf_docs: torch.Tensor          # (E,) int32
    doc_offsets: torch.Tensor       # (n_docs + 1,) int64


@dataclass
class CentroidPlan:
    """One head's pruning structure: centroids, every token's centroid, and the centroid -> documents lists."""

    centroids: np.ndarray    # (C, D) float32, L2-normalized
    codes: np.ndarray        # (n_tokens,) centroid of each stored token
    ivf_offsets: np.ndarray  # (C + 1,) int64
    ivf_docs: np.ndarray     # (E,) int32
    doc_offsets: np.ndarray  # (n_docs + 1,) int64, the index's

    @property
    def n_centroids(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(len(self.codes))

    def tables(self, device: torch.device | str = "cpu") -> PlanTables:
        """The plan's arrays on ``device``, uploaded on first use and cached with the plan (which the opened index
        keeps): one copy per device and index opening, none per query."""
        device = canonical_device(device)
        cache: dict[torch.device, PlanTables] = self.__dict__.setdefault("_tables", {})
        if device not in cache:
            if "_doc_codes" not in self.__dict__:  # on the host once, whatever the devices
                self.__dict__["_doc_codes"] = document_codes(self)
            doc_codes, doc_code_offsets = self.__dict__["_doc_codes"]
            cache[device] = PlanTables(upload_rows(self.centroids, np.float32, device),
                                       upload_rows(*stage3_codes(doc_codes), device),
                                       upload_rows(doc_code_offsets, np.int64, device),
                                       upload_rows(self.ivf_offsets, np.int64, device),
                                       upload_rows(self.ivf_docs, np.int32, device),
                                       upload_rows(self.doc_offsets, np.int64, device))
        return cache[device]
