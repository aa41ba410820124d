"""One call that opens any n-way / distillation source by its format's key: :func:`open_example_source`.

Each format is an :class:`~hil.data.examples.ExampleReader` registered where its reader lives
(:func:`~hil.data.examples.example_reader`): ``nway_examples`` (:class:`~hil.data.nway_files.NWayFile`,
ColBERTv2), ``run`` (:class:`~hil.data.run_examples.RunExamples`, a TREC run with teacher scores, Lightning IR's
``RunDataset``) and ``pylate`` (:func:`~hil.data.pylate_files.open_pylate`, PyLate's layout); each opens an
:class:`~hil.data.examples.ExampleSource` that :class:`~hil.data.datamodule.EpochShuffleSampler` shards and
resumes. This module only dispatches by key: a new format adds nothing here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# The built-in formats register themselves when their modules are imported.
import hil.data.nway_files  # noqa: F401
import hil.data.pylate_files  # noqa: F401
import hil.data.run_examples  # noqa: F401
from hil.data.examples import EXAMPLE_READERS, ExampleSource
from hil.errors import MissingInputError, UserError
from hil.paths import resolve_data_file


def _file(name: str, value: str | os.PathLike, data_dir: str | os.PathLike | None) -> Path:
    try:
        return resolve_data_file(value, data_dir)
    except FileNotFoundError as error:
        raise MissingInputError(f"{name}: {error}") from None


def open_example_source(kind: str, source: str | os.PathLike, *, queries: str | os.PathLike | None = None,
                        collection: str | os.PathLike | None = None, nway: int | None = None,
                        limit: int | None = None, check: bool = True, cache_dir: str | os.PathLike | None = None,
                        data_dir: str | os.PathLike | None = None, seed: int = 0,
                        **settings: Any) -> ExampleSource:
    """The examples of ``source`` in the format registered as ``kind``, with their texts.

    Args:
        kind: the format's key (``nway_examples``, ``run``, ``pylate``: :data:`~hil.data.examples.EXAMPLE_READERS`).
        source: its file, or a path relative to ``data_dir``.
        queries, collection: the query and document texts (``id TAB text`` files; for ``pylate`` also its tables in
            JSON lines or Parquet). Both required.
        nway: documents per example: the first ``nway`` of each line (None: all, the same on every line); a format
            that chooses them (``run``) requires it.
        limit: the first ``limit`` examples only.
        check: check every line when opening.
        cache_dir: where line offsets, checking records and conversions go.
        data_dir: where relative paths are also looked for (default ``$HIL_DATA_DIR``).
        seed: the data's seed, for a format that samples (``run``'s random selection).
        settings: the settings of one format (``run``: ``qrels``, ``depth``, ``selection``, ...): one set to
            anything but its default is refused by the other formats, naming it.

    A wrong combination of settings is a :class:`UserError` naming them; bad data a
    :class:`~hil.errors.DataFormatError` naming file and line.
    """
    reader = EXAMPLE_READERS.get(kind)
    if reader is None:
        raise UserError(f"no example reader for {kind!r} (readers: {', '.join(sorted(EXAMPLE_READERS))})")
    for name, value in (("queries", queries), ("collection", collection)):
        if value is None:
            raise UserError(f"{kind} needs {name} (the texts by id)")
    owners = {name: other for other in EXAMPLE_READERS.values() for name in other.settings}
    unknown = sorted(name for name in settings if name not in owners)
    if unknown:
        raise TypeError(f"open_example_source: no example reader takes {', '.join(unknown)}")
    foreign = [name for name, value in settings.items()
               if name not in reader.settings and value != owners[name].settings[name]]
    if foreign:
        raise UserError(f"{', '.join(foreign)} only apply to {' / '.join(sorted({owners[n].key for n in foreign}))}, "
                        f"not to {kind}")
    taken = {name: settings.get(name, default) for name, default in reader.settings.items()}
    for name in reader.files:
        if taken[name] is not None:
            taken[name] = _file(name, taken[name], data_dir)
    return reader.open(_file(kind, source, data_dir), _file("queries", queries, data_dir),
                       _file("collection", collection, data_dir), nway=nway, limit=limit, check=check,
                       cache_dir=cache_dir, seed=seed, **taken)
