"""Numbers that must not depend on how a search was run (issue 23's silent-number bugs).

1. A search-time setting changed on a reused index is used, and the results record the value the back-end used
   (nprobe of an IVF index, PLAID's ndocs and stage2_docs): the second evaluation of the same index with other
   search settings gives other candidates, the index is not rebuilt, and metrics.json says what ran.
2. One ranking rule (trec_eval's: score descending, then document id descending): every metric at k is the same
   from a depth-k ranking as from any deeper one, ties included (a property test over random tied scores, with
   pytrec_eval as the judge of the metrics; the rule itself checked against pytrec_eval's own order).
3. Self-matches (BEIR's rule): the query's own document is skipped before the cut, so k others are ranked, in every
   mode (full, exact, re-ranking, dense matrices) and by BM25.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import pytrec_eval
from hypothesis import given, settings
from hypothesis import strategies as st

from hil.data.beir import BeirDataset
from hil.data.bm25 import BM25Index
from hil.data.ranking import id_rank, top_k_indices
from hil.evaluation.evaluate import EvaluationSettings, evaluate, evaluate_bm25, first_stage
from hil.evaluation.metrics import evaluate_run
from hil.evaluation.runs import ranked
from hil.retrieval.backends.configs import IvfPqIndexConfig, IvfSearchConfig, PlaidIndexConfig, PlaidSearchConfig
from hil.retrieval.search import rank_matrix

from conftest import random_bert  # noqa: E402
from toys import WORDS  # noqa: E402


def encoder(hf_tokenizer, seed: int = 0):
    import torch

    from hil.modeling.encoder import ColBERTEncoder

    torch.manual_seed(seed)
    return ColBERTEncoder("random-bert", dim=16, query_maxlen=8, doc_maxlen=16,
                          _loaded=(random_bert(seed=seed), hf_tokenizer)).eval()


def dataset(n_docs: int = 60, n_queries: int = 8, self_matches: bool = False) -> BeirDataset:
    """Random short texts; with ``self_matches`` every query is also a corpus document (its own text)."""
    rng = np.random.default_rng(3)
    corpus = {f"d{i:02d}": {"title": "", "text": " ".join(rng.choice(WORDS, size=int(rng.integers(3, 12))))}
              for i in range(n_docs)}
    queries = {f"q{i}": " ".join(rng.choice(WORDS, size=4)) for i in range(n_queries)}
    if self_matches:
        queries = {doc_id: corpus[doc_id]["text"] for doc_id in list(corpus)[:n_queries]}
    qrels = {q: {f"d{int(j):02d}": int(g) for j, g in zip(rng.choice(n_docs, 3, replace=False), (2, 1, 1))
                 if f"d{int(j):02d}" != q} for q in queries}
    return BeirDataset("rules", corpus, queries, qrels, split="test", source="memory")


# -- 1. search-time settings on a reused index ---------------------------------------------------------------------

def test_ivf_nprobe_changed_on_a_reused_index_is_used_and_recorded(hf_tokenizer, tmp_path):
    model, data = encoder(hf_tokenizer), dataset()
    backend = IvfPqIndexConfig(nlist=8, m=4, nbits=4)

    def run(nprobe: int, root):
        return evaluate(model, data, EvaluationSettings(
            k=20, index_root=root, backend=backend, search=IvfSearchConfig(ncandidates=4, nprobe=nprobe),
            progress=False, metrics=("ndcg@10",)))

    first = run(1, tmp_path / "shared")
    faiss_file = first.store.directory / "colbert.faiss"
    built = faiss_file.stat().st_mtime_ns
    wide, again = run(8, tmp_path / "shared"), run(1, tmp_path / "shared")
    assert faiss_file.stat().st_mtime_ns == built, "the index was reused, not rebuilt"
    for evaluation, nprobe in ((first, 1), (wide, 8), (again, 1)):
        assert evaluation.details["search_stats"]["search"]["nprobe"] == nprobe, "read back from FAISS"
        params = evaluation.details["backend"]["params"]
        assert {k: params[k] for k in ("nlist", "m", "nbits")} == {"nlist": 8, "m": 4, "nbits": 4}
        assert "nprobe" not in params, "search-time settings are not part of the index"
    assert again.run == first.run, "same settings, same ranking"
    assert wide.run != first.run, "the construction makes nprobe matter"
    assert wide.run == run(8, tmp_path / "fresh").run, "the reused index searches as a fresh one with nprobe 8"


def test_plaid_ndocs_and_stage2_changed_on_a_reused_index_are_used_and_recorded(hf_tokenizer, tmp_path):
    model, data = encoder(hf_tokenizer), dataset()
    counts = []
    for search in (PlaidSearchConfig(nprobe=4, ndocs=3, stage2_docs=60),
                   PlaidSearchConfig(nprobe=4, ndocs=3, stage2_docs=1),
                   PlaidSearchConfig(nprobe=16, ndocs=40, stage2_docs=40)):
        evaluation = evaluate(model, data, EvaluationSettings(k=60, index_root=tmp_path,
                                                              backend=PlaidIndexConfig(n_centroids=16),
                                                              search=search, progress=False))
        used = evaluation.details["search_stats"]["search"]
        assert used == {"backend": "plaid", "nprobe": search.nprobe, "ndocs": search.ndocs,
                        "stage2_docs": search.stage2_docs}
        counts.append(evaluation.details["search_stats"]["candidates_max"])
    assert counts[0] == 3, "ndocs bounds each query's candidates"
    assert counts[1] == 1, "stage2_docs 1 lets one document through to stage 3"
    assert counts[2] > 3


def write_beir(folder, data: BeirDataset):
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": d, **doc}) + "\n"
                                                 for d, doc in data.corpus.items()))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n"
                                                  for q, t in data.queries.items()))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{q}\t{d}\t{g}\n" for q, docs in data.qrels.items() for d, g in docs.items()))
    return folder


def test_evaluate_command_records_the_search_settings_it_used(hf_tokenizer, tmp_path):
    """The issue's scenario: nprobe 1, then nprobe 16 on the same --index-root."""
    from hil.cli.evaluate_script import main

    export = encoder(hf_tokenizer).save_pretrained(tmp_path / "export")
    folder = write_beir(tmp_path / "beir", dataset())

    def run(params: dict, out: str) -> dict:
        code = main(["--model", str(export), "--dataset", str(folder), "--backend", "ivfpq",
                     "--backend-params", json.dumps(params), "--index-root", str(tmp_path / "indexes"),
                     "--output", str(tmp_path / out), "--quiet", "--no-stats", "--no-bm25", "--k", "50"])
        assert code == 0
        return json.loads((tmp_path / out / "metrics.json").read_text())

    first = run({"nlist": 16, "m": 4, "nbits": 4, "nprobe": 1, "ncandidates": 4}, "out")
    second = run({"nlist": 16, "m": 4, "nbits": 4, "nprobe": 16, "ncandidates": 4}, "out")  # same folder: resumed
    third = run({"nlist": 16, "m": 4, "nbits": 4, "nprobe": 16, "ncandidates": 4}, "out")
    (name,) = first["results"]
    assert first["results"][name]["search_stats"]["search"]["nprobe"] == 1
    assert second["results"][name]["search_stats"]["search"]["nprobe"] == 16
    assert first["results"][name]["index_dir"] == second["results"][name]["index_dir"], "one index, reused"
    assert (first["results"][name]["search_stats"]["candidates_mean"]
            < second["results"][name]["search_stats"]["candidates_mean"]), "16 lists probed find more candidates"
    assert third["results"] == second["results"], "the same settings keep the finished column"


# -- 2. trec_eval's order, and metrics independent of the search depth ---------------------------------------------

def test_the_rule_is_pytrec_evals_order():
    """With ties everywhere, P@k and success@k reveal which documents pytrec_eval puts first; ours must agree."""
    doc_ids = [f"x{i}" for i in [5, 12, 3, 40, 7, 21, 1]]
    scores = np.array([1.0, 1.0, 2.0, 1.0, 2.0, 1.0, 1.0])
    order = [doc_ids[i] for i in top_k_indices(scores, id_rank(doc_ids), len(doc_ids))]
    run = {"q": {d: float(s) for d, s in zip(doc_ids, scores)}}
    for position, doc in enumerate(order, start=1):
        evaluator = pytrec_eval.RelevanceEvaluator({"q": {doc: 1}}, {"recip_rank"})
        assert evaluator.evaluate(run)["q"]["recip_rank"] == pytest.approx(1.0 / position), doc
    assert order == [d for d, _ in ranked(run["q"])], "one rule for runs and for top-k"


METRICS = ("ndcg@1", "ndcg@3", "ndcg@5", "p@1", "p@3", "recall@3", "mrr@3", "map@3", "success@3")


@settings(max_examples=60, deadline=None)
@given(st.integers(4, 30), st.integers(0, 2 ** 31 - 1), st.integers(1, 4))
def test_metrics_at_k_do_not_depend_on_the_search_depth(n_docs, seed, n_distinct_scores):
    rng = np.random.default_rng(seed)
    doc_ids = [f"{rng.integers(0, 10 ** 6)}-{i}" for i in range(n_docs)]  # unsorted, non-numeric order
    scores = rng.integers(0, n_distinct_scores, size=(3, n_docs)).astype(np.float32)  # many ties
    qids = ["qa", "qb", "qc"]
    qrels = {q: {d: int(g) for d, g in zip(doc_ids, rng.integers(0, 3, n_docs)) if g} or {doc_ids[0]: 1}
             for q in qids}
    deep = rank_matrix(scores, qids, doc_ids, k=n_docs)
    for k in (1, 3, 5):
        shallow = rank_matrix(scores, qids, doc_ids, k=k)
        for qid in qids:
            assert list(shallow[qid]) == list(deep[qid])[:k]
        wanted = [m for m in METRICS if int(m.split("@")[1]) <= k]
        at_depth, _ = evaluate_run(qrels, shallow, wanted)
        from_deep, _ = evaluate_run(qrels, deep, wanted)
        assert at_depth == pytest.approx(from_deep), k


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["cat", "dog", "cat dog", "fish", "cat cat"]), min_size=2, max_size=25),
       st.integers(1, 6))
def test_bm25_top_k_is_the_head_of_a_deeper_bm25_ranking(texts, k):
    ids = [f"d{(7 * i) % 97:02d}" for i in range(len(texts))]
    index = BM25Index.build(ids, texts)
    deep = index.search(["cat"], k=len(texts))[0]
    assert index.search(["cat"], k=k)[0] == deep[:k]
    assert deep == ranked(dict(deep)), "BM25's order is trec_eval's"


# -- 3. self-matches: k candidates besides the query's own document ------------------------------------------------

@pytest.mark.parametrize("mode", ["full", "exhaustive", "rerank"])
def test_k_documents_besides_the_self_match_in_every_mode(hf_tokenizer, tmp_path, mode):
    model, data = encoder(hf_tokenizer), dataset(self_matches=True)
    candidates = first_stage(evaluate_bm25(data, k=30, drop_self_matches=False), 30) if mode == "rerank" else None
    common = dict(mode=mode, index_root=tmp_path, progress=False, metrics=("ndcg@10",))
    keep = evaluate(model, data, EvaluationSettings(k=60, drop_self_matches=False, **common), candidates=candidates)
    for k in (1, 5):
        evaluation = evaluate(model, data, EvaluationSettings(k=k, **common), candidates=candidates)
        for qid, docs in evaluation.run.items():
            assert qid not in docs
            expected = [d for d, _ in ranked(keep.run[qid]) if d != qid][:k]
            assert [d for d, _ in ranked(docs)] == expected, (mode, k, qid)
            assert len(docs) == k
    assert any(qid in keep.run[qid] for qid in data.queries), "the construction retrieves self-matches"
