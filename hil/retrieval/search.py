"""Full ranking (back-end candidates -> exact late interaction), exhaustive exact ranking, and re-ranking.

Full ranking follows ColBERT v1's end-to-end retrieval (Khattab & Zaharia 2020, Sec. 3.6; HIL Sec. 2) in two steps:
the index's back-end (:mod:`hil.retrieval.backends`: a token ANN search in FAISS, or PLAID's centroid pruning)
proposes each query's candidate documents, the union over heads; then every candidate is scored exactly with
``encoder.score`` (for ColBERT, Eq. 1 ``sum_i max_j E_qi . E_dj``; the model decides how its heads combine:
search never hard-codes MaxSim). Scores come from the index's fp16 vectors widened to fp32.

Every ranking follows trec_eval's rule (:mod:`hil.data.ranking`: score descending, then document id descending), so
a metric at k is the same from a depth-k search as from any deeper one. With ``skip_self`` a query's own document
(same id) is skipped before the top-k cut, as BEIR's exact search does (it retrieves k + 1 and skips it): k
candidates besides the query itself are ranked. A NaN or infinite query vector or score is never ranked: it raises
:class:`~hil.retrieval.integrity.NonFiniteError` naming the queries and the likely cause (a model producing NaN, or
a damaged index).
"""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from hil.data.ranking import id_rank, top_k_indices
from hil.modeling.contracts import EncodedBatch, Encoder
from hil.retrieval.backends.base import Candidates
from hil.retrieval.backends.configs import SearchConfig, with_search_values
from hil.retrieval.backends.registry import open_backend
from hil.retrieval.devices import resolve_device
from hil.retrieval.encoding import encode_document_tokens, eval_mode
from hil.retrieval.index import TokenIndex
from hil.retrieval.integrity import (check_finite_queries, check_finite_scores, check_finite_vectors,
                                     non_finite_scores)
from hil.retrieval.progress import progress_bar
from hil.retrieval.store import TokenStore, gather_documents, length_blocks

# Bound on the (Bq, C, Lq, Lmax) similarity tensor of one ``encoder.score`` call, in fp32 elements (128 MiB).
_SIM_ELEMENTS = 1 << 25


@dataclass
class SearchResult:
    """A run in BEIR's shape plus where each candidate came from and how long it took.

    ``sources[qid][docid]`` names the heads whose ANN search produced the document (full ranking only; the
    paper's Figure 3 overlap); it covers the ranked documents, or every candidate with
    ``keep_candidate_sources=True``. ``stats`` holds candidate counts and timings.
    """

    run: dict[str, dict[str, float]]
    sources: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)


def score_documents(encoder: Encoder, queries: EncodedBatch, store: TokenStore, doc_indices: np.ndarray, *,
                    block_tokens: int = 1 << 14, by_head: bool = False) -> np.ndarray | dict[str, np.ndarray]:
    """``encoder.score`` of every query against every listed stored document. -> (Bq, C) float32.

    Documents are sorted by length and scored in blocks of at most ``block_tokens`` padded tokens (little
    padding, bounded memory); queries in sub-batches that keep the similarity tensor under ``_SIM_ELEMENTS``.
    ``by_head=True`` returns each head's score instead (``encoder.score_heads``), in one pass. An encoder that
    ``normalizes_per_query`` gets its per-query moments from all C documents, accumulated over the blocks.
    """
    if encoder.normalizes_per_query:
        return _score_documents_per_query(encoder, queries, store, doc_indices, block_tokens, by_head)
    doc_indices = np.asarray(doc_indices, dtype=np.int64)
    n_queries = len(queries)
    if by_head:
        def score_fn(q: EncodedBatch, d: EncodedBatch) -> dict[str, torch.Tensor]:
            return encoder.score_heads(q, d, all_pairs=True)
        out = {head: np.empty((n_queries, len(doc_indices)), dtype=np.float32) for head in encoder.head_names}
    else:
        def score_fn(q: EncodedBatch, d: EncodedBatch) -> dict[str, torch.Tensor]:
            return {"": encoder.score(q, d)}
        out = {"": np.empty((n_queries, len(doc_indices)), dtype=np.float32)}
    for block, part, docs in _blocks(encoder, queries, store, doc_indices, block_tokens):
        for name, values in score_fn(queries.select(part), docs).items():
            out[name][part, block] = values.float().cpu().numpy()
    return out if by_head else out[""]


def _blocks(encoder: Encoder, queries: EncodedBatch, store: TokenStore, doc_indices: np.ndarray,
            block_tokens: int) -> Iterator[tuple[np.ndarray, slice, EncodedBatch]]:
    """(positions in ``doc_indices``, query slice, gathered documents) of each scoring call."""
    lengths = store.doc_lengths[doc_indices]
    order = np.argsort(lengths, kind="stable")
    query_len = queries.mask.shape[1]
    for start, end in length_blocks(lengths[order], block_tokens):
        block = order[start:end]
        # A pure MaxSim (scores_repeated_padding) reads the vectors alone: no mask needed, no token ids read.
        pure_maxsim = encoder.scores_repeated_padding
        docs = gather_documents(store, doc_indices[block], heads=encoder.head_names, device=encoder.device,
                                repeat_padding=pure_maxsim, token_ids=not pure_maxsim)
        step = max(1, _SIM_ELEMENTS // max(1, query_len * docs.mask.numel()))  # queries per score call
        for q_start in range(0, len(queries), step):
            yield block, slice(q_start, q_start + step), docs


def _score_documents_per_query(encoder: Encoder, queries: EncodedBatch, store: TokenStore, doc_indices: np.ndarray,
                               block_tokens: int, by_head: bool) -> np.ndarray | dict[str, np.ndarray]:
    """``score_documents`` for an encoder whose moments are per query: sums first, z-scores at the end."""
    doc_indices = np.asarray(doc_indices, dtype=np.int64)
    shape = (len(queries), len(doc_indices))
    sums = {head: np.zeros(shape, dtype=np.float64) for head in encoder.head_names}
    squares = {head: np.zeros(shape, dtype=np.float64) for head in encoder.head_names}
    counts: dict[str, np.ndarray] = {}
    for block, part, docs in _blocks(encoder, queries, store, doc_indices, block_tokens):
        for head, (late_raw, square_sums, n_tokens) in encoder.raw_head_scores(queries.select(part), docs).items():
            sums[head][part, block] = late_raw.double().cpu().numpy()
            squares[head][part, block] = square_sums.double().cpu().numpy()
            counts.setdefault(head, np.zeros(len(queries), dtype=np.float64))[part] = n_tokens.double().cpu().numpy()
    totals = {head: (torch.from_numpy(sums[head]), torch.from_numpy(squares[head]),
                     torch.from_numpy(counts.get(head, np.zeros(len(queries))))) for head in encoder.head_names}
    out = {head: values.float().numpy() for head, values in encoder.normalize_per_query(totals).items()}
    return out if by_head else sum(out.values())


def top_k(scores: np.ndarray, doc_indices: np.ndarray, doc_id_rank: np.ndarray, k: int,
          exclude: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best documents in trec_eval's order (score descending, then document id descending:
    :func:`hil.data.ranking.top_k_indices`); ``exclude``: a document row never ranked (the query's own).
    -> (doc_indices (k',), scores (k',))."""
    doc_indices = np.asarray(doc_indices, dtype=np.int64)
    skip = None
    if exclude is not None:
        found = np.flatnonzero(doc_indices == exclude)
        skip = int(found[0]) if len(found) else None
    best = top_k_indices(scores, doc_id_rank[doc_indices], k, exclude=skip)
    return doc_indices[best], np.asarray(scores)[best]


def _self_row(store: TokenStore, qid: str, skip_self: bool) -> int | None:
    """The row of the document whose id is the query's (None when not skipped or not in the corpus)."""
    return store.doc_index.get(qid) if skip_self else None


def _where(store: TokenStore) -> str:
    return str(store.directory) if isinstance(store, TokenIndex) else "the token store"


def _check_heads(encoder: Encoder, store: TokenStore) -> None:
    missing = [head for head in encoder.head_names if head not in store.embeddings]
    if missing:
        raise ValueError(f"{_where(store)} has heads {list(store.head_names)}; the encoder needs {missing} too "
                         "(index built with another model?)")


def _query_items(queries: dict[str, str]) -> tuple[list[str], list[str]]:
    qids = list(queries)
    texts = [queries[qid] for qid in qids]
    bad = [qid for qid, text in zip(qids, texts) if not isinstance(text, str)][:5]
    if bad:
        raise TypeError(f"query texts must be strings; queries {bad} are not")
    return qids, texts


def _progress(total: int, desc: str, enabled: bool) -> Any:
    return progress_bar(total, desc, "query", enabled)


@contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    tick = time.perf_counter()
    try:
        yield
    finally:
        timings[name] += time.perf_counter() - tick


class _HeadOverlap:
    """How many candidates each exact combination of heads proposed (the Venn regions of the paper's Figure 3)."""

    def __init__(self, heads: Sequence[str]):
        self.combos = [c for r in range(1, len(heads) + 1) for c in combinations(range(len(heads)), r)]
        self.names = ["+".join(heads[i] for i in combo) for combo in self.combos]
        self.counts = dict.fromkeys(self.names, 0)

    def add(self, flags: np.ndarray) -> None:
        """flags (U, H) bool: which heads proposed each candidate of one query."""
        for name, combo in zip(self.names, self.combos):
            wanted = np.zeros(flags.shape[1], dtype=bool)
            wanted[list(combo)] = True
            self.counts[name] += int((flags == wanted).all(axis=1).sum())


def _named_sources(index: TokenIndex, heads: Sequence[str], found: Candidates,
                   docs: list[int]) -> dict[str, tuple[str, ...]]:
    """Document id -> the heads that proposed it, for ``docs`` (all among ``found``, whose docs are ascending)."""
    rows = found.heads[np.searchsorted(found.docs, docs)].tolist() if len(docs) else []
    names: dict[tuple[bool, ...], tuple[str, ...]] = {}  # one tuple of head names per combination of flags
    for row in map(tuple, rows):
        if row not in names:
            names[row] = tuple(h for h, flag in zip(heads, row) if flag)
    return {index.doc_ids[d]: names[tuple(row)] for d, row in zip(docs, rows)}


def full_rank(encoder: Encoder, index: TokenIndex, queries: dict[str, str], *, k: int = 1000,
              search: SearchConfig | None = None, batch_size: int = 64, use_gpu: bool = False, gpu_device: int = 0,
              block_tokens: int = 1 << 16, keep_candidate_sources: bool = False, progress: bool = True,
              skip_self: bool = False, ncandidates: int | None = None, max_candidates: int | None = None,
              nprobe: int | None = None, stage2_docs: int | None = None,
              device: torch.device | str | None = None, query_encoder: Encoder | None = None) -> SearchResult:
    """End-to-end retrieval: the back-end's candidate documents (union over heads) -> exact ``encoder.score``
    -> top ``k``.

    ``search``: the search-time settings of the index's back-end (:mod:`hil.retrieval.backends.configs`; its
    defaults when None); ``ncandidates``, ``max_candidates``, ``nprobe``, ``stage2_docs`` set single fields of it
    (a field the back-end does not have is refused). Token ANN back-ends (``flat``, ``ivfflat``, ``ivfpq``): per
    query token ``ncandidates`` ANN hits per head (``nprobe`` IVF lists visited); ``max_candidates`` caps the
    candidates per query, keeping those with the best approximate score (the sum over heads and query tokens of each
    token's best retrieved similarity in the document: a ColBERT-style lower bound of MaxSim, a choice of ours).
    A ``plaid`` index (centroid pruning, :mod:`hil.retrieval.plaid`): each query token probes ``nprobe`` centroids,
    ``stage2_docs`` documents survive the probed-cells bound, and each head keeps its ``max_candidates`` (``ndocs``)
    best documents by centroid interaction; the union over heads is scored exactly. Its stages run on ``device``
    (``auto``, ``cpu``, ``cuda[:N]``; None: the encoder's device). ``query_encoder``: encodes the queries instead
    of ``encoder`` (a faster runtime of the same model, :func:`hil.retrieval.onnx_encode.onnx_query_encoder`);
    documents are always scored by ``encoder``. ``block_tokens``: padded document tokens gathered per scoring call
    (one query at a time: 65,536 tokens are a 32 MiB fp32 block at D = 128, and fewer calls than 16,384; the same
    scores, bit for bit, on SciFact).

    ``stats`` records the settings as the back-end used them (``search``: read back after the search).
    """
    if k < 1 or batch_size < 1:
        raise ValueError(f"k and batch_size must be >= 1 (got {k}, {batch_size})")
    _check_heads(encoder, index)
    qids, texts = _query_items(queries)
    heads = tuple(encoder.head_names)
    kind = index.backend_settings["kind"]
    if kind == "plaid":  # ``max_candidates`` is PLAID's ``ndocs``
        fields = {"ndocs": max_candidates, "nprobe": nprobe, "stage2_docs": stage2_docs, "ncandidates": ncandidates}
    else:
        fields = {"ncandidates": ncandidates, "max_candidates": max_candidates, "nprobe": nprobe,
                  "stage2_docs": stage2_docs}
    search = with_search_values(kind, search, fields)
    backend = open_backend(index, search, use_gpu=use_gpu, gpu_device=gpu_device,
                           device=None if device is None else resolve_device(device), depth=k)
    candidates_cap = getattr(backend.search, "ndocs", None) if kind == "plaid" else None
    if candidates_cap is not None and candidates_cap < k:  # a run shorter than k would be read as one of depth k
        warnings.warn(f"plaid: ndocs={candidates_cap} < k={k}: each head proposes at most {candidates_cap} documents, "
                      f"so a query may rank fewer than {k}", stacklevel=2)
    overlap = _HeadOverlap(heads)
    run: dict[str, dict[str, float]] = {}
    sources: dict[str, dict[str, tuple[str, ...]]] = {}
    counts: list[int] = []
    timings = {"encode_s": 0.0, "ann_s": 0.0, "score_s": 0.0}
    started = time.perf_counter()
    bar = _progress(len(qids), "full ranking", progress)
    with eval_mode(encoder):
        for batch_start in range(0, len(qids), batch_size):
            batch_qids = qids[batch_start: batch_start + batch_size]
            with _timed(timings, "encode_s"):
                encoded = (query_encoder or encoder).encode_queries(texts[batch_start: batch_start + batch_size])
            # Before the ANN search: FAISS never returns a NaN neighbour, so NaN queries would rank nothing.
            check_finite_queries(encoded, batch_qids, encoder.architecture)
            with _timed(timings, "ann_s"):  # retrieve
                found = backend.candidates(encoded, heads)
            with _timed(timings, "score_s"):  # rank
                non_finite = []
                for row, (qid, candidates) in enumerate(zip(batch_qids, found)):
                    counts.append(len(candidates.docs))
                    overlap.add(candidates.heads)
                    scores = score_documents(encoder, encoded.select(slice(row, row + 1)), index, candidates.docs,
                                             block_tokens=block_tokens)[0]
                    if not np.isfinite(scores).all():
                        non_finite.append(qid)
                        continue
                    best_docs, best_scores = top_k(scores, candidates.docs, index.doc_id_rank, k,
                                                   exclude=_self_row(index, qid, skip_self))
                    run[qid] = {index.doc_ids[d]: float(s) for d, s in zip(best_docs.tolist(), best_scores.tolist())}
                    kept = candidates.docs if keep_candidate_sources else best_docs
                    sources[qid] = _named_sources(index, heads, candidates, kept.tolist())
                if non_finite:
                    raise non_finite_scores(non_finite, _where(index))
            bar.update(len(batch_qids))
    bar.close()
    total = time.perf_counter() - started
    stats = {"n_queries": len(qids), "k": k, "skip_self": skip_self, "search": backend.search_stats(),
             "candidates_mean": float(np.mean(counts)) if counts else 0.0,
             "candidates_min": int(min(counts, default=0)), "candidates_max": int(max(counts, default=0)),
             "candidate_sources": overlap.counts, **timings, "total_s": total,
             "ms_per_query": 1000.0 * total / max(1, len(qids))}
    return SearchResult(run, sources, stats)


# -- exhaustive exact ranking -----------------------------------------------------------------------------------

def concat_batches(batches: list[EncodedBatch]) -> EncodedBatch:
    """Stack encoded batches, padding to the longest (queries of some encoders need not share a length)."""
    width = max(batch.mask.shape[1] for batch in batches)

    def pad(tensor: torch.Tensor) -> torch.Tensor:
        extra = width - tensor.shape[1]
        if extra == 0:
            return tensor
        shape = (tensor.shape[0], extra, *tensor.shape[2:])
        return torch.cat([tensor, tensor.new_zeros(shape)], dim=1)

    heads = {head: torch.cat([pad(b.heads[head]) for b in batches]) for head in batches[0].heads}
    return EncodedBatch(heads, torch.cat([pad(b.mask) for b in batches]),
                        torch.cat([pad(b.input_ids) for b in batches]))


def exact_rank(encoder: Encoder, index: TokenStore, queries: dict[str, str], k: int = 1000, *, batch_size: int = 64,
               block_tokens: int = 1 << 14, score_matrix_bytes: int = 1 << 30, progress: bool = True,
               skip_self: bool = False) -> SearchResult:
    """Brute force: ``encoder.score`` of every query against every stored document, then top ``k``.

    The ground truth for full ranking. Queries are taken in groups whose (group, n_docs) fp32 score matrix fits
    ``score_matrix_bytes``; each group makes one pass over the corpus.
    """
    _check_heads(encoder, index)
    qids, texts = _query_items(queries)
    all_docs = np.arange(index.n_docs, dtype=np.int64)
    group = max(1, score_matrix_bytes // (4 * max(1, index.n_docs)))
    run: dict[str, dict[str, float]] = {}
    started = time.perf_counter()
    bar = _progress(len(qids), "exact ranking", progress)
    with eval_mode(encoder):
        for group_start in range(0, len(qids), group):
            group_texts = texts[group_start: group_start + group]
            encoded = concat_batches([encoder.encode_queries(group_texts[i: i + batch_size])
                                       for i in range(0, len(group_texts), batch_size)])
            group_qids = qids[group_start: group_start + group]
            check_finite_queries(encoded, group_qids, encoder.architecture)
            scores = score_documents(encoder, encoded, index, all_docs, block_tokens=block_tokens)  # (G, n_docs)
            check_finite_scores(scores, group_qids, _where(index))
            for row, qid in enumerate(group_qids):
                best_docs, best_scores = top_k(scores[row], all_docs, index.doc_id_rank, k,
                                               exclude=_self_row(index, qid, skip_self))
                run[qid] = {index.doc_ids[d]: float(s) for d, s in zip(best_docs.tolist(), best_scores.tolist())}
            bar.update(len(group_texts))
    bar.close()
    total = time.perf_counter() - started
    return SearchResult(run, {qid: {} for qid in qids},
                        {"n_queries": len(qids), "k": k, "skip_self": skip_self,
                         "candidates_mean": float(index.n_docs), "total_s": total,
                         "ms_per_query": 1000.0 * total / max(1, len(qids))})


def exhaustive_scores(encoder: Encoder, store: TokenStore, queries: dict[str, str], *, batch_size: int = 64,
                      block_tokens: int = 1 << 14) -> tuple[EncodedBatch, dict[str, np.ndarray], np.ndarray]:
    """Every query against every stored document, kept dense: the encoded queries, each head's score
    (``encoder.score_heads``) and the model's score. -> (queries (Q, Lq), head -> (Q, n_docs), (Q, n_docs))
    float32, rows in ``queries`` order.

    O(Q * n_docs) memory per head: for the small collections of experiments (ColBERT-lambda from its members'
    matrices, each module's own ranking). The model's score is the sum of its heads' (ColBERT-HIL "simply adds"
    them, ColBERT-lambda by default); that is checked against ``encoder.score`` on a corner of the matrix, so a
    model that combines its heads otherwise (a weighted ensemble) is refused rather than ranked wrongly.
    """
    _check_heads(encoder, store)
    qids, texts = _query_items(queries)
    every = np.arange(store.n_docs, dtype=np.int64)
    with eval_mode(encoder):
        encoded = concat_batches([encoder.encode_queries(texts[i: i + batch_size])
                                  for i in range(0, len(texts), batch_size)])
        check_finite_queries(encoded, qids, encoder.architecture)
        heads = score_documents(encoder, encoded, store, every, block_tokens=block_tokens, by_head=True)
        total = sum(heads.values()) if len(heads) > 1 else next(iter(heads.values()))
        check_finite_scores(total, qids, _where(store))  # a NaN or inf of any head reaches the sum
        # every document: an encoder normalizing per query takes its moments from all of them
        corner = score_documents(encoder, encoded.select(slice(0, 4)), store, every, block_tokens=block_tokens)
    if not np.allclose(corner, total[:4], atol=1e-3, rtol=1e-4):
        raise ValueError(f"{encoder.architecture}: its score is not the sum of its heads' scores (a weighted "
                         "ensemble?); keep_head_scores needs a model that adds its heads")
    return encoded, heads, total


def rank_matrix(scores: np.ndarray, qids: Sequence[str], doc_ids: Sequence[str], k: int,
                candidates: dict[str, Sequence[str]] | None = None,
                skip_self: bool = False) -> dict[str, dict[str, float]]:
    """Top ``k`` per query of a dense (Q, n_docs) score matrix, columns ``doc_ids``: of every document, or,
    with ``candidates``, of each query's candidates only (a query without any gets an empty ranking); trec_eval's
    order, the query's own document skipped with ``skip_self`` (module docstring)."""
    doc_index = {doc: i for i, doc in enumerate(doc_ids)}
    ranks = id_rank(doc_ids)
    every = np.arange(len(doc_ids), dtype=np.int64)
    run: dict[str, dict[str, float]] = {}
    non_finite = []
    for row, qid in enumerate(qids):
        docs = every if candidates is None else np.array([doc_index[d] for d in candidates.get(qid, ())],
                                                         dtype=np.int64)
        if len(docs) == 0:
            run[qid] = {}
            continue
        if not np.isfinite(scores[row, docs]).all():
            non_finite.append(qid)
            continue
        best, best_scores = top_k(scores[row, docs], docs, ranks, k,
                                  exclude=doc_index.get(qid) if skip_self else None)
        run[qid] = {doc_ids[d]: float(s) for d, s in zip(best.tolist(), best_scores.tolist())}
    if non_finite:
        raise non_finite_scores(non_finite, "the score matrix")
    return run


# -- re-ranking -------------------------------------------------------------------------------------------------

def _unique_in_order(items: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(items))


def rerank(encoder: Encoder, index: TokenStore | None, queries: dict[str, str], candidates: dict[str, Sequence[str]],
           texts: dict[str, str] | None = None, k: int = 1000, *, batch_size: int = 64, doc_batch_size: int = 32,
           chunk_docs: int = 2048, block_tokens: int = 1 << 14, progress: bool = True,
           skip_self: bool = False) -> SearchResult:
    """Re-rank given candidates (e.g. BM25's top 100) with ``encoder.score``; top ``k`` per query.

    With an index, the stored vectors are scored (the numbers full ranking gives); without one, the candidates'
    ``texts`` are encoded on the fly (kept in fp32), for groups of queries sharing at most about ``chunk_docs``
    distinct documents, so memory stays bounded. Queries without candidates get an empty ranking.
    """
    qids, _ = _query_items(queries)
    wanted = {qid: _unique_in_order(candidates.get(qid, ())) for qid in qids}
    if index is not None:
        _check_heads(encoder, index)
        missing = sorted({d for docs in wanted.values() for d in docs if d not in index.doc_index})
        if missing:
            raise KeyError(f"{len(missing)} candidate documents are not in the index at "
                           f"{index.directory if isinstance(index, TokenIndex) else '?'}, e.g. {missing[:5]}")
        groups = [(qids, index)]
    else:
        if texts is None:
            raise ValueError("rerank without an index needs the candidates' texts")
        missing = sorted({d for docs in wanted.values() for d in docs if d not in texts})
        if missing:
            raise KeyError(f"{len(missing)} candidate documents have no text, e.g. {missing[:5]}")
        groups = list(_query_groups(qids, wanted, chunk_docs))

    run: dict[str, dict[str, float]] = {}
    timings = {"encode_docs_s": 0.0, "encode_queries_s": 0.0, "score_s": 0.0}
    started = time.perf_counter()
    bar = _progress(len(qids), "re-ranking", progress)
    with eval_mode(encoder):
        for group_qids, store in groups:
            if store is None:  # encode this group's documents
                tick = time.perf_counter()
                group_docs = _unique_in_order([d for qid in group_qids for d in wanted[qid]])
                tokens = encode_document_tokens(encoder, [texts[d] for d in group_docs], batch_size=doc_batch_size,
                                                dtype=np.float32)
                for head, vectors in tokens.embeddings.items():
                    check_finite_vectors(vectors, f"the candidates' document vectors (head {head})",
                                         f"{encoder.architecture} produces NaN (damaged weights, or an unstable "
                                         "precision); no ranking is made from them")
                store = tokens.to_store(group_docs)
                timings["encode_docs_s"] += time.perf_counter() - tick
            for batch_start in range(0, len(group_qids), batch_size):
                batch_qids = group_qids[batch_start: batch_start + batch_size]
                tick = time.perf_counter()
                encoded = encoder.encode_queries([queries[qid] for qid in batch_qids])
                check_finite_queries(encoded, batch_qids, encoder.architecture)
                timings["encode_queries_s"] += time.perf_counter() - tick
                tick = time.perf_counter()
                non_finite = []
                for row, qid in enumerate(batch_qids):
                    docs = np.array([store.doc_index[d] for d in wanted[qid]], dtype=np.int64)
                    if len(docs) == 0:
                        run[qid] = {}
                        continue
                    scores = score_documents(encoder, encoded.select(slice(row, row + 1)), store, docs,
                                             block_tokens=block_tokens)[0]
                    if not np.isfinite(scores).all():
                        non_finite.append(qid)
                        continue
                    best_docs, best_scores = top_k(scores, docs, store.doc_id_rank, k,
                                                   exclude=_self_row(store, qid, skip_self))
                    run[qid] = {store.doc_ids[d]: float(s) for d, s in zip(best_docs.tolist(), best_scores.tolist())}
                if non_finite:  # documents encoded just now (no index) are the model's output
                    raise non_finite_scores(non_finite, _where(index) if index is not None else "the candidates "
                                            "encoded on the fly")
                timings["score_s"] += time.perf_counter() - tick
                bar.update(len(batch_qids))
    bar.close()
    total = time.perf_counter() - started
    counts = [len(docs) for docs in wanted.values()]
    return SearchResult(run, {qid: {} for qid in qids},
                        {"n_queries": len(qids), "k": k, "skip_self": skip_self,
                         "candidates_mean": float(np.mean(counts)) if counts else 0.0,
                         **timings, "total_s": total, "ms_per_query": 1000.0 * total / max(1, len(qids))})


def _query_groups(qids: list[str], wanted: dict[str, list[str]], chunk_docs: int
                  ) -> Iterator[tuple[list[str], None]]:
    """Consecutive groups of queries whose candidates together number about ``chunk_docs`` distinct documents."""
    group: list[str] = []
    seen: set[str] = set()
    for qid in qids:
        new = [d for d in wanted[qid] if d not in seen]
        if group and len(seen) + len(new) > chunk_docs:
            yield group, None
            group, seen = [], set()
        group.append(qid)
        seen.update(wanted[qid])
    if group:
        yield group, None
