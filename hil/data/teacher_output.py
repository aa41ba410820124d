"""What ``hil teacher`` wrote, as training data: the reader :class:`TeacherOutput`, given the examples file alone.

The teacher (:mod:`hil.experiments.teacher`) writes its examples and ``<examples>.meta.json``, which records the
format (``colbert``: ColBERTv2's n-way lines; ``pylate``: PyLate's; ``trec``: a run of teacher scores), the number of
documents per query (``nway``) and where the texts are: the ``.queries.tsv`` / ``.collection.tsv`` it wrote beside
the examples (a BEIR dataset), or the queries and collection it read. :meth:`TeacherOutput.resolve` turns that
record into the reader of that format with its files, so that nothing it already knows is given twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from hil.data.examples import ExampleReader, ExampleSource, ReadSettings
from hil.data.nway_files import NWayExamples
from hil.data.pylate_files import PyLateExamples
from hil.data.run_examples import TrecRun
from hil.errors import MissingInputError, UserError

# the teacher's --format -> the reader of that layout
FORMAT_READERS: dict[str, type[NWayExamples | PyLateExamples | TrecRun]] = {
    "colbert": NWayExamples, "pylate": PyLateExamples, "trec": TrecRun}


@dataclass(frozen=True)
class TeacherOutput(ExampleReader):
    """The examples ``hil teacher`` wrote, given alone: the layout, the texts and ``nway`` are read from its
    ``.meta.json`` (``data.nway`` may lower ``nway``); paths of files written beside the examples are taken beside
    them, wherever the teacher ran.

    Args:
        path: the examples file ``hil teacher --output`` wrote (a path, or relative to ``HIL_DATA_DIR``).
    """

    path: str

    def resolve(self, read: ReadSettings) -> tuple[ExampleReader, ReadSettings]:
        """The reader of the recorded format with the recorded texts, and ``read`` with the recorded ``nway``
        (a lower ``data.nway`` kept, a higher one refused)."""
        path = read.file("TeacherOutput.path", self.path)
        meta_path = path.with_name(f"{path.name}.meta.json")
        if not meta_path.is_file():
            raise UserError(f"TeacherOutput.path: {meta_path} not found: not written by `hil teacher` (give its "
                            f"format's reader, NWayExamples, TrecRun or PyLateExamples, with queries and collection)")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            settings, files, inputs = meta["settings"], meta.get("files", {}), meta.get("inputs", {})
            reader = FORMAT_READERS[settings["format"]]
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
                raise MissingInputError(f"TeacherOutput.path: {texts[name]} ({name}, from {meta_path}) not found")
        if read.nway is not None and read.nway > nway:
            raise UserError(f"data.nway {read.nway} is more than the {nway} documents per query `hil teacher` wrote "
                            f"({self.path})")
        resolved = reader(str(path), texts["queries"], texts["collection"])
        return resolved.resolve(replace(read, nway=read.nway if read.nway is not None else nway))

    def open(self, read: ReadSettings) -> ExampleSource:
        reader, settings = self.resolve(read)
        return reader.open(settings)

    def prepare(self, read: ReadSettings) -> None:
        reader, settings = self.resolve(read)
        reader.prepare(settings)
