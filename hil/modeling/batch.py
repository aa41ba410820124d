"""The batch every training term sees: B queries, each with N documents, and optional teacher scores.

Layout (``RankingBatch``): the queries are encoded once, (B, Lq); the documents are encoded together, (N B, Ld),
*column by column*: document j of query i is row ``j B + i``. Column 0 holds each query's positive (or, for examples
graded by a teacher, its first document). With N = 2 this is exactly the triples' ``[positives; negatives]`` of
ColBERT v1 training (``TripleBatch``), so a triple batch is the same tensors, scored by the same calls, as before
n-way batches existed. ``pair_index`` (N B,) is the query row of each document: ``arange(B)`` repeated N times.

What is computed once per step and shared by every term (``_cache``):
- ``head_scores(encoder)``: each head's score of every (query, own document) pair as a (B, N) matrix -- for
  ColBERT-HIL the z-scored ``score_late`` of each head with the moments of the whole batch (all N B pairs at once;
  this also updates the running z-score estimates, which must happen once a step), for every other encoder
  ``score_heads`` column by column (for N = 2: the positives, then the negatives, as the pairwise loss always did);
- ``inter_iso(head)``: InterIso (HIL Eq. 2) of each of the N B (query, document) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from hil.isotropy.metrics import inter_iso
from hil.modeling.contracts import EncodedBatch, Encoder


@dataclass
class RankingBatch:
    """An encoded batch of B queries x N documents (see the module docstring for the layout)."""

    queries: EncodedBatch                # heads (B, Lq, D)
    docs: EncodedBatch                   # heads (N B, Ld, D), document j of query i at row j B + i
    teacher_scores: Tensor | None = None  # (B, N) float, larger = more relevant; None without a teacher
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        queries, docs = len(self.queries), len(self.docs)
        if queries == 0 or docs % queries or docs // queries < 2:
            raise ValueError(f"RankingBatch: {queries} queries need N >= 2 documents each, laid out column by "
                             f"column (N x {queries} rows), got {docs} documents")
        if self.teacher_scores is not None and tuple(self.teacher_scores.shape) != (queries, docs // queries):
            raise ValueError(f"RankingBatch: teacher scores must be (B, N) = ({queries}, {docs // queries}), got "
                             f"{tuple(self.teacher_scores.shape)}")

    @property
    def size(self) -> int:
        """B, the number of queries."""
        return len(self.queries)

    @property
    def n_documents(self) -> int:
        """N, the documents of each query."""
        return len(self.docs) // len(self.queries)

    def column(self, j: int) -> EncodedBatch:
        """Document j of every query, (B, Ld)."""
        return self.docs.select(slice(j * self.size, (j + 1) * self.size))

    @property
    def positives(self) -> EncodedBatch:
        return self.column(0)

    @property
    def negatives(self) -> EncodedBatch:
        """Columns 1 .. N - 1, ((N - 1) B, Ld), in the batch's layout."""
        return self.docs.select(slice(self.size, len(self.docs)))

    @cached_property
    def pair_index(self) -> Tensor:
        return torch.arange(self.size, device=self.docs.mask.device).repeat(self.n_documents)  # (N B,)

    @cached_property
    def paired_queries(self) -> EncodedBatch:
        return self.queries.select(self.pair_index)  # heads (N B, Lq, D)

    def as_matrix(self, per_pair: Tensor) -> Tensor:
        """A value of each (query, document) pair in the batch's row order, (N B,), as (B, N). Built by stacking the
        N column slices (for N = 2 the ``stack([x[:B], x[B:]], 1)`` the pairwise loss always built)."""
        b = self.size
        return torch.stack([per_pair[j * b:(j + 1) * b] for j in range(self.n_documents)], dim=1)

    def inter_iso(self, head: str) -> Tensor:
        """InterIso of every (q, d) pair for one head, over the tokens that are scored. -> (N B,), differentiable."""
        key = f"inter_iso:{head}"
        if key not in self._cache:
            self._cache[key] = inter_iso(self.paired_queries.heads[head], self.docs.heads[head],
                                         self.paired_queries.mask, self.docs.mask)
        return self._cache[key]

    def head_scores(self, encoder: Encoder) -> dict[str, Tensor]:
        """Each head's training score of every (query, own document) pair: head -> (B, N). Computed once a step."""
        if "head_scores" not in self._cache:
            scores, masks = encoder.training_head_scores(self.queries, self.docs, self.n_documents)
            self._cache["head_scores"], self._cache["query_masks"] = scores, masks
        return self._cache["head_scores"]

    def hil_query_masks(self, encoder: Encoder) -> dict[str, Tensor]:
        """ColBERT-HIL's query tokens taking part in each head, of the paired queries: head -> (N B, Lq)."""
        self.head_scores(encoder)
        masks = self._cache["query_masks"]
        if masks is None:
            raise TypeError(f"{type(encoder).__name__} scores without per-head query masks (a ColBERT-HIL term "
                            "needs a HILEncoder)")
        return masks


class TripleBatch(RankingBatch):
    """B triples <q, d+, d->: a :class:`RankingBatch` with N = 2, documents as [positives; negatives]."""

    def __post_init__(self) -> None:
        if len(self.docs) != 2 * len(self.queries):
            raise ValueError(f"TripleBatch: {len(self.queries)} queries need 2 x {len(self.queries)} documents "
                             f"(positives then negatives), got {len(self.docs)}")
        super().__post_init__()
