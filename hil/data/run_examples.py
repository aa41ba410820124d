"""Training examples from a TREC run file with teacher scores (and optional qrels): one example a query, read by
byte offset -- Lightning IR's ``RunDataset`` (``lightning_ir/data/dataset.py``) for this package's sources.

Files: the run (``qid Q0 docid rank score tag`` a line, whitespace-separated; the score is the teacher's), the
queries and the collection (``id TAB text``, :class:`~hil.data.id_texts.IdTextFile`), and optionally qrels (BEIR's
``qid TAB docid TAB grade`` or TREC's ``qid iteration docid grade``). A query's lines must be together (every
run writer groups them; ``hil.evaluation.runs.write_trec_run`` does): the run is indexed by the byte offset of each
query's first line, and a query whose lines come back after another query's is refused naming that line.

Which N documents an example holds, with Lightning IR's options beside (:class:`RunSettings`; in a config, the
reader :class:`TrecRun`):

- ``depth``: a query's documents are ranked by score, ties by document id descending (trec_eval's order, used
  across this package: ``hil.evaluation.runs``), and the best ``depth`` are its candidates (None: all). Lightning IR
  cuts at the rank *column* (``rank <= depth``); trec_eval ignores that column, and so does this.
- ``selection``: ``top`` takes the best N candidates (Lightning IR's ``"top"``); ``sample`` takes a seeded random N
  (its ``"random"``, which draws anew at every read; here the draw is a function of ``seed`` and the query's place
  in the run, the same in every epoch and process, so shards and resumes are exact), kept in rank order.
- ``positives``: ``none``; or ``first`` (needs qrels): the judged positive candidate (grade >= ``relevance_level``)
  with the highest grade, then the best ranked, first (as ``hil teacher`` picks it), and the
  other N - 1 drawn by ``selection`` from the candidates that are not judged positive (Lightning IR's
  ``"single_relevant"``, which draws the positive at random and may add a judged document
  absent from the run; here it must be in the run, since it needs a teacher score).
- ``targets``: ``scores`` (the run's scores, for distillation), ``qrels`` (the grades, 0 for unjudged: Lightning
  IR's ``"relevance"``), or ``none`` (no scores: a positive-first example for contrastive losses; needs
  ``positives="first"``).
- ``short_queries``: a query with fewer than N usable candidates (or no judged positive, with ``positives="first"``)
  is an ``error`` naming its first line, or ``skip``-ped (Lightning IR drops such queries silently; here their
  number is logged).

Checked when the reader is built, in one pass (recorded beside the line offsets, keyed by the four files and the
settings, so a second open skips it): valid UTF-8, six fields, a finite number as score, the grouping, each query id
in the queries and each document id in the collection (every line, even beyond ``depth``), a document listed twice
for one query, and each query's number of candidates. A line's problem is raised when that line is read; a
query's problem (too few candidates) when its lines end (at the next query's first line or the end of the file),
naming its first line. Read time re-parses the query's lines (cheap) and looks up the texts. With ``limit``, the
pass stops after the first ``limit`` usable queries. The qrels are read during the pass only; the grades of the run's
judged lines are kept (in the record), so the reader pickles cheaply.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal, NamedTuple

import numpy as np

from hil.data.beir_files import iter_text_lines, load_trec_qrels, read_qrels_tsv
from hil.data.example_files import (
    ExamplesOnDisk,
    checked_count,
    file_key,
    load_checked,
    save_checked,
    settings_key,
    text_of,
    unknown,
)
from hil.data.examples import ExampleReader, ReadSettings, ScoredExample
from hil.data.id_texts import IdTextFile
from hil.data.line_index import LineIndex
from hil.errors import DataFormatError, UserError

logger = logging.getLogger(__name__)

SELECTIONS = ("top", "sample")
POSITIVES = ("none", "first")
TARGETS = ("scores", "qrels", "none")
SHORT_QUERIES = ("error", "skip")


@dataclass(frozen=True)
class RunSettings:
    """How each query's N documents are chosen from a run (see the module docstring)."""

    nway: int
    depth: int | None = None
    selection: str = "top"
    positives: str = "none"
    targets: str = "scores"
    relevance_level: int = 1
    seed: int = 0
    short_queries: str = "error"

    def __post_init__(self) -> None:
        checked_count("nway", self.nway, 2)
        checked_count("depth", self.depth, self.nway)
        checked_count("relevance_level", self.relevance_level, 1)
        checked_count("seed", self.seed, 0)
        for name, allowed in (("selection", SELECTIONS), ("positives", POSITIVES), ("targets", TARGETS),
                              ("short_queries", SHORT_QUERIES)):
            if getattr(self, name) not in allowed:
                raise UserError(f"{name} must be one of {', '.join(allowed)} (got {getattr(self, name)!r})")
        if self.targets == "none" and self.positives != "first":
            raise UserError("targets='none' gives examples without scores, which need positives='first'")

    @property
    def needs_qrels(self) -> bool:
        return self.positives == "first" or self.targets == "qrels"


class Candidate(NamedTuple):
    """One run line of a query: the document, its teacher score, its grade (0 unjudged) and its line."""

    docid: str
    score: float
    grade: int
    line: int


def ranked(candidates: list[Candidate]) -> list[Candidate]:
    """trec_eval's order: score descending, then document id descending."""
    return sorted(candidates, key=lambda c: (c.score, c.docid), reverse=True)


def pools(candidates: list[Candidate], settings: RunSettings) -> tuple[Candidate | None, list[Candidate]]:
    """(the positive put first or None, the candidates the other documents are drawn from, in rank order)."""
    top = ranked(candidates)[: settings.depth]
    if settings.positives == "none":
        return None, top
    level = settings.relevance_level
    judged = [(-c.grade, rank) for rank, c in enumerate(top) if c.grade >= level]
    positive = top[min(judged)[1]] if judged else None  # the highest grade, then the best ranked
    return positive, [c for c in top if c.grade < level]


def shortage(candidates: list[Candidate], settings: RunSettings) -> str | None:
    """Why a query cannot give an example (None: it can)."""
    positive, pool = pools(candidates, settings)
    within = f" within depth {settings.depth}" if settings.depth is not None else ""
    if settings.positives == "first":
        if positive is None:
            return f"no judged positive (grade >= {settings.relevance_level}) among its documents{within}"
        if len(pool) < settings.nway - 1:
            return (f"{len(pool)} documents{within} besides judged positives, fewer than nway - 1 = "
                    f"{settings.nway - 1}")
    elif len(pool) < settings.nway:
        return f"{len(pool)} documents{within}, fewer than nway={settings.nway}"
    return None


def choose(candidates: list[Candidate], settings: RunSettings, query_number: int) -> list[Candidate]:
    """The example's N documents (positive first when asked); the sample is seeded by (seed, query_number)."""
    positive, pool = pools(candidates, settings)
    wanted = settings.nway - (positive is not None)
    if settings.selection == "top":
        picked = pool[:wanted]
    else:
        rng = np.random.default_rng([settings.seed, query_number])
        picked = [pool[i] for i in np.sort(rng.choice(len(pool), size=wanted, replace=False)).tolist()]
    return ([positive] if positive is not None else []) + picked


def read_qrels(path: Path) -> dict[str, dict[str, int]]:
    """BEIR (3 tab-separated columns) or TREC (4 whitespace-separated) qrels, told apart by the first line."""
    first = next(iter_text_lines(path), None)
    if first is not None and len(first[1].split("\t")) == 3:
        return read_qrels_tsv(path)
    return load_trec_qrels(path)


@dataclass
class _Query:
    """A query's lines while the checking pass reads them."""

    qid: str
    number: int          # its place among the run's queries (0-based)
    first_item: int
    first_line: int
    candidates: list[Candidate]
    docids: set[str]


class RunExamples(ExamplesOnDisk):
    """One example a query of a TREC run (see the module docstring).

    Args:
        run, queries, collection: the run file and the ``id TAB text`` files of its query and document texts.
        settings: how each query's documents are chosen (:class:`RunSettings`).
        qrels: judgments (needed by ``positives="first"`` and ``targets="qrels"``).
        limit: only the first ``limit`` usable queries.
        cache_dir: where line offsets and the checking record go.
    """

    kind = "run examples"

    def __init__(self, run: str | os.PathLike, queries: str | os.PathLike, collection: str | os.PathLike,
                 settings: RunSettings, qrels: str | os.PathLike | None = None, limit: int | None = None,
                 cache_dir: str | os.PathLike | None = None):
        if settings.needs_qrels and qrels is None:
            raise UserError(f"positives={settings.positives!r} with targets={settings.targets!r} needs qrels")
        self.settings, self.limit = settings, checked_count("limit", limit, 0)
        self.lines = LineIndex(run, cache_dir=cache_dir)
        self.path = self.lines.path
        if len(self.lines) == 0:
            raise DataFormatError(self.path, None, "no run lines")
        self.queries = IdTextFile(queries, "queries", cache_dir)
        self.collection = IdTextFile(collection, "passages", cache_dir)
        self.qrels_path = Path(qrels) if qrels is not None else None
        key = settings_key("run", settings, self.limit, file_key(self.queries.lines.path),
                           file_key(self.collection.lines.path),
                           file_key(self.qrels_path) if self.qrels_path is not None else None)
        self._record = (key, cache_dir)
        payload = load_checked(self.path, "run-checked", key, cache_dir)
        if payload is None:
            payload = save_checked(self.path, self.lines.stamp, "run-checked", key, self._scan(), cache_dir)
            self._mapped = load_checked(self.path, "run-checked", key, cache_dir) is not None
        else:
            self._mapped = True
        self._attach(payload)
        if self.skipped:
            logger.warning("%s: %d queries with too few documents left out (short_queries='skip')", self.path,
                           self.skipped)

    def _attach(self, payload: np.ndarray) -> None:
        size, judged, self.skipped = (int(v) for v in payload[:3])
        parts = np.split(payload[3:], np.cumsum([size, size, size, judged]))
        self.first_items, self.line_counts, self.query_numbers, self.judged_items, self.judged_grades = parts
        self.size = size

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self._mapped:  # the new process maps the checking record again instead of receiving copies
            for name in ("first_items", "line_counts", "query_numbers", "judged_items", "judged_grades"):
                state[name] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.first_items is None:
            payload = load_checked(self.path, "run-checked", *self._record)
            if payload is None:
                raise DataFormatError(self.path, None, "its checking record disappeared or changed; open it again")
            self._attach(payload)

    def _row(self, line: int, text: str) -> tuple[str, str, float]:
        """(query id, document id, score) of a run line."""
        fields = text.split()
        if len(fields) != 6:
            raise DataFormatError(self.path, line, f"expected 6 whitespace-separated fields 'qid Q0 docid rank "
                                                   f"score tag', found {len(fields)}")
        qid, _, docid, _, score_text, _ = fields
        try:
            score = float(score_text)
        except ValueError:
            raise DataFormatError(self.path, line, f"score {score_text!r} is not a number") from None
        if not math.isfinite(score):
            raise DataFormatError(self.path, line, f"score {score_text!r} is not finite")
        return qid, docid, score

    def _scan(self) -> list[np.ndarray]:
        """The checking pass (module docstring): -> the record's arrays."""
        qrels = read_qrels(self.qrels_path) if self.qrels_path is not None else {}
        kept: list[tuple[int, int, int]] = []   # (first item, lines, query number) of each usable query
        judged: list[tuple[int, int]] = []      # (item, grade) of each judged run line
        seen: dict[str, int] = {}                # query id -> its first line
        skipped = 0
        current: _Query | None = None

        def close(query: _Query) -> None:
            nonlocal skipped
            reason = shortage(query.candidates, self.settings)
            if reason is None:
                kept.append((query.first_item, len(query.candidates), query.number))
            elif self.settings.short_queries == "skip":
                skipped += 1
            else:
                raise DataFormatError(self.path, query.first_line, f"query {query.qid!r} has {reason}")

        for item, (line, text) in enumerate(iter_text_lines(self.path)):
            qid, docid, score = self._row(line, text)
            if current is None or qid != current.qid:
                if current is not None:
                    close(current)
                    if self.limit is not None and len(kept) >= self.limit:
                        current = None
                        break
                if qid in seen:
                    raise DataFormatError(self.path, line, f"query {qid!r} comes back after other queries (first "
                                                           f"on line {seen[qid]}): a query's lines must be together")
                seen[qid] = line
                if self.queries.row(qid) < 0:
                    raise unknown(self.path, line, "query id", qid, self.queries)
                current = _Query(qid, len(seen) - 1, item, line, [], set())
            if self.collection.row(docid) < 0:
                raise unknown(self.path, line, "document id", docid, self.collection)
            if docid in current.docids:
                raise DataFormatError(self.path, line, f"document {docid!r} appears twice for query {qid!r}")
            grade = qrels.get(qid, {}).get(docid, 0)
            if grade:
                judged.append((item, grade))
            current.docids.add(docid)
            current.candidates.append(Candidate(docid, score, grade, line))
        if current is not None:
            close(current)
        kept = kept[: self.limit]
        if not kept:
            raise DataFormatError(self.path, None, f"no query gives an example ({skipped} with too few documents)")
        columns = np.array(kept, dtype=np.int64).reshape(-1, 3).T
        grades = np.array(judged, dtype=np.int64).reshape(-1, 2).T
        return [np.array([len(kept), grades.shape[1], skipped], dtype=np.int64), *columns, *grades]

    def _candidates(self, position: int) -> tuple[str, int, list[Candidate]]:
        """(query id, first line, candidates) of usable query ``position``, read back from the run."""
        first, count = int(self.first_items[position]), int(self.line_counts[position])
        raw = self.lines.span(first, first + count)
        try:
            texts = [piece[:-1] if piece.endswith("\r") else piece for piece in raw.decode("utf-8").split("\n")]
        except UnicodeDecodeError:
            self.lines.check_unchanged()
            raise
        texts = [text for text in texts if text.strip()][:count]
        low, high = np.searchsorted(self.judged_items, [first, first + count])
        grades = dict(zip(self.judged_items[low:high].tolist(), self.judged_grades[low:high].tolist()))
        candidates, qid = [], None
        for offset, text in enumerate(texts):
            line = self.lines.line_number(first + offset)
            row_qid, docid, score = self._row(line, text)
            if qid is not None and row_qid != qid:
                self.lines.check_unchanged()
                raise DataFormatError(self.path, line, "changed since it was checked; start again")
            qid = row_qid
            candidates.append(Candidate(docid, score, grades.get(first + offset, 0), line))
        return qid, self.lines.line_number(first), candidates

    def _chosen(self, position: int) -> tuple[str, int, list[Candidate]]:
        qid, line, candidates = self._candidates(position)
        return qid, line, choose(candidates, self.settings, int(self.query_numbers[position]))

    def __getitem__(self, index: int) -> ScoredExample:
        qid, line, chosen = self._chosen(self._position(index))
        query = text_of(self.path, line, "query id", qid, self.queries)
        documents = tuple(text_of(self.path, c.line, "document id", c.docid, self.collection) for c in chosen)
        targets = self.settings.targets
        scores = (tuple(c.score for c in chosen) if targets == "scores"
                  else tuple(float(c.grade) for c in chosen) if targets == "qrels" else None)
        return ScoredExample(query, documents, scores, (qid, *(c.docid for c in chosen)))

    def example_ids(self) -> Iterator[tuple[int, str, tuple[str, ...]]]:
        for position in range(self.size):
            qid, line, chosen = self._chosen(position)
            yield line, qid, tuple(c.docid for c in chosen)

    def describe(self) -> str:
        s = self.settings
        return (f"{self.path} ({self.size} queries, {s.nway} documents each: {s.selection} of depth "
                f"{s.depth or 'all'}, positives {s.positives}, targets {s.targets}; {self.queries.describe()}; "
                f"{self.collection.describe()})")


@dataclass(frozen=True)
class TrecRun(ExampleReader):
    """A TREC run whose scores are a teacher's, one example of ``data.nway`` documents a query (:class:`RunExamples`;
    Lightning IR's ``RunDataset``); how each query's documents are chosen: the module docstring
    (:class:`RunSettings`, ``data.seed`` seeding ``selection: sample``).

    Args:
        path: the run, ``qid Q0 docid rank score tag`` a line.
        queries: ``qid TAB text``.
        collection: ``docid TAB text``.
        qrels: judgments (BEIR's TSV or TREC's), needed by ``positives: first`` and ``targets: qrels``.
        depth: a query's candidates: its best ``depth`` documents (None: all).
        selection: ``top`` (the best N candidates) or ``sample`` (a seeded random N, in rank order).
        positives: ``none``, or ``first``: the judged positive with the highest grade first.
        targets: ``scores`` (the run's), ``qrels`` (the grades) or ``none`` (no scores: positive-first examples).
        relevance_level: the least grade that counts as positive.
        short_queries: a query with fewer than N candidates is an ``error`` or is ``skip``-ped (and counted).
    """

    path: str
    queries: str
    collection: str
    qrels: str | None = None
    depth: int | None = None
    selection: Literal["top", "sample"] = "top"
    positives: Literal["none", "first"] = "none"
    targets: Literal["scores", "qrels", "none"] = "scores"
    relevance_level: int = 1
    short_queries: Literal["error", "skip"] = "error"

    def run_settings(self, read: ReadSettings) -> RunSettings:
        """How each query's documents are chosen (checked: a wrong value is one line naming it)."""
        if read.nway is None:
            raise UserError("TrecRun needs data.nway (the documents chosen per query)")
        return RunSettings(read.nway, self.depth, self.selection, self.positives, self.targets,
                           self.relevance_level, read.seed, self.short_queries)

    def resolve(self, read: ReadSettings) -> tuple[ExampleReader, ReadSettings]:
        settings = self.run_settings(read)
        if settings.needs_qrels and self.qrels is None:
            raise UserError(f"TrecRun: positives={self.positives!r} with targets={self.targets!r} needs qrels")
        return self, read

    def open(self, read: ReadSettings) -> RunExamples:
        """Every line is checked, whatever ``read.check``."""
        qrels = read.file("TrecRun.qrels", self.qrels) if self.qrels is not None else None
        return RunExamples(read.file("TrecRun.path", self.path), read.file("TrecRun.queries", self.queries),
                           read.file("TrecRun.collection", self.collection), self.run_settings(read), qrels,
                           read.limit, read.cache_dir)

    def prepare(self, read: ReadSettings) -> None:
        self.open(read)  # the line offsets and the checking pass, once for every rank
