"""Runs (``{qid: {docid: score}}``, BEIR's shape) and TREC run files on disk.

A TREC run file has one line per retrieved document: ``qid Q0 docid rank score tag``.

Ordering: everywhere in this package a query's documents are ranked the way trec_eval ranks them, by score
descending and then, among equal scores, by document id descending (``strcmp(b, a)`` in trec_eval's
``form_res_rels.c``; pytrec_eval compiles the same code — checked in tests/test_eval_metrics.py). trec_eval
ignores the rank column of a run file and re-sorts, so writing and truncating runs in this order keeps the rank
column, ``top_k`` and every metric consistent with each other.

A first stage given as a run file (``evaluate.py --first-stage-run``): :func:`read_trec_run` with the dataset's
queries and documents checks that the run belongs to the dataset, and :func:`candidates_from_run` takes each query's
best ``depth`` documents in that same order (the rank column is ignored, as trec_eval ignores it).
"""

from __future__ import annotations

import heapq
import math
import os
from pathlib import Path
from typing import Container, Mapping

from hil.data.beir_files import iter_text_lines
from hil.errors import DataFormatError, MissingInputError, UserError
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
        raise UserError(f"k must be >= 0, got {k}")
    # nlargest is O(n log k): cheap for k=10 on 1000-document lists.
    return heapq.nlargest(k, items, key=_trec_key)


def top_k(run: Mapping[str, Mapping[str, float]], k: int) -> Run:
    """Each query's best ``k`` documents (trec_eval order, ties by docid desc), as a new run in ranked order."""
    if k < 0:
        raise UserError(f"k must be >= 0, got {k}")
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


def read_trec_run(path: str | os.PathLike, queries: Container[str] | None = None,
                  documents: Container[str] | None = None) -> Run:
    """Read a TREC run file (``.gz`` too) into ``{qid: {docid: score}}``.

    The ``Q0`` and rank columns are not checked (trec_eval ignores them too); blank lines are skipped. A row
    without six fields, a score that is not a number (or is NaN), a document listed twice for the same query, and,
    when ``queries`` / ``documents`` are given, a query id or document id not among them (a run of another dataset:
    a re-ranker cannot score a document it has no text for) raise :class:`~hil.errors.DataFormatError` (a
    ``ValueError``) naming the file and line; a missing file raises :class:`~hil.errors.MissingInputError` (a
    ``FileNotFoundError``) naming it.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"{path}: no such run file")
    run: Run = {}
    for line_no, line in iter_text_lines(path):
        fields = line.split()
        if len(fields) != 6:
            raise DataFormatError(path, line_no, f"expected 6 fields 'qid Q0 docid rank score tag', got "
                                                 f"{len(fields)}: {line.rstrip()!r}")
        qid, _, docid, _, score_text, _ = fields
        try:
            score = float(score_text)
        except ValueError:
            raise DataFormatError(path, line_no, f"score {score_text!r} is not a number") from None
        if math.isnan(score):
            raise DataFormatError(path, line_no, "score is NaN")
        if queries is not None and qid not in queries:
            raise DataFormatError(path, line_no, f"query id {qid!r} is not among the dataset's judged queries")
        if documents is not None and docid not in documents:
            raise DataFormatError(path, line_no, f"document id {docid!r} (query {qid!r}) is not in the corpus")
        docs = run.setdefault(qid, {})
        if docid in docs:
            raise DataFormatError(path, line_no, f"document {docid!r} appears twice for query {qid!r}")
        docs[docid] = score
    return run


def candidates_from_run(run: Mapping[str, Mapping[str, float]], depth: int | None = None) -> dict[str, list[str]]:
    """Each query's best ``depth`` documents (all when None), best first in trec_eval's order: what a re-ranker
    scores. Queries without documents are left out."""
    if depth is not None and depth < 1:
        raise UserError(f"depth must be >= 1, got {depth}")
    return {str(qid): [docid for docid, _ in ranked(docs, depth)] for qid, docs in run.items() if docs}


def run_depth(run: Mapping[str, Mapping[str, float]]) -> int:
    """The most documents any query of ``run`` has (0 for an empty run)."""
    return max((len(docs) for docs in run.values()), default=0)
