"""Zero-shot evaluation of a retriever on a BEIR dataset: index -> search -> pytrec_eval -> files.

Modes:
    full    FAISS over every document token -> candidates -> exact late interaction -> top-k (the paper's setting)
    rerank  exact late interaction over BM25's top ``rerank_depth`` documents per query
    bm25    BM25 alone (the baseline; computed alongside the model unless ``with_bm25=False``)
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from hil.data.beir import BeirDataset
from hil.data.bm25 import bm25_run
from hil.evaluation.metrics import DEFAULT_METRICS, evaluate_run
from hil.evaluation.runs import write_trec_run
from hil.modeling.encoder import MultiVectorEncoder
from hil.provenance import provenance, write_json_atomic
from hil.retrieval.builder import open_or_build_index
from hil.retrieval.index import encoder_fingerprint
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


def default_index_dir(root: str | Path, dataset: BeirDataset, encoder: MultiVectorEncoder,
                      document_encoding: str | None = None) -> Path:
    folder = Path(root) / f"{dataset.name}-{dataset.fingerprint()[:8]}" / encoder_fingerprint(encoder)[:12]
    return folder.with_name(f"{folder.name}-{document_encoding}") if document_encoding else folder


def evaluate_retriever(encoder: MultiVectorEncoder, dataset: BeirDataset, *, mode: str = "full", k: int = 1000,
                       index_root: str | Path = "indexes", faiss_kind: str = "flat",
                       faiss_params: dict[str, Any] | None = None, ncandidates: int | None = None,
                       rerank_depth: int = 100, batch_size: int = 32, metrics=DEFAULT_METRICS,
                       drop_self_matches: bool = True, bm25: Evaluation | None = None,
                       progress: bool = True, name: str | None = None,
                       keep_candidate_sources: bool = False, document_encoding: str | None = None) -> Evaluation:
    """Evaluate ``encoder`` on ``dataset`` in ``mode``; the index is built once and reused (keyed by fingerprints).

    ``document_encoding`` encodes the corpus through a cheaper encoder (``build_index``'s ``quantize``: e.g.
    ``"onnx-int8"``; queries keep ``encoder``), in an index folder of its own. ``name`` overrides the run's name
    (default ``<architecture>-<mode>``); ``keep_candidate_sources`` records which heads retrieved every
    first-stage candidate, not only the ranked documents (full mode).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} (got {mode!r})")
    if mode == "bm25":
        return bm25 or evaluate_bm25(dataset, k=k, metrics=metrics, drop_self_matches=drop_self_matches)
    started = time.perf_counter()
    index = open_or_build_index(encoder, dataset.doc_ids(), dataset.documents(),
                                default_index_dir(index_root, dataset, encoder, document_encoding),
                                batch_size=batch_size, faiss_kind=faiss_kind, faiss_params=faiss_params,
                                corpus_fingerprint=dataset.fingerprint(), progress=progress,
                                **({"quantize": document_encoding} if document_encoding else {}))
    index_seconds = time.perf_counter() - started
    started = time.perf_counter()
    if mode == "full":
        options = {} if ncandidates is None else {"ncandidates": ncandidates}
        result = full_rank(encoder, index, dataset.queries, k=k, progress=progress,
                           keep_candidate_sources=keep_candidate_sources, **options)
    else:
        first_stage = bm25 or evaluate_bm25(dataset, k=rerank_depth, metrics=metrics)
        candidates = {qid: sorted(docs, key=docs.get, reverse=True)[:rerank_depth]
                      for qid, docs in first_stage.run.items()}
        result = rerank(encoder, index, dataset.queries, candidates, None, k=k, progress=progress)
    search_seconds = time.perf_counter() - started
    return score_run(name or f"{encoder.architecture}-{mode}", dataset, result.run, metrics, drop_self_matches,
                     mode=mode, index_dir=str(index.directory), index_seconds=round(index_seconds, 3),
                     document_encoding=index.meta.get("document_encoding"),
                     search_seconds=round(search_seconds, 3), search_stats=result.stats, sources=result.sources)


def evaluate_bm25(dataset: BeirDataset, k: int = 1000, metrics=DEFAULT_METRICS,
                  drop_self_matches: bool = True) -> Evaluation:
    started = time.perf_counter()
    run = bm25_run(dataset, k=k)
    return score_run("bm25", dataset, run, metrics, drop_self_matches, mode="bm25",
                     search_seconds=round(time.perf_counter() - started, 3))


def run_name(text: str) -> str:
    """``text`` made safe as a run name (a TREC tag and a file name): runs of other characters become ``_``."""
    return re.sub(r"[^A-Za-z0-9_.+=-]+", "_", text).strip("_") or "run"


def evaluate_transformed(encoder: MultiVectorEncoder, dataset: BeirDataset, spec: str, *, mode: str = "full",
                         transform_mode: str = "token", max_tokens: int = 200_000, max_docs: int = 20_000,
                         seed: int = 0, index_root: str | Path = "indexes", faiss_kind: str = "flat",
                         faiss_params: dict[str, Any] | None = None, batch_size: int = 32, progress: bool = True,
                         name: str | None = None, **evaluate_kwargs: Any) -> tuple[Evaluation, Any]:
    """Evaluate ``encoder`` with the post-hoc transform ``spec`` (e.g. ``"whitening"``, ``"whitening:k=64"``).

    The base index is built (or reused); the transform is fitted on its stored document vectors
    (``transform_mode`` token-wise or sequence-wise, seeded sample); a derived index holds the transformed vectors
    and the fitted ``transform_<head>.pt`` files; then the transformed encoder is evaluated like any other.
    Returns the evaluation and the :class:`~hil.retrieval.transformed.TransformedEncoder`.
    """
    from hil.retrieval.transformed import fit_transformed_encoder, open_or_derive_index

    if mode == "bm25":
        raise ValueError("a post-hoc transform applies to a model, not to BM25")
    base = open_or_build_index(encoder, dataset.doc_ids(), dataset.documents(),
                               default_index_dir(index_root, dataset, encoder), batch_size=batch_size,
                               faiss_kind=faiss_kind, faiss_params=faiss_params,
                               corpus_fingerprint=dataset.fingerprint(), progress=progress)
    started = time.perf_counter()
    transformed = fit_transformed_encoder(encoder, spec, store=base, mode=transform_mode, max_tokens=max_tokens,
                                          max_docs=max_docs, seed=seed)
    fit_seconds = time.perf_counter() - started
    derived = open_or_derive_index(base, transformed, default_index_dir(index_root, dataset, transformed),
                                   faiss_kind=faiss_kind, faiss_params=faiss_params, progress=progress)
    evaluation = evaluate_retriever(transformed, dataset, mode=mode, index_root=index_root, faiss_kind=faiss_kind,
                                    faiss_params=faiss_params, batch_size=batch_size, progress=progress,
                                    name=name or run_name(f"{encoder.architecture}+{spec}-{transform_mode}-{mode}"),
                                    **evaluate_kwargs)
    evaluation.details["transform"] = {**transformed.transform_settings(), "fit_seconds": round(fit_seconds, 3),
                                       "base_index_dir": str(base.directory), "index_dir": str(derived.directory),
                                       "files": sorted(p.name for p in derived.directory.glob("transform_*.pt"))}
    return evaluation, transformed


def evaluation_statistics(evaluations: Sequence[Evaluation], *, metrics: Sequence[str] = ("ndcg@10",),
                          pairs: Sequence[tuple[str, str]] | None = None, n_bootstrap: int = 1000,
                          n_permutations: int = 10000, confidence: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """Bootstrap CIs per run and metric, paired tests between runs, and the BM25-Easy split (when BM25 ran).

    ``bootstrap``: 004 Section 2.1 percentile intervals of the mean per-query metric (m = ``n_bootstrap``
    samples of all queries). ``paired``: for each (a, b) in ``pairs`` (default: every run against the first, e.g.
    the model vs BM25) the paired t-test, the paired permutation test and the paired bootstrap test of ``a - b``
    on each metric (001 Table 2's dagger). ``bm25_easy``: 001 Table 4, each run's mean on the queries in the top
    half of BM25's per-query nDCG@10 and on the rest. Metrics a run lacks per query are skipped.
    """
    from hil.evaluation.statistics import (bm25_easy_split, bootstrap_ci, paired_bootstrap_test, paired_t_test,
                                           paired_permutation_test)

    by_name = {e.name: e for e in evaluations}

    def values(evaluation: Evaluation, metric: str) -> dict[str, float] | None:
        found = {qid: row[metric] for qid, row in evaluation.per_query.items() if metric in row}
        return found or None

    result: dict[str, Any] = {"confidence": confidence, "n_bootstrap": n_bootstrap,
                              "n_permutations": n_permutations, "seed": seed, "bootstrap": {}, "paired": []}
    for evaluation in evaluations:
        rows = {}
        for metric in metrics:
            per_query = values(evaluation, metric)
            if per_query:
                rows[metric] = asdict(bootstrap_ci(per_query, n_samples=n_bootstrap, confidence=confidence, seed=seed))
        result["bootstrap"][evaluation.name] = rows
    if pairs is None:
        pairs = [(e.name, evaluations[0].name) for e in evaluations[1:]]
    for a, b in pairs:
        if a not in by_name or b not in by_name:
            raise KeyError(f"evaluation_statistics: no run named {a if a not in by_name else b!r}; "
                           f"runs: {sorted(by_name)}")
        for metric in metrics:
            va, vb = values(by_name[a], metric), values(by_name[b], metric)
            if not va or not vb:
                continue
            t = paired_t_test(va, vb, on="intersection")
            perm = paired_permutation_test(va, vb, n_permutations=n_permutations, seed=seed, on="intersection")
            boot = paired_bootstrap_test(va, vb, n_samples=n_bootstrap, seed=seed, confidence=confidence,
                                         on="intersection")
            shared = sorted(set(va) & set(vb))
            result["paired"].append({"a": a, "b": b, "metric": metric, "n": t.n,
                                     "mean_a": float(np.mean([va[q] for q in shared])),
                                     "mean_b": float(np.mean([vb[q] for q in shared])), "mean_diff": t.mean_diff,
                                     "t": t.statistic, "p_t_test": t.p_value, "p_permutation": perm.p_value,
                                     "permutation_method": perm.method, "p_bootstrap": boot.p_value,
                                     "diff_ci": list(boot.ci) if boot.ci else None})
    bm25 = next((e for e in evaluations if e.name == "bm25"), None)
    if bm25 is not None and values(bm25, "ndcg@10"):
        easy = bm25_easy_split(values(bm25, "ndcg@10"))
        split: dict[str, Any] = {"n_easy": len(easy), "n_hard": len(bm25.per_query) - len(easy), "runs": {}}
        for evaluation in evaluations:
            rows = {}
            for metric in metrics:
                per_query = values(evaluation, metric)
                if not per_query:
                    continue
                in_easy = [v for q, v in per_query.items() if q in easy]
                in_hard = [v for q, v in per_query.items() if q not in easy]
                rows[metric] = {"easy": float(np.mean(in_easy)) if in_easy else None,
                                "hard": float(np.mean(in_hard)) if in_hard else None}
            split["runs"][evaluation.name] = rows
        result["bm25_easy"] = split
    return result


def format_statistics(statistics: dict[str, Any]) -> str:
    """A plain-text summary of :func:`evaluation_statistics` (intervals, then paired tests)."""
    lines = [f"bootstrap {100 * statistics['confidence']:.0f}% intervals ({statistics['n_bootstrap']} samples)"]
    for name, rows in statistics["bootstrap"].items():
        for metric, row in rows.items():
            lines.append(f"  {name:<40} {metric:<12} {row['observed']:.4f}  [{row['low']:.4f}, {row['high']:.4f}]")
    if statistics["paired"]:
        lines.append("paired tests (a - b)")
        for row in statistics["paired"]:
            lines.append(f"  {row['a']} vs {row['b']} {row['metric']}: diff {row['mean_diff']:+.4f} "
                         f"t-test p={row['p_t_test']:.3g} permutation p={row['p_permutation']:.3g} "
                         f"bootstrap p={row['p_bootstrap']:.3g} (n={row['n']})")
    return "\n".join(lines)


def write_results(directory: str | Path, dataset: BeirDataset, evaluations: list[Evaluation],
                  settings: dict[str, Any], models: dict[str, Any],
                  statistics: dict[str, Any] | None = None) -> Path:
    """``metrics.json`` (settings, versions, dataset/model fingerprints, aggregates, optional statistics),
    per-query JSON, TREC runs."""
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
                                 for e in evaluations},
                        **({"statistics": statistics} if statistics is not None else {}))
    write_json_atomic(directory / "metrics.json", record)
    return directory / "metrics.json"


def format_table(evaluations: list[Evaluation], metrics=DEFAULT_METRICS) -> str:
    names = [m.lower() for m in metrics]
    width = max(len(e.name) for e in evaluations) + 2
    lines = ["model".ljust(width) + "".join(f"{m:>13}" for m in names)]
    for e in evaluations:
        lines.append(e.name.ljust(width) + "".join(f"{e.aggregate[m]:>13.4f}" for m in names))
    return "\n".join(lines)
