"""The isotropy x engine study: candidate recall against a hand count, and the study end to end on a slice (an
engine that scores every document finds exact search's ranking; the centered tokens' isotropy is that of the
tokens minus the mean of every stored token, computed here from the index's vectors)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hil.data.beir import load_beir
from hil.evaluation.experiment import ModelSpec
from hil.experiments.engines import Engine, candidate_recall, engine_study, muvera_points, top_documents
from hil.isotropy.metrics import avg_cos
from hil.retrieval.backends.configs import MuveraIndexConfig, MuveraSearchConfig
from hil.retrieval.index import TokenIndex


def test_top_documents_break_ties_by_descending_id():
    assert top_documents({"a": 1.0, "b": 2.0, "c": 1.0, "d": 0.5}, 3) == ["b", "c", "a"]
    assert top_documents({}, 3) == []


def test_candidate_recall_counts_the_exact_top_depth_found():
    exact = {"q1": {"a": 3.0, "b": 2.0, "c": 1.0, "d": 0.0}, "q2": {"a": 1.0, "b": 0.5}, "q3": {}}
    run = {"q1": {"a": 9.0, "c": 8.0, "d": 7.0}, "q2": {"x": 1.0}}
    # q1: exact top 2 {a, b}, run top 2 {a, c} -> 1/2; q2: {a, b} vs {x} -> 0; q3 has no exact documents: left out
    assert candidate_recall(run, exact, 2) == {"q1": 0.5, "q2": 0.0}
    assert candidate_recall(exact, exact, 3) == {"q1": 1.0, "q2": 1.0}


@pytest.mark.integration
def test_engine_study_on_a_slice(tiny_model_dir, tmp_path, capsys):
    dataset = load_beir("scifact").subset(6, 60, seed=1)
    engines = (Engine("all", MuveraIndexConfig(), MuveraSearchConfig(n_candidates=1000)),
               Engine("few, centered", MuveraIndexConfig(transform="center"), MuveraSearchConfig(n_candidates=2)))
    record = engine_study([ModelSpec(str(tiny_model_dir), name="tiny", dim=16)], dataset, tmp_path / "out",
                          engines=engines, depth=10, index_root=tmp_path / "indexes", max_tokens=500,
                          n_bootstrap=50)
    model = record["models"]["tiny"]
    every = model["engines"]["all"]
    assert every["recall@10_vs_exact"] == {"mean": 1.0, "low": 1.0, "high": 1.0}
    assert every["ndcg@10"]["mean"] == pytest.approx(model["exact"]["ndcg@10"]["mean"])
    few = model["engines"]["few, centered"]
    assert few["recall@10_vs_exact"]["mean"] <= 0.2 + 1e-9  # 2 candidates can hold at most 2 of the exact top 10
    assert few["search_stats"]["search"]["n_candidates"] == 2 and few["search_stats"]["candidates_max"] == 2
    # the centered tokens, by hand: every stored token of the head minus their mean, normalized, on the same sample
    (index_dir,) = [p.parent for p in (tmp_path / "indexes").rglob("index.json")]
    index = TokenIndex.load(index_dir)
    head = next(iter(model["isotropy"]))
    stored = np.asarray(index.embeddings[head][:], dtype=np.float64)
    from hil.retrieval.transformed import sample_token_vectors

    sample = sample_token_vectors(index, head, 500, seed=12345).double()
    centered = torch.nn.functional.normalize(sample - torch.from_numpy(stored.mean(axis=0)), dim=-1)
    assert model["isotropy"][head]["center"]["avg_cos"] == pytest.approx(float(avg_cos(centered)), abs=1e-4)
    assert model["isotropy"][head]["none"]["avg_cos"] == pytest.approx(float(avg_cos(sample)), abs=1e-6)
    points = muvera_points(record)
    assert [(m, t) for m, t, _, _ in points] == [("tiny", "none"), ("tiny", "center")]
    assert (tmp_path / "out" / "engines_isotropy.png").is_file()
    text = (tmp_path / "out" / "engines.md").read_text()
    assert "| tiny | all | 60 | 1.0000 [1.0000, 1.0000] |" in text
    assert json.loads((tmp_path / "out" / "engines.json").read_text())["settings"]["depth"] == 10
    # a line as each stage starts (the study ran ~20 s silent before its first result, issue 40), in order
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[engines] tiny: ")]
    assert [line.split(": ", 1)[1] for line in said[:4]] == [
        f"loading {tiny_model_dir}", "exact search over 60 documents (the reference of every engine)", "all",
        "few, centered"] and "recall" in said[4]


def test_models_given_with_seeds_are_trainings_of_one_method():
    from hil.errors import UserError
    from hil.experiments.engines import model_specs

    specs = model_specs("A@1=/a1,A@2=/a2,B=/b")
    assert [(s.column, s.method, s.seed, s.source) for s in specs] == [
        ("A (seed 1)", "A", 1, "/a1"), ("A (seed 2)", "A", 2, "/a2"), ("B", None, None, "/b")]
    for bad in ("A@x=/a", "A@=/a", "=/a", "A"):
        with pytest.raises(UserError, match="name@seed=path"):
            model_specs(bad)


def _entry(method, seed, cos_heads, recalls):
    return {"method": method, "seed": seed, "isotropy": {h: {"none": {"avg_cos": c}} for h, c in cos_heads.items()},
            "engines": {name: {"recall@100_vs_exact": {"mean": r}} for name, r in recalls.items()}}


def test_seed_summary_against_hand_computed_spread():
    from statistics import mean, stdev

    from hil.experiments.engines import seed_summary, summary_lines

    models = {"A (seed 1)": _entry("A", 1, {"L": 0.1, "H": 0.3}, {"MUVERA": 0.5, "PLAID": 0.8}),
              "A (seed 2)": _entry("A", 2, {"L": 0.2, "H": 0.1}, {"MUVERA": 0.6, "PLAID": 0.9}),
              "A (seed 3)": _entry("A", 3, {"L": 0.4, "H": 0.0}, {"MUVERA": 0.4, "PLAID": 0.7}),
              "B (seed 1)": _entry("B", 1, {"c": 0.5}, {"MUVERA": 0.1, "PLAID": 0.1}),  # one seed: no summary
              "C": _entry(None, None, {"c": 0.5}, {"MUVERA": 0.1, "PLAID": 0.1})}
    record = {"settings": {"depth": 100}, "models": models}
    summary = seed_summary(record)
    assert list(summary) == ["A"] and summary["A"]["n_seeds"] == 3
    cosines = [0.3, 0.2, 0.4]  # the most anisotropic head of each seed
    assert summary["A"]["avg_cos"]["mean"] == pytest.approx(mean(cosines))
    assert summary["A"]["avg_cos"]["sd"] == pytest.approx(stdev(cosines))
    muvera = summary["A"]["engines"]["MUVERA"]
    assert (muvera["mean"], muvera["sd"], muvera["min"], muvera["max"]) == pytest.approx(
        (0.5, stdev([0.5, 0.6, 0.4]), 0.4, 0.6))
    assert summary["A"]["engines"]["PLAID"]["mean"] == pytest.approx(0.8)
    # the one-table rendering: methods over their seeds, single models as they are
    record.update(n_queries=3, n_docs=9)
    record["settings"]["dataset"] = "toy"
    lines = summary_lines(record, "fig.png", "engines.md")
    assert "| A | 3 | 0.3000 +- 0.1000 | 0.5000 +- 0.1000 | 0.8000 +- 0.1000 |" in lines
    assert "| B | 1 | 0.5000 | 0.1000 | 0.1000 |" in lines and "| C | 1 | 0.5000 | 0.1000 | 0.1000 |" in lines
    assert lines[-1] == "![isotropy against MUVERA recall](fig.png)"


def test_muvera_points_plot_a_two_head_models_most_anisotropic_head_per_transform():
    # Two heads, the anisotropic one second in one model and first in the other, and a transform under which the
    # order flips: the figure's x is the head SimHash sees worst, per model and per transform (the max, not the min,
    # nor the first head).
    muvera = {"class_path": "hil.retrieval.backends.configs.MuveraIndexConfig"}
    plaid = {"class_path": "hil.retrieval.backends.configs.PlaidIndexConfig"}

    def entry(isotropy, recall):
        return {"isotropy": isotropy, "engines": {
            "MUVERA": {"backend": muvera, "transform": "none", "recall@100_vs_exact": {"mean": recall}},
            "MUVERA centered": {"backend": muvera, "transform": "centered", "recall@100_vs_exact": {"mean": recall}},
            "PLAID": {"backend": plaid, "transform": "none", "recall@100_vs_exact": {"mean": 0.9}}}}

    record = {"settings": {"depth": 100}, "models": {
        "HIL": entry({"lexical": {"none": {"avg_cos": 0.1}, "centered": {"avg_cos": 0.05}},
                      "semantic": {"none": {"avg_cos": 0.6}, "centered": {"avg_cos": 0.02}}}, 0.4),
        "other": entry({"a": {"none": {"avg_cos": 0.7}, "centered": {"avg_cos": 0.01}},
                        "b": {"none": {"avg_cos": 0.2}, "centered": {"avg_cos": 0.03}}}, 0.3)}}
    assert sorted(muvera_points(record)) == sorted([("HIL", "none", 0.6, 0.4), ("HIL", "centered", 0.05, 0.4),
                                                    ("other", "none", 0.7, 0.3), ("other", "centered", 0.03, 0.3)])


@pytest.mark.integration
def test_engine_study_reuses_unchanged_models_and_remeasures_changed_ones(tiny_model_dir, tmp_path, monkeypatch,
                                                                        capsys):
    import hil.experiments.engines as engines_module

    dataset = load_beir("scifact").subset(4, 40, seed=1)
    engines = (Engine("all", MuveraIndexConfig(), MuveraSearchConfig(n_candidates=1000)),)
    kwargs = dict(engines=engines, depth=5, index_root=tmp_path / "indexes", max_tokens=200, n_bootstrap=20)
    models = [ModelSpec(str(tiny_model_dir), name="m (seed 1)", dim=16, seed=1, method="m"),
              ModelSpec(str(tiny_model_dir), name="m (seed 2)", dim=20, seed=2, method="m")]
    first = engine_study(models, dataset, tmp_path / "out", **kwargs)
    measured = []
    real = engines_module.model_record
    monkeypatch.setattr(engines_module, "model_record", lambda name, *a, **k: measured.append(name) or real(
        name, *a, **k))
    again = engine_study(models, dataset, tmp_path / "out", **kwargs)
    assert measured == [] and "reused" in capsys.readouterr().err
    assert again["models"] == json.loads(json.dumps(first["models"]))
    # another head size is another model under the same name: measured again; the unchanged one is reused
    changed = [models[0], ModelSpec(str(tiny_model_dir), name="m (seed 2)", dim=24, seed=2, method="m")]
    engine_study(changed, dataset, tmp_path / "out", **kwargs)
    assert measured == ["m (seed 2)"]
    # other study settings: every model measured again
    engine_study(changed, dataset, tmp_path / "out", **{**kwargs, "depth": 6})
    assert measured == ["m (seed 2)", "m (seed 1)", "m (seed 2)"]
    assert "## Over training seeds" in (tmp_path / "out" / "engines.md").read_text()
