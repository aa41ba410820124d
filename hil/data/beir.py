"""BEIR datasets: a corpus, queries and one split's relevance judgments (qrels).

Layout on disk (the official BEIR zips)::

    <folder>/corpus.jsonl        {"_id": "...", "title": "...", "text": "...", ...}   one object a line
    <folder>/queries.jsonl       {"_id": "...", "text": "...", ...}
    <folder>/qrels/<split>.tsv   query-id TAB corpus-id TAB score   (a header row is optional)

``.jsonl.gz`` / ``.tsv.gz`` variants are read too; how each file is read and checked (every problem a
:class:`DataFormatError` naming file and line) is :mod:`hil.data.beir_files`. A dataset name is resolved with
:func:`hil.paths.resolve_dataset` (a path, or ``$HIL_DATA_DIR/beir/<name>`` / ``$HIL_DATA_DIR/<name>``); when there is
no local folder the Hugging Face hub copies ``BeIR/<name>`` and ``BeIR/<name>-qrels`` are tried (online machines
only). ``irds:<id>`` is read through ir_datasets (:mod:`hil.data.irds`) into the same :class:`BeirDataset`. A folder,
split or dataset that cannot be found is a :class:`~hil.errors.MissingInputError` naming it.

* A dataset's default split is :func:`default_split`'s, the one place every command takes it from: ``test``,
  as BEIR reports every dataset but MS MARCO, which it reports on ``dev`` (its ``test`` qrels are TREC DL 2019's 43
  queries).
* BEIR's ``cqadupstack`` folder holds a BEIR folder per forum, not one dataset: :func:`forum_folders` lists them,
  and an experiment evaluates them one by one and averages them.
* Only queries judged in the split are kept (BEIR convention); their judgments with score 0 stay in ``qrels``.
* Judgments of documents outside the corpus (some official BEIR qrels; many in a re-ranking set like TREC DL 2019)
  count in the ideal DCG for BEIR and trec_eval: ``load_beir`` keeps them by default (one warning line gives their
  count, ``BeirDataset.judged_outside_corpus`` records it); ``judged_outside_corpus="error"`` refuses them.
* ``relevance_level``: the lowest grade binary metrics count as relevant (1; TREC DL: 2); nDCG uses the grades.

Self matches (ArguAna, Quora: the query is itself a corpus document with the same id) are a property of runs, not of
the data; :func:`drop_self_matches` removes them from a run the way BEIR's ``ignore_identical_ids`` does.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from hil.data.beir_files import (
    OutsideCorpus,
    QrelsBuilder,
    check_options,
    checked_id,
    iter_text_lines,
    load_collection_tsv,
    load_topics_tsv,
    load_trec_qrels,
    parse_score,
    read_corpus_jsonl,
    read_qrels_tsv,
    read_queries_jsonl,
    records_to_corpus,
    records_to_queries,
)
from hil.data.irds import check_split, is_irds_name, read_irds
from hil.errors import DataFormatError, MissingInputError
from hil.paths import DATA_DIR_ENV, resolve_dataset
from hil.provenance import fingerprint_strings

# The file readers are part of this module's interface too (``from hil.data.beir import read_qrels_tsv``).
__all__ = ["BeirDataset", "OutsideCorpus", "default_split", "drop_self_matches", "forum_folders", "iter_text_lines",
           "load_beir", "load_collection_tsv", "load_topics_tsv", "load_trec_qrels", "read_corpus_jsonl",
           "read_qrels_tsv", "read_queries_jsonl"]




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
        """Document ids in corpus (file) order; row ``i`` of any index built over :meth:`documents` is
        ``doc_ids()[i]``."""
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


def default_split(name_or_path: str | os.PathLike) -> str:
    """The split evaluated when none is given: ``dev`` for BEIR's ``msmarco`` (a name, ``BeIR/msmarco``, or a
    folder of that name), as BEIR reports it (its ``test`` qrels are TREC DL 2019's), else ``test``. The one place
    every command and :func:`load_beir` take the default from."""
    return "dev" if Path(str(name_or_path).rstrip("/")).name.lower() == "msmarco" else "test"


def _is_beir_folder(folder: Path) -> bool:
    return _first_existing(folder, "corpus.jsonl", "corpus.jsonl.gz") is not None and \
        _first_existing(folder, "queries.jsonl", "queries.jsonl.gz") is not None


# BEIR's datasets made of several BEIR folders (CQADupStack: one per forum), known by their folder's name: another
# folder that holds BEIR folders (``msmarco/`` with the triples beside ``dl19/``) is not averaged over them.
FORUM_PARENTS = ("cqadupstack",)


def forum_folders(name_or_path: str | os.PathLike, data_dir: str | os.PathLike | None = None) -> tuple[Path, ...]:
    """The BEIR folders inside a local ``cqadupstack`` folder (:data:`FORUM_PARENTS`: one per forum, each with its
    corpus, queries and qrels), sorted by name; ``()`` for any other folder, a hub name or an ``irds:`` id. BEIR
    reports such a folder as the mean of its forums' scores (:func:`hil.evaluation.results.forum_mean`)."""
    if is_irds_name(name_or_path):
        return ()
    folder, _ = dataset_source(name_or_path, data_dir)
    if folder is None or _is_beir_folder(folder) or folder.absolute().name.lower() not in FORUM_PARENTS:
        return ()
    return tuple(sorted((sub for sub in folder.iterdir() if sub.is_dir() and _is_beir_folder(sub)),
                        key=lambda sub: sub.name))


def _load_folder(folder: Path, name: str, split: str, outside_corpus: OutsideCorpus,
                 relevance_level: int) -> BeirDataset:
    corpus_path = _first_existing(folder, "corpus.jsonl", "corpus.jsonl.gz")
    queries_path = _first_existing(folder, "queries.jsonl", "queries.jsonl.gz")
    qrels_path = _first_existing(folder / "qrels", f"{split}.tsv", f"{split}.tsv.gz")
    if corpus_path is None or queries_path is None:
        missing = "corpus.jsonl" if corpus_path is None else "queries.jsonl"
        forums = forum_folders(folder)
        if forums:  # BEIR's cqadupstack: hil evaluate takes it whole; one dataset is one of its parts
            raise MissingInputError(f"{folder}: a folder of {len(forums)} BEIR datasets "
                                    f"({', '.join(f.name for f in forums)}), not one: hil evaluate takes it whole "
                                    f"(their mean, as BEIR reports it); here give one of them, e.g. {forums[0]}")
        raise MissingInputError(f"{folder}: no {missing} (expected the BEIR layout: corpus.jsonl, queries.jsonl, "
                                f"qrels/<split>.tsv)")
    if qrels_path is None:
        qrels_folder = folder / "qrels"
        splits = sorted(p.name.split(".")[0] for p in qrels_folder.glob("*.tsv*")) if qrels_folder.is_dir() else []
        raise MissingInputError(f"{folder}: no qrels/{split}.tsv (splits found: {', '.join(splits) or 'none'})")
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
        raise MissingInputError(
            f"BEIR dataset {name!r} (split {split!r}) is not in a local folder "
            f"({DATA_DIR_ENV}={here!r}; looked for <dir>/beir/{name} and <dir>/{name}) and could not be loaded from "
            f"the Hugging Face hub as {hub_id!r}: {type(err).__name__}: {err}. Download the BEIR zip and set "
            f"{DATA_DIR_ENV}, or pass the folder's path.") from err
    corpus_source, queries_source = Path(f"hf://{hub_id}/corpus"), Path(f"hf://{hub_id}/queries")
    qrels_source = Path(f"hf://{hub_id}-qrels/{split}")
    corpus = records_to_corpus(corpus_source, ((row + 1, record) for row, record in enumerate(corpus_rows)))
    all_queries = records_to_queries(queries_source, ((row + 1, record) for row, record in enumerate(query_rows)))
    builder = QrelsBuilder(qrels_source, all_queries, corpus, outside_corpus)
    for row, record in enumerate(qrels_rows, start=1):
        query_id = checked_id(qrels_source, row, record.get("query-id"), "query-id")
        doc_id = checked_id(qrels_source, row, record.get("corpus-id"), "corpus-id")
        score = record.get("score")
        if isinstance(score, bool) or not isinstance(score, (int, str)):
            raise DataFormatError(qrels_source, row, f"score {score!r} is not an integer")
        builder.add(row, query_id, doc_id, parse_score(qrels_source, row, str(score).strip()))
    return _dataset(name, corpus, all_queries, builder.result(), split, f"hf://{hub_id}", relevance_level)


def _looks_like_path(name_or_path: str) -> bool:
    return (name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
            or os.sep != "/" and os.sep in name_or_path)


def load_beir(name_or_path: str | os.PathLike, split: str | None = None, data_dir: str | os.PathLike | None = None, *,
              judged_outside_corpus: OutsideCorpus = "keep", relevance_level: int | None = None) -> BeirDataset:
    """Load one split of a BEIR dataset from a local folder, else from the Hugging Face hub; or an ir_datasets
    dataset.

    ``name_or_path`` is a folder, a name found under ``data_dir`` / ``$HIL_DATA_DIR`` (``beir/<name>`` or ``<name>``),
    a hub name (``scifact`` or ``BeIR/scifact``), or ``irds:<id>`` (``irds:beir/scifact/test``: read through
    ir_datasets when it is installed, :mod:`hil.data.irds`; the id names the split). Bad files raise
    :class:`DataFormatError` naming file and line; a missing file or an unreachable dataset raises
    :class:`~hil.errors.MissingInputError` (a ``FileNotFoundError``). ``judged_outside_corpus``,
    ``relevance_level``: see the module docstring (TREC DL, ``msmarco/dl19``: ``"keep"`` and 2); ``None`` (the
    default) is the dataset's own: 1 for a folder or the hub, the official measures' level for ``irds:``.
    ``split``: None (the default) is the dataset's own, :func:`default_split` (``dev`` for MS MARCO, else
    ``test``; an ``irds:`` id names its split).
    """
    check_options(judged_outside_corpus, 1 if relevance_level is None else relevance_level)
    if is_irds_name(name_or_path):
        if split is not None:
            check_split(str(name_or_path), split, default="test")
        data = read_irds(str(name_or_path), judged_outside_corpus)
        return _dataset(data.name, data.corpus, data.queries, data.qrels, data.dataset_id, data.source,
                        data.relevance_level if relevance_level is None else relevance_level)
    relevance_level = 1 if relevance_level is None else relevance_level
    folder, hub_name = dataset_source(name_or_path, data_dir)
    if folder is not None:
        return _load_folder(folder, folder.name, split or default_split(folder), judged_outside_corpus,
                            relevance_level)
    return _load_hub(hub_name, split or default_split(hub_name), judged_outside_corpus, relevance_level)


def dataset_source(name_or_path: str | os.PathLike, data_dir: str | os.PathLike | None = None) -> tuple[Path | None,
                                                                                                       str]:
    """Where :func:`load_beir` reads ``name_or_path`` from, found without reading it: (its local folder, "") or
    (None, its hub name). A path that is not there, or a name that is no BEIR dataset nor local folder but close to
    one (``scifcat``), is a :class:`~hil.errors.MissingInputError` at once -- what a command checks before any
    work. (An ``irds:`` id is not resolved here.)"""
    folder = resolve_dataset(name_or_path, data_dir)
    text = str(name_or_path)
    if folder is None and isinstance(name_or_path, str) and text.lower().startswith("beir/"):
        folder = resolve_dataset(text.split("/", 1)[1], data_dir)
    if folder is not None:
        return folder, ""
    if not isinstance(name_or_path, str) or _looks_like_path(text):
        raise MissingInputError(f"{text}: no such dataset folder")
    name = text.split("/", 1)[1] if text.lower().startswith("beir/") else text
    check_not_misspelled(name, data_dir)
    return None, name


# The BEIR datasets (Thakur et al. 2021, Table 1) by their names on the hub and in the BEIR zips.
BEIR_NAMES = ("msmarco", "trec-covid", "nfcorpus", "bioasq", "nq", "hotpotqa", "fiqa", "signal1m", "trec-news",
              "robust04", "arguana", "webis-touche2020", "cqadupstack", "quora", "dbpedia-entity", "scidocs", "fever",
              "climate-fever", "scifact")


def check_not_misspelled(name: str, data_dir: str | os.PathLike | None = None) -> None:
    """Refuse at once a name that is not a BEIR dataset nor a local folder but close to one (``scifcat``), naming
    the close ones, instead of the hub's retries (half a minute offline) ending in "not found". A name close to
    nothing is still tried on the hub."""
    import difflib

    lowered = name.lower()
    if lowered in BEIR_NAMES or any(lowered.startswith(f"{known}-") for known in BEIR_NAMES):
        return
    root = Path(data_dir or os.environ.get(DATA_DIR_ENV) or ".")
    local = [p.name for folder in (root, root / "beir") if folder.is_dir() for p in folder.iterdir() if p.is_dir()]
    close = difflib.get_close_matches(lowered, list(dict.fromkeys([*BEIR_NAMES, *local])), n=3, cutoff=0.75)
    if close:
        raise MissingInputError(f"dataset {name!r}: not a BEIR dataset nor a folder under ${DATA_DIR_ENV} "
                                f"({root}); did you mean {' or '.join(map(repr, close))}?")
