"""Late interaction (MaxSim, ColBERT Eq. 1 / HIL Eq. 1) as pure tensor functions; the losses on it: ``losses.py``.

Shapes: B batch, Lq query tokens, Ld document tokens, D embedding dimension. Masks are boolean, True where a
token takes part. Embeddings are assumed L2-normalized by the encoder, so a dot product is a cosine.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_max(sim: Tensor, doc_mask: Tensor | None) -> Tensor:
    """Max over the last axis (document tokens), ignoring entries where ``doc_mask`` (broadcastable to ``sim``)
    is False; a row with no token left scores 0 (Eq. 1 with an empty document). ``sim`` is overwritten."""
    if doc_mask is None:
        return sim.max(dim=-1).values if sim.requires_grad else sim.amax(dim=-1)  # amax: no indices to compute
    # In place: ``sim`` is a fresh product that the matmul's backward does not need, and it is the largest
    # tensor of late interaction (Bq * Bd * Lq * Ld); an out-of-place fill would double the peak memory.
    sim = sim.masked_fill_(~doc_mask, float("-inf"))
    if sim.requires_grad:  # max routes the gradient to one winner among ties (amax would split it)
        best = sim.max(dim=-1).values
        return torch.where(torch.isneginf(best), torch.zeros_like(best), best)
    best = sim.amax(dim=-1)  # no indices to compute
    return best.masked_fill_(torch.isneginf(best), 0.0)  # only an empty document leaves -inf


def maxsim(queries: Tensor, docs: Tensor, doc_mask: Tensor | None = None) -> Tensor:
    """Per query token, the best match in the paired document: ``max_j E_qi . E_dj`` (inner term of Eq. 1).

    queries (B, Lq, D), docs (B, Ld, D), doc_mask (B, Ld) -> (B, Lq).

    A query of two tokens (the axes) and a document of three (the last one padding): each query token's best
    cosine, 1 (the second document token) and 0.8 (the first); with only the first document token, 0.6 and 0.8.

    >>> query = torch.tensor([[[1., 0.], [0., 1.]]])
    >>> document = torch.tensor([[[0.6, 0.8], [1., 0.], [0., 0.]]])
    >>> maxsim(query, document)
    tensor([[1.0000, 0.8000]])
    >>> maxsim(query, document, doc_mask=torch.tensor([[True, False, False]]))
    tensor([[0.6000, 0.8000]])
    """
    sim = torch.einsum("bqd,bkd->bqk", queries, docs)  # (B, Lq, Ld)
    return masked_max(sim, None if doc_mask is None else doc_mask[:, None, :])


def maxsim_matrix(queries: Tensor, docs: Tensor, doc_mask: Tensor | None = None) -> Tensor:
    """MaxSim of every query against every document.

    queries (Bq, Lq, D), docs (Bd, Ld, D), doc_mask (Bd, Ld) -> (Bq, Bd, Lq).
    """
    if queries.shape[0] == 1:  # one query against many documents (full ranking, query by query)
        # One plain (Bd * Ld, D) @ (D, Lq) product: ~1.4x faster on a CPU than the batched product einsum makes of
        # it (bench/README.md, search); the max then runs over a strided axis of a view, as cheap.
        n_docs, doc_len, dim = docs.shape
        sim = (docs.reshape(-1, dim) @ queries[0].T).view(n_docs, doc_len, -1).transpose(1, 2)  # (Bd, Lq, Ld)
        return masked_max(sim, None if doc_mask is None else doc_mask[:, None, :])[None]
    sim = torch.einsum("qid,bjd->qbij", queries, docs)  # (Bq, Bd, Lq, Ld)
    return masked_max(sim, None if doc_mask is None else doc_mask[None, :, None, :])


def sum_query_tokens(token_scores: Tensor, query_mask: Tensor | None) -> Tensor:
    """Sum per-token scores over the query tokens that take part. token_scores (..., Lq), query_mask (Bq, Lq)."""
    if query_mask is None:
        return token_scores.sum(dim=-1)
    mask = query_mask.to(token_scores.dtype)
    if token_scores.dim() == 3:  # (Bq, Bd, Lq)
        mask = mask[:, None, :]
    return (token_scores * mask).sum(dim=-1)


def late_interaction(queries: Tensor, docs: Tensor, query_mask: Tensor | None = None,
                     doc_mask: Tensor | None = None) -> Tensor:
    """Eq. 1 of HIL (ColBERT): ``score(q, d) = sum_i max_j E_qi . E_dj`` for paired rows. -> (B,)

    The query and document of :func:`maxsim`: 1 + 0.8; with the query's second token masked out, 1.

    >>> query = torch.tensor([[[1., 0.], [0., 1.]]])
    >>> document = torch.tensor([[[0.6, 0.8], [1., 0.], [0., 0.]]])
    >>> late_interaction(query, document)
    tensor([1.8000])
    >>> late_interaction(query, document, query_mask=torch.tensor([[True, False]]))
    tensor([1.])
    """
    return sum_query_tokens(maxsim(queries, docs, doc_mask), query_mask)


def late_interaction_matrix(queries: Tensor, docs: Tensor, query_mask: Tensor | None = None,
                            doc_mask: Tensor | None = None) -> Tensor:
    """Eq. 1 for every (query, document) pair. -> (Bq, Bd)

    One query against two documents: the first as in :func:`late_interaction` (1.8); the second matches the query's
    second token exactly and nothing of its first (0 + 1). A document with no token left scores 0.

    >>> query = torch.tensor([[[1., 0.], [0., 1.]]])
    >>> documents = torch.tensor([[[0.6, 0.8], [1., 0.]], [[0., 1.], [0., 0.]]])
    >>> late_interaction_matrix(query, documents)
    tensor([[1.8000, 1.0000]])
    >>> late_interaction_matrix(query, documents, doc_mask=torch.tensor([[True, True], [False, False]]))
    tensor([[1.8000, 0.0000]])
    """
    return sum_query_tokens(maxsim_matrix(queries, docs, doc_mask), query_mask)
