"""The paper-style report of a :mod:`hil.experiments.paper` run: Tables 2, 3 and 5, Figures 2, 3 and 5.

Everything is recomputed from the files the run left (``eval/<dataset>/<model>.json``, ``*.cosines.npz``,
``train/<variant>/train.json``), so ``--report-only`` rewrites it without touching a model. Numbers are nDCG@10
in percent as in 001; intervals are 95% percentile bootstraps over queries (004 Section 2.1); p-values are
two-sided paired t-tests and paired permutation tests against ColBERT on the same queries.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from hil.evaluation.statistics import bootstrap_ci, paired_permutation_test, paired_t_test
from hil.experiments.profiles import CORPUS_IDF, DATASETS, ENSEMBLES, VARIANTS, ZERO_SHOT, Profile
from hil.provenance import provenance, versions, write_json_atomic

METRIC = "ndcg@10"
MAIN_ROWS = ("bm25", "colbert", "cosreg", "istar", "iso", "aniso", "lambda", "hil", "hil_corpus_idf")
ABLATION_ROWS = ("hil_no_reg", "hil_no_reg_h", "hil_no_reg_l", "hil")
DATASET_LABELS = {"scifact": "SciFact", "nfcorpus": "NFCorpus", "dl19": "DL19 (re-rank)"}


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


def load_results(out: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """dataset key -> model name -> evaluation record, for every finished evaluation."""
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for key in DATASETS:
        folder = out / "eval" / key
        if folder.is_dir():
            results[key] = {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}
    return results


def delta_inter_iso(inter_iso: dict[str, float]) -> float | None:
    """Anisotropic minus isotropic module (H - L, aniso - iso); None for a one-module model."""
    for iso, aniso in (("L", "H"), ("iso", "aniso")):
        if iso in inter_iso and aniso in inter_iso:
            return inter_iso[aniso] - inter_iso[iso]
    return None


def compute_statistics(results: dict[str, dict[str, dict[str, Any]]], profile: Profile) -> dict[str, Any]:
    """Bootstrap intervals of every model, paired tests of every model against ColBERT, per dataset."""
    stats: dict[str, Any] = {}
    for key, models in results.items():
        rows: dict[str, Any] = {}
        reference = models.get("colbert")
        for name, record in models.items():
            per_query = {q: m[METRIC] for q, m in record["per_query"].items()}
            boot = bootstrap_ci(per_query, n_samples=profile.n_bootstrap, seed=profile.seed)
            row: dict[str, Any] = {"mean": boot.observed, "low": boot.low, "high": boot.high, "n": len(per_query)}
            if reference is not None and name != "colbert":
                base = {q: m[METRIC] for q, m in reference["per_query"].items()}
                t = paired_t_test(per_query, base, on="intersection")
                perm = paired_permutation_test(per_query, base, n_permutations=profile.n_permutations,
                                               seed=profile.seed, on="intersection")
                row.update(diff_vs_colbert=t.mean_diff, p_t_vs_colbert=t.p_value, p_perm_vs_colbert=perm.p_value)
            rows[name] = row
        stats[key] = rows
    return stats


def _pct(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or not np.isfinite(value) else f"{100 * value:.{digits}f}"


def _rel(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return "-"
    return f"{100 * (value - base) / base:+.1f}%"


def _p(value: float | None) -> str:
    if value is None or not np.isfinite(value):
        return "-"
    return f"{value:.2g}" if value >= 1e-3 else "<0.001"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _average(stats: dict[str, Any], name: str, keys: Sequence[str]) -> float | None:
    values = [stats[k][name]["mean"] for k in keys if k in stats and name in stats[k]]
    return float(np.mean(values)) if len(values) == len(keys) and values else None


def _inter_iso(results: dict[str, Any], name: str, keys: Sequence[str]) -> dict[str, float]:
    """Each head's InterIso averaged over the zero-shot datasets."""
    per_head: dict[str, list[float]] = {}
    for key in keys:
        record = results.get(key, {}).get(name)
        for head, value in (record or {}).get("inter_iso", {}).items():
            per_head.setdefault(head, []).append(value)
    return {head: float(np.mean(values)) for head, values in per_head.items()}


def table2(results: dict[str, Any], stats: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    keys = [k for k in ZERO_SHOT if k in stats]
    other = [k for k in DATASETS if k in stats and k not in ZERO_SHOT]
    header = ["Model"] + [DATASET_LABELS[k] for k in keys] + ["Avg.", "vs ColBERT", "vs BM25"] + \
             [DATASET_LABELS[k] for k in other]
    rows, summary = [], {}
    colbert_avg, bm25_avg = _average(stats, "colbert", keys), _average(stats, "bm25", keys)
    for name in MAIN_ROWS:
        if not any(name in stats[k] for k in stats):
            continue
        cells = [label(name)]
        for key in keys + other:
            row = stats[key].get(name)
            if row is None:
                cells.append("-")
                continue
            mark = "†" if row.get("p_t_vs_colbert", 1.0) < 0.01 else ""
            cells.append(f"{_pct(row['mean'])}{mark} [{_pct(row['low'], 1)}, {_pct(row['high'], 1)}]")
        avg = _average(stats, name, keys)
        cells[1 + len(keys): 1 + len(keys)] = [_pct(avg), _rel(avg, colbert_avg) if name != "colbert" else "-",
                                              _rel(avg, bm25_avg) if name != "bm25" else "-"]
        rows.append(cells)
        summary[name] = {"avg": avg, **{k: stats[k].get(name, {}).get("mean") for k in keys + other}}
    return _table(header, rows), summary


def significance_table(stats: dict[str, Any]) -> list[str]:
    header = ["Model"] + [f"{DATASET_LABELS[k]}: diff, p (t), p (perm.)" for k in stats]
    rows = []
    for name in MAIN_ROWS + ABLATION_ROWS[:-1]:
        if name in ("colbert",) or not any(name in stats[k] for k in stats):
            continue
        cells = [label(name)]
        for key in stats:
            row = stats[key].get(name, {})
            cells.append("-" if "diff_vs_colbert" not in row else
                         f"{100 * row['diff_vs_colbert']:+.2f}, {_p(row['p_t_vs_colbert'])}, "
                         f"{_p(row['p_perm_vs_colbert'])}")
        rows.append(cells)
    return _table(header, rows)


def table3(results: dict[str, Any], stats: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    keys = [k for k in ZERO_SHOT if k in results]
    header = ["Model", "BEIR Avg. nDCG@10", "DL19 re-rank", "InterIso per module", "Delta InterIso"]
    rows, summary = [], {}
    for name in ("colbert", "cosreg", "istar", "iso", "aniso", "lambda", "hil", "hil_corpus_idf"):
        if not any(name in results[k] for k in results):
            continue
        iso = _inter_iso(results, name, keys)
        delta = delta_inter_iso(iso)
        dl19 = stats.get("dl19", {}).get(name, {}).get("mean")
        rows.append([label(name), _pct(_average(stats, name, keys)), _pct(dl19),
                     ", ".join(f"{h} {v:.3f}" for h, v in iso.items()), "-" if delta is None else f"{delta:.3f}"])
        summary[name] = {"inter_iso": iso, "delta_inter_iso": delta}
    return _table(header, rows), summary


def table5(results: dict[str, Any], stats: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    keys = [k for k in ZERO_SHOT if k in results]
    header = ["Model", "DL19 re-rank (in-domain)", "BEIR Avg.", "Delta InterIso"]
    rows, summary = [], {}
    base: dict[str, float | None] = {}
    for name in ABLATION_ROWS:
        if not any(name in results[k] for k in results):
            continue
        values = {"dl19": stats.get("dl19", {}).get(name, {}).get("mean"), "beir": _average(stats, name, keys),
                  "delta": delta_inter_iso(_inter_iso(results, name, keys))}
        if not base:
            base = values

        def cell(field: str, scale: float = 100.0, digits: int = 2) -> str:
            value = values[field]
            if value is None:
                return "-"
            text = f"{scale * value:.{digits}f}"
            if name != ABLATION_ROWS[0] and base.get(field) is not None:
                text += f" ({scale * (value - base[field]):+.{digits}f})"
            return text

        rows.append([label(name), cell("dl19"), cell("beir"), cell("delta", 1.0, 3)])
        summary[name] = values
    return _table(header, rows), summary


def module_table(results: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """nDCG@10 of each module of the two-module models on its own, beside the combined score."""
    keys = [k for k in DATASETS if k in results]
    header = ["Model"] + [f"{DATASET_LABELS[k]}: {part}" for k in keys for part in ("iso module", "aniso module",
                                                                                      "sum")]
    rows, summary = [], {}
    for name in ("lambda", "hil", "hil_corpus_idf", "hil_no_reg_l", "hil_no_reg_h", "hil_no_reg"):
        cells, found = [label(name)], False
        for key in keys:
            record = results[key].get(name) or {}
            modules = record.get("module_metrics")
            if name == "lambda" and record:  # the members are the iso and aniso rows
                modules = {head: results[key].get(member, {}).get("metrics", {})
                           for head, member in zip(("iso", "aniso"), ENSEMBLES[name][:2])}
            if not modules:
                cells += ["-", "-", "-"]
                continue
            found = True
            (iso_head, iso), (aniso_head, aniso) = modules.items()
            cells += [_pct(iso.get(METRIC)), _pct(aniso.get(METRIC)), _pct(record["metrics"][METRIC])]
            summary.setdefault(name, {})[key] = {iso_head: iso.get(METRIC), aniso_head: aniso.get(METRIC),
                                                 "sum": record["metrics"][METRIC]}
        if found:
            rows.append(cells)
    return _table(header, rows), summary


def figures(out: Path, results: dict[str, Any]) -> dict[str, str]:
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


def qrels_note(key: str, profile: Profile) -> str | None:
    """A sentence on how informative a dataset's judgments are (grades used, share of the corpus judged relevant)."""
    from hil.experiments.paper import load_dataset

    try:
        dataset = load_dataset(key, profile)
    except (OSError, ValueError):
        return None
    grades = sorted({g for judged in dataset.qrels.values() for g in judged.values()})
    relevant = {d for judged in dataset.qrels.values() for d, g in judged.items() if g > 0}
    share = len(relevant) / max(1, len(dataset.corpus))
    text = (f"{DATASET_LABELS[key]}: {len(dataset.queries)} queries, {len(dataset.corpus)} documents, relevance "
            f"grades used {grades}, {100 * share:.0f}% of the documents judged relevant to some query")
    if share > 0.5 and len([g for g in grades if g > 0]) == 1:
        text += (" (nearly every document is relevant to some query, with one grade: re-ranking there is mostly "
                 "telling topics apart, so expect every model near the ceiling)")
    return text


def _verdict(stats: dict[str, Any], summary: dict[str, Any]) -> str:
    keys = [k for k in ZERO_SHOT if k in stats]
    hil, colbert, bm25 = (summary.get(n, {}).get("avg") for n in ("hil", "colbert", "bm25"))
    if hil is None or colbert is None:
        return "ColBERT and ColBERT-HIL did not both finish; no verdict."
    parts = [f"ColBERT-HIL averages {_pct(hil)} nDCG@10 over {', '.join(DATASET_LABELS[k] for k in keys)} against "
             f"ColBERT's {_pct(colbert)} ({_rel(hil, colbert)})"]
    significant = [k for k in keys if stats[k].get("hil", {}).get("p_t_vs_colbert", 1.0) < 0.01]
    if hil > colbert:
        parts.append("so at this scale HIL is ahead of ColBERT" + (
            f", significantly (p < 0.01) on {', '.join(DATASET_LABELS[k] for k in significant)}" if significant
            else ", but not significantly on any dataset (paired t-test p >= 0.01)"))
    else:
        parts.append("so at this scale HIL does not beat ColBERT" + (
            f"; the difference is significant on {', '.join(DATASET_LABELS[k] for k in significant)}"
            if significant else " (no dataset significant at p < 0.01)"))
    if bm25 is not None:
        parts.append(f"BM25 averages {_pct(bm25)}, so HIL is {_rel(hil, bm25)} against BM25")
    return "; ".join(parts) + "."


def _stage_minutes(results: dict[str, Any]) -> float:
    return sum(r["timings"]["encode_s"] + r["timings"]["score_s"] for models in results.values()
               for r in models.values() if r.get("timings")) / 60


def write_report(out: Path, profile: Profile, *, command: str = "", elapsed_s: float | None = None) -> Path:
    from hil.experiments.paper import machine

    out = Path(out)
    results = load_results(out)
    if not results:
        raise FileNotFoundError(f"{out}: no evaluations found (run the experiment first)")
    stats = compute_statistics(results, profile)
    t2, summary2 = table2(results, stats)
    t3, summary3 = table3(results, stats)
    t5, summary5 = table5(results, stats)
    tm, summary_modules = module_table(results)
    made = figures(out, results)
    training = {name: json.loads((out / "train" / name / "train.json").read_text()) for name in VARIANTS
                if (out / "train" / name / "train.json").is_file()}
    host = machine()
    sizes = {k: {"queries": max(len(m["per_query"]) for m in r.values()),
                 "documents": max((m.get("n_docs") or 0 for m in r.values()), default=0)}
             for k, r in results.items()}

    budget = profile.training
    lines = [f"# HIL (001) reproduced at `{profile.name}` scale", "",
             f"Generated {time.strftime('%Y-%m-%d %H:%M')} by `{command or 'python -m hil.experiments.paper'}` "
             f"at commit `{host['commit']}` on {host['cpu']} ({host['cores']} cores, {host['torch_threads']} torch "
             f"threads{', GPU ' + host['gpu'] if host['gpu'] else ''})"
             + (f"; this invocation ran {elapsed_s / 60:.1f} min" if elapsed_s is not None else "") + ". Stage "
             f"totals: training {sum(t['seconds'] for t in training.values()) / 60:.1f} min, document encoding "
             f"and scoring {_stage_minutes(results):.1f} min (model loading, BM25 and figures not counted).", "",
             "## Budget", "",
             f"{profile.description}. Every variant: backbone `{budget.backbone}`, triples `{budget.triples}`"
             + (f" (first {budget.max_triples})" if budget.max_triples else "")
             + f", {budget.max_steps} steps of batch {budget.batch_size}, lr {budget.lr:g} with "
             f"{budget.warmup_steps} warm-up steps, lengths {budget.query_maxlen}/{budget.doc_maxlen}, seed "
             f"{budget.seed}, precision {budget.precision} (`configs/presets/{profile.preset}`); each variant adds "
             "only its config's regularizer.", "",
             "Evaluation: SciFact and NFCorpus (test) by exact late interaction of every query with every document "
             "(full ranking without a first-stage approximation, top "
             f"{profile.k}); TREC DL19 by re-ranking BM25's top {profile.rerank_depth} in the judged pool. "
             "ColBERT-lambda adds the iso and aniso models' scores. nDCG@10 in percent, 95% bootstrap interval "
             f"over queries ({profile.n_bootstrap} samples); † = paired t-test p < 0.01 against ColBERT.", ""]
    if profile.slices:
        lines += [f"Slices (queries, documents): {profile.slices}.", ""]
    notes = [note for note in (qrels_note(k, profile) for k in results) if note]
    lines += ["Judgments: " + "; ".join(notes) + ".", ""] if notes else []
    lines += ["## Verdict", "", _verdict(stats, summary2), "",
              "## Table 2: nDCG@10", "", *t2, "",
              "Paired tests against ColBERT (difference in nDCG@10 points; two-sided p of the paired t-test and of "
              f"a {profile.n_permutations}-sample permutation test):", "", *significance_table(stats), "",
              "## Table 3: Delta InterIso", "",
              "InterIso (001 Eq. 2) of each module on (query, most relevant document) pairs "
              f"(up to {profile.interiso_pairs} per dataset), averaged over SciFact and NFCorpus. Delta = "
              "anisotropic module minus isotropic module.", "", *t3, "",
              "## Each module alone (cf. 001 Table 4's H)", "",
              "nDCG@10 of each module's own score (HIL: L and H after z-scoring; ColBERT-lambda: the iso and aniso "
              "models) and of their sum, which is what the model ranks by.", "", *tm, "",
              "## Table 5: HIL ablation", "",
              "Differences in parentheses are against HIL without both regularizers. 001 reports MS MARCO dev "
              "full ranking in the first column; here the in-domain column is TREC DL19 re-ranking.", "", *t5, ""]
    if made:
        fig_ds = DATASET_LABELS.get(made.get("figure_dataset", ""), "")
        lines += ["## Figures", "", f"From {fig_ds} (query, most relevant document) pairs.", ""]
        if "fig2" in made:
            lines += ["Figure 2: query-document token cosine distributions.", "", f"![Figure 2]({made['fig2']})", ""]
        if "fig3" in made:
            lines += [f"Figure 3: documents in each module's own top {profile.overlap_depth}, summed over queries.",
                      "", f"![Figure 3]({made['fig3']})", ""]
        if "fig5" in made:
            lines += ["Figure 5: InterIso of the backbone's hidden states per layer (right: log10 difference to "
                      "ColBERT-aniso).", "", f"![Figure 5]({made['fig5']})", ""]
    lines += ["## Cost", ""]
    rows = [[label(name), f"{t['seconds'] / 60:.1f}"] for name, t in training.items()]
    if rows:
        lines += _table(["Variant", "training minutes"], rows) + [""]
    rows = []
    for key, models in results.items():
        for name, record in sorted(models.items(), key=lambda item: _order(item[0])):
            timing = record.get("timings")
            if timing:
                rows.append([DATASET_LABELS[key], label(name), f"{timing['encode_s']:.0f}",
                             f"{timing['docs_per_s']:.1f}", f"{timing['score_s']:.0f}"])
    if rows:
        lines += _table(["Dataset", "Model", "encode s", "docs/s", "score s"], rows) + [""]
    lines += ["## Files", "",
              "`summary.json` (every number above, settings, versions), `eval/<dataset>/<model>.json` (metrics, "
              "per-query nDCG, InterIso, overlap), `eval/<dataset>/<model>.trec` (runs), `train/<variant>/` "
              "(training log, TensorBoard/CSV logs, exported model).", ""]
    report = out / "report.md"
    tmp = report.with_name("report.md.tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(report)
    write_json_atomic(out / "summary.json", provenance(
        profile.budget(), command=command, machine=host, versions=versions(), statistics=stats,
        table2=summary2, table3=summary3, table5=summary5, modules=summary_modules, figures=made, training=training, sizes=sizes))
    return report
