"""The one evaluation entry point: every mode against scores computed the obvious way, and its settings checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hil.data.beir import BeirDataset
from hil.evaluation.evaluate import EvaluationSettings, evaluate, evaluate_bm25, first_stage
from hil.evaluation.metrics import evaluate_run
from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.ensemble import EnsembleEncoder
from hil.retrieval.search import rank_matrix

from conftest import random_bert

WORDS = "gene cell protein cancer heart brain water climate energy virus bone blood sugar sleep light".split()


def toy_dataset() -> BeirDataset:
    rng = np.random.default_rng(0)
    corpus = {f"d{i:02d}": {"title": "", "text": " ".join(rng.choice(WORDS, size=int(rng.integers(3, 12))))}
              for i in range(30)}
    queries = {f"q{i}": " ".join(rng.choice(WORDS, size=3)) for i in range(6)}
    qrels = {q: {f"d{int(j):02d}": int(g) for j, g in zip(rng.choice(30, 3, replace=False), (2, 1, 1))}
             for q in queries}
    return BeirDataset("toy", corpus, queries, qrels, split="test", source="memory")


def make_encoder(hf_tokenizer, seed: int) -> ColBERTEncoder:
    torch.manual_seed(seed)
    return ColBERTEncoder("random-bert", dim=16, query_maxlen=8, doc_maxlen=16,
                          _loaded=(random_bert(seed=seed), hf_tokenizer)).eval()


@pytest.fixture
def encoder(hf_tokenizer) -> ColBERTEncoder:
    return make_encoder(hf_tokenizer, 0)


def brute_force_scores(encoder, dataset: BeirDataset) -> np.ndarray:
    """(Q, N) model scores of every query and document, each pair encoded and scored on its own."""
    with torch.inference_mode():
        docs = [encoder.encode_documents([text]) for text in dataset.documents()]
        rows = []
        for text in dataset.query_texts():
            query = encoder.encode_queries([text])
            rows.append([float(encoder.score(query, doc)[0, 0]) for doc in docs])
    return np.array(rows)


def ranking(scores: np.ndarray, doc_ids: list[str], k: int, allowed: list[str] | None = None) -> list[str]:
    """The top k ids by (-score, id), among ``allowed``."""
    pool = [(-scores[i], d) for i, d in enumerate(doc_ids) if allowed is None or d in allowed]
    return [d for _, d in sorted(pool)[:k]]


def test_exhaustive_and_full_rank_every_document_like_brute_force(encoder, tmp_path):
    dataset = toy_dataset()
    reference = brute_force_scores(encoder, dataset)
    doc_ids = dataset.doc_ids()
    runs = {}
    for name, settings in {
            "exhaustive": EvaluationSettings(mode="exhaustive", k=10, index_root=None, progress=False),
            "exhaustive-index": EvaluationSettings(mode="exhaustive", k=10, index_root=tmp_path, progress=False),
            "full": EvaluationSettings(mode="full", k=10, index_root=tmp_path, ncandidates=10_000, progress=False),
            "heads": EvaluationSettings(mode="exhaustive", k=10, index_root=None, keep_head_scores=True,
                                        progress=False)}.items():
        runs[name] = evaluate(encoder, dataset, settings)
    for row, qid in enumerate(dataset.queries):
        expected = ranking(reference[row], doc_ids, 10)
        for name, evaluation in runs.items():
            assert list(evaluation.run[qid]) == expected, (name, qid)
            np.testing.assert_allclose([evaluation.run[qid][d] for d in expected],
                                       [reference[row][doc_ids.index(d)] for d in expected], atol=2e-2)
    heads = runs["heads"].head_scores
    assert list(heads.heads) == ["colbert"] and heads.heads["colbert"].shape == (6, 30)
    np.testing.assert_allclose(heads.heads["colbert"], reference, atol=2e-2)  # fp16 store vs fp32 by hand
    # where the index's time went is reported by the evaluation that built it, not by one that reused it
    built, reused = runs["exhaustive-index"].details, runs["full"].details
    assert built["index_opened"] == "built" and reused["index_opened"] == "reused"
    assert list(built["index_build_seconds"]) == ["encode", "join", "search_structures"]
    assert sum(built["index_build_seconds"].values()) <= built["index_seconds"]
    assert "index_build_seconds" not in reused
    # the measured numbers are pytrec_eval's of the run
    aggregate, _ = evaluate_run(dataset.qrels, runs["full"].run)
    assert runs["full"].aggregate == aggregate


def test_rerank_and_exhaustive_with_candidates_rank_only_the_candidates(encoder, tmp_path):
    dataset = toy_dataset()
    reference = brute_force_scores(encoder, dataset)
    bm25 = evaluate_bm25(dataset, k=30)
    candidates = first_stage(bm25, depth=5)
    assert all(len(docs) <= 5 for docs in candidates.values())
    for settings in (EvaluationSettings(mode="rerank", k=10, index_root=tmp_path, progress=False),
                     EvaluationSettings(mode="rerank", k=10, index_root=None, progress=False),
                     EvaluationSettings(mode="exhaustive", k=10, index_root=None, progress=False)):
        evaluation = evaluate(encoder, dataset, settings, candidates=candidates)
        for row, qid in enumerate(dataset.queries):
            expected = ranking(reference[row], dataset.doc_ids(), 10, allowed=candidates[qid])
            assert list(evaluation.run[qid]) == expected, (settings.mode, settings.index_root, qid)


def test_head_scores_of_an_ensemble_add_up_to_its_ranking(hf_tokenizer):
    dataset = toy_dataset()
    ensemble = EnsembleEncoder(make_encoder(hf_tokenizer, 1), make_encoder(hf_tokenizer, 2)).eval()
    settings = EvaluationSettings(mode="exhaustive", k=30, index_root=None, keep_head_scores=True, progress=False)
    evaluation = evaluate(ensemble, dataset, settings)
    heads = evaluation.head_scores.heads
    assert set(heads) == {"iso", "aniso"}
    total = heads["iso"] + heads["aniso"]
    assert evaluation.run == rank_matrix(total, evaluation.head_scores.qids, dataset.doc_ids(), 30)
    weighted = EnsembleEncoder(make_encoder(hf_tokenizer, 1), make_encoder(hf_tokenizer, 2),
                               weights=(1.0, 0.25)).eval()
    with pytest.raises(ValueError, match="not the sum of its heads"):
        evaluate(weighted, dataset, settings)  # its matrices would not add up to what it ranks by


def test_rank_matrix_against_sorting():
    doc_ids = ["d0", "d1", "d2", "d3", "d4", "d5"]
    scores = np.array([[0.1, 0.9, 0.5, 0.9, 0.0, 0.3], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [0, 0, 0, 0, 0, 0.0]])
    run = rank_matrix(scores, ["q1", "q2", "q3"], doc_ids, k=3)
    assert list(run["q1"]) == ["d3", "d1", "d2"]  # tie at 0.9 broken by id, descending (trec_eval)
    assert list(run["q2"]) == ["d5", "d4", "d3"] and list(run["q3"]) == ["d5", "d4", "d3"]
    skipped = rank_matrix(scores, ["d3", "q2"], doc_ids, k=3, skip_self=True)
    assert list(skipped["d3"]) == ["d1", "d2", "d5"], "the query's own document is skipped; 3 others ranked"
    rerun = rank_matrix(scores, ["q1", "q2", "q3"], doc_ids, k=3, candidates={"q1": ["d0", "d4"], "q2": []})
    assert list(rerun["q1"]) == ["d0", "d4"] and rerun["q2"] == {} and rerun["q3"] == {}


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "dense"}, "mode must be one of"),
    ({"mode": "full", "index_root": None}, "give index_root"),
    ({"mode": "full", "keep_head_scores": True}, "keep_head_scores needs"),
    ({"k": 0}, "k must be >= 1"),
])
def test_settings_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EvaluationSettings(**kwargs)


def test_rerank_needs_candidates(encoder):
    with pytest.raises(ValueError, match="needs candidates"):
        evaluate(encoder, toy_dataset(), EvaluationSettings(mode="rerank", index_root=None, progress=False))


def test_sizes_left_unset_follow_the_device():
    """A CPU keeps the batch sizes measured there; a GPU gets large batches and tokenizers running ahead; sizes given
    are kept on either."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert EvaluationSettings().for_device(cpu.type).batch_size == 32
    assert (EvaluationSettings().for_device(cpu.type).query_batch_size,
            EvaluationSettings().for_device(cpu.type).tokenizer_workers) \
        == (64, 0)
    on_gpu = EvaluationSettings().for_device(gpu.type)
    assert (on_gpu.batch_size, on_gpu.query_batch_size, on_gpu.tokenizer_workers) == (128, 1024, 2)
    given = EvaluationSettings(batch_size=8, query_batch_size=3, tokenizer_workers=1)
    assert given.for_device(gpu.type) == given == given.for_device(cpu.type)
