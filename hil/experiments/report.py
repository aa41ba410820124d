"""The paper-style report of a :mod:`hil.experiments.paper` run: Tables 2, 3 and 5, Figures 2, 3 and 5.

Rendering only: every number comes from the record :func:`hil.experiments.records.summarize` computed (also written
as ``summary.json``), the figures from the files the run left (``eval/<dataset>/<model>.json``, ``*.cosines.npz``).
Numbers are nDCG@10 in percent as in 001; intervals are 95% percentile bootstraps over queries (004 Section 2.1);
p-values are two-sided paired t-tests and paired permutation tests against ColBERT on the same queries, each shown
beside its value adjusted for multiple comparisons (Holm-Bonferroni unless the profile's ``p_adjust`` says otherwise,
over every model compared with ColBERT on one dataset); the dagger marks an adjusted t-test p below 0.01.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from hil.evaluation.tables import adjustment_legend, markdown_table, p_with_adjusted, pct, relative
from hil.experiments.profiles import CORPUS_IDF, DATASETS, ENSEMBLES, VARIANTS, ZERO_SHOT, Profile
from hil.experiments.records import (
    ABLATION_ROWS,
    DATASET_LABELS,
    MAIN_ROWS,
    MODULE_ROWS,
    SIGNIFICANCE_FAMILY,
    TABLE3_ROWS,
    Results,
    dataset_column,
)
from hil.provenance import write_text_atomic


def _order(name: str) -> int:
    names = ["bm25", *VARIANTS, *ENSEMBLES, *CORPUS_IDF]
    return names.index(name) if name in names else len(names)


def label(name: str) -> str:
    if name == "bm25":
        return "BM25"
    if name in ENSEMBLES:
        return ENSEMBLES[name][2]
    if name in CORPUS_IDF:
        return CORPUS_IDF[name][1]
    return VARIANTS[name][1] if name in VARIANTS else name


def _keys(summary: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The zero-shot datasets of the run, then the others."""
    stats = summary["statistics"]
    return [k for k in ZERO_SHOT if k in stats], [k for k in DATASETS if k in stats and k not in ZERO_SHOT]


def significance(summary: dict[str, Any]) -> dict[str, Any]:
    """The test, threshold, adjustment and family of the report's dagger (``records.significance``); a summary
    written before adjusted p-values existed reads as unadjusted."""
    return summary.get("significance") or {"test": "paired t-test against ColBERT", "level": 0.01, "p_adjust": "none",
                                           "family": SIGNIFICANCE_FAMILY}


def significant(row: dict[str, Any] | None, summary: dict[str, Any]) -> bool:
    """Whether a model's test against ColBERT on a dataset passes the threshold, by its adjusted p-value (the raw
    one when the adjustment is "none")."""
    rule = significance(summary)
    value = (row or {}).get("p_t_vs_colbert" if rule["p_adjust"] == "none" else "p_t_vs_colbert_adjusted")
    return value is not None and value < rule["level"]


def legend(summary: dict[str, Any]) -> str:
    """The dagger's legend: test, threshold, correction and family."""
    rule = significance(summary)
    return adjustment_legend(rule["p_adjust"], rule["family"], rule["level"], test=rule["test"])


def table2_lines(summary: dict[str, Any]) -> list[str]:
    stats, rows_in = summary["statistics"], summary["table2"]
    keys, other = _keys(summary)
    depth = summary.get("settings", {}).get("rerank_depth", 100)
    header = ["Model"] + [DATASET_LABELS[k] for k in keys] + ["Avg.", "vs ColBERT", "vs BM25"] + \
             [dataset_column(k, depth) for k in other]
    colbert_avg, bm25_avg = (rows_in.get(n, {}).get("avg") for n in ("colbert", "bm25"))
    rows = []
    for name, row_in in rows_in.items():
        cells = [label(name)]
        for key in keys + other:
            row = stats[key].get(name)
            mark = "†" if significant(row, summary) else ""
            cells.append("-" if row is None else
                         f"{pct(row['mean'])}{mark} [{pct(row['low'], 1)}, {pct(row['high'], 1)}]")
        avg = row_in["avg"]
        cells[1 + len(keys): 1 + len(keys)] = [pct(avg), relative(avg, colbert_avg) if name != "colbert" else "-",
                                              relative(avg, bm25_avg) if name != "bm25" else "-"]
        rows.append(cells)
    return markdown_table(header, rows)


def significance_lines(summary: dict[str, Any]) -> list[str]:
    stats, method = summary["statistics"], significance(summary)["p_adjust"]
    header = ["Model"] + [f"{DATASET_LABELS[k]}: diff, p (t), p (perm.)" for k in stats]
    rows = []
    for name in MAIN_ROWS + ABLATION_ROWS[:-1]:
        if name == "colbert" or not any(name in stats[k] for k in stats):
            continue
        cells = [label(name)]
        for key in stats:
            row = stats[key].get(name, {})
            cells.append("-" if "diff_vs_colbert" not in row else
                         f"{100 * row['diff_vs_colbert']:+.2f}, "
                         f"{p_with_adjusted(row['p_t_vs_colbert'], row.get('p_t_vs_colbert_adjusted'), method)}, "
                         f"{p_with_adjusted(row['p_perm_vs_colbert'], row.get('p_perm_vs_colbert_adjusted'), method)}")
        rows.append(cells)
    return markdown_table(header, rows)


def table3_lines(summary: dict[str, Any]) -> list[str]:
    header = ["Model", "BEIR Avg. nDCG@10", "DL19 re-rank", "InterIso per module", "Delta InterIso"]
    rows = [[label(name), pct(row["beir_avg"]), pct(row["dl19"]),
             ", ".join(f"{h} {v:.3f}" for h, v in row["inter_iso"].items()),
             "-" if row["delta_inter_iso"] is None else f"{row['delta_inter_iso']:.3f}"]
            for name, row in summary["table3"].items() if name in TABLE3_ROWS]
    return markdown_table(header, rows)


def table5_lines(summary: dict[str, Any]) -> list[str]:
    """Each ablation beside the first row (HIL without both regularizers), differences in parentheses."""
    rows_in = summary["table5"]
    base = next(iter(rows_in.values()), {})

    def cell(name: str, field: str, scale: float = 100.0, digits: int = 2) -> str:
        value = rows_in[name][field]
        if value is None:
            return "-"
        text = f"{scale * value:.{digits}f}"
        if name != ABLATION_ROWS[0] and base.get(field) is not None:
            text += f" ({scale * (value - base[field]):+.{digits}f})"
        return text

    rows = [[label(name), cell(name, "dl19"), cell(name, "beir"), cell(name, "delta", 1.0, 3)] for name in rows_in]
    return markdown_table(["Model", "DL19 re-rank (in-domain)", "BEIR Avg.", "Delta InterIso"], rows)


def modules_lines(summary: dict[str, Any]) -> list[str]:
    keys = [k for k in DATASETS if k in summary["statistics"]]
    header = ["Model"] + [f"{DATASET_LABELS[k]}: {part}" for k in keys for part in ("iso module", "aniso module",
                                                                                      "sum")]
    rows = []
    for name in (n for n in MODULE_ROWS if n in summary["modules"]):
        cells = [label(name)]
        for key in keys:
            parts = summary["modules"][name].get(key)
            cells += ["-", "-", "-"] if parts is None else [pct(value) for value in parts.values()]
        rows.append(cells)
    return markdown_table(header, rows)


def figures(out: Path, results: Results) -> dict[str, str]:
    """Fig. 2 (token cosine distributions), Fig. 3 (overlap of heads' top documents), Fig. 5 (InterIso by layer)."""
    from hil.analysis.plots import plot_cosine_distributions, plot_layer_inter_iso, plot_overlap

    made: dict[str, str] = {}
    folder = out / "figures"
    figure_key = next((k for k in DATASETS if k in results and any("layer_inter_iso" in r
                                                                    for r in results[k].values())), None)
    if figure_key is None:
        return made
    series = {}
    for name, heads in (("colbert", None), ("iso", None), ("aniso", None), ("hil", ("L", "H"))):
        path = out / "eval" / figure_key / f"{name}.cosines.npz"
        if path.is_file():
            with np.load(path) as saved:
                for head in heads or saved.files:
                    series[label(name) + (f" {head}" if heads else "")] = saved[head].astype(np.float32)
    if series:
        made["fig2"] = str(plot_cosine_distributions(series, folder / "fig2_cosines.png").relative_to(out))
    elif (folder / "fig2_cosines.png").is_file():  # a published report (no score files): the figure as drawn
        made["fig2"] = str((folder / "fig2_cosines.png").relative_to(out))
    overlaps = {label(name): results[figure_key][name]["overlap"] for name in ("lambda", "hil")
                if name in results[figure_key] and results[figure_key][name].get("overlap")}
    if overlaps:
        made["fig3"] = str(plot_overlap(overlaps, folder / "fig3_overlap.png").relative_to(out))
    curves = {}
    for name in ("colbert", "iso", "aniso", "hil"):
        for curve_label, values in results[figure_key].get(name, {}).get("layer_inter_iso", {}).items():
            curves[label(name) + curve_label[len(name):]] = np.asarray(values)
    if curves:
        reference = label("aniso") if label("aniso") in curves else None
        made["fig5"] = str(plot_layer_inter_iso(curves, folder / "fig5_layers.png", reference=reference)
                           .relative_to(out))
    made["figure_dataset"] = figure_key
    return made


def verdict(summary: dict[str, Any]) -> str:
    stats, rows = summary["statistics"], summary["table2"]
    keys, _ = _keys(summary)
    hil, colbert, bm25 = (rows.get(n, {}).get("avg") for n in ("hil", "colbert", "bm25"))
    if hil is None or colbert is None:
        return "ColBERT and ColBERT-HIL did not both finish; no verdict."
    parts = [f"ColBERT-HIL averages {pct(hil)} nDCG@10 over {', '.join(DATASET_LABELS[k] for k in keys)} against "
             f"ColBERT's {pct(colbert)} ({relative(hil, colbert)})"]
    rule = significance(summary)
    threshold = ("p" if rule["p_adjust"] == "none" else f"{rule['p_adjust']}-adjusted p") + f" < {rule['level']:g}"
    passed = [k for k in keys if significant(stats[k].get("hil"), summary)]
    if hil > colbert:
        parts.append("so at this scale HIL is ahead of ColBERT" + (
            f", significantly ({threshold}) on {', '.join(DATASET_LABELS[k] for k in passed)}" if passed
            else f", but not significantly on any dataset (paired t-test, {threshold} nowhere)"))
    else:
        parts.append("so at this scale HIL does not beat ColBERT" + (
            f"; the difference is significant ({threshold}) on {', '.join(DATASET_LABELS[k] for k in passed)}"
            if passed else f" (no dataset significant at {threshold})"))
    if bm25 is not None:
        parts.append(f"BM25 averages {pct(bm25)}, so HIL is {relative(hil, bm25)} against BM25")
    return "; ".join(parts) + "."


def header_lines(summary: dict[str, Any], profile: Profile) -> list[str]:
    host, budget, training = summary["machine"], profile.training, summary["training"]
    elapsed_s = summary.get("elapsed_s")
    stage_minutes = sum(t["encode_s"] + t["score_s"] for models in summary["timings"].values()
                        for t in models.values()) / 60
    lines = [f"# HIL (001) reproduced at `{profile.name}` scale", "",
             f"Generated {time.strftime('%Y-%m-%d %H:%M')} by `{summary['command'] or 'hil paper'}`"
             f" at commit `{host['commit']}` on {host['cpu']} ({host['cores']} cores, {host['torch_threads']} torch "
             f"threads{', GPU ' + host['gpu'] if host['gpu'] else ''})"
             + (f"; this invocation ran {elapsed_s / 60:.1f} min" if elapsed_s is not None else "") + ". Stage "
             f"totals: training {sum(t['seconds'] for t in training.values()) / 60:.1f} min, document encoding "
             f"and scoring {stage_minutes:.1f} min (model loading, BM25 and figures not counted).", "",
             "## Budget", "",
             f"{profile.description}. Every variant: backbone `{budget.backbone}`, triples `{budget.triples}`"
             + (f" (first {budget.max_triples})" if budget.max_triples else "")
             + f", {budget.max_steps} steps of batch {budget.batch_size}, lr {budget.lr:g} with "
             f"{budget.warmup_steps} warm-up steps, lengths {budget.query_maxlen}/{budget.doc_maxlen}, seed "
             f"{budget.seed}, precision {budget.precision} (`configs/presets/{profile.preset}`); each variant adds "
             "only its config's regularizer.", "",
             "Evaluation: SciFact and NFCorpus (test) by exact late interaction of every query with every document "
             "(full ranking without a first-stage approximation, top "
             f"{profile.k}); TREC DL19 passage by re-ranking the official BM25 run's top "
             f"{profile.rerank_depth} per query (`bm25-top100.trec`; BM25's row is that run as given), against the "
             "official graded qrels (0-3): judgments of passages outside the top 100 count in the ideal DCG as "
             "trec_eval counts them, and binary metrics take grades >= 2 as relevant (TREC DL's convention). "
             "ColBERT-lambda adds the iso and aniso models' scores. nDCG@10 in percent, 95% bootstrap interval "
             f"over queries ({profile.n_bootstrap} samples). {legend(summary)}", ""]
    if profile.slices:
        lines += [f"Slices (queries, documents): {profile.slices}.", ""]
    return lines + (["Judgments: " + "; ".join(summary["judgments"]) + ".", ""] if summary["judgments"] else [])


def length_lines(summary: dict[str, Any]) -> list[str]:
    """nDCG@10 by query length (word pieces), each cell the bucket's mean and, for models other than ColBERT, the
    mean paired difference to ColBERT on the same queries."""
    table = summary.get("by_query_length") or {}
    lines: list[str] = []
    for key, models in table.items():
        buckets = list(next(iter(models.values()), {}))
        if not buckets:
            continue
        counts = {b: max(int(m[b]["n"]) for m in models.values()) for b in buckets}
        header = ["Model"] + [f"{DATASET_LABELS[key]} {b} ({counts[b]} q.)" for b in buckets]
        rows = []
        for name in sorted(models, key=_order):
            cells = [label(name)]
            for bucket in buckets:
                cell = models[name][bucket]
                text = "-" if cell["mean"] is None else pct(cell["mean"])
                if cell.get("diff") is not None:
                    text += f" ({cell['diff'] * 100:+.1f})"
                cells.append(text)
            rows.append(cells)
        lines += [*markdown_table(header, rows), ""]
    return lines


def tables_lines(summary: dict[str, Any], profile: Profile) -> list[str]:
    return ["## Verdict", "", verdict(summary), "",
            "## Table 2: nDCG@10", "", *table2_lines(summary), "",
            "Paired tests against ColBERT (difference in nDCG@10 points; two-sided p of the paired t-test and of "
            f"a {profile.n_permutations}-sample permutation test, each followed in parentheses by its adjusted "
            f"value). {legend(summary)}", "", *significance_lines(summary), "",
            "## Table 3: Delta InterIso", "",
            "InterIso (001 Eq. 2) of each module on (query, most relevant document) pairs "
            f"(up to {profile.interiso_pairs} per dataset), averaged over SciFact and NFCorpus. Delta = "
            "anisotropic module minus isotropic module.", "", *table3_lines(summary), "",
            "## Each module alone (cf. 001 Table 4's H)", "",
            "nDCG@10 of each module's own score (HIL: L and H after z-scoring; ColBERT-lambda: the iso and aniso "
            "models) and of their sum, which is what the model ranks by.", "", *modules_lines(summary), "",
            "## Table 5: HIL ablation", "",
            "Differences in parentheses are against HIL without both regularizers. 001 reports MS MARCO dev "
            "full ranking in the first column; here the in-domain column is TREC DL19 re-ranking.", "",
            *table5_lines(summary), "",
            *(["## nDCG@10 by query length", "",
               "Queries bucketed by their word pieces (no special tokens); in parentheses the mean paired difference "
               "to ColBERT on the same queries, in points.", "", *length_lines(summary)]
              if summary.get("by_query_length") else [])]


def figure_lines(made: dict[str, str], profile: Profile) -> list[str]:
    if not made:
        return []
    lines = ["## Figures", "", f"From {DATASET_LABELS.get(made.get('figure_dataset', ''), '')} (query, most "
             "relevant document) pairs.", ""]
    if "fig2" in made:
        lines += ["Figure 2: query-document token cosine distributions.", "", f"![Figure 2]({made['fig2']})", ""]
    if "fig3" in made:
        lines += [f"Figure 3: documents in each module's own top {profile.overlap_depth}, summed over queries.",
                  "", f"![Figure 3]({made['fig3']})", ""]
    if "fig5" in made:
        lines += ["Figure 5: InterIso of the backbone's hidden states per layer (right: log10 difference to "
                  "ColBERT-aniso).", "", f"![Figure 5]({made['fig5']})", ""]
    return lines


def cost_lines(summary: dict[str, Any]) -> list[str]:
    lines = ["## Cost", ""]
    rows = [[label(name), f"{t['seconds'] / 60:.1f}"] for name, t in summary["training"].items()]
    if rows:
        lines += markdown_table(["Variant", "training minutes"], rows) + [""]
    rows = [[DATASET_LABELS[key], label(name), f"{t['encode_s']:.0f}", f"{t['docs_per_s']:.1f}", f"{t['score_s']:.0f}"]
            for key, models in summary["timings"].items()
            for name, t in sorted(models.items(), key=lambda item: _order(item[0]))]
    if rows:
        lines += markdown_table(["Dataset", "Model", "encode s", "docs/s", "score s"], rows) + [""]
    return lines + ["## Files", "",
                    "`summary.json` (every number above, settings, versions), `eval/<dataset>/<model>.json` "
                    "(metrics, per-query nDCG, InterIso, overlap), `eval/<dataset>/<model>.trec` (runs), "
                    "`train/<variant>/` (training log, TensorBoard/CSV logs, exported model).", ""]


def write_report(out: Path, profile: Profile, summary: dict[str, Any], results: Results) -> Path:
    """``report.md`` under ``out`` from the run's summary record (and its figures from the run's files)."""
    made = figures(out, results)
    summary["figures"] = made
    lines = [*header_lines(summary, profile), *tables_lines(summary, profile), *figure_lines(made, profile),
             *cost_lines(summary)]
    report = Path(out) / "report.md"
    write_text_atomic(report, "\n".join(lines))
    return report
