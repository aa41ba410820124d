"""Training losses of late-interaction retrievers: pure cores, and small modules that take the encoder and a batch.

As in PyLate's losses and sentence-transformers' (one loss, one job, the scoring handed in), a loss scores through
the encoder it is given (``score_pairs``, ``score`` or HIL's ``training_pair_scores``), so the same loss class
serves every architecture whose scores it understands; a recipe difference is a different loss object in the config.

One training step, end to end (the module is ``hil.modeling.module.RetrieverModule``):
    TripleBatch: queries (B, Lq) encoded once, docs (2B, Ld) = [positives; negatives]
    PairwiseCE   L = CE(score(q, d+), score(q, d-))                        ColBERT v1 (Khattab & Zaharia 2020)
    InBatchCE    L = CE of query i over every document of the batch -- of every rank under DDP
    HILLoss      L = CE_L + CE_H + lambda (reg_L [reg_l] + reg_H [reg_h])  ColBERT-HIL (HIL Sec. 3.3)
    HILAuthorsLoss  L = CE((S_L + S_H) / 2) + lambda (mean H dots - |mean L dots|)  the authors' released code
and the module adds the isotropy regularizer, if any (``hil.isotropy.regularizers``).
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hil.isotropy.metrics import inter_iso
from hil.isotropy.regularizers import authors_hil_reg, interiso_reg, mean_token_dot
from hil.modeling.contracts import EncodedBatch
from hil.modeling.distributed import gather_encoded
from hil.modeling.encoder import MultiVectorEncoder
from hil.modeling.hil import HEADS, HILEncoder

# -- pure cores --------------------------------------------------------------------------------------------------


def pairwise_ce_loss(positive_scores: Tensor, negative_scores: Tensor) -> Tensor:
    """L_late = CE(score(q, d+), score(q, d-)): softmax cross-entropy over each (positive, negative) pair.

    positive_scores (B,), negative_scores (B,) -> scalar (mean over pairs).
    """
    logits = torch.stack([positive_scores, negative_scores], dim=1)  # (B, 2)
    return F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long, device=logits.device))


def in_batch_ce_loss(score_matrix: Tensor, offset: int = 0) -> Tensor:
    """Cross-entropy where query i's positive is column ``offset + i`` and every other column is a negative.

    score_matrix (B, N) with N >= offset + B: columns ``offset .. offset + B - 1`` are the positives of the B
    queries in order (``offset`` is where this rank's documents start among every rank's, 0 on one process).
    """
    targets = offset + torch.arange(score_matrix.shape[0], device=score_matrix.device)  # (B,)
    return F.cross_entropy(score_matrix, targets)


def pair_diagnostics(positive_scores: Tensor, negative_scores: Tensor) -> dict[str, Tensor]:
    """What training logs about the ranking of each pair: share of pairs with d+ above d-, mean score margin."""
    positive, negative = positive_scores.detach(), negative_scores.detach()
    return {"pair_accuracy": (positive > negative).float().mean(), "score_margin": (positive - negative).mean()}


def running_moment_logs(encoder: HILEncoder) -> dict[str, Tensor]:
    """ColBERT-HIL's running z-score estimates, logged by both HIL losses (``zscore_mean_<head>``, ``zscore_std_<head>``)."""
    logs = {}
    for head in HEADS:
        logs[f"zscore_mean_{head}"], logs[f"zscore_std_{head}"] = encoder.running_moments(head)
    return logs


# -- the batch a loss sees ------------------------------------------------------------------------------------------


@dataclass
class TripleBatch:
    """An encoded batch of B triples <q, d+, d->: each query once, its documents as [positives; negatives].

    ``pair_index`` (2B,) gives the query row of each document. ``inter_iso(head)`` is InterIso (HIL Eq. 2) of
    the 2B (q, d) pairs, computed once per step and shared by the loss, the regularizer and the logs.
    """

    queries: EncodedBatch  # heads (B, Lq, D)
    docs: EncodedBatch     # heads (2B, Ld, D)
    _inter_iso: dict[str, Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if len(self.docs) != 2 * len(self.queries):
            raise ValueError(f"TripleBatch: {len(self.queries)} queries need 2 x {len(self.queries)} documents "
                             f"(positives then negatives), got {len(self.docs)}")

    @property
    def size(self) -> int:
        return len(self.queries)

    @property
    def positives(self) -> EncodedBatch:
        return self.docs.select(slice(0, self.size))

    @property
    def negatives(self) -> EncodedBatch:
        return self.docs.select(slice(self.size, 2 * self.size))

    @cached_property
    def pair_index(self) -> Tensor:
        return torch.arange(self.size, device=self.docs.mask.device).repeat(2)  # (2B,)

    @cached_property
    def paired_queries(self) -> EncodedBatch:
        return self.queries.select(self.pair_index)  # heads (2B, Lq, D)

    def inter_iso(self, head: str) -> Tensor:
        """InterIso of every (q, d) pair for one head, over the tokens that are scored. -> (2B,), differentiable."""
        if head not in self._inter_iso:
            self._inter_iso[head] = inter_iso(self.paired_queries.heads[head], self.docs.heads[head],
                                              self.paired_queries.mask, self.docs.mask)
        return self._inter_iso[head]


@dataclass
class LossOutput:
    loss: Tensor              # scalar to minimize
    parts: dict[str, Tensor]  # detached values to log (train/<name>)


# -- the loss modules -----------------------------------------------------------------------------------------------


class TrainingLoss(nn.Module, metaclass=ABCMeta):
    """A training objective over a :class:`TripleBatch`, scored by the encoder it is given."""

    @abstractmethod
    def forward(self, encoder: MultiVectorEncoder, batch: TripleBatch) -> LossOutput:
        """The loss of one batch and its parts to log."""

    def settings(self) -> dict[str, Any]:
        """What is recorded in checkpoints and exports."""
        return {"class": f"{type(self).__module__}.{type(self).__qualname__}"}


class PairwiseCE(TrainingLoss):
    """ColBERT v1's loss: for each triple, softmax cross-entropy over (score(q, d+), score(q, d-)).

    Logs ``loss_late``, ``pair_accuracy`` and ``score_margin``.
    """

    def forward(self, encoder: MultiVectorEncoder, batch: TripleBatch) -> LossOutput:
        positive = encoder.score_pairs(batch.queries, batch.positives)  # (B,)
        negative = encoder.score_pairs(batch.queries, batch.negatives)  # (B,)
        loss = pairwise_ce_loss(positive, negative)
        return LossOutput(loss, {"loss_late": loss.detach(), **pair_diagnostics(positive, negative)})


class InBatchCE(TrainingLoss):
    """In-batch negatives: query i against every document of the batch -- of *every rank* under DDP.

    The documents of all ranks are gathered (padded, never truncated; ``hil.modeling.distributed.gather_padded``)
    and this rank's positive of query i sits at row ``offset + i`` of the gathered batch. Each rank's loss is the
    mean over its own queries; DDP averages the gradients, so with equal per-rank batches a step equals one on the
    concatenated global batch. Logs ``loss_late``, ``pair_accuracy``, ``score_margin`` (of each query's own pair,
    read off the score matrix) and ``in_batch_candidates`` (documents each query is scored against).
    """

    def forward(self, encoder: MultiVectorEncoder, batch: TripleBatch) -> LossOutput:
        everyone, offset = gather_encoded(batch.docs)
        scores = encoder.score(batch.queries, everyone)  # (B, N), N = 2B summed over ranks
        loss = in_batch_ce_loss(scores, offset)
        rows = torch.arange(batch.size, device=scores.device)
        positive = scores[rows, offset + rows]                 # (B,) this rank's positives
        negative = scores[rows, offset + batch.size + rows]    # (B,) and hard negatives
        return LossOutput(loss, {"loss_late": loss.detach(), **pair_diagnostics(positive, negative),
                                 "in_batch_candidates": torch.tensor(float(len(everyone)))})


def require_hil_encoder(loss: torch.nn.Module, encoder: MultiVectorEncoder) -> None:
    """The HIL losses score the heads L and H of a HILEncoder: anything else is a configuration error."""
    if not isinstance(encoder, HILEncoder):
        raise TypeError(f"{type(loss).__name__} scores the heads L and H of a HILEncoder; got a "
                        f"{type(encoder).__name__} (set model.encoder.class_path: hil.modeling.hil.HILEncoder)")


class HILLoss(TrainingLoss):
    """ColBERT-HIL's loss (HIL Sec. 3.3): ``CE_L + CE_H + lambda * (reg_L * [reg_l] + reg_H * [reg_h])``.

    Each head's ``score_late`` is z-scored with the batch moments of its token scores (``HILEncoder.
    training_pair_scores``) and trained with the pairwise CE; ``reg_L = -|InterIso_L|`` and ``reg_H =
    InterIso_H`` (averaged over the (q, d+) and (q, d-) pairs, the absolute value per pair), so a negative lambda
    pushes InterIso_L toward 0 and InterIso_H toward 1 (a larger Delta InterIso). InterIso_L counts only the
    query tokens of the lexical head (non-zero IDF). ``reg_l`` / ``reg_h`` False drop a term (the ablations of
    Table 5). lambda = -0.3 is the paper's best (A.3).
    """

    def __init__(self, reg_weight: float = -0.3, reg_l: bool = True, reg_h: bool = True):
        super().__init__()
        self.reg_weight = float(reg_weight)
        self.reg_l = bool(reg_l)
        self.reg_h = bool(reg_h)

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "reg_weight": self.reg_weight, "reg_l": self.reg_l, "reg_h": self.reg_h}

    def forward(self, encoder: MultiVectorEncoder, batch: TripleBatch) -> LossOutput:
        require_hil_encoder(self, encoder)
        n = batch.size
        late, query_masks = encoder.training_pair_scores(batch.queries, batch.docs, batch.pair_index)  # head -> (2B,)
        loss_late = {head: pairwise_ce_loss(late[head][:n], late[head][n:]) for head in HEADS}
        paired = batch.paired_queries
        iso = {"L": inter_iso(paired.heads["L"], batch.docs.heads["L"], query_masks["L"], batch.docs.mask),
               "H": batch.inter_iso("H")}  # (2B,) each; H takes part with every scored query token, as ColBERT
        reg_L = -interiso_reg(iso["L"], absolute=True)   # -|InterIso_L|, |.| per pair
        reg_H = interiso_reg(iso["H"], absolute=False)   # InterIso_H
        reg = reg_L * float(self.reg_l) + reg_H * float(self.reg_h)
        loss = loss_late["L"] + loss_late["H"] + self.reg_weight * reg

        total = late["L"] + late["H"]
        parts = {"loss_late_L": loss_late["L"], "loss_late_H": loss_late["H"], "loss_reg_L": reg_L,
                 "loss_reg_H": reg_H, "inter_iso_L": iso["L"].mean(), "inter_iso_H": iso["H"].mean(),
                 "delta_inter_iso": iso["H"].mean() - iso["L"].mean(), **pair_diagnostics(total[:n], total[n:])}
        parts.update(running_moment_logs(encoder))
        return LossOutput(loss, {k: v.detach().float() for k, v in parts.items()})


class HILAuthorsLoss(TrainingLoss):
    """ColBERT-HIL's loss as the authors' released code computes it (their ``ColBERT.score`` with ``qidf`` and
    the ``sensim`` regularizer): ONE pairwise CE on ``(score_late_L + score_late_H) / 2`` plus ``lambda *
    (mean(H dots) - |mean(L dots)|)``, the means over every query-token / document-token similarity of the
    batch's (q, d+) and (q, d-) pairs (:func:`hil.isotropy.regularizers.authors_hil_reg`). The paper writes
    ``CE_L + CE_H + lambda (reg_L + reg_H)`` with InterIso instead (:class:`HILLoss`, the default).
    lambda = -0.3 as their ``train.sh``. Logs the same InterIso diagnostics as ``HILLoss``.
    """

    def __init__(self, reg_weight: float = -0.3):
        super().__init__()
        self.reg_weight = float(reg_weight)

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "reg_weight": self.reg_weight}

    def forward(self, encoder: MultiVectorEncoder, batch: TripleBatch) -> LossOutput:
        require_hil_encoder(self, encoder)
        n = batch.size
        late, _ = encoder.training_pair_scores(batch.queries, batch.docs, batch.pair_index)  # head -> (2B,)
        total = (late["L"] + late["H"]) / 2
        loss_late = pairwise_ce_loss(total[:n], total[n:])
        paired = batch.paired_queries
        dots = {head: mean_token_dot(paired.heads[head], batch.docs.heads[head]) for head in HEADS}
        reg = authors_hil_reg(dots["L"], dots["H"])
        loss = loss_late + self.reg_weight * reg
        parts = {"loss_late": loss_late, "loss_reg": reg, "mean_dot_L": dots["L"], "mean_dot_H": dots["H"],
                 "inter_iso_H": batch.inter_iso("H").mean(), **pair_diagnostics(total[:n], total[n:])}
        parts.update(running_moment_logs(encoder))
        return LossOutput(loss, {k: v.detach().float() for k, v in parts.items()})
