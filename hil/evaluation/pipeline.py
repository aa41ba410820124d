"""Zero-shot evaluation of a retriever on a BEIR dataset: index -> search -> pytrec_eval -> files.

Modes:
    full    FAISS over every document token -> candidates -> exact late interaction -> top-k (the paper's setting)
    rerank  exact late interaction over BM25's top ``rerank_depth`` documents per query
    bm25    BM25 alone (the baseline; computed alongside the model unless ``with_bm25=False``)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hil.data.beir import BeirDataset
from hil.data.bm25 import bm25_run
from hil.evaluation.metrics import DEFAULT_METRICS, evaluate_run
from hil.evaluation.runs import write_trec_run
from hil.modeling.encoder import MultiVectorEncoder
from hil.provenance import provenance, write_json_atomic
from hil.retrieval.index import encoder_fingerprint, open_or_build_index
from hil.retrieval.search import full_rank, rerank

MODES = ("full", "rerank", "bm25")


@dataclass
class Evaluation:
    name: str
    run: dict[str, dict[str, float]]
    aggregate: dict[str, float]
    per_query: dict[str, dict[str, float]]
    details: dict[str, Any] = field(default_factory=dict)


def score_run(name: str, dataset: BeirDataset, run: dict[str, dict[str, float]], metrics=DEFAULT_METRICS,
              drop_self_matches: bool = True, **details: Any) -> Evaluation:
    aggregate, per_query = evaluate_run(dataset.qrels, run, metrics, drop_self_matches=drop_self_matches)
    return Evaluation(name, run, aggregate, per_query, details)


def default_index_dir(root: str | Path, dataset: BeirDataset, encoder: MultiVectorEncoder) -> Path:
    return Path(root) / f"{dataset.name}-{dataset.fingerprint()[:8]}" / encoder_fingerprint(encoder)[:12]


def evaluate_retriever(encoder: MultiVectorEncoder, dataset: BeirDataset, *, mode: str = "full", k: int = 1000,
                       index_root: str | Path = "indexes", faiss_kind: str = "flat",
                       faiss_params: dict[str, Any] | None = None, ncandidates: int | None = None,
                       rerank_depth: int = 100, batch_size: int = 32, metrics=DEFAULT_METRICS,
                       drop_self_matches: bool = True, bm25: Evaluation | None = None,
                       progress: bool = True) -> Evaluation:
    """Evaluate ``encoder`` on ``dataset`` in ``mode``; the index is built once and reused (keyed by fingerprints)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} (got {mode!r})")
    if mode == "bm25":
        return bm25 or evaluate_bm25(dataset, k=k, metrics=metrics, drop_self_matches=drop_self_matches)
    started = time.perf_counter()
    index = open_or_build_index(encoder, dataset.doc_ids(), dataset.documents(),
                                default_index_dir(index_root, dataset, encoder), batch_size=batch_size,
                                faiss_kind=faiss_kind, faiss_params=faiss_params,
                                corpus_fingerprint=dataset.fingerprint(), progress=progress)
    index_seconds = time.perf_counter() - started
    started = time.perf_counter()
    if mode == "full":
        options = {} if ncandidates is None else {"ncandidates": ncandidates}
        result = full_rank(encoder, index, dataset.queries, k=k, progress=progress, **options)
    else:
        first_stage = bm25 or evaluate_bm25(dataset, k=rerank_depth, metrics=metrics)
        candidates = {qid: sorted(docs, key=docs.get, reverse=True)[:rerank_depth]
                      for qid, docs in first_stage.run.items()}
        result = rerank(encoder, index, dataset.queries, candidates, None, k=k)
    search_seconds = time.perf_counter() - started
    return score_run(f"{encoder.architecture}-{mode}", dataset, result.run, metrics, drop_self_matches,
                     mode=mode, index_dir=str(index.directory), index_seconds=round(index_seconds, 3),
                     search_seconds=round(search_seconds, 3), search_stats=result.stats, sources=result.sources)


def evaluate_bm25(dataset: BeirDataset, k: int = 1000, metrics=DEFAULT_METRICS,
                  drop_self_matches: bool = True) -> Evaluation:
    started = time.perf_counter()
    run = bm25_run(dataset, k=k)
    return score_run("bm25", dataset, run, metrics, drop_self_matches, mode="bm25",
                     search_seconds=round(time.perf_counter() - started, 3))


def write_results(directory: str | Path, dataset: BeirDataset, evaluations: list[Evaluation],
                  settings: dict[str, Any], models: dict[str, Any]) -> Path:
    """``metrics.json`` (settings, versions, dataset/model fingerprints, aggregates), per-query JSON, TREC runs."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for evaluation in evaluations:
        write_trec_run(directory / f"{evaluation.name}.trec", evaluation.run, tag=evaluation.name)
    write_json_atomic(directory / "per_query.json", {e.name: e.per_query for e in evaluations})
    record = provenance(settings,
                        dataset={"name": dataset.name, "split": dataset.split, "source": dataset.source,
                                 "fingerprint": dataset.fingerprint(), "documents": len(dataset.corpus),
                                 "queries": len(dataset.queries)},
                        models=models,
                        results={e.name: {"metrics": e.aggregate,
                                          **{k: v for k, v in e.details.items() if k != "sources"}}
                                 for e in evaluations})
    write_json_atomic(directory / "metrics.json", record)
    return directory / "metrics.json"


def format_table(evaluations: list[Evaluation], metrics=DEFAULT_METRICS) -> str:
    names = [m.lower() for m in metrics]
    width = max(len(e.name) for e in evaluations) + 2
    lines = ["model".ljust(width) + "".join(f"{m:>13}" for m in names)]
    for e in evaluations:
        lines.append(e.name.ljust(width) + "".join(f"{e.aggregate[m]:>13.4f}" for m in names))
    return "\n".join(lines)
