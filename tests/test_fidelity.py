"""Issue 13's named settings: ColBERT v1's conventions and the HIL authors' released code, each checked against an
independent reference (the backbone run by hand, the authors' formulas written out in the test, slow loops)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hil.data.idf import AUTHORS_FORMULA, IDFTable
from hil.isotropy.regularizers import (
    ConditionalIsotropyRegularizer,
    authors_hil_reg,
    conditional_isotropy,
    mean_token_dot,
)
from hil.modeling.encoder import ColBERTEncoder, upgrade_settings
from hil.modeling.hil import HILEncoder
from hil.modeling.hil_scoring import batch_moments, per_query_moments, zscore_from_sums
from hil.modeling.losses import HILAuthorsLoss, TripleBatch
from hil.retrieval.encoding import encode_document_tokens
from hil.retrieval.search import score_documents

from conftest import random_bert

QUERIES = ["what is sleep", "how do cells divide in the body", "sleep"]
DOCS = ["sleep is a state of rest.", "cells divide by mitosis, a process of the body.", "a body at rest",
        "mitosis and meiosis", "the state of the art in sleep research"]


def hil_encoder(tokenizer, seed: int = 0, **settings) -> HILEncoder:
    torch.manual_seed(seed)
    return HILEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24,
                      _loaded=(random_bert(seed=seed), tokenizer),
                      **settings)


# -- ColBERT v1 conventions ------------------------------------------------------------------------------------------

def test_mask_padding_is_scored_but_not_attended_by_default(hf_tokenizer):
    """attend_to_mask_tokens False (ColBERT v1): the real tokens' outputs equal the backbone run on the query without
    any padding (nothing attends to a [MASK]); True: the padding changes them."""
    torch.manual_seed(0)
    encoder = ColBERTEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24,
                             _loaded=(random_bert(), hf_tokenizer)).eval()
    batch = encoder.tokenizer.encode_queries(["what is sleep"])
    n_real = 3 + len(hf_tokenizer("what is sleep", add_special_tokens=False)["input_ids"])
    assert batch.attention_mask[0].tolist() == [1] * n_real + [0] * (12 - n_real)
    assert batch.scoring_mask.all()  # every position, [MASK] included, is scored
    assert (batch.input_ids[0, n_real:] == hf_tokenizer.mask_token_id).all()
    with torch.no_grad():
        alone = encoder.backbone(input_ids=batch.input_ids[:, :n_real]).last_hidden_state      # no padding at all
        padded = encoder.hidden_states(batch)[:, :n_real]
        torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)
        attending = ColBERTEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24, attend_to_mask_tokens=True,
                                   _loaded=(encoder.backbone, hf_tokenizer)).eval()
        both = attending.tokenizer.encode_queries(["what is sleep"])
        assert both.attention_mask.all()
        assert not torch.allclose(attending.hidden_states(both)[:, :n_real], alone, atol=1e-4)


def test_head_init_bert_is_normal_with_the_backbone_std_and_torch_is_kaiming_uniform(hf_tokenizer):
    bert = random_bert(hidden=64)
    bert.config.initializer_range = 0.02
    encoder = ColBERTEncoder("random-bert", dim=128, _loaded=(bert, hf_tokenizer))
    weights = encoder.linear.weight.detach().flatten().numpy()
    assert abs(weights.std() - 0.02) < 0.002 and abs(weights.mean()) < 0.002
    torch_init = ColBERTEncoder("random-bert", dim=128, head_init="torch", _loaded=(bert, hf_tokenizer))
    uniform = torch_init.linear.weight.detach().flatten().numpy()
    bound = 1 / math.sqrt(64)  # kaiming_uniform(a=sqrt(5)) on fan_in 64
    assert np.abs(uniform).max() <= bound and abs(uniform.std() - bound / math.sqrt(3)) < 0.01
    hil = HILEncoder("random-bert", dim=128, _loaded=(bert, hf_tokenizer))
    for layer in (hil.linear_L, hil.linear_H):
        assert abs(layer.weight.detach().std().item() - 0.02) < 0.002
    with pytest.raises(ValueError, match="head_init"):
        ColBERTEncoder("random-bert", head_init="xavier", _loaded=(bert, hf_tokenizer))


def test_models_saved_before_the_setting_keep_attending_to_mask_tokens():
    assert upgrade_settings({"architecture": "colbert"})["attend_to_mask_tokens"] is True
    assert upgrade_settings({"attend_to_mask_tokens": False})["attend_to_mask_tokens"] is False


def test_export_round_trip_keeps_the_new_settings(tmp_path, hf_tokenizer):
    encoder = hil_encoder(hf_tokenizer, attend_to_mask_tokens=True, lexical_input="embedding_output",
                          zscore_eval="per_query", zscore_std="unbiased", zscore_detach=["H"])
    encoder.save_pretrained(tmp_path / "export")
    loaded = HILEncoder.from_pretrained(tmp_path / "export")
    for key in ("attend_to_mask_tokens", "lexical_input", "zscore_eval", "zscore_std", "zscore_detach", "head_init"):
        assert loaded.settings()[key] == encoder.settings()[key], key


# -- the HIL authors' code -----------------------------------------------------------------------------------------

def authors_qidf(hf_tokenizer, queries: list[str], query_maxlen: int) -> dict[int, float]:
    """Their qidf script, written out: [CLS] [unused0] body [SEP] + [MASK] padding, a set per query, ln(N/(1+df))."""
    counts: Counter = Counter()
    q_marker = hf_tokenizer.convert_tokens_to_ids("[unused0]")
    for text in queries:
        body = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = [hf_tokenizer.cls_token_id, q_marker, *body, hf_tokenizer.sep_token_id]
        ids += [hf_tokenizer.mask_token_id] * (query_maxlen - (len(body) + 3))
        counts.update(set(ids))
    return {t: math.log(len(queries) / (1 + c)) for t, c in counts.items()}


def test_authors_idf_matches_their_query_formula(hf_tokenizer):
    encoder = hil_encoder(hf_tokenizer, idf_formula="authors")
    table = encoder.set_idf_from_texts(QUERIES + ["what sleep is not"], source="toy queries")
    assert table.formula == AUTHORS_FORMULA
    expected = authors_qidf(hf_tokenizer, QUERIES + ["what sleep is not"], 12)
    for token, weight in expected.items():
        assert encoder.idf[token].item() == pytest.approx(weight, abs=1e-6), hf_tokenizer.convert_ids_to_tokens(token)
    assert encoder.idf[hf_tokenizer.cls_token_id].item() < 0  # in every query: ln(N / (N + 1))
    unseen = hf_tokenizer.convert_tokens_to_ids("zebra")
    assert encoder.idf[unseen].item() == pytest.approx(math.log(4))
    with pytest.raises(ValueError, match="idf_formula"):
        hil_encoder(hf_tokenizer).set_idf(table)  # a bm25 encoder refuses an authors' table


def test_lexical_input_embedding_output_is_the_embedding_layer(hf_tokenizer):
    encoder = hil_encoder(hf_tokenizer, lexical_input="embedding_output").eval()
    batch = encoder.tokenizer.encode_documents(DOCS[:2])
    with torch.no_grad():
        reference = encoder.backbone.embeddings(input_ids=batch.input_ids)  # word + position + type, LayerNorm
        expected = F.normalize(encoder.linear_L(reference), dim=-1)
        got = encoder.embed(batch, is_query=False)["L"]
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    words = hil_encoder(hf_tokenizer).eval()
    with torch.no_grad():
        torch.testing.assert_close(words.embed(batch, False)["L"],
                                   F.normalize(words.linear_L(words.backbone.embeddings.word_embeddings(
                                       batch.input_ids)), dim=-1))


def test_unbiased_and_per_query_moments_match_torch_std_and_loops():
    torch.manual_seed(1)
    x, mask = torch.randn(4, 7), torch.rand(4, 7) > 0.3
    mean, std = batch_moments(x, mask, eps=0.0, unbiased=True)
    assert mean.item() == pytest.approx(x[mask].mean().item(), abs=1e-6)
    assert std.item() == pytest.approx(torch.std(x[mask]).item(), abs=1e-6)
    _, population = batch_moments(x, mask, eps=0.0)
    assert population.item() == pytest.approx(x[mask].std(unbiased=False).item(), abs=1e-6)
    scores, qmask = torch.randn(3, 5, 6), torch.rand(3, 6) > 0.3
    qmask[:, 0] = True
    means, stds = per_query_moments(scores, qmask, eps=0.0, unbiased=True)
    for q in range(3):
        values = scores[q][:, qmask[q]].flatten()
        assert means[q, 0, 0].item() == pytest.approx(values.mean().item(), abs=1e-6)
        assert stds[q, 0, 0].item() == pytest.approx(torch.std(values).item(), abs=1e-6)
        raw = (scores[q] * qmask[q]).sum(-1)
        sums = zscore_from_sums(raw[None], ((scores[q] ** 2) * qmask[q]).sum(-1)[None], qmask[q].sum()[None],
                                eps=0.0, unbiased=True)[0]
        expected = ((scores[q] - values.mean()) / torch.std(values) * qmask[q]).sum(-1)
        torch.testing.assert_close(sums, expected, atol=1e-5, rtol=1e-5)


def test_per_query_zscore_in_retrieval_uses_every_candidate_not_each_block(hf_tokenizer):
    """zscore_eval per_query: ranking a query's documents in many small blocks gives the scores of one call over all
    of them (the moments accumulate over blocks)."""
    encoder = hil_encoder(hf_tokenizer, zscore_eval="per_query", zscore_std="unbiased").eval()
    encoder.set_idf_from_texts(DOCS)
    with torch.no_grad():
        queries = encoder.encode_queries(QUERIES)
        docs = encoder.encode_documents(DOCS)
        whole = encoder.score(queries, docs).numpy()                     # one call: moments over all 5 documents
        first_two = encoder.score(queries, docs.select(slice(0, 2))).numpy()
    assert not np.allclose(first_two, whole[:, :2], atol=1e-3)  # the moments do depend on the candidate set
    store = encode_document_tokens(encoder, DOCS, batch_size=2, dtype=np.float32).to_store([f"d{i}" for i in range(5)])
    with torch.no_grad():
        blocked = score_documents(encoder, queries, store, np.arange(5), block_tokens=30)  # several blocks
    np.testing.assert_allclose(blocked, whole, atol=1e-4, rtol=1e-4)


def authors_score_and_reg(encoder: HILEncoder, batch: TripleBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The authors' ``ColBERT.score`` (qidf branch, sensim) written out on our embeddings: Q repeated for
    [positives; negatives], torch.mean / torch.std over all (2B, Lq) token scores, (cb + lx) / 2."""
    q = batch.paired_queries
    qH, qL, dH, dL = q.heads["H"], q.heads["L"], batch.docs.heads["H"], batch.docs.heads["L"]
    cb_dot = qH @ dH.permute(0, 2, 1)
    lx_dot = qL @ dL.permute(0, 2, 1)
    cb = cb_dot.max(2).values
    lx = encoder.idf[q.input_ids] * lx_dot.max(2).values
    cb = ((cb - cb.mean()) / torch.std(cb)).sum(1)
    lx = ((lx - lx.mean()) / torch.std(lx)).sum(1)
    return (cb + lx) / 2, torch.mean(cb_dot) - torch.abs(torch.mean(lx_dot))


def test_authors_loss_equals_their_formulas(hf_tokenizer):
    encoder = hil_encoder(hf_tokenizer, idf_formula="authors", lexical_query_tokens="all", zscore_std="unbiased",
                          zscore_eps=1e-12, lexical_input="embedding_output").train()
    encoder.set_idf_from_texts(QUERIES)
    batch = TripleBatch(encoder.encode_queries(QUERIES), encoder.encode_documents(DOCS[:3] + DOCS[2:5]))
    out = HILAuthorsLoss(reg_weight=-0.3)(encoder, batch)
    scores, reg = authors_score_and_reg(encoder, batch)
    n = len(QUERIES)
    ce = F.cross_entropy(torch.stack([scores[:n], scores[n:]], dim=1), torch.zeros(n, dtype=torch.long))
    assert out.loss.item() == pytest.approx((ce - 0.3 * reg).item(), abs=1e-5)
    assert out.parts["loss_reg"].item() == pytest.approx(reg.item(), abs=1e-6)


def test_mean_token_dot_and_conditional_isotropy_match_slow_loops():
    torch.manual_seed(2)
    q = F.normalize(torch.randn(2, 3, 4), dim=-1)
    d = F.normalize(torch.randn(2, 5, 4), dim=-1)
    d[1, 3:] = 0.0  # padding rows
    assert mean_token_dot(q, d).item() == pytest.approx(torch.einsum("bid,bjd->bij", q, d).mean().item(), abs=1e-6)
    # the authors' sensim term: mean(H dots) - |mean(L dots)|, with L's mean negative here (-q against q)
    mean_L, mean_H = mean_token_dot(q, -q), mean_token_dot(q, q)
    assert mean_L.item() < 0
    assert authors_hil_reg(mean_L, mean_H).item() == pytest.approx(mean_H.item() - abs(mean_L.item()), abs=1e-6)
    total, count = 0.0, 0
    for b in range(2):
        for i in range(3):
            residuals = []
            for j in range(5):
                r = d[b, j] - torch.dot(q[b, i], d[b, j]) * q[b, i]
                residuals.append(r / r.norm() if r.norm() > 0 else r)
            for j in range(5):
                for k in range(5):
                    total += torch.dot(residuals[j], residuals[k]).item()
                    count += 1
    assert conditional_isotropy(q, d).item() == pytest.approx(total / count, abs=1e-5)
    docs = torch.cat([d, F.normalize(torch.randn(2, 5, 4), dim=-1)])  # [positives; negatives]: only d+ counts
    reg, logs = ConditionalIsotropyRegularizer(0.4)(q, docs, pair_index=torch.arange(2).repeat(2))
    assert reg.item() == pytest.approx(0.4 * total / count, abs=1e-5)


def test_detached_moments_and_a_fixed_temperature(hf_tokenizer):
    """zscore_detach H: the gradient equals the one with H's moments frozen as constants; zscore_temperature T:
    score_late = (sum_i S_i - n m) / T."""
    torch.manual_seed(3)
    grads = {}
    for detach in ((), ("H",)):
        encoder = hil_encoder(hf_tokenizer, zscore_detach=list(detach)).train()
        batch = TripleBatch(encoder.encode_queries(QUERIES), encoder.encode_documents(DOCS[:3] + DOCS[2:5]))
        late, masks = encoder.training_pair_scores(batch.queries, batch.docs, batch.pair_index)
        late["H"].sum().backward()
        grads[detach] = encoder.linear_H.weight.grad.clone()
    encoder = hil_encoder(hf_tokenizer).train()
    batch = TripleBatch(encoder.encode_queries(QUERIES), encoder.encode_documents(DOCS[:3] + DOCS[2:5]))
    scores, masks = encoder.token_scores(batch.paired_queries, batch.docs, all_pairs=False)
    mean, std = (m.detach() for m in batch_moments(scores["H"], masks["H"], eps=encoder.zscore_eps))
    (((scores["H"] - mean) / std) * masks["H"]).sum().backward()
    torch.testing.assert_close(grads[("H",)], encoder.linear_H.weight.grad, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(grads[()], grads[("H",)], atol=1e-4)
    fixed = hil_encoder(hf_tokenizer, zscore_temperature=0.5).train()
    batch = TripleBatch(fixed.encode_queries(QUERIES), fixed.encode_documents(DOCS[:3] + DOCS[2:5]))
    late, masks = fixed.training_pair_scores(batch.queries, batch.docs, batch.pair_index)
    scores, _ = fixed.token_scores(batch.paired_queries, batch.docs, all_pairs=False)
    mean = scores["L"][masks["L"]].mean()
    expected = ((scores["L"] - mean) * masks["L"]).sum(1) / 0.5
    torch.testing.assert_close(late["L"], expected, atol=1e-5, rtol=1e-5)


def test_bad_settings_are_refused(hf_tokenizer):
    for bad in ({"lexical_input": "tokens"}, {"zscore_eval": "batch"}, {"zscore_detach": ["X"]},
                {"zscore_temperature": 0.0}, {"idf_formula": "tfidf"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            hil_encoder(hf_tokenizer, **bad)


def test_idf_table_round_trip_keeps_the_authors_formula(tmp_path, hf_tokenizer):
    encoder = hil_encoder(hf_tokenizer, idf_formula="authors")
    table = IDFTable.from_queries(encoder.tokenizer, QUERIES, vocab_size=encoder.vocab_size)
    loaded = IDFTable.load(table.save(tmp_path / "idf.pt"))
    assert loaded.formula == AUTHORS_FORMULA
    torch.testing.assert_close(loaded.to_tensor(), table.to_tensor())
