"""Token-level geometry of a retriever: query-document token cosines (HIL Fig. 2) and isotropy of token clouds.

``token_cosines`` gives, for paired (query, document) texts, every (query token, document token) cosine per head
-- the "score distributions" of HIL Figure 2, whose mean is InterIso (HIL Eq. 2) -- and each query token's best
match (its MaxSim term, ColBERT Eq. 1). ``isotropy_scores`` gives the single-distribution metrics of HIL A.1 /
000 Section 3.2 / 004 Section 2.5 for one point cloud: I(W), Avg-Cos and IsoScore.

Choices: cosines are taken between the vectors as the model scores them (a post-hoc transform's output
included), L2-normalized again so that an unnormalized transform still gives cosines; only tokens that take
part in scoring count (``mask``: a query's ``[MASK]`` augmentation tokens included, a document's punctuation
and padding excluded). Pairs are a query with its top-ranked document(s) of a run (BM25's by default in the
report, so that every model is measured on the same pairs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from hil.evaluation.runs import ranked
from hil.isotropy.metrics import avg_cos, isoscore, masked_tokens, partition_isotropy
from hil.modeling.contracts import Encoder
from hil.modeling.scoring import masked_max
from hil.retrieval.encoding import eval_mode


def top_pairs(run: Mapping[str, Mapping[str, float]], depth: int = 1, max_queries: int | None = None,
              queries: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """(qid, docid) pairs: each query's ``depth`` best documents of ``run`` (trec_eval order), queries in sorted
    order (or the order of ``queries``), at most ``max_queries`` queries."""
    qids = [q for q in (queries if queries is not None else sorted(run)) if run.get(q)]
    if max_queries is not None:
        qids = qids[:max_queries]
    return [(qid, docid) for qid in qids for docid, _ in ranked(run[qid], depth)]


@dataclass
class TokenCosines:
    """Per head: every (query token, document token) cosine of the pairs, and every query token's MaxSim."""

    all_pairs: dict[str, np.ndarray]  # head -> (P,) float32
    maxsim: dict[str, np.ndarray]     # head -> (T,) float32, one per scored query token
    n_pairs: int

    def summary(self) -> dict[str, dict[str, float]]:
        """Mean (= InterIso over the pairs' tokens), std and quartiles of each head's cosines, and mean MaxSim."""
        out = {}
        for head, values in self.all_pairs.items():
            q1, median, q3 = np.percentile(values, [25, 50, 75]) if values.size else (np.nan,) * 3
            out[head] = {"mean": float(values.mean()) if values.size else float("nan"),
                         "std": float(values.std()) if values.size else float("nan"),
                         "q1": float(q1), "median": float(median), "q3": float(q3),
                         "maxsim_mean": float(self.maxsim[head].mean()) if self.maxsim[head].size else float("nan"),
                         "n_values": int(values.size)}
        return out


def pair_cosines(queries: Tensor, docs: Tensor, query_mask: Tensor, doc_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Cosines of paired rows: queries (B, Lq, D), docs (B, Ld, D), masks (B, Lq) / (B, Ld) bool.

    -> (all valid (i, j) cosines flattened (P,), each valid query token's max over valid doc tokens (T,)).
    A row without a valid document token contributes no MaxSim value.
    """
    q = F.normalize(queries.float(), dim=-1)
    d = F.normalize(docs.float(), dim=-1)
    sims = torch.einsum("bqd,bld->bql", q, d)                       # (B, Lq, Ld)
    valid = query_mask.bool()[:, :, None] & doc_mask.bool()[:, None, :]
    values = sims[valid]  # a copy: taken before masked_max overwrites ``sims``
    best = masked_max(sims, doc_mask.bool()[:, None, :])            # (B, Lq)
    keep = query_mask.bool() & doc_mask.bool().any(dim=1, keepdim=True)
    return values, best[keep]


def token_cosines(encoder: Encoder, query_texts: Sequence[str], doc_texts: Sequence[str], *,
                  batch_size: int = 16) -> TokenCosines:
    """Query-document token cosines of each head for the paired texts (query i with document i); HIL Fig. 2."""
    if len(query_texts) != len(doc_texts):
        raise ValueError(f"token_cosines: {len(query_texts)} queries but {len(doc_texts)} documents")
    all_pairs: dict[str, list[np.ndarray]] = {head: [] for head in encoder.head_names}
    maxsim: dict[str, list[np.ndarray]] = {head: [] for head in encoder.head_names}
    with eval_mode(encoder):
        for start in range(0, len(query_texts), batch_size):
            q = encoder.encode_queries(list(query_texts[start: start + batch_size]))
            d = encoder.encode_documents(list(doc_texts[start: start + batch_size]))
            for head in encoder.head_names:
                values, best = pair_cosines(q.heads[head], d.heads[head], q.mask, d.mask)
                all_pairs[head].append(values.cpu().numpy().astype(np.float32))
                maxsim[head].append(best.cpu().numpy().astype(np.float32))
    join = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.float32)  # noqa: E731
    return TokenCosines({h: join(p) for h, p in all_pairs.items()}, {h: join(p) for h, p in maxsim.items()},
                        len(query_texts))


def query_token_vectors(encoder: Encoder, texts: Sequence[str], *, batch_size: int = 64) -> dict[str, Tensor]:
    """Every scored query token vector of each head, as the model scores them. -> head -> (T, D) fp32"""
    parts: dict[str, list[Tensor]] = {head: [] for head in encoder.head_names}
    with eval_mode(encoder):
        for start in range(0, len(texts), batch_size):
            batch = encoder.encode_queries(list(texts[start: start + batch_size]))
            for head in encoder.head_names:
                parts[head].append(masked_tokens(batch.heads[head].float(), batch.mask.bool()).cpu())
    return {head: torch.cat(chunks) for head, chunks in parts.items()}


def isotropy_scores(points: Tensor, max_points: int | None = 20_000, seed: int = 0) -> dict[str, float]:
    """I(W) (partition score, higher = more isotropic), Avg-Cos (lower = more isotropic) and IsoScore (higher =
    more isotropic) of a point cloud (N, D); HIL A.1, 000 Eqs. 3-4, 004 Section 2.5. At most ``max_points``
    points, sampled without replacement (seeded), enter the scores."""
    if points.dim() != 2 or points.shape[0] < 2:
        raise ValueError(f"isotropy_scores: expected at least 2 points (N, D), got shape {tuple(points.shape)}")
    if max_points is not None and points.shape[0] > max_points:
        rows = np.sort(np.random.default_rng(seed).choice(points.shape[0], max_points, replace=False))
        points = points[torch.from_numpy(rows)]
    x = points.double()
    return {"I(W)": float(partition_isotropy(x)), "avg_cos": float(avg_cos(x)), "isoscore": float(isoscore(x)),
            "n_points": int(points.shape[0]), "dim": int(points.shape[1])}
