"""ColBERT-HIL scoring (HIL Section 3.3) as pure tensor functions.

    M(q_i, d)     = max_j E_qi . E_dj                                  (inner term of Eq. 1)
    S_L(q_i, d)   = IDF(q_i) * M_L(q_i, d)       lexical head L (projected vocabulary embeddings)
    S_H(q_i, d)   = M_H(q_i, d)                  contextual head H (projected last hidden state, as ColBERT)
    S'(q_i, d)    = (S(q_i, d) - m) / sigma      z-score with one mean / std per head
    score_late(q, d) = sum_i S'(q_i, d)          per head; at inference score = score_late_L + score_late_H

Shapes: Bq queries, Bd documents, B (query, document) pairs, Lq / Ld tokens, D embedding dimension. Masks are bool,
True where a token takes part. Which query tokens take part is the caller's choice (``HILEncoder`` leaves tokens
with IDF weight 0 out of the lexical head, see ``lexical_query_mask``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from hil.modeling.scoring import maxsim, maxsim_matrix, sum_query_tokens

DEFAULT_EPS = 1e-5


def hil_token_scores(query_L: Tensor, doc_L: Tensor, query_H: Tensor, doc_H: Tensor, query_idf: Tensor,
                     doc_mask: Tensor | None = None, all_pairs: bool = False) -> tuple[Tensor, Tensor]:
    """Per-query-token scores of both heads, ``(S_L, S_H)`` (HIL Sec. 3.3, the equations for S_L and S_H).

    query_* (Bq, Lq, D), doc_* (Bd, Ld, D), query_idf (Bq, Lq) the IDF weight of each query token, doc_mask
    (Bd, Ld). Paired rows (``all_pairs=False``, Bq == Bd) -> two (B, Lq); every query against every document
    (``all_pairs=True``) -> two (Bq, Bd, Lq). Masked document tokens never win the max; a document with no token
    left scores 0. Computed in float32 at least.
    """
    dtype = torch.promote_types(query_L.dtype, torch.float32)
    query_L, doc_L, query_H, doc_H = (x.to(dtype) for x in (query_L, doc_L, query_H, doc_H))
    if all_pairs:
        best_L = maxsim_matrix(query_L, doc_L, doc_mask)           # (Bq, Bd, Lq)
        best_H = maxsim_matrix(query_H, doc_H, doc_mask)           # (Bq, Bd, Lq)
        weights = query_idf.to(dtype)[:, None, :]                  # (Bq, 1, Lq)
    else:
        if query_L.shape[0] != doc_L.shape[0]:
            raise ValueError(f"hil_token_scores pairs rows: {query_L.shape[0]} queries vs {doc_L.shape[0]} documents")
        best_L = maxsim(query_L, doc_L, doc_mask)                  # (B, Lq)
        best_H = maxsim(query_H, doc_H, doc_mask)                  # (B, Lq)
        weights = query_idf.to(dtype)                              # (B, Lq)
    return weights * best_L, best_H


def lexical_query_mask(query_mask: Tensor, query_idf: Tensor) -> Tensor:
    """Query tokens that take part in the lexical head: scored (``query_mask``) and with a non-zero IDF weight.

    Tokens weighted 0 ([CLS], markers, the [MASK] query padding) would only add constant zeros to S_L: left out,
    they neither shift the batch moments nor add a constant ``-m / sigma`` to the z-scored sum.
    """
    return query_mask.bool() & (query_idf != 0)


def batch_moments(x: Tensor, mask: Tensor | None = None, eps: float = DEFAULT_EPS,
                  unbiased: bool = False) -> tuple[Tensor, Tensor]:
    """Mean and standard deviation of the entries of ``x`` where ``mask`` is True (HIL Sec. 3.3, m and sigma).

    x (...), mask (...) bool of the same shape or None (all entries) -> two scalars. The std is the population
    one (ddof 0; ``unbiased``: ddof 1, ``torch.std``'s default, which the HIL authors' code uses) and is taken as
    ``sqrt(var + eps)`` (as BatchNorm): a single value or a constant batch gives ``sqrt(eps)`` instead of 0 / NaN,
    and the gradient stays finite at var = 0 (sqrt alone has an infinite derivative there). No selected entry
    gives mean 0, std sqrt(eps). Differentiable; float32 at least.
    """
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    if mask is None:
        mask = torch.ones_like(x, dtype=torch.bool)
    if mask.shape != x.shape:
        raise ValueError(f"batch_moments: mask shape {tuple(mask.shape)} differs from x shape {tuple(x.shape)}")
    weights = mask.to(x.dtype)
    count = weights.sum()
    mean = (x * weights).sum() / count.clamp(min=1.0)
    variance = ((x - mean).square() * weights).sum() / (count - float(unbiased)).clamp(min=1.0)
    return mean, torch.sqrt(variance + eps)


def per_query_moments(token_scores: Tensor, query_mask: Tensor, eps: float = DEFAULT_EPS,
                      unbiased: bool = False) -> tuple[Tensor, Tensor]:
    """Mean and std of each query's token scores against every document it is scored with (the HIL authors'
    evaluation, which z-scores the scores it is evaluating). token_scores (Bq, Bd, Lq), query_mask (Bq, Lq)
    -> two (Bq, 1) tensors, broadcastable against (Bq, Bd)."""
    weights = query_mask[:, None, :].to(token_scores.dtype).expand_as(token_scores)
    count = weights.sum(dim=(1, 2))
    mean = (token_scores * weights).sum(dim=(1, 2)) / count.clamp(min=1.0)
    centred = (token_scores - mean[:, None, None]).square() * weights
    variance = centred.sum(dim=(1, 2)) / (count - float(unbiased)).clamp(min=1.0)
    return mean[:, None, None], torch.sqrt(variance + eps)[:, None, None]


def zscore_from_sums(late_raw: Tensor, square_sums: Tensor, n_tokens: Tensor, eps: float = DEFAULT_EPS,
                     unbiased: bool = False) -> Tensor:
    """Per-query z-scored ``score_late`` from sums accumulated over blocks of documents.

    late_raw (Bq, C) = sum_i S(q_i, d), square_sums (Bq, C) = sum_i S(q_i, d)^2 over each query's scored tokens,
    n_tokens (Bq,) how many tokens each query scores with. The moments are those of all (document, token) scores
    of the query (as :func:`per_query_moments` over all C documents at once), and
    ``score_late = sum_i (S_i - m) / sigma = (late_raw - n m) / sigma``. Sums in float64. -> (Bq, C)
    """
    raw = late_raw.to(torch.float64)
    n = n_tokens.to(torch.float64)[:, None] * raw.shape[1]          # (Bq, 1) entries per query
    mean = raw.sum(dim=1, keepdim=True) / n.clamp(min=1.0)
    variance = (square_sums.to(torch.float64).sum(dim=1, keepdim=True) - n * mean.square()).clamp(min=0.0)
    std = torch.sqrt(variance / (n - float(unbiased)).clamp(min=1.0) + eps)
    return ((raw - n_tokens.to(torch.float64)[:, None] * mean) / std).to(late_raw.dtype)


def zscore(x: Tensor, mean: Tensor | float, std: Tensor | float, eps: float = DEFAULT_EPS) -> Tensor:
    # mean / std are scalars, or (Bq, 1, 1) per-query moments against (Bq, Bd, Lq) scores
    """``S' = (S - m) / sigma`` (HIL Sec. 3.3), with sigma floored at ``eps`` so a zero std cannot divide by 0."""
    std = torch.as_tensor(std, dtype=x.dtype, device=x.device).clamp(min=eps)
    return (x - mean) / std


def zscored_late_interaction(token_scores: Tensor, query_mask: Tensor | None, mean: Tensor | float,
                             std: Tensor | float, eps: float = DEFAULT_EPS) -> Tensor:
    """``score_late(q, d) = sum_i S'(q_i, d)`` over the query tokens in ``query_mask`` (HIL Sec. 3.3).

    token_scores (B, Lq) with query_mask (B, Lq) -> (B,); or (Bq, Bd, Lq) with query_mask (Bq, Lq) -> (Bq, Bd).
    """
    return sum_query_tokens(zscore(token_scores, mean, std, eps), query_mask)
