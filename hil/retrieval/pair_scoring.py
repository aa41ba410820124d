"""Exact scoring and ranking of (query, document) candidate pairs on the encoder's device: the last two steps of
full ranking (:mod:`hil.retrieval.full_ranking`).

Each query has its own candidates, so a batch is scored as pairs, not as a (queries x documents) matrix (which would
score every query against every other query's candidates: ~B times the work). Each query's documents are gathered on
the device (:mod:`hil.retrieval.device_tokens`) in length-sorted blocks and scored by ``encoder.score`` (the model
decides how its heads combine; search never hard-codes MaxSim): a pure MaxSim-and-sum score
(``encoder.scores_repeated_padding``) gets documents with repeated padding and no token ids, any other score the
masked documents with their ids, and a score normalized over all of a query's documents (``normalizes_per_query``)
goes through :func:`hil.retrieval.search.score_documents`, which accumulates the moments first (on the host).

**Why query by query**: the blocks of a query, hence every product's shape, are those the query alone would get, so
a batched search ranks exactly as a search of one query at a time (on the CPU, bit for bit:
``tests/test_batched_search.py``). A block mixing several queries' pairs would call other kernel shapes, and BLAS
rounds a dot product differently with the shape (seen at small D). The blocks of every query are planned on the
host from one copy of the pairs' lengths, so the loop issues device work without waiting for it.

Ranking follows trec_eval's rule (:mod:`hil.data.ranking`: score descending, then document id descending) by three
stable sorts on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from hil.modeling.contracts import EncodedBatch, Encoder
from hil.retrieval.device_tokens import device_tokens
from hil.retrieval.search import score_documents
from hil.retrieval.store import TokenStore, length_blocks


def pair_scores(encoder: Encoder, queries: EncodedBatch, store: TokenStore, pair_query: torch.Tensor,
                pair_doc: torch.Tensor, *, block_tokens: int = 1 << 16) -> torch.Tensor:
    """``encoder``'s exact score of query ``pair_query[p]`` (a row of ``queries``) with stored document
    ``pair_doc[p]``, pairs sorted by query. -> (P,) float32 on the encoder's device.

    ``block_tokens``: padded document tokens gathered per scoring call (the scores do not depend on it).
    """
    device = encoder.device
    pair_query, pair_doc = pair_query.to(device), pair_doc.to(device)
    out = torch.zeros(len(pair_doc), dtype=torch.float32, device=device)
    if len(pair_doc) == 0:
        return out
    bounds = torch.searchsorted(pair_query, torch.arange(len(queries) + 1, device=device)).cpu().numpy()
    if encoder.normalizes_per_query:
        docs = pair_doc.cpu().numpy()
        for row, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            if hi > lo:
                values = score_documents(encoder, queries.select(slice(row, row + 1)), store, docs[lo:hi],
                                         block_tokens=block_tokens)[0]
                out[lo:hi] = torch.from_numpy(np.ascontiguousarray(values)).to(device)
        return out
    tokens = device_tokens(store, device)
    lengths = tokens.lengths[pair_doc].cpu().numpy()  # the one copy that plans every block of the batch
    plan = [_query_blocks(lengths[lo:hi], lo, block_tokens) for lo, hi in zip(bounds[:-1], bounds[1:])]
    order = torch.from_numpy(np.concatenate([np.zeros(0, np.int64)] + [o for o, _ in plan])).to(device)
    pure = encoder.scores_repeated_padding
    for row, (_, blocks) in enumerate(plan):
        query = queries.select(slice(row, row + 1))
        for start, end, shortest, longest in blocks:
            picked = order[start:end]  # positions of this block's pairs
            docs = tokens.gather(pair_doc[picked], encoder.head_names, repeat_padding=pure, token_ids=not pure,
                                 lengths=(shortest, longest))
            out[picked] = encoder.score(query, docs)[0].float()
    return out


def _query_blocks(lengths: np.ndarray, offset: int, block_tokens: int
                  ) -> tuple[np.ndarray, list[tuple[int, int, int, int]]]:
    """One query's pairs (positions ``offset ..``) by length, cut into blocks as the per-query search cuts them
    (:func:`~hil.retrieval.store.length_blocks`). -> (positions in length order, [(start, end) into the batch's
    concatenated order, shortest and longest length of the block)])."""
    order = np.argsort(lengths, kind="stable")
    sorted_lengths = lengths[order]
    base = offset  # this query's pairs start at ``offset`` in the concatenated order as well
    blocks = [(base + a, base + b, int(sorted_lengths[a]), int(sorted_lengths[b - 1]))
              for a, b in length_blocks(sorted_lengths, block_tokens)]
    return order + offset, blocks


def ranked_pairs(pair_query: torch.Tensor, pair_doc: torch.Tensor, scores: torch.Tensor, tie_rank: torch.Tensor,
                 k: int, n_queries: int, exclude: torch.Tensor | None = None) -> torch.Tensor:
    """Each query's ``k`` best pairs in trec_eval's order (score descending, then ``tie_rank`` of the document
    descending: :func:`hil.data.ranking.top_k_indices`), ``exclude[q]`` (a document row, -1 for none) never
    ranked for query q. -> positions into the pairs, grouped by query (ascending), best first within each.

    Three stable sorts, the last key first: by id rank, by score, by query.
    """
    positions = torch.arange(len(scores), device=scores.device)
    if exclude is not None:
        positions = positions[pair_doc != exclude[pair_query]]
    for key, descending in ((tie_rank[pair_doc], True), (scores, True), (pair_query, False)):
        positions = positions[torch.argsort(key[positions], descending=descending, stable=True)]
    query = pair_query[positions]
    sizes = torch.bincount(query, minlength=n_queries)
    first = torch.cumsum(sizes, 0) - sizes
    return positions[torch.arange(len(positions), device=positions.device) - first[query] < k]
