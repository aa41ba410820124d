"""The pure ranking and distillation losses against references written out with loops and math.log."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hil.modeling.loss_functions import (
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


def log_softmax_at(logits: list[float], index: int) -> float:
    top = max(logits)
    return logits[index] - top - math.log(sum(math.exp(x - top) for x in logits))


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    return [w / sum(weights) for w in weights]


def matrix(rows: int, columns: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


# -- n-way CE ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 7])
def test_nway_ce_is_minus_log_softmax_of_the_first_column(n):
    scores = matrix(4, n, seed=n)
    expected = -sum(log_softmax_at(scores[i].tolist(), 0) for i in range(4)) / 4
    assert nway_ce_loss(scores).item() == pytest.approx(expected, rel=1e-12)


def test_n_equal_two_is_todays_pairwise_loss_bit_for_bit():
    """The pairwise CE as ColBERT v1 training computed it before n-way batches: stack (pos, neg), CE to 0."""
    scores = matrix(5, 2, seed=1).float().requires_grad_()
    old = F.cross_entropy(torch.stack([scores[:, 0], scores[:, 1]], dim=1), torch.zeros(5, dtype=torch.long))
    new = nway_ce_loss(torch.stack([scores[:, 0], scores[:, 1]], dim=1))
    assert torch.equal(old, new)
    assert torch.equal(pairwise_ce_loss(scores[:, 0], scores[:, 1]), old)
    old_grad, = torch.autograd.grad(old, scores)
    new_grad, = torch.autograd.grad(pairwise_ce_loss(scores[:, 0], scores[:, 1]), scores)
    assert torch.equal(old_grad, new_grad)
    expected = -sum(log_softmax_at(scores[i].tolist(), 0) for i in range(5)) / 5
    assert new.item() == pytest.approx(expected, rel=1e-6)


def test_nway_ce_refuses_one_column():
    with pytest.raises(ValueError, match=r"\(B, N\)"):
        nway_ce_loss(torch.zeros(3, 1))


# -- in-batch CE ------------------------------------------------------------------------------------------------------


def slow_in_batch(scores: torch.Tensor, offset: int, n: int, drop_own_negatives: bool) -> float:
    """ColBERTv2's ``compute_ib_loss`` written as loops: query i keeps every column but its own negatives
    (``offset + j B + i``, j >= 1) when asked, the positive ``offset + i`` is the target."""
    b = scores.shape[0]
    total = 0.0
    for i in range(b):
        own_negatives = {offset + j * b + i for j in range(1, n)}
        kept = [c for c in range(scores.shape[1]) if not (drop_own_negatives and c in own_negatives)]
        row = [float(scores[i, c]) for c in kept]
        total -= log_softmax_at(row, kept.index(offset + i))
    return total / b


@pytest.mark.parametrize("n, offset, extra", [(2, 0, 0), (3, 0, 0), (3, 6, 9), (4, 4, 0)])
def test_in_batch_ce_with_and_without_own_negatives(n, offset, extra):
    b = 3
    scores = matrix(b, offset + n * b + extra, seed=n + offset)
    excluded = own_negative_columns(b, n, offset, scores.shape[1])
    assert excluded.sum().item() == b * (n - 1)
    for i in range(b):
        for j in range(1, n):
            assert excluded[i, offset + j * b + i]
    assert in_batch_ce_loss(scores, offset).item() == pytest.approx(slow_in_batch(scores, offset, n, False), rel=1e-12)
    assert in_batch_ce_loss(scores, offset, excluded).item() == pytest.approx(
        slow_in_batch(scores, offset, n, True), rel=1e-12)


def test_in_batch_ce_without_exclusions_is_todays():
    scores = matrix(2, 4, seed=3).float()
    for offset in (0, 1, 2):
        old = F.cross_entropy(scores, offset + torch.arange(2))
        assert torch.equal(in_batch_ce_loss(scores, offset), old)


def test_in_batch_ce_refuses_to_exclude_a_positive():
    scores = matrix(2, 4, seed=3)
    excluded = torch.zeros(2, 4, dtype=torch.bool)
    excluded[1, 1] = True
    with pytest.raises(ValueError, match="positive"):
        in_batch_ce_loss(scores, 0, excluded)


# -- KL distillation ------------------------------------------------------------------------------------------------


def slow_kl(student: torch.Tensor, teacher: torch.Tensor, t_student: float, t_teacher: float) -> float:
    total = 0.0
    for i in range(student.shape[0]):
        p = softmax([float(x) / t_teacher for x in teacher[i]])
        log_q = [log_softmax_at([float(x) / t_student for x in student[i]], j) for j in range(student.shape[1])]
        total += sum(p[j] * (math.log(p[j]) - log_q[j]) for j in range(student.shape[1]))
    return total / student.shape[0]


@pytest.mark.parametrize("t_student, t_teacher", [(1.0, 1.0), (1.0, 0.5), (2.0, 2.0), (0.25, 4.0)])
def test_kl_is_teacher_softmax_against_student_log_softmax(t_student, t_teacher):
    student, teacher = matrix(4, 6, seed=5), matrix(4, 6, seed=6, scale=5.0)
    got = kl_distillation_loss(student, teacher, t_student, t_teacher).item()
    assert got == pytest.approx(slow_kl(student, teacher, t_student, t_teacher), rel=1e-10)


def test_kl_treats_teacher_scores_as_logits_and_matches_colbertv2():
    """ColBERTv2 (training.py): log_softmax(target * alpha) vs log_softmax(scores), KLDivLoss(batchmean,
    log_target=True). The teacher's scores are logits: adding a constant to a query's row changes nothing."""
    student, teacher = matrix(3, 5, seed=7), matrix(3, 5, seed=8)
    alpha = 2.0
    colbertv2 = torch.nn.KLDivLoss(reduction="batchmean", log_target=True)(
        F.log_softmax(student, dim=-1), F.log_softmax(teacher * alpha, dim=-1))
    assert kl_distillation_loss(student, teacher, 1.0, 1 / alpha).item() == pytest.approx(colbertv2.item(), rel=1e-12)
    shifted = teacher + torch.tensor([[100.0], [-3.0], [0.5]], dtype=torch.float64)
    assert kl_distillation_loss(student, shifted).item() == pytest.approx(
        kl_distillation_loss(student, teacher).item(), rel=1e-9)
    assert kl_distillation_loss(teacher, teacher).item() == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="temperatures"):
        kl_distillation_loss(student, teacher, 0.0)
    with pytest.raises(ValueError, match="differ"):
        kl_distillation_loss(student, teacher[:, :4])


def test_minmax_scales_each_row_to_the_unit_interval():
    scores = matrix(3, 4, seed=9)
    got = minmax_normalize(scores)
    for i in range(3):
        low, high = min(scores[i].tolist()), max(scores[i].tolist())
        for j in range(4):
            assert got[i, j].item() == pytest.approx((scores[i, j].item() - low) / (high - low + 1e-8), rel=1e-12)


# -- MarginMSE ------------------------------------------------------------------------------------------------------


def slow_margin_mse(student: torch.Tensor, teacher: torch.Tensor, pairs: str) -> float:
    n = student.shape[1]
    chosen = [(0, j) for j in range(1, n)] if pairs == "first" else [(a, b) for a in range(n) for b in range(a + 1, n)]
    errors = [((float(student[i, a]) - float(student[i, b])) - (float(teacher[i, a]) - float(teacher[i, b]))) ** 2
              for i in range(student.shape[0]) for a, b in chosen]
    return sum(errors) / len(errors)


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("pairs", ["first", "all"])
def test_margin_mse_against_pair_loops(n, pairs):
    student, teacher = matrix(4, n, seed=10 + n), matrix(4, n, seed=20 + n)
    assert margin_mse_loss(student, teacher, pairs).item() == pytest.approx(
        slow_margin_mse(student, teacher, pairs), rel=1e-12)


def test_margin_mse_for_triples_is_hofstaetters():
    """N = 2: MSE(s+ - s-, t+ - t-) (Hofstaetter et al. 2020, Eq. 1), whichever pairing is chosen."""
    student, teacher = matrix(6, 2, seed=30), matrix(6, 2, seed=31)
    expected = F.mse_loss(student[:, 0] - student[:, 1], teacher[:, 0] - teacher[:, 1])
    assert margin_mse_loss(student, teacher, "first").item() == pytest.approx(expected.item(), rel=1e-12)
    assert margin_mse_loss(student, teacher, "all").item() == pytest.approx(expected.item(), rel=1e-12)
    with pytest.raises(ValueError, match="margin pairs"):
        margin_mse_loss(student, teacher, "random")


# -- diagnostics ----------------------------------------------------------------------------------------------------


def test_ranking_diagnostics_compare_the_first_column_with_every_other():
    scores = torch.tensor([[1.0, 0.0, 2.0], [3.0, 3.0, 1.0]])
    parts = ranking_diagnostics(scores)
    assert parts["pair_accuracy"].item() == pytest.approx(2 / 4)  # ties are not ranked right
    assert parts["score_margin"].item() == pytest.approx((1 - 1 + 0 + 2) / 4)
    pairs = ranking_diagnostics(scores[:, :2])
    assert {k: v.item() for k, v in pairs.items()} == {
        k: v.item() for k, v in pair_diagnostics(scores[:, 0], scores[:, 1]).items()}


def test_teacher_agreement_counts_pairs_ordered_as_the_teacher():
    student = torch.tensor([[3.0, 2.0, 1.0], [1.0, 1.0, 0.0]])
    teacher = torch.tensor([[1.0, 2.0, 0.0], [5.0, 4.0, 4.0]])
    # row 0: pairs (0,1) wrong, (0,2) right, (1,2) right; row 1: (0,1) student tie -> wrong, (0,2) right,
    # (1,2) teacher tie -> left out
    assert teacher_agreement(student, teacher).item() == pytest.approx(3 / 5)
