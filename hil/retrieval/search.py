"""Full ranking (FAISS candidates -> exact late interaction), exhaustive exact ranking, and re-ranking.

Full ranking follows ColBERT v1's end-to-end retrieval (Khattab & Zaharia 2020, Sec. 3.6; HIL Sec. 2): every
query token vector retrieves its ``ncandidates`` nearest document token vectors from the head's FAISS index; the
documents owning them are the query's candidates (the union over tokens and heads), and every candidate is scored
exactly with ``encoder.score`` (for ColBERT, Eq. 1 ``sum_i max_j E_qi . E_dj``; the model decides how its heads
combine: search never hard-codes MaxSim). Scores come from the index's fp16 vectors widened to fp32.

Ties are broken by document id (sort by ``(-score, doc_id)``) so every ranking is deterministic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from hil.modeling.contracts import EncodedBatch
from hil.retrieval.index import TokenStore, encode_document_tokens, eval_mode

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


# -- gathering stored documents ---------------------------------------------------------------------------------

def gather_documents(store: TokenStore, doc_indices: Sequence[int] | np.ndarray, *,
                     heads: Sequence[str] | None = None, device: torch.device | str | None = None) -> EncodedBatch:
    """Stored documents as a padded :class:`EncodedBatch`: heads (C, Lmax, D) fp32, mask (C, Lmax), input_ids.

    Every stored token takes part in scoring (only scored tokens are stored), so the mask is True exactly on the
    first ``doc_lengths[i]`` positions; padding is zero vectors with input id 0. One ``index_select`` per head
    reads the rows (padding positions re-read the document's first row, then are zeroed): no per-document loop
    and no large zero-filled buffer.
    """
    doc_indices = np.asarray(doc_indices, dtype=np.int64)
    starts = store.doc_offsets[doc_indices]
    lengths = store.doc_offsets[doc_indices + 1] - starts
    n, width = len(doc_indices), max(int(lengths.max(initial=0)), 1)
    positions = np.arange(width)
    mask = positions[None, :] < lengths[:, None]  # (C, Lmax)
    padding = torch.from_numpy(~mask).to(device)
    # With no token stored at all there is no row to read: read nothing and zero everything.
    rows = np.where(mask, starts[:, None] + positions[None, :], starts[:, None]) if store.n_tokens else None
    rows_t = torch.from_numpy(rows.ravel()) if rows is not None else None

    def read(table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # -> (C, Lmax, *table.shape[1:])
        if rows_t is None:
            return torch.zeros((n, width, *table.shape[1:]), dtype=dtype, device=device)
        # Move before widening: half the bytes cross to an accelerator. The result is fresh: in place is safe.
        picked = table.index_select(0, rows_t).view(n, width, *table.shape[1:]).to(device).to(dtype)
        return picked.masked_fill_(padding.view(n, width, *([1] * (table.dim() - 1))), 0)

    def read_vectors(head: str) -> torch.Tensor:  # -> (C, Lmax, D) float32
        array = store.embeddings[head]
        if getattr(array, "codec", None) is None or rows_t is None:
            return read(store.torch_view(head), torch.float32)
        # A compressed-only index (hil.retrieval.codec): decompress exactly the rows read.
        picked = array.rows_torch(rows_t).view(n, width, -1).to(device)
        return picked.masked_fill_(padding.view(n, width, 1), 0)

    encoded = {head: read_vectors(head) for head in (heads if heads is not None else store.head_names)}
    return EncodedBatch(encoded, ~padding, read(store.torch_view("token_ids"), torch.long))


def _length_blocks(sorted_lengths: np.ndarray, block_tokens: int) -> Iterator[tuple[int, int]]:
    """Consecutive ``[start, end)`` blocks of ascending lengths whose padded size ``count * longest`` fits."""
    start, n = 0, len(sorted_lengths)
    while start < n:
        window = np.maximum(sorted_lengths[start: start + block_tokens], 1)
        padded = np.arange(1, len(window) + 1) * window  # nondecreasing: count and longest both grow
        end = start + max(1, int(np.searchsorted(padded, block_tokens, side="right")))
        yield start, end
        start = end


def score_documents(encoder: Any, queries: EncodedBatch, store: TokenStore, doc_indices: np.ndarray, *,
                    block_tokens: int = 1 << 14, by_head: bool = False) -> np.ndarray | dict[str, np.ndarray]:
    """``encoder.score`` of every query against every listed stored document. -> (Bq, C) float32.

    Documents are sorted by length and scored in blocks of at most ``block_tokens`` padded tokens (little
    padding, bounded memory); queries in sub-batches that keep the similarity tensor under ``_SIM_ELEMENTS``.
    ``by_head=True`` returns each head's score instead (``encoder.score_heads``; a one-head encoder without it
    gives ``{head: score}``), in one pass.
    """
    doc_indices = np.asarray(doc_indices, dtype=np.int64)
    n_queries = len(queries)
    if by_head:
        if hasattr(encoder, "score_heads"):
            def score_fn(q: EncodedBatch, d: EncodedBatch) -> dict[str, torch.Tensor]:
                return encoder.score_heads(q, d, all_pairs=True)
        else:
            (head,) = encoder.head_names

            def score_fn(q: EncodedBatch, d: EncodedBatch) -> dict[str, torch.Tensor]:
                return {head: encoder.score(q, d)}
        out = {head: np.empty((n_queries, len(doc_indices)), dtype=np.float32) for head in encoder.head_names}
    else:
        def score_fn(q: EncodedBatch, d: EncodedBatch) -> dict[str, torch.Tensor]:
            return {"": encoder.score(q, d)}
        out = {"": np.empty((n_queries, len(doc_indices)), dtype=np.float32)}
    lengths = store.doc_lengths[doc_indices]
    order = np.argsort(lengths, kind="stable")
    query_len = queries.mask.shape[1]
    for start, end in _length_blocks(lengths[order], block_tokens):
        block = order[start:end]
        docs = gather_documents(store, doc_indices[block], heads=encoder.head_names, device=encoder.device)
        padded_tokens = docs.mask.numel()
        step = max(1, _SIM_ELEMENTS // max(1, query_len * padded_tokens))
        for q_start in range(0, n_queries, step):
            part = queries.select(slice(q_start, q_start + step))
            for name, values in score_fn(part, docs).items():
                out[name][q_start: q_start + step, block] = values.float().cpu().numpy()
    return out if by_head else out[""]


def top_k(scores: np.ndarray, doc_indices: np.ndarray, doc_id_rank: np.ndarray,
          k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best documents sorted by ``(-score, doc_id)``. -> (doc_indices (k',), scores (k',))."""
    doc_indices = np.asarray(doc_indices, dtype=np.int64)
    if len(scores) > k:
        # Keep everything tied with the k-th score so that the id tie-break below sees all of them.
        kth = np.partition(scores, len(scores) - k)[len(scores) - k]
        keep = scores >= kth
        scores, doc_indices = scores[keep], doc_indices[keep]
    order = np.lexsort((doc_id_rank[doc_indices], -scores))[:k]
    return doc_indices[order], scores[order]


def _check_heads(encoder: Any, store: TokenStore) -> None:
    missing = [head for head in encoder.head_names if head not in store.embeddings]
    if missing:
        where = getattr(store, "directory", "the token store")
        raise ValueError(f"{where} has heads {list(store.head_names)}; the encoder needs {missing} too "
                         "(index built with another model?)")


def _query_items(queries: dict[str, str]) -> tuple[list[str], list[str]]:
    qids = list(queries)
    texts = [queries[qid] for qid in qids]
    bad = [qid for qid, text in zip(qids, texts) if not isinstance(text, str)][:5]
    if bad:
        raise TypeError(f"query texts must be strings; queries {bad} are not")
    return qids, texts


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="query", desc=desc, disable=not enabled)


# -- full ranking -----------------------------------------------------------------------------------------------

def _candidates_from_head(faiss_index: Any, vectors: np.ndarray, token_rows: np.ndarray, token_doc: np.ndarray,
                          n_docs: int, ncandidates: int, want_approx: bool
                          ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """One ANN search of all query token vectors of a batch -> unique ``row * n_docs + doc`` keys.

    With ``want_approx`` also each key's approximate score: the sum over query tokens of the best similarity among
    that token's retrieved tokens of the document (MaxSim restricted to what the ANN returned).
    """
    sims, hits = faiss_index.search(vectors, ncandidates)  # (T, k) each
    valid = hits >= 0  # FAISS pads with -1 when it finds fewer than k
    token_pos = np.nonzero(valid)[0]
    docs = token_doc[hits[valid]].astype(np.int64)
    keys = token_rows[token_pos] * n_docs + docs
    if not want_approx:
        return np.unique(keys), None, None
    token_keys = token_pos.astype(np.int64) * n_docs + docs
    similarity = sims[valid]
    order = np.lexsort((-similarity, token_keys))  # per (token, doc) the best hit first
    unique_token_keys, first = np.unique(token_keys[order], return_index=True)
    best = similarity[order][first].astype(np.float64)
    row_keys = token_rows[unique_token_keys // n_docs] * n_docs + unique_token_keys % n_docs
    return np.unique(keys), row_keys, best


def _plaid_candidates(index: Any, heads: tuple[str, ...], encoded: EncodedBatch, row: int, nprobe: int,
                      ndocs: int, stage2_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """Centroid pruning of one query (``hil.retrieval.plaid``): each head keeps its ``ndocs`` best documents by
    centroid interaction; the union goes to exact scoring. -> (docs ascending (U,), flags (U, H) bool)."""
    from hil.retrieval.plaid import plaid_candidates

    mask = encoded.mask[row].bool()
    per_head = []
    for head in heads:
        vectors = encoded.heads[head][row][mask].float().cpu()  # (Lq', D) scored query tokens
        docs, _, _ = plaid_candidates(index.plan(head), vectors, nprobe=nprobe, ndocs=ndocs, stage2_docs=stage2_docs)
        per_head.append(docs)
    union = np.unique(np.concatenate(per_head)) if per_head else np.zeros(0, dtype=np.int64)
    flags = np.stack([np.isin(union, docs, assume_unique=True) for docs in per_head], axis=1)
    return union, flags


def full_rank(encoder: Any, index: Any, queries: dict[str, str], *, k: int = 1000, ncandidates: int = 256,
              batch_size: int = 64, max_candidates: int | None = None, nprobe: int | None = None,
              use_gpu: bool = False, block_tokens: int = 1 << 14, keep_candidate_sources: bool = False,
              progress: bool = True, stage2_docs: int | None = None) -> SearchResult:
    """End-to-end retrieval: per query token ``ncandidates`` ANN hits per head -> candidate documents (union over
    tokens and heads) -> exact ``encoder.score`` -> top ``k``.

    ``max_candidates`` caps the candidates per query, keeping those with the best approximate score (the sum over
    heads and query tokens of each token's best retrieved similarity in the document: a ColBERT-style lower bound
    of MaxSim, a choice of ours); None keeps all. ``nprobe`` overrides the IVF setting stored in the index.

    A ``plaid`` index (centroid pruning, :mod:`hil.retrieval.plaid`) replaces the token ANN search: each query
    token probes ``nprobe`` centroids, ``stage2_docs`` documents survive the probed-cells bound, and each head keeps
    its ``max_candidates`` best documents by centroid interaction (defaults: the index's ``nprobe``,
    ``stage2_docs`` and ``ndocs``); the union over heads is scored exactly. ``ncandidates`` does not apply there.
    """
    if k < 1 or ncandidates < 1 or batch_size < 1:
        raise ValueError(f"k, ncandidates and batch_size must be >= 1 (got {k}, {ncandidates}, {batch_size})")
    _check_heads(encoder, index)
    qids, texts = _query_items(queries)
    heads = tuple(encoder.head_names)
    kind = index.faiss_settings["kind"]
    if kind == "plaid":
        stored = index.faiss_settings["params"]
        plaid = {"nprobe": int(nprobe or stored["nprobe"]), "ndocs": int(max_candidates or stored["ndocs"]),
                 "stage2_docs": int(stage2_docs or stored["stage2_docs"])}
        faiss_indexes = {}
    else:
        plaid = None
        faiss_indexes = {head: index.faiss_index(head, use_gpu=use_gpu, nprobe=nprobe) for head in heads}
    ncandidates = min(ncandidates, max(1, index.n_tokens))
    token_doc, n_docs, id_rank = index.token_doc, index.n_docs, index.doc_id_rank
    combos = [c for r in range(1, len(heads) + 1) for c in combinations(range(len(heads)), r)]
    source_counts = {"+".join(heads[i] for i in combo): 0 for combo in combos}

    run: dict[str, dict[str, float]] = {}
    sources: dict[str, dict[str, tuple[str, ...]]] = {}
    counts: list[int] = []
    timings = {"encode_s": 0.0, "ann_s": 0.0, "score_s": 0.0}
    started = time.perf_counter()
    bar = _progress(len(qids), "full ranking", progress)
    with eval_mode(encoder):
        for batch_start in range(0, len(qids), batch_size):
            batch_qids = qids[batch_start: batch_start + batch_size]
            tick = time.perf_counter()
            encoded = encoder.encode_queries(texts[batch_start: batch_start + batch_size])
            mask = encoded.mask.bool()
            token_rows = np.nonzero(mask.cpu().numpy())[0].astype(np.int64)  # query row of each valid token
            timings["encode_s"] += time.perf_counter() - tick

            tick = time.perf_counter()
            if plaid is not None:
                pruned = [_plaid_candidates(index, heads, encoded, row, **plaid) for row in range(len(batch_qids))]
            else:
                union, flags, approx, bounds = _faiss_candidates(faiss_indexes, heads, encoded, mask, token_rows,
                                                                 token_doc, n_docs, ncandidates, max_candidates,
                                                                 len(batch_qids))
            timings["ann_s"] += time.perf_counter() - tick

            tick = time.perf_counter()
            for row, qid in enumerate(batch_qids):
                if plaid is not None:
                    docs, doc_flags = pruned[row]
                else:
                    lo, hi = bounds[row], bounds[row + 1]
                    docs, doc_flags = union[lo:hi] % n_docs, flags[lo:hi]
                if plaid is None and max_candidates is not None and len(docs) > max_candidates:
                    keep = np.lexsort((docs, -approx[lo:hi]))[:max_candidates]
                    keep.sort()
                    docs, doc_flags = docs[keep], doc_flags[keep]
                counts.append(len(docs))
                for combo, n in zip(combos, _combo_counts(doc_flags, combos)):
                    source_counts["+".join(heads[i] for i in combo)] += n
                scores = score_documents(encoder, encoded.select(slice(row, row + 1)), index, docs,
                                         block_tokens=block_tokens)[0]
                best_docs, best_scores = top_k(scores, docs, id_rank, k)
                run[qid] = {index.doc_ids[d]: float(s) for d, s in zip(best_docs.tolist(), best_scores.tolist())}
                named = {d: tuple(h for h, f in zip(heads, f_row) if f) for d, f_row in zip(docs.tolist(), doc_flags)}
                kept = docs.tolist() if keep_candidate_sources else best_docs.tolist()
                sources[qid] = {index.doc_ids[d]: named[d] for d in kept}
            timings["score_s"] += time.perf_counter() - tick
            bar.update(len(batch_qids))
    bar.close()
    total = time.perf_counter() - started
    n_queries = max(1, len(qids))
    stats = {"n_queries": len(qids), "k": k, "ncandidates": ncandidates, "max_candidates": max_candidates,
             "faiss_kind": kind, "nprobe": nprobe, **({"plaid": plaid} if plaid is not None else {}),
             "candidates_mean": float(np.mean(counts)) if counts else 0.0,
             "candidates_min": int(min(counts, default=0)), "candidates_max": int(max(counts, default=0)),
             "candidate_sources": source_counts, **timings, "total_s": total,
             "ms_per_query": 1000.0 * total / n_queries}
    return SearchResult(run, sources, stats)


def _faiss_candidates(faiss_indexes: dict[str, Any], heads: tuple[str, ...], encoded: EncodedBatch,
                      mask: torch.Tensor, token_rows: np.ndarray, token_doc: np.ndarray, n_docs: int,
                      ncandidates: int, max_candidates: int | None, n_rows: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """ANN search of a batch's query tokens in every head -> (union keys ``row * n_docs + doc`` sorted, flags
    (U, H), approximate scores (U,) or None, per-row bounds into the union (n_rows + 1,))."""
    head_keys, approx_keys, approx_values = [], [], []
    for head in heads:
        vectors = np.ascontiguousarray(encoded.heads[head][mask].float().cpu().numpy())  # (T, D)
        keys, row_keys, best = _candidates_from_head(faiss_indexes[head], vectors, token_rows, token_doc,
                                                     n_docs, ncandidates, max_candidates is not None)
        head_keys.append(keys)
        if max_candidates is not None:
            approx_keys.append(row_keys)
            approx_values.append(best)
    union = np.unique(np.concatenate(head_keys))  # sorted by (row, doc)
    flags = np.stack([np.isin(union, keys, assume_unique=True) for keys in head_keys], axis=1)  # (U, H)
    approx = None
    if max_candidates is not None:
        all_keys = np.concatenate(approx_keys)
        inverse = np.searchsorted(union, all_keys)  # every approx key is in the union
        approx = np.bincount(inverse, weights=np.concatenate(approx_values), minlength=len(union))
    bounds = np.searchsorted(union // n_docs, np.arange(n_rows + 1))
    return union, flags, approx, bounds


def _combo_counts(flags: np.ndarray, combos: list[tuple[int, ...]]) -> list[int]:
    """How many rows have exactly the heads of each combination set (the Venn regions)."""
    counts = []
    for combo in combos:
        wanted = np.zeros(flags.shape[1], dtype=bool)
        wanted[list(combo)] = True
        counts.append(int((flags == wanted).all(axis=1).sum()))
    return counts


# -- exhaustive exact ranking -----------------------------------------------------------------------------------

def _concat_batches(batches: list[EncodedBatch]) -> EncodedBatch:
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


def exact_rank(encoder: Any, index: TokenStore, queries: dict[str, str], k: int = 1000, *, batch_size: int = 64,
               block_tokens: int = 1 << 14, score_matrix_bytes: int = 1 << 30, progress: bool = True) -> SearchResult:
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
            encoded = _concat_batches([encoder.encode_queries(group_texts[i: i + batch_size])
                                       for i in range(0, len(group_texts), batch_size)])
            scores = score_documents(encoder, encoded, index, all_docs, block_tokens=block_tokens)  # (G, n_docs)
            for row, qid in enumerate(qids[group_start: group_start + group]):
                best_docs, best_scores = top_k(scores[row], all_docs, index.doc_id_rank, k)
                run[qid] = {index.doc_ids[d]: float(s) for d, s in zip(best_docs.tolist(), best_scores.tolist())}
            bar.update(len(group_texts))
    bar.close()
    total = time.perf_counter() - started
    return SearchResult(run, {qid: {} for qid in qids},
                        {"n_queries": len(qids), "k": k, "candidates_mean": float(index.n_docs), "total_s": total,
                         "ms_per_query": 1000.0 * total / max(1, len(qids))})


# -- re-ranking -------------------------------------------------------------------------------------------------

def _unique_in_order(items: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(items))


def rerank(encoder: Any, index: TokenStore | None, queries: dict[str, str], candidates: dict[str, Sequence[str]],
           texts: dict[str, str] | None = None, k: int = 1000, *, batch_size: int = 64, doc_batch_size: int = 32,
           chunk_docs: int = 2048, block_tokens: int = 1 << 14, progress: bool = True) -> SearchResult:
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
                           f"{getattr(index, 'directory', '?')}, e.g. {missing[:5]}")
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
                store = tokens.to_store(group_docs)
                timings["encode_docs_s"] += time.perf_counter() - tick
            for batch_start in range(0, len(group_qids), batch_size):
                batch_qids = group_qids[batch_start: batch_start + batch_size]
                tick = time.perf_counter()
                encoded = encoder.encode_queries([queries[qid] for qid in batch_qids])
                timings["encode_queries_s"] += time.perf_counter() - tick
                tick = time.perf_counter()
                for row, qid in enumerate(batch_qids):
                    docs = np.array([store.doc_index[d] for d in wanted[qid]], dtype=np.int64)
                    if len(docs) == 0:
                        run[qid] = {}
                        continue
                    scores = score_documents(encoder, encoded.select(slice(row, row + 1)), store, docs,
                                             block_tokens=block_tokens)[0]
                    best_docs, best_scores = top_k(scores, docs, store.doc_id_rank, k)
                    run[qid] = {store.doc_ids[d]: float(s) for d, s in zip(best_docs.tolist(), best_scores.tolist())}
                timings["score_s"] += time.perf_counter() - tick
                bar.update(len(batch_qids))
    bar.close()
    total = time.perf_counter() - started
    counts = [len(docs) for docs in wanted.values()]
    return SearchResult(run, {qid: {} for qid in qids},
                        {"n_queries": len(qids), "k": k, "candidates_mean": float(np.mean(counts)) if counts else 0.0,
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
