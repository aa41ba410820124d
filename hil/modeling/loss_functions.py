"""Ranking and distillation losses as pure functions on score tensors: scores in, scalar out.

A batch of B queries with N documents each is scored into a (B, N) matrix, column 0 being each query's positive
(or, for graded examples, simply its first document). The loss terms (``hil.modeling.losses``) compute those scores
through the encoder and call one of these; each is tested against a loop written out by hand
(``tests/test_loss_functions.py``).

    nway_ce_loss          CE over each query's N documents, target column 0     ColBERT v1 (N = 2), ColBERTv2 nway
    in_batch_ce_loss      CE of query i over every document of the batch        ColBERTv2 use_ib_negatives, PyLate
    kl_distillation_loss  KL(teacher || student) over each query's N documents  ColBERTv2, PyLate Distillation
    margin_mse_loss       MSE of student vs teacher score margins               Hofstaetter et al. 2020 (MarginMSE)
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

MarginPairs = Literal["first", "all"]
MARGIN_PAIRS: tuple[str, ...] = ("first", "all")
MINMAX_EPS = 1e-8  # PyLate's Distillation: (s - min) / (max - min + 1e-8)


def _check_matrix(name: str, scores: Tensor, least_columns: int = 2) -> None:
    if scores.dim() != 2 or scores.shape[1] < least_columns:
        raise ValueError(f"{name} expects scores (B, N) with N >= {least_columns}, got shape {tuple(scores.shape)}")


def nway_ce_loss(scores: Tensor) -> Tensor:
    """Softmax cross-entropy of each query over its own N documents, the positive in column 0; mean over queries.

    scores (B, N) -> scalar. N = 2 is ColBERT v1's pairwise loss (Khattab & Zaharia 2020); any N is ColBERTv2's
    ``nn.CrossEntropyLoss()(scores.view(-1, nway), zeros)`` (``colbert/training/training.py``) and PyLate's
    ``Contrastive`` restricted to each query's own documents.

    A positive 2 above its negative costs ``log(1 + e^-2)`` = 0.127, a tie ``log 2`` = 0.693; the mean, 0.410:

    >>> nway_ce_loss(torch.tensor([[2., 0.], [0., 0.]]))
    tensor(0.4100)
    """
    _check_matrix("nway_ce_loss", scores)
    return F.cross_entropy(scores, torch.zeros(len(scores), dtype=torch.long, device=scores.device))


def pairwise_ce_loss(positive_scores: Tensor, negative_scores: Tensor) -> Tensor:
    """L_late = CE(score(q, d+), score(q, d-)): :func:`nway_ce_loss` with N = 2 (ColBERT v1).

    positive_scores (B,), negative_scores (B,) -> scalar (mean over pairs).

    >>> pairwise_ce_loss(torch.tensor([2., 0.]), torch.tensor([0., 0.]))  # as nway_ce_loss's example
    tensor(0.4100)
    """
    return nway_ce_loss(torch.stack([positive_scores, negative_scores], dim=1))  # (B, 2)


def own_negative_columns(n_queries: int, n_documents: int, offset: int, n_columns: int,
                         device: torch.device | None = None) -> Tensor:
    """Where each query's own negatives sit in an in-batch score matrix. -> (B, C) bool.

    This rank's documents are columns ``offset .. offset + N B - 1``, document j of query i at ``offset + j B + i``
    (``hil.modeling.batch.RankingBatch``'s layout); True at ``offset + j B + i`` for j = 1 .. N - 1.

    Two queries with a positive and a negative each: the positives in columns 0 and 1, the negatives in 2 and 3.

    >>> own_negative_columns(2, 2, offset=0, n_columns=4)
    tensor([[False, False,  True, False],
            [False, False, False,  True]])
    """
    rows = torch.arange(n_queries, device=device)
    excluded = torch.zeros(n_queries, n_columns, dtype=torch.bool, device=device)
    for j in range(1, n_documents):
        excluded[rows, offset + j * n_queries + rows] = True
    return excluded


def in_batch_ce_loss(score_matrix: Tensor, offset: int = 0, excluded: Tensor | None = None) -> Tensor:
    """Cross-entropy where query i's positive is column ``offset + i`` and every other column is a negative.

    score_matrix (B, C) with C >= offset + B: columns ``offset .. offset + B - 1`` are the positives of the B
    queries in order (``offset`` is where this rank's documents start among every rank's, 0 on one process).
    ``excluded`` (B, C) bool: columns left out of query i's candidates (ColBERTv2's ``compute_ib_loss`` leaves out
    each query's own hard negatives, which its n-way loss already ranks: :func:`own_negative_columns`); None keeps
    every column (ColBERT v1 style in-batch negatives, this package's ``InBatchCE`` before n-way batches).

    Each positive 5 above three negatives: ``log(1 + 3 e^-5)`` = 0.0200; its own negative left out, ``log(1 + 2
    e^-5)`` = 0.0134.

    >>> scores = torch.tensor([[5., 0., 0., 0.], [0., 5., 0., 0.]])
    >>> in_batch_ce_loss(scores)
    tensor(0.0200)
    >>> in_batch_ce_loss(scores, excluded=own_negative_columns(2, 2, 0, 4))
    tensor(0.0134)
    """
    _check_matrix("in_batch_ce_loss", score_matrix, least_columns=1)
    targets = offset + torch.arange(score_matrix.shape[0], device=score_matrix.device)  # (B,)
    if excluded is not None:
        if excluded.shape != score_matrix.shape:
            raise ValueError(f"in_batch_ce_loss: excluded {tuple(excluded.shape)} must match the scores "
                             f"{tuple(score_matrix.shape)}")
        if bool(excluded[torch.arange(len(targets), device=targets.device), targets].any()):
            raise ValueError("in_batch_ce_loss: a query's own positive cannot be excluded")
        score_matrix = score_matrix.masked_fill(excluded, float("-inf"))
    return F.cross_entropy(score_matrix, targets)


def minmax_normalize(scores: Tensor) -> Tensor:
    """Each row scaled to [0, 1]: ``(s - min) / (max - min + 1e-8)`` (PyLate's ``Distillation`` with
    ``normalize_scores=True``, its default, applied to the student's scores). scores (B, N) -> (B, N).

    >>> minmax_normalize(torch.tensor([[1., 3., 2.]]))
    tensor([[0.0000, 1.0000, 0.5000]])
    """
    low = scores.min(dim=1, keepdim=True).values
    high = scores.max(dim=1, keepdim=True).values
    return (scores - low) / (high - low + MINMAX_EPS)


def kl_distillation_loss(student_scores: Tensor, teacher_scores: Tensor, student_temperature: float = 1.0,
                         teacher_temperature: float = 1.0) -> Tensor:
    """KL(p_teacher || p_student) over each query's N documents, summed over documents, mean over queries.

        p_teacher = softmax(teacher / T_t),  p_student = softmax(student / T_s)
        L = 1/B sum_i sum_j p_teacher[i, j] (log p_teacher[i, j] - log p_student[i, j])

    student_scores, teacher_scores (B, N) -> scalar. The teacher's scores are logits: both sides go through
    log-softmax over the N documents, as ColBERTv2 (``colbert/training/training.py``: ``log_softmax(target_scores *
    distillation_alpha)`` against ``log_softmax(scores)``, ``KLDivLoss(reduction='batchmean', log_target=True)``),
    PyLate (``pylate/losses/distillation.py``: ``log_softmax(labels)``) and Lightning IR's ``KLDivergence``.
    The temperatures: ColBERTv2 scales only the teacher (``distillation_alpha`` = 1 / T_t, default 1, T_s = 1);
    Hinton et al. (2015) divide both by one T.

    Equal scores cost 0; a student indifferent between two documents the teacher tells apart by a wide margin
    costs ``log 2``:

    >>> kl_distillation_loss(torch.tensor([[1., 2.]]), torch.tensor([[1., 2.]]))
    tensor(0.)
    >>> kl_distillation_loss(torch.tensor([[0., 0.]]), torch.tensor([[0., 100.]]))
    tensor(0.6931)
    """
    _check_matrix("kl_distillation_loss", student_scores)
    if teacher_scores.shape != student_scores.shape:
        raise ValueError(f"kl_distillation_loss: teacher scores {tuple(teacher_scores.shape)} and student scores "
                         f"{tuple(student_scores.shape)} differ")
    if student_temperature <= 0 or teacher_temperature <= 0:
        raise ValueError(f"kl_distillation_loss: temperatures must be > 0 (got {student_temperature}, "
                         f"{teacher_temperature})")
    log_student = F.log_softmax(student_scores / student_temperature, dim=-1)
    log_teacher = F.log_softmax(teacher_scores.to(log_student.dtype) / teacher_temperature, dim=-1)
    return F.kl_div(log_student, log_teacher, reduction="batchmean", log_target=True)


def margin_pairs(n_documents: int, pairs: MarginPairs, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """The (a, b) document columns whose margins :func:`margin_mse_loss` compares. -> two (P,) long tensors.

    "first": (0, j) for j = 1 .. N - 1, the positive against each negative (Hofstaetter et al. 2020 train on
    triples, N = 2; this is the same pair for each of a query's negatives). "all": every unordered pair a < b,
    N (N - 1) / 2 of them (as Lightning IR's ``MarginMSE`` with ``margin="scores"``, which however keeps only the
    pairs the teacher does not tie). Both give the one pair (0, 1) when N = 2; the orientation of a pair does not
    change its squared error.

    >>> margin_pairs(3, "first")
    (tensor([0, 0]), tensor([1, 2]))
    >>> margin_pairs(3, "all")
    (tensor([0, 0, 1]), tensor([1, 2, 2]))
    """
    if pairs not in MARGIN_PAIRS:
        raise ValueError(f"margin pairs must be one of {MARGIN_PAIRS}, got {pairs!r}")
    if pairs == "first":
        others = torch.arange(1, n_documents, device=device)
        return torch.zeros_like(others), others
    first, second = torch.triu_indices(n_documents, n_documents, offset=1, device=device)
    return first, second


def margin_mse_loss(student_scores: Tensor, teacher_scores: Tensor, pairs: MarginPairs = "first") -> Tensor:
    """MarginMSE (Hofstaetter et al. 2020, "Improving Efficient Neural Ranking Models with Cross-Architecture
    Knowledge Distillation", Eq. 1): ``mean over pairs of ((s_a - s_b) - (t_a - t_b))^2``.

    student_scores, teacher_scores (B, N) -> scalar, the mean over the B x P pairs of :func:`margin_pairs`.

    Student margin 2 where the teacher's is 1: (2 - 1)^2. Over all three pairs of (3, 1, 0) against (2, 1, 0), the
    margins (2, 3, 1) against (1, 2, 1): (1 + 1 + 0) / 3.

    >>> margin_mse_loss(torch.tensor([[3., 1.]]), torch.tensor([[2., 1.]]))
    tensor(1.)
    >>> margin_mse_loss(torch.tensor([[3., 1., 0.]]), torch.tensor([[2., 1., 0.]]), pairs="all")
    tensor(0.6667)
    """
    _check_matrix("margin_mse_loss", student_scores)
    if teacher_scores.shape != student_scores.shape:
        raise ValueError(f"margin_mse_loss: teacher scores {tuple(teacher_scores.shape)} and student scores "
                         f"{tuple(student_scores.shape)} differ")
    first, second = margin_pairs(student_scores.shape[1], pairs, student_scores.device)
    student_margin = student_scores[:, first] - student_scores[:, second]          # (B, P)
    teacher = teacher_scores.to(student_scores.dtype)
    teacher_margin = teacher[:, first] - teacher[:, second]                         # (B, P)
    return F.mse_loss(student_margin, teacher_margin)


# -- what training logs ---------------------------------------------------------------------------------------------


def pair_diagnostics(positive_scores: Tensor, negative_scores: Tensor) -> dict[str, Tensor]:
    """What training logs about the ranking of each pair: share of pairs with d+ above d-, mean score margin.

    positive_scores (B,) with negative_scores (B,), or (B, 1) with (B, N - 1): each positive against each of its
    query's negatives. Ties do not count as ranked right.

    >>> pair_diagnostics(torch.tensor([2., 0., 1.]), torch.tensor([1., 0., 3.]))  # right, tie, wrong
    {'pair_accuracy': tensor(0.3333), 'score_margin': tensor(-0.3333)}
    """
    positive, negative = positive_scores.detach(), negative_scores.detach()
    return {"pair_accuracy": (positive > negative).float().mean(), "score_margin": (positive - negative).mean()}


def ranking_diagnostics(scores: Tensor) -> dict[str, Tensor]:
    """:func:`pair_diagnostics` of a (B, N) score matrix: column 0 against each other column."""
    if scores.shape[1] == 2:
        return pair_diagnostics(scores[:, 0], scores[:, 1])
    return pair_diagnostics(scores[:, :1], scores[:, 1:])


def teacher_agreement(student_scores: Tensor, teacher_scores: Tensor) -> Tensor:
    """Share of each query's document pairs that the student orders as the teacher does (pairs the teacher ties
    left out; a student tie counts as wrong). (B, N) twice -> scalar in [0, 1] (0 when the teacher ties all).

    The student orders (0, 1) and (0, 2) as the teacher does, (1, 2) the other way:

    >>> teacher_agreement(torch.tensor([[3., 1., 2.]]), torch.tensor([[3., 2., 1.]]))
    tensor(0.6667)
    """
    first, second = margin_pairs(student_scores.shape[1], "all", student_scores.device)
    student = (student_scores[:, first] - student_scores[:, second]).detach()
    teacher = (teacher_scores[:, first] - teacher_scores[:, second]).to(student.dtype)
    ordered = teacher != 0
    agree = (torch.sign(student) == torch.sign(teacher)) & ordered
    return agree.sum().float() / ordered.sum().clamp(min=1).float()
