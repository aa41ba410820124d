"""The named settings of the teacher tool (``hil teacher``), without the models and files behind them, so that its
``--help`` needs nothing more: the kinds of teacher (:mod:`hil.experiments.teacher_models`) and the formats of the
examples file (:mod:`hil.experiments.teacher`), the files it writes (checked before any work), and
:class:`TeacherSettings`, what the command parses (each field an option of that name)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from hil.errors import UserError

KINDS = ("auto", "colbert", "cross-encoder", "dense")
FORMATS = ("colbert", "pylate", "trec")
TeacherKind = Literal["auto", "colbert", "cross-encoder", "dense"]  # KINDS, spelled out for the type checkers
ExamplesFormat = Literal["colbert", "pylate", "trec"]  # FORMATS
POSITIVE_SETTINGS = ("depth", "batch_size", "max_queries", "max_length", "relevance_level")


@dataclass
class TeacherSettings:
    """The settings of hil teacher, each field the option of its name.

    What :func:`hil.experiments.teacher.run` makes and from what. A setting that cannot work is refused at
    construction, naming its key in backquotes (``nway``), which the command shows as its option (``--nway``).

    Args:
        teacher: a model hil loads, or a Hugging Face model (a cross-encoder, a dense encoder)
        output: the examples file to write (refused when it or a file written beside it exists)
        queries: qid TAB text (a path, or relative to HIL_DATA_DIR)
        collection: pid TAB text (with queries)
        dataset: a BEIR dataset name or folder instead of queries / collection
        split: the BEIR split whose judged queries are used
        data_dir: overrides HIL_DATA_DIR
        qrels: judgments for positives first (BEIR TSV or TREC qrels; with queries)
        positives: first: each query's judged positive leads its line (none: the teacher ranks)
        relevance_level: the least grade that is a positive
        miner: bm25, or a model hil loads
        index_root: a model miner searches an index built here (default: exact, in memory)
        depth: candidates mined per query
        nway: documents written per query
        teacher_kind: what the teacher is (auto: read from the model's files)
        batch_size: pairs (or texts) per teacher forward pass
        max_length: tokens per pair or text (Hugging Face teachers; default: the model's sentence_bert_config.json
            max_seq_length, else 512)
        max_queries: only the first N queries
        format: the examples file's format: colbert (ColBERTv2's), pylate, trec (a run)
        overwrite: replace an earlier output (the examples, their .meta.json and texts)
        device: auto, cpu, cuda, cuda:N
        quiet: no progress bars
    """

    teacher: str
    output: str
    queries: Optional[str] = None
    collection: Optional[str] = None
    dataset: Optional[str] = None
    split: str = "train"
    data_dir: Optional[str] = None
    qrels: Optional[str] = None
    positives: Literal["none", "first"] = "none"
    relevance_level: int = 1
    miner: str = "bm25"
    index_root: Optional[str] = None
    depth: int = 100
    nway: int = 32
    teacher_kind: TeacherKind = "auto"
    batch_size: int = 32
    max_length: Optional[int] = None
    max_queries: Optional[int] = None
    format: ExamplesFormat = "colbert"
    overwrite: bool = False
    device: str = "auto"
    quiet: bool = False

    def __post_init__(self) -> None:
        """Refuse settings that cannot work, before anything is loaded (the device is resolved by the run)."""
        for key in POSITIVE_SETTINGS:
            value = getattr(self, key)
            if value is not None and value < 1:
                raise UserError(f"`{key}` must be >= 1 (got {value})")
        if self.nway < 2:
            raise UserError(f"`nway` must be >= 2 (got {self.nway})")
        if self.nway > self.depth + (self.positives == "first"):
            raise UserError(f"`nway` {self.nway} is more than the `depth` {self.depth} candidates mined")
        if (self.dataset is None) == (self.queries is None):
            raise UserError("give `dataset`, or `queries` with `collection`")
        if self.queries is not None and self.collection is None:
            raise UserError("`queries` needs `collection`")
        if self.dataset is not None and (self.collection or self.qrels):
            raise UserError("`dataset` brings its corpus and qrels: `collection` and `qrels` go with `queries`")
        if self.positives == "first" and self.dataset is None and self.qrels is None:
            raise UserError("`positives` first needs judgments: `qrels` (or a `dataset`'s)")


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
