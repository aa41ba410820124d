"""Isotropy regularizers added to the late-interaction loss: InterIso (HIL Section 3.2), CosReg and I-STAR (A.1, A.3).

Each ``*_reg`` function returns the unweighted term L_reg; ``regularization_loss`` applies lambda exactly as the
paper writes it, and ``Regularizer`` is the ``nn.Module`` a LightningModule holds (it keeps the I-STAR shrinkage
covariances as buffers, so they are saved in checkpoints). All terms are computed on the projected, L2-normalized
token embeddings that late interaction scores, with padding excluded through the boolean masks.

Shapes: Bq queries, B (query, document) pairs, Lq / Ld tokens, N valid tokens, D embedding dimension.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from hil.isotropy.metrics import covariance, inter_iso, isoscore_star, masked_tokens, sum_offdiagonal_cosines

RegularizerKind = Literal["none", "interiso", "cosreg", "istar"]
ShrinkageTarget = Literal["identity", "running"]
KINDS: tuple[str, ...] = ("none", "interiso", "cosreg", "istar")
SHRINKAGE_TARGETS: tuple[str, ...] = ("identity", "running")


# --------------------------------------------------------------------------------------------------------------
# The regularization terms
# --------------------------------------------------------------------------------------------------------------

def interiso_reg(inter_iso_values: Tensor, lam: float) -> Tensor:
    """L_reg of HIL Section 3.2 averaged over a batch of (q, d) pairs; the caller multiplies by lambda.

        L_reg(q, d) = InterIso(q, d)        if lambda < 0   (lambda * L_reg rewards InterIso -> 1: anisotropy)
                      |InterIso(q, d)|      if lambda > 0   (lambda * L_reg pushes InterIso -> 0: isotropy)

    inter_iso_values (B,) -> scalar. The absolute value is taken per (q, d) pair, before the batch mean, so that
    pairs of opposite sign cannot cancel. lambda = 0 uses the absolute value (the term is multiplied by 0 anyway).
    """
    if inter_iso_values.dim() != 1:
        raise ValueError(f"hil.isotropy.regularizers: interiso_reg expects InterIso values (B,), "
                         f"got shape {tuple(inter_iso_values.shape)}")
    per_pair = inter_iso_values if lam < 0 else inter_iso_values.abs()
    return per_pair.mean()


def cosreg(x: Tensor) -> Tensor:
    """CosReg of Gao et al. (2019), HIL A.1 / A.3: ``1 / M^2 * sum_i sum_{j != i} x^_i^T x^_j`` over M points.

    x (M, D) -> scalar. Rows are L2-normalized (A.1's x^_i = x_i / ||x_i||; a no-op on the encoders' normalized
    embeddings). Note the 1 / M^2 (not 1 / (M (M - 1)) as Avg-Cos), as the paper and the I-STAR reference code.
    With fewer than 2 points there is no pair and the term is 0.
    """
    if x.dim() != 2:
        raise ValueError(f"hil.isotropy.regularizers: cosreg expects points (M, D), got shape {tuple(x.shape)}")
    m = x.shape[0]
    if m < 2:
        return x.sum() * 0.0  # keeps the graph and device
    return sum_offdiagonal_cosines(x) / m ** 2


def istar_reg(x: Tensor, shrinkage_cov: Tensor | None, zeta: float = 0.2) -> Tensor:
    """I-STAR term of Rudman & Eickhoff (2023), HIL A.1 / A.3: ``1 - IsoScore*(x, C)``.

    x (M, D), shrinkage_cov C (D, D) or None (batch covariance alone) -> scalar in [0, 1]; 0 when the shrunk
    covariance is isotropic. Minimizing it (lambda > 0) spreads variance over more directions, maximizing it
    (lambda < 0) concentrates it. With fewer than 2 points the covariance is undefined and the term is 0.
    """
    if x.dim() != 2:
        raise ValueError(f"hil.isotropy.regularizers: istar_reg expects points (M, D), got shape {tuple(x.shape)}")
    if x.shape[0] < 2:
        return x.sum() * 0.0
    return 1.0 - isoscore_star(x, shrinkage_cov, zeta)


def regularization_loss(kind: str, lam: float, queries: Tensor, docs: Tensor, query_mask: Tensor | None = None,
                        doc_mask: Tensor | None = None, pair_index: Tensor | None = None,
                        query_shrinkage: Tensor | None = None, doc_shrinkage: Tensor | None = None,
                        zeta: float = 0.2) -> tuple[Tensor, dict[str, Tensor]]:
    """The weighted regularization term added to L_late, and detached values to log.

    queries (Bq, Lq, D), docs (B, Ld, D), query_mask (Bq, Lq), doc_mask (B, Ld); pair_index (B,) long gives the
    query row of each document (None: Bq == B and row k pairs with row k). For triples <q, d+, d->, pass each
    query once and docs = cat([positives, negatives]) with pair_index = arange(Bq).repeat(2).

    - ``interiso`` (HIL 3.2): ``lambda * mean_pairs L_reg(q, d)``, InterIso over every (q, d) pair given -- with
      triples, the (q, d+) and (q, d-) pairs alike, as the paper writes L_reg(q, d) without restricting d.
    - ``cosreg`` / ``istar`` (HIL A.3): ``lambda / 2 * (L_reg(q) + L_reg(d))``, each on the flattened valid tokens
      of the batch, queries and documents separately. I-STAR shrinks toward ``query_shrinkage`` /
      ``doc_shrinkage`` (None: the batch covariance alone).
    - ``none``: zero.

    Logs: ``inter_iso`` (batch mean InterIso, always), ``reg`` (the unweighted L_reg; for cosreg / istar the mean
    of the two sides) and, for cosreg / istar, ``reg_query`` and ``reg_doc``.
    """
    if kind not in KINDS:
        raise ValueError(f"hil.isotropy.regularizers: unknown regularizer kind {kind!r}; expected one of {KINDS}")
    if pair_index is None:
        if queries.shape[0] != docs.shape[0]:
            raise ValueError(f"hil.isotropy.regularizers: {queries.shape[0]} queries and {docs.shape[0]} docs "
                             f"need pair_index (the query row of each doc)")
        paired_queries, paired_mask = queries, query_mask
    else:
        if pair_index.dim() != 1 or pair_index.shape[0] != docs.shape[0]:
            raise ValueError(f"hil.isotropy.regularizers: pair_index must be (B,) = ({docs.shape[0]},), "
                             f"got shape {tuple(pair_index.shape)}")
        paired_queries = queries[pair_index]                      # (B, Lq, D)
        paired_mask = None if query_mask is None else query_mask[pair_index]

    values = inter_iso(paired_queries, docs, paired_mask, doc_mask)  # (B,)
    logs: dict[str, Tensor] = {"inter_iso": values.detach().mean()}
    if kind == "none":
        return values.new_zeros(()), logs
    if kind == "interiso":
        reg = interiso_reg(values, lam)
        logs["reg"] = reg.detach()
        return lam * reg, logs

    query_points = masked_tokens(queries, query_mask)            # (Nq, D)
    doc_points = masked_tokens(docs, doc_mask)                   # (Nd, D)
    if kind == "cosreg":
        reg_query, reg_doc = cosreg(query_points), cosreg(doc_points)
    else:
        reg_query = istar_reg(query_points, query_shrinkage, zeta)
        reg_doc = istar_reg(doc_points, doc_shrinkage, zeta)
    logs.update(reg=(reg_query + reg_doc).detach() / 2, reg_query=reg_query.detach(), reg_doc=reg_doc.detach())
    return lam / 2 * (reg_query + reg_doc), logs


# --------------------------------------------------------------------------------------------------------------
# The module
# --------------------------------------------------------------------------------------------------------------

class Regularizer(nn.Module):
    """Isotropy regularizer held by a training module: ``loss = L_late + Regularizer(...)[0]``.

    kind: "none" | "interiso" | "cosreg" | "istar"; weight: lambda (its sign picks isotropy, > 0, or anisotropy,
    < 0; HIL A.3 best values: InterIso -0.1 / 0.4, CosReg -0.1 / 0.2, I-STAR -0.6 / 0.2).

    I-STAR settings: ``zeta`` is the shrinkage weight of IsoScore* (0.2, the I-STAR code's default).
    ``shrinkage_target`` picks C:
      - "identity" (default): C = I, as HIL A.3 writes ``1 - IsoScore(X, I)`` for its DR adaptation;
      - "running": C is a per-side (D, D) buffer (``query_shrinkage_cov`` / ``doc_shrinkage_cov``, needs ``dim``)
        tracking the detached batch covariances with an exponential moving average,
        ``C <- (1 - momentum) C + momentum Cov(batch)``, started from the first batch's covariance. I-STAR
        re-estimates C from a sample of the current model at the start of each epoch (HIL A.1's C_i); an EMA is
        a streaming stand-in that needs no extra pass over the data. Each step uses C from the previous steps
        (the first step: the batch covariance alone), then updates it, only in training mode. The buffers are
        updated in place and live in the state dict, so checkpoints carry them and resume continues the
        average; under DDP (broadcast_buffers) every rank uses rank 0's average.
    """

    def __init__(self, kind: RegularizerKind = "none", weight: float = 0.0, zeta: float = 0.2,
                 shrinkage_target: ShrinkageTarget = "identity", momentum: float = 0.1, dim: int | None = None):
        super().__init__()
        where = "hil.isotropy.regularizers: Regularizer"
        if kind not in KINDS:
            raise ValueError(f"{where} kind must be one of {KINDS}, got {kind!r}")
        if shrinkage_target not in SHRINKAGE_TARGETS:
            raise ValueError(f"{where} shrinkage_target must be one of {SHRINKAGE_TARGETS}, got {shrinkage_target!r}")
        if not 0.0 <= zeta <= 1.0:
            raise ValueError(f"{where} zeta must lie in [0, 1], got {zeta}")
        if not 0.0 < momentum <= 1.0:
            raise ValueError(f"{where} momentum must lie in (0, 1], got {momentum}")
        self.kind = kind
        self.weight = float(weight)
        self.zeta = float(zeta)
        self.shrinkage_target = shrinkage_target
        self.momentum = float(momentum)
        self.dim = dim
        self.tracks_covariance = kind == "istar" and shrinkage_target == "running"
        if self.tracks_covariance:
            if dim is None or dim < 1:
                raise ValueError(f"{where} with kind='istar' and shrinkage_target='running' needs dim (the "
                                 f"embedding dimension D) for its (D, D) covariance buffers, got dim={dim}")
            for side in ("query", "doc"):
                self.register_buffer(f"{side}_shrinkage_cov", torch.zeros(dim, dim))
                self.register_buffer(f"{side}_shrinkage_updates", torch.zeros((), dtype=torch.long))

    def extra_repr(self) -> str:
        return (f"kind={self.kind!r}, weight={self.weight}, zeta={self.zeta}, "
                f"shrinkage_target={self.shrinkage_target!r}, momentum={self.momentum}, dim={self.dim}")

    def _shrinkage(self, side: str, points: Tensor) -> Tensor | None:
        """C for one side ("query" or "doc") as it stood before this step; updates the running average in training."""
        d = points.shape[-1]
        if self.shrinkage_target == "identity":
            return torch.eye(d, device=points.device, dtype=torch.float32)
        running: Tensor = getattr(self, f"{side}_shrinkage_cov")
        updates: Tensor = getattr(self, f"{side}_shrinkage_updates")
        if running.shape != (d, d):
            raise ValueError(f"hil.isotropy.regularizers: Regularizer was built with dim={self.dim} but the "
                             f"{side} embeddings have D = {d}")
        current = running.clone() if int(updates) > 0 else None  # None: no history yet, batch covariance alone
        if self.training and points.shape[0] >= 2:
            with torch.no_grad():
                batch_cov = covariance(points.detach().float()).to(running.dtype)  # (D, D)
                if current is None:
                    running.copy_(batch_cov)
                else:
                    running.mul_(1.0 - self.momentum).add_(batch_cov, alpha=self.momentum)
                updates.add_(1)
        return current

    def forward(self, queries: Tensor, docs: Tensor, query_mask: Tensor | None = None,
                doc_mask: Tensor | None = None,
                pair_index: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """(weighted regularization term, logs); see ``regularization_loss`` for shapes, pairing and log keys."""
        query_shrinkage = doc_shrinkage = None
        if self.kind == "istar":
            query_shrinkage = self._shrinkage("query", masked_tokens(queries, query_mask))
            doc_shrinkage = self._shrinkage("doc", masked_tokens(docs, doc_mask))
        return regularization_loss(self.kind, self.weight, queries, docs, query_mask, doc_mask, pair_index,
                                   query_shrinkage, doc_shrinkage, self.zeta)
