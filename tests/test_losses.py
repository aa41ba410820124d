"""Training losses and the module that composes them, against cross-entropies written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from hil.isotropy.metrics import inter_iso
from hil.isotropy.regularizers import CosRegRegularizer, InterIsoRegularizer
from hil.modeling import batch as batch_module
from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.hil import HILEncoder
from hil.modeling.losses import (
    HILLoss,
    InBatchCE,
    PairwiseCE,
    TripleBatch,
    in_batch_ce_loss,
    pair_diagnostics,
    pairwise_ce_loss,
)
from hil.modeling.module import LinearWarmup, RetrieverModule

from conftest import random_bert

QUERIES = ["what causes fever", "is coffee bad for sleep", "cats"]
POSITIVES = ["Fever is caused by infection.", "Coffee delays sleep in the evening.", "Cats are small carnivores."]
NEGATIVES = ["Paris is in France.", "The cat sat on the mat.", "Stock markets fell on Monday."]


def slow_late(q, q_mask, d, d_mask) -> float:
    """ColBERT Eq. 1 for one query and one document, token by token."""
    total = 0.0
    for i in range(q.shape[0]):
        if q_mask[i]:
            sims = [float(q[i] @ d[j]) for j in range(d.shape[0]) if d_mask[j]]
            total += max(sims) if sims else 0.0
    return total


def log_softmax_at(logits: list[float], index: int) -> float:
    top = max(logits)
    return logits[index] - top - math.log(sum(math.exp(x - top) for x in logits))


@pytest.fixture
def colbert(hf_tokenizer) -> ColBERTEncoder:
    torch.manual_seed(0)
    return ColBERTEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24,
                          _loaded=(random_bert(), hf_tokenizer)).eval()


def encode(encoder) -> TripleBatch:
    return TripleBatch(encoder.encode_queries(QUERIES), encoder.encode_documents(POSITIVES + NEGATIVES))


def test_cores_against_written_out_cross_entropy():
    pos, neg = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    expected = -(log_softmax_at([2.0, 0.0], 0) + log_softmax_at([0.0, 0.0], 0)) / 2
    assert pairwise_ce_loss(pos, neg).item() == pytest.approx(expected, rel=1e-6)
    scores = torch.tensor([[3.0, 1.0, 0.0, 0.5], [0.0, 2.0, 1.0, -1.0]])
    for offset in (0, 1, 2):
        manual = -sum(log_softmax_at(scores[i].tolist(), offset + i) for i in range(2)) / 2
        assert in_batch_ce_loss(scores, offset).item() == pytest.approx(manual, rel=1e-6), offset
    parts = pair_diagnostics(torch.tensor([1.0, 0.0, 3.0]), torch.tensor([0.5, 0.5, 3.0]))
    assert parts["pair_accuracy"].item() == pytest.approx(1 / 3)  # ties do not count as ranked right
    assert parts["score_margin"].item() == pytest.approx((0.5 - 0.5 + 0.0) / 3)


def test_triple_batch_pairs_each_document_with_its_query_and_shares_inter_iso(colbert):
    batch = encode(colbert)
    assert batch.pair_index.tolist() == [0, 1, 2, 0, 1, 2]
    values = batch.inter_iso("colbert")
    q, d = batch.queries, batch.docs
    for k in range(6):
        i = k % 3
        qs = [q.heads["colbert"][i, a] for a in range(q.mask.shape[1]) if q.mask[i, a]]
        ds = [d.heads["colbert"][k, b] for b in range(d.mask.shape[1]) if d.mask[k, b]]
        mean = sum(float(x @ y) for x in qs for y in ds) / (len(qs) * len(ds))
        assert values[k].item() == pytest.approx(mean, abs=1e-5)
    assert batch.inter_iso("colbert") is values  # computed once per step
    with pytest.raises(ValueError, match="positives then negatives"):
        TripleBatch(q, d.select(slice(0, 5)))


def test_pairwise_ce_scores_each_query_against_its_own_pair(colbert):
    with torch.no_grad():
        batch = encode(colbert)
        out = PairwiseCE()(colbert, batch)
    q, d = batch.queries, batch.docs
    positive = [slow_late(q.heads["colbert"][i], q.mask[i], d.heads["colbert"][i], d.mask[i]) for i in range(3)]
    negative = [slow_late(q.heads["colbert"][i], q.mask[i], d.heads["colbert"][3 + i], d.mask[3 + i])
                for i in range(3)]
    expected = -sum(log_softmax_at([p, n], 0) for p, n in zip(positive, negative)) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.parts["loss_late"].item() == pytest.approx(expected, rel=1e-5)
    assert out.parts["pair_accuracy"].item() == pytest.approx(sum(p > n for p, n in zip(positive, negative)) / 3)
    margin = sum(p - n for p, n in zip(positive, negative)) / 3
    assert out.parts["score_margin"].item() == pytest.approx(margin, rel=1e-5, abs=1e-5)


def test_in_batch_ce_scores_each_query_against_every_document(colbert):
    with torch.no_grad():
        batch = encode(colbert)
        out = InBatchCE()(colbert, batch)
        pairwise = PairwiseCE()(colbert, batch)
    q, d = batch.queries, batch.docs
    expected = 0.0
    for i in range(3):
        row = [slow_late(q.heads["colbert"][i], q.mask[i], d.heads["colbert"][j], d.mask[j]) for j in range(6)]
        expected -= log_softmax_at(row, i) / 3  # query i's positive is document i; the 5 others are negatives
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.parts["in_batch_candidates"].item() == 6.0
    for name in ("pair_accuracy", "score_margin"):  # read off the matrix: the same pairs as the pairwise loss
        assert out.parts[name].item() == pytest.approx(pairwise.parts[name].item(), abs=1e-5)


@pytest.fixture
def hil_encoder(hf_tokenizer) -> HILEncoder:
    torch.manual_seed(0)
    encoder = HILEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24, _loaded=(random_bert(), hf_tokenizer))
    encoder.set_idf_from_texts(POSITIVES + NEGATIVES, source="toy")
    return encoder


def test_hil_loss_is_late_terms_plus_lambda_times_switched_regularizers(hil_encoder):
    for reg_l, reg_h in ((True, True), (False, True), (True, False), (False, False)):
        hil_encoder.train()
        batch = encode(hil_encoder)
        out = HILLoss(reg_weight=-0.3, reg_l=reg_l, reg_h=reg_h)(hil_encoder, batch)
        parts = out.parts
        expected = (parts["loss_late_L"] + parts["loss_late_H"]
                    - 0.3 * (parts["loss_reg_L"] * reg_l + parts["loss_reg_H"] * reg_h))
        assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5)
        # reg_H is InterIso_H of the pairs over every scored query token; reg_L is -mean |InterIso_L| over the
        # query tokens of the lexical head (non-zero IDF), per pair
        q, d = batch.paired_queries, batch.docs
        iso_H = inter_iso(q.heads["H"], d.heads["H"], q.mask, d.mask)
        lexical = q.mask & (hil_encoder.query_idf(q) != 0)
        iso_L = inter_iso(q.heads["L"], d.heads["L"], lexical, d.mask)
        assert parts["loss_reg_H"].item() == pytest.approx(iso_H.mean().item(), abs=1e-6)
        assert parts["loss_reg_L"].item() == pytest.approx(-iso_L.abs().mean().item(), abs=1e-6)
        assert parts["delta_inter_iso"].item() == pytest.approx((iso_H.mean() - iso_L.mean()).item(), abs=1e-6)


def test_a_loss_or_regularizer_that_does_not_fit_the_encoder_is_refused(colbert, hil_encoder):
    with pytest.raises(TypeError, match="HILEncoder"):
        HILLoss()(colbert, encode(colbert))
    with pytest.raises(ValueError, match="one-head encoder"):
        RetrieverModule(hil_encoder, HILLoss(), InterIsoRegularizer(0.4))


@pytest.mark.parametrize("regularizer", [None, InterIsoRegularizer(0.4), CosRegRegularizer(-0.1)])
def test_module_adds_the_regularizer_to_the_loss_and_logs_inter_iso_once(colbert, regularizer, monkeypatch):
    module = RetrieverModule(colbert, PairwiseCE(), regularizer)
    module.eval()  # no dropout: the same forward as the reference below
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return inter_iso(*args, **kwargs)

    monkeypatch.setattr(batch_module, "inter_iso", counted)
    loss, parts = module.compute_loss({"queries": QUERIES,
                                       "documents": [list(pair) for pair in zip(POSITIVES, NEGATIVES)]})
    monkeypatch.undo()
    with torch.no_grad():
        batch = encode(colbert)
        late = PairwiseCE()(colbert, batch).loss
        q, d = batch.queries, batch.docs
        expected_reg = 0.0 if regularizer is None else regularizer(q.heads["colbert"], d.heads["colbert"], q.mask,
                                                                   d.mask, batch.pair_index)[0].item()
    assert loss.item() == pytest.approx(late.item() + expected_reg, rel=1e-5, abs=1e-6)
    assert ("loss_reg" in parts) == (regularizer is not None)
    assert parts["inter_iso"].item() == pytest.approx(batch.inter_iso("colbert").mean().item(), abs=1e-6)
    assert len(calls) == 1  # InterIso of the step's pairs is computed once, for the regularizer and the logs


def test_linear_warmup_factor_in_closed_form():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = LinearWarmup(optimizer, warmup_steps=4)
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert seen == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert LinearWarmup(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0), 0).factor(0) == 1.0
    with pytest.raises(ValueError, match="warmup_steps"):
        LinearWarmup(optimizer, -1)
