"""ColBERT-HIL: scoring math against slow loops, batch independence, running statistics, training, export."""

from __future__ import annotations

import math
from functools import partial

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hil.data.datamodule import TrainingDataModule
from hil.data.idf import IDFTable
from hil.data.triples_file import TextTriples
from hil.modeling.contracts import EncodedBatch
from hil.modeling.hil import HILEncoder, RunningMoments
from hil.modeling.hil_scoring import (
    batch_moments,
    hil_token_scores,
    lexical_query_mask,
    zscore,
    zscored_late_interaction,
)
from hil.modeling.loading import load_encoder
from hil.modeling.losses import HILLoss
from hil.modeling.module import RetrieverModule

from conftest import random_bert

TRIPLES = "msmarco/triples.train.small.head1000.tsv"
QUERIES = ["what causes fever", "effects of caffeine on sleep", "cat"]
DOCS = ["Fever is caused by infection.", "Caffeine is a stimulant, found in coffee; it delays sleep.", "",
        "Cats are small domesticated carnivores that sleep a lot and sometimes catch a fever."]


# -- pure functions against slow loops --------------------------------------------------------------------------

def unit(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=generator, dtype=torch.float64), dim=-1)


def slow_token_scores(qL, dL, qH, dH, idf, doc_mask):
    """S_L[i] = idf[i] * max_j qL_i . dL_j and S_H[i] = max_j qH_i . dH_j over valid document tokens (0 if none)."""
    s_L = torch.zeros(qL.shape[0])
    s_H = torch.zeros(qL.shape[0])
    valid = [j for j in range(dL.shape[0]) if doc_mask[j]]
    for i in range(qL.shape[0]):
        if valid:
            s_L[i] = idf[i] * max(float(qL[i] @ dL[j]) for j in valid)
            s_H[i] = max(float(qH[i] @ dH[j]) for j in valid)
    return s_L, s_H


@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 5), st.integers(1, 6), st.integers(0, 10_000))
@settings(max_examples=15, deadline=None)
def test_token_scores_match_slow_loops(bq, bd, lq, ld, seed):
    qL, qH = unit(bq, lq, 4, seed=seed), unit(bq, lq, 4, seed=seed + 1)
    dL, dH = unit(bd, ld, 4, seed=seed + 2), unit(bd, ld, 4, seed=seed + 3)
    generator = torch.Generator().manual_seed(seed)
    idf = torch.rand(bq, lq, generator=generator, dtype=torch.float64) * 3
    doc_mask = torch.rand(bd, ld, generator=generator) > 0.3
    s_L, s_H = hil_token_scores(qL, dL, qH, dH, idf, doc_mask, all_pairs=True)  # (Bq, Bd, Lq)
    assert s_L.shape == s_H.shape == (bq, bd, lq)
    for a in range(bq):
        for b in range(bd):
            ref_L, ref_H = slow_token_scores(qL[a], dL[b], qH[a], dH[b], idf[a], doc_mask[b])
            torch.testing.assert_close(s_L[a, b].float(), ref_L, atol=1e-6, rtol=0)
            torch.testing.assert_close(s_H[a, b].float(), ref_H, atol=1e-6, rtol=0)
    n = min(bq, bd)
    p_L, p_H = hil_token_scores(qL[:n], dL[:n], qH[:n], dH[:n], idf[:n], doc_mask[:n], all_pairs=False)
    for k in range(n):
        torch.testing.assert_close(p_L[k], s_L[k, k])
        torch.testing.assert_close(p_H[k], s_H[k, k])


@given(st.lists(st.floats(-5, 5), min_size=1, max_size=30), st.integers(0, 1000))
@settings(max_examples=25, deadline=None)
def test_batch_moments_and_zscore_match_slow_formulas(values, seed):
    x = torch.tensor(values, dtype=torch.float64)
    mask = torch.rand(len(values), generator=torch.Generator().manual_seed(seed)) > 0.4
    mean, std = batch_moments(x, mask, eps=1e-5)
    chosen = [v for v, keep in zip(values, mask.tolist()) if keep]
    if chosen:
        ref_mean = sum(chosen) / len(chosen)
        ref_var = sum((v - ref_mean) ** 2 for v in chosen) / len(chosen)  # population variance
    else:
        ref_mean, ref_var = 0.0, 0.0
    assert mean.item() == pytest.approx(ref_mean, abs=1e-9)
    assert std.item() == pytest.approx(math.sqrt(ref_var + 1e-5), rel=1e-9)
    z = zscore(x, mean, std)
    for v, zv in zip(values, z.tolist()):
        assert zv == pytest.approx((v - ref_mean) / math.sqrt(ref_var + 1e-5), rel=1e-9, abs=1e-9)


def test_zscored_late_interaction_sums_masked_tokens():
    scores = torch.tensor([[[1.0, 2.0, 3.0], [0.5, 0.0, -1.0]]])  # (Bq=1, Bd=2, Lq=3)
    mask = torch.tensor([[True, False, True]])
    out = zscored_late_interaction(scores, mask, torch.tensor(1.0), torch.tensor(2.0))
    assert out.shape == (1, 2)
    torch.testing.assert_close(out, torch.tensor([[(0 + 2) / 2.0, (-0.5 - 2) / 2.0]]))
    paired = zscored_late_interaction(scores[0], mask.expand(2, 3), 1.0, 2.0)  # (B=2, Lq) with (B, Lq) mask
    torch.testing.assert_close(paired, out[0])
    # a zero std is floored at eps instead of dividing by zero
    assert torch.isfinite(zscore(scores, 0.0, torch.tensor(0.0))).all()


def test_moments_of_one_value_or_a_constant_are_finite_with_finite_gradients():
    for x in (torch.tensor([0.7], requires_grad=True), torch.full((5,), 0.3, requires_grad=True)):
        mean, std = batch_moments(x, eps=1e-5)
        assert std.item() == pytest.approx(math.sqrt(1e-5))
        z = zscore(x, mean, std)
        assert torch.equal(z.detach(), torch.zeros_like(x))
        z.sum().backward()
        assert torch.isfinite(x.grad).all()
    empty_mean, empty_std = batch_moments(torch.ones(3), torch.zeros(3, dtype=torch.bool))
    assert empty_mean.item() == 0.0 and math.isfinite(empty_std.item())


def test_lexical_mask_drops_zero_weight_tokens():
    mask = torch.tensor([[True, True, True, False]])
    idf = torch.tensor([[0.0, 1.5, 0.0, 2.0]])
    assert lexical_query_mask(mask, idf).tolist() == [[False, True, False, False]]


def test_running_moments_copy_first_then_average_and_ignore_nan():
    stats = RunningMoments(momentum=0.25)
    assert stats.mean.item() == 0.0 and stats.std.item() == 1.0
    stats.update(torch.tensor(2.0), torch.tensor(4.0))
    assert (stats.mean.item(), stats.std.item(), int(stats.updates)) == (2.0, 4.0, 1)
    stats.update(torch.tensor(6.0), torch.tensor(8.0))
    assert stats.mean.item() == pytest.approx(0.75 * 2 + 0.25 * 6)
    assert stats.std.item() == pytest.approx(0.75 * 4 + 0.25 * 8)
    stats.update(torch.tensor(float("nan")), torch.tensor(1.0))
    assert stats.mean.item() == pytest.approx(3.0) and int(stats.updates) == 2
    with pytest.raises(ValueError, match="zscore_momentum"):
        RunningMoments(0.0)


# -- the encoder (random 1-layer BERT, real vocabulary) -------------------------------------------------------------

@pytest.fixture
def encoder(hf_tokenizer) -> HILEncoder:
    torch.manual_seed(0)
    model = HILEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24, zscore_momentum=0.5,
                       _loaded=(random_bert(), hf_tokenizer))
    model.set_idf_from_texts(DOCS + ["the the the", "sleep well"], source="toy corpus")
    with torch.no_grad():  # non-trivial running statistics
        model.zscore["L"].update(torch.tensor(0.4), torch.tensor(0.7))
        model.zscore["H"].update(torch.tensor(0.6), torch.tensor(0.2))
    return model.eval()


def test_heads_are_normalized_and_L_depends_on_the_token_only(encoder, hf_tokenizer):
    with torch.no_grad():
        docs = encoder.encode_documents(["fever fever", "a fever came after the long trip"])
    assert set(docs.heads) == {"L", "H"}
    for head in ("L", "H"):
        norms = docs.heads[head].norm(dim=-1)[docs.mask]
        torch.testing.assert_close(norms, torch.ones_like(norms))
    fever = hf_tokenizer.convert_tokens_to_ids("fever")
    rows = (docs.input_ids == fever).nonzero().tolist()
    vectors_L = torch.stack([docs.heads["L"][i, j] for i, j in rows])
    vectors_H = torch.stack([docs.heads["H"][i, j] for i, j in rows])
    assert len(rows) == 3
    torch.testing.assert_close(vectors_L, vectors_L[:1].expand_as(vectors_L))  # same token, same L vector
    assert not torch.allclose(vectors_H[0], vectors_H[2])                      # H is contextual


def test_idf_buffer_weights_special_tokens_zero(encoder, hf_tokenizer):
    table = IDFTable.from_texts(encoder.tokenizer, DOCS + ["the the the", "sleep well"])
    torch.testing.assert_close(encoder.idf, table.to_tensor(encoder.vocab_size))
    assert encoder.has_idf and int(encoder.idf_documents) == len(DOCS) + 2
    queries = encoder.encode_queries(["fever"])
    idf = encoder.query_idf(queries)[0]
    ids = queries.input_ids[0].tolist()
    mask_id = hf_tokenizer.mask_token_id
    assert ids.count(mask_id) == 12 - 4
    for token, weight in zip(ids, idf.tolist()):
        if token in (hf_tokenizer.cls_token_id, hf_tokenizer.sep_token_id, mask_id, encoder.tokenizer.query_marker_id):
            assert weight == 0.0
        else:
            assert weight > 0
    assert "toy corpus" in encoder.settings()["idf_source"]


def slow_score(encoder: HILEncoder, q: EncodedBatch, d: EncodedBatch, a: int, b: int) -> float:
    """score_late_L + score_late_H of query a and document b, written out token by token."""
    total = 0.0
    for head in ("L", "H"):
        mean, std = (float(v) for v in encoder.running_moments(head))
        for i in range(q.mask.shape[1]):
            weight = float(encoder.idf[q.input_ids[a, i]]) if head == "L" else 1.0
            if not q.mask[a, i] or weight == 0.0:
                continue
            sims = [float(q.heads[head][a, i] @ d.heads[head][b, j]) for j in range(d.mask.shape[1]) if d.mask[b, j]]
            s = weight * max(sims) if sims else 0.0
            total += (s - mean) / std
    return total


def test_score_matches_a_slow_reference_and_score_pairs(encoder):
    with torch.no_grad():
        q, d = encoder.encode_queries(QUERIES), encoder.encode_documents(DOCS)
        scores = encoder.score(q, d)
        assert scores.shape == (len(QUERIES), len(DOCS))
        for a in range(len(QUERIES)):
            for b in range(len(DOCS)):
                assert scores[a, b].item() == pytest.approx(slow_score(encoder, q, d, a, b), rel=1e-4, abs=1e-4)
        index = torch.tensor([0, 1, 2, 0])
        pairs = encoder.score_pairs(q.select(index), d)
        torch.testing.assert_close(pairs, scores[index, torch.arange(4)])
        heads = encoder.score_heads(q, d)
        torch.testing.assert_close(heads["L"] + heads["H"], scores)


def test_eval_scores_do_not_depend_on_the_batch(encoder):
    before = {k: v.clone() for k, v in encoder.state_dict().items() if k.startswith("zscore")}
    with torch.no_grad():
        q = encoder.encode_queries(QUERIES)
        together = encoder.score(q, encoder.encode_documents(DOCS))
        for b, text in enumerate(DOCS):
            alone = encoder.score(q, encoder.encode_documents([text]))[:, 0]
            torch.testing.assert_close(alone, together[:, b], rtol=1e-5, atol=1e-5)
        one_query = encoder.score(encoder.encode_queries(QUERIES[:1]), encoder.encode_documents(DOCS))
        torch.testing.assert_close(one_query[0], together[0], rtol=1e-5, atol=1e-5)
        # the training path in eval mode uses the running statistics too
        docs = encoder.encode_documents(DOCS[:3])
        late, _ = encoder.training_pair_scores(q, docs, torch.arange(3))
        torch.testing.assert_close(late["L"] + late["H"], together[torch.arange(3), torch.arange(3)],
                                   rtol=1e-5, atol=1e-5)
    after = {k: v for k, v in encoder.state_dict().items() if k.startswith("zscore")}
    assert all(torch.equal(before[k], after[k]) for k in before), "eval scoring must not touch running statistics"


def test_training_path_uses_batch_moments_and_updates_running_ones(encoder):
    encoder.train()
    q, d = encoder.encode_queries(QUERIES[:2]), encoder.encode_documents(DOCS[:2] + DOCS[2:4])
    pair_index = torch.arange(2).repeat(2)
    late, masks = encoder.training_pair_scores(q, d, pair_index)
    tokens, _ = encoder.token_scores(q.select(pair_index), d, all_pairs=False)
    for head in ("L", "H"):
        mean, std = batch_moments(tokens[head], masks[head])
        torch.testing.assert_close(late[head], zscored_late_interaction(tokens[head], masks[head], mean, std))
        # momentum 0.5 from the fixture's values
        old_mean = {"L": 0.4, "H": 0.6}[head]
        assert encoder.zscore[head].mean.item() == pytest.approx(0.5 * old_mean + 0.5 * mean.item(), rel=1e-5)
        assert int(encoder.zscore[head].updates) == 2
    (late["L"] + late["H"]).sum().backward()
    assert encoder.linear_L.weight.grad is not None and torch.isfinite(encoder.linear_L.weight.grad).all()


def test_batch_of_one_and_constant_scores_give_no_nan(encoder, hf_tokenizer):
    encoder.train()
    for texts in (["fever"], ["fever fever"]):  # one pair; a document that matches every query token the same way
        q, d = encoder.encode_queries(["fever"]), encoder.encode_documents(texts)
        late, _ = encoder.training_pair_scores(q, d, torch.zeros(1, dtype=torch.long))
        for head in ("L", "H"):
            assert torch.isfinite(late[head]).all()
        (late["L"] + late["H"]).sum().backward()
        grads = [p.grad for p in encoder.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
    # the lexical head of a one-token query against one document is a single value: std = sqrt(eps), z = 0
    assert late["L"].abs().max().item() == 0.0


def test_state_dict_holds_buffers_and_export_roundtrip(encoder, tmp_path):
    state = encoder.state_dict()
    for key in ("idf", "idf_documents", "zscore.L.mean", "zscore.L.std", "zscore.H.mean", "zscore.H.std",
                "zscore.L.updates", "linear_L.weight", "linear_H.weight"):
        assert key in state
    encoder.save_pretrained(tmp_path / "export")
    loaded = load_encoder(tmp_path / "export")
    assert isinstance(loaded, HILEncoder) and not loaded.training
    for key in ("idf", "idf_documents", "zscore.L.mean", "zscore.H.std"):
        assert torch.equal(loaded.state_dict()[key], state[key])
    assert loaded.settings() == {**encoder.settings(), "backbone": str(tmp_path / "export")}
    with torch.no_grad():
        before = encoder.score(encoder.encode_queries(QUERIES), encoder.encode_documents(DOCS))
        after = loaded.score(loaded.encode_queries(QUERIES), loaded.encode_documents(DOCS))
    torch.testing.assert_close(before, after, rtol=0, atol=0)


def test_search_over_an_index_scores_like_the_encoder(encoder, tmp_path):
    from hil.retrieval.builder import build_index
    from hil.retrieval.search import exact_rank, rerank

    doc_ids = [f"d{i}" for i in range(len(DOCS))]
    index = build_index(encoder, doc_ids, DOCS, tmp_path / "index", progress=False)
    assert set(index.head_names) == {"L", "H"}
    queries = {f"q{i}": text for i, text in enumerate(QUERIES)}
    exact = exact_rank(encoder, index, queries, k=10, progress=False)
    on_the_fly = rerank(encoder, None, queries, {qid: doc_ids for qid in queries}, dict(zip(doc_ids, DOCS)), k=10,
                        progress=False)
    with torch.no_grad():
        reference = encoder.score(encoder.encode_queries(QUERIES), encoder.encode_documents(DOCS))
    for i, qid in enumerate(queries):
        for doc, score in on_the_fly.run[qid].items():  # fp32 vectors: the same numbers
            assert score == pytest.approx(reference[i, doc_ids.index(doc)].item(), rel=1e-4, abs=1e-4)
        for doc, score in exact.run[qid].items():       # fp16 index vectors
            assert score == pytest.approx(reference[i, doc_ids.index(doc)].item(), rel=1e-2, abs=5e-2)


# -- the LightningModule with the shared tiny model --------------------------------------------------------------

pytest_integration = pytest.mark.integration


def hil_module(**encoder_settings) -> RetrieverModule:
    encoder = HILEncoder(backbone="bert-tiny-splade", **{"dim": 16, "query_maxlen": 12, "doc_maxlen": 24,
                                                         **encoder_settings})
    return RetrieverModule(encoder, HILLoss(), optimizer=partial(torch.optim.AdamW, lr=1e-3))


@pytest_integration
def test_training_lowers_the_loss_computes_idf_and_logs_delta_interiso(shared_dir, tmp_path):
    pl.seed_everything(0)
    model = hil_module(dim=32, query_maxlen=16, doc_maxlen=40)
    data = TrainingDataModule(TextTriples(TRIPLES), max_triples=4, batch_size=4, shuffle=False)
    logged: list[dict[str, float]] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    steps = 6
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[Record()], default_root_dir=tmp_path)
    trainer.fit(model, data)
    assert len(logged) == steps
    for key in ("loss", "loss_late_L", "loss_late_H", "loss_reg_L", "loss_reg_H", "inter_iso_L", "inter_iso_H",
                "delta_inter_iso", "zscore_mean_L", "zscore_std_L", "zscore_mean_H", "zscore_std_H"):
        assert f"train/{key}" in logged[-1], key
    # the regularizer can make the total negative, so compare the late-interaction part and the total separately
    late = [step["train/loss_late_L"] + step["train/loss_late_H"] for step in logged]
    assert late[-1] < 0.5 * late[0], late
    assert logged[-1]["train/loss"] < logged[0]["train/loss"]
    # lambda < 0 widens the isotropy gap between the heads
    assert logged[-1]["train/delta_inter_iso"] > logged[0]["train/delta_inter_iso"]
    final = logged[-1]
    assert final["train/delta_inter_iso"] == pytest.approx(final["train/inter_iso_H"] - final["train/inter_iso_L"],
                                                           abs=1e-5)
    # IDF came from the distinct passages of the 4 training triples (data.idf_source: train) and is in the model
    passages = {text for t in data.train_dataset.triples for text in (t.positive, t.negative)}
    assert int(model.encoder.idf_documents) == len(passages)
    assert "training triples" in model.encoder.idf_source
    assert int(model.encoder.zscore["H"].updates) == steps
    assert final["train/zscore_std_H"] == pytest.approx(model.encoder.zscore["H"].std.item(), rel=1e-5)


@pytest_integration
def test_idf_sources_and_checkpoint_roundtrip(shared_dir, tmp_path):
    data = TrainingDataModule(TextTriples(TRIPLES), idf_source=TRIPLES, idf_max_docs=30)
    texts, label = data.idf_documents()
    assert len(texts) == 30 and len(set(texts)) == 30 and "triples" in label
    texts, label = TrainingDataModule(TextTriples(TRIPLES), idf_source="scifact", idf_max_docs=30).idf_documents()
    assert len(texts) == 30 and "scifact" in label
    with pytest.raises(FileNotFoundError, match="idf_source"):
        TrainingDataModule(TextTriples(TRIPLES), idf_source="no-such-dataset-anywhere/x/y").idf_documents()
    assert TrainingDataModule(TextTriples(TRIPLES), idf_source="none").idf_documents() is None
    with pytest.raises(ValueError, match="setup"):  # "train" needs the triples loaded
        TrainingDataModule(TextTriples(TRIPLES)).idf_documents()

    def fit_no_steps(module: RetrieverModule, data: TrainingDataModule) -> pl.Trainer:
        trainer = pl.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             default_root_dir=tmp_path)
        trainer.fit(module, data)  # runs setup("fit"): IDF from the data module when the encoder needs one
        return trainer

    model = hil_module()
    trainer = fit_no_steps(model, TrainingDataModule(TextTriples(TRIPLES), max_triples=4, idf_source="none"))
    assert not model.encoder.has_idf and torch.equal(model.encoder.idf, torch.ones_like(model.encoder.idf))

    model.encoder.set_idf_from_texts(DOCS, source="toy")
    model.encoder.zscore["L"].update(torch.tensor(0.3), torch.tensor(0.9))
    trainer.save_checkpoint(tmp_path / "hil.ckpt")
    loaded = load_encoder(tmp_path / "hil.ckpt")
    assert torch.equal(loaded.idf, model.encoder.idf) and loaded.zscore["L"].std.item() == pytest.approx(0.9)
    model.encoder.eval()
    with torch.no_grad():
        before = model.encoder.score(model.encoder.encode_queries(QUERIES), model.encoder.encode_documents(DOCS))
        after = loaded.score(loaded.encode_queries(QUERIES), loaded.encode_documents(DOCS))
    torch.testing.assert_close(before, after, rtol=0, atol=0)
    # init_from keeps the source's IDF: setup does not recompute it, whatever the data module names
    tuned = RetrieverModule(HILEncoder(backbone="bert-tiny-splade", dim=16, query_maxlen=12, doc_maxlen=24),
                            HILLoss(), init_from=str(tmp_path / "hil.ckpt"))
    fit_no_steps(tuned, TrainingDataModule(TextTriples(TRIPLES), max_triples=4))
    assert torch.equal(tuned.encoder.idf, model.encoder.idf)
    fresh = hil_module()
    fit_no_steps(fresh, TrainingDataModule(TextTriples(TRIPLES), max_triples=4))  # idf_source: train (the default)
    assert fresh.encoder.has_idf and "training triples" in fresh.encoder.idf_source
