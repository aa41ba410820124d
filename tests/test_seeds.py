"""Seeds as a setting: the statistics over seeds against hand computations (t statistics written out, the t
distribution's tail from scipy.stats.t), the seed in a column's identity (two seeds never share a column; a rerun
keeps both; another seed is recomputed), the paper profile's training seed (the training command takes it, the
evaluation data does not), a paper run retraining a variant whose budget changed, and the seed report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from hil.errors import UserError
from hil.evaluation.evaluate import EvaluationSettings
from hil.evaluation.runner import DatasetSpec, Experiment, ModelSpec, StatisticsSettings, run_experiment
from hil.evaluation.seeds import VERDICTS, seed_comparison, seed_spread, seed_table, seed_verdict
from hil.experiments.profiles import PROFILES


def two_sided_t(values: list[float]) -> float:
    """p of a one-sample t-test of mean 0, written out: t = mean / (sd / sqrt(n)), df = n - 1."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return 2 * scipy_stats.t.sf(abs(mean / (sd / math.sqrt(n))), n - 1)


def test_seed_spread_is_mean_sample_sd_and_range():
    spread = seed_spread({3: 0.6, 1: 0.5, 2: 0.7})
    assert spread["mean"] == pytest.approx(0.6) and spread["sd"] == pytest.approx(0.1)  # sqrt((0.01+0.01+0)/2)
    assert spread["range"] == pytest.approx(0.2) and (spread["min"], spread["max"]) == (0.5, 0.7)
    assert list(spread["per_seed"]) == ["1", "2", "3"] and spread["n_seeds"] == 3
    assert seed_spread({7: 0.4})["sd"] is None
    with pytest.raises(UserError):
        seed_spread({})


A = {1: {"q1": 0.9, "q2": 0.5, "q3": 0.4, "q4": 0.2, "q5": 0.0},  # q5: never measured for B
     2: {"q1": 0.8, "q2": 0.6, "q3": 0.5, "q4": 0.1, "q5": 0.0},
     3: {"q1": 1.0, "q2": 0.4, "q3": 0.3, "q4": 0.3, "q5": 0.0, "extra": 1.0}}
B = {1: {"q1": 0.7, "q2": 0.5, "q3": 0.2, "q4": 0.2},
     2: {"q1": 0.8, "q2": 0.3, "q3": 0.4, "q4": 0.2},
     3: {"q1": 0.6, "q2": 0.5, "q3": 0.3, "q4": 0.1}}


def test_seed_comparison_against_hand_computation():
    result = seed_comparison(A, B)
    queries = ["q1", "q2", "q3", "q4"]  # "extra" is not measured under every seed, q5 not for B: left out
    assert result["n_queries"] == 4
    seed_level = {s: (np.mean([A[s][q] for q in queries]), np.mean([B[s][q] for q in queries])) for s in (1, 2, 3)}
    diffs = [seed_level[s][0] - seed_level[s][1] for s in (1, 2, 3)]  # 0.1, 0.075, 0.1
    assert [result["per_seed_difference"][str(s)] for s in (1, 2, 3)] == pytest.approx(diffs)
    assert result["signs"] == "+++" and result["mean_difference"] == pytest.approx(np.mean(diffs))
    assert result["p_t_test_seeds"] == pytest.approx(two_sided_t(diffs))
    per_query = [np.mean([A[s][q] for s in (1, 2, 3)]) - np.mean([B[s][q] for s in (1, 2, 3)]) for q in queries]
    assert result["p_t_test_queries"] == pytest.approx(two_sided_t(per_query))


def test_seed_comparison_pairs_by_seed_and_handles_constant_differences():
    # seeds 1 and 2 shared; B's seed 9 counts in its mean but has no partner
    b = {1: {"q1": 0.5, "q2": 0.5}, 2: {"q1": 0.6, "q2": 0.4}, 9: {"q1": 0.0, "q2": 0.0}}
    a = {1: {"q1": 0.7, "q2": 0.5}, 2: {"q1": 0.7, "q2": 0.5}, 5: {"q1": 0.6, "q2": 0.6}}  # a's seed 5: no partner
    result = seed_comparison(a, b)
    assert result["per_seed_difference"] == pytest.approx({"1": 0.1, "2": 0.1}) and result["signs"] == "++"
    assert result["p_t_test_seeds"] == 0.0  # a nonzero constant difference: scipy's t is infinite
    assert result["mean_difference"] == pytest.approx((0.6 + 0.6 + 0.6) / 3 - (0.5 + 0.5 + 0.0) / 3)
    same = seed_comparison(a, a)
    assert same["p_t_test_seeds"] == 1.0 and same["signs"] == "000" and seed_verdict(
        {**same, "p_t_test_seeds_adjusted": 1.0}) == "no difference"
    assert seed_comparison({1: {"q1": 0.2, "q2": 0.1}}, {1: {"q1": 0.1, "q2": 0.3}})["p_t_test_seeds"] is None


@pytest.mark.parametrize("signs, mean, p, verdict", [
    ("+++", 0.1, 0.01, VERDICTS[0]), ("+++", 0.1, 0.2, VERDICTS[1]), ("++-", 0.1, 0.01, VERDICTS[2]),
    ("---", -0.1, 0.04, VERDICTS[0]), ("---", -0.1, None, VERDICTS[1]), ("+0+", 0.1, 0.01, VERDICTS[2]),
    ("000", 0.0, 1.0, VERDICTS[3])])
def test_seed_verdict(signs, mean, p, verdict):
    assert seed_verdict({"signs": signs, "mean_difference": mean, "p_t_test_seeds_adjusted": p}) == verdict


def test_seed_table_adjusts_each_test_within_its_family_by_holm():
    c = {s: {q: v - 0.3 for q, v in per.items()} for s, per in B.items()}
    c[2]["q1"] = 0.9  # not a constant shift
    table = seed_table({"ref": B, "a": A, "c": c}, "ref")
    assert table["reference"] == "ref" and set(table["comparisons"]) == {"a", "c"}
    for test in ("p_t_test_queries", "p_t_test_seeds"):
        raw = [table["comparisons"][name][test] for name in ("a", "c")]
        small, large = sorted(raw)
        holm = {small: min(1.0, 2 * small), large: min(1.0, max(2 * small, large))}  # Holm for two, by hand
        for name in ("a", "c"):
            comparison = table["comparisons"][name]
            assert comparison[f"{test}_adjusted"] == pytest.approx(holm[comparison[test]])
    assert table["spread"]["ref"]["mean"] == pytest.approx(np.mean([np.mean(list(B[s].values())) for s in B]))
    with pytest.raises(UserError):
        seed_table({"a": A}, "colbert")


def test_a_name_with_seed_needs_a_seed():
    assert ModelSpec("x/export", name="m-s{seed}", seed=4).column == "m-s4"
    with pytest.raises(UserError, match="seed"):
        ModelSpec("x/export", name="m-s{seed}")


def seeded(tiny_model_dir, out, seeds: tuple[int, ...]) -> Experiment:
    settings = EvaluationSettings(mode="exhaustive", k=20, index_root=None, progress=False)
    models = [ModelSpec(str(tiny_model_dir), name="tiny-{seed}", dim=16, seed=seed, method="tiny") for seed in seeds]
    models.append(ModelSpec(str(tiny_model_dir), name="other-{seed}", dim=16, seed=seeds[0], method="other"))
    return Experiment([DatasetSpec("scifact", max_queries=6, max_docs=80)], models, out, settings=settings,
                      statistics=StatisticsSettings(metrics=("ndcg@10",), bootstrap_samples=50, permutations=50),
                      quiet=True)


@pytest.mark.integration
def test_the_seed_is_part_of_a_columns_identity(tiny_model_dir, tmp_path):
    """One model under two seeds (the same weights: only the seed tells them apart) makes two columns; a rerun
    keeps both; a third seed adds one column and leaves the others; the statistics summarize the method."""
    (result,) = run_experiment(seeded(tiny_model_dir, tmp_path, (1, 2)))
    assert [c.name for c in result.columns] == ["bm25", "tiny-1", "tiny-2", "other-1"]
    records = {n: json.loads((tmp_path / "scifact" / f"{n}.json").read_text()) for n in ("tiny-1", "tiny-2")}
    assert records["tiny-1"]["identity"]["column"]["seed"] == 1 and records["tiny-2"]["identity"]["column"]["seed"] == 2
    assert records["tiny-1"]["model"]["method"] == "tiny"
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "scifact").glob("*-*.json")}
    run_experiment(seeded(tiny_model_dir, tmp_path, (1, 2)))
    assert stamps == {p.name: p.stat().st_mtime_ns for p in (tmp_path / "scifact").glob("*-*.json")}
    (result,) = run_experiment(seeded(tiny_model_dir, tmp_path, (1, 2, 3)))
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "scifact").glob("*-*.json")}
    assert {k: after[k] for k in stamps} == stamps and "tiny-3.json" in after
    seeds = json.loads((tmp_path / "scifact" / "metrics.json").read_text())["statistics"]["seeds"]["ndcg@10"]
    assert seeds["reference"] == "tiny" and seeds["spread"]["tiny"]["n_seeds"] == 3
    assert seeds["spread"]["tiny"]["sd"] == 0.0  # one set of weights under three seeds
    assert set(seeds["comparisons"]) == {"other"}


def test_the_training_seed_goes_to_training_only():
    from dataclasses import replace

    profile = PROFILES["smoke"]
    seeded_profile = replace(profile, train_seed=7)
    args = seeded_profile.config_args("hil")
    assert args[args.index("--seed_everything") + 1] == "7" and seeded_profile.training.seed == 7
    assert "--seed_everything" not in profile.config_args("hil")
    assert seeded_profile.seed == profile.seed == profile.training.seed  # slices and bootstraps: the config's seed
    assert seeded_profile.budget()["seed"] == 7 and seeded_profile.budget()["evaluation_seed"] == profile.seed


def test_a_variant_trained_under_another_budget_is_trained_again(tmp_path, monkeypatch):
    from dataclasses import replace

    import hil.experiments.paper as paper

    calls = []

    def fake_run(command, **kwargs):  # what train.py leaves: an export folder at --export_dir
        calls.append(command)
        export = Path(command[command.index("--export_dir") + 1])
        export.mkdir(parents=True)
        (export / paper.CONFIG_NAME).write_text("{}")
        return type("Completed", (), {"returncode": 0})()

    monkeypatch.setattr(paper.subprocess, "run", fake_run)
    profile = PROFILES["smoke"]
    paper.train_variant("colbert", replace(profile, train_seed=1), tmp_path)
    paper.train_variant("colbert", replace(profile, train_seed=1), tmp_path)
    assert len(calls) == 1  # same budget: kept
    paper.train_variant("colbert", replace(profile, train_seed=2), tmp_path)
    assert len(calls) == 2 and calls[-1][calls[-1].index("--seed_everything") + 1] == "2"
    record = json.loads((tmp_path / "train" / "colbert" / "train.json").read_text())
    assert record["budget"]["seed"] == 2
    (tmp_path / "train" / "colbert" / "train.json").unlink()  # an export without a record: trained again
    paper.train_variant("colbert", replace(profile, train_seed=2), tmp_path)
    assert len(calls) == 3


def test_seeds_option_is_checked(capsys):
    from hil.cli.paper import main

    for bad in ("1,x", "1,1", ","):
        assert main(["--profile", "smoke", "--seeds", bad, "--report-only", "--output", "/nonexistent"]) == 2
        assert "--seeds" in capsys.readouterr().err


def test_seed_report_reads_each_seeds_run_and_checks_its_seed(tmp_path):
    from hil.experiments.profiles import PROFILES
    from hil.experiments.seed_report import seed_records, write_seed_report

    def column(seed: int, per_query: dict[str, float], recorded_seed: int | None = None) -> dict:
        metrics = {q: {"ndcg@10": v, "recall@100": v / 2} for q, v in per_query.items()}
        return {"per_query": metrics, "model": {"seed": seed if recorded_seed is None else recorded_seed}}

    for seed in (1, 2, 3):
        for name, values in (("colbert", B[seed]), ("hil", A[seed])):
            path = tmp_path / f"seed-{seed}" / "eval" / "scifact" / f"{name}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(column(seed, values)))
    tables = seed_records(tmp_path, [1, 2, 3])
    assert set(tables) == {"scifact"} and set(tables["scifact"]) == {"ndcg@10", "recall@100"}
    hil = tables["scifact"]["ndcg@10"]["comparisons"]["hil"]
    assert hil["p_t_test_seeds"] == pytest.approx(seed_comparison(A, B)["p_t_test_seeds"]) and hil["signs"] == "+++"
    assert tables["scifact"]["recall@100"]["comparisons"]["hil"]["mean_difference"] == pytest.approx(
        hil["mean_difference"] / 2)
    path = write_seed_report(tmp_path, PROFILES["smoke"], [1, 2, 3])
    text = path.read_text()
    assert "| ColBERT-HIL |" in text and "+++" in text and (tmp_path / "seeds.json").is_file()
    wrong = tmp_path / "seed-2" / "eval" / "scifact" / "hil.json"
    wrong.write_text(json.dumps(column(2, A[2], recorded_seed=5)))
    with pytest.raises(UserError, match="trained with seed 5"):
        seed_records(tmp_path, [1, 2, 3])
