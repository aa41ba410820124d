"""hil.evaluation.statistics.adjust_p_values: Holm-Bonferroni and Benjamini-Hochberg adjusted p-values.

References written apart from the implementation: examples worked by hand (the arithmetic is in each test), values
printed by statsmodels 0.15.0 (``multipletests``), and the two procedures as their papers state them, as
step-by-step rejection loops (Holm 1979; Benjamini & Hochberg 1995): rejecting where the adjusted p <= alpha
must reject exactly what the loop rejects.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hil.evaluation.statistics import P_ADJUST_METHODS, adjust_in_families, adjust_p_values, holm_adjusted

P = st.floats(0.0, 1.0, allow_nan=False)


def test_holm_by_hand():
    # Four comparisons, m = 4. Sorted: 0.005 (d), 0.01 (a), 0.03 (c), 0.04 (b).
    #   j = 1: (4 - 1 + 1) * 0.005 = 4 * 0.005 = 0.020 -> running max 0.020   (d)
    #   j = 2: (4 - 2 + 1) * 0.01  = 3 * 0.01  = 0.030 -> running max 0.030   (a)
    #   j = 3: (4 - 3 + 1) * 0.03  = 2 * 0.03  = 0.060 -> running max 0.060   (c)
    #   j = 4: (4 - 4 + 1) * 0.04  = 1 * 0.04  = 0.040 -> running max 0.060   (b: the max keeps the order)
    raw = [0.01, 0.04, 0.03, 0.005]  # a, b, c, d
    assert adjust_p_values(raw, "holm") == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert adjust_p_values(raw) == pytest.approx([0.03, 0.06, 0.06, 0.02])  # Holm is the default
    # Capped at 1: m = 3, sorted 0.2, 0.5, 0.6 -> 3 * 0.2 = 0.6, 2 * 0.5 = 1.0, 1 * 0.6 = 0.6 -> max 1.0
    assert adjust_p_values([0.5, 0.2, 0.6], "holm") == pytest.approx([1.0, 0.6, 1.0])


def test_bh_by_hand():
    # m = 4, sorted 0.005 (d), 0.01 (a), 0.03 (c), 0.04 (b); m p_(j) / j = 4 * p / j:
    #   j = 1: 4 * 0.005 / 1 = 0.020;  j = 2: 4 * 0.01 / 2 = 0.020;  j = 3: 4 * 0.03 / 3 = 0.040;
    #   j = 4: 4 * 0.04 / 4 = 0.040. Running minimum from the largest down: 0.040, 0.040, 0.020, 0.020.
    raw = [0.01, 0.04, 0.03, 0.005]
    assert adjust_p_values(raw, "bh") == pytest.approx([0.02, 0.04, 0.04, 0.02])
    # The minimum from above matters: m = 3, sorted 0.01, 0.04, 0.045 -> 3 * 0.01 = 0.03, 3 * 0.04 / 2 = 0.06,
    # 3 * 0.045 / 3 = 0.045; from the top: 0.045, min(0.06, 0.045) = 0.045, min(0.03, 0.045) = 0.03
    assert adjust_p_values([0.045, 0.01, 0.04], "bh") == pytest.approx([0.045, 0.03, 0.045])


def test_against_statsmodels_values():
    # statsmodels 0.15.0: multipletests(raw, method="holm")[1] and multipletests(raw, method="fdr_bh")[1]
    raw = [0.0008, 0.021, 0.3, 0.0125, 0.049, 0.7, 0.021, 0.002, 0.9, 0.04]
    holm = [0.008, 0.147, 0.9, 0.1, 0.2, 1.0, 0.147, 0.018, 1.0, 0.2]
    bh = [0.008, 0.042, 0.375, 0.0416666666666667, 0.07, 0.7777777777777778, 0.042, 0.01, 0.9, 0.0666666666666667]
    assert adjust_p_values(raw, "holm") == pytest.approx(holm)
    assert adjust_p_values(raw, "bh") == pytest.approx(bh)
    assert adjust_p_values(raw, "none") == pytest.approx(raw)


@settings(max_examples=100, deadline=None)
@given(st.lists(P, min_size=1, max_size=30))
def test_against_statsmodels_when_installed(raw):
    multitest = pytest.importorskip("statsmodels.stats.multitest")
    assert adjust_p_values(raw, "holm") == pytest.approx(multitest.multipletests(raw, method="holm")[1])
    assert adjust_p_values(raw, "bh") == pytest.approx(multitest.multipletests(raw, method="fdr_bh")[1])


def holm_rejections(raw: list[float], alpha: float) -> set[int]:
    """Holm's step-down procedure as stated: from the smallest p, reject while p_(j) <= alpha / (m - j + 1)."""
    order = sorted(range(len(raw)), key=lambda i: raw[i])
    rejected = set()
    for j, i in enumerate(order, start=1):
        if raw[i] > alpha / (len(raw) - j + 1):
            break
        rejected.add(i)
    return rejected


def bh_rejections(raw: list[float], alpha: float) -> set[int]:
    """Benjamini-Hochberg as stated: k = the largest j with p_(j) <= j alpha / m; reject the k smallest."""
    order = sorted(range(len(raw)), key=lambda i: raw[i])
    m = len(raw)
    k = max((j for j, i in enumerate(order, start=1) if raw[i] <= j * alpha / m), default=0)
    return set(order[:k])


@settings(max_examples=200, deadline=None)
@given(st.lists(P, min_size=1, max_size=20), st.sampled_from([0.001, 0.01, 0.05, 0.1, 0.2]))
def test_adjusted_p_rejects_what_the_procedure_rejects(raw, alpha):
    m = len(raw)
    # skip p-values within rounding of a procedure's threshold (alpha / c or j alpha / m), where float products and
    # quotients may round to either side
    assume(all(abs(p * c - alpha) > 1e-12 and abs(p * m / c - alpha) > 1e-12 for p in raw for c in range(1, m + 1)))
    holm, bh = adjust_p_values(raw, "holm"), adjust_p_values(raw, "bh")
    assert {i for i in range(m) if holm[i] <= alpha} == holm_rejections(raw, alpha)
    assert {i for i in range(m) if bh[i] <= alpha} == bh_rejections(raw, alpha)


@settings(max_examples=200, deadline=None)
@given(st.lists(P, min_size=1, max_size=30), st.sampled_from(P_ADJUST_METHODS))
def test_adjusted_is_between_raw_and_one_and_keeps_the_order(raw, method):
    adjusted = adjust_p_values(raw, method)
    raw_array = np.asarray(raw)
    assert np.all(adjusted >= raw_array - 1e-15) and np.all(adjusted <= 1.0)
    for i in range(len(raw)):
        for j in range(len(raw)):
            if raw[i] <= raw[j]:
                assert adjusted[i] <= adjusted[j] + 1e-15


@settings(max_examples=100, deadline=None)
@given(st.lists(P, min_size=1, max_size=30))
def test_holm_is_never_below_bh(raw):
    # (m - j + 1) j >= m for 1 <= j <= m, so Holm's factor is at least BH's m / j at every rank
    assert np.all(adjust_p_values(raw, "holm") >= adjust_p_values(raw, "bh") - 1e-15)


def test_nan_and_none_pass_through_and_are_not_counted():
    raw = [0.01, float("nan"), 0.04, None, 0.03, 0.005]
    for method in P_ADJUST_METHODS:
        adjusted = adjust_p_values(raw, method)
        assert math.isnan(adjusted[1]) and math.isnan(adjusted[3])
        # the family is the four tested comparisons: m = 4, as in the worked examples above
        assert adjusted[[0, 2, 4, 5]] == pytest.approx(adjust_p_values([0.01, 0.04, 0.03, 0.005], method))
    assert np.isnan(adjust_p_values([None, float("nan")])).all()
    assert adjust_p_values([], "bh").size == 0


def test_one_comparison_is_not_changed():
    for method in P_ADJUST_METHODS:
        assert adjust_p_values([0.003], method) == pytest.approx([0.003])


def test_ties_share_one_adjusted_value():
    assert holm_adjusted([0.01, 0.01, 0.01]) == pytest.approx([0.03, 0.03, 0.03])
    assert adjust_p_values([0.02, 0.02, 0.5], "bh") == pytest.approx([0.03, 0.03, 0.5])  # 3 * 0.02 / 2


def test_families_are_adjusted_apart():
    raw = [0.01, 0.02, 0.04, None, 0.03, 0.005]
    families = ["bm25", "colbert", "bm25", "bm25", "colbert", "bm25"]
    adjusted = adjust_in_families(raw, families, "holm")
    # bm25: 0.01, 0.04, 0.005 (m = 3): 3 * 0.005 = 0.015, 2 * 0.01 = 0.02, 1 * 0.04 = 0.04
    # colbert: 0.02, 0.03 (m = 2): 2 * 0.02 = 0.04, max(0.04, 1 * 0.03) = 0.04
    assert adjusted[3] is None
    assert [adjusted[i] for i in (0, 1, 2, 4, 5)] == pytest.approx([0.02, 0.04, 0.04, 0.04, 0.015])
    assert adjust_in_families(raw, families, "none") == [0.01, 0.02, 0.04, None, 0.03, 0.005]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="holm, bh, none"):
        adjust_p_values([0.1], "bonferroni")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        adjust_p_values([0.1, 1.5])
    with pytest.raises(ValueError, match="family labels"):
        adjust_in_families([0.1, 0.2], ["a"])


# ----------------------------------------------------------------------------------------------------------
# the tables: adjusted beside raw, the dagger by the adjusted value, the legend naming correction, family, threshold

N_QUERIES = 30


def shifted(base: np.ndarray, t: float, seed: int, spread: float = 0.05) -> np.ndarray:
    """``base`` plus differences whose paired t statistic is exactly ``t`` (n = 30: t 3.2 gives p ~ 0.0034)."""
    z = np.random.default_rng(seed).normal(size=base.size)
    z = (z - z.mean()) / z.std(ddof=1)  # mean 0, sd 1 exactly: t = mean(d) / (sd(d) / sqrt(n))
    return base + spread * (z + t / math.sqrt(base.size))


@pytest.fixture(scope="module")
def per_query() -> dict[str, dict[str, float]]:
    """A baseline, one model clearly better by a raw t-test (p ~ 0.0034 < 0.01), and three near it (p > 0.3): with
    four comparisons against the baseline, Holm multiplies the smallest p by 4, above 0.01."""
    base = np.random.default_rng(0).uniform(0.3, 0.7, size=N_QUERIES)
    columns = {"base": base, "good": shifted(base, 3.2, 1), "near1": shifted(base, 0.5, 2),
               "near2": shifted(base, -0.8, 3), "bm25": shifted(base, 0.9, 4)}
    return {name: {f"q{i}": float(v) for i, v in enumerate(values)} for name, values in columns.items()}


def raw_t(a: dict[str, float], b: dict[str, float]) -> float:
    from scipy import stats as scipy_stats

    return float(scipy_stats.ttest_rel([a[q] for q in sorted(a)], [b[q] for q in sorted(a)]).pvalue)


def test_the_fixture_has_a_raw_significance_that_holm_removes(per_query):
    p_good = raw_t(per_query["good"], per_query["base"])
    others = [raw_t(per_query[n], per_query["base"]) for n in ("near1", "near2", "bm25")]
    assert p_good < 0.01 < 4 * p_good and min(others) > 0.05


def evaluations(per_query, names):
    from hil.evaluation.evaluate import Evaluation

    return [Evaluation(name, {}, {"ndcg@10": float(np.mean(list(per_query[name].values())))},
                       {q: {"ndcg@10": v, "mrr@10": v / 2} for q, v in per_query[name].items()}) for name in names]


def test_evaluation_statistics_adjusts_each_reference_and_metric_apart(per_query):
    from hil.evaluation.results import evaluation_statistics, format_statistics

    pairs = [("good", "base"), ("near1", "base"), ("near2", "base"), ("bm25", "base"), ("good", "bm25"),
             ("near1", "bm25")]
    stats = evaluation_statistics(evaluations(per_query, ["base", "good", "near1", "near2", "bm25"]),
                                  metrics=("ndcg@10", "mrr@10"), pairs=pairs, n_bootstrap=50, n_permutations=50)
    assert stats["p_adjust"]["method"] == "holm" and "reference" in stats["p_adjust"]["family"]
    rows = stats["paired"]
    for metric in ("ndcg@10", "mrr@10"):
        for reference in ("base", "bm25"):
            family = [r for r in rows if r["metric"] == metric and r["b"] == reference]
            assert len(family) == (4 if reference == "base" else 2)
            for key in ("p_t_test", "p_permutation", "p_bootstrap"):
                expected = holm_adjusted([r[key] for r in family])  # this family alone
                assert [r[f"{key}_adjusted"] for r in family] == pytest.approx(expected)
    good = next(r for r in rows if (r["a"], r["b"], r["metric"]) == ("good", "base", "ndcg@10"))
    assert good["p_t_test"] < 0.01 < good["p_t_test_adjusted"]
    assert f"({good['p_t_test_adjusted']:.3g}" in format_statistics(stats).replace("holm ", "(")
    none = evaluation_statistics(evaluations(per_query, ["base", "good", "near1"]), n_bootstrap=20,
                                 n_permutations=20, p_adjust="none")
    assert all(r["p_t_test_adjusted"] == r["p_t_test"] for r in none["paired"])
    with pytest.raises(ValueError, match="holm, bh, none"):
        evaluation_statistics(evaluations(per_query, ["base", "good"]), n_bootstrap=20, p_adjust="sidak")


def test_beir_table_marks_by_the_adjusted_p_and_states_the_correction(per_query):
    from hil.experiments.beir_sets import BeirSet
    from hil.experiments.beir_table import build_table, render_markdown

    facts = {"queries": N_QUERIES, "documents": 100, "judged_outside_corpus": 0}
    results = {"scifact": {name: {"metrics": {"ndcg@10": float(np.mean(list(values.values())))},
                                  "per_query": {q: {"ndcg@10": v} for q, v in values.items()}, "dataset": facts}
                           for name, values in per_query.items()}}
    columns = ["bm25", "base", "good", "near1", "near2"]
    sets = [BeirSet("scifact", "SciFact")]
    tables = {method: build_table(results, {"scifact": ["scifact"]}, sets, columns, "base", n_bootstrap=50,
                                  p_adjust=method) for method in ("holm", "bh", "none")}
    row = tables["holm"]["rows"][0]
    good = row["p_vs_baseline"]["good"]
    family = [row["p_vs_baseline"][c]["t"] for c in ("bm25", "good", "near1", "near2")]
    assert good["t_adjusted"] == pytest.approx(holm_adjusted(family)[1]) and good["t_adjusted"] > 0.01 > good["t"]
    assert tables["bh"]["rows"][0]["p_vs_baseline"]["good"]["t_adjusted"] == pytest.approx(
        adjust_p_values(family, "bh")[1])
    holm_md, none_md = render_markdown(tables["holm"]), render_markdown(tables["none"])
    score = f"{100 * row['scores']['good']:.2f}"
    assert f"{score}†" not in holm_md and f"{score}†" in none_md  # raw p < 0.01, Holm-adjusted p > 0.01
    assert "Holm-Bonferroni" in holm_md and "one reference" in holm_md
    assert "† = holm-adjusted paired t-test against the baseline p < 0.01" in holm_md
    assert "† = paired t-test against the baseline p < 0.01" in none_md
    assert f"(holm {p_value_text(good['t_adjusted'])} / " in holm_md
    assert "not adjusted" in none_md and "(none " not in none_md
    assert tables["holm"]["statistics"]["p_adjust"] == "holm"


def p_value_text(value: float) -> str:
    from hil.evaluation.tables import p_value

    return p_value(value)


def test_paper_report_marks_by_the_adjusted_p_and_states_the_family(per_query):
    from dataclasses import replace

    from hil.experiments.profiles import PROFILES
    from hil.experiments.records import compute_statistics, significance, table2
    from hil.experiments.report import significance_lines, table2_lines, verdict

    names = {"colbert": "base", "hil": "good", "cosreg": "near1", "istar": "near2", "bm25": "bm25"}
    results = {"scifact": {name: {"per_query": {q: {"ndcg@10": v} for q, v in per_query[source].items()}}
                           for name, source in names.items()}}
    lines = {}
    for method in ("holm", "none"):
        profile = replace(PROFILES["smoke"], n_bootstrap=20, n_permutations=20, p_adjust=method)
        stats = compute_statistics(results, profile)
        summary = {"statistics": stats, "table2": table2(results, stats), "significance": significance(profile)}
        lines[method] = ("\n".join(table2_lines(summary)), "\n".join(significance_lines(summary)), verdict(summary))
    hil = stats["scifact"]["hil"]
    assert hil["p_t_vs_colbert_adjusted"] == hil["p_t_vs_colbert"] < 0.01  # "none": adjusted = raw
    profile = replace(PROFILES["smoke"], n_bootstrap=20, n_permutations=20)
    stats = compute_statistics(results, profile)
    family = [stats["scifact"][n]["p_t_vs_colbert"] for n in ("hil", "cosreg", "istar", "bm25")]
    assert [stats["scifact"][n]["p_t_vs_colbert_adjusted"] for n in ("hil", "cosreg", "istar", "bm25")] == \
        pytest.approx(holm_adjusted(family))
    assert "colbert" not in [n for n, row in stats["scifact"].items() if "p_t_vs_colbert_adjusted" in row]
    score = f"{100 * hil['mean']:.2f}"
    assert f"{score}†" not in lines["holm"][0] and f"{score}†" in lines["none"][0]
    assert "(holm " in lines["holm"][1] and "(none " not in lines["none"][1]
    assert "not significantly" in lines["holm"][2] and "holm-adjusted p < 0.01" in lines["holm"][2]
    assert "significantly (p < 0.01) on SciFact" in lines["none"][2]
    assert "ColBERT on one dataset" in significance(profile)["family"]


def test_analysis_significance_table_shows_raw_and_adjusted(per_query):
    from hil.analysis.render import significance_lines
    from hil.evaluation.results import evaluation_statistics

    stats = evaluation_statistics(evaluations(per_query, ["bm25", "base", "good", "near1", "near2"]),
                                  pairs=[(n, "base") for n in ("good", "near1", "near2", "bm25")], n_bootstrap=20,
                                  n_permutations=20)
    text = "\n".join(significance_lines(stats))
    assert "holm p (t)" in text and "Holm-Bonferroni" in text and "p < 0.01" in text
    good = next(r for r in stats["paired"] if r["a"] == "good")
    good_line = next(line for line in text.splitlines() if line.startswith("| good |"))
    assert "†" not in good_line and f"{good['p_t_test_adjusted']:.4f}" in good_line
    raw = "\n".join(significance_lines({**stats, "p_adjust": {**stats["p_adjust"], "method": "none"}}))
    assert "holm p (t)" not in raw and "†" in next(line for line in raw.splitlines() if line.startswith("| good |"))


@pytest.mark.parametrize("command", ["evaluate", "beir", "paper", "analysis"])
def test_every_command_with_several_comparisons_takes_p_adjust(command):
    from hil.cli.analyze import build_parser as analysis_parser
    from hil.cli.beir import build_parser as beir_parser
    from hil.cli.evaluate_script import build_parser as evaluate_parser
    from hil.cli.paper import build_parser as paper_parser

    parser, required = {"evaluate": (evaluate_parser, ["--model", "m", "--dataset", "d"]),
                        "beir": (beir_parser, ["--model", "m"]), "paper": (paper_parser, []),
                        "analysis": (analysis_parser, ["--model", "m", "--dataset", "d", "--output", "o"])}[command]
    default = parser().parse_args(required).p_adjust
    assert default == ("holm" if command != "paper" else None)  # the paper's None keeps the profile's (holm)
    assert parser().parse_args([*required, "--p-adjust", "bh"]).p_adjust == "bh"
    from hil.errors import UserError

    with pytest.raises((SystemExit, UserError)) as refused:  # a UserError is printed as one line, exit 2
        parser().parse_args([*required, "--p-adjust", "bonferroni"])
    assert "p-adjust" in str(refused.value) if refused.type is UserError else refused.value.code == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(P, min_size=1, max_size=12))
def test_holm_and_bh_equal_statsmodels_multipletests(raw):
    """The library's numbers on any family: Holm (hand-written here: scipy has none) is statsmodels' ``holm``; BH
    (scipy's ``false_discovery_control``) is statsmodels' ``fdr_bh``."""
    from statsmodels.stats.multitest import multipletests

    assert adjust_p_values(raw, "holm") == pytest.approx(multipletests(raw, method="holm")[1], abs=1e-12)
    assert adjust_p_values(raw, "bh") == pytest.approx(multipletests(raw, method="fdr_bh")[1], abs=1e-12)
