"""batched: full ranking of the judged queries searched in batches (what evaluation does) against the same queries
searched one at a time (the latency path), per index variant and ranking depth k, in alternating rounds in one
child: seconds per pass, queries/s, the ratio, the time in each step (candidates, exact scoring), whether the two
runs are identical (every document, its rank and its score), and nDCG@10 beside exact search's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sections.common import (
    base_index,
    fmt,
    judged_queries,
    load_dataset,
    load_model,
    ndcg,
    setup_threads,
    variant_index,
)
from sections.options import Job, comma_ints, comma_list, option

if TYPE_CHECKING:
    from sections.config import BenchConfig

STEPS = ("encode_s", "ann_s", "score_s")


@dataclass(frozen=True)
class Config:
    """Batched against per-query full ranking."""

    variants: tuple[str, ...] = option("--batched-variants", ("plaid", "flat"),
                                       "index variants searched both ways (flat = the base index)", type=comma_list)
    ks: tuple[int, ...] = option("--batched-k", (10, 1000), "ranking depths (PLAID's defaults follow k)",
                                 type=comma_ints)
    batch: int = option("--batched-batch", 64, "queries encoded and searched together")
    rounds: int = option("--batched-rounds", 3, "alternating rounds of both ways (the first is a warm-up too)")
    queries: int | None = option("--batched-queries", None, "judged queries searched (default all)", type=int)


def jobs(config: BenchConfig) -> list[Job]:
    return [Job(f"batched:{v}", "batched", variant=v) for v in config.batched.variants]


def _one_pass(encoder: Any, index: Any, queries: dict[str, str], k: int, batch: int, batched: bool) -> Any:
    from hil.retrieval.full_ranking import full_rank

    return full_rank(encoder, index, queries, k=k, batch_size=batch, batched=batched, progress=False)


def run(config: BenchConfig, job: Job) -> dict[str, Any]:
    import numpy as np

    from hil.retrieval.search import exact_rank

    setup_threads(config.common.threads)
    settings = config.batched
    dataset = load_dataset(config)
    encoder = load_model(config, export=config.common.export)
    base, _ = base_index(config, dataset, encoder)
    index = base if job.variant == "flat" else variant_index(config, base, job.variant)[0]
    queries = judged_queries(dataset, settings.queries)
    exact_ndcg, _ = ndcg(dataset, exact_rank(encoder, base, queries, k=10, progress=False).run)
    out: dict[str, Any] = {"variant": job.variant, "queries": len(queries), "batch": settings.batch,
                           "exact_ndcg@10": exact_ndcg, "by_k": {}}
    for k in settings.ks:
        seconds: dict[str, list[float]] = {"batched": [], "per_query": []}
        steps: dict[str, dict[str, list[float]]] = {way: {s: [] for s in STEPS} for way in seconds}
        runs: dict[str, Any] = {}
        for _ in range(settings.rounds):
            for way in ("per_query", "batched"):
                result = _one_pass(encoder, index, queries, k, settings.batch, way == "batched")
                seconds[way].append(result.stats["total_s"])
                for step in STEPS:
                    steps[way][step].append(result.stats[step])
                runs[way] = result
        identical = all(list(runs["batched"].run[q].items()) == list(runs["per_query"].run[q].items())
                        for q in queries)
        median = {way: float(np.median(values[1:] if len(values) > 1 else values)) for way, values in seconds.items()}
        out["by_k"][str(k)] = {
            "search": runs["batched"].stats["search"], "seconds": seconds, "median_s": median,
            "queries_per_s": {way: len(queries) / s for way, s in median.items()},
            "speedup": median["per_query"] / median["batched"], "identical_runs": identical,
            "steps_median_s": {way: {s: float(np.median(v[1:] if len(v) > 1 else v)) for s, v in per.items()}
                               for way, per in steps.items()},
            "ndcg@10": ndcg(dataset, runs["batched"].run)[0],
            "candidates_mean": runs["batched"].stats["candidates_mean"]}
    return out


def rows(label: str, result: dict[str, Any]) -> list[tuple[str, str, str]]:
    lines = []
    for k, r in result["by_k"].items():
        steps = r["steps_median_s"]
        lines.append((f"batched {result['variant']} k={k}",
                      f"{r['queries_per_s']['batched']:.1f} vs {r['queries_per_s']['per_query']:.1f} q/s "
                      f"(x{r['speedup']:.2f})",
                      f"batch {result['batch']}, {result['queries']} queries, identical runs: {r['identical_runs']}, "
                      f"candidates+exact {fmt(steps['batched']['ann_s'], 2)}+{fmt(steps['batched']['score_s'], 2)} s "
                      f"vs {fmt(steps['per_query']['ann_s'], 2)}+{fmt(steps['per_query']['score_s'], 2)} s, "
                      f"nDCG@10 {r['ndcg@10']:.4f} (exact {result['exact_ndcg@10']:.4f})"))
    return lines
