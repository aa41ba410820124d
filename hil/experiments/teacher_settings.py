"""The named settings of the teacher tool (``hil teacher``), without the models and files behind them, so that its
``--help`` needs nothing more: the kinds of teacher (:mod:`hil.experiments.teacher_models`) and the formats of the
examples file (:mod:`hil.experiments.teacher`), and the files it writes (checked before any work)."""

from __future__ import annotations

from pathlib import Path

KINDS = ("auto", "colbert", "cross-encoder", "dense")
FORMATS = ("colbert", "pylate", "trec")


def output_files(output: str | Path, beir: bool) -> dict[str, Path]:
    """What ``hil teacher --output <output>`` writes: the examples, with a BEIR dataset the texts of the ids written
    beside them, and the ``.meta.json`` record."""
    output = Path(output)
    files = {"examples": output}
    if beir:
        files["queries"] = output.with_name(f"{output.stem}.queries.tsv")
        files["collection"] = output.with_name(f"{output.stem}.collection.tsv")
    files["meta"] = output.with_name(f"{output.name}.meta.json")
    return files
