"""One call that opens any n-way / distillation source by the settings a data module holds:
:func:`open_example_source`. The readers are :class:`~hil.data.nway_files.NWayFile` (ColBERTv2),
:class:`~hil.data.run_examples.RunExamples` (a TREC run with teacher scores, Lightning IR's ``RunDataset``) and
:func:`~hil.data.pylate_files.open_pylate` (PyLate's layout); each is an
:class:`~hil.data.examples.ExampleSource` that :class:`~hil.data.datamodule.EpochShuffleSampler` shards and resumes.
"""

from __future__ import annotations

import os
from pathlib import Path

from hil.errors import MissingInputError, UserError
from hil.data.examples import ExampleSource
from hil.data.nway_files import NWayFile
from hil.data.pylate_files import open_pylate
from hil.data.run_examples import RunExamples, RunSettings
from hil.paths import resolve_data_file

KINDS = ("nway_examples", "run", "pylate")


def _file(name: str, value: str | os.PathLike, data_dir: str | os.PathLike | None) -> Path:
    try:
        return resolve_data_file(value, data_dir)
    except FileNotFoundError as error:
        raise MissingInputError(f"{name}: {error}") from None


def open_example_source(*, nway_examples: str | os.PathLike | None = None, run: str | os.PathLike | None = None,
                        pylate: str | os.PathLike | None = None, queries: str | os.PathLike | None = None,
                        collection: str | os.PathLike | None = None, nway: int | None = None,
                        qrels: str | os.PathLike | None = None, depth: int | None = None, selection: str = "top",
                        positives: str = "none", targets: str = "scores", relevance_level: int = 1, seed: int = 0,
                        short_queries: str = "error", limit: int | None = None, check: bool = True,
                        cache_dir: str | os.PathLike | None = None,
                        data_dir: str | os.PathLike | None = None) -> ExampleSource:
    """The examples of exactly one of ``nway_examples``, ``run`` or ``pylate``, with their texts.

    Args:
        nway_examples: ColBERTv2 JSON lines (``[qid, [pid, score], ...]`` or ``[qid, pid, ...]``).
        run: a TREC run whose scores are a teacher's (one example a query).
        pylate: PyLate's examples (``query_id``, ``document_ids``, ``scores``), JSON lines or Parquet.
        queries, collection: the query and document texts: ``id TAB text`` files (for ``pylate`` also its
            ``query_id``/``document_id`` + ``text`` tables in JSON lines or Parquet). Both required.
        nway: documents per example: the first ``nway`` of each line (None: all, the same on every line); for
            ``run``, required: how many are chosen per query.
        qrels, depth, selection, positives, targets, relevance_level, seed, short_queries: ``run`` only; see
            :class:`~hil.data.run_examples.RunSettings`.
        limit: the first ``limit`` examples only.
        check: check every line when opening (``nway_examples``/``pylate``; a run is always checked).
        cache_dir: where line offsets, checking records and conversions go.
        data_dir: where relative paths are also looked for (default ``$HIL_DATA_DIR``).

    Every path is a file or relative to ``data_dir``. A wrong combination of settings is a :class:`UserError`
    naming them; bad data a :class:`~hil.errors.DataFormatError` naming file and line.
    """
    given = {name: value for name, value in zip(KINDS, (nway_examples, run, pylate)) if value is not None}
    if len(given) != 1:
        raise UserError(f"give exactly one of {', '.join(KINDS)} (got {', '.join(given) or 'none'})")
    (kind, source), = given.items()
    for name, value in (("queries", queries), ("collection", collection)):
        if value is None:
            raise UserError(f"{kind} needs {name} (the texts by id)")
    run_only = {"qrels": qrels is not None, "depth": depth is not None, "selection": selection != "top",
                "positives": positives != "none", "targets": targets != "scores",
                "relevance_level": relevance_level != 1, "short_queries": short_queries != "error"}
    if kind != "run" and any(run_only.values()):
        raise UserError(f"{', '.join(name for name, set_ in run_only.items() if set_)} only apply to a run, not "
                        f"to {kind}")
    source_path = _file(kind, source, data_dir)
    query_path, collection_path = _file("queries", queries, data_dir), _file("collection", collection, data_dir)
    if kind == "nway_examples":
        return NWayFile(source_path, query_path, collection_path, nway, limit, check, cache_dir)
    if kind == "pylate":
        return open_pylate(source_path, query_path, collection_path, nway, limit, check, cache_dir)
    if nway is None:
        raise UserError("run needs nway (the documents chosen per query)")
    settings = RunSettings(nway, depth, selection, positives, targets, relevance_level, seed, short_queries)
    qrels_path = _file("qrels", qrels, data_dir) if qrels is not None else None
    return RunExamples(source_path, query_path, collection_path, settings, qrels_path, limit, cache_dir)
