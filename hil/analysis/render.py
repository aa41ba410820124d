"""report.md from the analysis report's dict (the content of report.json): rendering only, nothing computed.

:func:`render_markdown` joins one function per section, each taking the report (or its part) and returning
Markdown lines; a section whose record is empty renders nothing or one line saying why. Tables and numbers come
from :mod:`hil.evaluation.tables` (floats to 4 decimals, scientific below 1e-3, None as "n/a"); every table is
followed by a blank line. The dict is the JSON-safe one (NaN already None), so a report re-read from report.json
renders the same Markdown as when it was written.
"""

from __future__ import annotations

from typing import Any, Sequence

from hil.evaluation.statistics import SIGNIFICANCE_LEVEL
from hil.evaluation.tables import adjustment_legend, fmt, markdown_table


def render_markdown(report: dict[str, Any], stat_metrics: Sequence[str]) -> str:
    """report.md from the report dict (everything in it is also in report.json).

    ``stat_metrics``: the metrics given bootstrap intervals, the leading columns of the retrieval table ("n/a"
    where a run has none); the report uses :data:`hil.analysis.report.STAT_METRICS`.
    """
    stats = report["statistics"]
    lines = [*header_lines(report), *retrieval_lines(report, stat_metrics), *significance_lines(stats),
             *bm25_easy_lines(stats), *transform_lines(report["runs"]),
             *isotropy_lines(report["isotropy"], report["settings"]["isotropy_tokens"], report["figures"]),
             *token_cosine_lines(report), *layer_lines(report["layers"], report["figures"]),
             *head_overlap_lines(report["head_overlap"], report["figures"]),
             *threshold_lines(report["thresholds"], report["settings"]), *vocabulary_lines(report["vocabulary"]),
             *notes_lines(report["notes"]), *timing_lines(report["timings_s"])]
    return "\n".join(lines)


def _table_block(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A Markdown table and the blank line after it."""
    return [*markdown_table(header, rows), ""]


def _interval(row: dict[str, Any] | None) -> str:
    return f"{row['observed']:.4f} [{row['low']:.4f}, {row['high']:.4f}]" if row else "n/a"


def header_lines(report: dict[str, Any]) -> list[str]:
    """Title, the command line that made the report, and the dataset, seed and provenance."""
    cfg, data = report["settings"], report["dataset"]
    lines = [f"# Analysis: {cfg['model']} on {data['name']}", ""]
    if cfg.get("command"):
        lines += ["```", cfg["command"], "```", ""]
    return lines + [f"Dataset {data['name']} ({data['split']}): {data['queries']} queries, {data['documents']} "
                    f"documents (fingerprint {data['fingerprint']}). Seed {cfg['seed']}; full ranking, top "
                    f"{cfg['k']}; created {report['created']} (git {report.get('git_commit') or 'n/a'}).", ""]


def retrieval_lines(report: dict[str, Any], stat_metrics: Sequence[str]) -> list[str]:
    """Each run's metrics with bootstrap intervals (004 Sec. 2.1), then the intervals figure."""
    stats = report["statistics"]
    rows = [[name, *(_interval(stats["bootstrap"].get(name, {}).get(metric)) for metric in stat_metrics),
             run["metrics"].get("mrr@10"), run["metrics"].get("recall@100")]
            for name, run in report["runs"].items()]
    return ["## Retrieval quality", "",
            f"Mean per-query metric with its bootstrap {100 * stats['confidence']:.0f}% percentile interval "
            f"({stats['n_bootstrap']} resamples of all queries; 004 Sec. 2.1).", "",
            *_table_block(["run", *stat_metrics, "mrr@10", "recall@100"], rows),
            f"![nDCG@10 intervals]({report['figures']['intervals']})", ""]


def significance_lines(stats: dict[str, Any]) -> list[str]:
    """Paired t-, permutation and bootstrap tests of each compared pair of runs (001 Table 2 dagger), each p-value
    beside its value adjusted for multiple comparisons; the dagger marks the t-test p that decides (the adjusted one
    unless the method is "none") below the level."""
    rule = stats.get("p_adjust") or {"method": "none", "family": "", "significance": SIGNIFICANCE_LEVEL}
    method, level = rule["method"], rule["significance"]
    tests = ("p_t_test", "p_permutation", "p_bootstrap")
    shown = [*tests, *(f"{key}_adjusted" for key in tests if method != "none")]
    decides = "p_t_test" if method == "none" else "p_t_test_adjusted"

    def cell(r: dict[str, Any], key: str) -> Any:
        value = r.get(key)
        return f"{fmt(value)}†" if key == decides and value is not None and value < level else value

    rows = [[r["a"], r["b"], r["metric"], r["n"], r["mean_a"], r["mean_b"], r["mean_diff"],
             f"[{r['diff_ci'][0]:.4f}, {r['diff_ci'][1]:.4f}]" if r.get("diff_ci") else "n/a",
             *(cell(r, key) for key in shown)] for r in stats["paired"]]
    adjusted_header = [f"{method} p (t)", f"{method} p (perm.)", f"{method} p (boot.)"] if method != "none" else []
    return ["## Significance", "", "Paired tests of per-query metrics, a - b (001 Table 2 dagger): paired t-test, "
            f"sign-flip permutation test ({stats['n_permutations']} permutations, exact when n <= 16) and "
            "paired bootstrap test; the difference's bootstrap interval. "
            + adjustment_legend(method, rule["family"], level), "",
            *_table_block(["a", "b", "metric", "n", "mean a", "mean b", "diff", "diff CI", "p (t)", "p (perm.)",
                           "p (boot.)", *adjusted_header], rows)]


def bm25_easy_lines(stats: dict[str, Any]) -> list[str]:
    """001 Table 4: nDCG@10 on the queries BM25 finds easy and on the rest; nothing without BM25."""
    easy = stats.get("bm25_easy")
    if not easy:
        return []
    rows = [[name, split.get("ndcg@10", {}).get("easy"), split.get("ndcg@10", {}).get("hard")]
            for name, split in easy["runs"].items()]
    return ["## BM25-Easy split", "", f"001 Table 4: queries in the top half of BM25's per-query nDCG@10 "
            f"({easy['n_easy']} easy, {easy['n_hard']} hard; ties broken by query id).", "",
            *_table_block(["run", "nDCG@10 easy", "nDCG@10 hard"], rows)]


def transform_lines(runs: dict[str, Any]) -> list[str]:
    """The fitted post-hoc transforms, one row per run and head; nothing when no run was transformed."""
    transformed = {name: run["transform"] for name, run in runs.items() if run.get("transform")}
    if not transformed:
        return []
    rows = [[name, info["spec"], info["mode"], head, h["fit_info"].get("n_vectors"), h["output_dim"],
             h["fingerprint"], info["index_dir"]]
            for name, info in transformed.items() for head, h in info["heads"].items()]
    return ["## Post-hoc transforms", "", "Fitted on the corpus' stored token vectors of the base index "
            "(000 Sec. 4.1; token-wise unless stated), applied to query and document vectors before scoring, "
            "output L2-normalized; parameters saved as `transform_<head>.pt` in the derived index folder.", "",
            *_table_block(["run", "spec", "mode", "head", "fit vectors", "dim", "fingerprint", "index"], rows)]


def isotropy_lines(isotropy: list[dict[str, Any]], max_tokens: int, figures: dict[str, str]) -> list[str]:
    """I(W), Avg-Cos and IsoScore per run, head and side, then the isotropy figure."""
    rows = [[r["variant"], r["head"], r["side"], r["n_points"], r["I(W)"], r["avg_cos"], r["isoscore"]]
            for r in isotropy]
    return ["## Isotropy", "", "I(W) (partition score, higher = more isotropic), Avg-Cos (lower = more "
            "isotropic) and IsoScore (higher = more isotropic) of the token vectors as scored: every query token "
            f"(queries of the dataset) and up to {max_tokens} sampled document tokens of the index.", "",
            *_table_block(["run", "head", "tokens", "n", "I(W)", "Avg-Cos", "IsoScore"], rows),
            f"![isotropy]({figures['isotropy']})", ""]


def token_cosine_lines(report: dict[str, Any]) -> list[str]:
    """001 Fig. 2: the query-document token cosine summary per run and head, then the figure."""
    rows = [[name, head, s["mean"], s["std"], s["median"], s["maxsim_mean"], s["n_values"]]
            for name, heads in report["token_cosines"].items() for head, s in heads.items()]
    return ["## Query-document token cosines (001 Fig. 2)", "",
            f"Every (query token, document token) cosine for {report['token_cosine_pairs']} queries and BM25's top "
            "document of each; the mean is InterIso over these pairs (001 Eq. 2); MaxSim is each query token's "
            "best match.", "",
            *_table_block(["run", "head", "mean (InterIso)", "std", "median", "mean MaxSim", "values"], rows),
            f"![token cosines]({report['figures']['token_cosines']})", ""]


def layer_lines(layers: dict[str, Any], figures: dict[str, str]) -> list[str]:
    """001 Fig. 5: one row per layer, a column per curve and per log10 difference to the reference."""
    curves, differences = layers["values"], layers["log10_difference"] or {}
    width = max(len(c) for c in curves.values())
    rows = [[i, *[c[i] if i < len(c) else None for c in curves.values()],
             *[d[i] if i < len(d) else None for d in differences.values()]] for i in range(width)]
    reference = f" Log10 difference to {layers['reference']}." if layers["reference"] else ""
    return ["## InterIso per layer (001 Fig. 5)", "", "Mean InterIso of L2-normalized hidden states on the same "
            "pairs; layer 0 = embeddings." + reference, "",
            *_table_block(["layer", *curves, *(f"log10 diff {k}" for k in differences)], rows),
            f"![layers]({figures['layers']})", ""]


def head_overlap_lines(overlaps: dict[str, Any], figures: dict[str, str]) -> list[str]:
    """001 Fig. 3: documents found by one head, the other or both, first stage and top k, per two-head run."""
    if not overlaps:
        return ["## Head overlap (001 Fig. 3)", "",
                "Not applicable: no two-head model (HIL or ColBERT-lambda) in this analysis.", ""]
    rows = []
    for name, overlap in overlaps.items():
        for stage in ("first_stage", "ranked"):
            r = overlap[stage]
            a, b = r["heads"]
            rows.append([name, stage if stage == "first_stage" else f"top {r['k']}", f"{r[f'only_{a}']} ({a})",
                         f"{r[f'only_{b}']} ({b})", r["both"], r["share_both"], r[f"share_{a}"], r[f"share_{b}"]])
    return ["## Head overlap (001 Fig. 3)", "",
            *_table_block(["run", "documents", "only a", "only b", "both", "share both", "share a", "share b"], rows),
            f"![overlap]({figures['overlap']})", ""]


def threshold_lines(thresholds: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    """004 Secs. 2.2-2.3: mean scores, COE / ROE and the best threshold per run, then each run's threshold table."""
    rows = []
    for name, t in thresholds.items():
        c, best = t["coe_roe"], t["best_threshold"]
        rows.append([name, t["n_queries"], t["mean_correct"], t["mean_topk"], t["mean_random"],
                     f"{c['coe']:.3f} [{c['coe_low']:.3f}, {c['coe_high']:.3f}]",
                     f"{c['roe']:.3f} [{c['roe_low']:.3f}, {c['roe_high']:.3f}]", f"{best['tau']:.3f} (psi "
                     f"{best['psi']:g})", f"{best['accuracy']:.3f} [{best['low']:.3f}, {best['high']:.3f}]"])
    lines = ["## Score thresholds and COE / ROE (004 Secs. 2.2-2.3)", "",
             "Scores are the model's relevance scores (for ColBERT a sum of MaxSim cosines over query tokens). "
             f"COE / ROE: share of correct / random pairs above theta = the {cfg['coe_psi']:g}th percentile of the "
             f"top-{cfg['threshold_k']} scores, mean and 95% interval over 500 bootstrap samples. Best threshold: "
             f"the tau(psi) with the highest bootstrapped top-{cfg['threshold_k']} accuracy.", "",
             *_table_block(["run", "queries", "mean correct", "mean top-K", "mean random", "COE", "ROE", "best tau",
                      f"top-{cfg['threshold_k']} acc."], rows)]
    for name, t in thresholds.items():
        lines += [f"Threshold table for {name} (thresholds at percentiles 10-90 of the correct scores):", "",
                  *_table_block(["threshold", "correct above", "random above"],
                          [[r["threshold"], r["frac_relevant_above"], r["frac_nonrelevant_above"]]
                           for r in t["threshold_table"]])]
    return lines


def vocabulary_lines(vocab: dict[str, Any]) -> list[str]:
    """003: the MLM head, coverage of shared tokens, token MRR and amnesia, then the examples."""
    lines = ["## Vocabulary projections and token amnesia (003)", ""]
    if not vocab.get("available"):
        return lines + [f"Skipped: {vocab.get('note')}", ""]
    s = vocab["summary"]
    lines += [f"MLM head: {vocab['source']}; representation: backbone last hidden states, {vocab['pooling']}; "
              f"{s['n_pairs']} (query, best relevant document) pairs, {s['n_shared_tokens']} shared tokens "
              "(no stop words or punctuation).", ""]
    if "coverage_query" in s:
        lines += [*_table_block(["top-k", "shared tokens in top-k of Q", "shared tokens in top-k of P"],
                          [[k, s["coverage_query"][k], s["coverage_passage"][k]] for k in s["coverage_query"]]),
                  f"Token MRR in P: shared tokens {fmt(s.get('mrr_shared_in_passage'))}, other passage tokens "
                  f"{fmt(s.get('mrr_other_passage_tokens'))} (003 Table 2). Median worst rank of a shared token "
                  f"in P (token amnesia, 003 Fig. 5): {s['amnesia_median_max_rank_passage']} "
                  f"(pairs: {s['amnesia_counts']}).", ""]
    for example in vocab["examples"]:
        lines += example_lines(example)
    return lines


def example_lines(ex: dict[str, Any]) -> list[str]:
    """One projected (query, passage) pair: top tokens of each, shared tokens by rank in P, token amnesia."""
    shared = ", ".join(f"{t} (Q {r[0]}, P {r[1]})" for t, r in sorted(ex["shared"].items(), key=lambda kv: kv[1][1]))
    return [f"**Query {ex['qid']}**: {ex['query']}", "",
            f"- top tokens of Q: {' '.join(ex['top_query'])}",
            f"- top tokens of P (doc {ex['docid']}, rank in the model's run: "
            f"{ex['retrieved_rank'] or 'not retrieved'}): {' '.join(ex['top_passage'])}",
            f"- shared tokens (rank in Q, rank in P): {shared or 'none'}",
            f"- token amnesia: worst rank in P {ex['max_rank_passage']}, in Q {ex['max_rank_query']}", ""]


def notes_lines(notes: list[str]) -> list[str]:
    """What was skipped and why; nothing when nothing was."""
    return ["## Notes", "", *(f"- {note}" for note in notes), ""] if notes else []


def timing_lines(timings: dict[str, float]) -> list[str]:
    """Seconds per stage, in the order they ran."""
    return ["## Timings (s)", "", ", ".join(f"{k}: {v}" for k, v in timings.items()), ""]
