"""The Python API (``hil.api``, re-exported from ``hil``), checked against computations written out by hand, and the
README's "Use from Python" block run as written."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import pytrec_eval
import torch

import hil
from hil.errors import UserError

pytestmark = pytest.mark.integration
README = Path(__file__).resolve().parents[1] / "README.md"
TEXTS = ["Paris is the capital of France.", "Vaccines, in many studies, do not cause autism!", "short",
         "a much longer document about the geography of europe and its capitals, rivers and hills"]


@pytest.fixture(scope="module")
def model(shared_dir):
    torch.manual_seed(0)
    return hil.load_model(shared_dir / "models" / "bert-tiny-splade", device="cpu", dim=16, query_maxlen=12,
                          doc_maxlen=40)


def test_every_api_name_is_exported_from_the_package():
    for name in hil.API:
        assert callable(getattr(hil, name)), name
    with pytest.raises(AttributeError):
        hil.no_such_function  # noqa: B018


def test_encoding_gives_the_scored_tokens_of_each_text_whatever_the_batch(model):
    one = hil.encode_documents(model, TEXTS, batch_size=1)
    many = hil.encode_documents(model, TEXTS, batch_size=3, progress=True, device="cpu")
    tokenized = model.tokenizer.encode_documents(TEXTS)
    for i, text in enumerate(TEXTS):
        assert one[i].shape == (int(tokenized.scoring_mask[i].sum()), 16)  # punctuation and padding dropped
        assert torch.allclose(one[i], many[i], atol=1e-5)
        assert torch.allclose(one[i].norm(dim=-1), torch.ones(len(one[i])), atol=1e-5)
    queries = hil.encode_queries(model, ["a query", "another, longer query"], batch_size=1)
    assert [q.shape for q in queries] == [(12, 16), (12, 16)]  # [MASK] expansion to query_maxlen


def test_score_is_maxsim_of_the_encoded_tokens(model):
    queries = ["capital of france", "autism vaccines"]
    q = hil.encode_queries(model, queries)
    d = hil.encode_documents(model, TEXTS)
    expected = torch.tensor([[sum(max(float(qt @ dt) for dt in doc) for qt in query) for doc in d] for query in q])
    assert torch.allclose(hil.score(model, queries, TEXTS), expected, atol=1e-4)


def test_two_head_models_give_every_head_or_the_one_asked(shared_dir):
    from hil.modeling.hil import HILEncoder

    model = HILEncoder(str(shared_dir / "models" / "bert-tiny-splade"), dim=8, query_maxlen=12, doc_maxlen=40)
    model.set_idf_from_texts(TEXTS)
    both = hil.encode_documents(model, TEXTS[:2])
    assert set(both[0]) == {"L", "H"}
    assert torch.equal(hil.encode_documents(model, TEXTS[:2], head="H")[1], both[1]["H"])
    with pytest.raises(UserError, match="heads are"):
        hil.encode_documents(model, TEXTS, head="colbert")


@pytest.mark.parametrize("call,words", [
    (lambda m: hil.encode_documents(m, "one string"), "not one string"),
    (lambda m: hil.encode_queries(m, ["q"], batch_size=0), "batch_size must be a positive integer"),
    (lambda m: hil.build_index(m, ["not", "a", "mapping"], "x"), "{doc_id: text}"),
])
def test_bad_api_input_is_a_user_error(model, call, words):
    with pytest.raises(UserError, match=re.escape(words)):
        call(model)


def test_search_and_evaluate_agree_with_exhaustive_scoring_and_pytrec_eval(model, shared_dir, tmp_path):
    dataset = hil.load_dataset(shared_dir / "data" / "beir" / "scifact")
    judged = [qid for qid in dataset.queries][:8]
    relevant = {doc for qid in judged for doc in dataset.qrels[qid]}
    doc_ids = list(dict.fromkeys([*sorted(relevant), *dataset.doc_ids()[:60]]))
    corpus = {doc_id: dataset.doc_text(doc_id) for doc_id in doc_ids}
    queries = {qid: dataset.queries[qid] for qid in judged}
    index = hil.build_index(model, corpus, tmp_path / "index", progress=False)
    run = hil.search(model, index, queries, k=5, ncandidates=len(corpus) * 40)
    scores = hil.score(model, list(queries.values()), list(corpus.values()))
    for row, qid in enumerate(queries):
        best = torch.topk(scores[row], 5)
        assert list(run[qid]) == [doc_ids[i] for i in best.indices.tolist()]
        # The index stores token vectors in fp16: scores agree to fp16's precision (relative 1e-3), not bitwise.
        assert [run[qid][doc_ids[i]] for i in best.indices.tolist()] == pytest.approx(best.values.tolist(), rel=1e-3)
    qrels = {qid: dataset.qrels[qid] for qid in judged}
    reference = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10"}).evaluate(run)
    metrics = hil.evaluate_run(run, qrels, metrics=["ndcg@10"])
    assert metrics["ndcg@10"] == pytest.approx(sum(v["ndcg_cut_10"] for v in reference.values()) / len(reference))
    assert hil.open_index(tmp_path / "index").doc_ids == doc_ids


def test_the_readme_python_block_runs_as_written(tmp_path, monkeypatch, shared_dir):
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Use from Python"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HIL_DATA_DIR", str(shared_dir / "data"))
    monkeypatch.setenv("HIL_MODELS_DIR", str(shared_dir / "models"))
    namespace: dict = {}
    exec(compile(block, "README.md: Use from Python", "exec"), namespace)  # noqa: S102
    metrics = namespace["hil"].evaluate_run(namespace["run"], namespace["qrels"], metrics=["ndcg@10"])
    assert 0.0 <= metrics["ndcg@10"] <= 1.0
    assert (tmp_path / "indexes" / "scifact-300").is_dir() and os.listdir(tmp_path / "indexes" / "scifact-300")
