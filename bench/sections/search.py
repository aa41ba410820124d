"""search: full-ranking latency p50/p95 per query (batch of one query, query encoding included) and nDCG@10 per
index variant, beside exact brute force (its nDCG@10 and time), BM25's nDCG@10 and ColBERT v1's token search; each
variant's per-query nDCG@10 difference to exact search over fp32 documents, with a paired bootstrap 95% interval
and p-value, adjusted for the several variants compared with exact search (:func:`adjust_vs_exact`)
(``flat-int8`` / ``flat-onnx-int8``: exact search over documents encoded that way)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hil.evaluation.statistics import SIGNIFICANCE_LEVEL, add_adjusted
from hil.evaluation.tables import adjustment_legend

from sections.common import (
    INDEX_VARIANTS,
    base_folder,
    base_index,
    fmt,
    judged_queries,
    latencies,
    load_dataset,
    load_model,
    ndcg,
    variant_index,
)
from sections.options import Job, option

if TYPE_CHECKING:
    from sections.config import BenchConfig

# The comparisons whose p-values are adjusted together (the parent adjusts after every child).
FAMILY = "every search variant of this run compared with exact search"


@dataclass(frozen=True)
class Config:
    """Search: PLAID's search-time settings, the queries timed, ColBERT v1's token search."""

    nprobe: int | None = option("--nprobe", None, "plaid search: centroids per query token", type=int)
    ndocs: int | None = option("--ndocs", None, "plaid search: documents scored exactly per head", type=int)
    stage2_docs: int | None = option("--stage2-docs", None, "plaid search: documents into stage 3", type=int)
    queries: int | None = option("--search-queries", None, "queries timed (default: all judged)", type=int)
    v1_queries: int = option("--v1-queries", 20, "queries timed for ColBERT v1 flat search")
    ncandidates: int = option("--ncandidates", 256, "ColBERT v1: hits per query token")
    encode_queries: str = option("--encode-queries", "fp32", "index variants: queries encoded by the model (fp32) "
                                 "or ONNX Runtime's fused fp32 graph (onnx)", choices=("fp32", "onnx"))

    def options(self) -> dict[str, int]:
        """The search-time settings given (``full_rank``'s names)."""
        given = {"nprobe": self.nprobe, "max_candidates": self.ndocs, "stage2_docs": self.stage2_docs}
        return {k: v for k, v in given.items() if v is not None}


def jobs(config: BenchConfig) -> list[Job]:
    """BM25, exact search, each index variant but flat (exact already), ColBERT v1; with ``--export``, exact
    search and the last variant again under an ``export-`` label."""
    variants = ["bm25", "exact"] + [v for v in config.index.variants if v != "flat"] + \
        (["v1"] if config.search.v1_queries else [])
    found = [Job(f"search:{v}", "search", variant=v) for v in variants]
    if config.common.export:
        found += [Job(f"search:export-{v}", "search", variant=v) for v in ("exact", config.index.variants[-1])]
    return found


def paired_difference(exact_ndcg_path: Path, per_query: dict[str, float]) -> dict[str, Any] | None:
    """Mean per-query nDCG@10 difference to exact search, with a paired bootstrap 95% interval and p-value
    (None before the exact run is saved): whether a variant's change is larger than the queries' noise."""
    from hil.evaluation.statistics import paired_bootstrap_test

    if not exact_ndcg_path.is_file():
        return None
    exact = json.loads(exact_ndcg_path.read_text())
    test = paired_bootstrap_test(per_query, exact, n_samples=10000, seed=0)
    changed = sum(abs(per_query[q] - exact[q]) > 1e-9 for q in exact)
    return {"mean_diff": test.mean_diff, "ci95": list(test.ci), "p_value": test.p_value, "queries": test.n,
            "queries_changed": int(changed)}


def overlap(exact_path: Path, run: dict[str, dict[str, float]]) -> float | None:
    """Mean share of the exact top 10 that ``run``'s top 10 also holds (None before the exact run is saved)."""
    if not exact_path.is_file():
        return None
    exact = json.loads(exact_path.read_text())
    shares = [len(set(list(run.get(q, {}))[:10]) & set(top)) / max(1, len(top)) for q, top in exact.items()]
    return float(np.mean(shares)) if shares else None


def run(config: BenchConfig, job: Job) -> dict[str, Any]:
    from hil.evaluation.evaluate import EvaluationSettings, evaluate
    from measure import peak_rss_mb, percentiles

    name, k = job.variant, config.common.k
    dataset = load_dataset(config)
    encoder = load_model(config, export=config.common.export)
    base, _ = base_index(config, dataset, encoder, INDEX_VARIANTS.get(name, (0, 0, "fp32"))[2])
    queries = judged_queries(dataset, config.search.queries)
    out: dict[str, Any] = {"variant": name, "queries": len(queries), "k": k,
                           "model": config.common.export or config.common.model}
    # Exact search over fp32-encoded documents is the reference every variant is compared with.
    exact_stem = base_folder(config, dataset, encoder).name + f".exact-top10-{len(queries)}"
    exact_path = Path(config.common.work) / f"{exact_stem}.json"
    exact_ndcg_path = Path(config.common.work) / f"{exact_stem}.ndcg10.json"
    if name == "exact" or INDEX_VARIANTS.get(name, ("",))[0] == "flat":  # a flat index is searched exhaustively
        tick = time.perf_counter()
        judged = replace(dataset, queries=queries, qrels={q: dataset.qrels[q] for q in queries})
        result = evaluate(encoder, judged, EvaluationSettings(mode="exhaustive", k=k, metrics=("ndcg@10",),
                                                              progress=False), store=base)
        per_query = {q: float(v["ndcg@10"]) for q, v in result.per_query.items()}
        out.update(ndcg10=float(result.aggregate["ndcg@10"]), ms_per_query_batched=1000 * (time.perf_counter() - tick)
                   / max(1, len(queries)), document_encoding=base.meta.get("document_encoding"))
        if name == "exact":
            exact_path.write_text(json.dumps({q: list(docs)[:10] for q, docs in result.run.items()}))
            exact_ndcg_path.write_text(json.dumps(per_query))
        else:
            out["overlap10_vs_exact"] = overlap(exact_path, result.run)
            out["ndcg10_vs_exact"] = paired_difference(exact_ndcg_path, per_query)
    elif name == "v1":  # ColBERT v1 full ranking: flat FAISS token search, ncandidates per query token
        limited = dict(list(queries.items())[: config.search.v1_queries])
        _, times, stats = latencies(encoder, base, limited, k, ncandidates=config.search.ncandidates)
        out.update(percentiles(times), queries=len(limited), candidates_mean=stats.get("candidates_mean"),
                   ncandidates=config.search.ncandidates)
    elif name == "bm25":
        from hil.evaluation.evaluate import evaluate_bm25

        out.update(ndcg10=float(evaluate_bm25(dataset).aggregate["ndcg@10"]), variant="bm25")
    else:
        index, _ = variant_index(config, base, name)
        options: dict[str, Any] = dict(config.search.options())
        if config.search.encode_queries == "onnx":
            from hil.retrieval.onnx_encode import onnx_query_encoder

            options["query_encoder"] = onnx_query_encoder(encoder)
        run_, times, stats = latencies(encoder, index, queries, k, **options)
        ndcg10, per_query = ndcg(dataset, run_)
        out.update(percentiles(times), queries_per_s=1000.0 * len(times) / max(sum(times), 1e-9),  # times in ms
                   ndcg10=ndcg10, overlap10_vs_exact=overlap(exact_path, run_),
                   ndcg10_vs_exact=paired_difference(exact_ndcg_path, per_query),
                   candidates_mean=stats.get("candidates_mean"),
                   plaid=stats.get("plaid"), bytes_per_token=index.bytes_per_token(),
                   encode_s=stats.get("encode_s"), ann_s=stats.get("ann_s"), score_s=stats.get("score_s"),
                   query_encoding=config.search.encode_queries)
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def adjust_vs_exact(results: dict[str, Any], method: str) -> None:
    """Add ``p_value_adjusted`` (and the method and family) to every search row's comparison with exact search:
    the rows of one run form one family, adjusted by ``method`` (``hil.evaluation.statistics.adjust_p_values``)."""
    compared = [r["ndcg10_vs_exact"] for label, r in results.items()
                if label.startswith("search:") and isinstance(r.get("ndcg10_vs_exact"), dict)]
    add_adjusted(compared, ("p_value",), lambda _: FAMILY, method)
    for row in compared:
        row.update(p_adjust=method, family=FAMILY)


def vs_exact(result: dict[str, Any]) -> str:
    """`` (+0.0020 vs exact, 95% CI [-0.0028, +0.0076], p 0.41, holm 0.82)``, a dagger after the p-value that decides
    (the adjusted one) when it is below :data:`SIGNIFICANCE_LEVEL`; nothing without a comparison."""
    diff = result.get("ndcg10_vs_exact")
    if not diff:
        return ""
    low, high = diff["ci95"]
    method = diff.get("p_adjust", "none")
    raw, adjusted = diff.get("p_value"), diff.get("p_value_adjusted")
    decides = raw if method == "none" else adjusted
    mark = "†" if decides is not None and decides < SIGNIFICANCE_LEVEL else ""
    text = f" ({diff['mean_diff']:+.4f} vs exact, 95% CI [{low:+.4f}, {high:+.4f}], p {fmt(raw, 2)}"
    return text + (f"{mark})" if method == "none" else f", {method} {fmt(adjusted, 2)}{mark})")


def rows(label: str, result: dict[str, Any]) -> list[tuple[str, str, str]]:
    name, r = label.split(":", 1)[1], result
    if "p50_ms" in r:
        return [(f"search {name}", f"p50 {r['p50_ms']:.1f} ms, p95 {r['p95_ms']:.1f} ms, "
                 f"{fmt(r.get('queries_per_s'), 1)} queries/s",
                 f"nDCG@10 {fmt(r.get('ndcg10'), 4)}{vs_exact(r)}, top-10 overlap with exact "
                 f"{fmt(r.get('overlap10_vs_exact'), 3)}; {r['queries']} queries, "
                 f"{fmt(r.get('candidates_mean'), 0)} docs scored exactly; peak RSS {r['peak_rss_mb']:.0f} MB")]
    return [(f"search {name}", f"nDCG@10 {r['ndcg10']:.4f}{vs_exact(r)}",
             f"exhaustive, {fmt(r.get('ms_per_query_batched'))} ms/query batched; "
             f"top-10 overlap with exact {fmt(r.get('overlap10_vs_exact'), 3)}; {r.get('queries', '')} queries")]


def legend(results: dict[str, Any]) -> list[str]:
    """The table's note on the p-values of the comparisons with exact search, when there are some."""
    compared = [r["ndcg10_vs_exact"] for label, r in results.items()
                if label.startswith("search:") and isinstance(r.get("ndcg10_vs_exact"), dict)]
    if not compared:
        return []
    method = compared[0].get("p_adjust", "none")
    return [f"vs exact: paired bootstrap test of per-query nDCG@10 against exact search over fp32 documents "
            f"({len(compared)} comparisons). " + adjustment_legend(method, FAMILY, SIGNIFICANCE_LEVEL,
                                                                    test="paired bootstrap test")]
