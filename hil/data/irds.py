"""Datasets through `ir_datasets <https://ir-datasets.com>`_: ``irds:<id>`` wherever a dataset name is taken.

    python evaluate.py --model M --dataset irds:beir/scifact/test
    python evaluate.py --model M --dataset irds:msmarco-passage/trec-dl-2019/judged

:func:`read_irds` reads an ir_datasets dataset's documents, queries and qrels (``docs_iter``, ``queries_iter``,
``qrels_iter``) into the shapes of a BEIR folder, checked by the same rules (:mod:`hil.data.beir_files`: ids without
whitespace, no repeated id, integer grades, every judged query among the queries); :func:`hil.data.beir.load_beir`
makes the :class:`~hil.data.beir.BeirDataset` of it, which keeps only judged queries, counts judgments of documents
outside the corpus and fingerprints the content, as for a folder. ir_datasets is optional (``pip install
ir_datasets``); it downloads a dataset into ``$IR_DATASETS_HOME`` (``~/.ir_datasets``) the first time it is read.

* A document with a ``text`` field keeps its ``title`` (when it has one) beside the text, as a BEIR ``corpus.jsonl``
  does, so that its text is BEIR's ``title + " " + text`` (:meth:`~hil.data.beir.BeirDataset.doc_text`) and a BEIR
  set read through ir_datasets is the same data as its folder. A document without ``text`` (e.g. MS MARCO
  documents' ``body``) is ir_datasets' own ``default_text()``; a query likewise (``text``, else ``default_text()``).
* Relevance level (the lowest grade binary metrics count): the dataset's official measures as ir_datasets documents
  them (``RR(rel=2)``, ``AP(rel=2)``: 2 for TREC DL), else 1 (trec_eval's default).
* The split is the id itself (``beir/scifact/test``): the id chooses the queries and qrels.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol

from hil.data.beir_files import (
    OutsideCorpus,
    QrelsBuilder,
    checked_id,
    parse_score,
    records_to_corpus,
    records_to_queries,
)
from hil.errors import MissingInputError, UserError

IRDS_PREFIX = "irds:"
INSTALL_HINT = "pip install ir_datasets"
_RELEVANCE_IN_MEASURE = re.compile(r"\brel=(\d+)")


class IrdsDataset(Protocol):
    """What is read of an ``ir_datasets`` dataset (``ir_datasets.load(id)``)."""

    def docs_iter(self) -> Iterator[Any]: ...

    def queries_iter(self) -> Iterator[Any]: ...

    def qrels_iter(self) -> Iterator[Any]: ...


@dataclass(frozen=True)
class IrdsData:
    """An ir_datasets dataset in BEIR's shapes: every query (judged or not), every judgment, its own relevance level."""

    dataset_id: str
    corpus: dict[str, dict[str, str]]  # doc_id -> {"title", "text"}
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]
    relevance_level: int

    @property
    def name(self) -> str:
        """A name that is also a folder name: ``beir/scifact/test`` -> ``beir-scifact-test``."""
        return re.sub(r"[^A-Za-z0-9_.+=-]+", "-", self.dataset_id).strip("-")

    @property
    def source(self) -> str:
        return f"{IRDS_PREFIX}{self.dataset_id}"


def is_irds_name(name: object) -> bool:
    """Whether a dataset name asks for ir_datasets (``irds:<id>``)."""
    return isinstance(name, str) and name.lower().startswith(IRDS_PREFIX)


def irds_id(name: str) -> str:
    """``irds:beir/scifact/test`` -> ``beir/scifact/test``; an empty id is a :class:`UserError`."""
    dataset_id = name[len(IRDS_PREFIX):].strip()
    if not dataset_id:
        raise UserError(f"{name!r}: give an ir_datasets id after 'irds:', e.g. irds:beir/scifact/test")
    return dataset_id


def open_irds(dataset_id: str) -> IrdsDataset:
    """``ir_datasets.load(dataset_id)``, with one-line errors: ir_datasets not installed, an unknown id (named, with
    the registered ids closest to it), a dataset without documents, queries or qrels."""
    where = f"{IRDS_PREFIX}{dataset_id}"
    try:
        import ir_datasets  # optional: only an irds: name needs it
    except ImportError:
        raise UserError(f"{where}: ir_datasets is not installed ({INSTALL_HINT})") from None
    try:
        dataset = ir_datasets.load(dataset_id)
    except KeyError:
        close = difflib.get_close_matches(dataset_id, list(ir_datasets.registry), n=3)
        hint = f"; closest: {', '.join(close)}" if close else " (ids are listed at https://ir-datasets.com)"
        raise MissingInputError(f"{where}: no ir_datasets dataset with id {dataset_id!r}{hint}") from None
    lacking = [part for part in ("docs", "queries", "qrels") if not getattr(dataset, f"has_{part}")()]
    if lacking:
        raise UserError(f"{where}: has no {' or '.join(lacking)}; an evaluation needs documents, queries and qrels "
                        "(choose a subset with queries and judgments, e.g. .../test or .../judged)")
    return dataset


def relevance_level(dataset: object) -> int:
    """The lowest grade the dataset's official measures count as relevant (``RR(rel=2)`` -> 2), else 1."""
    documentation = getattr(dataset, "documentation", None)
    measures: list[Any] = []
    if callable(documentation):
        try:
            measures = list((documentation() or {}).get("official_measures") or [])
        except Exception:  # a documentation file ir_datasets cannot read: no statement, trec_eval's default
            measures = []
    levels = [int(found) for measure in measures for found in _RELEVANCE_IN_MEASURE.findall(str(measure))]
    return max(levels) if levels else 1


def _document(record: Any) -> dict[str, Any]:
    """One ``docs_iter`` record as a BEIR corpus record (``_id``, ``title``, ``text``)."""
    text = getattr(record, "text", None)
    title = getattr(record, "title", None) if isinstance(text, str) else None
    return {"_id": record.doc_id, "title": title if isinstance(title, str) else "",
            "text": text if isinstance(text, str) else record.default_text()}


def _query(record: Any) -> dict[str, Any]:
    text = getattr(record, "text", None)
    return {"_id": record.query_id, "text": text if isinstance(text, str) else record.default_text()}


def read_irds(name: str, judged_outside_corpus: OutsideCorpus = "keep") -> IrdsData:
    """Documents, queries and qrels of ``irds:<id>`` (the module docstring says how), every record checked: a bad
    one is a :class:`DataFormatError` naming ``irds:<id>/<docs|queries|qrels>`` and the record's 1-based number;
    anything ir_datasets itself fails on (a download, a damaged file) is one :class:`MissingInputError`."""
    dataset_id = irds_id(name)
    dataset = open_irds(dataset_id)
    where = f"{IRDS_PREFIX}{dataset_id}"
    try:
        corpus = records_to_corpus(Path(f"{where}/docs"), enumerate(map(_document, dataset.docs_iter()), start=1))
        queries = records_to_queries(Path(f"{where}/queries"),
                                     enumerate(map(_query, dataset.queries_iter()), start=1))
        source = Path(f"{where}/qrels")
        builder = QrelsBuilder(source, queries, corpus, judged_outside_corpus)
        for number, qrel in enumerate(dataset.qrels_iter(), start=1):
            builder.add(number, checked_id(source, number, qrel.query_id, "query_id"),
                        checked_id(source, number, qrel.doc_id, "doc_id"),
                        parse_score(source, number, str(qrel.relevance).strip()))
        qrels = builder.result()
    except UserError:
        raise
    except Exception as error:  # ir_datasets' own failures: no network, a damaged download, a format it rejects
        raise MissingInputError(f"{where}: ir_datasets could not read it ({type(error).__name__}: {error}); it "
                                f"downloads into $IR_DATASETS_HOME (~/.ir_datasets) on first use") from error
    return IrdsData(dataset_id, corpus, queries, qrels, relevance_level(dataset))


def check_split(name: str, split: str, default: str) -> None:
    """An ``irds:`` id names its split; a ``split`` other than the default (or the id's last part) is refused."""
    if split not in (default, irds_id(name).rsplit("/", 1)[-1]):
        raise UserError(f"{name}: split {split!r} does not apply to an ir_datasets id, which names its split itself "
                        f"(e.g. irds:beir/scifact/dev)")
