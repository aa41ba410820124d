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

Where it runs: every stage is torch on one device (:func:`plaid_candidates`' ``device``, by default the query's,
i.e. the encoder's): the plan's arrays are uploaded there once per opened index (:meth:`CentroidPlan.tables`), and
only scalar sizes reach the host before the caller takes the ``ndocs`` documents. The centroid scores are one
exact torch product on that device, not a FAISS search (faiss-gpu or not): stage 3 reads the score of *every*
centroid, which a k-nearest-centroid search would not give. The same code runs on the CPU and on a GPU; on the
CPU it gives the numbers of the numpy implementation it replaced (``tests/test_plaid_device.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from hil.retrieval.devices import canonical_device

# Rows of the (n_tokens, D) table handled at once when assigning codes: bounds the fp32 copy (16 MiB at D=128).
_ASSIGN_BLOCK = 1 << 15
# Stage 2 scatters into a (Lq, n_docs) table when it has at most this many cells per probed entry (cell_scores).
_DENSE_RATIO = 16
# Rows of a plan's table copied to a device at once (bounds the host temporary: 64 MiB of int32 codes).
_UPLOAD_BLOCK = 1 << 24


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


@dataclass(frozen=True)
class PlanTables:
    """A :class:`CentroidPlan`'s arrays as tensors on one device: what every search stage reads."""

    centroids: torch.Tensor         # (C, D) float32
    doc_codes: torch.Tensor         # (E,) int32 each document's distinct centroids (distinct_doc_codes)
    doc_code_offsets: torch.Tensor  # (n_docs + 1,) int64
    ivf_offsets: torch.Tensor       # (C + 1,) int64
    ivf_docs: torch.Tensor          # (E,) int32
    doc_offsets: torch.Tensor       # (n_docs + 1,) int64


def _upload(array: np.ndarray, dtype: type[np.generic], device: torch.device, block: int = _UPLOAD_BLOCK
            ) -> torch.Tensor:
    """``array`` (a memmap is fine) as a tensor of ``dtype`` on ``device``, converted and copied in blocks of
    ``block`` rows: no whole-table temporary on the host (the codes of a large corpus take gigabytes)."""
    out = torch.empty(array.shape, dtype=torch.from_numpy(np.empty(0, dtype=dtype)).dtype, device=device)
    for start in range(0, len(array), block):
        part = torch.from_numpy(np.ascontiguousarray(array[start: start + block], dtype=dtype))
        out[start: start + len(part)] = part.to(device)
    return out


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
                self.__dict__["_doc_codes"] = distinct_doc_codes(self.ivf_offsets, self.ivf_docs,
                                                                 len(self.doc_offsets) - 1)
            doc_codes, doc_code_offsets = self.__dict__["_doc_codes"]
            cache[device] = PlanTables(_upload(self.centroids, np.float32, device),
                                       _upload(doc_codes, np.int32, device),
                                       _upload(doc_code_offsets, np.int64, device),
                                       _upload(self.ivf_offsets, np.int64, device),
                                       _upload(self.ivf_docs, np.int32, device),
                                       _upload(self.doc_offsets, np.int64, device))
        return cache[device]


def _on(values: torch.Tensor | np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` as a tensor on ``device`` (a tensor already there is returned as is)."""
    if not isinstance(values, torch.Tensor):
        values = torch.from_numpy(np.asarray(values))
    return values.to(device=device, dtype=dtype)


def probe_cells(centroid_scores: torch.Tensor, nprobe: int) -> torch.Tensor:
    """Each query token's ``nprobe`` best centroids. centroid_scores (Lq, C) -> (Lq, nprobe) int64."""
    nprobe = min(nprobe, centroid_scores.shape[1])
    return centroid_scores.topk(nprobe, dim=1, sorted=False).indices


def cell_scores(plan: CentroidPlan, centroid_scores: torch.Tensor, cells: torch.Tensor, *,
                dense: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 and 2: candidate documents and their probed-cells lower bound of the centroid interaction.

    For query token i and a document d owning a token in a probed centroid, ``m_i(d) = max_{c in probe(i), d in
    ivf(c)} q_i . C_c``; the bound is ``sum_i m_i(d)`` over the tokens that reached d (the others add nothing).
    centroid_scores (Lq, C), cells (Lq, nprobe) -> (docs (N,) int64 ascending, bound (N,) float32), on
    ``centroid_scores``' device, where every step runs.

    The scatter-max goes into a (Lq, n_docs) table when that table is small next to the entries (``dense`` None:
    ``Lq * n_docs <= _DENSE_RATIO * entries``; a small corpus, where sorting the entries costs more than the
    table), else into (Lq, N) after a sort of the entries' documents (``torch.unique``). Both give the same numbers
    (the same values summed in the same order); ``dense`` forces one (tests).
    """
    device = centroid_scores.device
    tables = plan.tables(device)
    n_tokens_q, nprobe = cells.shape
    flat_cells = cells.reshape(-1)
    starts = tables.ivf_offsets[flat_cells]
    sizes = tables.ivf_offsets[flat_cells + 1] - starts  # (Lq * nprobe,) documents listed under each probe
    n_entries = int(sizes.sum())  # one scalar crosses to the host: the size of what follows
    if n_entries == 0:
        return (torch.zeros(0, dtype=torch.int64, device=device),
                torch.zeros(0, dtype=centroid_scores.dtype, device=device))
    # Every (probed cell, document) entry: the probe it came from (probes are token-major: token = probe // nprobe),
    # hence its place in the inverted file, its document and its score.
    probe = torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes, output_size=n_entries)
    list_start = torch.cumsum(sizes, 0) - sizes  # where each probe's entries begin among all entries
    entry_doc = tables.ivf_docs[(starts - list_start)[probe] + torch.arange(n_entries, device=device)]
    entry_token = probe // nprobe
    entry_score = centroid_scores.gather(1, cells).reshape(-1)[probe]
    n_docs = len(tables.doc_offsets) - 1
    if dense is None:
        dense = n_tokens_q * n_docs <= _DENSE_RATIO * n_entries
    if dense:  # documents by number: no sort; the reached ones are read off a flag per document
        reached = torch.zeros(n_docs, dtype=torch.bool, device=device)
        reached[entry_doc.long()] = True
        docs = reached.nonzero().reshape(-1)
        width, column = n_docs, entry_doc.long()
    else:
        docs, column = torch.unique(entry_doc, sorted=True, return_inverse=True)
        docs, width = docs.long(), len(docs)
    # max over the cells of one (token, doc) pair, then sum over tokens: a scatter-max into (Lq, width), then a sum.
    # include_self=False: a pair no entry reached keeps its 0 (the token adds nothing), a reached one gets the max
    # of its entries alone, negative or not.
    best = torch.zeros((n_tokens_q, width), dtype=entry_score.dtype, device=device)
    best.view(-1).scatter_reduce_(0, entry_token * width + column, entry_score, reduce="amax", include_self=False)
    if dense:
        best = best.index_select(1, docs)
    return docs, best.sum(dim=0)


def _length_blocks(sorted_lengths: torch.Tensor, budget: int) -> Iterator[tuple[slice, int]]:
    """:func:`hil.retrieval.store.length_blocks` on the lengths' device: consecutive blocks of ascending lengths
    whose padded size ``count * longest`` (an empty item counts 1) fits ``budget``, greedy, at least one item each.
    -> (block, its longest length): two scalars cross to the host per block, no array."""
    start, n = 0, len(sorted_lengths)
    while start < n:
        window = sorted_lengths[start: start + budget].clamp(min=1)
        padded = torch.arange(1, len(window) + 1, device=window.device) * window  # nondecreasing
        count = max(1, int((padded <= budget).sum()))
        yield slice(start, start + count), int(window[count - 1])
        start += count


def _repeating_rows(offsets: torch.Tensor, docs: torch.Tensor, lengths: torch.Tensor, width: int,
                    last_row: int) -> torch.Tensor:
    """Rows ``offsets[d] ..`` of each document padded to ``width`` by repeating its last row (an empty document's
    rows are some other document's: its caller sets it to 0). -> (N, width) int64 on the tables' device."""
    positions = torch.arange(width, device=docs.device)
    last = (lengths - 1).clamp(min=0)
    return (offsets[docs][:, None] + torch.minimum(positions[None, :], last[:, None])).clamp(max=last_row)


def centroid_interaction(plan: CentroidPlan, centroid_scores: torch.Tensor, docs: torch.Tensor | np.ndarray, *,
                         block_elements: int = 1 << 22) -> torch.Tensor:
    """Stage 3: ``sum_i max_j q_i . C_{c(j)}`` over every stored token j of each document (PLAID Eq. 3).

    centroid_scores (Lq, C), docs (N,) -> (N,) float32 on ``centroid_scores``' device, where every step runs.
    Documents are taken in length-sorted blocks of at most ``block_elements`` (N_b * Lmax * Lq) looked-up scores,
    so padding and memory stay small.
    """
    device = centroid_scores.device
    docs = _on(docs, device, torch.int64)
    out = torch.zeros(len(docs), dtype=torch.float32, device=device)
    if len(docs) == 0 or plan.n_tokens == 0:  # no stored token at all: every document scores 0
        return out
    tables = plan.tables(device)
    table = centroid_scores.t().contiguous()  # (C, Lq): one row per centroid, read by code
    n_q = table.shape[1]
    # A document's distinct centroids stand for its tokens: the max over them is the max over its tokens.
    offsets = tables.doc_code_offsets
    lengths = offsets[docs + 1] - offsets[docs]
    order = torch.argsort(lengths, stable=True)
    last_row = max(len(tables.doc_codes) - 1, 0)
    for block, width in _length_blocks(lengths[order], max(1, block_elements // max(1, n_q))):
        picked = order[block]
        rows = _repeating_rows(offsets, docs[picked], lengths[picked], width, last_row)
        # index_select, not advanced indexing: whole rows of Lq scores copied at once (several times faster on a CPU)
        codes = tables.doc_codes.index_select(0, rows.reshape(-1))
        sims = table.index_select(0, codes).view(len(picked), width, n_q)  # the score of every (centroid, q token)
        # No mask: a document's padding repeats its own last centroid, and a max is unchanged by a repeated element
        # (one pass over the largest tensor of the search saved). Only an empty document, whose padding is another
        # document's centroid, is set to 0 afterwards, as the masked max gave it.
        best = sims.amax(dim=1).sum(dim=1)  # Eq. 3: max over the document's centroids, summed over Lq
        out[picked] = torch.where(lengths[picked] > 0, best, torch.zeros_like(best))
    return out


def top_by_score(docs: torch.Tensor | np.ndarray, scores: torch.Tensor | np.ndarray, count: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``count`` best documents by score (ties: lower document number first), in their given (ascending)
    order, on ``scores``' device. -> (docs, scores) tensors.

    No sort of all the scores: ``topk`` finds the ``count``-th best score, every score above it is kept, and the
    places left go to the documents tied at it, lowest numbers first.
    """
    scores = _on(scores, scores.device if isinstance(scores, torch.Tensor) else torch.device("cpu"))
    docs = _on(docs, scores.device)
    if len(docs) <= count:
        return docs, scores
    if count < 1:
        return docs[:0], scores[:0]
    cut = scores.topk(count, sorted=False).values.min()
    keep = scores > cut
    tied = (scores == cut).nonzero().reshape(-1)
    # ``count - (above the cut)`` of the tied documents, by document number (``tied`` is in position order)
    wanted = count - int(keep.sum())
    keep[tied[torch.argsort(docs[tied], stable=True)[:wanted]]] = True
    return docs[keep], scores[keep]


def plaid_candidates(plan: CentroidPlan, query: torch.Tensor, *, nprobe: int, ndocs: int,
                     stage2_docs: int | None = None, device: torch.device | str | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Stages 1-3 for one query. query (Lq, D) (its scored tokens) -> (docs (<= ndocs,) int64 ascending, their
    centroid-interaction scores (float32), counts per stage).

    ``stage2_docs`` (default ``4 * ndocs``) documents survive the probed-cells bound into stage 3. ``device``
    (default: the query's) is where every stage runs and the returned tensors are: the plan's tables are uploaded
    there once (:meth:`CentroidPlan.tables`), the query is moved there, and nothing but scalar sizes comes back
    before the caller takes the result.
    """
    device = canonical_device(device) if device is not None else query.device
    centroids = plan.tables(device).centroids
    scores = query.to(device=device, dtype=torch.float32) @ centroids.T  # (Lq, C)
    cells = probe_cells(scores, nprobe)
    docs, bound = cell_scores(plan, scores, cells)
    n_probed = len(docs)
    docs, _ = top_by_score(docs, bound, stage2_docs if stage2_docs is not None else 4 * ndocs)
    approx = centroid_interaction(plan, scores, docs)
    docs, approx = top_by_score(docs, approx, ndocs)
    return docs, approx, {"probed_docs": n_probed}
