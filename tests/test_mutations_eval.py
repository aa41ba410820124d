"""Evaluation that cannot silently drift (issue 13, section 3): self-matches dropped through the whole pipeline,
``ncandidates`` limiting full ranking's candidates, two-sided paired tests that agree with ``scipy.stats``, and int8
document encoding that really quantizes.

Each test was checked by breaking the code it guards and watching it fail: the pipeline keeping self-matches,
``ncandidates`` ignored below full depth, the paired bootstrap made one-sided, int8 "quantization" that quantizes
nothing. References: trec_eval's formulas written out (``reference_metrics``), brute-force token search in numpy,
``scipy.stats`` called directly, and int8 levels counted per output channel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

from hil.data.beir import BeirDataset
from hil.evaluation.evaluate import EvaluationSettings, evaluate, evaluate_bm25
from hil.evaluation.statistics import (
    paired_bootstrap_test,
    paired_permutation_test,
    paired_t_test,
)
from hil.retrieval.backends.configs import FlatSearchConfig
from hil.retrieval.encoding import encode_document_tokens, eval_mode
from hil.retrieval.fast_encode import quantized_document_encoder
from hil.retrieval.smoothing import SmoothedLinear

from reference_metrics import mrr_at_k_reference, ndcg_at_k_reference
from toys import make_encoder

WORDS = ["gene", "cell", "protein", "cancer", "heart", "brain", "water", "climate", "energy", "virus", "bone",
         "blood", "sugar", "sleep", "light"]


def trec_order(docs: dict[str, float]) -> list[str]:
    """A query's documents in trec_eval's order: score descending, ties by document id descending."""
    return [d for d, _ in sorted(docs.items(), key=lambda item: (item[1], item[0]), reverse=True)]


# -- self-matches ---------------------------------------------------------------------------------------------------
def self_match_dataset(qrels: dict[str, dict[str, int]] | None = None) -> BeirDataset:
    """Queries that are also corpus documents under the same id (as ArguAna, Quora), with the query's own text."""
    rng = np.random.default_rng(3)
    queries = {f"x{i}": " ".join(rng.choice(WORDS, size=4)) for i in range(4)}
    corpus = {f"d{i:02d}": {"title": "", "text": " ".join(rng.choice(WORDS, size=int(rng.integers(3, 9))))}
              for i in range(12)}
    corpus.update({qid: {"title": "", "text": text} for qid, text in queries.items()})
    if qrels is None:
        qrels = {qid: {f"d{(3 * i + j) % 12:02d}": 1 + j % 2 for j in range(3)} for i, qid in enumerate(queries)}
    return BeirDataset("selfmatch", corpus, queries, qrels, split="test", source="memory")


def hand_metrics(dataset: BeirDataset, run: dict[str, dict[str, float]], drop_self: bool) -> dict[str, dict]:
    per_query = {}
    for qid, judged in dataset.qrels.items():
        ranking = [d for d in trec_order(run.get(qid, {})) if not (drop_self and d == qid)]
        per_query[qid] = {"ndcg@10": ndcg_at_k_reference(judged, ranking, 10),
                          "mrr@10": mrr_at_k_reference(judged, ranking, 10)}
    return per_query


def assert_measured_without_self_matches(dataset: BeirDataset, evaluation, keep_run: dict) -> None:
    expected = hand_metrics(dataset, evaluation.run, drop_self=True)
    kept = hand_metrics(dataset, keep_run, drop_self=False)
    assert expected != kept, "the construction must make self-matches change the numbers"
    for qid, values in expected.items():
        for metric, value in values.items():
            assert evaluation.per_query[qid][metric] == pytest.approx(value, abs=1e-9), (qid, metric)
    for metric in ("ndcg@10", "mrr@10"):
        mean = sum(v[metric] for v in expected.values()) / len(expected)
        assert evaluation.aggregate[metric] == pytest.approx(mean, abs=1e-9), metric


def assert_k_others_ranked(run: dict, keep_run: dict, k: int) -> None:
    """BEIR's rule: the query's own document is skipped and k other documents are ranked -- the run is the deeper
    run with the self-match kept, minus the self-match, cut at k (in trec_eval's order)."""
    for qid, docs in run.items():
        assert qid not in docs
        expected = [d for d in trec_order(keep_run[qid]) if d != qid][:k]
        assert trec_order(docs) == expected, qid


def test_bm25_evaluation_skips_self_matches_and_ranks_k_others():
    dataset = self_match_dataset()
    keep = evaluate_bm25(dataset, k=100, metrics=("ndcg@10", "mrr@10"), drop_self_matches=False)
    # each query finds itself first (its own text), and that document is judged irrelevant by omission
    assert all(trec_order(keep.run[qid])[0] == qid for qid in dataset.queries)
    kept = hand_metrics(dataset, keep.run, drop_self=False)
    assert keep.aggregate["mrr@10"] == pytest.approx(sum(v["mrr@10"] for v in kept.values()) / len(kept))
    for k in (3, 100):
        evaluation = evaluate_bm25(dataset, k=k, metrics=("ndcg@10", "mrr@10"))
        assert_k_others_ranked(evaluation.run, keep.run, k)
        if k == 3:
            assert all(len(docs) == 3 for docs in evaluation.run.values()), "3 documents besides the query's own"
    assert_measured_without_self_matches(dataset, evaluation, keep.run)


def test_model_evaluation_skips_self_matches_by_default(hf_tokenizer):
    encoder = make_encoder(hf_tokenizer)
    probe = evaluate(encoder, self_match_dataset(), EvaluationSettings(
        mode="exhaustive", k=100, index_root=None, metrics=("ndcg@10",), progress=False, drop_self_matches=False))
    # judge, for each query, documents the model ranks right below its self-match: the self-match then counts
    qrels = {}
    for qid, docs in probe.run.items():
        order = trec_order(docs)
        position = order.index(qid)
        assert position < len(order) - 2, "the query should rank its own text high"
        qrels[qid] = {order[position + 1]: 2, order[-1]: 1}
    dataset = self_match_dataset(qrels)
    keep = evaluate(encoder, dataset, EvaluationSettings(mode="exhaustive", k=100, index_root=None,
                                                         metrics=("ndcg@10", "mrr@10"), progress=False,
                                                         drop_self_matches=False))
    for k in (100, 4):  # full ranking: tests/test_evaluate.py (it needs an index on disk)
        settings = EvaluationSettings(mode="exhaustive", k=k, index_root=None, metrics=("ndcg@10", "mrr@10"),
                                      progress=False)
        assert settings.drop_self_matches
        evaluation = evaluate(encoder, dataset, settings)
        assert_k_others_ranked(evaluation.run, keep.run, k)
    assert_measured_without_self_matches(dataset, evaluation, keep.run)


def test_evaluate_command_skips_self_matches_unless_asked_and_passes_ncandidates():
    from hil.cli.evaluate_script import build_parser, settings_from

    base = ["--model", "m", "--dataset", "d", "--mode", "full", "--quiet"]
    assert settings_from(build_parser().parse_args(base)).drop_self_matches is True
    assert settings_from(build_parser().parse_args([*base, "--keep-self-matches"])).drop_self_matches is False
    assert settings_from(build_parser().parse_args([*base, "--ncandidates", "3"])).search.ncandidates == 3


# -- ncandidates below full depth --------------------------------------------------------------------------------------
def candidate_dataset() -> BeirDataset:
    rng = np.random.default_rng(0)
    corpus = {f"d{i:02d}": {"title": "", "text": " ".join(rng.choice(WORDS, size=int(rng.integers(3, 12))))}
              for i in range(30)}
    queries = {f"q{i}": " ".join(rng.choice(WORDS, size=3)) for i in range(5)}
    qrels = {q: {f"d{int(j):02d}": 1 for j in rng.choice(30, 2, replace=False)} for q in queries}
    return BeirDataset("cands", corpus, queries, qrels, split="test", source="memory")


@pytest.mark.parametrize("ncandidates", [1, 3])
def test_full_ranking_ranks_only_the_documents_of_each_query_tokens_nearest_tokens(hf_tokenizer, tmp_path,
                                                                                    ncandidates):
    encoder = make_encoder(hf_tokenizer)
    dataset = candidate_dataset()
    settings = EvaluationSettings(mode="full", k=1000, index_root=tmp_path,
                                  search=FlatSearchConfig(ncandidates=ncandidates), metrics=("ndcg@10",),
                                  progress=False)
    evaluation = evaluate(encoder, dataset, settings)
    store = evaluation.store
    table = np.asarray(store.embeddings["colbert"], dtype=np.float32)  # (n_tokens, D) as stored
    sizes = []
    for qid, text in dataset.queries.items():
        with eval_mode(encoder), torch.no_grad():
            encoded = encoder.encode_queries([text])
        query = encoded.heads["colbert"][0][encoded.mask[0]].float().numpy()  # (Lq, D) scored tokens
        nearest = np.argsort(-(query @ table.T), axis=1, kind="stable")[:, :ncandidates]  # brute-force search
        expected = {store.doc_ids[int(store.token_doc[t])] for t in nearest.ravel()}
        assert set(evaluation.run[qid]) == expected, qid
        sizes.append(len(expected))
    assert max(sizes) < len(dataset.corpus), "the construction must leave documents out"
    assert evaluation.details["search_stats"]["search"]["ncandidates"] == ncandidates
    assert evaluation.details["search_stats"]["candidates_mean"] == pytest.approx(np.mean(sizes))


# -- paired tests: two-sided, against scipy.stats -------------------------------------------------------------------
def paired_scores(n: int, shift: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    b = rng.uniform(0.2, 0.8, size=n)
    return b + shift + rng.normal(0.0, 0.1, size=n), b


def mean_difference(x, y, axis=-1):
    return np.mean(x - y, axis=axis)


@pytest.mark.parametrize("n, shift, seed", [(30, 0.03, 0), (40, 0.025, 5), (50, -0.02, 4), (45, -0.015, 3),
                                            (25, 0.0, 2)])
def test_paired_bootstrap_is_two_sided_as_scipy_bootstrap_gives_it(n, shift, seed):
    a, b = paired_scores(n, shift, seed)
    resamples = 4000
    result = paired_bootstrap_test(a, b, n_samples=resamples, seed=seed)
    # the reference: scipy's paired percentile bootstrap of mean(a - b), the null centred on the observed mean,
    # p = (1 + #{|T* - T| >= |T|}) / (1 + B), both tails
    boot = scipy_stats.bootstrap((a, b), mean_difference, paired=True, vectorized=True, n_resamples=resamples,
                                 method="percentile", rng=np.random.default_rng(seed))
    observed = float(np.mean(a - b))
    centred = np.abs(boot.bootstrap_distribution - observed)
    expected = (1 + np.sum(centred >= abs(observed) - 1e-12)) / (1 + resamples)
    assert result.p_value == pytest.approx(expected, abs=1e-12)
    assert result.ci == pytest.approx((boot.confidence_interval.low, boot.confidence_interval.high), abs=1e-12)
    # two-sided: swapping the systems changes the sign of the difference, not the p-value
    swapped = paired_bootstrap_test(b, a, n_samples=resamples, seed=seed)
    assert swapped.p_value == pytest.approx(result.p_value, abs=1e-12)
    assert swapped.mean_diff == pytest.approx(-result.mean_diff)
    assert swapped.ci == pytest.approx((-result.ci[1], -result.ci[0]), abs=1e-12)
    # and it is of the size of the two-sided paired t-test's p (not about half of it, as a one-sided test's)
    t_p = scipy_stats.ttest_rel(a, b).pvalue
    if 0.05 < t_p < 0.5:  # (the middle three cases; where p is tiny or near 1 the two need not be close)
        assert 0.75 * t_p < result.p_value < 1.3 * t_p, (result.p_value, t_p)


@pytest.mark.parametrize("n, shift, seed", [(10, 0.05, 0), (12, -0.04, 1), (14, 0.0, 5)])
def test_paired_permutation_test_is_scipy_two_sided_exact_test(n, shift, seed):
    a, b = paired_scores(n, shift, seed)
    result = paired_permutation_test(a, b)  # n <= 16: every sign pattern
    reference = scipy_stats.permutation_test((a - b,), lambda d, axis=-1: np.mean(d, axis=axis),
                                             permutation_type="samples", alternative="two-sided",
                                             n_resamples=np.inf, vectorized=True)
    assert result.p_value == pytest.approx(reference.pvalue, abs=1e-12)
    assert paired_permutation_test(b, a).p_value == pytest.approx(result.p_value, abs=1e-12)
    assert paired_t_test(b, a).p_value == pytest.approx(scipy_stats.ttest_rel(a, b).pvalue)


# -- int8 document encoding quantizes ----------------------------------------------------------------------------------
TEXTS = ["the protein binds the receptor in mouse cells", "vaccine dose and trial results, 2020.",
         "brain tumor growth is slowed by the therapy", "insulin signal in the liver",
         "heart and lung risk in older patients", "a short one"] * 2


def test_int8_document_encoding_quantizes_every_backbone_linear(tiny_random_colbert):
    original = {name: module.weight.detach().clone() for name, module in tiny_random_colbert.backbone.named_modules()
                if isinstance(module, torch.nn.Linear)}
    view = quantized_document_encoder(tiny_random_colbert, "int8", calibration_texts=TEXTS[:4])
    layers = {name: module for name, module in view.encoder.backbone.named_modules()
              if isinstance(module, SmoothedLinear)}
    assert set(layers) == set(original)
    for name, smoothed in layers.items():
        assert isinstance(smoothed.inner, DynamicQuantizedLinear), f"{name} is not quantized"
        weight = smoothed.inner.weight()  # the packed weight of a dynamically quantized Linear
        assert weight.is_quantized and weight.dtype == torch.qint8, name
        scales = weight.q_per_channel_scales().double()                  # (out,) one scale per output channel
        levels = weight.int_repr().long()                                 # (out, in) int8 codes
        assert levels.min() >= -128 and levels.max() <= 127
        assert all(len(torch.unique(row)) <= 256 for row in levels)
        dequantized = weight.dequantize().double()
        torch.testing.assert_close(dequantized, levels.double() * scales[:, None], rtol=0, atol=1e-7)
        # the smoothed fp32 weight is the dequantized one times 1 / inv_scale per input channel, to within half a
        # level of its channel: what rounding to the int8 grid gives
        effective = dequantized * smoothed.inv_scale.double()[None, :]
        reference = original[name].double()
        error = (effective - reference).abs() / smoothed.inv_scale.double()[None, :]   # in smoothed units
        assert (error <= scales[:, None] / 2 + 1e-6).all(), name
        assert (effective - reference).abs().max() > 0, f"{name}: weights were not rounded"
    # the document vectors change (activations are quantized too), but stay close to fp32
    with eval_mode(tiny_random_colbert), eval_mode(view):
        fp32 = encode_document_tokens(tiny_random_colbert, TEXTS, batch_size=4, dtype=np.float32).embeddings
        int8 = encode_document_tokens(view, TEXTS, batch_size=4, dtype=np.float32).embeddings
    a, b = fp32["colbert"], int8["colbert"]
    # (smoothing alone is an exact rewrite: ~1e-7 here; int8 moves them by ~1e-4)
    assert np.abs(a - b).max() > 1e-5, "int8 vectors equal the fp32 ones: nothing was quantized"
    cosine = (a * b).sum(axis=1)
    assert cosine.mean() > 0.98 and cosine.min() > 0.9
