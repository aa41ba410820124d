"""Runs (``{qid: {docid: score}}``, BEIR's shape) and TREC run files on disk.

A TREC run file has one line per retrieved document: ``qid Q0 docid rank score tag``.

Ordering: everywhere in this package a query's documents are ranked the way trec_eval ranks them, by score
descending and then, among equal scores, by document id descending (``strcmp(b, a)`` in trec_eval's
``form_res_rels.c``; pytrec_eval compiles the same code — checked in tests/test_eval_metrics.py). trec_eval
ignores the rank column of a run file and re-sorts, so writing and truncating runs in this order keeps the rank
column, ``top_k`` and every metric consistent with each other.
"""

from __future__ import annotations

import heapq
import math
import os
from pathlib import Path
from typing import Mapping

from hil.provenance import atomic_output

Run = dict[str, dict[str, float]]


def _trec_key(item: tuple[str, float]) -> tuple[float, str]:
    docid, score = item
    return (score, docid)


def ranked(doc_scores: Mapping[str, float], k: int | None = None) -> list[tuple[str, float]]:
    """A query's ``(docid, score)`` pairs in trec_eval's order (score desc, then docid desc), the first ``k``."""
    items = [(str(d), float(s)) for d, s in doc_scores.items()]
    if k is None or k >= len(items):
        return sorted(items, key=_trec_key, reverse=True)
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    # nlargest is O(n log k): cheap for k=10 on 1000-document lists.
    return heapq.nlargest(k, items, key=_trec_key)


def top_k(run: Mapping[str, Mapping[str, float]], k: int) -> Run:
    """Each query's best ``k`` documents (trec_eval order, ties by docid desc), as a new run in ranked order."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return {str(qid): dict(ranked(docs, k)) for qid, docs in run.items()}


def _check_token(value: str, what: str, context: str = "") -> str:
    value = str(value)
    if not value or any(ch.isspace() for ch in value):
        raise ValueError(f"{what} {value!r}{context} is empty or contains whitespace; it cannot be written to a "
                         "TREC run")
    return value


def write_trec_run(path: str | os.PathLike, run: Mapping[str, Mapping[str, float]], tag: str = "hil",
                   k: int | None = None) -> Path:
    """Write ``run`` as a TREC run file (``qid Q0 docid rank score tag``), atomically.

    Queries are written in sorted qid order, documents in trec_eval's order with ranks from 1; ``k`` keeps only
    each query's top ``k``. Scores are written with ``repr(float)`` so reading the file back gives the exact same
    floats (fixed decimals would create ties that change the ranking). Written through
    :func:`hil.provenance.atomic_output`, so a reader never sees half a file and an error leaves none.
    """
    tag = _check_token(tag, "run tag")
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for qid in sorted(run, key=str):
            q = _check_token(qid, "query id")
            for rank, (docid, score) in enumerate(ranked(run[qid], k), start=1):
                d = _check_token(docid, "document id", f" (query {q!r})")
                if math.isnan(score):
                    raise ValueError(f"score of query {q!r}, document {d!r} is NaN")
                handle.write(f"{q} Q0 {d} {rank} {score!r} {tag}\n")
    return Path(path)


def read_trec_run(path: str | os.PathLike) -> Run:
    """Read a TREC run file into ``{qid: {docid: score}}``.

    The ``Q0`` and rank columns are not checked (trec_eval ignores them too); blank lines are skipped. A row
    without six fields, a score that is not a number (or is NaN), or a document listed twice for the same
    query raises ``ValueError`` naming the file and line.
    """
    path = Path(path)
    run: Run = {}
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            fields = line.split()
            if not fields:
                continue
            where = f"{path}:{line_no}"
            if len(fields) != 6:
                raise ValueError(f"{where}: expected 6 fields 'qid Q0 docid rank score tag', got {len(fields)}: "
                                 f"{line.rstrip()!r}")
            qid, _, docid, _, score_text, _ = fields
            try:
                score = float(score_text)
            except ValueError:
                raise ValueError(f"{where}: score {score_text!r} is not a number") from None
            if math.isnan(score):
                raise ValueError(f"{where}: score is NaN")
            docs = run.setdefault(qid, {})
            if docid in docs:
                raise ValueError(f"{where}: document {docid!r} appears twice for query {qid!r}")
            docs[docid] = score
    return run
