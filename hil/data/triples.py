"""Training triples (query, positive passage, negative passage): MS MARCO text triples and BM25-mined ones.

File format (MS MARCO ``triples.train.small.tsv``): one ``query TAB positive TAB negative`` a line, UTF-8. Reading
follows :func:`hil.data.beir_files.iter_text_lines` (BOM and CRLF removed, blank lines skipped, invalid UTF-8 an
error) and keeps text exactly as written: MS MARCO's mojibake (``"â\\x80\\x99"`` for ``'``) is valid UTF-8 and is not
repaired, so training sees what ColBERT's reference training saw.

:func:`read_triples` holds every triple; training reads files of any size by index instead
(:class:`hil.data.triples_file.TriplesFile`, the same triples).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from hil.data.beir import BeirDataset, load_beir
from hil.data.beir_files import iter_text_lines
from hil.data.examples import ExampleReader, ReadSettings
from hil.errors import DataFormatError, UserError
from hil.provenance import atomic_output

if TYPE_CHECKING:
    from hil.data.bm25 import BM25Index

_COLUMNS = ("query", "positive", "negative")


@dataclass(frozen=True)
class Triple:
    query: str
    positive: str
    negative: str


class TripleDataset:
    """Triples held in a list (BM25-mined ones, a ``.gz`` file); the interface of the on-disk datasets."""

    def __init__(self, triples: list[Triple], label: str = "triples"):
        self.triples, self.label = triples, label

    def __len__(self) -> int:
        return len(self.triples)

    def __getitem__(self, index: int) -> Triple:
        return self.triples[index]

    def __iter__(self) -> Iterator[Triple]:
        return iter(self.triples)

    def iter_passages(self) -> Iterator[str]:
        """Positive then negative of each triple in order (repeats included)."""
        for triple in self.triples:
            yield triple.positive
            yield triple.negative

    def iter_queries(self) -> Iterator[str]:
        return (triple.query for triple in self.triples)

    def describe(self) -> str:
        return f"{self.label} ({len(self.triples)} triples, in memory)"


def parse_triple(path: str | os.PathLike, line: int, text: str) -> Triple:
    """The triple on line ``line`` of ``path`` (``text``: the line as :func:`iter_text_lines` gives it).

    Raises :class:`DataFormatError` naming file and line for a wrong column count or an empty column.
    """
    columns = text.split("\t")
    if len(columns) != 3:
        raise DataFormatError(path, line, f"expected 3 tab-separated columns (query, positive, negative), "
                                          f"found {len(columns)}")
    for name, column in zip(_COLUMNS, columns):
        if not column.strip():
            raise DataFormatError(path, line, f"empty {name} column")
    return Triple(*columns)


def iter_triples(path: str | os.PathLike) -> Iterator[tuple[int, Triple]]:
    """``(line_number, Triple)`` for each line of a triples TSV, streaming (for files too big to hold)."""
    path = Path(path)
    for line, text in iter_text_lines(path):
        yield line, parse_triple(path, line, text)


def read_triples(path: str | os.PathLike, limit: int | None = None) -> list[Triple]:
    """The first ``limit`` triples (all when None) of a ``query TAB positive TAB negative`` file.

    Raises :class:`DataFormatError` naming file and line for a wrong column count, an empty column or invalid
    UTF-8, and for a file without any triple.
    """
    if limit is not None and limit < 0:
        raise UserError(f"limit must be >= 0, got {limit}")
    triples: list[Triple] = []
    if limit == 0:
        return triples
    for _, triple in iter_triples(path):
        triples.append(triple)
        if limit is not None and len(triples) >= limit:
            break
    if not triples:
        raise DataFormatError(path, None, "no triples")
    return triples


def write_triples(path: str | os.PathLike, triples: Iterable[Triple]) -> None:
    """Write triples as TSV through :func:`hil.provenance.atomic_output` (a reader never sees half a file).

    A field holding a tab or a line break could not be read back as the same triple, so it is a ``ValueError``.
    """
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as handle:
        for number, triple in enumerate(triples, start=1):
            fields = (triple.query, triple.positive, triple.negative)
            for name, value in zip(_COLUMNS, fields):
                if any(mark in value for mark in ("\t", "\n", "\r")) or not value.strip():
                    raise ValueError(f"triple {number}: {name} is empty or holds a tab or line break")
            handle.write("\t".join(fields) + "\n")


def _flat(text: str) -> str:
    """``text`` with tabs and line breaks as spaces, stripped: one TSV field."""
    return text.replace("\t", " ").replace("\r", " ").replace("\n", " ").strip()


def mine_bm25_triples(dataset: BeirDataset, negatives_per_query: int = 1, depth: int = 100, seed: int = 0,
                      skip_top: int = 0, index: "BM25Index | None" = None) -> list[Triple]:
    """Hard-negative triples from ``dataset``'s qrels (split ``dataset.split``) and BM25 (ColBERT/BEIR style).

    For each query and each judged-relevant document (score > 0), ``negatives_per_query`` negatives are sampled
    without replacement from BM25's top ``depth`` for that query, after skipping its first ``skip_top`` ranks (the
    ones most likely to be unjudged positives), excluding every document judged relevant for that query and the
    query's own id (self matches). Documents judged 0 are fair negatives. Tabs and line breaks in texts become
    spaces (as ColBERT's BEIR-to-TSV conversion does) so the triples can be cached with :func:`write_triples`;
    positives or negatives whose text is empty are skipped. When fewer candidates exist, all are used;
    a pair with none is skipped. Each query draws from ``random.Random(f"{seed}:{query_id}")``, so results do not
    depend on which other queries are present. Output order: queries, then positives, as in the dataset.
    """
    from hil.data.bm25 import BM25Index  # a sibling module; imported here to keep bm25s optional for readers

    if negatives_per_query < 1:
        raise UserError(f"negatives_per_query must be >= 1, got {negatives_per_query}")
    if depth < 1 or skip_top < 0 or skip_top >= depth:
        raise UserError(f"need depth >= 1 and 0 <= skip_top < depth, got depth={depth}, skip_top={skip_top}")
    query_ids = [query_id for query_id in dataset.queries
                 if any(score > 0 for score in dataset.qrels.get(query_id, {}).values())]
    if not query_ids:
        return []
    index = index if index is not None else BM25Index.from_dataset(dataset)
    rankings = index.search([dataset.queries[query_id] for query_id in query_ids], depth)
    triples: list[Triple] = []
    for query_id, ranking in zip(query_ids, rankings):
        judgments = dataset.qrels[query_id]
        relevant = {doc_id for doc_id, score in judgments.items() if score > 0}
        candidates = [doc_id for doc_id, _ in ranking[skip_top:] if doc_id not in relevant and doc_id != query_id]
        # BM25 only returns documents with tokens, but a document of bare punctuation has no text worth training on.
        candidates = [doc_id for doc_id in candidates if _flat(dataset.doc_text(doc_id))]
        rng = random.Random(f"{seed}:{query_id}")
        query = _flat(dataset.queries[query_id])
        if not query:
            continue
        for positive_id in (doc_id for doc_id, score in judgments.items() if score > 0):
            positive = _flat(dataset.doc_text(positive_id)) if positive_id in dataset.corpus else ""
            if not positive:
                continue  # a subset may hold judgments for documents it dropped; an empty positive teaches nothing
            chosen = rng.sample(candidates, min(negatives_per_query, len(candidates)))
            triples.extend(Triple(query, positive, _flat(dataset.doc_text(negative_id))) for negative_id in chosen)
    return triples


@dataclass(frozen=True)
class MinedTriples(ExampleReader):
    """Triples mined from a BEIR dataset: its judged positives, each with BM25 hard negatives
    (:func:`mine_bm25_triples`, seeded by ``data.seed``), held in memory.

    Args:
        dataset: a BEIR dataset name or folder (under ``HIL_DATA_DIR``), or an ir_datasets id.
        split: whose ``qrels/<split>.tsv`` gives the positives.
        negatives_per_query: BM25 negatives drawn for each positive.
        depth: the negatives are drawn from BM25's top ``depth`` of each query.
    """

    dataset: str
    split: str = "train"
    negatives_per_query: int = 1
    depth: int = 100
    n_documents = 2

    def open(self, read: ReadSettings) -> TripleDataset:
        corpus = load_beir(self.dataset, split=self.split, data_dir=read.data_dir)
        triples = mine_bm25_triples(corpus, negatives_per_query=self.negatives_per_query, depth=self.depth,
                                    seed=read.seed)
        return TripleDataset(triples[: read.limit] if read.limit else triples,
                             f"BM25-mined from {self.dataset} ({self.split})")
