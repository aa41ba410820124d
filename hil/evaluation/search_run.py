"""``hil search`` over the user's own queries (a queries file or ``--query`` texts), with no judgments: a TREC run,
JSONL hits with the documents' texts, the top hits of each typed query.

Two places to search, both through :func:`hil.evaluation.evaluate.evaluate` (the one way every command ranks; with
no judgments its metrics are left empty and only the run is kept):

- **an index folder** (``--index``) that ``hil index`` (or any evaluation) built: opened as it is, its back-end's own
  structures searched; the model is the one its ``index.json`` records (``settings.backbone``: the source it was
  loaded from) or the one given, and either must have the index's encoder fingerprint, or the search is refused.
- **a model and a dataset**: the dataset loaded and sliced as ``hil index`` / ``hil evaluate`` load it
  (:class:`~hil.evaluation.runner.DatasetRun`), its index under ``settings.index_root`` reused or built, then
  searched with the queries given instead of the dataset's.

The documents' texts (JSONL, printed hits) come from the corpus; for an index folder, from the corpus record
``hil index`` writes beside it (``<index_root>/<dataset>-<fp>/corpus.json``: the dataset, slice and seed), loaded
again and checked against the index's corpus fingerprint.

Every input is read and every output checked by :func:`check_search_outputs` and :func:`read_index_record`
before any model loads (what ``hil.cli.main`` calls while parsing); nothing here imports torch at module level.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hil.errors import MissingInputError, UserError, check_output_path
from hil.evaluation.experiment import DatasetSpec, Experiment, ModelSpec
from hil.evaluation.settings import EvaluationSettings, run_name
from hil.provenance import atomic_output, place_file, write_json_atomic

CORPUS_RECORD = "corpus.json"
INDEX_JSON = "index.json"  # hil.retrieval.index.INDEX_JSON (not imported: that module imports torch)


@dataclass
class QuerySearch:
    """What ``hil search`` ranks when given its own queries, read and checked before any model loads.

    ``experiment``: the model-plus-dataset search (its one model and dataset, settings, seed); None with
    ``index``. ``model``: the model of an index search (the index's own, or the one given; ``model_from_index``:
    the index's). ``printed``: the top ``hits`` of each query are shown (typed queries), with texts where the
    corpus is known; ``jsonl`` always has them."""

    queries: dict[str, str]
    settings: EvaluationSettings
    run_file: Path
    experiment: Experiment | None = None
    index: Path | None = None
    index_meta: dict[str, Any] = field(default_factory=dict)
    model: ModelSpec | None = None
    model_from_index: bool = False
    jsonl: Path | None = None
    overwrite: bool = False
    hits: int = 10
    printed: bool = False
    seed: int = 12345
    data_dir: str | None = None
    quiet: bool = False


@dataclass
class QuerySearchResult:
    """The run (``{qid: {docid: score}}``), its tag, the queries, each document's (title, text) where the corpus
    is known (``texts`` None otherwise), and the search's details as :func:`evaluate` records them."""

    run: dict[str, dict[str, float]]
    tag: str
    queries: dict[str, str]
    texts: Callable[[str], tuple[str, str]] | None
    details: dict[str, Any]


# -- before any model loads -------------------------------------------------------------------------------------

def check_new_file(path: str | os.PathLike, option: str, overwrite: bool) -> Path:
    """``path`` as an output file: writable (:func:`check_output_path`), and absent unless ``overwrite``."""
    path = Path(path)
    check_output_path(path, option, folder=False)
    if path.exists() and not overwrite:
        raise UserError(f"{option} {path}: the file is there; give --overwrite to replace it, or another path")
    return path


def read_index_record(index: str | os.PathLike) -> dict[str, Any]:
    """The ``index.json`` of an index folder, read as JSON (no array opened): a folder that is not a finished index
    is one line naming ``--index``."""
    index = Path(index)
    meta_path = index / INDEX_JSON
    if not meta_path.is_file():
        unfinished = index.with_name(index.name + ".tmp-build")
        hint = (f"; {unfinished} holds an unfinished build (run hil index again to finish it)" if unfinished.exists()
                else "; give the folder hil index printed")
        raise MissingInputError(f"--index {index}: not an index folder (no {INDEX_JSON}){hint}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UserError(f"--index {index}: {INDEX_JSON} unreadable ({error}); rebuild it with hil index") from None
    if not isinstance(meta, dict) or "encoder_fingerprint" not in meta:
        raise UserError(f"--index {index}: {INDEX_JSON} is not a hil index record; rebuild it with hil index")
    return meta


def recorded_model(index: Path, meta: dict[str, Any]) -> ModelSpec:
    """The model an index records (the source its encoder was loaded from), to load when none is given."""
    source = meta.get("settings", {}).get("backbone")
    if not isinstance(source, str) or not source:
        raise UserError(f"--index {index}: its record names no single model to load; give --model")
    return ModelSpec(source=source)


def settings_for_index(settings: EvaluationSettings, index: Path, meta: dict[str, Any]) -> EvaluationSettings:
    """``settings`` for searching the index folder ``index``: its back-end is the one it was built with (a
    search-time setting of another back-end, or another back-end asked for, refused in one line), and re-ranking,
    which needs a first stage over the corpus's texts, refused."""
    record = meta.get("backend") or meta.get("faiss") or {}
    kind = record.get("kind", "flat")
    if settings.backend.kind != kind and settings.backend != EvaluationSettings().backend:
        raise UserError(f"--settings.backend {settings.backend.kind}: the index at {index} was built as {kind} (a "
                        "back-end's build-time settings are the index's own); leave it out")
    if settings.mode == "rerank":
        raise UserError(f"--settings.mode rerank re-ranks a first stage over a corpus's texts; with --index {index} "
                        "give full or exhaustive, or search with --model and --dataset")
    if settings.search is not None and getattr(settings.search, "kind", kind) != kind:
        raise UserError(f"--settings.search: settings of the {settings.search.kind} back-end; the index at {index} "
                        f"is {kind}")
    return replace(settings, backend=kind)


def corpus_record_path(index: Path) -> Path:
    """Where the corpus record of the index folder ``index`` lives: beside it, in its dataset slice's folder."""
    return index.parent / CORPUS_RECORD


# -- the corpus record ------------------------------------------------------------------------------------------

def write_corpus_record(index: Path, experiment: Experiment, spec: DatasetSpec, fingerprint: str) -> None:
    """Record beside the index folder ``index`` which dataset slice its corpus is (so that a search of the folder
    alone can show the documents' texts): the dataset spec with a local folder made absolute, the seed and data
    folder the slice was drawn with, and the fingerprint the index was built for. Kept when already there."""
    path = corpus_record_path(index)
    try:
        if json.loads(path.read_text(encoding="utf-8")).get("fingerprint") == fingerprint:
            return
    except (OSError, ValueError, AttributeError):
        pass  # absent or unreadable: written below
    entry = asdict(spec)
    if Path(spec.name).exists():
        entry["name"] = str(Path(spec.name).resolve())
    write_json_atomic(path, {"dataset": entry, "seed": experiment.seed, "data_dir": experiment.data_dir,
                             "fingerprint": fingerprint})


def recorded_corpus(request: QuerySearch) -> Callable[[str], tuple[str, str]] | None:
    """Each document's (title, text) of an index folder's corpus, from its corpus record; None when there is no
    record and only printed hits want them (the JSONL's texts are refused in one line instead); refused when the
    dataset no longer gives the corpus the index was built from."""
    from hil.evaluation.runner import DatasetRun

    index, path = request.index, corpus_record_path(request.index)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        spec = DatasetSpec(**record["dataset"])
    except (OSError, ValueError, KeyError, TypeError):
        if request.jsonl is None:
            return None
        raise UserError(f"--jsonl {request.jsonl}: --index {index} has no record of its corpus ({path}; hil index "
                        "writes it), so no document texts; search with --model and --dataset, or leave out "
                        "--jsonl") from None
    experiment = Experiment(datasets=[spec], models=[], output=str(index.parent), seed=record.get("seed", 12345),
                            data_dir=record.get("data_dir"), quiet=True,
                            settings=replace(request.settings, index_root=None, mode="exhaustive"))
    dataset = DatasetRun(experiment, spec).dataset
    if dataset.fingerprint() != request.index_meta.get("corpus_fingerprint"):
        raise UserError(f"--index {index}: {spec.name} no longer gives the corpus the index was built from (its "
                        "fingerprint differs); rebuild the index with hil index")
    return lambda doc_id: (dataset.corpus[doc_id].get("title", ""), dataset.corpus[doc_id].get("text", ""))


# -- the search -------------------------------------------------------------------------------------------------

def run_query_search(request: QuerySearch) -> QuerySearchResult:
    """Rank ``request.queries`` (see the module docstring); -> the run and what shows its hits."""
    if request.index is not None:
        return _search_index(request)
    return _search_dataset(request)


def _search_index(request: QuerySearch) -> QuerySearchResult:
    from hil.data.beir import BeirDataset
    from hil.evaluation.evaluate import evaluate
    from hil.evaluation.runner import load_model
    from hil.retrieval.index import IndexMismatchError, TokenIndex, encoder_fingerprint

    # the texts first: a corpus that cannot give them is refused before the model loads
    texts = recorded_corpus(request) if request.printed or request.jsonl is not None else None
    model, index = request.model, request.index
    try:
        encoder = load_model(model, request.seed)
    except UserError as error:
        if not request.model_from_index:
            raise
        raise UserError(f"--index {index}: the model its record names cannot be loaded here ({error}); give "
                        "--model") from None
    fingerprint = encoder_fingerprint(encoder)
    try:
        store = TokenIndex.load(index, expect_encoder_fingerprint=fingerprint, verify=request.settings.verify_index)
    except IndexMismatchError:
        raise UserError(f"--index {index}: built with another model (encoder fingerprint "
                        f"{request.index_meta['encoder_fingerprint']}) than {model.source} ({fingerprint}); give "
                        "the model it was built with as --model") from None
    store.how_opened = "opened"
    queries_only = BeirDataset(name=index.parent.name, corpus={}, queries=request.queries, qrels={}, split="",
                               source=str(index))
    evaluation = evaluate(encoder, queries_only, request.settings, store=store, name=model.column)
    return QuerySearchResult(evaluation.run, run_name(model.column), request.queries, texts, evaluation.details)


def _search_dataset(request: QuerySearch) -> QuerySearchResult:
    from hil.data.bm25 import bm25_run
    from hil.evaluation.evaluate import document_store, evaluate, place_encoder
    from hil.evaluation.runner import DatasetRun, load_model, set_corpus_idf
    from hil.evaluation.runs import candidates_from_run
    from hil.retrieval.index import TokenIndex

    experiment = request.experiment
    model, spec = experiment.models[0], experiment.datasets[0]
    part = DatasetRun(experiment, spec)  # loaded and sliced as hil index and hil evaluate do: their index
    encoder = load_model(model, experiment.seed)
    if model.idf == "corpus":
        set_corpus_idf(encoder, part.dataset, model.source)
    settings = request.settings
    place_encoder(encoder, settings)
    store = None
    if settings.mode != "rerank" or settings.index_root is not None:
        store = document_store(encoder, part.dataset, settings)  # keyed by the dataset's own fingerprint
        if isinstance(store, TokenIndex):
            write_corpus_record(store.directory, experiment, spec, part.dataset.fingerprint())
    asked = replace(part.dataset, queries=request.queries, qrels={})  # the corpus, searched with these queries
    candidates = None
    if settings.mode == "rerank":  # BM25's top rerank_depth of each query, as hil evaluate re-ranks
        candidates = candidates_from_run(bm25_run(asked, k=settings.rerank_depth, skip_self=settings.drop_self_matches),
                                         settings.rerank_depth)
    evaluation = evaluate(encoder, asked, settings, store=store, candidates=candidates, name=model.column)
    corpus = part.dataset.corpus
    return QuerySearchResult(evaluation.run, run_name(model.column), request.queries,
                             lambda doc_id: (corpus[doc_id].get("title", ""), corpus[doc_id].get("text", "")),
                             evaluation.details)


# -- what is written and shown ----------------------------------------------------------------------------------

def ranked_hits(result: QuerySearchResult, qid: str, n: int) -> list[tuple[int, str, float]]:
    """A query's top ``n`` as (rank, doc id, score), in the run file's order (trec_eval's: score, then id)."""
    from hil.evaluation.runs import ranked

    return [(rank, doc_id, score) for rank, (doc_id, score) in enumerate(ranked(result.run.get(qid, {}), n), 1)]


def hit_lines(result: QuerySearchResult, qid: str, n: int, width: int = 100) -> list[str]:
    """A query's top ``n`` as lines to print: rank, score, doc id and the first ``width`` characters of its text."""
    lines = [f"{qid}: {result.queries[qid]}"]
    for rank, doc_id, score in ranked_hits(result, qid, n):
        snippet = ""
        if result.texts is not None:
            title, text = result.texts(doc_id)
            joined = " ".join(f"{title} {text}".split())
            snippet = "  " + (joined if len(joined) <= width else joined[:width - 3] + "...")
        lines.append(f"{rank:>4}  {score:10.4f}  {doc_id}{snippet}")
    return lines


def write_outputs(result: QuerySearchResult, request: QuerySearch) -> None:
    """The TREC run (every query, ``settings.k`` deep), and the JSONL hits when asked (each query's top ``hits``
    with the documents' titles and texts): each written beside its place, then put there -- without
    ``overwrite`` only where nothing is (a file another process wrote meanwhile is refused, not replaced)."""
    from hil.evaluation.runs import write_trec_run

    staged = []
    try:
        staged.append((staging(request.run_file), request.run_file, "--output"))
        write_trec_run(staged[-1][0], result.run, tag=result.tag)
        if request.jsonl is not None:
            staged.append((staging(request.jsonl), request.jsonl, "--jsonl"))
            with atomic_output(staged[-1][0]) as tmp, open(tmp, "w", encoding="utf-8") as handle:
                for qid in result.queries:
                    for rank, doc_id, score in ranked_hits(result, qid, request.hits):
                        title, text = result.texts(doc_id)
                        handle.write(json.dumps({"query_id": qid, "query": result.queries[qid], "rank": rank,
                                                 "doc_id": doc_id, "score": score, "title": title, "text": text},
                                                ensure_ascii=False) + "\n")
        for source, target, option in staged:
            publish(source, target, option, request.overwrite)
    finally:
        for source, _, _ in staged:
            source.unlink(missing_ok=True)


def staging(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.staged")


def publish(source: Path, target: Path, option: str, overwrite: bool) -> None:
    """``source`` becomes ``target`` atomically (:func:`hil.provenance.place_file`); without ``overwrite`` only where
    no file is."""
    try:
        place_file(source, target, overwrite=overwrite)
    except FileExistsError:
        raise UserError(f"{option} {target}: written by another process while this search ran; give "
                        "--overwrite to replace it") from None
