"""What an experiment is: datasets x models under one set of evaluation settings (:mod:`hil.evaluation.runner`
runs it).

Each entry point (``evaluate.py`` / ``hil evaluate``, ``hil beir``) describes its experiment with these classes; they
are plain typed settings, selectable from YAML like the rest of the configuration.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from hil.data.beir import dataset_source, forum_folders
from hil.data.irds import is_irds_name
from hil.errors import UserError, check_output_path
from hil.evaluation.metrics import canonical_metrics
from hil.evaluation.settings import EvaluationSettings, run_name
from hil.evaluation.statistics import P_ADJUST_METHODS

BASELINE = "bm25"  # the baseline column's name, whether BM25 or a dataset's first-stage run
EXPORT_FOLDER_NAMES = ("export",)  # train.py --export_dir folders: a column is named after their parent


# -- what an experiment is --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSpec:
    """One model: where it comes from, what its column is called, and how it is evaluated.

    Args:
        source: an export folder, a ``.ckpt``, a Stanford / PyLate checkpoint, a backbone (untrained head), a hub id,
            or ``"iso+aniso"`` (ColBERT-lambda); :func:`hil.modeling.loading.load_encoder`.
        name: the column (default: the folder or checkpoint name, :func:`column_name`); ``{architecture}`` and
            ``{mode}`` are filled in once the model is loaded (``evaluate.py`` names it ``{architecture}-{mode}``).
        transforms: post-hoc transforms, each its own column (``"whitening"``, ``"whitening:k=64"``, ...), named by
            ``transform_name`` (``{column}``, ``{architecture}``, ``{mode}``, ``{transform}``, ``{transform_mode}``).
        transform_mode, transform_max_tokens: how the transforms are fitted (token-wise or sequence-wise, sample).
        idf: ColBERT-HIL's query-term IDF: ``model`` (stored with it) or ``corpus`` (recomputed on each dataset:
            its documents, or its queries for the authors' formula).
        dim, query_maxlen, doc_maxlen: an untrained head's settings (a trained model keeps its own; a different
            value is refused, never ignored).
        seed: the seed the model was trained with. Part of its column's identity (two seeds never share a column,
            and a rerun keeps each seed's column); ``{seed}`` in ``name`` is filled with it.
        method: what the model is an instance of (default: its column): columns of one method under several seeds
            are summarized over seeds (mean, standard deviation, range) and compared with the other methods'
            (:mod:`hil.evaluation.seeds`, ``seeds`` in ``metrics.json``'s statistics).
    """

    source: str
    name: str | None = None
    transforms: tuple[str, ...] = ()
    transform_name: str = "{column}+{transform}-{transform_mode}"
    transform_mode: str = "token"
    transform_max_tokens: int = 200_000
    idf: str = "model"
    dim: int | None = None
    query_maxlen: int | None = None
    doc_maxlen: int | None = None
    seed: int | None = None
    method: str | None = None

    def __post_init__(self) -> None:
        if self.seed is None and "{seed}" in (self.name or ""):
            raise UserError(f"model {self.source!r}: name {self.name!r} has {{seed}} but no seed is given")
        if self.idf not in ("model", "corpus"):
            raise UserError(f"idf must be 'model' or 'corpus' (got {self.idf!r})")
        if self.transform_mode not in ("token", "sequence"):
            raise UserError(f"transform_mode must be 'token' or 'sequence' (got {self.transform_mode!r})")
        for key in ("dim", "query_maxlen", "doc_maxlen", "transform_max_tokens"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise UserError(f"{key} must be >= 1 (got {value})")

    @property
    def column(self) -> str:
        """The column before the model is loaded (``{seed}`` filled, other placeholders not): what duplicate names
        are checked on."""
        name = self.name or column_name(self.source)
        return name.replace("{seed}", str(self.seed)) if self.seed is not None else name

    def column_for(self, architecture: str, mode: str) -> str:
        """The column of this model once loaded (``architecture``: its encoder's) in evaluation ``mode``."""
        return run_name(self.column.format(architecture=architecture, mode=mode))

    @property
    def method_name(self) -> str:
        """The method this model's column belongs to in seed statistics (``method``, else its column)."""
        return self.method or self.column

    def transform_column(self, architecture: str, mode: str, transform: str) -> str:
        return run_name(self.transform_name.format(column=self.column_for(architecture, mode), mode=mode,
                                                   architecture=architecture, transform=transform,
                                                   transform_mode=self.transform_mode))

    def overrides(self) -> dict[str, int]:
        """The loader options the user gave (only those: a default is never sent as a request)."""
        return {key: value for key in ("dim", "query_maxlen", "doc_maxlen")
                if (value := getattr(self, key)) is not None}


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset: a BEIR name or folder, ``irds:<id>``, with its split, an optional first-stage run, a slice.

    A folder of several BEIR folders (BEIR's ``cqadupstack``, a folder per forum) is evaluated as BEIR reports it:
    each part on its own (:meth:`forums`, into ``<key>/<forum>/``), and the mean over the parts
    (:func:`hil.evaluation.results.forum_mean`, the rule ``hil beir`` uses) written into ``<key>/``.

    Args:
        name: what :func:`hil.data.beir.load_beir` loads.
        split: the qrels split (None: the dataset's own, :func:`hil.data.beir.default_split`: ``dev`` for MS
            MARCO, as BEIR reports it, else ``test``).
        first_stage_run: a TREC run file whose documents are re-ranked (TREC DL's ``bm25-top100.trec``); scored as
            given, it is the baseline column.
        rerank_depth: candidates per query taken from the baseline (default: 100 of BM25's, all of a run file's).
        relevance_level: the lowest grade binary metrics count (None: the dataset's own, 1 for BEIR).
        max_queries, max_docs: a seeded slice (judged documents kept).
        first_stage_name: the baseline column's name with a run file (default: the file's name without suffix).
        always_rerank: re-rank the run file's candidates whatever the experiment's mode (a set that ships its
            first stage, as TREC DL in the BEIR command); else ``full`` becomes ``rerank`` and ``exhaustive`` ranks
            the candidates exhaustively.
        key: the folder and table key (default: derived from ``name``).
    """

    name: str
    split: str | None = None
    first_stage_run: str | None = None
    first_stage_name: str | None = None
    always_rerank: bool = False
    rerank_depth: int | None = None
    relevance_level: int | None = None
    max_queries: int | None = None
    max_docs: int | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        for option in ("rerank_depth", "relevance_level", "max_queries", "max_docs"):
            value = getattr(self, option)
            if value is not None and value < 1:
                raise UserError(f"{option} must be >= 1 (got {value})")

    def forums(self, data_dir: str | None = None) -> tuple["DatasetSpec", ...]:
        """One spec per part of a folder of several BEIR folders (:func:`hil.data.beir.forum_folders`), each keyed
        ``<key>/<part>``; ``()`` for one dataset."""
        forums = forum_folders(self.name, data_dir)
        if forums and self.first_stage_run is not None:
            raise UserError(f"dataset {self.name}: a folder of {len(forums)} datasets; a first-stage run belongs to "
                            "one of them: give that one")
        return tuple(replace(self, name=str(forum), key=f"{self.folder_key}/{forum.name}") for forum in forums)

    @property
    def folder_key(self) -> str:
        return self.key or run_name(self.name.removeprefix("irds:").replace("/", "-"))

    @property
    def baseline_name(self) -> str:
        if self.first_stage_run is None:
            return BASELINE
        return self.first_stage_name or run_name(Path(self.first_stage_run).stem)


@dataclass(frozen=True)
class StatisticsSettings:
    """Bootstrap intervals and paired tests between columns (:func:`hil.evaluation.results.evaluation_statistics`);
    ``p_adjust``: the multiple-comparison adjustment (``holm``, ``bh`` or ``none``)."""

    enabled: bool = True
    metrics: tuple[str, ...] = ("ndcg@10", "mrr@10", "recall@100")
    bootstrap_samples: int = 1000
    permutations: int = 10000
    p_adjust: str = "holm"

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", canonical_metrics(self.metrics, "statistics.metrics", allow_empty=True))
        if self.p_adjust not in P_ADJUST_METHODS:
            raise UserError(f"p_adjust must be one of {P_ADJUST_METHODS} (got {self.p_adjust!r})")
        for option in ("bootstrap_samples", "permutations"):
            if getattr(self, option) < 1:
                raise UserError(f"{option} must be >= 1 (got {getattr(self, option)})")


@dataclass
class Experiment:
    """Datasets x models under one :class:`~hil.evaluation.evaluate.EvaluationSettings` (see the module docstring).

    ``baseline``: add the BM25 column (always there when re-ranking needs its candidates, or when a dataset gives
    a first-stage run). ``folders``: ``per-dataset`` writes ``output/<key>/``; ``flat`` writes the one dataset's
    files into ``output`` itself. ``idf`` and the slices are per model / dataset. ``command``: what the user ran
    (recorded with every result). ``seed``: slices and untrained heads. ``resume``: keep the columns finished with
    the same identity (False: compute every column again, e.g. when the caller needs the evaluations and encoders
    themselves, as the analysis report does).
    """

    datasets: Sequence[DatasetSpec]
    models: Sequence[ModelSpec]
    output: str | Path
    settings: EvaluationSettings = field(default_factory=EvaluationSettings)
    statistics: StatisticsSettings = field(default_factory=StatisticsSettings)
    baseline: bool = True
    folders: str = "per-dataset"
    seed: int = 12345
    data_dir: str | None = None
    quiet: bool = False
    resume: bool = True
    command: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.folders not in ("per-dataset", "flat"):
            raise UserError(f"folders must be 'per-dataset' or 'flat' (got {self.folders!r})")
        if self.folders == "flat" and len(self.datasets) != 1:
            raise UserError("folders='flat' writes one dataset's files into the output folder: give one dataset")
        if not self.datasets:
            raise UserError("an experiment needs at least one dataset")
        for spec in self.datasets:  # first: a misspelled name or a missing folder costs no model (torch) import
            if not is_irds_name(spec.name):
                dataset_source(spec.name, self.data_dir)
            forums = spec.forums(self.data_dir)
            if forums and self.folders == "flat":
                raise UserError(f"dataset {spec.name}: a folder of {len(forums)} datasets, written one by one into "
                                f"<output>/<dataset>/ (folders 'flat' holds one): give one of them, e.g. "
                                f"{forums[0].name}")
        if self.models and self.settings.index_root is not None:  # every model's documents go into an index there
            check_output_path(self.settings.index_root, "settings.index_root", folder=True)
        check_output_path(self.output, "output", folder=True)
        names = [model.column for model in self.models]
        for name in names:
            if name.lower() == BASELINE:
                raise UserError(f"model column {name!r} is the baseline's name; name the model otherwise")
            if names.count(name) > 1:
                raise UserError(f"two models are named {name!r}; give them names")

    def log(self, message: str) -> None:
        if not self.quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def column_name(source: str) -> str:
    """A model's column when not named: its folder's (or checkpoint's) name; an export folder's parent's."""
    from hil.modeling.loading import split_ensemble_source

    members = split_ensemble_source(source)
    if members is not None:
        return run_name("+".join(column_name(member) for member in members))
    path = Path(str(source).rstrip("/"))
    name = path.stem if path.suffix == ".ckpt" else path.name
    if name in EXPORT_FOLDER_NAMES and path.parent.name:
        name = path.parent.name
    return run_name(name)
