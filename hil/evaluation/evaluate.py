"""The one way to evaluate a retriever on a BEIR dataset: ``evaluate(encoder, dataset, EvaluationSettings(...))``.

``evaluate.py``, the analysis report, the paper experiment and the benchmark all call it. Modes:

    full        the index's back-end proposes candidates (FAISS over document tokens, or PLAID centroids), every
                candidate is scored by exact late interaction, top-k per query (the paper's setting)
    rerank      exact late interaction over given candidates per query (e.g. BM25's top 100, or any first stage
                given as a TREC run file: ``evaluate_run_file`` scores it, ``first_stage`` takes its candidates)
    exhaustive  every query against every document (full ranking without a first-stage approximation); with
                ``candidates`` only those are ranked; ``keep_head_scores`` keeps each head's dense score matrix

The documents are an index on disk under ``index_root`` (built once, reused while corpus and encoder fingerprints
match), or, with ``index_root=None`` (rerank and exhaustive only), encoded in memory. BM25, the baseline and the
usual first stage, is ``evaluate_bm25``. Metrics come from pytrec_eval (``hil.evaluation.metrics``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from hil.data.beir import BeirDataset
from hil.data.bm25 import bm25_run
from hil.errors import UserError
from hil.evaluation.metrics import DEFAULT_METRICS, evaluate_run
from hil.evaluation.runs import candidates_from_run, read_trec_run, run_depth
from hil.evaluation.settings import EvaluationSettings, run_name  # noqa: F401 (EvaluationSettings re-exported)
from hil.modeling.contracts import EncodedBatch, Encoder
from hil.retrieval.builder import open_or_build_index
from hil.retrieval.corpus_encoding import check_processes
from hil.retrieval.devices import autocast, check_precision, faiss_gpu_for, resolve_device
from hil.retrieval.encoding import encode_document_tokens, eval_mode
from hil.retrieval.full_ranking import full_rank
from hil.retrieval.index import TokenIndex, encoder_fingerprint
from hil.retrieval.onnx_encode import onnx_query_encoder
from hil.retrieval.search import SearchResult, exact_rank, exhaustive_scores, rank_matrix, rerank
from hil.retrieval.store import TokenStore

Run = dict[str, dict[str, float]]


@dataclass
class HeadScores:
    """Each head's score of every query (rows, ``qids``) against every document of ``Evaluation.store``, and the
    queries as they were encoded for it."""

    qids: list[str]
    heads: dict[str, np.ndarray]  # head -> (Q, n_docs) float32
    queries: EncodedBatch         # (Q, Lq)


@dataclass
class Evaluation:
    name: str
    run: Run
    aggregate: dict[str, float]
    per_query: dict[str, dict[str, float]]
    details: dict[str, Any] = field(default_factory=dict)
    head_scores: HeadScores | None = None  # exhaustive mode with keep_head_scores
    store: TokenStore | None = None        # the documents as scored (an index on disk, or in memory)


def score_run(name: str, dataset: BeirDataset, run: Run, metrics: Sequence[str] = DEFAULT_METRICS,
              drop_self_matches: bool = True, **details: Any) -> Evaluation:
    """A run measured against the dataset's qrels (binary metrics at the dataset's ``relevance_level``)."""
    aggregate, per_query = evaluate_run(dataset.qrels, run, metrics, drop_self_matches=drop_self_matches,
                                        relevance_level=dataset.relevance_level)
    return Evaluation(name, run, aggregate, per_query, details)


def evaluate_run_file(path: str | Path, dataset: BeirDataset, metrics: Sequence[str] = DEFAULT_METRICS,
                      drop_self_matches: bool = True, name: str | None = None) -> Evaluation:
    """A first stage given as a TREC run file (e.g. TREC DL's ``bm25-top100.trec``), checked against the dataset
    (every query judged, every document in the corpus: :func:`~hil.evaluation.runs.read_trec_run`) and scored as
    it is: the baseline row of a re-ranking. ``name`` defaults to the file's stem."""
    run = read_trec_run(path, queries=dataset.queries, documents=dataset.corpus)
    return score_run(name or run_name(Path(path).stem), dataset, run, metrics, drop_self_matches,
                     mode="first-stage", run_file=str(path), depth=run_depth(run))


def evaluate_bm25(dataset: BeirDataset, k: int = 1000, metrics: Sequence[str] = DEFAULT_METRICS,
                  drop_self_matches: bool = True) -> Evaluation:
    """BM25 (``hil.data.bm25``): the baseline row, and the first stage of re-ranking. With ``drop_self_matches``
    the query's own document is skipped before the cut (k others are ranked, BEIR's rule)."""
    started = time.perf_counter()
    run = bm25_run(dataset, k=k, skip_self=drop_self_matches)
    return score_run("bm25", dataset, run, metrics, drop_self_matches, mode="bm25", k=k,
                     skip_self=drop_self_matches, search_seconds=round(time.perf_counter() - started, 3))


def subset_with_first_stage(dataset: BeirDataset, first: Evaluation | None, n_queries: int | None,
                            n_docs: int | None, seed: int, depth: int | None, drop_self_matches: bool = True,
                            ) -> tuple[BeirDataset, Evaluation | None, dict[str, list[str]] | None]:
    """A slice of ``dataset`` (:meth:`~hil.data.beir.BeirDataset.subset`; none when both sizes are None) that keeps
    the kept queries' first-stage candidates (``first``'s top ``depth``, all when None), the first stage scored on
    the slice, and those candidates."""
    candidates = first_stage(first, depth) if first is not None else None
    if n_queries is not None or n_docs is not None:
        dataset = dataset.subset(n_queries, n_docs, seed=seed, candidates=candidates)
    if first is None:
        return dataset, None, None
    kept = {qid: first.run[qid] for qid in dataset.queries if qid in first.run}
    first = score_run(first.name, dataset, kept, tuple(first.aggregate), drop_self_matches, **first.details)
    return dataset, first, {qid: candidates[qid] for qid in kept}


def first_stage(evaluation: Evaluation, depth: int | None) -> dict[str, list[str]]:
    """Each query's top ``depth`` documents (all when None) of a run (BM25's, a run file's), best first in
    trec_eval's order (ties by document id, descending): the candidates to re-rank."""
    return candidates_from_run(evaluation.run, depth)


def index_dir(root: str | Path, dataset: BeirDataset, encoder: Encoder, document_encoding: str | None = None) -> Path:
    """Where an encoder's index of a dataset lives: keyed by the corpus and encoder fingerprints."""
    folder = Path(root) / f"{dataset.name}-{dataset.fingerprint()[:8]}" / encoder_fingerprint(encoder)[:12]
    return folder.with_name(f"{folder.name}-{document_encoding}") if document_encoding else folder


def place_encoder(encoder: Encoder, settings: EvaluationSettings) -> torch.device:
    """Move ``encoder`` (in place) to ``settings.device`` after checking that the device exists and can autocast to
    ``settings.precision``; -> the device."""
    device = resolve_device(settings.device)
    check_precision(settings.precision, device)
    check_processes(settings.processes, device)
    if encoder.device != device:
        encoder.to(device)
    return device


def faiss_on_gpu(settings: EvaluationSettings, device: torch.device) -> int | None:
    """The GPU FAISS searches on (None: the CPU): ``faiss_gpu`` False -> CPU; True or None -> the encoder's GPU where
    faiss-gpu sees it (True on a CPU encoder: GPU 0)."""
    if settings.faiss_gpu is False:
        return None
    if settings.faiss_gpu and device.type != "cuda":
        device = torch.device("cuda", 0)
    return faiss_gpu_for(device)


def document_store(encoder: Encoder, dataset: BeirDataset, settings: EvaluationSettings) -> TokenStore:
    """The corpus as the model scores it: the index under ``settings.index_root`` (built or reused), or encoded
    in memory (fp16, as an index stores it) when that is None; on the encoder's device, in ``settings.precision``."""
    settings = settings.for_device(encoder.device.type)
    if settings.index_root is None:
        with eval_mode(encoder), autocast(encoder.device, settings.precision):
            tokens = encode_document_tokens(encoder, dataset.documents(), batch_size=settings.batch_size)
        return tokens.to_store(dataset.doc_ids())
    quantize = {"quantize": settings.document_encoding} if settings.document_encoding else {}
    quantize.update(precision=settings.precision, processes=settings.processes,
                    tokenizer_workers=settings.tokenizer_workers)
    gpu = faiss_on_gpu(settings, encoder.device)
    quantize.update(use_gpu=gpu is not None, gpu_device=gpu or 0)
    return open_or_build_index(encoder, dataset.doc_ids(), dataset.documents(),
                               index_dir(settings.index_root, dataset, encoder, settings.document_encoding),
                               batch_size=settings.batch_size, backend=settings.backend,
                               corpus_fingerprint=dataset.fingerprint(), progress=settings.progress,
                               verify=settings.verify_index, **quantize)


def _search(encoder: Encoder, dataset: BeirDataset, store: TokenStore | None, settings: EvaluationSettings,
            candidates: dict[str, list[str]] | None) -> tuple[SearchResult, HeadScores | None]:
    settings = settings.for_device(encoder.device.type)
    queries, k, progress, skip_self = dataset.queries, settings.k, settings.progress, settings.drop_self_matches
    if settings.mode == "full":
        if not isinstance(store, TokenIndex):
            raise ValueError("full ranking searches an index on disk (a TokenIndex), not documents held in memory")
        gpu = faiss_on_gpu(settings, encoder.device)
        options: dict[str, Any] = {} if gpu is None else {"use_gpu": True, "gpu_device": gpu}
        if settings.query_encoding is not None:
            if encoder.device.type != "cpu":
                raise UserError(f"query_encoding {settings.query_encoding!r} runs on the CPU; the model is on "
                                f"{encoder.device}")
            options["query_encoder"] = onnx_query_encoder(encoder)
        result = full_rank(encoder, store, queries, k=k, search=settings.resolved_search, progress=progress,
                           batch_size=settings.query_batch_size, batched=settings.batched_search,
                           keep_candidate_sources=settings.keep_candidate_sources, skip_self=skip_self, **options)
        if "query_encoder" in options:  # what encoded the queries, as it described itself
            result.stats["query_encoding"] = dict(options["query_encoder"].backbone.description)
        return result, None
    if settings.mode == "rerank":
        texts = None if store is not None else {doc_id: dataset.doc_text(doc_id) for docs in candidates.values()
                                                for doc_id in docs}
        return rerank(encoder, store, queries, candidates, texts, k=k, batch_size=settings.query_batch_size,
                      doc_batch_size=settings.batch_size, progress=progress, skip_self=skip_self), None
    if not settings.keep_head_scores and candidates is None:
        return exact_rank(encoder, store, queries, k=k, batch_size=settings.query_batch_size,
                          progress=progress, skip_self=skip_self), None
    encoded, heads, total = exhaustive_scores(encoder, store, queries, batch_size=settings.query_batch_size)
    qids = list(queries)
    result = SearchResult(rank_matrix(total, qids, store.doc_ids, k, candidates, skip_self=skip_self),
                          {qid: {} for qid in qids},
                          {"n_queries": len(qids), "k": k, "skip_self": skip_self,
                           "candidates_mean": float(store.n_docs)})
    return result, HeadScores(qids, heads, encoded) if settings.keep_head_scores else None


def evaluate(encoder: Encoder, dataset: BeirDataset, settings: EvaluationSettings = EvaluationSettings(), *,
             name: str | None = None, candidates: dict[str, list[str]] | None = None,
             store: TokenStore | None = None) -> Evaluation:
    """Evaluate ``encoder`` on ``dataset`` as ``settings`` say (see the module docstring).

    ``candidates`` (qid -> document ids, e.g. ``first_stage(evaluate_bm25(dataset), depth)``) are what ``rerank``
    scores and what ``exhaustive`` ranks among; ``store`` evaluates over documents already indexed (else the
    index is built or reused, or the corpus encoded in memory). ``name`` defaults to ``<architecture>-<mode>``.
    """
    if settings.mode == "rerank" and candidates is None:
        raise UserError("mode='rerank' needs candidates (e.g. first_stage(evaluate_bm25(dataset), depth))")
    device = place_encoder(encoder, settings)
    settings = settings.for_device(device.type)
    started = time.perf_counter()
    if store is None and not (settings.mode == "rerank" and settings.index_root is None):
        store = document_store(encoder, dataset, settings)
    index_seconds = time.perf_counter() - started
    started = time.perf_counter()
    result, head_scores = _search(encoder, dataset, store, settings, candidates)
    search_seconds = time.perf_counter() - started
    details: dict[str, Any] = {"mode": settings.mode, "device": str(device), "precision": settings.precision,
                               "processes": settings.processes, "batch_size": settings.batch_size,
                               "query_batch_size": settings.query_batch_size,
                               "tokenizer_workers": settings.tokenizer_workers,
                               "index_seconds": round(index_seconds, 3),
                               "search_seconds": round(search_seconds, 3), "search_stats": result.stats,
                               "sources": result.sources}
    if isinstance(store, TokenIndex):  # read back from the index: what the search structures were built with
        details.update(index_dir=str(store.directory), index_opened=store.how_opened,
                       document_encoding=store.meta.get("document_encoding"),
                       backend=store.backend_settings)
        if store.how_opened not in ("reused", "opened"):  # built (or partly) here: where index_seconds went
            details["index_build_seconds"] = store.meta.get("build_seconds")
    evaluation = score_run(name or f"{encoder.architecture}-{settings.mode}", dataset, result.run, settings.metrics,
                           settings.drop_self_matches, **details)
    evaluation.head_scores, evaluation.store = head_scores, store
    return evaluation


def evaluate_transformed(encoder: Encoder, dataset: BeirDataset, spec: str,
                         settings: EvaluationSettings = EvaluationSettings(), *, transform_mode: str = "token",
                         max_tokens: int = 200_000, max_docs: int = 20_000, seed: int = 0, name: str | None = None,
                         candidates: dict[str, list[str]] | None = None) -> tuple[Evaluation, Encoder]:
    """Evaluate ``encoder`` with the post-hoc transform ``spec`` (e.g. ``"whitening"``, ``"whitening:k=64"``).

    The base index is built (or reused); the transform is fitted on its stored document vectors
    (``transform_mode`` token-wise or sequence-wise, seeded sample); a derived index holds the transformed vectors
    and the fitted ``transform_<head>.pt`` files; then the transformed encoder is evaluated over it.
    Returns the evaluation and the :class:`~hil.retrieval.transformed.TransformedEncoder`.
    """
    from hil.retrieval.transformed import fit_transformed_encoder, open_or_derive_index

    if settings.index_root is None:
        raise UserError("a post-hoc transform is fitted on an index's stored vectors: give index_root")
    settings = settings.for_device(encoder.device.type)
    base = document_store(encoder, dataset, replace(settings, document_encoding=None))
    started = time.perf_counter()
    transformed = fit_transformed_encoder(encoder, spec, store=base, mode=transform_mode, max_tokens=max_tokens,
                                          max_docs=max_docs, seed=seed)
    fit_seconds = time.perf_counter() - started
    derived = open_or_derive_index(base, transformed, index_dir(settings.index_root, dataset, transformed),
                                   backend=settings.backend, progress=settings.progress,
                                   verify=settings.verify_index)
    evaluation = evaluate(transformed, dataset, settings, candidates=candidates, store=derived,
                          name=name or run_name(f"{encoder.architecture}+{spec}-{transform_mode}-{settings.mode}"))
    evaluation.details["transform"] = {**transformed.transform_settings(), "fit_seconds": round(fit_seconds, 3),
                                       "base_index_dir": str(base.directory), "index_dir": str(derived.directory),
                                       "files": sorted(p.name for p in derived.directory.glob("transform_*.pt"))}
    return evaluation, transformed
