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
  k-means is FAISS's (spherical: centroids are L2-normalized after every iteration, as the vectors are), trained on a
  seeded sample of ``train_size`` tokens for ``niter`` iterations (ColBERTv2 uses 4-20).
- Stage 2 replaces PLAID's score threshold by a fixed count (``stage2_docs``): its cost is then bounded per query
  whatever the corpus, and a count is easier to reason about than a score threshold across models.
- Documents with no stored token score 0 at every stage, as in Eq. 1 with an empty document.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hil.modeling.scoring import masked_max
from hil.retrieval.store import length_blocks, padded_rows

# Rows of the (n_tokens, D) table handled at once when assigning codes: bounds the fp32 copy (16 MiB at D=128).
_ASSIGN_BLOCK = 1 << 15


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


def train_centroids(embeddings: np.ndarray, n_centroids: int, *, train_size: int, niter: int = 10,
                    seed: int = 0, gpu: bool = False) -> np.ndarray:
    """Spherical k-means (FAISS) on a seeded sample of token vectors. embeddings (n_tokens, D) -> (C, D) float32.

    The centroids are L2-normalized, so ``q . C_c`` is a cosine like every score in late interaction. ``gpu``: on
    every GPU faiss-gpu sees (MS MARCO's 2^18 centroids: bench/README.md); the CPU when it sees none.
    """
    import faiss

    n_tokens, dim = embeddings.shape
    if not 1 <= n_centroids <= n_tokens:
        raise ValueError(f"n_centroids must lie in 1..n_tokens={n_tokens}, got {n_centroids}")
    rows = sample_rows(n_tokens, max(train_size, n_centroids), seed)
    sample = np.ascontiguousarray(embeddings[rows], dtype=np.float32)  # (S, D)
    # FAISS subsamples to max_points_per_centroid * k on its own; the sample is already what we want.
    gpus = faiss.get_num_gpus() if gpu and hasattr(faiss, "StandardGpuResources") else 0
    kmeans = faiss.Kmeans(dim, n_centroids, niter=niter, seed=seed, spherical=True, verbose=False,
                          max_points_per_centroid=max(256, len(sample) // n_centroids + 1),
                          **({"gpu": gpus} if gpus else {}))
    kmeans.train(sample)
    centroids = np.asarray(kmeans.centroids, dtype=np.float32).reshape(n_centroids, dim)
    norms = np.linalg.norm(centroids, axis=1, keepdims=True)
    return centroids / np.maximum(norms, 1e-12)


def code_dtype(n_centroids: int) -> np.dtype:
    """The smallest unsigned type holding a centroid number: uint16 up to 65,536 centroids, else int32."""
    return np.dtype(np.uint16) if n_centroids <= 1 << 16 else np.dtype(np.int32)


def assign_codes(embeddings: np.ndarray, centroids: np.ndarray, *, block_tokens: int = _ASSIGN_BLOCK,
                 out: np.ndarray | None = None, gpu_device: int | None = None) -> np.ndarray:
    """The nearest centroid (largest inner product) of every token. -> (n_tokens,) ``code_dtype``.

    Reads ``embeddings`` (a memmap is fine) in blocks of ``block_tokens`` rows; ``out`` may be a memmap too.
    ``gpu_device``: search the centroids on that FAISS GPU (where faiss-gpu sees it), else on the CPU.
    """
    import faiss

    n_tokens = embeddings.shape[0]
    search = faiss.IndexFlatIP(centroids.shape[1])
    resources = None
    if gpu_device is not None and hasattr(faiss, "StandardGpuResources") and gpu_device < faiss.get_num_gpus():
        resources = faiss.StandardGpuResources()  # kept alive while the GPU index is used
        search = faiss.index_cpu_to_gpu(resources, int(gpu_device), search)
    search.add(np.ascontiguousarray(centroids, dtype=np.float32))
    codes = out if out is not None else np.empty(n_tokens, dtype=code_dtype(len(centroids)))
    for start in range(0, n_tokens, block_tokens):
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
    token_doc = np.repeat(np.arange(n_docs, dtype=np.int64), np.diff(doc_offsets))
    keys = np.unique(codes.astype(np.int64) * max(n_docs, 1) + token_doc)  # sorted by (centroid, doc)
    cells = keys // max(n_docs, 1)
    offsets = np.zeros(n_centroids + 1, dtype=np.int64)
    np.cumsum(np.bincount(cells, minlength=n_centroids), out=offsets[1:])
    return offsets, (keys % max(n_docs, 1)).astype(np.int32)


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

    def torch_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The centroids and codes as (cached) tensors: (C, D) float32 and (n_tokens,) int64."""
        cached = self.__dict__.get("_tables")
        if cached is None:
            cached = (torch.from_numpy(np.ascontiguousarray(self.centroids, dtype=np.float32)),
                      torch.from_numpy(np.asarray(self.codes).astype(np.int64)))
            self.__dict__["_tables"] = cached
        return cached


def probe_cells(centroid_scores: torch.Tensor, nprobe: int) -> torch.Tensor:
    """Each query token's ``nprobe`` best centroids. centroid_scores (Lq, C) -> (Lq, nprobe) int64."""
    nprobe = min(nprobe, centroid_scores.shape[1])
    return centroid_scores.topk(nprobe, dim=1, sorted=False).indices


def cell_scores(plan: CentroidPlan, centroid_scores: torch.Tensor, cells: torch.Tensor
                ) -> tuple[np.ndarray, np.ndarray]:
    """Stage 1 and 2: candidate documents and their probed-cells lower bound of the centroid interaction.

    For query token i and a document d owning a token in a probed centroid, ``m_i(d) = max_{c in probe(i), d in
    ivf(c)} q_i . C_c``; the bound is ``sum_i m_i(d)`` over the tokens that reached d (the others add nothing).
    centroid_scores (Lq, C), cells (Lq, nprobe) -> (docs (N,) int64 ascending, bound (N,) float32).
    """
    n_tokens_q, nprobe = cells.shape
    flat_cells = cells.reshape(-1).numpy()
    starts, ends = plan.ivf_offsets[flat_cells], plan.ivf_offsets[flat_cells + 1]
    sizes = ends - starts
    if sizes.sum() == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    # Every (probed cell, document) entry: its document and the query token / score it came with.
    entry_doc = plan.ivf_docs[np.repeat(starts - np.cumsum(sizes) + sizes, sizes) + np.arange(sizes.sum())]
    entry_token = np.repeat(np.repeat(np.arange(n_tokens_q), nprobe), sizes)
    probe_scores = centroid_scores.gather(1, cells).reshape(-1).numpy()  # (Lq * nprobe,)
    entry_score = np.repeat(probe_scores, sizes)
    docs, doc_of_entry = np.unique(entry_doc, return_inverse=True)
    # max over the cells of one (token, doc) pair, then sum over tokens: a scatter-max into (Lq, N), then a sum.
    best = torch.full((n_tokens_q * len(docs),), -torch.inf)
    best.scatter_reduce_(0, torch.from_numpy(entry_token * len(docs) + doc_of_entry),
                         torch.from_numpy(entry_score.astype(np.float32)), reduce="amax")
    best = best.view(n_tokens_q, len(docs))
    bound = torch.where(torch.isinf(best), torch.zeros_like(best), best).sum(dim=0)
    return docs.astype(np.int64), bound.numpy()


def centroid_interaction(plan: CentroidPlan, centroid_scores: torch.Tensor, docs: np.ndarray, *,
                         block_elements: int = 1 << 22) -> np.ndarray:
    """Stage 3: ``sum_i max_j q_i . C_{c(j)}`` over every stored token j of each document (PLAID Eq. 3).

    centroid_scores (Lq, C), docs (N,) -> (N,) float32. Documents are taken in length-sorted blocks of at most
    ``block_elements`` (N_b * Lmax * Lq) looked-up scores, so padding and memory stay small.
    """
    docs = np.asarray(docs, dtype=np.int64)
    out = np.zeros(len(docs), dtype=np.float32)
    if len(docs) == 0 or len(plan.codes) == 0:  # no stored token at all: every document scores 0
        return out
    _, codes = plan.torch_tables()
    table = centroid_scores.t().contiguous()  # (C, Lq): one row per centroid, read by code
    n_q = table.shape[1]
    lengths = plan.doc_offsets[docs + 1] - plan.doc_offsets[docs]
    order = np.argsort(lengths, kind="stable")
    for start, end in length_blocks(lengths[order], max(1, block_elements // n_q)):
        block = order[start:end]
        rows, mask = padded_rows(plan.doc_offsets, docs[block])  # (Nb, Lmax) each
        sims = table[codes[rows]].transpose(1, 2)  # (Nb, Lq, Lmax): the centroid score of every token pair
        out[block] = masked_max(sims, mask[:, None, :]).sum(dim=1).numpy()  # Eq. 3, (Nb, Lq) summed over Lq
    return out


def top_by_score(docs: np.ndarray, scores: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``count`` best documents by score (ties: lower document number first), in ascending document order."""
    if len(docs) <= count:
        return docs, scores
    keep = np.lexsort((docs, -scores))[:count]
    keep.sort()
    return docs[keep], scores[keep]


def plaid_candidates(plan: CentroidPlan, query: torch.Tensor, *, nprobe: int, ndocs: int,
                     stage2_docs: int | None = None) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Stages 1-3 for one query. query (Lq, D) float32 (its scored tokens) -> (docs (<= ndocs,) ascending,
    their centroid-interaction scores, counts per stage).

    ``stage2_docs`` (default ``4 * ndocs``) documents survive the probed-cells bound into stage 3.
    """
    centroids, _ = plan.torch_tables()
    scores = query.float() @ centroids.T  # (Lq, C)
    cells = probe_cells(scores, nprobe)
    docs, bound = cell_scores(plan, scores, cells)
    n_probed = len(docs)
    docs, _ = top_by_score(docs, bound, stage2_docs if stage2_docs is not None else 4 * ndocs)
    approx = centroid_interaction(plan, scores, docs)
    docs, approx = top_by_score(docs, approx, ndocs)
    return docs, approx, {"probed_docs": n_probed}
