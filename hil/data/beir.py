"""BEIR datasets: a corpus, queries and one split's relevance judgments (qrels).

Layout on disk (the official BEIR zips)::

    <folder>/corpus.jsonl        {"_id": "...", "title": "...", "text": "...", ...}   one object a line
    <folder>/queries.jsonl       {"_id": "...", "text": "...", ...}
    <folder>/qrels/<split>.tsv   query-id TAB corpus-id TAB score   (a header row is optional)

``.jsonl.gz`` / ``.tsv.gz`` variants are read too. A dataset name is resolved with :func:`hil.paths.resolve_dataset`
(a path, or ``$HIL_DATA_DIR/beir/<name>`` / ``$HIL_DATA_DIR/<name>``); when there is no local folder the Hugging Face
hub copies ``BeIR/<name>`` and ``BeIR/<name>-qrels`` are tried (online machines only).

Choices where BEIR itself is loose (each checked, each reported as a :class:`DataFormatError` naming file and line):

* Files are read as a stream of lines split on ``\\n`` only; a UTF-8 byte order mark on the first line and a ``\\r``
  before the newline are removed; blank (whitespace-only) lines are skipped; invalid UTF-8 is an error.
* ``_id`` must be a non-empty string without whitespace (run files and TREC qrels are whitespace-separated). JSON
  integers are accepted and turned into their decimal string (``7`` -> ``"7"``), since some exports write numeric
  ids; floats, booleans and null are errors. A repeated id is an error naming both lines.
* Documents: ``"text"`` must be present and a string (it may be empty); a missing or null ``"title"`` is ``""``.
  Queries: ``"text"`` must be present and a string. Strings with unpaired surrogates (``"\\ud800"``) are errors.
* Qrels: exactly three tab-separated columns; the score must be an integer (graded, 0 and negative kept). The first
  non-blank line is taken as a header when its score column is not an integer (BEIR's own loader skips line 1
  unconditionally, which silently drops a judgment from header-less files). Every query id and document id must exist
  in queries/corpus. A repeated (query, doc) pair with the same score is ignored; with a different score, an error.
* Only queries judged in the split are kept (BEIR convention); their judgments with score 0 stay in ``qrels``.
* Judgments of documents outside the corpus (some official BEIR qrels; many in a re-ranking set like TREC DL 2019)
  count in the ideal DCG for BEIR and trec_eval: ``load_beir`` keeps them by default (one warning line gives their
  count, ``BeirDataset.judged_outside_corpus`` records it); ``judged_outside_corpus="error"`` refuses them.
* ``relevance_level``: the lowest grade binary metrics count as relevant (1; TREC DL: 2); nDCG uses the grades.

Self matches (ArguAna, Quora: the query is itself a corpus document with the same id) are a property of runs, not of
the data; :func:`drop_self_matches` removes them from a run the way BEIR's ``ignore_identical_ids`` does.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Literal, Mapping, TypeVar

from hil.data.errors import DataFormatError
from hil.paths import DATA_DIR_ENV, resolve_dataset
from hil.provenance import fingerprint_strings

V = TypeVar("V")
OutsideCorpus = Literal["error", "keep"]
logger = logging.getLogger(__name__)

_BOM = b"\xef\xbb\xbf"
_SURROGATE = re.compile("[\ud800-\udfff]")
_INTEGER = re.compile(r"[+-]?[0-9]+")
_WHITESPACE = re.compile(r"\s")


# ----------------------------------------------------------------------------------------------------------------------
# Reading lines


def _open_binary(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def iter_text_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """``(line_number, text)`` for each non-blank line of a UTF-8 file (``.gz`` decompressed), streaming.

    Lines are split on ``\\n`` only (so a stray ``\\r`` or form feed inside a field stays inside it); a first-line BOM
    and the ``\\r`` of CRLF endings are removed. Line numbers are 1-based and count blank lines.
    """
    path = Path(path)
    with _open_binary(path) as handle:
        try:
            for number, raw in enumerate(handle, start=1):
                if number == 1 and raw.startswith(_BOM):
                    raw = raw[len(_BOM):]
                raw = raw.rstrip(b"\n")
                if raw.endswith(b"\r"):
                    raw = raw[:-1]
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DataFormatError(path, number, f"invalid UTF-8 at byte {err.start} of the line "
                                                        f"({err.reason})") from None
                if text.strip():
                    yield number, text
        except (OSError, EOFError, zlib.error) as err:  # a corrupt or truncated .gz
            raise DataFormatError(path, None, f"cannot read file: {err}") from None


def _check_no_surrogates(path: Path, line: int | None, name: str, value: str) -> None:
    # Only "\ud800"-style JSON escapes can produce these (strict UTF-8 decoding rejects them in raw bytes).
    if _SURROGATE.search(value):
        raise DataFormatError(path, line, f"field {name!r} contains an unpaired UTF-16 surrogate")


def _iter_json_objects(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    for number, text in iter_text_lines(path):
        try:
            value = json.loads(text)
        except RecursionError:
            raise DataFormatError(path, number, "malformed JSON: nested too deeply") from None
        except ValueError as err:  # json.JSONDecodeError, and over-long integer literals
            detail = f"{err.msg} at column {err.colno}" if isinstance(err, json.JSONDecodeError) else str(err)
            raise DataFormatError(path, number, f"malformed JSON: {detail}") from None
        if not isinstance(value, dict):
            raise DataFormatError(path, number, f"expected a JSON object, got {type(value).__name__}")
        yield number, value


def _checked_id(path: Path, line: int | None, value: Any, name: str = "_id") -> str:
    if isinstance(value, bool) or value is None or not isinstance(value, (str, int)):
        shown = "missing" if value is None else f"a {type(value).__name__}"
        raise DataFormatError(path, line, f"field {name!r} must be a string (or integer), got {shown}")
    identifier = str(value)
    if not identifier.strip():
        raise DataFormatError(path, line, f"field {name!r} is empty")
    if _WHITESPACE.search(identifier):
        raise DataFormatError(path, line, f"{name} {identifier!r} contains whitespace, which run and qrels files "
                                          f"cannot hold")
    _check_no_surrogates(path, line, name, identifier)
    return identifier


def _checked_text(path: Path, line: int | None, record: Mapping[str, Any], name: str, required: bool) -> str:
    if name not in record or record[name] is None:
        if required:
            raise DataFormatError(path, line, f"missing field {name!r}")
        return ""
    value = record[name]
    if not isinstance(value, str):
        raise DataFormatError(path, line, f"field {name!r} must be a string, got {type(value).__name__}")
    _check_no_surrogates(path, line, name, value)
    return value


def _records_by_id(path: Path, records: Iterable[tuple[int, Mapping[str, Any]]], what: str,
                   value: Callable[[int, Mapping[str, Any]], V]) -> dict[str, V]:
    """``{_id: value(line, record)}`` of JSON records: every ``_id`` present, valid and unique, at least one."""
    found: dict[str, V] = {}
    first_line: dict[str, int] = {}
    for line, record in records:
        if "_id" not in record:
            raise DataFormatError(path, line, "missing field '_id'")
        record_id = _checked_id(path, line, record["_id"])
        if record_id in found:
            raise DataFormatError(path, line, f"duplicate _id {record_id!r} (first on line {first_line[record_id]})")
        found[record_id] = value(line, record)
        first_line[record_id] = line
    if not found:
        raise DataFormatError(path, None, f"no {what}")
    return found


def _records_to_corpus(path: Path, records: Iterable[tuple[int, Mapping[str, Any]]]) -> dict[str, dict[str, str]]:
    def document(line: int, record: Mapping[str, Any]) -> dict[str, str]:
        text = _checked_text(path, line, record, "text", required=True)  # the required field is checked first
        return {"title": _checked_text(path, line, record, "title", required=False), "text": text}

    return _records_by_id(path, records, "documents", document)


def _records_to_queries(path: Path, records: Iterable[tuple[int, Mapping[str, Any]]]) -> dict[str, str]:
    return _records_by_id(path, records, "queries",
                          lambda line, record: _checked_text(path, line, record, "text", required=True))


def read_corpus_jsonl(path: str | os.PathLike) -> dict[str, dict[str, str]]:
    """``{doc_id: {"title", "text"}}`` from a BEIR ``corpus.jsonl`` (rules in the module docstring)."""
    path = Path(path)
    return _records_to_corpus(path, _iter_json_objects(path))


def read_queries_jsonl(path: str | os.PathLike) -> dict[str, str]:
    """``{query_id: text}`` from a BEIR ``queries.jsonl``."""
    path = Path(path)
    return _records_to_queries(path, _iter_json_objects(path))


def _check_options(judged_outside_corpus: str = "error", relevance_level: int = 1) -> None:
    if judged_outside_corpus not in ("error", "keep"):
        raise ValueError(f"judged_outside_corpus must be 'error' or 'keep', got {judged_outside_corpus!r}")
    if isinstance(relevance_level, bool) or not isinstance(relevance_level, int) or relevance_level < 1:
        raise ValueError(f"relevance_level must be an integer >= 1, got {relevance_level!r}")


class _QrelsBuilder:
    """Collects judgments, checking ids against the corpus/queries (see ``judged_outside_corpus``) and repeats."""

    def __init__(self, path: Path, queries: Mapping[str, str] | None, corpus: Mapping[str, Any] | None,
                 outside_corpus: OutsideCorpus = "error") -> None:
        _check_options(outside_corpus)
        self.path, self.queries, self.corpus, self.outside_corpus = path, queries, corpus, outside_corpus
        self.qrels: dict[str, dict[str, int]] = {}
        self.first_line: dict[tuple[str, str], int] = {}
        self.n_outside = 0

    def add(self, line: int | None, query_id: str, doc_id: str, score: int) -> None:
        if self.queries is not None and query_id not in self.queries:
            raise DataFormatError(self.path, line, f"query id {query_id!r} is not in the queries")
        outside = self.corpus is not None and doc_id not in self.corpus
        if outside and self.outside_corpus == "error":
            raise DataFormatError(self.path, line, f"corpus id {doc_id!r} is not in the corpus (a re-ranking set "
                                                   f"whose qrels judge documents outside its corpus loads with "
                                                   f"judged_outside_corpus='keep')")
        judged = self.qrels.setdefault(query_id, {})
        if doc_id in judged:
            if judged[doc_id] != score:
                raise DataFormatError(self.path, line, f"({query_id!r}, {doc_id!r}) judged {score} here but "
                                                       f"{judged[doc_id]} on line {self.first_line[(query_id, doc_id)]}")
            return
        judged[doc_id] = score
        self.first_line[(query_id, doc_id)] = line if line is not None else 0
        self.n_outside += outside

    def result(self) -> dict[str, dict[str, int]]:
        if not self.qrels:
            raise DataFormatError(self.path, None, "no judgments")
        if self.n_outside:
            logger.warning("%s: %d of %d judgments name documents outside the corpus; kept (they count in the ideal "
                           "DCG, as in trec_eval)", self.path, self.n_outside, sum(map(len, self.qrels.values())))
        return self.qrels


def _parse_score(path: Path, line: int | None, value: str) -> int:
    if not _INTEGER.fullmatch(value):
        raise DataFormatError(path, line, f"score {value!r} is not an integer")
    return int(value)


def read_qrels_tsv(path: str | os.PathLike, queries: Mapping[str, str] | None = None,
                   corpus: Mapping[str, Any] | None = None,
                   judged_outside_corpus: OutsideCorpus = "error") -> dict[str, dict[str, int]]:
    """``{query_id: {doc_id: score}}`` from a BEIR qrels TSV; ids are checked when ``queries``/``corpus`` are given
    (documents outside ``corpus`` as ``judged_outside_corpus`` says: see the module docstring)."""
    path = Path(path)
    builder = _QrelsBuilder(path, queries, corpus, judged_outside_corpus)
    first = True
    for line, text in iter_text_lines(path):
        columns = [column.strip() for column in text.split("\t")]
        if len(columns) != 3:
            raise DataFormatError(path, line, f"expected 3 tab-separated columns (query-id, corpus-id, score), "
                                              f"found {len(columns)}")
        if first and not _INTEGER.fullmatch(columns[2]):
            first = False
            continue  # header row
        first = False
        query_id = _checked_id(path, line, columns[0], "query-id")
        doc_id = _checked_id(path, line, columns[1], "corpus-id")
        builder.add(line, query_id, doc_id, _parse_score(path, line, columns[2]))
    return builder.result()


def load_trec_qrels(path: str | os.PathLike, queries: Mapping[str, str] | None = None,
                    corpus: Mapping[str, Any] | None = None,
                    judged_outside_corpus: OutsideCorpus = "error") -> dict[str, dict[str, int]]:
    """``{query_id: {doc_id: relevance}}`` from TREC qrels (``qid iteration docid relevance``, whitespace-separated);
    ids checked as :func:`read_qrels_tsv` does."""
    path = Path(path)
    builder = _QrelsBuilder(path, queries, corpus, judged_outside_corpus)
    for line, text in iter_text_lines(path):
        columns = text.split()
        if len(columns) != 4:
            raise DataFormatError(path, line, f"expected 4 whitespace-separated columns (query-id, iteration, "
                                              f"doc-id, relevance), found {len(columns)}")
        query_id = _checked_id(path, line, columns[0], "query-id")
        doc_id = _checked_id(path, line, columns[2], "doc-id")
        builder.add(line, query_id, doc_id, _parse_score(path, line, columns[3]))
    return builder.result()


def _read_id_text_tsv(path: Path, what: str) -> tuple[dict[str, str], dict[str, int]]:
    values: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for line, text in iter_text_lines(path):
        # Split at the first tab only: the text keeps any tab it holds (robust04's topic 350 does), as is.
        identifier, tab, rest = text.partition("\t")
        if not tab:
            raise DataFormatError(path, line, "expected 2 tab-separated columns (id, text), found 1")
        identifier = _checked_id(path, line, identifier.strip(), "id")
        if identifier in values:
            raise DataFormatError(path, line, f"duplicate id {identifier!r} (first on line {first_line[identifier]})")
        values[identifier] = rest
        first_line[identifier] = line
    if not values:
        raise DataFormatError(path, None, f"no {what}")
    return values, first_line


def load_topics_tsv(path: str | os.PathLike) -> dict[str, str]:
    """``{query_id: text}`` from ``qid TAB text`` lines (``.gz`` allowed): MS MARCO queries, Pyserini BEIR topics."""
    return _read_id_text_tsv(Path(path), "queries")[0]


def load_collection_tsv(path: str | os.PathLike) -> dict[str, dict[str, str]]:
    """``{doc_id: {"title": "", "text"}}`` from an MS MARCO style ``pid TAB text`` collection."""
    passages = _read_id_text_tsv(Path(path), "documents")[0]
    return {doc_id: {"title": "", "text": text} for doc_id, text in passages.items()}


# ----------------------------------------------------------------------------------------------------------------------
# The dataset


@dataclass
class BeirDataset:
    """A corpus, the queries judged in one split, and that split's qrels (BEIR dict shapes)."""

    name: str
    corpus: dict[str, dict[str, str]]  # doc_id -> {"title", "text"}
    queries: dict[str, str]  # query_id -> text, only queries with judgments in ``split``
    qrels: dict[str, dict[str, int]]  # query_id -> {doc_id: graded relevance}
    split: str
    source: str  # the folder or hub id it was read from
    relevance_level: int = 1  # lowest grade binary metrics count as relevant (TREC DL: 2); nDCG uses the grades
    judged_outside_corpus: int = 0  # judgments in ``qrels`` of documents not in ``corpus`` (re-ranking sets)

    def doc_ids(self) -> list[str]:
        """Document ids in corpus (file) order; row ``i`` of any index built over :meth:`documents` is ``doc_ids()[i]``."""
        return list(self.corpus)

    def query_ids(self) -> list[str]:
        return list(self.queries)

    def doc_text(self, doc_id: str) -> str:
        """``title + " " + text`` when the title is non-empty, else ``text``; stripped (BEIR / ColBERT convention)."""
        document = self.corpus[doc_id]
        title, text = document.get("title", ""), document.get("text", "")
        return f"{title} {text}".strip() if title else text.strip()

    def documents(self) -> list[str]:
        """The texts of :meth:`doc_ids`, in that order."""
        return [self.doc_text(doc_id) for doc_id in self.corpus]

    def query_texts(self) -> list[str]:
        return list(self.queries.values())

    def fingerprint(self) -> str:
        """A content fingerprint: split, document ids and texts, queries and qrels (sorted), in one hash."""

        def items() -> Iterator[str]:
            yield "split"
            yield self.split
            yield "corpus"
            for doc_id, document in self.corpus.items():
                yield doc_id
                yield document.get("title", "")
                yield document.get("text", "")
            yield "queries"
            for query_id, text in self.queries.items():
                yield query_id
                yield text
            yield "qrels"
            for query_id in sorted(self.qrels):
                for doc_id, score in sorted(self.qrels[query_id].items()):
                    yield f"{query_id}\t{doc_id}\t{score}"

        return fingerprint_strings(items())

    def subset(self, n_queries: int | None = None, n_docs: int | None = None, seed: int = 0,
               candidates: Mapping[str, Iterable[str]] | None = None) -> "BeirDataset":
        """A smaller dataset for tests and slices, deterministic given ``seed``.

        Keeps ``n_queries`` judged queries sampled without replacement (all when None) with all their judgments,
        every document judged for a kept query or among its ``candidates`` (qid -> a first stage's document ids),
        even beyond ``n_docs`` (they are never dropped), and documents sampled from the rest up to ``n_docs`` in total
        (all when None). Order follows the original.
        """
        rng = random.Random(seed)
        query_ids = [query_id for query_id in self.queries if query_id in self.qrels]
        if n_queries is not None and n_queries < len(query_ids):
            kept = set(rng.sample(query_ids, n_queries))
            query_ids = [query_id for query_id in query_ids if query_id in kept]
        judged = {doc_id for query_id in query_ids for doc_id in self.qrels[query_id] if doc_id in self.corpus}
        if candidates is not None:
            judged |= {doc_id for query_id in query_ids for doc_id in candidates.get(query_id, ())
                       if doc_id in self.corpus}
        if n_docs is None:
            doc_ids = set(self.corpus)
        else:
            others = [doc_id for doc_id in self.corpus if doc_id not in judged]
            extra = max(0, min(n_docs - len(judged), len(others)))
            doc_ids = judged | set(rng.sample(others, extra))
        return BeirDataset(
            name=self.name,
            corpus={doc_id: dict(document) for doc_id, document in self.corpus.items() if doc_id in doc_ids},
            queries={query_id: self.queries[query_id] for query_id in query_ids},
            qrels={query_id: dict(self.qrels[query_id]) for query_id in query_ids},
            split=self.split,
            source=self.source,
            relevance_level=self.relevance_level,
            judged_outside_corpus=sum(doc_id not in self.corpus for query_id in query_ids
                                      for doc_id in self.qrels[query_id]),
        )


def drop_self_matches(run: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """A copy of ``run`` without documents whose id equals their query id (BEIR's ``ignore_identical_ids``).

    Needed for ArguAna and Quora, whose queries are themselves corpus documents with the same ids.
    """
    return {query_id: {doc_id: score for doc_id, score in ranked.items() if doc_id != query_id}
            for query_id, ranked in run.items()}


def _first_existing(folder: Path, *names: str) -> Path | None:
    for name in names:
        candidate = folder / name
        if candidate.is_file():
            return candidate
    return None


def _load_folder(folder: Path, name: str, split: str, outside_corpus: OutsideCorpus,
                 relevance_level: int) -> BeirDataset:
    corpus_path = _first_existing(folder, "corpus.jsonl", "corpus.jsonl.gz")
    queries_path = _first_existing(folder, "queries.jsonl", "queries.jsonl.gz")
    qrels_path = _first_existing(folder / "qrels", f"{split}.tsv", f"{split}.tsv.gz")
    if corpus_path is None or queries_path is None:
        missing = "corpus.jsonl" if corpus_path is None else "queries.jsonl"
        raise FileNotFoundError(f"{folder}: no {missing} (expected the BEIR layout: corpus.jsonl, queries.jsonl, "
                                f"qrels/<split>.tsv)")
    if qrels_path is None:
        splits = sorted(p.name.split(".")[0] for p in (folder / "qrels").glob("*.tsv*")) if (folder / "qrels").is_dir() else []
        raise FileNotFoundError(f"{folder}: no qrels/{split}.tsv (splits found: {', '.join(splits) or 'none'})")
    corpus = read_corpus_jsonl(corpus_path)
    all_queries = read_queries_jsonl(queries_path)
    qrels = read_qrels_tsv(qrels_path, queries=all_queries, corpus=corpus, judged_outside_corpus=outside_corpus)
    return _dataset(name, corpus, all_queries, qrels, split, str(folder), relevance_level)


def _dataset(name: str, corpus: dict[str, dict[str, str]], all_queries: dict[str, str],
             qrels: dict[str, dict[str, int]], split: str, source: str, relevance_level: int) -> BeirDataset:
    queries = {query_id: text for query_id, text in all_queries.items() if query_id in qrels}
    outside = sum(doc_id not in corpus for judged in qrels.values() for doc_id in judged)
    return BeirDataset(name=name, corpus=corpus, queries=queries, qrels=qrels, split=split, source=source,
                       relevance_level=relevance_level, judged_outside_corpus=outside)


def _load_hub(name: str, split: str, outside_corpus: OutsideCorpus, relevance_level: int) -> BeirDataset:
    """BEIR from the Hugging Face hub (``BeIR/<name>`` corpus/queries configs, ``BeIR/<name>-qrels``). Needs network."""
    hub_id = f"BeIR/{name}"
    try:
        from datasets import load_dataset  # imported here: slow to import and only needed online

        corpus_rows = load_dataset(hub_id, "corpus")["corpus"]
        query_rows = load_dataset(hub_id, "queries")["queries"]
        qrels_rows = load_dataset(f"{hub_id}-qrels", split=split)
    except Exception as err:  # ImportError, ConnectionError, hub errors: one clear message
        here = os.environ.get(DATA_DIR_ENV)
        raise FileNotFoundError(
            f"BEIR dataset {name!r} (split {split!r}) is not in a local folder "
            f"({DATA_DIR_ENV}={here!r}; looked for <dir>/beir/{name} and <dir>/{name}) and could not be loaded from "
            f"the Hugging Face hub as {hub_id!r}: {type(err).__name__}: {err}. Download the BEIR zip and set "
            f"{DATA_DIR_ENV}, or pass the folder's path.") from err
    corpus_source, queries_source = Path(f"hf://{hub_id}/corpus"), Path(f"hf://{hub_id}/queries")
    qrels_source = Path(f"hf://{hub_id}-qrels/{split}")
    corpus = _records_to_corpus(corpus_source, ((row + 1, record) for row, record in enumerate(corpus_rows)))
    all_queries = _records_to_queries(queries_source, ((row + 1, record) for row, record in enumerate(query_rows)))
    builder = _QrelsBuilder(qrels_source, all_queries, corpus, outside_corpus)
    for row, record in enumerate(qrels_rows, start=1):
        query_id = _checked_id(qrels_source, row, record.get("query-id"), "query-id")
        doc_id = _checked_id(qrels_source, row, record.get("corpus-id"), "corpus-id")
        score = record.get("score")
        if isinstance(score, bool) or not isinstance(score, (int, str)):
            raise DataFormatError(qrels_source, row, f"score {score!r} is not an integer")
        builder.add(row, query_id, doc_id, _parse_score(qrels_source, row, str(score).strip()))
    return _dataset(name, corpus, all_queries, builder.result(), split, f"hf://{hub_id}", relevance_level)


def _looks_like_path(name_or_path: str) -> bool:
    return name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1 or os.sep != "/" and os.sep in name_or_path


def load_beir(name_or_path: str | os.PathLike, split: str = "test", data_dir: str | os.PathLike | None = None, *,
              judged_outside_corpus: OutsideCorpus = "keep", relevance_level: int = 1) -> BeirDataset:
    """Load one split of a BEIR dataset from a local folder, else from the Hugging Face hub.

    ``name_or_path`` is a folder, a name found under ``data_dir`` / ``$HIL_DATA_DIR`` (``beir/<name>`` or ``<name>``),
    or a hub name (``scifact`` or ``BeIR/scifact``). Bad files raise :class:`DataFormatError` naming file and line;
    a missing file or an unreachable dataset raises ``FileNotFoundError``. ``judged_outside_corpus``,
    ``relevance_level``: see the module docstring (TREC DL, ``msmarco/dl19``: ``"keep"`` and 2).
    """
    _check_options(judged_outside_corpus, relevance_level)
    folder = resolve_dataset(name_or_path, data_dir)
    text = str(name_or_path)
    if folder is None and isinstance(name_or_path, str) and text.lower().startswith("beir/"):
        folder = resolve_dataset(text.split("/", 1)[1], data_dir)
    if folder is not None:
        return _load_folder(folder, folder.name, split, judged_outside_corpus, relevance_level)
    if not isinstance(name_or_path, str) or _looks_like_path(text):
        raise FileNotFoundError(f"{text}: no such dataset folder")
    name = text.split("/", 1)[1] if text.lower().startswith("beir/") else text
    return _load_hub(name, split, judged_outside_corpus, relevance_level)
