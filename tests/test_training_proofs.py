"""Training that is proven to learn, and losses that equal references written out by hand (issue 13, section 3).

Each test here was checked by breaking the code it guards and watching it fail:
- positive and negative swapped in ColBERT's or HIL's cross-entropy: the overfitting tests (pair accuracy 1.0 with
  the positive preferred) and the hand-written loss references;
- the module returning the late-interaction loss without the regularizer: ``test_module_loss_is_late_plus_...``;
- HIL's reg_L as |batch mean| instead of the mean of |.| per pair, reg_H under |.|: the crafted mixed-sign test.

References never call the code under test: late interaction, InterIso, z-scores and cross-entropies are loops over
numpy float64 values of the encoded tensors.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from hil.data.datamodule import TrainingDataModule
from hil.data.triples_file import TextTriples
from hil.isotropy.regularizers import CosRegRegularizer, InterIsoRegularizer
from hil.modeling.contracts import EncodedBatch
from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.hil import HILEncoder
from hil.modeling.losses import HILLoss, PairwiseCE, TripleBatch
from hil.modeling.module import RetrieverModule

from conftest import random_bert

TRIPLES = "msmarco/triples.train.small.head1000.tsv"
QUERIES = ["what causes fever", "is coffee bad for sleep", "cats"]
POSITIVES = ["Fever is caused by infection.", "Coffee delays sleep in the evening.", "Cats are small carnivores."]
NEGATIVES = ["Paris is in France.", "The cat sat on the mat.", "Stock markets fell on Monday."]
EPS = 1e-5  # HILEncoder's default zscore_eps


# -- slow references -------------------------------------------------------------------------------------------------
def arr(x: torch.Tensor) -> np.ndarray:
    return x.detach().double().cpu().numpy()


def token_maxsims(q: np.ndarray, q_keep, d: np.ndarray, d_keep) -> list[float]:
    """For each query token kept, max_j q_i . d_j over the document tokens kept (0 with no document token)."""
    out = []
    for i in range(q.shape[0]):
        if q_keep[i]:
            sims = [float(np.dot(q[i], d[j])) for j in range(d.shape[0]) if d_keep[j]]
            out.append(max(sims) if sims else 0.0)
    return out


def slow_late(q, q_keep, d, d_keep) -> float:
    """ColBERT Eq. 1, token by token."""
    return sum(token_maxsims(q, q_keep, d, d_keep))


def slow_inter_iso(q, q_keep, d, d_keep) -> float:
    """HIL Eq. 2: the mean dot product over every (kept query token, kept document token) pair, as a double loop."""
    total, count = 0.0, 0
    for i in range(q.shape[0]):
        for j in range(d.shape[0]):
            if q_keep[i] and d_keep[j]:
                total += float(np.dot(q[i], d[j]))
                count += 1
    return total / count if count else 0.0


def ce_first(logits: list[float]) -> float:
    """-log softmax(logits)[0]: cross-entropy with the first entry (the positive) as the target."""
    top = max(logits)
    return -(logits[0] - top - math.log(sum(math.exp(x - top) for x in logits)))


def pairwise_ce(positive: list[float], negative: list[float]) -> float:
    return sum(ce_first([p, n]) for p, n in zip(positive, negative)) / len(positive)


def pairs_of(batch: TripleBatch):
    """(query row, document row) of each of the 2B pairs: (i, i) then (i, B + i)."""
    n = batch.size
    return [(k % n, k) for k in range(2 * n)]


def slow_colbert_parts(batch: TripleBatch, head: str = "colbert") -> tuple[list[float], list[float], list[float]]:
    """Positive scores, negative scores and InterIso of every pair, by loops."""
    q, d = batch.queries, batch.docs
    qv, dv, qm, dm = arr(q.heads[head]), arr(d.heads[head]), q.mask.numpy(), d.mask.numpy()
    scores = [slow_late(qv[i], qm[i], dv[k], dm[k]) for i, k in pairs_of(batch)]
    iso = [slow_inter_iso(qv[i], qm[i], dv[k], dm[k]) for i, k in pairs_of(batch)]
    n = batch.size
    return scores[:n], scores[n:], iso


def slow_hil_loss(encoder: HILEncoder, batch: TripleBatch, reg_weight: float, training: bool) -> dict[str, float]:
    """ColBERT-HIL's loss (HIL Sec. 3.3, the paper's recipe, this package's defaults) written out by hand:

    S_L(q_i, d) = idf(q_i) max_j L_qi . L_dj over the query tokens with idf != 0, S_H(q_i, d) = max_j H_qi . H_dj;
    each head z-scored with the mean / sqrt(population variance + eps) of all its S over the 2B pairs (training)
    or the running estimates (eval); score_late = sum_i S'; CE with the positive as target per head;
    reg_L = -mean_pairs |InterIso_L|, reg_H = mean_pairs InterIso_H; loss = CE_L + CE_H + lambda (reg_L + reg_H).
    """
    q, d = batch.queries, batch.docs
    qm, dm = q.mask.numpy(), d.mask.numpy()
    idf = encoder.idf.detach().double().numpy()[q.input_ids.numpy()]  # (B, Lq)
    keep = {"L": qm & (idf != 0), "H": qm}
    n = batch.size
    token_scores: dict[str, list[list[float]]] = {}
    for head in ("L", "H"):
        qv, dv = arr(q.heads[head]), arr(d.heads[head])
        rows = []
        for i, k in pairs_of(batch):
            best = token_maxsims(qv[i], keep[head][i], dv[k], dm[k])
            weights = [idf[i, a] for a in range(qv.shape[1]) if keep[head][i][a]] if head == "L" else [1.0] * len(best)
            rows.append([w * s for w, s in zip(weights, best)])
        token_scores[head] = rows
    out: dict[str, float] = {}
    for head in ("L", "H"):
        flat = [s for row in token_scores[head] for s in row]
        if training:
            mean = sum(flat) / len(flat)
            std = math.sqrt(sum((s - mean) ** 2 for s in flat) / len(flat) + EPS)
        else:
            mean, std = float(encoder.zscore[head].mean), float(encoder.zscore[head].std)
        late = [sum((s - mean) / std for s in row) for row in token_scores[head]]
        out[f"loss_late_{head}"] = pairwise_ce(late[:n], late[n:])
        out[f"late_{head}"] = late
        qv, dv = arr(q.heads[head]), arr(d.heads[head])
        out[f"iso_{head}"] = [slow_inter_iso(qv[i], keep[head][i], dv[k], dm[k]) for i, k in pairs_of(batch)]
    out["loss_reg_L"] = -sum(abs(x) for x in out["iso_L"]) / (2 * n)
    out["loss_reg_H"] = sum(out["iso_H"]) / (2 * n)
    out["loss"] = (out["loss_late_L"] + out["loss_late_H"] + reg_weight * (out["loss_reg_L"] + out["loss_reg_H"]))
    return out


# -- 1. overfitting a handful of triples: the positive ends up preferred ---------------------------------------------
def pair_margins(encoder, triples) -> np.ndarray:
    """score(q, d+) - score(q, d-) of every triple, in eval mode."""
    encoder.eval()
    with torch.no_grad():
        queries = encoder.encode_queries([t.query for t in triples])
        positive = encoder.score_pairs(queries, encoder.encode_documents([t.positive for t in triples]))
        negative = encoder.score_pairs(queries, encoder.encode_documents([t.negative for t in triples]))
    return (positive - negative).numpy()


@pytest.mark.integration
@pytest.mark.parametrize("architecture", ["colbert", "hil"])
def test_overfitting_a_handful_of_triples_prefers_every_positive(shared_dir, tmp_path, one_thread, architecture):
    torch.manual_seed(0)
    settings = {"dim": 32, "query_maxlen": 16, "doc_maxlen": 48}
    if architecture == "colbert":
        encoder, loss = ColBERTEncoder("bert-tiny-splade", **settings), PairwiseCE()
    else:
        encoder, loss = HILEncoder("bert-tiny-splade", **settings), HILLoss()
    module = RetrieverModule(encoder, loss, optimizer=partial(torch.optim.AdamW, lr=1e-3))
    data = TrainingDataModule(TextTriples(TRIPLES), max_triples=6, batch_size=6, shuffle=False)
    data.setup("fit")
    triples = data.train_dataset.triples
    trainer = pl.Trainer(max_steps=20, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    if architecture == "hil":  # the untrained model, with the IDF training will use, for the "before" margins
        encoder.set_idf_from_texts(*data.idf_documents())
    before = pair_margins(encoder, triples)
    trainer.fit(module, data)
    after = pair_margins(encoder, triples)
    # every triple ranks its positive above its negative, by a clear margin, and better than before training
    assert (after > 0).all(), (before, after)
    assert after.min() > 1.0 and after.mean() > before.mean() + 1.0, (before, after)
    assert float(trainer.callback_metrics["train/pair_accuracy"]) == 1.0


# -- 1. the loss values against hand-written cross-entropies --------------------------------------------------------
@pytest.fixture
def colbert(hf_tokenizer) -> ColBERTEncoder:
    torch.manual_seed(0)
    return ColBERTEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24,
                          _loaded=(random_bert(), hf_tokenizer)).eval()


@pytest.fixture
def hil_encoder(hf_tokenizer) -> HILEncoder:
    torch.manual_seed(0)
    encoder = HILEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24, _loaded=(random_bert(), hf_tokenizer))
    encoder.set_idf_from_texts(POSITIVES + NEGATIVES + ["the the the", "sleep well"], source="toy")
    return encoder


def encode(encoder, queries=QUERIES, positives=POSITIVES, negatives=NEGATIVES) -> TripleBatch:
    with torch.no_grad():
        return TripleBatch(encoder.encode_queries(queries), encoder.encode_documents(positives + negatives))


def test_pairwise_ce_equals_log_softmax_with_the_positive_as_target(colbert):
    batch = encode(colbert)
    positive, negative, _ = slow_colbert_parts(batch)
    out = PairwiseCE()(colbert, batch)
    assert out.loss.item() == pytest.approx(pairwise_ce(positive, negative), rel=1e-5)
    assert out.parts["pair_accuracy"].item() == pytest.approx(np.mean([p > n for p, n in zip(positive, negative)]))
    # swapping the documents' roles gives the other loss: the loss knows which one is the positive
    swapped = TripleBatch(batch.queries, batch.docs.select(torch.tensor([3, 4, 5, 0, 1, 2])))
    assert PairwiseCE()(colbert, swapped).loss.item() == pytest.approx(pairwise_ce(negative, positive), rel=1e-5)
    assert abs(pairwise_ce(negative, positive) - pairwise_ce(positive, negative)) > 1e-3


@pytest.mark.parametrize("training", [True, False])
def test_hil_loss_equals_a_hand_written_reference(hil_encoder, training):
    hil_encoder.train(training)
    if not training:  # non-trivial running estimates for eval mode
        with torch.no_grad():
            hil_encoder.zscore["L"].update(torch.tensor(0.3), torch.tensor(0.8))
            hil_encoder.zscore["H"].update(torch.tensor(0.5), torch.tensor(0.25))
    batch = encode(hil_encoder)
    reference = slow_hil_loss(hil_encoder, batch, reg_weight=-0.3, training=training)
    out = HILLoss(reg_weight=-0.3)(hil_encoder, batch)
    for name in ("loss_late_L", "loss_late_H", "loss_reg_L", "loss_reg_H"):
        assert out.parts[name].item() == pytest.approx(reference[name], rel=1e-4, abs=1e-5), name
    assert out.loss.item() == pytest.approx(reference["loss"], rel=1e-4, abs=1e-5)
    n = batch.size
    total = [a + b for a, b in zip(reference["late_L"], reference["late_H"])]
    assert out.parts["pair_accuracy"].item() == pytest.approx(np.mean([total[i] > total[n + i] for i in range(n)]))
    # the positive is the target of both heads' CE: the same batch with the documents' roles swapped
    swapped = TripleBatch(batch.queries, batch.docs.select(torch.tensor([3, 4, 5, 0, 1, 2])))
    flipped = HILLoss(reg_weight=-0.3)(hil_encoder, swapped)
    for head in ("L", "H"):
        late = reference[f"late_{head}"]
        assert flipped.parts[f"loss_late_{head}"].item() == pytest.approx(pairwise_ce(late[n:], late[:n]),
                                                                            rel=1e-4, abs=1e-5)


# -- 2. the module's loss is late + lambda * reg -------------------------------------------------------------------
@pytest.mark.parametrize("regularizer, form", [
    (InterIsoRegularizer(0.4), "abs"),        # ColBERT-iso: lambda |InterIso| per pair
    (InterIsoRegularizer(-0.1), "signed"),    # ColBERT-aniso: lambda InterIso
    (CosRegRegularizer(0.2), "cosreg"),
])
def test_module_loss_is_late_plus_lambda_times_an_independent_regularizer(colbert, regularizer, form):
    module = RetrieverModule(colbert, PairwiseCE(), regularizer)
    module.eval()  # no dropout: the encoding below is the module's
    batch = {"queries": QUERIES, "documents": [list(pair) for pair in zip(POSITIVES, NEGATIVES)]}
    loss, parts = module.compute_loss(batch)
    triples = encode(colbert)
    positive, negative, iso = slow_colbert_parts(triples)
    if form == "abs":
        reg = sum(abs(x) for x in iso) / len(iso)
    elif form == "signed":
        reg = sum(iso) / len(iso)
    else:  # CosReg (HIL A.1): 1 / M^2 sum_{i != j} cos over each side's valid tokens, averaged over the two sides
        sides = []
        for encoded in (triples.queries, triples.docs):
            points = arr(encoded.heads["colbert"])[encoded.mask.numpy()]
            unit = points / np.linalg.norm(points, axis=1, keepdims=True)
            m = len(unit)
            sides.append(sum(float(unit[i] @ unit[j]) for i in range(m) for j in range(m) if i != j) / m ** 2)
        reg = sum(sides) / 2
    late = pairwise_ce(positive, negative)
    expected = late + regularizer.weight * reg
    assert abs(regularizer.weight * reg) > 1e-3  # the term matters at this tolerance
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert parts["loss_late"].item() == pytest.approx(late, rel=1e-5)
    assert parts["loss_reg"].item() == pytest.approx(regularizer.weight * reg, rel=1e-4, abs=1e-6)
    assert parts["inter_iso"].item() == pytest.approx(sum(iso) / len(iso), abs=1e-5)
    # and what a training step returns (and so what is backpropagated) is that same total
    step_loss = module.training_step(batch, 0)
    assert step_loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert step_loss.requires_grad


# -- 3. HIL's regularizers per pair, with InterIso values of both signs ---------------------------------------------
def unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm(dim=-1, keepdim=True)


def crafted_triples(dim: int = 4) -> TripleBatch:
    """Two triples (4 pairs) whose InterIso_L values have opposite signs and whose InterIso_H are all negative.

    Queries: L tokens along e0, H tokens along e2 (3 and 2 valid tokens). Documents of pair k: L tokens
    normalize(c_k e0 + e1) with c = (2, -3, 0.5, -0.25) -> InterIso_L = c_k / sqrt(c_k^2 + 1), mixed signs;
    H tokens normalize(-a_k e2 + e3) plus one token on e3 -> InterIso_H < 0.
    """
    e = torch.eye(dim)
    lq, ld = 3, 4
    q_mask = torch.tensor([[True, True, True], [True, True, False]])
    d_mask = torch.tensor([[True, True, True, False], [True, True, False, False],
                           [True, True, True, True], [True, False, False, False]])
    q_L = e[0].expand(2, lq, dim).clone()
    q_H = unit(e[2] + 0.3 * e[1]).expand(2, lq, dim).clone()
    q_H[1, 1] = unit(e[2] - 0.5 * e[0])
    c = [2.0, -3.0, 0.5, -0.25]
    a = [1.0, 2.0, 0.4, 3.0]
    d_L = torch.stack([unit(ck * e[0] + e[1]).expand(ld, dim) for ck in c]).clone()
    d_L[2, 3] = unit(-e[0] + 0.1 * e[3])  # one token pulling the other way
    d_H = torch.stack([unit(-ak * e[2] + e[3]).expand(ld, dim) for ak in a]).clone()
    d_H[:, 1] = e[3]
    q_ids = torch.tensor([[2000, 2001, 2002], [2003, 2004, 0]])
    d_ids = torch.arange(3000, 3000 + 4 * ld).reshape(4, ld)
    queries = EncodedBatch({"L": q_L * q_mask[..., None], "H": q_H * q_mask[..., None]}, q_mask, q_ids)
    docs = EncodedBatch({"L": d_L * d_mask[..., None], "H": d_H * d_mask[..., None]}, d_mask, d_ids)
    return TripleBatch(queries, docs)


def test_hil_regularizers_are_taken_per_pair_with_mixed_signs(hf_tokenizer):
    torch.manual_seed(0)
    encoder = HILEncoder("random-bert", dim=4, query_maxlen=12, doc_maxlen=24,
                         _loaded=(random_bert(), hf_tokenizer)).train()
    with torch.no_grad():  # IDF weights of the crafted query tokens: one of them 0 (left out of the lexical head)
        encoder.idf.fill_(1.0)
        encoder.idf[2000], encoder.idf[2001], encoder.idf[2003] = 2.0, 0.0, 0.5
        encoder.idf_documents.fill_(10)
    batch = crafted_triples()
    reference = slow_hil_loss(encoder, batch, reg_weight=-0.3, training=True)
    iso_L, iso_H = reference["iso_L"], reference["iso_H"]
    # the construction: InterIso_L of both signs (so |mean| < mean |.|), InterIso_H all negative
    assert min(iso_L) < -0.5 and max(iso_L) > 0.5
    assert abs(sum(iso_L)) / 4 < sum(abs(x) for x in iso_L) / 4 - 0.3
    assert max(iso_H) < -0.1
    for reg_l, reg_h in ((True, True), (True, False), (False, True)):
        out = HILLoss(reg_weight=-0.3, reg_l=reg_l, reg_h=reg_h)(encoder, batch)
        assert out.parts["loss_reg_L"].item() == pytest.approx(reference["loss_reg_L"], abs=1e-6)
        assert out.parts["loss_reg_H"].item() == pytest.approx(reference["loss_reg_H"], abs=1e-6)
        expected = (reference["loss_late_L"] + reference["loss_late_H"]
                    - 0.3 * (reference["loss_reg_L"] * reg_l + reference["loss_reg_H"] * reg_h))
        assert out.loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6), (reg_l, reg_h)
        assert out.parts["inter_iso_L"].item() == pytest.approx(sum(iso_L) / 4, abs=1e-6)
        assert out.parts["inter_iso_H"].item() == pytest.approx(sum(iso_H) / 4, abs=1e-6)
