"""Exact scoring of stored documents, exhaustive exact ranking and re-ranking; what full ranking
(:mod:`hil.retrieval.full_ranking`) shares with them.

Every ranking follows trec_eval's rule (:mod:`hil.data.ranking`: score descending, then document id descending), so
a metric at k is the same from a depth-k search as from any deeper one. With ``skip_self`` a query's own document
(same id) is skipped before the top-k cut, as BEIR's exact search does (it retrieves k + 1 and skips it): k
candidates besides the query itself are ranked. A NaN or infinite query vector or score is never ranked: it raises
:class:`~hil.retrieval.integrity.NonFiniteError` naming the queries and the likely cause (a model producing NaN, or
a damaged index).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from hil.data.ranking import id_rank, top_k_indices
from hil.modeling.contracts import EncodedBatch, Encoder
from hil.retrieval.encoding import encode_document_tokens, eval_mode
from hil.retrieval.index import TokenIndex
from hil.retrieval.integrity import check_finite_queries, check_finite_scores, check_finite_vectors, non_finite_scores
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


def self_row(store: TokenStore, qid: str, skip_self: bool) -> int | None:
    """The row of the document whose id is the query's (None when not skipped or not in the corpus)."""
    return store.doc_index.get(qid) if skip_self else None


def store_location(store: TokenStore) -> str:
    return str(store.directory) if isinstance(store, TokenIndex) else "the token store"


def check_heads(encoder: Encoder, store: TokenStore) -> None:
    missing = [head for head in encoder.head_names if head not in store.embeddings]
    if missing:
        raise ValueError(f"{store_location(store)} has heads {list(store.head_names)}; the encoder needs {missing} too "
                         "(index built with another model?)")


def query_items(queries: dict[str, str]) -> tuple[list[str], list[str]]:
    qids = list(queries)
    texts = [queries[qid] for qid in qids]
    bad = [qid for qid, text in zip(qids, texts) if not isinstance(text, str)][:5]
    if bad:
        raise TypeError(f"query texts must be strings; queries {bad} are not")
    return qids, texts


def search_progress(total: int, desc: str, enabled: bool) -> Any:
    return progress_bar(total, desc, "query", enabled)


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
    check_heads(encoder, index)
    qids, texts = query_items(queries)
    all_docs = np.arange(index.n_docs, dtype=np.int64)
    group = max(1, score_matrix_bytes // (4 * max(1, index.n_docs)))
    run: dict[str, dict[str, float]] = {}
    started = time.perf_counter()
    bar = search_progress(len(qids), "exact ranking", progress)
    with eval_mode(encoder):
        for group_start in range(0, len(qids), group):
            group_texts = texts[group_start: group_start + group]
            encoded = concat_batches([encoder.encode_queries(group_texts[i: i + batch_size])
                                       for i in range(0, len(group_texts), batch_size)])
            group_qids = qids[group_start: group_start + group]
            check_finite_queries(encoded, group_qids, encoder.architecture)
            scores = score_documents(encoder, encoded, index, all_docs, block_tokens=block_tokens)  # (G, n_docs)
            check_finite_scores(scores, group_qids, store_location(index))
            for row, qid in enumerate(group_qids):
                best_docs, best_scores = top_k(scores[row], all_docs, index.doc_id_rank, k,
                                               exclude=self_row(index, qid, skip_self))
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
    check_heads(encoder, store)
    qids, texts = query_items(queries)
    every = np.arange(store.n_docs, dtype=np.int64)
    with eval_mode(encoder):
        encoded = concat_batches([encoder.encode_queries(texts[i: i + batch_size])
                                  for i in range(0, len(texts), batch_size)])
        check_finite_queries(encoded, qids, encoder.architecture)
        heads = score_documents(encoder, encoded, store, every, block_tokens=block_tokens, by_head=True)
        total = sum(heads.values()) if len(heads) > 1 else next(iter(heads.values()))
        check_finite_scores(total, qids, store_location(store))  # a NaN or inf of any head reaches the sum
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
    qids, _ = query_items(queries)
    wanted = {qid: _unique_in_order(candidates.get(qid, ())) for qid in qids}
    if index is not None:
        check_heads(encoder, index)
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
    bar = search_progress(len(qids), "re-ranking", progress)
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
                                                   exclude=self_row(store, qid, skip_self))
                    run[qid] = {store.doc_ids[d]: float(s) for d, s in zip(best_docs.tolist(), best_scores.tolist())}
                if non_finite:  # documents encoded just now (no index) are the model's output
                    raise non_finite_scores(non_finite,
                                            store_location(index) if index is not None else "the candidates "
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
