"""One analysis run: retrieval with intervals and significance, isotropy, figures and vocabulary projections.

``run_analysis(AnalysisConfig(model=..., dataset=..., output=...))`` evaluates the model (and optionally a
second model, and the model under post-hoc transforms) on a BEIR dataset and writes ``report.md``,
``report.json`` and PNG figures to ``output``. Sections and the papers they follow:

==============================  =============================================================================
retrieval / intervals           nDCG@10, success@k with bootstrap 95% CIs (004 Sec. 2.1)
significance                    paired t-test, permutation and bootstrap tests (001 Table 2 dagger)
BM25-Easy                       top half of BM25's per-query nDCG@10 (001 Table 4)
isotropy                        I(W), Avg-Cos, IsoScore of query / document tokens, before and after each
                                transform (000 Table 1, 004 Sec. 2.5, 001 A.1)
token cosines                   query-document token cosine distributions per head (001 Fig. 2)
layers                          InterIso per backbone layer, log-difference to a reference (001 Fig. 5)
head overlap                    documents retrieved by each head of a two-head model (001 Fig. 3)
thresholds, COE / ROE           004 Secs. 2.2-2.3
vocabulary projections          top tokens through the MLM head, token amnesia (003 Secs. 5-6)
==============================  =============================================================================

Choices: every model sees the same (query, document) pairs for the token and layer analyses -- each query with
BM25's top document, for the first ``pairs`` queries in id order; vocabulary projections pair a query with its
best-judged relevant document (003 uses gold passages); all sampling is seeded with ``seed``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from hil.analysis import plots
from hil.analysis.layers import encoder_layer_inter_iso, log_difference
from hil.analysis.overlap import candidate_overlap, ranked_overlap
from hil.analysis.similarity import isotropy_scores, query_token_vectors, token_cosines, top_pairs
from hil.analysis.thresholds import similarity_sets
from hil.analysis.vocab import load_mlm_head, project_pairs, summarize_projections
from hil.evaluation.metrics import DEFAULT_METRICS
from hil.evaluation.pipeline import (Evaluation, evaluate_bm25, evaluate_retriever, evaluate_transformed,
                                     evaluation_statistics, run_name)
from hil.evaluation.runs import ranked
from hil.evaluation.statistics import bootstrap_thresholds, overlap_coe_roe, threshold_analysis
from hil.provenance import provenance, write_json_atomic
from hil.retrieval.index import TokenIndex, encoder_fingerprint
from hil.retrieval.transformed import sample_token_vectors

logger = logging.getLogger(__name__)

REPORT_METRICS = (*DEFAULT_METRICS, "success@1", "success@5", "success@10")
STAT_METRICS = ("ndcg@10", "success@1", "success@5")


@dataclass
class AnalysisConfig:
    """Everything one analysis run depends on (recorded in report.json)."""

    model: str
    dataset: str
    output: str
    compare_model: str | None = None
    transforms: list[str] = field(default_factory=list)
    transform_mode: str = "token"
    transform_max_tokens: int = 200_000
    split: str = "test"
    data_dir: str | None = None
    max_queries: int | None = None
    max_docs: int | None = None
    seed: int = 12345
    index_root: str = "indexes"
    k: int = 1000
    ncandidates: int | None = None
    faiss: str = "flat"
    batch_size: int = 32
    dim: int = 128
    query_maxlen: int | None = None
    doc_maxlen: int | None = None
    n_bootstrap: int = 1000
    n_permutations: int = 10000
    pairs: int = 64
    isotropy_tokens: int = 20_000
    vocab_pairs: int = 100
    vocab_examples: int = 3
    vocab_top_k: int = 20
    threshold_k: int = 5
    coe_psi: float = 10.0
    progress: bool = True
    command: str | None = None


@dataclass
class Variant:
    """A model as evaluated: its run name, encoder, evaluation and token index."""

    name: str
    source: str
    encoder: Any
    evaluation: Evaluation
    index: TokenIndex
    transform: str | None = None


def _label(source: str, taken: set[str]) -> str:
    """A short unique run name from a model source: its folder / file name ("iso+aniso" for an ensemble)."""
    from hil.modeling.loading import split_ensemble_source

    parts = split_ensemble_source(source) or [source]
    base = run_name("+".join(Path(str(p).rstrip("/")).name.removesuffix(".ckpt") for p in parts) or "model")
    label, i = base, 2
    while label in taken or label == "bm25":
        label, i = f"{base}-{i}", i + 1
    taken.add(label)
    return label


def _load(source: str, overrides: dict[str, Any]) -> Any:
    """``load_encoder``; an ensemble ("iso+aniso") keeps its members' own settings, so no overrides go to it."""
    from hil.modeling.loading import load_encoder, split_ensemble_source

    return load_encoder(source) if split_ensemble_source(source) is not None else load_encoder(source, **overrides)


def _finite(value: Any) -> Any:
    """JSON-safe numbers: NaN / inf become None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, np.generic):
        return _finite(value.item())
    if isinstance(value, np.ndarray):
        return _finite(value.tolist())
    return value


def run_analysis(config: AnalysisConfig) -> dict[str, Any]:
    """Run every instrument and write ``report.json``, ``report.md`` and the PNG figures to ``config.output``."""
    from hil.data.beir import load_beir

    output = Path(config.output)
    output.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    notes: list[str] = []
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = round(now - clock, 2)
        clock = now

    dataset = load_beir(config.dataset, split=config.split, data_dir=config.data_dir)
    if config.max_queries or config.max_docs:
        dataset = dataset.subset(config.max_queries, config.max_docs, seed=config.seed)
    overrides = {k: v for k, v in {"dim": config.dim, "query_maxlen": config.query_maxlen,
                                   "doc_maxlen": config.doc_maxlen}.items() if v is not None}
    common = dict(mode="full", k=config.k, index_root=config.index_root, faiss_kind=config.faiss,
                  ncandidates=config.ncandidates, batch_size=config.batch_size, metrics=REPORT_METRICS,
                  progress=config.progress)
    bm25 = evaluate_bm25(dataset, k=max(config.k, 100), metrics=REPORT_METRICS)
    lap("bm25")

    taken: set[str] = set()
    variants: list[Variant] = []
    with torch.inference_mode():
        torch.manual_seed(config.seed)
        encoder = _load(config.model, overrides)
        name = _label(config.model, taken)
        evaluation = evaluate_retriever(encoder, dataset, name=name, **common)
        variants.append(Variant(name, config.model, encoder, evaluation,
                                TokenIndex.load(evaluation.details["index_dir"])))
        lap("model")
        for spec in config.transforms:
            t_name = run_name(f"{name}+{spec}" + ("" if config.transform_mode == "token" else "-sequence"))
            t_eval, t_encoder = evaluate_transformed(
                encoder, dataset, spec, transform_mode=config.transform_mode, max_tokens=config.transform_max_tokens,
                seed=config.seed, name=t_name, **common)
            variants.append(Variant(t_name, config.model, t_encoder, t_eval,
                                    TokenIndex.load(t_eval.details["index_dir"]), transform=spec))
            lap(f"transform {spec}")
        compare: Variant | None = None
        if config.compare_model:
            torch.manual_seed(config.seed)
            other = _load(config.compare_model, overrides)
            c_name = _label(config.compare_model, taken)
            c_eval = evaluate_retriever(other, dataset, name=c_name, **common)
            compare = Variant(c_name, config.compare_model, other, c_eval, TokenIndex.load(c_eval.details["index_dir"]))
            variants.append(compare)
            lap("compare model")
    base = variants[0]
    evaluations = [bm25, *(v.evaluation for v in variants)]

    # -- statistics -------------------------------------------------------------------------------------------
    pairs = [(v.name, "bm25") for v in variants]
    pairs += [(v.name, base.name) for v in variants[1:]]
    statistics = evaluation_statistics(evaluations, metrics=STAT_METRICS, pairs=pairs, n_bootstrap=config.n_bootstrap,
                                       n_permutations=config.n_permutations, seed=config.seed)
    lap("statistics")

    figures: dict[str, str] = {}
    figures["intervals"] = plots.plot_intervals(statistics["bootstrap"], "ndcg@10",
                                                output / "ndcg_intervals.png").name

    # -- thresholds and COE / ROE (004 Secs. 2.2-2.3) ---------------------------------------------------------
    thresholds: dict[str, Any] = {}
    with torch.inference_mode():
        for v in variants:
            correct, topk, random = similarity_sets(v.encoder, v.index, dataset.queries, dataset.qrels,
                                                    v.evaluation.run, k=config.threshold_k, seed=config.seed)
            if not correct:
                notes.append(f"{v.name}: no query has a relevant document in the index; thresholds skipped")
                continue
            correct_scores = np.concatenate([np.ravel(x) for x in correct.values()])
            table = threshold_analysis(correct, random, thresholds=np.percentile(correct_scores, [10, 25, 50, 75, 90]))
            coe = overlap_coe_roe(correct, topk, random, psi=config.coe_psi, n_samples=500, seed=config.seed)
            accuracy = bootstrap_thresholds(v.evaluation.run, dataset.qrels, k=config.threshold_k, n_samples=500,
                                            seed=config.seed)
            best = max(accuracy, key=lambda row: (row.accuracy, -row.psi))
            thresholds[v.name] = {
                "n_queries": len(correct),
                "mean_correct": float(np.mean([s for x in correct.values() for s in x])),
                "mean_topk": float(np.mean([s for x in topk.values() for s in x])),
                "mean_random": float(np.mean([s for x in random.values() for s in x])),
                "threshold_table": [asdict(row) for row in table], "coe_roe": asdict(coe),
                "bootstrap_thresholds": [asdict(row) for row in accuracy], "best_threshold": asdict(best)}
    lap("thresholds")

    # -- token cosine distributions (001 Fig. 2) and InterIso per layer (001 Fig. 5) --------------------------
    pair_ids = top_pairs(bm25.run, depth=1, max_queries=config.pairs)
    query_texts = [dataset.queries[q] for q, _ in pair_ids]
    doc_texts = [dataset.doc_text(d) for _, d in pair_ids]
    cosines: dict[str, Any] = {}
    series: dict[str, np.ndarray] = {}
    with torch.inference_mode():
        for v in variants:
            result = token_cosines(v.encoder, query_texts, doc_texts, batch_size=16)
            cosines[v.name] = result.summary()
            for head, values in result.all_pairs.items():
                series[v.name if len(result.all_pairs) == 1 else f"{v.name}:{head}"] = values
    figures["token_cosines"] = plots.plot_cosine_distributions(series, output / "token_cosines.png").name
    lap("token cosines")

    layer_curves: dict[str, np.ndarray] = {}
    with torch.inference_mode():
        for v in (base, compare) if compare is not None else (base,):
            layer_curves.update(encoder_layer_inter_iso(v.encoder, query_texts, doc_texts, label=v.name))
    reference = next((label for label in layer_curves if compare is not None and label.startswith(compare.name)),
                     None)
    figures["layers"] = plots.plot_layer_inter_iso(layer_curves, output / "layer_inter_iso.png",
                                                   reference=reference).name
    layers = {"values": {k: v.tolist() for k, v in layer_curves.items()}, "reference": reference,
              "log10_difference": ({k: log_difference(v, layer_curves[reference]).tolist()
                                    for k, v in layer_curves.items() if k != reference} if reference else None)}
    lap("layers")

    # -- which head retrieved what (001 Fig. 3) ----------------------------------------------------------------
    overlaps: dict[str, Any] = {}
    for v in variants:
        heads = tuple(v.encoder.head_names)
        if len(heads) != 2:
            continue
        overlaps[v.name] = {"first_stage": candidate_overlap(v.evaluation.details["search_stats"], heads),
                            "ranked": ranked_overlap(v.evaluation.run, v.evaluation.details["sources"], heads,
                                                     k=min(config.k, 100))}
    if overlaps:
        figures["overlap"] = plots.plot_overlap({k: o["first_stage"] for k, o in overlaps.items()},
                                                output / "head_overlap.png",
                                                title="First-stage candidates retrieved by each head").name
    else:
        notes.append("head overlap (001 Fig. 3): no two-head model (HIL or ColBERT-lambda) analysed; skipped")

    # -- isotropy before / after transforms ---------------------------------------------------------------------
    isotropy_rows: list[dict[str, Any]] = []
    query_list = [dataset.queries[q] for q in sorted(dataset.queries)][:2000]
    with torch.inference_mode():
        for v in variants:
            q_vectors = query_token_vectors(v.encoder, query_list, batch_size=64)
            for head in v.encoder.head_names:
                for side, points in (("queries", q_vectors[head]),
                                     ("documents", sample_token_vectors(v.index, head, config.isotropy_tokens,
                                                                        seed=config.seed))):
                    isotropy_rows.append({"variant": v.name, "head": head, "side": side,
                                          **isotropy_scores(points, config.isotropy_tokens, seed=config.seed)})
    figures["isotropy"] = plots.plot_isotropy(isotropy_rows, output / "isotropy.png").name
    lap("isotropy")

    # -- vocabulary projections (003) ---------------------------------------------------------------------------
    vocab = _vocabulary_section(base, dataset, config, notes)
    lap("vocabulary")

    report = {
        **provenance(asdict(config)),
        "dataset": {"name": dataset.name, "split": dataset.split, "fingerprint": dataset.fingerprint(),
                    "documents": len(dataset.corpus), "queries": len(dataset.queries)},
        "runs": {e.name: {"metrics": e.aggregate, **({"source": v.source, "transform_spec": v.transform,
                                                     "fingerprint": encoder_fingerprint(v.encoder),
                                                     "settings": v.encoder.settings()} if v else {}),
                          **{k: val for k, val in e.details.items() if k != "sources"}}
                 for e, v in [(bm25, None), *((v.evaluation, v) for v in variants)]},
        "statistics": statistics, "thresholds": thresholds, "token_cosines": cosines,
        "token_cosine_pairs": len(pair_ids), "layers": layers, "head_overlap": overlaps,
        "isotropy": isotropy_rows, "vocabulary": vocab, "figures": figures, "notes": notes, "timings_s": timings}
    report = _finite(report)
    write_json_atomic(output / "report.json", report)
    (output / "report.md").write_text(render_markdown(report), encoding="utf-8")
    return report


def _vocabulary_section(base: Variant, dataset: Any, config: AnalysisConfig, notes: list[str]) -> dict[str, Any]:
    head, why = load_mlm_head(base.encoder)
    if head is None:
        notes.append(f"vocabulary projections (003) skipped for {base.name}: {why}")
        return {"available": False, "note": why}
    from hil.analysis.layers import backbones

    backbone, tokenizer = next(iter(backbones(base.encoder).values()))
    pairs = []
    for qid in sorted(dataset.queries):
        judged = [(rel, d) for d, rel in dataset.qrels.get(qid, {}).items() if int(rel) > 0 and d in dataset.corpus]
        if judged:
            pairs.append((qid, min(judged, key=lambda item: (-int(item[0]), item[1]))[1]))  # best grade, then id
        if len(pairs) >= config.vocab_pairs:
            break
    if not pairs:
        notes.append("vocabulary projections (003): no judged query-document pair; skipped")
        return {"available": False, "note": "no judged pairs"}
    projections = project_pairs(head, backbone, tokenizer, pairs, [dataset.queries[q] for q, _ in pairs],
                                [dataset.doc_text(d) for _, d in pairs], top_k=config.vocab_top_k)
    for projection in projections:
        order = [d for d, _ in ranked(base.evaluation.run.get(projection.qid, {}))]
        projection.retrieved_rank = order.index(projection.docid) + 1 if projection.docid in order else None
    return {"available": True, "source": head.source, "pooling": "mean over scored tokens",
            "summary": summarize_projections(projections),
            "examples": [asdict(p) for p in projections[: config.vocab_examples]]}


# -- markdown ---------------------------------------------------------------------------------------------------

def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return lines + [""]


def render_markdown(report: dict[str, Any]) -> str:
    """report.md from the report dict (everything in it is also in report.json)."""
    cfg, data, stats = report["settings"], report["dataset"], report["statistics"]
    lines = [f"# Analysis: {cfg['model']} on {data['name']}", ""]
    if cfg.get("command"):
        lines += ["```", cfg["command"], "```", ""]
    lines += [f"Dataset {data['name']} ({data['split']}): {data['queries']} queries, {data['documents']} documents "
              f"(fingerprint {data['fingerprint']}). Seed {cfg['seed']}; full ranking, top {cfg['k']}; "
              f"created {report['created']} (git {report.get('git_commit') or 'n/a'}).", ""]

    lines += ["## Retrieval quality", "",
              f"Mean per-query metric with its bootstrap {100 * stats['confidence']:.0f}% percentile interval "
              f"({stats['n_bootstrap']} resamples of all queries; 004 Sec. 2.1).", ""]
    rows = []
    for name, run in report["runs"].items():
        boot = stats["bootstrap"].get(name, {})
        cells = [name]
        for metric in STAT_METRICS:
            row = boot.get(metric)
            cells.append(f"{row['observed']:.4f} [{row['low']:.4f}, {row['high']:.4f}]" if row else "n/a")
        cells += [run["metrics"].get("mrr@10"), run["metrics"].get("recall@100")]
        rows.append(cells)
    lines += _table(["run", *STAT_METRICS, "mrr@10", "recall@100"], rows)
    lines += [f"![nDCG@10 intervals]({report['figures']['intervals']})", ""]

    lines += ["## Significance", "", "Paired tests of per-query metrics, a - b (001 Table 2 dagger): paired t-test, "
              f"sign-flip permutation test ({stats['n_permutations']} permutations, exact when n <= 16) and "
              "paired bootstrap test; the difference's bootstrap interval.", ""]
    lines += _table(["a", "b", "metric", "n", "mean a", "mean b", "diff", "diff CI", "p (t)", "p (perm.)", "p (boot.)"],
                    [[r["a"], r["b"], r["metric"], r["n"], r["mean_a"], r["mean_b"], r["mean_diff"],
                      f"[{r['diff_ci'][0]:.4f}, {r['diff_ci'][1]:.4f}]" if r.get("diff_ci") else "n/a",
                      r["p_t_test"], r["p_permutation"], r["p_bootstrap"]] for r in stats["paired"]])

    easy = stats.get("bm25_easy")
    if easy:
        lines += ["## BM25-Easy split", "", f"001 Table 4: queries in the top half of BM25's per-query nDCG@10 "
                  f"({easy['n_easy']} easy, {easy['n_hard']} hard; ties broken by query id).", ""]
        lines += _table(["run", "nDCG@10 easy", "nDCG@10 hard"],
                        [[name, rows.get("ndcg@10", {}).get("easy"), rows.get("ndcg@10", {}).get("hard")]
                         for name, rows in easy["runs"].items()])

    transformed = {name: run["transform"] for name, run in report["runs"].items() if run.get("transform")}
    if transformed:
        lines += ["## Post-hoc transforms", "", "Fitted on the corpus' stored token vectors of the base index "
                  "(000 Sec. 4.1; token-wise unless stated), applied to query and document vectors before scoring, "
                  "output L2-normalized; parameters saved as `transform_<head>.pt` in the derived index folder.", ""]
        rows = []
        for name, info in transformed.items():
            for head, h in info["heads"].items():
                rows.append([name, info["spec"], info["mode"], head, h["fit_info"].get("n_vectors"), h["output_dim"],
                             h["fingerprint"], info["index_dir"]])
        lines += _table(["run", "spec", "mode", "head", "fit vectors", "dim", "fingerprint", "index"], rows)

    lines += ["## Isotropy", "", "I(W) (partition score, higher = more isotropic), Avg-Cos (lower = more "
              "isotropic) and IsoScore (higher = more isotropic) of the token vectors as scored: every query token "
              f"(queries of the dataset) and up to {cfg['isotropy_tokens']} sampled document tokens of the index.", ""]
    lines += _table(["run", "head", "tokens", "n", "I(W)", "Avg-Cos", "IsoScore"],
                    [[r["variant"], r["head"], r["side"], r["n_points"], r["I(W)"], r["avg_cos"], r["isoscore"]]
                     for r in report["isotropy"]])
    lines += [f"![isotropy]({report['figures']['isotropy']})", ""]

    lines += ["## Query-document token cosines (001 Fig. 2)", "",
              f"Every (query token, document token) cosine for {report['token_cosine_pairs']} queries and BM25's top "
              "document of each; the mean is InterIso over these pairs (001 Eq. 2); MaxSim is each query token's "
              "best match.", ""]
    rows = []
    for name, heads in report["token_cosines"].items():
        for head, s in heads.items():
            rows.append([name, head, s["mean"], s["std"], s["median"], s["maxsim_mean"], s["n_values"]])
    lines += _table(["run", "head", "mean (InterIso)", "std", "median", "mean MaxSim", "values"], rows)
    lines += [f"![token cosines]({report['figures']['token_cosines']})", ""]

    layers = report["layers"]
    lines += ["## InterIso per layer (001 Fig. 5)", "", "Mean InterIso of L2-normalized hidden states on the same "
              "pairs; layer 0 = embeddings." + (f" Log10 difference to {layers['reference']}." if layers["reference"]
                                                 else ""), ""]
    curves = layers["values"]
    width = max(len(v) for v in curves.values())
    header = ["layer", *curves] + ([f"log10 diff {k}" for k in (layers["log10_difference"] or {})])
    differences = list((layers["log10_difference"] or {}).values())
    rows = [[i, *[c[i] if i < len(c) else None for c in curves.values()],
             *[d[i] if i < len(d) else None for d in differences]] for i in range(width)]
    lines += _table(header, rows) + [f"![layers]({report['figures']['layers']})", ""]

    lines += ["## Head overlap (001 Fig. 3)", ""]
    if report["head_overlap"]:
        rows = []
        for name, o in report["head_overlap"].items():
            for stage in ("first_stage", "ranked"):
                r = o[stage]
                a, b = r["heads"]
                rows.append([name, stage if stage == "first_stage" else f"top {r['k']}", f"{r[f'only_{a}']} ({a})",
                             f"{r[f'only_{b}']} ({b})", r["both"], r["share_both"], r[f"share_{a}"], r[f"share_{b}"]])
        lines += _table(["run", "documents", "only a", "only b", "both", "share both", "share a", "share b"], rows)
        lines += [f"![overlap]({report['figures']['overlap']})", ""]
    else:
        lines += ["Not applicable: no two-head model (HIL or ColBERT-lambda) in this analysis.", ""]

    lines += ["## Score thresholds and COE / ROE (004 Secs. 2.2-2.3)", "",
              "Scores are the model's relevance scores (for ColBERT a sum of MaxSim cosines over query tokens). "
              f"COE / ROE: share of correct / random pairs above theta = the {cfg['coe_psi']:g}th percentile of the "
              f"top-{cfg['threshold_k']} scores, mean and 95% interval over 500 bootstrap samples. Best threshold: "
              f"the tau(psi) with the highest bootstrapped top-{cfg['threshold_k']} accuracy.", ""]
    rows = []
    for name, t in report["thresholds"].items():
        c, best = t["coe_roe"], t["best_threshold"]
        rows.append([name, t["n_queries"], t["mean_correct"], t["mean_topk"], t["mean_random"],
                     f"{c['coe']:.3f} [{c['coe_low']:.3f}, {c['coe_high']:.3f}]",
                     f"{c['roe']:.3f} [{c['roe_low']:.3f}, {c['roe_high']:.3f}]",
                     f"{best['tau']:.3f} (psi {best['psi']:g})", f"{best['accuracy']:.3f} [{best['low']:.3f}, "
                                                                   f"{best['high']:.3f}]"])
    lines += _table(["run", "queries", "mean correct", "mean top-K", "mean random", "COE", "ROE", "best tau",
                     f"top-{cfg['threshold_k']} acc."], rows)
    for name, t in report["thresholds"].items():
        lines += [f"Threshold table for {name} (thresholds at percentiles 10-90 of the correct scores):", ""]
        lines += _table(["threshold", "correct above", "random above"],
                        [[r["threshold"], r["frac_relevant_above"], r["frac_nonrelevant_above"]]
                         for r in t["threshold_table"]])

    vocab = report["vocabulary"]
    lines += ["## Vocabulary projections and token amnesia (003)", ""]
    if vocab.get("available"):
        s = vocab["summary"]
        lines += [f"MLM head: {vocab['source']}; representation: backbone last hidden states, {vocab['pooling']}; "
                  f"{s['n_pairs']} (query, best relevant document) pairs, {s['n_shared_tokens']} shared tokens "
                  "(no stop words or punctuation).", ""]
        if "coverage_query" in s:
            lines += _table(["top-k", "shared tokens in top-k of Q", "shared tokens in top-k of P"],
                            [[k, s["coverage_query"][k], s["coverage_passage"][k]] for k in s["coverage_query"]])
            lines += [f"Token MRR in P: shared tokens {_fmt(s.get('mrr_shared_in_passage'))}, other passage tokens "
                      f"{_fmt(s.get('mrr_other_passage_tokens'))} (003 Table 2). Median worst rank of a shared token "
                      f"in P (token amnesia, 003 Fig. 5): {s['amnesia_median_max_rank_passage']} "
                      f"(pairs: {s['amnesia_counts']}).", ""]
        for ex in vocab["examples"]:
            shared = ", ".join(f"{t} (Q {r[0]}, P {r[1]})" for t, r in sorted(ex["shared"].items(),
                                                                             key=lambda kv: kv[1][1]))
            lines += [f"**Query {ex['qid']}**: {ex['query']}", "",
                      f"- top tokens of Q: {' '.join(ex['top_query'])}",
                      f"- top tokens of P (doc {ex['docid']}, rank in the model's run: "
                      f"{ex['retrieved_rank'] or 'not retrieved'}): {' '.join(ex['top_passage'])}",
                      f"- shared tokens (rank in Q, rank in P): {shared or 'none'}",
                      f"- token amnesia: worst rank in P {ex['max_rank_passage']}, in Q {ex['max_rank_query']}", ""]
    else:
        lines += [f"Skipped: {vocab.get('note')}", ""]

    if report["notes"]:
        lines += ["## Notes", ""] + [f"- {note}" for note in report["notes"]] + [""]
    lines += ["## Timings (s)", "", ", ".join(f"{k}: {v}" for k, v in report["timings_s"].items()), ""]
    return "\n".join(lines)

