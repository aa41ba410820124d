"""Batches of B queries x N documents and the objective as a weighted list of terms, against loops written out.

- N = 2 through the general path equals the pairwise math of ColBERT v1 training written out as it was (loss and
  every parameter gradient, ``torch.equal``), for ColBERT (with each regularizer) and ColBERT-HIL (paper and authors).
- Every term on an n-way batch (N = 3, 4) against slow loops: the scores and ColBERT-HIL's batch z-scoring over all
  N B pairs, n-way and in-batch CE, KL distillation on each head / their sum / mean, and each regularizer with the
  pairs it sees.
- Distillation drives a tiny model's ranking to the teacher's (Spearman > 0.9).
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hil.errors import UserError
from hil.isotropy.metrics import inter_iso, isoscore_star, masked_tokens
from hil.isotropy.regularizers import (
    ConditionalIsotropyRegularizer,
    CosRegRegularizer,
    InterIsoRegularizer,
    IStarRegularizer,
    cosreg,
    mean_token_dot,
)
from hil.modeling.batch import RankingBatch, TripleBatch
from hil.modeling.contracts import EncodedBatch
from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.hil import HILEncoder
from hil.modeling.losses import HILAuthorsLoss, HILLoss, InBatchCE, KLDistillation, MarginMSE, NWayCE, PairwiseCE
from hil.modeling.module import RetrieverModule
from hil.modeling.terms import HILAuthorsRegularizer, HILIsotropy, RegularizerTerm

from conftest import random_bert

QUERIES = ["what causes fever", "is coffee bad for sleep", "cats"]
DOCS = [["Fever is caused by infection.", "Coffee delays sleep in the evening.", "Cats are small carnivores."],
        ["Paris is in France.", "The cat sat on the mat.", "Stock markets fell on Monday."],
        ["Fever can follow a vaccine.", "Tea has less caffeine.", "Dogs bark at cats."],
        ["Infection spreads fast.", "Sleep is restful.", "A lion is a big cat."]]  # DOCS[j][i]: document j of query i
TEACHER = [[4.0, 0.5, 2.0], [3.0, -1.0, 0.0], [1.0, 2.5, -2.0]]  # (B, N = 3)
EPS = 1e-5


def slow_late(q, q_keep, d, d_keep, weights=None) -> float:
    """sum over kept query tokens of (weight *) max over kept document tokens of the dot product."""
    total = 0.0
    for a in range(q.shape[0]):
        if q_keep[a]:
            sims = [float(q[a] @ d[b]) for b in range(d.shape[0]) if d_keep[b]]
            total += (1.0 if weights is None else float(weights[a])) * (max(sims) if sims else 0.0)
    return total


def slow_pair_mean_dot(q, q_keep, d, d_keep) -> float:
    values = [float(q[a] @ d[b]) for a in range(q.shape[0]) for b in range(d.shape[0]) if q_keep[a] and d_keep[b]]
    return sum(values) / len(values) if values else 0.0


def log_softmax_at(logits: list[float], index: int) -> float:
    top = max(logits)
    return logits[index] - top - math.log(sum(math.exp(x - top) for x in logits))


def slow_kl(student: list[list[float]], teacher: list[list[float]]) -> float:
    total = 0.0
    for s_row, t_row in zip(student, teacher):
        log_p = [log_softmax_at(t_row, j) for j in range(len(t_row))]
        log_q = [log_softmax_at(s_row, j) for j in range(len(s_row))]
        total += sum(math.exp(lp) * (lp - lq) for lp, lq in zip(log_p, log_q))
    return total / len(student)


@pytest.fixture
def colbert(hf_tokenizer) -> ColBERTEncoder:
    torch.manual_seed(0)
    return ColBERTEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24,
                          _loaded=(random_bert(), hf_tokenizer)).eval()


@pytest.fixture
def hil_encoder(hf_tokenizer) -> HILEncoder:
    torch.manual_seed(0)
    encoder = HILEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24, _loaded=(random_bert(), hf_tokenizer))
    encoder.set_idf_from_texts([d for column in DOCS for d in column], source="toy")
    return encoder


def nway(encoder, n: int = 3, teacher: bool = False) -> RankingBatch:
    documents = [d for column in DOCS[:n] for d in column]  # column by column: document j of query i at j B + i
    scores = torch.tensor(TEACHER, dtype=torch.float32)[:, :n] if teacher else None
    return RankingBatch(encoder.encode_queries(QUERIES), encoder.encode_documents(documents), scores)


def params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


def assert_bit_identical(new: torch.Tensor, old: torch.Tensor, module: torch.nn.Module) -> None:
    assert torch.equal(new, old), (new.item(), old.item())
    new_grads = torch.autograd.grad(new, params(module), retain_graph=True, allow_unused=True)
    old_grads = torch.autograd.grad(old, params(module), retain_graph=True, allow_unused=True)
    for a, b in zip(new_grads, old_grads):
        assert (a is None and b is None) or torch.equal(a, b)


# -- the layout ---------------------------------------------------------------------------------------------------


def test_ranking_batch_lays_documents_out_column_by_column(colbert):
    with torch.no_grad():
        batch = nway(colbert, 3, teacher=True)
    assert (batch.size, batch.n_documents) == (3, 3)
    assert batch.pair_index.tolist() == [0, 1, 2] * 3
    assert torch.equal(batch.column(1).heads["colbert"], batch.docs.heads["colbert"][3:6])
    assert torch.equal(batch.negatives.mask, batch.docs.mask[3:])
    assert batch.as_matrix(torch.arange(9.0)).tolist() == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    with pytest.raises(ValueError, match="N >= 2"):
        RankingBatch(batch.queries, batch.docs.select(slice(0, 8)))
    with pytest.raises(ValueError, match="teacher scores"):
        RankingBatch(batch.queries, batch.docs, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="positives then negatives"):
        TripleBatch(batch.queries, batch.docs)


def test_training_scores_come_from_the_encoders_own_method(colbert, monkeypatch):
    """The batch asks the encoder (``training_head_scores``, the contract) and never branches on its class: an
    encoder that scores otherwise is used as it says, once a step; the default is ``score_heads`` column by
    column, computed here by hand."""
    with torch.no_grad():
        batch = nway(colbert, 3)
        by_hand = torch.stack([colbert.score_heads(batch.queries, batch.column(j), all_pairs=False)["colbert"]
                               for j in range(3)], dim=1)
        assert torch.equal(batch.head_scores(colbert)["colbert"], by_hand)
        calls = []
        own = {"colbert": torch.full((3, 3), 7.0)}
        monkeypatch.setattr(type(colbert), "training_head_scores",
                            lambda self, q, d, n: calls.append(n) or (own, None))
        fresh = RankingBatch(batch.queries, batch.docs)
        assert fresh.head_scores(colbert) is own and fresh.head_scores(colbert) is own and calls == [3]
        with pytest.raises(TypeError, match="needs a HILEncoder"):
            fresh.hil_query_masks(colbert)


# -- N = 2: the general path is the old math, bit for bit ---------------------------------------------------------


@pytest.mark.parametrize("regularizer", [None, InterIsoRegularizer(0.4), InterIsoRegularizer(-0.1),
                                         CosRegRegularizer(0.2), IStarRegularizer(-0.6),
                                         ConditionalIsotropyRegularizer(0.4)])
@pytest.mark.parametrize("loss_class", [PairwiseCE, NWayCE])
def test_triples_train_as_before_on_colbert(colbert, regularizer, loss_class):
    """The objective of a triple batch against ColBERT v1's pairwise CE (+ lambda L_reg) as written before n-way
    batches: two score_pairs calls, CE over stack([pos, neg]), the regularizer's own weighted value added."""
    module = RetrieverModule(colbert, loss_class(), regularizer)
    batch = nway(colbert, 2)
    new, _ = module.objective_value(batch)
    q, d = batch.queries, batch.docs
    positive = colbert.score_pairs(q, d.select(slice(0, 3)))
    negative = colbert.score_pairs(q, d.select(slice(3, 6)))
    old = F.cross_entropy(torch.stack([positive, negative], dim=1), torch.zeros(3, dtype=torch.long))
    head = "colbert"
    pairs = torch.arange(3).repeat(2)
    if isinstance(regularizer, InterIsoRegularizer):
        values = inter_iso(q.heads[head][pairs], d.heads[head], q.mask[pairs], d.mask)
        old = old + regularizer.weight * (values.abs() if regularizer.weight >= 0 else values).mean()
    elif isinstance(regularizer, CosRegRegularizer):
        old = old + regularizer.weight / 2 * (cosreg(masked_tokens(q.heads[head], q.mask))
                                              + cosreg(masked_tokens(d.heads[head], d.mask)))
    elif isinstance(regularizer, IStarRegularizer):
        eye = torch.eye(16)
        old = old + regularizer.weight / 2 * ((1 - isoscore_star(masked_tokens(q.heads[head], q.mask), eye, 0.2))
                                              + (1 - isoscore_star(masked_tokens(d.heads[head], d.mask), eye, 0.2)))
    elif regularizer is not None:
        old = old + regularizer.weight * regularizer.term(q.heads[head], d.heads[head], q.mask, d.mask, pairs)[0]
    assert_bit_identical(new, old, colbert)


def test_triples_train_as_before_on_colbert_hil(hil_encoder):
    """HILLoss and HILAuthorsLoss through the terms against their math as written before (HIL Sec. 3.3 and the
    authors' code), in training mode (batch z-score moments)."""
    hil_encoder.train()
    batch = nway(hil_encoder, 2)
    q, d, n = batch.queries, batch.docs, 3
    pairs = torch.arange(3).repeat(2)
    for reg_l, reg_h in ((True, True), (False, True)):
        new = HILLoss(reg_weight=-0.3, reg_l=reg_l, reg_h=reg_h)(hil_encoder, RankingBatch(q, d)).loss
        late, masks = hil_encoder.training_pair_scores(q, d, pairs)
        ce = {h: F.cross_entropy(torch.stack([late[h][:n], late[h][n:]], dim=1), torch.zeros(n, dtype=torch.long))
              for h in ("L", "H")}
        paired = q.select(pairs)
        iso_L = inter_iso(paired.heads["L"], d.heads["L"], masks["L"], d.mask)
        iso_H = inter_iso(paired.heads["H"], d.heads["H"], paired.mask, d.mask)
        reg = -(iso_L.abs().mean()) * float(reg_l) + iso_H.mean() * float(reg_h)
        assert_bit_identical(new, ce["L"] + ce["H"] + -0.3 * reg, hil_encoder)
    new = HILAuthorsLoss(reg_weight=-0.3)(hil_encoder, RankingBatch(q, d)).loss
    late, _ = hil_encoder.training_pair_scores(q, d, pairs)
    total = (late["L"] + late["H"]) / 2
    ce = F.cross_entropy(torch.stack([total[:n], total[n:]], dim=1), torch.zeros(n, dtype=torch.long))
    paired = q.select(pairs)
    sensim = (mean_token_dot(paired.heads["H"], d.heads["H"]) - mean_token_dot(paired.heads["L"], d.heads["L"]).abs())
    assert_bit_identical(new, ce + -0.3 * sensim, hil_encoder)


# -- n-way batches against loops ----------------------------------------------------------------------------------


def slow_colbert_matrix(batch: RankingBatch, docs: EncodedBatch | None = None) -> list[list[float]]:
    """score(query i, document c) for every document row c of ``docs`` (default: the batch's)."""
    q = batch.queries
    d = batch.docs if docs is None else docs
    return [[slow_late(q.heads["colbert"][i], q.mask[i], d.heads["colbert"][c], d.mask[c]) for c in range(len(d))]
            for i in range(batch.size)]


def test_nway_ce_and_kl_on_colbert_against_loops(colbert):
    with torch.no_grad():
        batch = nway(colbert, 3, teacher=True)
        every = slow_colbert_matrix(batch)
        own = [[every[i][j * 3 + i] for j in range(3)] for i in range(3)]
        np.testing.assert_allclose(batch.head_scores(colbert)["colbert"].numpy(), own, atol=1e-5)
        out = NWayCE()(colbert, batch)
        assert out.loss.item() == pytest.approx(-sum(log_softmax_at(row, 0) for row in own) / 3, rel=1e-5)
        wrong = sum(row[0] > other for row in own for other in row[1:])
        assert out.parts["pair_accuracy"].item() == pytest.approx(wrong / 6)
        assert KLDistillation()(colbert, batch).loss.item() == pytest.approx(slow_kl(own, TEACHER), rel=1e-5)
        hot = KLDistillation(teacher_temperature=0.5)(colbert, batch).loss.item()
        assert hot == pytest.approx(slow_kl(own, [[2 * t for t in row] for row in TEACHER]), rel=1e-5)
        pairs = [(0, 1), (0, 2), (1, 2)]
        mse = sum(((own[i][a] - own[i][b]) - (TEACHER[i][a] - TEACHER[i][b])) ** 2 for i in range(3) for a, b in pairs)
        assert MarginMSE(pairs="all")(colbert, batch).loss.item() == pytest.approx(mse / 9, rel=1e-5)


@pytest.mark.parametrize("own_negatives", ["candidates", "excluded"])
def test_in_batch_ce_on_an_nway_batch_against_loops(colbert, own_negatives):
    with torch.no_grad():
        batch = nway(colbert, 3)
        every = slow_colbert_matrix(batch)
        out = InBatchCE(own_negatives=own_negatives)(colbert, batch)
    expected = 0.0
    for i in range(3):
        columns = [c for c in range(9) if own_negatives == "candidates" or c == i or c % 3 != i]
        expected -= log_softmax_at([every[i][c] for c in columns], columns.index(i)) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.parts["in_batch_candidates"].item() == (9.0 if own_negatives == "candidates" else 7.0)


def slow_hil_heads(encoder: HILEncoder, batch: RankingBatch) -> dict[str, list[list[float]]]:
    """Each head's z-scored score_late (HIL Sec. 3.3) of every (query i, own document j), by loops: token scores
    S_L = idf * max L.L over the lexical query tokens (idf != 0), S_H = max H.H over every scored query token; one
    mean / sqrt(population variance + eps) per head over every token score of all N B pairs; S' summed."""
    q, d, b, n = batch.queries, batch.docs, batch.size, batch.n_documents
    idf = encoder.idf[q.input_ids]
    keep = {"L": q.mask & (idf != 0), "H": q.mask}
    out = {}
    for head in ("L", "H"):
        rows = {}
        for i in range(b):
            for j in range(n):
                k = j * b + i
                rows[i, j] = [(float(idf[i, a]) if head == "L" else 1.0)
                              * max(float(q.heads[head][i, a] @ d.heads[head][k, c])
                                    for c in range(d.mask.shape[1]) if d.mask[k, c])
                              for a in range(q.mask.shape[1]) if keep[head][i, a]]
        flat = [s for row in rows.values() for s in row]
        mean = sum(flat) / len(flat)
        std = math.sqrt(sum((s - mean) ** 2 for s in flat) / len(flat) + EPS)
        out[head] = [[sum((s - mean) / std for s in rows[i, j]) for j in range(n)] for i in range(b)]
    return out


@pytest.mark.parametrize("heads", ["each", "sum", "mean"])
def test_distillation_on_colbert_hil_applies_to_each_head_or_their_sum(hil_encoder, heads):
    """KL on ColBERT-HIL's z-scored heads (batch moments over all N B pairs): "each" = KL(S_L) + KL(S_H), the
    per-head objective of Sec. 3.3; "sum" = KL(S_L + S_H), the score searched; "mean" = KL((S_L + S_H) / 2)."""
    hil_encoder.train()
    with torch.no_grad():
        batch = nway(hil_encoder, 3, teacher=True)
        slow = slow_hil_heads(hil_encoder, batch)
        scores = batch.head_scores(hil_encoder)
        for head in ("L", "H"):
            np.testing.assert_allclose(scores[head].numpy(), slow[head], atol=1e-4)
        out = KLDistillation(heads=heads)(hil_encoder, batch)
    combined = [[slow["L"][i][j] + slow["H"][i][j] for j in range(3)] for i in range(3)]
    expected = {"each": slow_kl(slow["L"], TEACHER) + slow_kl(slow["H"], TEACHER), "sum": slow_kl(combined, TEACHER),
                "mean": slow_kl([[x / 2 for x in row] for row in combined], TEACHER)}[heads]
    assert out.loss.item() == pytest.approx(expected, rel=1e-4)
    assert ("loss_kl_L" in out.parts) == (heads == "each")


def random_batch(b: int = 3, n: int = 4, lq: int = 5, ld: int = 6, dim: int = 8, seed: int = 0) -> RankingBatch:
    """Normalized random token embeddings with padding (zero vectors, as the encoders give), B queries x N docs."""
    g = torch.Generator().manual_seed(seed)
    q_mask, d_mask = torch.rand(b, lq, generator=g) > 0.3, torch.rand(n * b, ld, generator=g) > 0.3
    q_mask[:, :2], d_mask[:, :2] = True, True
    q = F.normalize(torch.randn(b, lq, dim, generator=g, dtype=torch.float64), dim=-1) * q_mask[..., None]
    d = F.normalize(torch.randn(n * b, ld, dim, generator=g, dtype=torch.float64), dim=-1) * d_mask[..., None]
    ids = torch.ones(b, lq, dtype=torch.long)
    return RankingBatch(EncodedBatch({"colbert": q}, q_mask, ids),
                        EncodedBatch({"colbert": d}, d_mask, torch.ones(n * b, ld, dtype=torch.long)))


class OneHead:
    head_names, architecture, dim = ("colbert",), "colbert", 8


def cosreg_loop(points: list[torch.Tensor]) -> float:
    m = len(points)
    return sum(float(points[a] @ points[c]) for a in range(m) for c in range(m) if a != c) / m ** 2


@pytest.mark.parametrize("n", [2, 4])
def test_regularizers_over_an_nway_batch_against_loops(n):
    """InterIso over all N B (query, document) pairs; CosReg / I-STAR over the queries' and the N B documents'
    token clouds; conditional isotropy over the (q, d+) pairs of column 0."""
    batch = random_batch(n=n)
    q, d, b = batch.queries, batch.docs, batch.size
    qv, dv = q.heads["colbert"], d.heads["colbert"]
    pair_iso = [slow_pair_mean_dot(qv[k % b], q.mask[k % b], dv[k], d.mask[k]) for k in range(n * b)]
    for weight in (0.4, -0.1):
        value = RegularizerTerm(InterIsoRegularizer(weight))(OneHead(), batch).loss.item()
        expected = sum(abs(x) if weight >= 0 else x for x in pair_iso) / (n * b)
        assert value == pytest.approx(expected, abs=1e-12)
    query_points = [qv[i, a] for i in range(b) for a in range(q.mask.shape[1]) if q.mask[i, a]]
    doc_points = [dv[k, c] for k in range(n * b) for c in range(d.mask.shape[1]) if d.mask[k, c]]
    cos = RegularizerTerm(CosRegRegularizer(0.2))(OneHead(), batch).loss.item()
    assert cos == pytest.approx((cosreg_loop(query_points) + cosreg_loop(doc_points)) / 2, abs=1e-12)
    eye = torch.eye(8, dtype=torch.float64)
    istar = RegularizerTerm(IStarRegularizer(0.2))(OneHead(), batch).loss.item()
    expected = ((1 - isoscore_star(torch.stack(query_points), eye).item())
                + (1 - isoscore_star(torch.stack(doc_points), eye).item())) / 2
    assert istar == pytest.approx(expected, abs=1e-9)
    conditional = RegularizerTerm(ConditionalIsotropyRegularizer(0.4))(OneHead(), batch).loss.item()
    total, count = 0.0, 0
    for i in range(b):  # column 0 only: document i is query i's positive
        for a in range(q.mask.shape[1]):
            residuals = []
            for c in range(d.mask.shape[1]):
                r = dv[i, c] - float(qv[i, a] @ dv[i, c]) * qv[i, a]
                residuals.append(r / r.norm() if r.norm() > 0 else r)
            total += sum(float(x @ y) for x in residuals for y in residuals)
            count += len(residuals) ** 2
    assert conditional == pytest.approx(total / count, abs=1e-9)


def test_hil_regularizers_over_an_nway_batch_against_loops(hil_encoder):
    hil_encoder.eval()
    with torch.no_grad():
        batch = nway(hil_encoder, 3)
        q, d, b = batch.queries, batch.docs, batch.size
        lexical = q.mask & (hil_encoder.idf[q.input_ids] != 0)
        iso = {"L": [slow_pair_mean_dot(q.heads["L"][k % b], lexical[k % b], d.heads["L"][k], d.mask[k])
                     for k in range(3 * b)],
               "H": [slow_pair_mean_dot(q.heads["H"][k % b], q.mask[k % b], d.heads["H"][k], d.mask[k])
                     for k in range(3 * b)]}
        out = HILIsotropy(weight=-0.3)(hil_encoder, batch)
        expected = -sum(abs(x) for x in iso["L"]) / 9 + sum(iso["H"]) / 9
        assert out.loss.item() == pytest.approx(expected, abs=1e-5)
        assert out.parts["delta_inter_iso"].item() == pytest.approx((sum(iso["H"]) - sum(iso["L"])) / 9, abs=1e-5)
        only_h = HILIsotropy(weight=-0.3, reg_l=False)(hil_encoder, batch).loss.item()
        assert only_h == pytest.approx(sum(iso["H"]) / 9, abs=1e-5)
        dots = {}
        for head in ("L", "H"):  # every token pair of every (query, document) pair, padding included as zeros
            lq, ld = q.mask.shape[1], d.mask.shape[1]
            dots[head] = sum(float(q.heads[head][k % b, a] @ d.heads[head][k, c])
                             for k in range(3 * b) for a in range(lq) for c in range(ld)) / (3 * b * lq * ld)
        sensim = HILAuthorsRegularizer()(hil_encoder, batch).loss.item()
        assert sensim == pytest.approx(dots["H"] - abs(dots["L"]), abs=1e-6)


# -- the weighted sum ---------------------------------------------------------------------------------------------


def test_the_objective_is_the_weighted_sum_of_its_terms(colbert):
    module = RetrieverModule(colbert, KLDistillation(weight=0.5), InterIsoRegularizer(0.4),
                             terms=[InBatchCE(weight=0.25, own_negatives="excluded"), CosRegRegularizer(-0.2),
                                    InBatchCE(weight=2.0)])
    with torch.no_grad():
        batch = nway(colbert, 3, teacher=True)
        loss, parts = module.objective_value(batch)
        values = {"kl": KLDistillation()(colbert, batch).loss.item(),
                  "iso": RegularizerTerm(InterIsoRegularizer(0.4))(colbert, batch).loss.item(),
                  "ib_excluded": InBatchCE(own_negatives="excluded")(colbert, batch).loss.item(),
                  "cosreg": RegularizerTerm(CosRegRegularizer(-0.2))(colbert, batch).loss.item(),
                  "ib": InBatchCE()(colbert, batch).loss.item()}
    expected = (0.5 * values["kl"] + 0.4 * values["iso"] + 0.25 * values["ib_excluded"] - 0.2 * values["cosreg"]
                + 2.0 * values["ib"])
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert parts["loss_kl"].item() == pytest.approx(values["kl"], rel=1e-5)  # the main loss's parts, unweighted
    assert parts["loss_reg"].item() == pytest.approx(0.4 * values["iso"], rel=1e-5)
    assert parts["loss_in_batch_ce"].item() == pytest.approx(0.25 * values["ib_excluded"], rel=1e-5)
    assert parts["loss_in_batch_ce_2"].item() == pytest.approx(2.0 * values["ib"], rel=1e-5)
    assert parts["loss_cos_reg_regularizer"].item() == pytest.approx(-0.2 * values["cosreg"], rel=1e-5)
    assert parts["in_batch_ce_in_batch_candidates"].item() == 7.0
    record = module.training_record()
    assert [t["class"].rsplit(".", 1)[1] for t in record["terms"]] == ["InBatchCE", "CosRegRegularizer", "InBatchCE"]


def test_terms_that_do_not_fit_are_refused_before_training(colbert, hil_encoder):
    with pytest.raises(TypeError, match="model.loss: .*HILEncoder"):
        RetrieverModule(colbert, HILLoss())
    with pytest.raises(TypeError, match=r"model.terms\[1\]: .*HILEncoder"):
        RetrieverModule(colbert, KLDistillation(), terms=[InBatchCE(), HILIsotropy()])
    with pytest.raises(ValueError, match="model.regularizer: .*one-head encoder"):
        RetrieverModule(hil_encoder, HILLoss(), InterIsoRegularizer(0.4))
    with pytest.raises(ValueError, match="gradcache_chunk_size"):
        RetrieverModule(colbert, gradcache_chunk_size=0)
    with torch.no_grad():
        batch = nway(colbert, 3)
        for term in (KLDistillation(), MarginMSE()):
            with pytest.raises(UserError, match="needs teacher scores"):
                term(colbert, batch)


def test_the_module_reads_nway_string_batches_with_teacher_scores(colbert):
    """The data module's batch of strings: documents (B, N), each query's row; scores (B, N)."""
    module = RetrieverModule(colbert, KLDistillation())
    strings = {"queries": QUERIES, "documents": [list(row) for row in zip(*DOCS[:3])],
               "teacher_scores": torch.tensor(TEACHER)}
    with torch.no_grad():
        loss, parts = module.compute_loss(strings)
        expected = KLDistillation()(colbert, nway(colbert, 3, teacher=True)).loss
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    with pytest.raises(ValueError, match="N documents for each query"):
        module.compute_loss({**strings, "documents": [*strings["documents"][:2], DOCS[0][2:3]]})
    with pytest.raises(ValueError, match="documents for 2"):
        module.compute_loss({**strings, "documents": strings["documents"][:2]})


# -- distillation works -------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_distillation_drives_the_student_ranking_to_the_teachers(shared_dir, one_thread):
    """A tiny ColBERT trained with the KL term alone on 4 queries x 8 documents with arbitrary teacher scores ends
    up ranking each query's documents as the teacher does: mean Spearman over the queries > 0.9."""
    from scipy.stats import spearmanr

    from hil.data.triples import read_triples
    from hil.paths import resolve_data_file

    triples = read_triples(resolve_data_file("msmarco/triples.train.small.head1000.tsv"), limit=40)
    queries = [t.query for t in triples[:4]]
    pool = list(dict.fromkeys(text for t in triples for text in (t.positive, t.negative)))
    n = 8
    rows = [[pool[(j * 4 + i) * 3 % len(pool)] for j in range(n)] for i in range(4)]  # (B, N)
    documents = [row[j] for j in range(n) for row in rows]  # column by column
    teacher = torch.randn(4, n, generator=torch.Generator().manual_seed(3)) * 3
    torch.manual_seed(0)
    encoder = ColBERTEncoder("bert-tiny-splade", dim=32, query_maxlen=16, doc_maxlen=48)
    module = RetrieverModule(encoder, KLDistillation(), optimizer=partial(torch.optim.AdamW, lr=3e-3))
    optimizer = module.configure_optimizers()["optimizer"]
    strings = {"queries": queries, "documents": rows, "teacher_scores": teacher}

    def correlations() -> list[float]:
        encoder.eval()
        with torch.no_grad():
            scores = nway_scores(encoder, queries, documents, n)
        encoder.train()
        return [spearmanr(scores[i], teacher[i]).statistic for i in range(4)]

    before = correlations()
    module.train()
    for _ in range(20):
        optimizer.zero_grad()
        loss, _ = module.compute_loss(strings)
        loss.backward()
        optimizer.step()
    after = correlations()
    assert np.mean(after) > 0.9, (before, after)
    assert np.mean(after) > np.mean(before) + 0.3, (before, after)


def nway_scores(encoder, queries: list[str], documents: list[str], n: int) -> np.ndarray:
    batch = RankingBatch(encoder.encode_queries(queries), encoder.encode_documents(documents))
    return batch.head_scores(encoder)["colbert"].numpy()
