"""The training objective as a weighted list of terms (as Lightning IR's ``loss_functions``, ``lightning_ir/base/
module.py``): ``L = sum_k weight_k * term_k(encoder, batch)``.

A term takes the encoder and one :class:`~hil.modeling.batch.RankingBatch` (B queries x N documents, optional
teacher scores) and returns its unweighted value and what to log (:class:`LossOutput`); ``RetrieverModule`` sums
``weight * value`` (:func:`weighted_objective`). Terms of this package:

    ranking / distillation   PairwiseCE, NWayCE, InBatchCE, KLDistillation, MarginMSE   (``hil.modeling.losses``)
    isotropy regularizers    InterIso, CosReg, I-STAR, conditional isotropy             (``hil.isotropy.regularizers``,
                             weight = the paper's lambda, wrapped by :class:`RegularizerTerm`)
    ColBERT-HIL's own        HILIsotropy (-|InterIso_L| + InterIso_H), HILAuthorsRegularizer ("sensim")  (this file)
    composites kept for the paper's configs   HILLoss, HILAuthorsLoss                  (``hil.modeling.losses``)

So any regularizer composes with any ranking or distillation loss. A score-based term on ColBERT-HIL reads each
head's z-scored score (``RankingBatch.head_scores``) and combines the heads as its ``heads`` setting says
(:func:`combine_heads`).
"""

from __future__ import annotations

import re
from abc import ABCMeta, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal, Sequence

from torch import Tensor, nn

from hil.isotropy.metrics import inter_iso
from hil.isotropy.regularizers import Regularizer, authors_hil_reg, interiso_reg, mean_token_dot
from hil.modeling.batch import RankingBatch
from hil.modeling.contracts import Encoder
from hil.modeling.hil import HEADS, HILEncoder

# How a score-based term treats an encoder's heads (one-head encoders: all three are the same):
#   "sum"   the loss of sum_h S_h, the score ranked at inference (ColBERT-HIL: score_late_L + score_late_H, Sec. 3.3)
#   "each"  sum_h loss(S_h), each head trained to rank alone (ColBERT-HIL's CE_L + CE_H, HIL Sec. 3.3)
#   "mean"  the loss of mean_h S_h (the HIL authors' code: one CE on (S_L + S_H) / 2)
HeadCombination = Literal["sum", "each", "mean"]
HEAD_COMBINATIONS: tuple[str, ...] = ("sum", "each", "mean")


@dataclass
class LossOutput:
    loss: Tensor              # scalar: the term's unweighted value
    parts: dict[str, Tensor]  # detached values to log (train/<name>)


def snake_case(name: str) -> str:
    """``InBatchCE`` -> ``in_batch_ce``, ``KLDistillation`` -> ``kl_distillation``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


class Term(nn.Module, metaclass=ABCMeta):
    """One weighted term of the training objective, scored by the encoder it is given.

    ``weight`` multiplies the term's value in the objective (1 for a loss; an isotropy regularizer's weight is the
    paper's lambda). ``needs_teacher_scores``: the batch must carry teacher scores (checked before training).
    """

    needs_teacher_scores: ClassVar[bool] = False

    def __init__(self, weight: float = 1.0):
        super().__init__()
        self.weight = float(weight)

    @abstractmethod
    def forward(self, encoder: Encoder, batch: RankingBatch) -> LossOutput:
        """The term's unweighted value over one batch and its parts to log."""

    def check(self, encoder: Encoder) -> None:
        """Raise ``ValueError`` / ``TypeError`` if this term cannot train ``encoder`` (called at construction)."""

    def settings(self) -> dict[str, Any]:
        """What is recorded in checkpoints and exports."""
        return {"class": f"{type(self).__module__}.{type(self).__qualname__}", "weight": self.weight}


TrainingLoss = Term  # the name before the objective became a list of terms


def combine_heads(scores: dict[str, Tensor], heads: HeadCombination,
                  loss: Callable[[Tensor], Tensor]) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """Apply ``loss`` to an encoder's per-head scores as ``heads`` says (see :data:`HeadCombination`).

    scores: head -> (B, ...) -> (value, per-head losses to log ("each" with several heads; else empty), the
    combined score the diagnostics read: the sum over heads for "sum" / "each", the mean for "mean").
    """
    if heads not in HEAD_COMBINATIONS:
        raise ValueError(f"heads must be one of {HEAD_COMBINATIONS}, got {heads!r}")
    values = list(scores.values())
    total = values[0]
    for value in values[1:]:
        total = total + value
    if heads == "mean" and len(values) > 1:
        total = total / len(values)
    if heads != "each" or len(values) == 1:
        return loss(total), {}, total
    per_head = {name: loss(value) for name, value in scores.items()}
    parts = list(per_head.values())
    value = parts[0]
    for part in parts[1:]:
        value = value + part
    return value, per_head, total


def require_hil_encoder(term: nn.Module, encoder: Encoder) -> None:
    """The HIL terms read the heads L and H of a HILEncoder: anything else is a configuration error."""
    if not isinstance(encoder, HILEncoder):
        raise TypeError(f"{type(term).__name__} scores the heads L and H of a HILEncoder; got a "
                        f"{type(encoder).__name__} (set model.encoder.class_path: hil.modeling.hil.HILEncoder)")


def running_moment_logs(encoder: HILEncoder) -> dict[str, Tensor]:
    """ColBERT-HIL's running z-score estimates (``zscore_mean_<head>``, ``zscore_std_<head>``)."""
    logs = {}
    for head in HEADS:
        logs[f"zscore_mean_{head}"], logs[f"zscore_std_{head}"] = encoder.running_moments(head)
    return logs


# -- isotropy regularizers as terms ---------------------------------------------------------------------------------


class RegularizerTerm(Term):
    """An isotropy regularizer (``hil.isotropy.regularizers``) as a term: its unweighted L_reg over one head's token
    embeddings, weighted by its lambda. Which pairs it sees in an n-way batch: InterIso every one of the N B
    (query, document) pairs, as the paper's L_reg(q, d) for (q, d+) and (q, d-) alike; CosReg and I-STAR the
    queries' token cloud (each query once) and the N B documents' token cloud; the authors' conditional isotropy
    the (q, d+) pairs (column 0) only. Needs a one-head encoder, or ``head`` naming one."""

    def __init__(self, regularizer: Regularizer, head: str | None = None):
        super().__init__(regularizer.weight)
        self.regularizer = regularizer
        self.head = head

    def check(self, encoder: Encoder) -> None:
        if self.head is None and len(encoder.head_names) != 1:
            raise ValueError(f"an isotropy regularizer applies to a one-head encoder; {encoder.architecture} has "
                             f"heads {list(encoder.head_names)} (ColBERT-HIL regularizes through its own terms)")
        if self.head is not None and self.head not in encoder.head_names:
            raise ValueError(f"regularizer head {self.head!r} is not one of {list(encoder.head_names)}")
        self.regularizer.bind(encoder.dim)

    def settings(self) -> dict[str, Any]:
        return self.regularizer.settings()

    def forward(self, encoder: Encoder, batch: RankingBatch) -> LossOutput:
        self.weight = self.regularizer.weight
        (head,) = encoder.head_names if self.head is None else (self.head,)
        queries, docs = batch.queries, batch.docs
        value, logs = self.regularizer.term(queries.heads[head], docs.heads[head], queries.mask, docs.mask,
                                            batch.pair_index, inter_iso_values=batch.inter_iso(head))
        return LossOutput(value, logs)


def as_term(item: Term | Regularizer) -> Term:
    return RegularizerTerm(item) if isinstance(item, Regularizer) else item


# -- ColBERT-HIL's regularizers -------------------------------------------------------------------------------------


class HILIsotropy(Term):
    """ColBERT-HIL's regularizer (HIL Sec. 3.3): ``reg_L * [reg_l] + reg_H * [reg_h]`` with ``reg_L =
    -mean |InterIso_L|`` (the absolute value per pair) and ``reg_H = mean InterIso_H``, over every (query, document)
    pair of the batch (N B of them; with triples the (q, d+) and (q, d-) pairs). InterIso_L counts only the query
    tokens of the lexical head (non-zero IDF); H every scored query token, as ColBERT. With weight lambda < 0
    (-0.3, the paper's best, A.3) it pushes InterIso_L toward 0 and InterIso_H toward 1. ``reg_l`` / ``reg_h``
    False drop a part (Table 5's ablations). Logs ``loss_reg_L``, ``loss_reg_H``, ``inter_iso_L``,
    ``inter_iso_H``, ``delta_inter_iso``.
    """

    def __init__(self, weight: float = -0.3, reg_l: bool = True, reg_h: bool = True):
        super().__init__(weight)
        self.reg_l = bool(reg_l)
        self.reg_h = bool(reg_h)

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "reg_l": self.reg_l, "reg_h": self.reg_h}

    def check(self, encoder: Encoder) -> None:
        require_hil_encoder(self, encoder)

    def forward(self, encoder: Encoder, batch: RankingBatch) -> LossOutput:
        require_hil_encoder(self, encoder)
        query_masks = batch.hil_query_masks(encoder)
        paired = batch.paired_queries
        iso = {"L": inter_iso(paired.heads["L"], batch.docs.heads["L"], query_masks["L"], batch.docs.mask),
               "H": batch.inter_iso("H")}  # (N B,) each
        reg_L = -interiso_reg(iso["L"], absolute=True)   # -|InterIso_L|, |.| per pair
        reg_H = interiso_reg(iso["H"], absolute=False)   # InterIso_H
        reg = reg_L * float(self.reg_l) + reg_H * float(self.reg_h)
        parts = {"loss_reg_L": reg_L, "loss_reg_H": reg_H, "inter_iso_L": iso["L"].mean(),
                 "inter_iso_H": iso["H"].mean(), "delta_inter_iso": iso["H"].mean() - iso["L"].mean()}
        return LossOutput(reg, {k: v.detach().float() for k, v in parts.items()})


class HILAuthorsRegularizer(Term):
    """The HIL authors' regularizer ("sensim" in their code): ``mean(H dots) - |mean(L dots)|``, each the mean
    of every query-token / document-token dot product over the batch's (query, document) pairs (N B of them)
    (:func:`hil.isotropy.regularizers.authors_hil_reg`); weight lambda = -0.3 as their ``train.sh``. Logs
    ``mean_dot_L``, ``mean_dot_H`` and ``inter_iso_H``."""

    def __init__(self, weight: float = -0.3):
        super().__init__(weight)

    def check(self, encoder: Encoder) -> None:
        require_hil_encoder(self, encoder)

    def forward(self, encoder: Encoder, batch: RankingBatch) -> LossOutput:
        require_hil_encoder(self, encoder)
        paired = batch.paired_queries
        dots = {head: mean_token_dot(paired.heads[head], batch.docs.heads[head]) for head in HEADS}
        reg = authors_hil_reg(dots["L"], dots["H"])
        parts = {"mean_dot_L": dots["L"], "mean_dot_H": dots["H"], "inter_iso_H": batch.inter_iso("H").mean()}
        return LossOutput(reg, {k: v.detach().float() for k, v in parts.items()})


# -- the weighted sum -----------------------------------------------------------------------------------------------


@dataclass
class NamedTerm:
    """A term of the objective and where its logs go: ``""`` the main loss (its parts under their own names),
    ``"reg"`` the isotropy regularizer (``loss_reg`` = its weighted value, as before terms), any other name an
    extra term (``loss_<name>`` = its weighted value, its parts as ``<name>_<part>``)."""

    name: str
    term: Term


def weighted_objective(terms: Sequence[NamedTerm], encoder: Encoder, batch: RankingBatch
                       ) -> tuple[Tensor, dict[str, Tensor]]:
    """``sum_k weight_k * value_k`` and every term's logs. A weight of 1 adds the value as it is."""
    total: Tensor | None = None
    parts: dict[str, Tensor] = {}
    for named in terms:
        out = named.term(encoder, batch)
        weight = named.term.weight
        contribution = out.loss if weight == 1.0 else weight * out.loss
        total = contribution if total is None else total + contribution
        if named.name == "":
            parts.update(out.parts)
        elif named.name == "reg":
            parts.update(loss_reg=contribution.detach(), **out.parts)
        else:
            parts[f"loss_{named.name}"] = contribution.detach()
            parts.update({f"{named.name}_{key}": value for key, value in out.parts.items()})
    if total is None:
        raise ValueError("the training objective has no term")
    return total, parts


def name_terms(loss: Term, regularizer: Regularizer | None, extra: Sequence[Term | Regularizer]) -> list[NamedTerm]:
    """The objective's terms in order, named for the logs: the loss, the regularizer, the extra terms (each named
    after its class, ``_2``, ``_3``... when a class repeats)."""
    named = [NamedTerm("", loss)]
    if regularizer is not None:
        named.append(NamedTerm("reg", RegularizerTerm(regularizer)))
    seen: dict[str, int] = {}
    for item in extra:
        term = as_term(item)
        base = snake_case(type(item).__name__)
        seen[base] = seen.get(base, 0) + 1
        named.append(NamedTerm(base if seen[base] == 1 else f"{base}_{seen[base]}", term))
    return named
