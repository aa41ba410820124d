"""Isotropy regularizers added to the late-interaction loss: InterIso (HIL Section 3.2), CosReg and I-STAR (A.1, A.3).

Each ``*_reg`` function returns the unweighted term L_reg. The regularizer objects (``InterIsoRegularizer``,
``CosRegRegularizer``, ``IStarRegularizer``) are the ``nn.Module`` a ``RetrieverModule`` holds: ``term(...)`` gives
the unweighted L_reg and its logs, and the training objective adds ``lambda * L_reg`` (``weight`` is the paper's
lambda; ``hil.modeling.terms`` sums every term as ``weight * value``); calling the object gives ``(lambda * L_reg,
logs)``. I-STAR keeps its shrinkage covariances as buffers, so they are saved in checkpoints. A config picks one by
``class_path`` (``model.regularizer``, or in ``model.terms`` beside any loss); no regularizer is ``null``. All terms
are computed on the projected, L2-normalized token embeddings that late interaction scores, with padding excluded
through the boolean masks.

Batches of B queries x N documents (``hil.modeling.batch.RankingBatch``: documents column by column, ``pair_index``
the query row of each): InterIso is taken over all N B (query, document) pairs; CosReg and I-STAR over the queries'
token cloud (each query once) and the N B documents' token cloud; the authors' conditional isotropy over the
(q, d+) pairs, column 0. With triples (N = 2) that is what it always was.

Shapes: Bq queries, B (query, document) pairs, Lq / Ld tokens, N valid tokens, D embedding dimension.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from typing import Any, Literal

import torch
from torch import Tensor, nn

from hil.isotropy.metrics import (
    covariance,
    inter_iso,
    isoscore_star,
    masked_tokens,
    sum_offdiagonal_cosines,
    token_cloud,
)

ShrinkageTarget = Literal["identity", "running"]
SHRINKAGE_TARGETS: tuple[str, ...] = ("identity", "running")


# --------------------------------------------------------------------------------------------------------------
# The regularization terms
# --------------------------------------------------------------------------------------------------------------

def interiso_reg(inter_iso_values: Tensor, absolute: bool) -> Tensor:
    """L_reg of HIL Section 3.2 averaged over a batch of (q, d) pairs; the caller multiplies by lambda.

        L_reg(q, d) = InterIso(q, d)        for anisotropy (lambda < 0: lambda * L_reg rewards InterIso -> 1)
                      |InterIso(q, d)|      for isotropy   (lambda > 0: lambda * L_reg pushes InterIso -> 0)

    inter_iso_values (B,) -> scalar; ``absolute`` picks the second form. The absolute value is taken per (q, d)
    pair, before the batch mean, so that pairs of opposite sign cannot cancel. ColBERT-HIL uses both forms at once
    (``-|InterIso_L|`` and ``InterIso_H``, Sec. 3.3).
    """
    if inter_iso_values.dim() != 1:
        raise ValueError(f"hil.isotropy.regularizers: interiso_reg expects InterIso values (B,), "
                         f"got shape {tuple(inter_iso_values.shape)}")
    per_pair = inter_iso_values.abs() if absolute else inter_iso_values
    return per_pair.mean()


def cosreg(x: Tensor, weights: Tensor | None = None) -> Tensor:
    """CosReg of Gao et al. (2019), HIL A.1 / A.3: ``1 / M^2 * sum_i sum_{j != i} x^_i^T x^_j`` over M points.

    x (M, D) -> scalar. Rows are L2-normalized (A.1's x^_i = x_i / ||x_i||; a no-op on the encoders' normalized
    embeddings). Note the 1 / M^2 (not 1 / (M (M - 1)) as Avg-Cos), as the paper and the I-STAR reference code.
    With fewer than 2 points there is no pair and the term is 0. ``weights`` (M,) 1.0 / 0.0
    (:func:`~hil.isotropy.metrics.token_cloud`): the points weighted 1 only, counted on the device (no host sync).
    """
    if x.dim() != 2:
        raise ValueError(f"hil.isotropy.regularizers: cosreg expects points (M, D), got shape {tuple(x.shape)}")
    if weights is not None:
        m = weights.sum()
        total = sum_offdiagonal_cosines(x * weights[:, None].to(x.dtype))  # zero rows contribute nothing
        return torch.where(m >= 2, total / m.to(total.dtype).clamp(min=1).square(), torch.zeros_like(total))
    m = x.shape[0]
    if m < 2:
        return x.sum() * 0.0  # keeps the graph and device
    return sum_offdiagonal_cosines(x) / m ** 2


def istar_reg(x: Tensor, shrinkage_cov: Tensor | None, zeta: float = 0.2, weights: Tensor | None = None) -> Tensor:
    """I-STAR term of Rudman & Eickhoff (2023), HIL A.1 / A.3: ``1 - IsoScore*(x, C)``.

    x (M, D), shrinkage_cov C (D, D) or None (batch covariance alone) -> scalar in [0, 1]; 0 when the shrunk
    covariance is isotropic. Minimizing it (lambda > 0) spreads variance over more directions, maximizing it
    (lambda < 0) concentrates it. With fewer than 2 points the covariance is undefined and the term is 0.
    ``weights``: as :func:`cosreg`'s (the rows weighted 1 only, counted on the device).
    """
    if x.dim() != 2:
        raise ValueError(f"hil.isotropy.regularizers: istar_reg expects points (M, D), got shape {tuple(x.shape)}")
    if x.shape[0] < 2:
        return x.sum() * 0.0
    if weights is None:
        return 1.0 - isoscore_star(x, shrinkage_cov, zeta)
    # With fewer than 2 weighted rows the covariance is the zero matrix (finite, as its gradient): the term is 0.
    value = 1.0 - isoscore_star(x, shrinkage_cov, zeta, weights)
    return torch.where(weights.sum() >= 2, value, torch.zeros_like(value))


def mean_token_dot(queries: Tensor, docs: Tensor) -> Tensor:
    """Mean of every query-token / document-token dot product over a batch of pairs, padding included.

    queries (B, Lq, D), docs (B, Ld, D) -> scalar = mean over b, i, j of ``q_bi . d_bj``: ``torch.mean`` of the
    (B, Lq, Ld) similarity tensor, as the HIL authors' code takes it (its zero padding vectors count as zeros).
    Computed as ``(sum_i q_bi) . (sum_j d_bj) / (Lq Ld)``, without the (B, Lq, Ld) tensor.
    """
    if queries.dim() != 3 or docs.dim() != 3 or queries.shape[0] != docs.shape[0]:
        raise ValueError(f"hil.isotropy.regularizers: mean_token_dot expects (B, Lq, D) and (B, Ld, D), got "
                         f"{tuple(queries.shape)} and {tuple(docs.shape)}")
    per_pair = (queries.sum(dim=1) * docs.sum(dim=1)).sum(dim=-1)  # (B,)
    return per_pair.mean() / (queries.shape[1] * docs.shape[1])


def authors_hil_reg(mean_dot_L: Tensor, mean_dot_H: Tensor) -> Tensor:
    """The HIL authors' regularizer ("sensim" in their code): ``mean(H dots) - |mean(L dots)|``, each the
    :func:`mean_token_dot` of one head over the batch's (q, d+) and (q, d-) pairs; with lambda = -0.3 it rewards
    H's similarities and pushes L's batch mean toward 0 (the absolute value of the batch mean, not per pair)."""
    return mean_dot_H - mean_dot_L.abs()


def conditional_isotropy(queries: Tensor, docs: Tensor) -> Tensor:
    """The HIL authors' "conditional isotropy" of ColBERT (their ``cond_isotropy`` with ``avg_cos``).

    queries (B, Lq, D), docs (B, Ld, D) (L2-normalized, padding zero): for each pair b and query token i, the
    document tokens with their component along q_bi removed, ``e_bij = normalize(d_bj - (q_bi . d_bj) q_bi)``; the
    term is the mean over b, i, j, k of ``e_bij . e_bik`` (the average cosine of the residuals, j = k and the zero
    padding rows included, as ``torch.mean`` over their (B, Lq, Ld, Ld) tensor). Equal to the mean over b, i of
    ``|sum_j e_bij|^2 / Ld^2``, which is how it is computed: (B, Lq, Ld, D) memory, not (B, Lq, Ld, Ld). -> scalar
    """
    if queries.dim() != 3 or docs.dim() != 3 or queries.shape[0] != docs.shape[0]:
        raise ValueError(f"hil.isotropy.regularizers: conditional_isotropy expects (B, Lq, D) and (B, Ld, D), got "
                         f"{tuple(queries.shape)} and {tuple(docs.shape)}")
    cos = torch.einsum("bid,bjd->bij", queries, docs)                               # (B, Lq, Ld)
    residual = docs[:, None, :, :] - cos[..., None] * queries[:, :, None, :]         # (B, Lq, Ld, D)
    residual = torch.nn.functional.normalize(residual, p=2, dim=-1)
    summed = residual.sum(dim=2)                                                     # (B, Lq, D)
    return summed.square().sum(dim=-1).mean() / docs.shape[1] ** 2


# --------------------------------------------------------------------------------------------------------------
# The regularizer objects
# --------------------------------------------------------------------------------------------------------------

def paired_rows(queries: Tensor, query_mask: Tensor | None, n_docs: int,
                pair_index: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The query row of each document: queries (Bq, Lq, D) -> (B, Lq, D) and its mask, for ``pair_index`` (B,)
    (None: Bq == B and row k pairs with row k). With triples <q, d+, d->, pass each query once and
    docs = cat([positives, negatives]) with pair_index = arange(Bq).repeat(2)."""
    if pair_index is None:
        if queries.shape[0] != n_docs:
            raise ValueError(f"hil.isotropy.regularizers: {queries.shape[0]} queries and {n_docs} docs need "
                             f"pair_index (the query row of each doc)")
        return queries, query_mask
    if pair_index.dim() != 1 or pair_index.shape[0] != n_docs:
        raise ValueError(f"hil.isotropy.regularizers: pair_index must be (B,) = ({n_docs},), "
                         f"got shape {tuple(pair_index.shape)}")
    return queries[pair_index], None if query_mask is None else query_mask[pair_index]


class Regularizer(nn.Module, metaclass=ABCMeta):
    """An isotropy term added to the late-interaction loss: ``loss = L_late + regularizer(...)[0]``.

    ``weight`` is the paper's lambda; its sign picks isotropy (> 0) or anisotropy (< 0). HIL A.3's best values:
    InterIso 0.4 / -0.1, CosReg 0.2 / -0.1, I-STAR 0.2 / -0.6 (``configs/variants``).
    """

    def __init__(self, weight: float = 0.0):
        super().__init__()
        self.weight = float(weight)

    def bind(self, dim: int) -> None:
        """Called once with the encoder's embedding dimension D before training (I-STAR sizes its buffers)."""

    def settings(self) -> dict[str, Any]:
        return {"class": f"{type(self).__module__}.{type(self).__qualname__}", "weight": self.weight}

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.settings().items() if k != "class")

    @abstractmethod
    def term(self, queries: Tensor, docs: Tensor, query_mask: Tensor | None = None,
             doc_mask: Tensor | None = None, pair_index: Tensor | None = None,
             inter_iso_values: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """(L_reg, detached values to log), unweighted. queries (Bq, Lq, D), docs (B, Ld, D), masks (Bq, Lq) /
        (B, Ld), pair_index (B,) the query row of each document (see :func:`paired_rows`). ``inter_iso_values``
        (B,): InterIso of the pairs when the caller has already computed it (with gradient)."""

    def forward(self, queries: Tensor, docs: Tensor, query_mask: Tensor | None = None,
                doc_mask: Tensor | None = None, pair_index: Tensor | None = None,
                inter_iso_values: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """(lambda * L_reg, detached values to log); the arguments as :meth:`term`."""
        reg, logs = self.term(queries, docs, query_mask, doc_mask, pair_index, inter_iso_values)
        return self.weight * reg, logs


class InterIsoRegularizer(Regularizer):
    """HIL Sec. 3.2: ``lambda * mean_pairs L_reg(q, d)``, InterIso over every (q, d) pair given -- with triples,
    the (q, d+) and (q, d-) pairs alike, as the paper writes L_reg(q, d) without restricting d.
    ``L_reg = |InterIso|`` for lambda >= 0 (at lambda = 0 the term is multiplied by 0 anyway), ``InterIso`` below.

    Logs ``inter_iso`` (batch mean) and ``reg`` (the unweighted L_reg).
    """

    def term(self, queries: Tensor, docs: Tensor, query_mask: Tensor | None = None,
             doc_mask: Tensor | None = None, pair_index: Tensor | None = None,
             inter_iso_values: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        if inter_iso_values is None:
            paired, paired_mask = paired_rows(queries, query_mask, docs.shape[0], pair_index)
            inter_iso_values = inter_iso(paired, docs, paired_mask, doc_mask)  # (B,)
        reg = interiso_reg(inter_iso_values, absolute=self.weight >= 0)
        return reg, {"inter_iso": inter_iso_values.detach().mean(), "reg": reg.detach()}


class ConditionalIsotropyRegularizer(Regularizer):
    """The HIL authors' ColBERT-iso / -aniso term (their code's ``sensim`` for ColBERT): ``lambda *
    conditional_isotropy`` on the (q, d+) pairs only (the first half of their batch), added as is (no absolute
    value; lambda > 0 lowers the residuals' average cosine, lambda < 0 raises it). The paper's ColBERT-iso /
    -aniso use :class:`InterIsoRegularizer` instead. Logs ``reg`` (the unweighted term)."""

    def term(self, queries: Tensor, docs: Tensor, query_mask: Tensor | None = None,
             doc_mask: Tensor | None = None, pair_index: Tensor | None = None,
             inter_iso_values: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        n = queries.shape[0]
        if pair_index is not None and not torch.equal(pair_index[:n].cpu(), torch.arange(n)):
            raise ValueError("hil.isotropy.regularizers: ConditionalIsotropyRegularizer expects the documents as "
                             "[positives; negatives] with positive k paired with query k")
        positives = docs[:n] if doc_mask is None else docs[:n] * doc_mask[:n, :, None].to(docs.dtype)
        reg = conditional_isotropy(queries, positives)
        return reg, {"reg": reg.detach()}


def _selected_tokens(x: Tensor, mask: Tensor | None) -> tuple[Tensor, None]:
    return masked_tokens(x, mask), None


def _valid_tokens(device: torch.device):
    """How a token cloud's valid tokens are taken on ``device``: selected on a CPU (no sync to save there, and the
    objective stays bit for bit what it was: tests/test_terms.py), weighted elsewhere
    (:func:`~hil.isotropy.metrics.token_cloud`: a boolean selection reads its size back from the device, a host
    sync each step; the weighted terms equal the selected ones to rounding)."""
    return _selected_tokens if device.type == "cpu" else token_cloud


class _TokenCloudRegularizer(Regularizer):
    """HIL A.3 for CosReg and I-STAR: ``lambda / 2 * (L_reg(q) + L_reg(d))``, each on the flattened valid tokens
    of the batch, queries and documents separately. Logs ``reg`` (the mean of the two sides), ``reg_query`` and
    ``reg_doc``."""

    @abstractmethod
    def side_term(self, side: str, points: Tensor, weights: Tensor | None) -> Tensor:
        """L_reg of one token cloud (``side`` is "query" or "doc"). points (N, D), weights (N,) 1.0 for the valid
        tokens, 0.0 for padding (None: all valid) -> scalar."""

    def term(self, queries: Tensor, docs: Tensor, query_mask: Tensor | None = None,
             doc_mask: Tensor | None = None, pair_index: Tensor | None = None,
             inter_iso_values: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        cloud = _valid_tokens(queries.device)
        reg_query = self.side_term("query", *cloud(queries, query_mask))
        reg_doc = self.side_term("doc", *cloud(docs, doc_mask))
        reg = (reg_query + reg_doc) / 2  # lambda * reg = lambda / 2 * (..): halving is exact in floating point
        return reg, {"reg": reg.detach(), "reg_query": reg_query.detach(), "reg_doc": reg_doc.detach()}


class CosRegRegularizer(_TokenCloudRegularizer):
    """CosReg (Gao et al. 2019; HIL A.1 / A.3) on the query and document token clouds (see :func:`cosreg`)."""

    def side_term(self, side: str, points: Tensor, weights: Tensor | None) -> Tensor:
        return cosreg(points, weights)


class IStarRegularizer(_TokenCloudRegularizer):
    """I-STAR (Rudman & Eickhoff 2023; HIL A.1 / A.3): ``1 - IsoScore*`` of each token cloud (see :func:`istar_reg`).

    ``zeta`` is the shrinkage weight of IsoScore* (0.2, the I-STAR code's default). ``shrinkage_target`` picks C:
      - "identity" (default): C = I, as HIL A.3 writes ``1 - IsoScore(X, I)`` for its DR adaptation;
      - "running": C is a per-side (D, D) buffer (``query_shrinkage_cov`` / ``doc_shrinkage_cov``) tracking the
        detached batch covariances with an exponential moving average,
        ``C <- (1 - momentum) C + momentum Cov(batch)``, started from the first batch's covariance. I-STAR
        re-estimates C from a sample of the current model at the start of each epoch (HIL A.1's C_i); an EMA is
        a streaming stand-in that needs no extra pass over the data. Each step uses C from the previous steps
        (the first step: the batch covariance alone), then updates it, only in training mode. The buffers are
        updated in place and live in the state dict, so checkpoints carry them and resume continues the
        average; under DDP (broadcast_buffers) every rank uses rank 0's average. Their size D comes from ``dim``
        or, when that is None, from the encoder (:meth:`bind`, called by the training module).
    """

    def __init__(self, weight: float = 0.0, zeta: float = 0.2, shrinkage_target: ShrinkageTarget = "identity",
                 momentum: float = 0.1, dim: int | None = None):
        super().__init__(weight)
        where = "hil.isotropy.regularizers: IStarRegularizer"
        if shrinkage_target not in SHRINKAGE_TARGETS:
            raise ValueError(f"{where} shrinkage_target must be one of {SHRINKAGE_TARGETS}, got {shrinkage_target!r}")
        if not 0.0 <= zeta <= 1.0:
            raise ValueError(f"{where} zeta must lie in [0, 1], got {zeta}")
        if not 0.0 < momentum <= 1.0:
            raise ValueError(f"{where} momentum must lie in (0, 1], got {momentum}")
        if dim is not None and dim < 1:
            raise ValueError(f"{where} dim must be >= 1 or null, got {dim}")
        self.zeta = float(zeta)
        self.shrinkage_target = shrinkage_target
        self.momentum = float(momentum)
        self.dim: int | None = None
        if dim is not None:
            self.bind(dim)

    def bind(self, dim: int) -> None:
        if self.dim is not None:
            if self.dim != dim:
                raise ValueError(f"hil.isotropy.regularizers: IStarRegularizer was built with dim={self.dim} but "
                                 f"the encoder's embeddings have D = {dim}")
            return
        self.dim = int(dim)
        if self.shrinkage_target == "running":
            for side in ("query", "doc"):
                self.register_buffer(f"{side}_shrinkage_cov", torch.zeros(dim, dim))
                self.register_buffer(f"{side}_shrinkage_updates", torch.zeros((), dtype=torch.long))

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "zeta": self.zeta, "shrinkage_target": self.shrinkage_target,
                "momentum": self.momentum, "dim": self.dim}

    def side_term(self, side: str, points: Tensor, weights: Tensor | None) -> Tensor:
        return istar_reg(points, self._shrinkage(side, points, weights), self.zeta, weights)

    def _shrinkage(self, side: str, points: Tensor, weights: Tensor | None) -> Tensor | None:
        """C for one side as it stood before this step; updates the running average in training."""
        d = points.shape[-1]
        if self.shrinkage_target == "identity":
            return torch.eye(d, device=points.device, dtype=torch.float32)
        if self.dim is None:
            raise ValueError("hil.isotropy.regularizers: IStarRegularizer with shrinkage_target='running' needs "
                             "dim (the embedding dimension D) for its (D, D) covariance buffers: give dim, or let "
                             "the training module bind it to the encoder")
        running: Tensor = getattr(self, f"{side}_shrinkage_cov")
        updates: Tensor = getattr(self, f"{side}_shrinkage_updates")
        if running.shape != (d, d):
            raise ValueError(f"hil.isotropy.regularizers: IStarRegularizer was built with dim={self.dim} but the "
                             f"{side} embeddings have D = {d}")
        # None: no history yet, batch covariance alone. (One host read a step: running shrinkage only.)
        current = running.clone() if int(updates) > 0 else None
        if self.training and points.shape[0] >= 2:
            with torch.no_grad():
                weights_32 = None if weights is None else weights.float()
                batch_cov = covariance(points.detach().float(), weights_32).to(running.dtype)  # (D, D)
                blended = batch_cov if current is None else \
                    running.mul(1.0 - self.momentum).add(batch_cov, alpha=self.momentum)
                if weights is None:
                    running.copy_(blended)
                    updates.add_(1)
                else:  # fewer than 2 valid tokens: no covariance, the average stays (decided on the device)
                    enough = weights.sum() >= 2
                    running.copy_(torch.where(enough, blended, running))
                    updates.add_(enough.to(updates.dtype))
        return current
