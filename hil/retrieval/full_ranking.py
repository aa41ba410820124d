"""Full ranking: the back-end's candidates, then exact late interaction, then the top k -- for a batch of queries at
once, or one query at a time.

Full ranking follows ColBERT v1's end-to-end retrieval (Khattab & Zaharia 2020, Sec. 3.6; HIL Sec. 2) in two steps:
the index's back-end (:mod:`hil.retrieval.backends`: a token ANN search in FAISS, or PLAID's centroid pruning)
proposes each query's candidate documents, the union over heads; then every candidate is scored exactly by
``encoder`` (for ColBERT, Eq. 1 ``sum_i max_j E_qi . E_dj``; the model decides how its heads combine) over the
index's stored vectors widened to fp32, and ranked by trec_eval's rule (:mod:`hil.data.ranking`), the query's own
document skipped with ``skip_self`` (:mod:`hil.retrieval.search`).

**Batched** (``batched=True``, what evaluation uses): the queries of an encoding batch are searched together --
the back-end's :meth:`~hil.retrieval.backends.base.SearchBackend.candidate_pairs` (PLAID: every stage on the device
for the whole batch), exact scores of every (query, candidate) pair (:mod:`hil.retrieval.pair_scoring`, documents
gathered on the device), the top k of every query by sorting on the device -- and the host is reached once per batch
for the results. **One query at a time** (``batched=False``, for latency): the same functions on a batch of one, so
both give the same rankings (``tests/test_batched_search.py``: on the CPU, bit for bit).
"""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from itertools import combinations
from typing import Iterator, Sequence

import numpy as np
import torch

from hil.modeling.contracts import EncodedBatch, Encoder
from hil.retrieval.backends.base import CandidatePairs, SearchBackend
from hil.retrieval.backends.configs import SearchConfig, with_search_values
from hil.retrieval.backends.registry import backend_class, open_backend
from hil.retrieval.devices import resolve_device
from hil.retrieval.encoding import eval_mode
from hil.retrieval.index import TokenIndex
from hil.retrieval.integrity import check_finite_queries, non_finite_scores
from hil.retrieval.pair_scoring import pair_scores, ranked_pairs
from hil.retrieval.search import SearchResult, check_heads, query_items, search_progress, store_location

# Padded document tokens per exact-scoring call: 65,536 on a CPU (a 32 MiB fp32 block at D = 128; the same scores,
# bit for bit, as 16,384, in fewer calls), 2^21 on an accelerator (1 GiB: fewer, larger kernels).
BLOCK_TOKENS = {"cpu": 1 << 16}
ACCELERATOR_BLOCK_TOKENS = 1 << 21


def _synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so a stage's time is its own (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _timed(timings: dict[str, float], name: str, device: torch.device) -> Iterator[None]:
    tick = time.perf_counter()
    try:
        yield
    finally:
        _synchronize(device)
        timings[name] += time.perf_counter() - tick


class HeadOverlap:
    """How many candidates each exact combination of heads proposed (the Venn regions of the paper's Figure 3)."""

    def __init__(self, heads: Sequence[str]):
        self.combos = [c for r in range(1, len(heads) + 1) for c in combinations(range(len(heads)), r)]
        self.names = ["+".join(heads[i] for i in combo) for combo in self.combos]
        self.counts = dict.fromkeys(self.names, 0)

    def add(self, flags: np.ndarray) -> None:
        """flags (U, H) bool: which heads proposed each candidate (of one query or of several)."""
        for name, combo in zip(self.names, self.combos):
            wanted = np.zeros(flags.shape[1], dtype=bool)
            wanted[list(combo)] = True
            self.counts[name] += int((flags == wanted).all(axis=1).sum())


class _Ranking:
    """What a full ranking accumulates over its batches: the run, the candidate sources, counts and overlaps."""

    def __init__(self, index: TokenIndex, heads: Sequence[str], keep_candidate_sources: bool):
        self.index, self.heads, self.keep_all_sources = index, tuple(heads), keep_candidate_sources
        self.run: dict[str, dict[str, float]] = {}
        self.sources: dict[str, dict[str, tuple[str, ...]]] = {}
        self.counts: list[int] = []
        self.overlap = HeadOverlap(heads)
        self._names: dict[tuple[bool, ...], tuple[str, ...]] = {}

    def head_names(self, flags: tuple[bool, ...]) -> tuple[str, ...]:
        if flags not in self._names:
            self._names[flags] = tuple(h for h, flag in zip(self.heads, flags) if flag)
        return self._names[flags]

    def add(self, qids: Sequence[str], pairs: CandidatePairs, scores: torch.Tensor, best: torch.Tensor) -> None:
        """One batch: its pairs, their scores and the ranked positions (:func:`ranked_pairs`); one copy to the host.
        Queries with a non-finite score are collected and refused together (never ranked)."""
        query, docs, flags = (t.cpu().numpy() for t in (pairs.query, pairs.docs, pairs.heads))
        values, best = scores.cpu().numpy(), best.cpu().numpy()
        per_query = np.bincount(query, minlength=len(qids))
        self.counts.extend(per_query.tolist())
        self.overlap.add(flags)
        bad = np.bincount(query[~np.isfinite(values)], minlength=len(qids))
        if bad.any():
            raise non_finite_scores([qid for qid, n in zip(qids, bad) if n], store_location(self.index))
        doc_ids = self.index.doc_ids
        bounds = np.searchsorted(query[best], np.arange(len(qids) + 1))
        candidate_bounds = np.searchsorted(query, np.arange(len(qids) + 1))
        for row, qid in enumerate(qids):
            ranked = best[bounds[row]: bounds[row + 1]]
            self.run[qid] = {doc_ids[d]: float(s) for d, s in zip(docs[ranked].tolist(), values[ranked].tolist())}
            kept = np.arange(candidate_bounds[row], candidate_bounds[row + 1]) if self.keep_all_sources else ranked
            self.sources[qid] = {doc_ids[d]: self.head_names(tuple(f)) for d, f in zip(docs[kept].tolist(),
                                                                                       flags[kept].tolist())}


def _search_batch(encoder: Encoder, index: TokenIndex, backend: SearchBackend, encoded: EncodedBatch,
                  qids: Sequence[str], k: int, skip_self: bool, block_tokens: int, timings: dict[str, float]
                  ) -> tuple[CandidatePairs, torch.Tensor, torch.Tensor]:
    """Candidates, exact scores and ranked positions of one batch of queries, all on the encoder's device."""
    device = encoder.device
    with _timed(timings, "ann_s", device):  # retrieve
        pairs = backend.candidate_pairs(encoded, encoder.head_names)
    with _timed(timings, "score_s", device):  # rank
        pair_query, pair_doc = pairs.query.to(device), pairs.docs.to(device)
        scores = pair_scores(encoder, encoded, index, pair_query, pair_doc, block_tokens=block_tokens)
        exclude = None
        if skip_self:
            rows = [index.doc_index.get(qid, -1) for qid in qids]
            exclude = torch.tensor(rows, dtype=torch.int64, device=device)
        tie_rank = _tie_rank(index, device)
        # A non-finite score ranks nowhere; its query is refused when the batch reaches the host (_Ranking.add).
        best = ranked_pairs(pair_query, pair_doc, torch.nan_to_num(scores), tie_rank, k, len(qids), exclude)
    return pairs, scores, best


def _tie_rank(index: TokenIndex, device: torch.device) -> torch.Tensor:
    """The index's document-id ranks (:attr:`~hil.retrieval.store.TokenStore.doc_id_rank`) on ``device``, cached."""
    cache: dict[torch.device, torch.Tensor] = index.__dict__.setdefault("_tie_rank", {})
    if device not in cache:
        cache[device] = torch.from_numpy(index.doc_id_rank).to(device)
    return cache[device]


def full_rank(encoder: Encoder, index: TokenIndex, queries: dict[str, str], *, k: int = 1000,
              search: SearchConfig | None = None, batch_size: int = 64, batched: bool = True, use_gpu: bool = False,
              gpu_device: int = 0, block_tokens: int | None = None, keep_candidate_sources: bool = False,
              progress: bool = True, skip_self: bool = False, ncandidates: int | None = None,
              max_candidates: int | None = None, nprobe: int | None = None, stage2_docs: int | None = None,
              device: torch.device | str | None = None, query_encoder: Encoder | None = None) -> SearchResult:
    """End-to-end retrieval: the back-end's candidate documents (union over heads) -> exact ``encoder.score``
    -> top ``k`` (module docstring).

    ``batch_size`` queries are encoded together and, with ``batched``, searched together; else one at a time.
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
    documents are always scored by ``encoder``. ``block_tokens``: padded document tokens per exact-scoring call
    (default :data:`BLOCK_TOKENS`; the scores do not depend on it).

    ``stats`` records the settings as the back-end used them (``search``: read back after the search), whether the
    search was batched, the candidates per query and the time of each step.
    """
    if k < 1 or batch_size < 1:
        raise ValueError(f"k and batch_size must be >= 1 (got {k}, {batch_size})")
    check_heads(encoder, index)
    qids, texts = query_items(queries)
    heads = tuple(encoder.head_names)
    kind = index.backend_settings["kind"]
    fields = backend_class(kind).keyword_search_values(ncandidates=ncandidates, max_candidates=max_candidates,
                                                       nprobe=nprobe, stage2_docs=stage2_docs)
    search = with_search_values(kind, search, fields)
    backend = open_backend(index, search, use_gpu=use_gpu, gpu_device=gpu_device,
                           device=None if device is None else resolve_device(device), depth=k)
    cap = backend.candidates_per_head()
    if cap is not None and cap[1] < k:  # a run shorter than k would be read as one of depth k
        warnings.warn(f"{kind}: {cap[0]}={cap[1]} < k={k}: each head proposes at most {cap[1]} documents, so a "
                      f"query may rank fewer than {k}", stacklevel=2)
    if block_tokens is None:
        block_tokens = BLOCK_TOKENS.get(encoder.device.type, ACCELERATOR_BLOCK_TOKENS)
    ranking = _Ranking(index, heads, keep_candidate_sources)
    timings = {"encode_s": 0.0, "ann_s": 0.0, "score_s": 0.0}
    started = time.perf_counter()
    bar = search_progress(len(qids), "full ranking", progress)
    with eval_mode(encoder):
        for batch_start in range(0, len(qids), batch_size):
            batch_qids = qids[batch_start: batch_start + batch_size]
            with _timed(timings, "encode_s", encoder.device):
                encoded = (query_encoder or encoder).encode_queries(texts[batch_start: batch_start + batch_size])
            # Before the candidates: FAISS never returns a NaN neighbour, so NaN queries would rank nothing.
            check_finite_queries(encoded, batch_qids, encoder.architecture)
            groups = [slice(0, len(batch_qids))] if batched else [slice(i, i + 1) for i in range(len(batch_qids))]
            for group in groups:
                found = _search_batch(encoder, index, backend, encoded.select(group), batch_qids[group], k,
                                      skip_self, block_tokens, timings)
                ranking.add(batch_qids[group], *found)
            bar.update(len(batch_qids))
    bar.close()
    total = time.perf_counter() - started
    counts = ranking.counts
    stats = {"n_queries": len(qids), "k": k, "skip_self": skip_self, "search": backend.search_stats(),
             "batched": batched, "batch_size": batch_size,
             "candidates_mean": float(np.mean(counts)) if counts else 0.0,
             "candidates_min": int(min(counts, default=0)), "candidates_max": int(max(counts, default=0)),
             "candidate_sources": ranking.overlap.counts, **timings, "total_s": total,
             "ms_per_query": 1000.0 * total / max(1, len(qids))}
    return SearchResult(ranking.run, ranking.sources, stats)
