"""What ``hil teacher`` wrote, as training data: ``data.teacher_output: <examples file>`` alone.

The teacher (:mod:`hil.experiments.teacher`) writes its examples and ``<examples>.meta.json``, which records the
format (``colbert``: ColBERTv2's n-way lines; ``pylate``: PyLate's; ``trec``: a run of teacher scores), the number of
documents per query (``nway``) and where the texts are: the ``.queries.tsv`` / ``.collection.tsv`` it wrote beside
the examples (a BEIR dataset), or the queries and collection it read. :func:`teacher_output_source` turns that
record into the data module's own keys, so that nothing it already knows is given twice.
"""

from __future__ import annotations

import json
from pathlib import Path

from hil.errors import MissingInputError, UserError
from hil.paths import resolve_data_file

# the teacher's --format -> the data module's key for that layout
FORMAT_SOURCES = {"colbert": "nway_examples", "pylate": "pylate", "trec": "run"}


def teacher_output_source(examples: str | Path, data_dir: str | None = None) -> dict[str, str | int]:
    """``{<source key>: examples, "queries": ..., "collection": ..., "nway": ...}`` read from ``examples``'s
    ``.meta.json`` (paths of files written beside the examples are taken beside them, wherever the teacher ran)."""
    try:
        path = resolve_data_file(str(examples), data_dir)
    except FileNotFoundError as error:
        raise MissingInputError(f"data.teacher_output: {error}") from None
    meta_path = path.with_name(f"{path.name}.meta.json")
    if not meta_path.is_file():
        raise UserError(f"data.teacher_output: {meta_path} not found: not written by `hil teacher` (give "
                        "nway_examples, run or pylate with queries and collection instead)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        settings, files, inputs = meta["settings"], meta.get("files", {}), meta.get("inputs", {})
        source = FORMAT_SOURCES[settings["format"]]
        nway = int(settings["nway"])
    except (ValueError, KeyError, TypeError) as error:
        raise UserError(f"{meta_path}: not a `hil teacher` record ({type(error).__name__}: {error})") from None
    texts = {}
    for name in ("queries", "collection"):
        if name in files:  # written beside the examples
            texts[name] = str(path.with_name(Path(files[name]).name))
        elif name in inputs:  # read by the teacher
            texts[name] = str(inputs[name])
        else:
            raise UserError(f"{meta_path}: records no {name} file")
        if not Path(texts[name]).is_file():
            raise MissingInputError(f"data.teacher_output: {texts[name]} ({name}, from {meta_path}) not found")
    return {source: str(path), **texts, "nway": nway}
