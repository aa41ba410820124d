"""The analysis toolkit: each instrument against a slow reference, the figures, and one report on a SciFact slice."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hil.analysis import plots, render
from hil.analysis.layers import layer_inter_iso, log_difference
from hil.analysis.overlap import candidate_overlap, ranked_overlap
from hil.analysis.similarity import isotropy_scores, pair_cosines, token_cosines, top_pairs
from hil.analysis.vocab import PairProjection, content_token_ids, ranks_of, summarize_projections

# -- pure functions -----------------------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(1, 5), st.integers(1, 6), st.integers(0, 10_000))
def test_pair_cosines_match_a_loop(batch, lq, ld, seed):
    generator = torch.Generator().manual_seed(seed)
    q, d = torch.randn(batch, lq, 4, generator=generator), torch.randn(batch, ld, 4, generator=generator)
    qm = torch.rand(batch, lq, generator=generator) > 0.3
    dm = torch.rand(batch, ld, generator=generator) > 0.3
    values, best = pair_cosines(q, d, qm, dm)
    expected, expected_best = [], []
    for b in range(batch):
        for i in range(lq):
            row = [float(F.cosine_similarity(q[b, i], d[b, j], dim=0)) for j in range(ld) if qm[b, i] and dm[b, j]]
            expected += row
            if qm[b, i] and dm[b].any():
                expected_best.append(max(row))
    assert np.allclose(values.numpy(), expected, atol=1e-5)
    assert np.allclose(best.numpy(), expected_best, atol=1e-5)


def test_token_cosines_mean_is_inter_iso(tiny_random_colbert):
    from hil.isotropy.metrics import inter_iso

    queries, docs = ["what do cats eat", "protein folding"], ["cats eat fish and mice", "proteins fold quickly"]
    result = token_cosines(tiny_random_colbert, queries, docs, batch_size=1)
    with torch.inference_mode():
        q, d = tiny_random_colbert.encode_queries(queries), tiny_random_colbert.encode_documents(docs)
    per_pair = inter_iso(q.heads["colbert"], d.heads["colbert"], q.mask, d.mask)  # (2,) HIL Eq. 2
    counts = q.mask.sum(1) * d.mask.sum(1)
    assert result.summary()["colbert"]["mean"] == pytest.approx(float((per_pair * counts).sum() / counts.sum()),
                                                                abs=1e-5)
    assert result.all_pairs["colbert"].size == int(counts.sum())
    assert result.maxsim["colbert"].size == int(q.mask.sum())


def test_layer_inter_iso_matches_a_direct_computation(tiny_random_colbert):
    encoder = tiny_random_colbert
    queries, docs = ["cats and dogs", "market news"], ["dogs chase cats all day", "stocks fell on monday"]
    curve = layer_inter_iso(encoder.backbone, encoder.tokenizer, queries, docs, batch_size=1)
    assert curve.shape == (encoder.backbone.config.num_hidden_layers + 1,)
    for layer in range(len(curve)):
        values = []
        for query, doc in zip(queries, docs):
            qb, db = encoder.tokenizer.encode_queries([query]), encoder.tokenizer.encode_documents([doc])
            with torch.inference_mode():
                hq = encoder.backbone(input_ids=qb.input_ids, attention_mask=qb.attention_mask,
                                      output_hidden_states=True).hidden_states[layer][0]
                hd = encoder.backbone(input_ids=db.input_ids, attention_mask=db.attention_mask,
                                      output_hidden_states=True).hidden_states[layer][0]
            qv, dv = F.normalize(hq[qb.scoring_mask[0]], dim=-1), F.normalize(hd[db.scoring_mask[0]], dim=-1)
            values.append(float((qv @ dv.T).mean()))  # mean cosine over all token pairs: InterIso
        assert curve[layer] == pytest.approx(np.mean(values), abs=1e-5)


def test_log_difference():
    diff = log_difference(np.array([0.1, 0.5, -0.2, 1.0]), np.array([0.01, 0.5, 0.3]))
    assert diff[0] == pytest.approx(1.0) and diff[1] == pytest.approx(0.0)
    assert math.isnan(diff[2]) and math.isnan(diff[3])


def test_isotropy_scores_order_a_sphere_and_a_cone():
    generator = torch.Generator().manual_seed(0)
    sphere = F.normalize(torch.randn(3000, 16, generator=generator), dim=-1)
    cone = F.normalize(torch.randn(3000, 16, generator=generator) * 0.2 + 1.0, dim=-1)
    iso, aniso = isotropy_scores(sphere), isotropy_scores(cone)
    assert iso["I(W)"] > 0.9 > aniso["I(W)"]
    assert abs(iso["avg_cos"]) < 0.01 and aniso["avg_cos"] > 0.8
    assert iso["isoscore"] > 0.9
    assert isotropy_scores(sphere, max_points=100)["n_points"] == 100


def test_top_pairs_follow_trec_order():
    run = {"q2": {"a": 1.0, "b": 3.0}, "q1": {"c": 2.0, "d": 2.0, "e": 1.0}, "q3": {}}
    assert top_pairs(run, depth=1) == [("q1", "d"), ("q2", "b")]  # ties by docid descending, as trec_eval
    assert top_pairs(run, depth=2, max_queries=1) == [("q1", "d"), ("q1", "c")]


def test_overlap_counts():
    stats = {"candidate_sources": {"L": 6, "H": 3, "L+H": 1}}
    first = candidate_overlap(stats, ("L", "H"))
    assert (first["only_L"], first["only_H"], first["both"], first["total"]) == (6, 3, 1, 10)
    assert first["share_L"] == pytest.approx(0.7) and first["share_both"] == pytest.approx(0.1)
    run = {"q": {"d1": 3.0, "d2": 2.0, "d3": 1.0, "d4": 0.5}}
    sources = {"q": {"d1": ("L",), "d2": ("L", "H"), "d3": ("H",), "d4": ("H",)}}
    top = ranked_overlap(run, sources, ("L", "H"), k=3)
    assert (top["only_L"], top["only_H"], top["both"], top["k"]) == (1, 1, 1, 3)
    with pytest.raises(ValueError, match="two-head"):
        candidate_overlap(stats, ("colbert",))


def test_ranks_of_is_one_based_rank():
    log_probs = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.2, 0.3]]).log()
    assert ranks_of(log_probs).tolist() == [[3, 1, 2], [1, 3, 2]]


def test_content_tokens_drop_stopwords_and_punctuation(hf_tokenizer):
    ids = content_token_ids(hf_tokenizer, "The cat, and the hat!")
    assert set(hf_tokenizer.convert_ids_to_tokens(sorted(ids))) == {"cat", "hat"}


def test_projection_summary():
    def pair(shared, retrieved):
        return PairProjection("q", "d", "text", [], [], shared, max((r[0] for r in shared.values()), default=None),
                              max((r[1] for r in shared.values()), default=None), 0.01, retrieved)

    summary = summarize_projections([pair({"a": (1, 2), "b": (30, 200)}, 1), pair({"c": (5, 7)}, None)],
                                    ks=(1, 10), success_depth=5)
    assert summary["coverage_query"] == {1: pytest.approx(1 / 3), 10: pytest.approx(2 / 3)}
    assert summary["coverage_passage"] == {1: 0.0, 10: pytest.approx(2 / 3)}
    assert summary["mrr_shared_in_passage"] == pytest.approx((1 / 2 + 1 / 200 + 1 / 7) / 3)
    assert summary["amnesia_median_max_rank_passage"] == {"retrieved_top5": 200.0, "missed_top5": 7.0}


def test_plots_write_png_files(tmp_path):
    rng = np.random.default_rng(0)
    paths = [
        plots.plot_cosine_distributions({"colbert": rng.uniform(-1, 1, 500), "L": rng.normal(0, .1, 500)},
                                        tmp_path / "a.png"),
        plots.plot_layer_inter_iso({"hil": np.array([.1, .2, .4]), "colbert": np.array([.2, .3, .3])},
                                   tmp_path / "b.png", reference="colbert"),
        plots.plot_overlap({"m": {"heads": ["L", "H"], "only_L": 40, "only_H": 50, "both": 10},
                            "n": {"heads": ["iso", "aniso"], "only_iso": 90, "only_aniso": 0, "both": 10}},
                           tmp_path / "c.png"),
        plots.plot_isotropy([{"variant": v, "head": "colbert", "side": s, "I(W)": .5, "avg_cos": .2, "isoscore": .3}
                             for v in ("base", "whitening") for s in ("queries", "documents")], tmp_path / "d.png"),
        plots.plot_intervals({"a": {"ndcg@10": {"observed": .5, "low": .4, "high": .6, "confidence": .95}}},
                             "ndcg@10", tmp_path / "e.png"),
    ]
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_venn_circle_distance_gives_the_asked_overlap():
    r = math.sqrt(1 / math.pi)  # unit-area circles
    assert plots._circle_distance(r, r, 0.0) == pytest.approx(2 * r, abs=1e-6)
    assert plots._circle_distance(r, r, 1.0) == pytest.approx(0.0, abs=1e-6)
    d = plots._circle_distance(r, r, 0.5)
    lens = 2 * r * r * math.acos(d / (2 * r)) - 0.5 * d * math.sqrt(4 * r * r - d * d)
    assert lens == pytest.approx(0.5, abs=1e-6)


# -- the Markdown renderer (expected text written by hand) ----------------------------------------------------------

def test_render_retrieval_table_with_intervals_and_missing_values():
    report = {"runs": {"bm25": {"metrics": {"mrr@10": 0.5, "recall@100": 1.0}}, "m": {"metrics": {"mrr@10": 0.25}}},
              "statistics": {"confidence": 0.95, "n_bootstrap": 10,
                             "bootstrap": {"bm25": {"ndcg@10": {"observed": 0.6, "low": 0.5, "high": 0.7}}, "m": {}}},
              "figures": {"intervals": "i.png"}}
    assert "\n".join(render.retrieval_lines(report, ["ndcg@10"])) == """## Retrieval quality

Mean per-query metric with its bootstrap 95% percentile interval (10 resamples of all queries; 004 Sec. 2.1).

| run | ndcg@10 | mrr@10 | recall@100 |
|---|---|---|---|
| bm25 | 0.6000 [0.5000, 0.7000] | 0.5000 | 1.0000 |
| m | n/a | 0.2500 | n/a |

![nDCG@10 intervals](i.png)
"""


def test_render_layer_table_with_reference_and_ragged_curves():
    layers = {"values": {"a": [0.1, 0.2], "b": [0.01, 0.02, 0.0004]}, "reference": "b",
              "log10_difference": {"a": [1.0, 1.0]}}
    assert "\n".join(render.layer_lines(layers, {"layers": "l.png"})) == """## InterIso per layer (001 Fig. 5)

Mean InterIso of L2-normalized hidden states on the same pairs; layer 0 = embeddings. Log10 difference to b.

| layer | a | b | log10 diff a |
|---|---|---|---|
| 0 | 0.1000 | 0.0100 | 1.0000 |
| 1 | 0.2000 | 0.0200 | 1.0000 |
| 2 | n/a | 4.00e-04 | n/a |

![layers](l.png)
"""


def test_render_head_overlap_per_stage_or_not_applicable():
    first = {"heads": ["L", "H"], "only_L": 6, "only_H": 3, "both": 1, "share_both": 0.1, "share_L": 0.7,
             "share_H": 0.4}
    ranked = {"heads": ["L", "H"], "k": 10, "only_L": 2, "only_H": 0, "both": 8, "share_both": 0.8, "share_L": 1.0,
              "share_H": 0.8}
    overlaps = {"hil": {"first_stage": first, "ranked": ranked}}
    assert "\n".join(render.head_overlap_lines(overlaps, {"overlap": "o.png"})) == """## Head overlap (001 Fig. 3)

| run | documents | only a | only b | both | share both | share a | share b |
|---|---|---|---|---|---|---|---|
| hil | first_stage | 6 (L) | 3 (H) | 1 | 0.1000 | 0.7000 | 0.4000 |
| hil | top 10 | 2 (L) | 0 (H) | 8 | 0.8000 | 1.0000 | 0.8000 |

![overlap](o.png)
"""
    assert render.head_overlap_lines({}, {}) == [
        "## Head overlap (001 Fig. 3)", "",
        "Not applicable: no two-head model (HIL or ColBERT-lambda) in this analysis.", ""]


def test_render_vocabulary_example_orders_shared_tokens_by_passage_rank():
    example = {"qid": "7", "query": "cats eat fish", "top_query": ["cat", "food"], "docid": "d1",
               "retrieved_rank": None, "top_passage": ["fish", "cat"], "shared": {"cats": [3, 9], "fish": [40, 1]},
               "max_rank_passage": 9, "max_rank_query": 40}
    assert "\n".join(render.example_lines(example)) == """**Query 7**: cats eat fish

- top tokens of Q: cat food
- top tokens of P (doc d1, rank in the model's run: not retrieved): fish cat
- shared tokens (rank in Q, rank in P): fish (Q 40, P 1), cats (Q 3, P 9)
- token amnesia: worst rank in P 9, in Q 40
"""
    assert render.vocabulary_lines({"available": False, "note": "no MLM head"}) == [
        "## Vocabulary projections and token amnesia (003)", "", "Skipped: no MLM head", ""]


def _small_report():
    return {
        "created": "2024-01-01T00:00:00+00:00", "git_commit": None,
        "settings": {"model": "m", "command": "python -m hil.analysis --model m", "seed": 1, "k": 10,
                     "isotropy_tokens": 5, "coe_psi": 10.0, "threshold_k": 5},
        "dataset": {"name": "toy", "split": "test", "queries": 2, "documents": 3, "fingerprint": "abc"},
        "runs": {"m": {"metrics": {"mrr@10": 0.5, "recall@100": 1.0}}},
        "statistics": {"confidence": 0.95, "n_bootstrap": 10, "n_permutations": 20, "paired": [],
                       "bootstrap": {"m": {"ndcg@10": {"observed": 0.5, "low": 0.25, "high": 0.75}}}},
        "isotropy": [{"variant": "m", "head": "colbert", "side": "queries", "n_points": 7, "I(W)": 0.5,
                      "avg_cos": 0.00005, "isoscore": None}],
        "token_cosines": {}, "token_cosine_pairs": 2, "head_overlap": {}, "thresholds": {},
        "layers": {"values": {"m": [0.125]}, "reference": None, "log10_difference": None},
        "vocabulary": {"available": False, "note": "no MLM head"}, "notes": ["x skipped"],
        "figures": {"intervals": "i.png", "isotropy": "iso.png", "token_cosines": "c.png", "layers": "l.png"},
        "timings_s": {"bm25": 0.5, "model": 2}}


def test_render_markdown_sections_in_order_each_table_then_a_blank_line():
    text = render.render_markdown(_small_report(), ["ndcg@10"])
    lines = text.split("\n")
    assert lines[:7] == ["# Analysis: m on toy", "", "```", "python -m hil.analysis --model m", "```", "",
                         "Dataset toy (test): 2 queries, 3 documents (fingerprint abc). Seed 1; full ranking, top 10; "
                         "created 2024-01-01T00:00:00+00:00 (git n/a)."]
    assert [line for line in lines if line.startswith("## ")] == [
        "## Retrieval quality", "## Significance", "## Isotropy", "## Query-document token cosines (001 Fig. 2)",
        "## InterIso per layer (001 Fig. 5)", "## Head overlap (001 Fig. 3)",
        "## Score thresholds and COE / ROE (004 Secs. 2.2-2.3)", "## Vocabulary projections and token amnesia (003)",
        "## Notes", "## Timings (s)"]  # no BM25-Easy split, no transforms: nothing rendered for them
    assert "| m | colbert | queries | 7 | 0.5000 | 5.00e-05 | n/a |" in lines
    table_ends = [i for i, line in enumerate(lines) if line.startswith("|") and not lines[i + 1].startswith("|")]
    assert len(table_ends) == 6 and all(lines[i + 1] == "" for i in table_ends)
    assert text.endswith("## Notes\n\n- x skipped\n\n## Timings (s)\n\nbm25: 0.5, model: 2\n")


def test_judged_pairs_take_the_best_graded_document_in_the_corpus():
    from types import SimpleNamespace

    from hil.analysis.sections import judged_pairs

    dataset = SimpleNamespace(queries={"q3": "", "q1": "", "q2": "", "q4": ""}, corpus={"a": {}, "b": {}, "c": {}},
                              qrels={"q1": {"c": 1, "b": 2, "x": 5}, "q2": {"c": 1, "a": 1}, "q3": {"a": 0},
                                     "q4": {"b": 1}})
    assert judged_pairs(dataset, 10) == [("q1", "b"), ("q2", "a"), ("q4", "b")]  # "x" is not in the corpus
    assert judged_pairs(dataset, 2) == [("q1", "b"), ("q2", "a")]


# -- the MLM head --------------------------------------------------------------------------------------------------

@pytest.mark.integration
def test_mlm_head_found_or_explained(shared_dir, hf_tokenizer, tmp_path):
    from hil.analysis.vocab import load_mlm_head, pooled_states, project
    from hil.modeling.encoder import ColBERTEncoder
    from hil.modeling.loading import load_encoder

    from conftest import random_bert

    tiny = load_encoder("bert-tiny-splade", dim=8)
    head, why = load_mlm_head(tiny)
    assert head is not None and head.vocab_size == 30522, why
    states = pooled_states(tiny.backbone, tiny.tokenizer, ["what is a protein"], is_query=True)
    log_probs = project(head, states)
    assert log_probs.shape == (1, 30522) and torch.allclose(log_probs.exp().sum(), torch.tensor(1.0), atol=1e-4)
    # a backbone saved without an MLM head (like all-MiniLM-L6-v2): skipped, with the reason
    random_bert().save_pretrained(tmp_path / "bare")
    hf_tokenizer.save_pretrained(tmp_path / "bare")
    head, why = load_mlm_head(ColBERTEncoder(str(tmp_path / "bare"), dim=8))
    assert head is None and "no MLM head weights" in why


# -- one report on a SciFact slice --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def report(shared_dir, tmp_path_factory):
    """One analysis of a two-head model (a ColBERT-lambda of two exported untrained members) and its whitening."""
    from hil.analysis.report import AnalysisConfig, run_analysis
    from hil.modeling.encoder import ColBERTEncoder

    output = tmp_path_factory.mktemp("analysis")
    members = []
    for seed, name in ((1, "iso"), (2, "aniso")):
        torch.manual_seed(seed)
        members.append(str(ColBERTEncoder("bert-tiny-splade", dim=32, doc_maxlen=64).save_pretrained(output / name)))
    config = AnalysisConfig(model="+".join(members), transforms=["whitening"], dataset="scifact", max_queries=10,
                            max_docs=200, seed=0, output=str(output), index_root=str(output / "indexes"), k=100,
                            pairs=6, isotropy_tokens=2000, vocab_pairs=10, n_bootstrap=200, n_permutations=500,
                            progress=False)
    return run_analysis(config), output


MODEL, WHITENED = "iso+aniso", "iso+aniso+whitening"


@pytest.mark.integration
def test_report_files_and_sections(report):
    data, output = report
    text = (output / "report.md").read_text()
    for section in ("## Retrieval quality", "## Significance", "## BM25-Easy split", "## Post-hoc transforms",
                    "## Isotropy", "## Query-document token cosines (001 Fig. 2)", "## InterIso per layer (001 Fig. 5)",
                    "## Head overlap (001 Fig. 3)", "## Score thresholds and COE / ROE",
                    "## Vocabulary projections and token amnesia (003)", "**Query "):
        assert section in text, section
    assert json.loads((output / "report.json").read_text())["figures"] == data["figures"]
    from hil.analysis.report import STAT_METRICS

    assert render.render_markdown(json.loads((output / "report.json").read_text()), STAT_METRICS) == text
    assert set(data["figures"]) == {"intervals", "token_cosines", "layers", "overlap", "isotropy"}
    for name in data["figures"].values():
        assert (output / name).stat().st_size > 1000 and f"({name})" in text


@pytest.mark.integration
def test_report_statistics_and_runs(report):
    data, _ = report
    runs = data["runs"]
    assert set(runs) == {"bm25", MODEL, WHITENED}
    assert runs[WHITENED]["transform"]["heads"].keys() == {"iso", "aniso"}  # each head fitted on its own tokens
    paired = {(r["a"], r["b"], r["metric"]): r for r in data["statistics"]["paired"]}
    assert (MODEL, "bm25", "ndcg@10") in paired
    row = paired[(WHITENED, MODEL, "ndcg@10")]
    assert row["n"] == 10 and 0 <= row["p_t_test"] <= 1 and 0 < row["p_permutation"] <= 1
    assert row["mean_diff"] == pytest.approx(runs[WHITENED]["metrics"]["ndcg@10"] - runs[MODEL]["metrics"]["ndcg@10"],
                                             abs=1e-9)
    interval = data["statistics"]["bootstrap"][MODEL]["success@5"]
    assert interval["low"] <= runs[MODEL]["metrics"]["success@5"] <= interval["high"]
    easy = data["statistics"]["bm25_easy"]
    assert easy["n_easy"] == 5 and easy["runs"]["bm25"]["ndcg@10"]["easy"] >= easy["runs"]["bm25"]["ndcg@10"]["hard"]
    thresholds = data["thresholds"][MODEL]
    assert 0 <= thresholds["coe_roe"]["coe"] <= 1 and 0 <= thresholds["coe_roe"]["roe"] <= 1
    assert thresholds["mean_correct"] > thresholds["mean_random"]


@pytest.mark.integration
def test_report_isotropy_layers_overlap_and_vocabulary(report):
    data, _ = report
    rows = {(r["variant"], r["head"], r["side"]): r for r in data["isotropy"]}
    for head in ("iso", "aniso"):
        before, after = rows[(MODEL, head, "documents")], rows[(WHITENED, head, "documents")]
        assert after["avg_cos"] < before["avg_cos"] and after["isoscore"] > before["isoscore"]
        assert abs(after["avg_cos"]) < 0.05  # whitened on these very documents
        cosines = data["token_cosines"]
        assert cosines[WHITENED][head]["mean"] < cosines[MODEL][head]["mean"]
    layers = data["layers"]
    assert layers["reference"] is None and set(layers["values"]) == {f"{MODEL}/iso", f"{MODEL}/aniso"}
    assert all(len(curve) == 3 for curve in layers["values"].values())  # embeddings + 2 layers
    for name in (MODEL, WHITENED):
        overlap, stats = data["head_overlap"][name], data["runs"][name]["search_stats"]
        assert overlap["first_stage"]["total"] == pytest.approx(stats["candidates_mean"] * stats["n_queries"])
        assert 0 < overlap["ranked"]["total"] <= min(overlap["first_stage"]["total"], 10 * 100)
    vocab = data["vocabulary"]
    # the members are exports without an MLM head: the head of the backbone they came from is used
    assert vocab["available"] and vocab["source"] == "bert-tiny-splade" and vocab["summary"]["n_pairs"] == 10
    example = vocab["examples"][0]
    assert len(example["top_query"]) == 20 and all(r[0] >= 1 and r[1] >= 1 for r in example["shared"].values())
