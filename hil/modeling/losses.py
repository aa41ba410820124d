"""Training losses of late-interaction retrievers: terms of the objective that score through the encoder.

As in PyLate's losses and sentence-transformers' (one loss, one job, the scoring handed in), a loss scores through
the encoder it is given, so the same class serves every architecture whose scores it understands; a recipe
difference is a different loss object in the config. Each is a :class:`~hil.modeling.terms.Term` over one
:class:`~hil.modeling.batch.RankingBatch` (B queries x N documents, column 0 the positive, optional teacher scores
(B, N)), calling a pure function of ``hil.modeling.loss_functions``:

    PairwiseCE / NWayCE  CE of each query over its own N documents              ColBERT v1 (N = 2), ColBERTv2 (nway)
    InBatchCE      CE of query i over every document of the batch -- of every rank under DDP   (use_ib_negatives)
    KLDistillation KL(teacher || student) over each query's N documents       ColBERTv2, PyLate, Lightning IR
    MarginMSE      MSE of student vs teacher score margins                    Hofstaetter et al. 2020
    HILLoss        CE_L + CE_H + lambda (reg_L [reg_l] + reg_H [reg_h])       ColBERT-HIL (HIL Sec. 3.3)
    HILAuthorsLoss CE((S_L + S_H) / 2) + lambda (mean H dots - |mean L dots|) the authors' released code
The module adds the isotropy regularizer and any further terms (``hil.modeling.terms``).

ColBERT-HIL: a score-based loss reads each head's z-scored score (batch moments over all N B pairs, HIL Sec. 3.3)
and combines them by its ``heads`` setting: "each" (the paper's per-head objective, CE_L + CE_H, Sec. 3.3), "sum"
(the score ranked at inference, S_L + S_H, the default of every loss here but HILLoss) or "mean" (the authors'
code, one loss on (S_L + S_H) / 2). Distillation on "each" asks each head to reproduce the teacher's distribution on
its own; on "sum" only the score that is searched must. Both follow from Sec. 3.3 (per-head training, summed
inference), hence the setting; ``configs/variants/colbert_hil_distill.yaml`` picks "each", as HILLoss does for CE.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from hil.errors import UserError
from hil.modeling.batch import RankingBatch, TripleBatch
from hil.modeling.contracts import Encoder
from hil.modeling.distributed import gather_encoded
from hil.modeling.loss_functions import (
    MarginPairs,
    in_batch_ce_loss,
    kl_distillation_loss,
    margin_mse_loss,
    minmax_normalize,
    nway_ce_loss,
    own_negative_columns,
    pair_diagnostics,
    pairwise_ce_loss,
    ranking_diagnostics,
    teacher_agreement,
)
from hil.modeling.terms import (
    HEAD_COMBINATIONS,
    HeadCombination,
    HILAuthorsRegularizer,
    HILIsotropy,
    LossOutput,
    Term,
    TrainingLoss,
    combine_heads,
    require_hil_encoder,
    running_moment_logs,
)

__all__ = ["PairwiseCE", "NWayCE", "InBatchCE", "KLDistillation", "MarginMSE", "HILLoss", "HILAuthorsLoss",
           "LossOutput", "Term", "TrainingLoss", "RankingBatch", "TripleBatch", "pairwise_ce_loss", "nway_ce_loss",
           "in_batch_ce_loss", "pair_diagnostics", "require_hil_encoder", "running_moment_logs"]

OwnNegatives = Literal["candidates", "excluded"]
Normalization = Literal["none", "minmax"]


def _check_heads(heads: str) -> str:
    if heads not in HEAD_COMBINATIONS:
        raise ValueError(f"heads must be one of {HEAD_COMBINATIONS}, got {heads!r}")
    return heads


def _detached(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.detach() for name, value in parts.items()}


class NWayCE(Term):
    """Softmax cross-entropy of each query over its own N documents, the positive first (column 0):
    :func:`~hil.modeling.loss_functions.nway_ce_loss` of the (B, N) scores. N = 2 is ColBERT v1's loss; any N is
    ColBERTv2's without teacher scores. ``heads``: see the module docstring.

    Logs ``loss_late`` (and ``loss_late_<head>`` with heads "each"), ``pair_accuracy`` and ``score_margin`` (the
    positive against each negative).
    """

    def __init__(self, weight: float = 1.0, heads: HeadCombination = "sum"):
        super().__init__(weight)
        self.heads = _check_heads(heads)

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "heads": self.heads}

    def forward(self, encoder: Encoder, batch: RankingBatch) -> LossOutput:
        value, per_head, total = combine_heads(batch.head_scores(encoder), self.heads, nway_ce_loss)
        parts = {"loss_late": value, **{f"loss_late_{head}": v for head, v in per_head.items()},
                 **ranking_diagnostics(total)}
        return LossOutput(value, _detached(parts))


class PairwiseCE(NWayCE):
    """ColBERT v1's loss: for each triple, softmax cross-entropy over (score(q, d+), score(q, d-)). On batches of
    N > 2 documents it is :class:`NWayCE` (one softmax over the positive and all N - 1 negatives)."""


class InBatchCE(Term):
    """In-batch negatives: query i against every document of the batch -- of *every rank* under DDP.

    The documents of all ranks are gathered (padded, never truncated; ``hil.modeling.distributed.gather_padded``)
    and this rank's positive of query i sits at column ``offset + i`` (column 0 of the batch's layout). Each rank's
    loss is the mean over its own queries; DDP averages the gradients, so with equal per-rank batches a step equals
    one on the concatenated global batch.

    Args:
        own_negatives: "candidates" (default; the single softmax over every document, this package's in-batch loss
            since ColBERT v1 triples) or "excluded": a query's own hard negatives (columns 1 .. N - 1) are left out,
            as ColBERTv2's ``compute_ib_loss`` (``colbert/modeling/colbert.py``, ``all_except_self_negatives``),
            whose n-way loss ranks them already. ColBERTv2's ``use_ib_negatives`` is then an n-way loss (NWayCE or
            KLDistillation) plus this term with weight 1 (``loss += ib_loss`` in ``training.py``).
        across_ranks: gather the other ranks' documents (True) or use this rank's only (False, ColBERTv2's).
        heads: see the module docstring (ColBERT-HIL's in-batch scores use the running z-score estimates).

    Logs ``loss_late``, ``pair_accuracy``, ``score_margin`` (each query's own documents, read off the score
    matrix) and ``in_batch_candidates`` (documents each query is scored against).
    """

    def __init__(self, weight: float = 1.0, own_negatives: OwnNegatives = "candidates", across_ranks: bool = True,
                 heads: HeadCombination = "sum"):
        super().__init__(weight)
        if own_negatives not in ("candidates", "excluded"):
            raise ValueError(f"own_negatives must be 'candidates' or 'excluded', got {own_negatives!r}")
        self.own_negatives = own_negatives
        self.across_ranks = bool(across_ranks)
        self.heads = _check_heads(heads)

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "own_negatives": self.own_negatives, "across_ranks": self.across_ranks,
                "heads": self.heads}

    def forward(self, encoder: Encoder, batch: RankingBatch) -> LossOutput:
        everyone, offset = gather_encoded(batch.docs) if self.across_ranks else (batch.docs, 0)
        if self.heads == "sum":  # the encoder's own score (the sum of its heads), as InBatchCE always called it
            matrices = {"score": encoder.score(batch.queries, everyone)}         # (B, C)
        else:
            matrices = encoder.score_heads(batch.queries, everyone, all_pairs=True)  # head -> (B, C)
        b, n, columns = batch.size, batch.n_documents, len(everyone)
        device = batch.docs.mask.device
        excluded = None
        if self.own_negatives == "excluded":
            excluded = own_negative_columns(b, n, offset, columns, device)

        def loss(matrix: torch.Tensor) -> torch.Tensor:
            return in_batch_ce_loss(matrix, offset, excluded)

        value, per_head, total = combine_heads(matrices, self.heads, loss)
        rows = torch.arange(b, device=device)
        own = total[rows[:, None], offset + torch.arange(n, device=device)[None, :] * b + rows[:, None]]  # (B, N)
        candidates = columns - (n - 1 if excluded is not None else 0)
        parts = {"loss_late": value, **{f"loss_late_{head}": v for head, v in per_head.items()},
                 **ranking_diagnostics(own),  # filled on the device: a host tensor would be copied there to be logged
                 "in_batch_candidates": torch.full((), float(candidates), device=device)}
        return LossOutput(value, _detached(parts))


def _teacher(term: Term, batch: RankingBatch) -> torch.Tensor:
    if batch.teacher_scores is None:
        raise UserError(f"{type(term).__name__} needs teacher scores, and this batch has none: train from "
                        f"examples with scores (data.source: NWayExamples, TrecRun, PyLateExamples or TeacherOutput)")
    return batch.teacher_scores


class KLDistillation(Term):
    """KL(teacher || student) over each query's N documents (:func:`~hil.modeling.loss_functions.
    kl_distillation_loss`): the teacher's scores are logits, both sides log-softmaxed (ColBERTv2, PyLate).

    Args:
        student_temperature, teacher_temperature: each side's scores are divided by its own (ColBERTv2: teacher
            multiplied by ``distillation_alpha`` = 1 / teacher_temperature, student 1; Hinton et al. 2015: both T).
        normalize: "none" (ColBERTv2, Lightning IR) or "minmax": the student's scores of each query scaled to
            [0, 1] first (PyLate's ``Distillation``, ``normalize_scores=True``, its default).
        heads: see the module docstring.

    Logs ``loss_kl`` (``loss_kl_<head>`` with heads "each") and ``teacher_agreement`` (share of document pairs the
    student orders as the teacher).
    """

    needs_teacher_scores = True

    def __init__(self, weight: float = 1.0, student_temperature: float = 1.0, teacher_temperature: float = 1.0,
                 normalize: Normalization = "none", heads: HeadCombination = "sum"):
        super().__init__(weight)
        if student_temperature <= 0 or teacher_temperature <= 0:
            raise ValueError(f"KLDistillation temperatures must be > 0 (got {student_temperature}, "
                             f"{teacher_temperature})")
        if normalize not in ("none", "minmax"):
            raise ValueError(f"KLDistillation normalize must be 'none' or 'minmax', got {normalize!r}")
        self.student_temperature = float(student_temperature)
        self.teacher_temperature = float(teacher_temperature)
        self.normalize = normalize
        self.heads = _check_heads(heads)

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "student_temperature": self.student_temperature,
                "teacher_temperature": self.teacher_temperature, "normalize": self.normalize, "heads": self.heads}

    def forward(self, encoder: Encoder, batch: RankingBatch) -> LossOutput:
        teacher = _teacher(self, batch)

        def loss(scores: torch.Tensor) -> torch.Tensor:
            student = minmax_normalize(scores) if self.normalize == "minmax" else scores
            return kl_distillation_loss(student, teacher, self.student_temperature, self.teacher_temperature)

        value, per_head, total = combine_heads(batch.head_scores(encoder), self.heads, loss)
        parts = {"loss_kl": value, **{f"loss_kl_{head}": v for head, v in per_head.items()},
                 "teacher_agreement": teacher_agreement(total, teacher)}
        return LossOutput(value, _detached(parts))


class MarginMSE(Term):
    """MarginMSE (Hofstaetter et al. 2020): the student's score margins regressed on the teacher's
    (:func:`~hil.modeling.loss_functions.margin_mse_loss`). ``pairs``: "first" (the first document against each
    other one: the paper's (q, d+, d-) triples, N - 1 pairs a query) or "all" (every pair, N (N - 1) / 2 a query;
    Lightning IR's choice, which drops teacher ties). The same pair for N = 2. Logs ``loss_margin_mse`` and
    ``teacher_agreement``."""

    needs_teacher_scores = True

    def __init__(self, weight: float = 1.0, pairs: MarginPairs = "first", heads: HeadCombination = "sum"):
        super().__init__(weight)
        if pairs not in ("first", "all"):
            raise ValueError(f"MarginMSE pairs must be 'first' or 'all', got {pairs!r}")
        self.pairs = pairs
        self.heads = _check_heads(heads)

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "pairs": self.pairs, "heads": self.heads}

    def forward(self, encoder: Encoder, batch: RankingBatch) -> LossOutput:
        teacher = _teacher(self, batch)
        value, per_head, total = combine_heads(batch.head_scores(encoder), self.heads,
                                               lambda scores: margin_mse_loss(scores, teacher, self.pairs))
        parts = {"loss_margin_mse": value, **{f"loss_margin_mse_{head}": v for head, v in per_head.items()},
                 "teacher_agreement": teacher_agreement(total, teacher)}
        return LossOutput(value, _detached(parts))


# -- ColBERT-HIL's losses as the paper's and the authors' configs name them ----------------------------------------


class HILLoss(Term):
    """ColBERT-HIL's loss (HIL Sec. 3.3): ``CE_L + CE_H + lambda * (reg_L * [reg_l] + reg_H * [reg_h])``, i.e.
    ``NWayCE(heads="each")`` plus ``lambda`` times :class:`~hil.modeling.terms.HILIsotropy` (``reg_weight`` is
    lambda; -0.3 is the paper's best, A.3). Each head's ``score_late`` is z-scored with the batch moments of its
    token scores (``HILEncoder.training_pair_scores``); ``reg_L = -|InterIso_L|``, ``reg_H = InterIso_H``, over every
    (q, d) pair of the batch. To combine HIL's regularizer with another loss (distillation), list the two terms
    instead: ``model.loss`` the loss with ``heads``, ``model.terms`` a ``HILIsotropy`` of weight lambda.
    """

    def __init__(self, reg_weight: float = -0.3, reg_l: bool = True, reg_h: bool = True, weight: float = 1.0):
        super().__init__(weight)
        self.reg_weight = float(reg_weight)
        self.reg_l = bool(reg_l)
        self.reg_h = bool(reg_h)
        self.ranking = NWayCE(heads="each")
        self.isotropy = HILIsotropy(self.reg_weight, self.reg_l, self.reg_h)

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "reg_weight": self.reg_weight, "reg_l": self.reg_l, "reg_h": self.reg_h}

    def check(self, encoder: Encoder) -> None:
        require_hil_encoder(self, encoder)

    def forward(self, encoder: Encoder, batch: RankingBatch) -> LossOutput:
        require_hil_encoder(self, encoder)
        ranking = self.ranking(encoder, batch)    # CE_L + CE_H
        isotropy = self.isotropy(encoder, batch)  # reg_L [reg_l] + reg_H [reg_h]
        loss = ranking.loss + self.reg_weight * isotropy.loss
        parts = {"loss_late_L": ranking.parts["loss_late_L"], "loss_late_H": ranking.parts["loss_late_H"],
                 **isotropy.parts, "pair_accuracy": ranking.parts["pair_accuracy"],
                 "score_margin": ranking.parts["score_margin"], **running_moment_logs(encoder)}
        return LossOutput(loss, {k: v.detach().float() for k, v in parts.items()})


class HILAuthorsLoss(Term):
    """ColBERT-HIL's loss as the authors' released code computes it (their ``ColBERT.score`` with ``qidf`` and the
    ``sensim`` regularizer): ONE CE on ``(score_late_L + score_late_H) / 2`` (``NWayCE(heads="mean")``) plus
    ``lambda`` times :class:`~hil.modeling.terms.HILAuthorsRegularizer` (``mean(H dots) - |mean(L dots)|``). The
    paper writes ``CE_L + CE_H + lambda (reg_L + reg_H)`` with InterIso instead (:class:`HILLoss`, the default).
    lambda = -0.3 as their ``train.sh``.
    """

    def __init__(self, reg_weight: float = -0.3, weight: float = 1.0):
        super().__init__(weight)
        self.reg_weight = float(reg_weight)
        self.ranking = NWayCE(heads="mean")
        self.sensim = HILAuthorsRegularizer(self.reg_weight)

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "reg_weight": self.reg_weight}

    def check(self, encoder: Encoder) -> None:
        require_hil_encoder(self, encoder)

    def forward(self, encoder: Encoder, batch: RankingBatch) -> LossOutput:
        require_hil_encoder(self, encoder)
        ranking = self.ranking(encoder, batch)  # CE((S_L + S_H) / 2)
        sensim = self.sensim(encoder, batch)
        loss = ranking.loss + self.reg_weight * sensim.loss
        parts = {"loss_late": ranking.parts["loss_late"], "loss_reg": sensim.loss, **sensim.parts,
                 "pair_accuracy": ranking.parts["pair_accuracy"], "score_margin": ranking.parts["score_margin"],
                 **running_moment_logs(encoder)}
        return LossOutput(loss, {k: v.detach().float() for k, v in parts.items()})
