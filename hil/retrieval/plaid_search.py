"""PLAID's search stages (:mod:`hil.retrieval.plaid` holds the structure and the math) for a batch of queries at once.

Full ranking on a GPU searched one query at a time leaves the device idle: each query is a dozen small kernels and
a few host synchronizations. Here every stage takes B queries together -- one (B Lq, D) x (D, C) product for the
centroid scores, one scatter-max over the probed lists of all B queries, one gather for the centroid interaction of
every kept (query, document) pair -- and a search crosses to the host only for sizes (a handful of scalars per
batch). One query is the batch of one: :func:`plaid_candidates` and the single-query stage functions are thin
wrappers, so the per-query path (``full_rank(..., batched=False)``, for latency) and the batched path run the same
code and give the same candidates.

Candidates are (query, document) *pairs*, sorted by query, then document: ``pair_query`` (P,) and ``pair_doc`` (P,)
int64, with one score per pair.

**Why sums over query tokens are sequential** (:func:`token_sum`). A query's value must not depend on which other
queries share its batch, nor on how many padding tokens it carries; torch's reductions do not guarantee that: a sum
over a contiguous axis is vectorized (its rounding depends on the length, so trailing zeros change it) and a sum over
an outer axis changes strategy with the width of the tensor (measured: both give last-bit differences). Adding one
token's row at a time, in token order, is exact to reproduce: ``x + 0.0 == x``, so tokens that do not take part
(zero rows) change nothing, whatever the batch. It is ``Lq`` additions of ``n``-vectors, the same work as a sum.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hil.retrieval.devices import canonical_device
from hil.retrieval.plaid import CentroidPlan, PlanTables, unsigned_codes
from hil.retrieval.store import device_length_blocks

# Stage 2 scatters into a (Lq, B n_docs) table when it has at most this many cells per probed entry (see
# probed_pairs); else it sorts the entries' (query, document) keys.
_DENSE_RATIO = 16
# Looked-up centroid scores per stage-3 block (N_b * Lmax * Lq fp32 values): 16 MiB on a CPU (cache-sized blocks), 512
# MiB on an accelerator, where a batch's ~10^5-10^6 pairs would otherwise take hundreds of small blocks.
STAGE3_BLOCK_ELEMENTS = {"cpu": 1 << 22}
ACCELERATOR_STAGE3_BLOCK_ELEMENTS = 1 << 27
# The (B, Lq, C) fp32 centroid scores of the queries searched together (MS MARCO's 2^18 centroids: 32 MiB a query).
SCORE_TABLE_BYTES = 1 << 30
# Probed (cell, document) entries handled at once: queries are split into groups under this bound, which bounds
# stage 2's memory (~Lq * 4 bytes per entry for its table, 40 bytes per entry for the entry arrays).
_ENTRY_BUDGET = 1 << 22


def token_sum(per_token: torch.Tensor) -> torch.Tensor:
    """Sum over query tokens, one token at a time, in token order. per_token (Lq, n) -> (n,).

    Sequential on purpose (module docstring): the result for one column depends only on that column's values, not
    on ``n`` nor on zero rows, so batched and per-query searches give the same numbers, bit for bit.
    """
    total = per_token[0].clone()
    for row in per_token[1:]:
        total += row
    return total


def query_centroid_scores(queries: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """``q_i . C_c`` for every token of every query. queries (B, Lq, D), centroids (C, D) -> (B, Lq, C) float32.

    One (Lq, D) x (D, C) product per query: a product over all B Lq rows at once may round a row differently with the
    number of rows (BLAS picks kernels by shape: seen at small D), and a query's numbers must not depend on its batch
    (module docstring). B products of one shape cost about what one product of B Lq rows costs.
    """
    centroids_t = centroids.T
    out = torch.empty((*queries.shape[:2], centroids.shape[0]), dtype=torch.float32, device=queries.device)
    for row, query in enumerate(queries):
        torch.mm(query, centroids_t, out=out[row])
    return out


def probe_cells(centroid_scores: torch.Tensor, nprobe: int) -> torch.Tensor:
    """Each query token's ``nprobe`` best centroids. centroid_scores (..., C) -> (..., nprobe) int64."""
    nprobe = min(nprobe, centroid_scores.shape[-1])
    return centroid_scores.topk(nprobe, dim=-1, sorted=False).indices


def _empty_pairs(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return empty, empty.clone(), torch.zeros(0, dtype=dtype, device=device)


def probed_pairs(tables: PlanTables, centroid_scores: torch.Tensor, cells: torch.Tensor, valid: torch.Tensor, *,
                 dense: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stages 1 and 2 for B queries: every (query, document) pair reached through a probed cell, and its
    probed-cells lower bound of the centroid interaction (:mod:`hil.retrieval.plaid`, stage 2).

    For query token i and a document d owning a token in a probed centroid, ``m_i(d) = max_{c in probe(i), d in
    ivf(c)} q_i . C_c``; the bound is ``sum_i m_i(d)`` over the tokens that reached d (the others add nothing).
    centroid_scores (B, Lq, C), cells (B, Lq, nprobe), valid (B, Lq) bool (tokens that take part; the others probe
    nothing) -> (pair_query (P,), pair_doc (P,) int64 sorted by (query, document), bound (P,)), on the scores'
    device.

    The scatter-max goes into a (Lq, B n_docs) table when that table is small next to the entries (``dense`` None:
    ``B Lq n_docs <= _DENSE_RATIO * entries``), else into (Lq, P) after sorting the entries' keys
    (``torch.unique``); both give the same numbers.
    """
    device = centroid_scores.device
    n_queries, n_tokens_q, nprobe = cells.shape
    flat_cells = cells.reshape(-1)
    starts = tables.ivf_offsets[flat_cells]
    sizes = tables.ivf_offsets[flat_cells + 1] - starts  # documents listed under each probe
    sizes = sizes.masked_fill(~valid[..., None].expand(-1, -1, nprobe).reshape(-1), 0)
    n_entries = int(sizes.sum())  # one scalar crosses to the host: the size of what follows
    if n_entries == 0:
        return _empty_pairs(device, centroid_scores.dtype)
    # Every (probe, document) entry: its probe (probes are token-major: token = probe // nprobe), hence its place in
    # the inverted file, its document, its query token and its score.
    probe = torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes, output_size=n_entries)
    list_start = torch.cumsum(sizes, 0) - sizes  # where each probe's entries begin among all entries
    entry_doc = tables.ivf_docs[(starts - list_start)[probe] + torch.arange(n_entries, device=device)].long()
    entry_token = probe // nprobe  # b * Lq + i
    entry_score = centroid_scores.reshape(-1, centroid_scores.shape[-1]).gather(
        1, cells.reshape(-1, nprobe)).reshape(-1)[probe]
    n_docs = len(tables.doc_offsets) - 1
    keys = (entry_token // n_tokens_q) * n_docs + entry_doc  # query * n_docs + document: sorts by (query, doc)
    if dense is None:
        dense = n_queries * n_tokens_q * n_docs <= _DENSE_RATIO * n_entries
    if dense:  # pairs by number: no sort; the reached ones are read off a flag per (query, document)
        reached = torch.zeros(n_queries * n_docs, dtype=torch.bool, device=device)
        reached[keys] = True
        pair_keys = reached.nonzero().reshape(-1)
        width, column = n_queries * n_docs, keys
    else:
        pair_keys, column = torch.unique(keys, sorted=True, return_inverse=True)
        width = len(pair_keys)
    # max over the cells of one (token, pair), then the sum over tokens. include_self=False: a (token, pair) no entry
    # reached keeps its 0 (the token adds nothing); a reached one gets the max of its entries alone.
    best = torch.zeros((n_tokens_q, width), dtype=entry_score.dtype, device=device)
    best.view(-1).scatter_reduce_(0, (entry_token % n_tokens_q) * width + column, entry_score, reduce="amax",
                                  include_self=False)
    if dense:
        best = best.index_select(1, pair_keys)
    return pair_keys // n_docs, pair_keys % n_docs, token_sum(best)


def best_in_groups(group: torch.Tensor, docs: torch.Tensor, scores: torch.Tensor, count: int, n_groups: int
                   ) -> torch.Tensor:
    """Which pairs are each group's ``count`` best by score (ties: lower document number first). Pairs are sorted
    by (group, document). -> keep (P,) bool, on ``scores``' device.

    No sort: per group, ``topk`` finds the ``count``-th best score; every score above it is kept, and the places
    left go to the pairs tied at it in document order (a running count of the tied pairs within the group).
    """
    device = scores.device
    n_pairs = len(scores)
    if n_pairs == 0 or count < 1:
        return torch.zeros(n_pairs, dtype=torch.bool, device=device)
    sizes = torch.bincount(group, minlength=n_groups)
    width = int(sizes.max())  # one scalar to the host
    if width <= count:
        return torch.ones(n_pairs, dtype=torch.bool, device=device)
    starts = torch.cumsum(sizes, 0) - sizes
    padded = torch.full((n_groups, width), float("-inf"), dtype=scores.dtype, device=device)
    padded[group, torch.arange(n_pairs, device=device) - starts[group]] = scores
    cut = padded.topk(count, dim=1).values[:, count - 1][group]  # -inf in a group of fewer: all of it is kept
    above = scores > cut
    tied = scores == cut
    wanted = count - torch.zeros(n_groups, dtype=torch.int64, device=device).index_add_(0, group, above.long())
    running = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(tied.long(), 0)])
    tied_rank = running[1:] - running[starts][group]  # 1, 2, ... among the group's tied pairs, by document
    return above | (tied & (tied_rank <= wanted[group]))


def _repeating_rows(offsets: torch.Tensor, docs: torch.Tensor, lengths: torch.Tensor, width: int,
                    last_row: int) -> torch.Tensor:
    """Rows ``offsets[d] ..`` of each document padded to ``width`` by repeating its last row (an empty document's
    rows are some other document's: its caller sets it to 0). -> (N, width) int64 on the tables' device."""
    positions = torch.arange(width, device=docs.device)
    last = (lengths - 1).clamp(min=0)
    return (offsets[docs][:, None] + torch.minimum(positions[None, :], last[:, None])).clamp(max=last_row)


def pair_centroid_interaction(tables: PlanTables, centroid_scores: torch.Tensor, pair_query: torch.Tensor,
                              pair_doc: torch.Tensor, *, block_elements: int = 1 << 22) -> torch.Tensor:
    """Stage 3 for (query, document) pairs: ``sum_i max_j q_i . C_{c(j)}`` over every stored token j of the
    document (PLAID Eq. 3). centroid_scores (B, Lq, C) -> (P,) float32 on their device.

    A document's distinct centroids stand for its tokens (the max over them is the max over its tokens). Pairs go in
    length-sorted blocks of at most ``block_elements`` (N_b * Lmax * Lq) looked-up scores.
    """
    device = centroid_scores.device
    out = torch.zeros(len(pair_doc), dtype=torch.float32, device=device)
    if len(pair_doc) == 0 or len(tables.doc_codes) == 0:  # no stored token at all: every document scores 0
        return out
    n_queries, n_tokens_q, n_centroids = centroid_scores.shape
    if n_queries * n_centroids >= 1 << 31:
        raise ValueError(f"{n_queries} queries x {n_centroids} centroids: search fewer queries at once")
    # One row of Lq scores per (query, centroid), read by ``query * C + code``.
    # contiguous: the rows are gathered whole (a (C, Lq) view of the scores' (Lq, C) layout is read strided: 3x slower)
    table = centroid_scores.transpose(1, 2).contiguous().view(n_queries * n_centroids, n_tokens_q)
    offsets = tables.doc_code_offsets
    lengths = offsets[pair_doc + 1] - offsets[pair_doc]
    order = torch.argsort(lengths, stable=True)
    last_row = len(tables.doc_codes) - 1
    for block, width in device_length_blocks(lengths[order], max(1, block_elements // n_tokens_q)):
        picked = order[block]
        rows = _repeating_rows(offsets, pair_doc[picked], lengths[picked], width, last_row)
        # index_select, not advanced indexing: whole rows of Lq scores copied at once (several times faster on a CPU)
        codes = unsigned_codes(tables.doc_codes.index_select(0, rows.reshape(-1))).view(len(picked), width)
        if n_queries > 1:  # the row of (query, centroid); int32 arithmetic (B C < 2^31, checked above)
            codes = codes + (pair_query[picked] * n_centroids).to(torch.int32)[:, None]
        sims = table.index_select(0, codes.reshape(-1)).view(len(picked), width, n_tokens_q)
        # No mask: a document's padding repeats its own last centroid, and a max is unchanged by a repeated element.
        # Only an empty document, whose padding is another document's centroid, is set to 0 afterwards (Eq. 1 with
        # an empty document).
        best = token_sum(sims.amax(dim=1).t())
        out[picked] = torch.where(lengths[picked] > 0, best, torch.zeros_like(best))
    return out


def _entry_groups(tables: PlanTables, cells: torch.Tensor, valid: torch.Tensor) -> list[slice]:
    """Consecutive query groups whose probed entries stay under :data:`_ENTRY_BUDGET` (a query alone may pass it).
    One (B,) array of entry counts crosses to the host."""
    flat = cells.reshape(cells.shape[0], -1)
    sizes = (tables.ivf_offsets[flat + 1] - tables.ivf_offsets[flat]).view(cells.shape)
    per_query = sizes.masked_fill(~valid[..., None], 0).sum(dim=(1, 2)).cpu().numpy()
    groups, start, total = [], 0, 0
    for index, entries in enumerate(per_query.tolist()):
        if index > start and total + entries > _ENTRY_BUDGET:
            groups.append(slice(start, index))
            start, total = index, 0
        total += entries
    groups.append(slice(start, len(per_query)))
    return groups


def plaid_pairs(plan: CentroidPlan, queries: torch.Tensor, valid: torch.Tensor, *, nprobe: int, ndocs: int,
                stage2_docs: int | None = None, device: torch.device | str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Stages 1-3 for B queries. queries (B, Lq, D) (rows where ``valid`` is False take no part), valid (B, Lq) ->
    (pair_query, pair_doc (P,) int64 sorted by (query, document), their centroid-interaction scores (float32),
    counts). Each query keeps its ``ndocs`` best documents; ``stage2_docs`` (default ``4 * ndocs``) survive the
    probed-cells bound into stage 3.

    ``device`` (default: the queries') is where every stage runs and the results are; the plan's tables are uploaded
    there once (:meth:`CentroidPlan.tables`). Queries are searched in groups whose score tables fit
    :data:`SCORE_TABLE_BYTES` and whose probed entries fit :data:`_ENTRY_BUDGET`, so memory is bounded whatever B.
    """
    device = canonical_device(device) if device is not None else queries.device
    tables = plan.tables(device)
    valid = valid.to(device=device, dtype=torch.bool)
    n_queries, n_tokens_q, _ = queries.shape
    # Queries whose (Lq, C) score tables fit SCORE_TABLE_BYTES together (each is copied once more for stage 3).
    step = max(1, SCORE_TABLE_BYTES // (4 * n_tokens_q * plan.n_centroids))
    parts, probed = [], 0
    for start in range(0, n_queries, step):
        part = slice(start, start + step)
        found, count = _pairs_of(tables, queries[part], valid[part], nprobe, ndocs, stage2_docs, device)
        parts.append((found[0] + start, *found[1:]))
        probed += count
    pair_query, pair_doc, approx = (torch.cat(values) for values in zip(*parts))
    return pair_query, pair_doc, approx, {"probed_pairs": probed}


def _pairs_of(tables: PlanTables, queries: torch.Tensor, valid: torch.Tensor, nprobe: int, ndocs: int,
              stage2_docs: int | None, device: torch.device
              ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], int]:
    """:func:`plaid_pairs` for queries whose score tables fit in memory together; -> (pairs, probed pairs)."""
    vectors = queries.to(device=device, dtype=torch.float32).masked_fill(~valid[..., None], 0.0)  # out of play: 0
    scores = query_centroid_scores(vectors, tables.centroids)  # (B, Lq, C)
    cells = probe_cells(scores, nprobe)
    stage2 = stage2_docs if stage2_docs is not None else 4 * ndocs
    block_elements = STAGE3_BLOCK_ELEMENTS.get(device.type, ACCELERATOR_STAGE3_BLOCK_ELEMENTS)
    parts, probed = [], 0
    n_queries = len(vectors)
    for group in _entry_groups(tables, cells, valid) if n_queries > 1 else [slice(0, n_queries)]:
        group_scores = scores[group]
        pair_query, pair_doc, bound = probed_pairs(tables, group_scores, cells[group], valid[group])
        probed += len(pair_doc)
        size = group_scores.shape[0]
        keep = best_in_groups(pair_query, pair_doc, bound, stage2, size)
        pair_query, pair_doc = pair_query[keep], pair_doc[keep]
        approx = pair_centroid_interaction(tables, group_scores, pair_query, pair_doc, block_elements=block_elements)
        keep = best_in_groups(pair_query, pair_doc, approx, ndocs, size)
        parts.append((pair_query[keep] + group.start, pair_doc[keep], approx[keep]))
    return tuple(torch.cat(values) for values in zip(*parts)), probed  # type: ignore[return-value]


# -- one query: the batch of one ---------------------------------------------------------------------------------

def _one(values: torch.Tensor | np.ndarray, device: torch.device | None = None) -> torch.Tensor:
    if not isinstance(values, torch.Tensor):
        values = torch.from_numpy(np.asarray(values))
    return values if device is None else values.to(device)


def cell_scores(plan: CentroidPlan, centroid_scores: torch.Tensor, cells: torch.Tensor, *,
                dense: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`probed_pairs` for one query. centroid_scores (Lq, C), cells (Lq, nprobe) -> (docs (N,) int64
    ascending, bound (N,)), on the scores' device."""
    tables = plan.tables(centroid_scores.device)
    valid = torch.ones((1, cells.shape[0]), dtype=torch.bool, device=centroid_scores.device)
    _, docs, bound = probed_pairs(tables, centroid_scores[None], cells[None], valid, dense=dense)
    return docs, bound


def centroid_interaction(plan: CentroidPlan, centroid_scores: torch.Tensor, docs: torch.Tensor | np.ndarray, *,
                         block_elements: int = 1 << 22) -> torch.Tensor:
    """:func:`pair_centroid_interaction` for one query. centroid_scores (Lq, C), docs (N,) -> (N,) float32."""
    device = centroid_scores.device
    docs = _one(docs, device).long()
    if plan.n_tokens == 0:
        return torch.zeros(len(docs), dtype=torch.float32, device=device)
    return pair_centroid_interaction(plan.tables(device), centroid_scores[None], torch.zeros_like(docs), docs,
                                     block_elements=block_elements)


def top_by_score(docs: torch.Tensor | np.ndarray, scores: torch.Tensor | np.ndarray, count: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`best_in_groups` for one query: the ``count`` best documents by score (ties: lower document number
    first), in their given order. -> (docs, scores) tensors on ``scores``' device."""
    scores = _one(scores)
    docs = _one(docs, scores.device)
    order = torch.argsort(docs, stable=True)  # the group rule reads ties in document order
    keep = torch.zeros(len(docs), dtype=torch.bool, device=scores.device)
    keep[order] = best_in_groups(torch.zeros_like(docs), docs[order], scores[order], count, 1)
    return docs[keep], scores[keep]


def plaid_candidates(plan: CentroidPlan, query: torch.Tensor, *, nprobe: int, ndocs: int,
                     stage2_docs: int | None = None, device: torch.device | str | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """:func:`plaid_pairs` for one query. query (Lq, D) (its scored tokens) -> (docs (<= ndocs,) int64 ascending,
    their centroid-interaction scores (float32), counts per stage: ``probed_docs``)."""
    valid = torch.ones((1, query.shape[0]), dtype=torch.bool, device=query.device)
    _, docs, approx, counts = plaid_pairs(plan, query[None], valid, nprobe=nprobe, ndocs=ndocs,
                                          stage2_docs=stage2_docs, device=device)
    return docs, approx, {"probed_docs": counts["probed_pairs"]}
