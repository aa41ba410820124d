"""001 Table 2 from per-dataset results: BEIR datasets as rows, BM25 and the models as columns, nDCG@10.

Pure: ``build_table(results, sets, columns, baseline)`` turns the records :mod:`hil.experiments.beir` wrote
(``<out>/<part>/<column>.json``: ``metrics`` and ``per_query``) into the table's record (``table.json``);
``render_markdown`` writes it as ``table.md``. Choices:

- A cell is the dataset's mean metric over its queries, as its results file gives it. CQADupStack's is the mean of
  its forums' means (BEIR's convention: every forum counts the same, whatever its number of queries).
- Each row carries a 95% percentile bootstrap interval per column and paired tests (t, permutation, bootstrap:
  :func:`hil.evaluation.results.evaluation_statistics`) of each model against BM25 and of each column against the
  baseline model. CQADupStack's interval resamples queries within each forum
  (:func:`~hil.evaluation.statistics.stratified_bootstrap_ci`); its tests run on the pooled forum queries, each
  value scaled by ``N / (F * n_f)`` (N queries in all, F forums, n_f in its forum), so that the plain mean of the
  pooled values (and of their differences) is the mean of the forum means: both are about the number in the
  table.
- Every p-value is shown beside its value adjusted for multiple comparisons (``p_adjust``: Holm-Bonferroni by
  default, Benjamini-Hochberg, or none; :func:`hil.evaluation.statistics.adjust_p_values`) over :data:`FAMILY`,
  and the dagger marks an adjusted t-test p below :data:`SIGNIFICANCE` against the baseline.
- The average is over the rows counted in it (the zero-shot ones: 001 leaves MS MARCO out) that every column has;
  rows some column lacks are listed as left out rather than averaged over fewer datasets.
- "vs" rows give the relative change of the average, ``(avg - avg_ref) / avg_ref``, and the difference in points.
  001's "Avg. Performance vs." rows are in fact differences in points marked "%" (its BM25 and ColBERT columns
  average 42.42 and 41.94; the row says -0.48%): both are shown so either reading can be compared.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from hil.evaluation.evaluate import Evaluation

# CQADupStack's rule is hil evaluate's too (a folder of forums): one function, in the evaluation layer.
from hil.evaluation.results import Cell, evaluation_statistics, forum_mean, record_cell
from hil.evaluation.statistics import SIGNIFICANCE_LEVEL, stratified_bootstrap_ci
from hil.evaluation.tables import adjustment_legend, markdown_table, p_value, pct
from hil.experiments.beir_sets import BeirSet

METRIC = "ndcg@10"
BM25 = "bm25"
SIGNIFICANCE = SIGNIFICANCE_LEVEL  # 001 Table 2's dagger: p < 0.01 against the baseline model
# The comparisons adjusted together (hil.evaluation.results.evaluation_statistics: one reference, one metric).
FAMILY = "the columns compared with one reference (BM25, or the baseline) on one dataset"

Records = Mapping[str, Mapping[str, Mapping[str, Any]]]  # part -> column -> results record


def row_cells(beir_set: BeirSet, parts: Sequence[str], results: Records, columns: Sequence[str],
              metric: str = METRIC) -> dict[str, Cell]:
    """Each column's cell on a set's row; a column lacking one of the parts has none."""
    cells = {}
    for column in columns:
        if not all(column in results.get(part, {}) for part in parts):
            continue
        by_part = {part.rsplit("/", 1)[-1]: record_cell(results[part][column], metric) for part in parts}
        cells[column] = forum_mean(by_part) if beir_set.forums else next(iter(by_part.values()))
    return cells


def relative_change(value: float | None, reference: float | None) -> float | None:
    """``(value - reference) / reference``; None when either is missing or the reference is 0."""
    if value is None or reference is None or reference == 0:
        return None
    return (value - reference) / reference


def comparison_pairs(columns: Sequence[str], baseline: str) -> list[tuple[str, str]]:
    """(a, b) pairs tested as ``a - b``: every model against BM25, every other column against the baseline."""
    pairs = [(column, BM25) for column in columns if column != BM25]
    return pairs + [(column, baseline) for column in columns if column not in (baseline, BM25)] + \
        ([(BM25, baseline)] if BM25 in columns and baseline in columns else [])


def row_statistics(cells: Mapping[str, Cell], baseline: str, n_bootstrap: int, seed: int,
                   metric: str = METRIC, p_adjust: str = "holm") -> dict[str, Any]:
    """Bootstrap intervals of each cell and the paired tests of :func:`comparison_pairs` (none with fewer than two
    queries, where a paired test is undefined), their p-values adjusted by ``p_adjust`` over :data:`FAMILY`."""
    evaluations = [Evaluation(name, {}, {metric: cell.mean}, {q: {metric: v} for q, v in cell.per_query.items()})
                   for name, cell in cells.items()]
    testable = min((len(cell.per_query) for cell in cells.values()), default=0) >= 2
    pairs = comparison_pairs(list(cells), baseline) if testable else []
    return evaluation_statistics(evaluations, metrics=(metric,), pairs=pairs, n_bootstrap=n_bootstrap, seed=seed,
                                 p_adjust=p_adjust)


def paired(statistics: Mapping[str, Any], a: str, b: str) -> dict[str, Any] | None:
    """The raw and adjusted p-values and the mean difference of ``a - b`` from a row's statistics, or None when not
    tested."""
    for row in statistics["paired"]:
        if (row["a"], row["b"]) == (a, b):
            return {"diff": row["mean_diff"], "t": row["p_t_test"], "permutation": row["p_permutation"],
                    "bootstrap": row["p_bootstrap"], "t_adjusted": row["p_t_test_adjusted"],
                    "permutation_adjusted": row["p_permutation_adjusted"],
                    "bootstrap_adjusted": row["p_bootstrap_adjusted"]}
    return None


def _against(scores: Mapping[str, float | None], reference: str) -> dict[str, float | None]:
    """Each column's relative change against the ``reference`` column (None for the reference itself)."""
    return {column: relative_change(value, scores.get(reference)) if column != reference else None
            for column, value in scores.items()}


def _dataset_facts(parts: Sequence[str], results: Records) -> dict[str, Any]:
    """Queries, documents and judgments of documents outside the corpus, summed over the parts (BM25's records)."""
    facts = [next(iter(results[part].values()))["dataset"] for part in parts if results.get(part)]
    return {key: sum(int(f.get(key) or 0) for f in facts) for key in ("queries", "documents", "judged_outside_corpus")}


def build_row(beir_set: BeirSet, parts: Sequence[str], results: Records, columns: Sequence[str], baseline: str,
              n_bootstrap: int, seed: int, p_adjust: str = "holm") -> dict[str, Any]:
    """One row of the table (see the module docstring)."""
    cells = row_cells(beir_set, parts, results, columns)
    scores = {column: cells[column].mean if column in cells else None for column in columns}
    statistics = (row_statistics(cells, baseline, n_bootstrap, seed, p_adjust=p_adjust) if cells
                  else {"bootstrap": {}, "paired": []})
    intervals = {name: interval(name, cell, statistics, n_bootstrap, seed) for name, cell in cells.items()}
    first = beir_set.first_stage
    return {"dataset": beir_set.key, "label": beir_set.label, "in_average": beir_set.in_average,
            "parts": list(parts), "forums": [p.rsplit("/", 1)[-1] for p in parts] if beir_set.forums else None,
            "n_forums": len(beir_set.forums) or None, "first_stage": first.run_file if first else None,
            **_dataset_facts(parts, results), "scores": scores, "intervals": intervals,
            "relative_to_bm25": _against(scores, BM25), "relative_to_baseline": _against(scores, baseline),
            "p_vs_bm25": {c: paired(statistics, c, BM25) for c in columns if c != BM25},
            "p_vs_baseline": {c: paired(statistics, c, baseline) for c in columns if c != baseline}}


def interval(name: str, cell: Cell, statistics: Mapping[str, Any], n_bootstrap: int, seed: int) -> list[float]:
    """Column ``name``'s 95% interval: stratified by forum for a mean over forums, else the row statistics'
    bootstrap."""
    if cell.strata is not None:
        result = stratified_bootstrap_ci(cell.strata, n_samples=n_bootstrap, seed=seed)
        return [result.low, result.high]
    bootstrap = statistics["bootstrap"][name][METRIC]
    return [bootstrap["low"], bootstrap["high"]]


def average_row(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], baseline: str) -> dict[str, Any]:
    """Each column's mean over the rows counted in the average that every column has, and its change against BM25
    and the baseline (relative, and in points)."""
    counted = [r for r in rows if r["in_average"] and all(r["scores"][c] is not None for c in columns)]
    scores = {c: float(np.mean([r["scores"][c] for r in counted])) if counted else None for c in columns}

    def points(reference: str) -> dict[str, float | None]:
        base = scores.get(reference)
        return {c: None if v is None or base is None or c == reference else v - base for c, v in scores.items()}

    return {"datasets": [r["dataset"] for r in counted],
            "left_out": [r["dataset"] for r in rows if r["in_average"] and r not in counted],
            "scores": scores, "relative_to_bm25": _against(scores, BM25), "points_vs_bm25": points(BM25),
            "relative_to_baseline": _against(scores, baseline), "points_vs_baseline": points(baseline)}


def build_table(results: Records, parts: Mapping[str, Sequence[str]], sets: Sequence[BeirSet],
                columns: Sequence[str], baseline: str, *, n_bootstrap: int = 1000, seed: int = 0,
                missing: Sequence[str] = (), p_adjust: str = "holm") -> dict[str, Any]:
    """Table 2's record: one row per set of ``sets`` (in that order) over its ``parts``, then the average.

    ``columns`` are ``bm25`` and the models, in order; ``baseline`` is one of the models; ``p_adjust`` the
    multiple-comparison adjustment ("holm", "bh" or "none").
    """
    if baseline not in columns:
        raise ValueError(f"baseline {baseline!r} is not among the columns {list(columns)}")
    rows = [build_row(s, parts[s.key], results, columns, baseline, n_bootstrap, seed, p_adjust) for s in sets]
    return {"metric": METRIC, "columns": list(columns), "baseline": baseline, "rows": rows,
            "average": average_row(rows, columns, baseline), "missing": list(missing),
            "statistics": {"n_bootstrap": n_bootstrap, "seed": seed, "confidence": 0.95,
                           "significance": SIGNIFICANCE, "dagger_test": "paired t-test against the baseline",
                           "p_adjust": p_adjust, "family": FAMILY}}


# -- rendering ---------------------------------------------------------------------------------------------------

def column_label(column: str) -> str:
    return "BM25" if column == BM25 else column


def change(relative: float | None, points: float | None = None) -> str:
    """``+5.24%`` (relative), with ``(+2.22 pts)`` when the difference in points is given; ``-`` when undefined."""
    if relative is None:
        return "-"
    return f"{100 * relative:+.2f}%" + (f" ({100 * points:+.2f} pts)" if points is not None else "")


def row_notes(row: Mapping[str, Any]) -> list[str]:
    """What a reader must know to compare a row with published figures."""
    notes = []
    if not row["in_average"]:
        notes.append("in-domain for MS MARCO-trained models: not in the average")
    if row["first_stage"]:
        notes.append(f"re-ranks the shipped first-stage run ({row['first_stage']}), which is its BM25 column")
    if row["forums"] is not None:
        notes.append(f"the mean of its forums' nDCG@10, as BEIR reports it ({len(row['forums'])} of "
                     f"{row['n_forums']} forums: {', '.join(row['forums'])})")
    outside = row["judged_outside_corpus"]
    if outside:
        notes.append(f"{outside} judgment{'s' if outside > 1 else ''} of documents outside the corpus, kept: they "
                     "count in the ideal DCG, as in trec_eval")
    return notes


def _score_cell(row: Mapping[str, Any], column: str, baseline: str) -> str:
    value = row["scores"][column]
    test = row["p_vs_baseline"].get(column) if column != baseline else None
    adjusted = None if test is None else test.get("t_adjusted")
    dagger = "†" if adjusted is not None and adjusted < SIGNIFICANCE else ""
    return pct(value) + dagger


def main_lines(table: Mapping[str, Any]) -> list[str]:
    """Table 2: a row per dataset, then the average and its changes against BM25 and the baseline."""
    columns, baseline, average = table["columns"], table["baseline"], table["average"]
    rows, footnotes = [], []
    for row in table["rows"]:
        notes = row_notes(row)
        marks = "".join(f" [{len(footnotes) + i + 1}]" for i in range(len(notes)))
        footnotes += notes
        rows.append([row["label"] + marks] + [_score_cell(row, c, baseline) for c in columns])
    n = len(average["datasets"])
    rows.append([f"Avg. ({n} dataset{'s' if n != 1 else ''})"] + [pct(average["scores"][c]) for c in columns])
    for reference, key in ((BM25, "bm25"), (baseline, "baseline")):
        rows.append([f"Avg. vs {column_label(reference)}"] +
                    [change(average[f"relative_to_{key}"][c], average[f"points_vs_{key}"][c])
                     if c != reference else "-" for c in columns])
    lines = markdown_table(["Dataset"] + [column_label(c) for c in columns], rows)
    return lines + [""] + [f"[{i}] {note}." for i, note in enumerate(footnotes, start=1)]


def detail_lines(table: Mapping[str, Any]) -> list[str]:
    """Per dataset and column: the 95% interval, the change against BM25 and the baseline, and paired p-values
    (raw, then adjusted in parentheses)."""
    baseline, method = table["baseline"], table["statistics"].get("p_adjust", "none")
    header = ["Dataset", "Column", "nDCG@10 [95% CI]", "vs BM25", "p vs BM25 (t / perm.)",
              f"vs {baseline}", f"p vs {baseline} (t / perm.)"]
    rows = []
    for row in table["rows"]:
        for column in table["columns"]:
            if row["scores"][column] is None:
                continue
            low, high = row["intervals"].get(column, (None, None))
            rows.append([row["label"], column_label(column), f"{pct(row['scores'][column])} [{pct(low)}, {pct(high)}]",
                         change(row["relative_to_bm25"][column]), _p_cell(row["p_vs_bm25"].get(column), method),
                         change(row["relative_to_baseline"][column]),
                         _p_cell(row["p_vs_baseline"].get(column), method)])
    return markdown_table(header, rows)


def _p_cell(test: Mapping[str, Any] | None, method: str) -> str:
    """``t / perm.`` p-values, then the adjusted ones in parentheses: ``0.004 / 0.005 (holm 0.012 / 0.015)``."""
    if test is None:
        return "-"
    raw = f"{p_value(test['t'])} / {p_value(test['permutation'])}"
    if method == "none":
        return raw
    return raw + f" ({method} {p_value(test.get('t_adjusted'))} / {p_value(test.get('permutation_adjusted'))})"


def render_markdown(table: Mapping[str, Any]) -> str:
    """``table.md``: Table 2, then the per-dataset intervals and tests, then what was left out."""
    stats = table["statistics"]
    lines = ["# BEIR: nDCG@10 in the layout of HIL (001) Table 2", ""]
    lines += [f"- {name}: {model.get('source')} (fingerprint {model.get('fingerprint')})"
              for name, model in table.get("models", {}).items()]
    lines += [f"- baseline: {table['baseline']}. "
              + adjustment_legend(stats.get("p_adjust", "none"), stats.get("family", FAMILY), stats["significance"],
                                  test=stats["dagger_test"]),
              ("- Avg. vs rows: relative change of the average, and its difference in points (001's rows are "
               "differences in points)."), ""]
    lines += main_lines(table)
    lines += ["", (f"## Per dataset: {100 * stats['confidence']:.0f}% bootstrap intervals "
                   f"({stats['n_bootstrap']} samples), changes and paired tests"), ""]
    lines += detail_lines(table)
    if table["average"]["left_out"]:
        lines += ["", f"Not in the average (a column lacks them): {', '.join(table['average']['left_out'])}."]
    if table["missing"]:
        lines += ["", f"Not found, left out: {', '.join(table['missing'])}."]
    return "\n".join(lines) + "\n"
