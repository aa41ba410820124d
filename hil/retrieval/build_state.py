"""The stages an unfinished index build has finished, so that a build killed at any point resumes where it was.

An index is assembled in ``<dir>.tmp-build`` (:mod:`hil.retrieval.builder`). Besides the chunks, which say for
themselves whether they are finished (:mod:`hil.retrieval.chunks`), a build has stages whose results are files of
the folder: the compressed build's sample and centroids (:mod:`hil.retrieval.compressed_build`), the joined arrays,
the inverted file. :class:`BuildState` is ``.build-state.json`` in that folder: the build's identity (everything
that determines its files: encoder and corpus fingerprints, settings, back-end settings, chunking) and, per finished
stage, what it recorded. It is written after a stage's files, so a stage it names is complete; the name starts with
a dot, so :func:`hil.retrieval.integrity.record_files` never counts it among the index's files, and it is removed
just before the folder is renamed into place.

A rerun whose identity is the recorded one keeps the folder and skips the stages named; any other rerun (other
settings, no state: an earlier version's leftovers) clears the folder but for its finished chunks, which are reused
only when their own metadata matches.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from hil.provenance import write_json_atomic
from hil.retrieval.index import json_normalized

STATE_FILE = ".build-state.json"
CHUNKS_DIR = "chunks"


class BuildState:
    """``.build-state.json`` of an unfinished build folder (module docstring)."""

    def __init__(self, folder: Path, identity: dict[str, Any]):
        self.folder = Path(folder)
        self.identity = json_normalized(identity)
        self.stages: dict[str, dict[str, Any]] = {}

    @property
    def path(self) -> Path:
        return self.folder / STATE_FILE

    def start(self) -> bool:
        """Open the folder for this build: resume it when its state has this identity (-> True), else clear it but
        for ``chunks/`` and start a new state (-> False). Creates ``chunks/``."""
        (self.folder / CHUNKS_DIR).mkdir(parents=True, exist_ok=True)
        recorded = self._read()
        if recorded is not None and recorded.get("identity") == self.identity:
            self.stages = dict(recorded.get("stages") or {})
            return True
        for leftover in self.folder.iterdir():
            if leftover.name != CHUNKS_DIR:
                shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        self.stages = {}
        self._write()
        return False

    def done(self, stage: str) -> dict[str, Any] | None:
        """What finished ``stage`` recorded, or None when it has not finished."""
        return self.stages.get(stage)

    def mark(self, stage: str, **record: Any) -> dict[str, Any]:
        """Record ``stage`` as finished (its files are in place), with ``record``; -> the record."""
        self.stages[stage] = json_normalized(record)
        self._write()
        return self.stages[stage]

    def remove(self) -> None:
        """The build is sealed: nothing is resumed from here on (the folder is renamed next)."""
        self.path.unlink(missing_ok=True)

    def _read(self) -> dict[str, Any] | None:
        try:
            value = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        return value if isinstance(value, dict) else None

    def _write(self) -> None:
        write_json_atomic(self.path, {"identity": self.identity, "stages": self.stages})
