"""One experiment runner: datasets x models x settings -> columns of results on disk, resumed by recorded identity.

An :class:`Experiment` says what to measure; :func:`run_experiment` measures it and writes, per dataset::

    <column>.json     identity, dataset, model (source, fingerprint, settings), metrics, per-query metrics, and
                      the details of the search as it ran (the back-end's build-time settings read back from the
                      index, the search-time settings read back from the back-end)
    <column>.trec     the run
    metrics.json      every column's metrics and details, the statistics (bootstrap intervals, paired tests with
                      multiple-comparison adjustment), the settings, versions; ``per_query.json`` beside it

Columns: the baseline (BM25, or the dataset's first-stage run file scored as given), then each model, then each
model under each post-hoc transform. Re-ranking takes its candidates from the baseline. A column whose
``<column>.json`` records the same identity -- dataset fingerprint and slice, model fingerprint, and the settings
that change the numbers (:mod:`hil.evaluation.identity`) -- is kept; any other is recomputed. Device, processes,
batch sizes and folders change how fast, not what, and are not part of an identity.

Two evaluations into one folder at once (or one after the other) keep both: ``metrics.json`` is read, merged and
written under the folder's lock, holding the other's columns measured on the same dataset slice with the same
settings beside this one's (:func:`finish_dataset`); a column of the same name that another evaluation running at
the same time wrote otherwise (another model, other settings) is refused, not overwritten
(:meth:`DatasetRun.refuse_another_runs`).

Every entry point describes its experiment and calls this: ``evaluate.py`` / ``hil evaluate`` (one dataset, in
``output`` itself), ``hil beir`` (:mod:`hil.experiments.beir`: every BEIR set, ``output/<dataset>/``), the paper
experiment (:mod:`hil.experiments.paper`, with :class:`ColumnHooks` for what only it measures: InterIso, each head's
score matrix, figures, ColBERT-lambda derived from its members' matrices) and the analysis report. Statistics
compare every column with the baseline, and each transform with its plain model: one family per reference run
and metric for the p-value adjustment (:data:`hil.evaluation.results.PAIRED_FAMILY`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from hil.data.beir import BeirDataset, load_beir
from hil.errors import UserError
from hil.evaluation.evaluate import (
    Evaluation,
    EvaluationSettings,
    evaluate,
    evaluate_bm25,
    evaluate_run_file,
    evaluate_transformed,
    first_stage,
    subset_with_first_stage,
)
from hil.evaluation.experiment import BASELINE, DatasetSpec, Experiment, ModelSpec, StatisticsSettings, column_name
from hil.evaluation.identity import (
    baseline_identity,
    dataset_identity,
    differences,
    evaluation_identity,
    normalized,
    run_file_of,
)
from hil.evaluation.metrics import measurable_metrics
from hil.evaluation.results import (
    RESULTS_LOCK,
    Column,
    DatasetResult,
    dataset_record,
    evaluation_statistics,
    forum_mean_result,
    other_columns,
    paired_comparisons,
    write_results,
)
from hil.evaluation.runs import write_trec_run
from hil.evaluation.seeds import seed_table
from hil.modeling.contracts import Encoder
from hil.modeling.hil import HILEncoder
from hil.modeling.loading import load_encoder, split_ensemble_source
from hil.provenance import file_lock, provenance, write_json_atomic
from hil.retrieval.encoding import eval_mode
from hil.retrieval.index import encoder_fingerprint

logger = logging.getLogger(__name__)

# The experiment's settings classes are re-exported: an entry point imports what it needs from here.
__all__ = ["BASELINE", "Column", "ColumnHooks", "DatasetResult", "DatasetRun", "DatasetSpec", "Experiment", "ModelSpec",
           "StatisticsSettings", "column_name", "run_experiment"]


# -- the columns of one dataset -------------------------------------------------------------------------------

class ColumnHooks(Protocol):
    """What an experiment measures beyond metrics (the paper: InterIso, each head's score matrix, figures), and
    columns it derives from finished ones (the paper's ColBERT-lambda: the sum of two members' score matrices).

    ``identity``: the hooks' settings for one dataset; part of every model column's identity, so that a column
    whose extras were measured otherwise is recomputed. ``column_extras``: called for each model column computed in
    this run (not for a kept one), with its evaluation and encoder (in eval mode); the keys it returns join the
    column's record (they may not replace the runner's own) and it may write files beside it, named after the
    column. ``derived_columns``: called once a dataset's columns are finished (baseline and models, kept or
    computed); it keeps or computes each derived column through :meth:`DatasetRun.finished` /
    :meth:`DatasetRun.save`, like the runner's own.
    """

    def identity(self, part: "DatasetRun") -> dict[str, Any]: ...

    def column_extras(self, part: "DatasetRun", name: str, evaluation: Evaluation,
                      encoder: Encoder) -> dict[str, Any]: ...

    def derived_columns(self, part: "DatasetRun", columns: Sequence[Column]) -> list[Column]: ...


class DatasetRun:
    """One dataset of an experiment: loads it, computes or keeps each column, writes its files. ``started``
    (``time.time_ns()``, default: now): when the experiment started; a column file written after it with another
    identity was written by another evaluation running at the same time (:meth:`refuse_another_runs`)."""

    def __init__(self, experiment: Experiment, spec: DatasetSpec, hooks: ColumnHooks | None = None,
                 started: int | None = None):
        self.experiment, self.spec, self.hooks = experiment, spec, hooks
        self.started = time.time_ns() if started is None else started
        self.folder = Path(experiment.output) if experiment.folders == "flat" else \
            Path(experiment.output) / spec.folder_key
        settings = experiment.settings
        if spec.first_stage_run is not None and (spec.always_rerank or settings.mode == "full"):
            settings = replace(settings, mode="rerank")  # a given first stage is re-ranked
        self.settings = settings
        self.run_file: Path | None = None
        self.dataset, self.first, self.candidates = self._load()
        self.depth = spec.rerank_depth or (self.first.details["depth"] if self.first is not None
                                          else settings.rerank_depth)
        self.measure_at_run_depth()
        self.identity = dataset_identity(self.dataset, spec, experiment.seed)
        self.baseline_id = baseline_identity(self.run_file, settings, self.depth)

    def measure_at_run_depth(self) -> None:
        """Keep the metrics the dataset's runs can measure: a run holds ``k`` documents per query, or, re-ranking
        (a first stage's candidates), at most those candidates (:func:`~hil.evaluation.metrics.measurable_metrics`);
        the others are left out of every column (said once), not reported as the value at a shallower depth under
        their name."""
        settings = self.settings
        reranked = settings.mode == "rerank" or self.first is not None
        depth = min(settings.k, self.depth) if reranked else settings.k
        kept, dropped = measurable_metrics(settings.metrics, depth)
        if not dropped:
            return
        if not kept:
            raise UserError(f"{self.spec.folder_key}: no metric measurable on runs of {depth} documents per query "
                            f"(metrics {', '.join(dropped)}): raise k or the re-ranking depth")
        self.experiment.log(f"{self.spec.folder_key}: {', '.join(dropped)} left out (the runs hold {depth} "
                            f"documents per query: each would equal its value at {depth})")
        self.settings = replace(settings, metrics=kept)
        if self.first is not None:
            self.first = replace(self.first, aggregate={m: self.first.aggregate[m] for m in kept},
                                 per_query={q: {m: v[m] for m in kept} for q, v in self.first.per_query.items()})

    def _load(self) -> tuple[BeirDataset, Evaluation | None, dict[str, list[str]] | None]:
        spec, experiment = self.spec, self.experiment
        dataset = load_beir(spec.name, split=spec.split, data_dir=experiment.data_dir, judged_outside_corpus="keep",
                            relevance_level=spec.relevance_level)
        first = None
        if spec.first_stage_run is not None:  # checked against the whole dataset, then sliced with it
            self.run_file = run_file_of(spec.first_stage_run, dataset)
            first = evaluate_run_file(self.run_file, dataset, self.settings.metrics, name=spec.baseline_name,
                                      drop_self_matches=self.settings.drop_self_matches)
            first.details["rerank_depth"] = spec.rerank_depth or first.details["depth"]
        dataset, first, candidates = subset_with_first_stage(
            dataset, first, spec.max_queries, spec.max_docs, seed=experiment.seed, depth=spec.rerank_depth,
            drop_self_matches=self.settings.drop_self_matches)
        if first is not None and len(first.run) < len(dataset.queries):
            logger.warning("%s: %d of %d judged queries have no document in the run (they score 0)",
                           spec.first_stage_run, len(dataset.queries) - len(first.run), len(dataset.queries))
        return dataset, first, candidates

    # -- records -------------------------------------------------------------------------------------------------
    def finished(self, name: str, identity: dict[str, Any]) -> dict[str, Any] | None:
        """The record of column ``name`` when it was made with ``identity``, else None (saying why it is redone)."""
        path = self.folder / f"{name}.json"
        if not path.is_file():
            return None
        self.refuse_another_runs(name, identity)
        if not self.experiment.resume:
            return None
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self.experiment.log(f"{path}: unreadable, recomputed")
            return None
        changed = differences(record.get("identity"), normalized(identity))
        if changed:
            self.experiment.log(f"{path}: made with other settings ({', '.join(changed[:4])}), recomputed")
            return None
        return record

    def refuse_another_runs(self, name: str, identity: dict[str, Any]) -> None:
        """Refuse column ``name`` when another evaluation running at the same time wrote it into this folder with
        another identity (another model of the same name, other settings): one of the two would be lost. Written
        before this experiment started, it is an earlier result, recomputed as any column whose settings changed."""
        path = self.folder / f"{name}.json"
        try:
            if path.stat().st_mtime_ns < self.started:
                return
            changed = differences(json.loads(path.read_text(encoding="utf-8")).get("identity"), normalized(identity))
        except (OSError, ValueError, AttributeError):
            return  # gone, or not a record: nothing of another run's to keep
        if changed:
            raise UserError(f"column {name!r} in {self.folder}: another evaluation running now wrote it with another "
                            f"model or settings ({', '.join(changed[:3])}); name this model otherwise "
                            "(--model NAME=PATH) or give another --output")

    def save(self, name: str, evaluation: Evaluation, identity: dict[str, Any], model: dict[str, Any],
             encoder: Encoder | None = None, extras: dict[str, Any] | None = None) -> Column:
        """The run, then the column's record (its presence marks the column finished), both atomically and under
        the folder's lock, refused when another evaluation running now wrote that column otherwise
        (:meth:`refuse_another_runs`); ``extras``: more keys for the record (:class:`ColumnHooks`)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with file_lock(self.folder / RESULTS_LOCK, what="writing results"):
            self.refuse_another_runs(name, identity)
            return self._write_column(name, evaluation, identity, model, encoder, extras)

    def _write_column(self, name: str, evaluation: Evaluation, identity: dict[str, Any], model: dict[str, Any],
                      encoder: Encoder | None, extras: dict[str, Any] | None) -> Column:
        write_trec_run(self.folder / f"{name}.trec", evaluation.run, tag=name)
        record = provenance(self.experiment.command, identity=normalized(identity),
                            dataset=dataset_record(self.dataset), model=model, metrics=evaluation.aggregate,
                            per_query=evaluation.per_query,
                            details={k: v for k, v in evaluation.details.items() if k != "sources"})
        clash = sorted(set(extras or {}) & set(record))
        if clash:
            raise ValueError(f"column extras may not replace the record's own keys: {clash}")
        record.update(extras or {})
        write_json_atomic(self.folder / f"{name}.json", record)
        return Column(name, normalized(record), evaluation, encoder)

    # -- columns -------------------------------------------------------------------------------------------------
    def baseline(self) -> Column | None:
        """The baseline column (kept or computed), and the re-ranking candidates taken from it."""
        settings = self.settings
        if not (self.experiment.baseline or self.first is not None or settings.mode == "rerank"):
            return None
        identity = {"dataset": self.identity, "column": self.baseline_id,
                    "evaluation": {"metrics": list(settings.metrics),
                                   "drop_self_matches": settings.drop_self_matches}}
        name = self.spec.baseline_name
        record = self.finished(name, identity)
        if record is not None and self.first is None and settings.mode == "rerank":
            record = None  # BM25's candidates are needed: recompute the (cheap) run instead of re-reading it
        if record is not None:
            self.experiment.log(f"{name} on {self.dataset.name}: kept {self.folder / f'{name}.json'} (finished with "
                                "the same settings)")
            return Column(name, record)
        evaluation = self.first or evaluate_bm25(self.dataset, k=max(settings.k, self.depth),
                                                 metrics=settings.metrics,
                                                 drop_self_matches=settings.drop_self_matches)
        if self.candidates is None and settings.mode == "rerank":
            self.candidates = first_stage(evaluation, self.depth)
        return self.save(name, evaluation, identity, {"name": name, **self.baseline_id})

    def model_columns(self, spec: ModelSpec, encoder: Encoder) -> Iterator[Column]:
        """The model's column, then one per transform: each kept when finished with the same identity."""
        settings, experiment = self.settings, self.experiment
        if spec.idf == "corpus":
            set_corpus_idf(encoder, self.dataset, spec.source)
        fingerprint = encoder_fingerprint(encoder)
        column = spec.column_for(encoder.architecture, settings.mode)
        model = {"name": column, "source": spec.source, "fingerprint": fingerprint,
                 "architecture": encoder.architecture, "settings": encoder.settings(), "idf": spec.idf}
        model_id: dict[str, Any] = {"fingerprint": fingerprint}
        if spec.seed is not None:  # two seeds never share a column, even of one (e.g. untrained) model
            model_id["seed"] = spec.seed
            model.update(seed=spec.seed, method=spec.method_name)
        identity = {**self.model_context(), "column": model_id}
        record = self.finished(column, identity)
        if record is None:
            experiment.log(f"evaluate {column} on {self.dataset.name} ({len(self.dataset.queries)} queries, "
                           f"{len(self.dataset.corpus)} documents, {settings.mode})")
            with torch.inference_mode():
                evaluation = evaluate(encoder, self.dataset, settings, name=column, candidates=self._candidates())
            if "index_dir" in evaluation.details:
                experiment.log(f"{column}: index {evaluation.details['index_dir']} "
                               f"({evaluation.details.get('index_opened', 'opened')})")
            yield self.save(column, evaluation, identity, model, encoder, self._extras(column, evaluation, encoder))
        else:
            experiment.log(f"{column} on {self.dataset.name}: kept {self.folder / f'{column}.json'} (finished with "
                           "the same settings)")
            yield Column(column, record)
        for transform in spec.transforms:
            name = spec.transform_column(encoder.architecture, settings.mode, transform)
            fitted = {"transform": transform, "mode": spec.transform_mode, "max_tokens": spec.transform_max_tokens,
                      "seed": experiment.seed}
            transform_id = {**identity, "column": {**model_id, "transform": fitted}}
            record = self.finished(name, transform_id)
            if record is not None:
                experiment.log(f"{name} on {self.dataset.name}: kept {self.folder / f'{name}.json'} (finished with "
                               "the same settings)")
                yield Column(name, record)
                continue
            experiment.log(f"evaluate {name} on {self.dataset.name}")
            with torch.inference_mode():
                evaluation, transformed = evaluate_transformed(
                    encoder, self.dataset, transform, settings, transform_mode=spec.transform_mode,
                    max_tokens=spec.transform_max_tokens, seed=experiment.seed, name=name,
                    candidates=self._candidates())
            yield self.save(name, evaluation, transform_id, {**model, "name": name, "transform": fitted,
                                                             "plain_column": column,
                                                             "settings": transformed.settings(),
                                                             "fingerprint": encoder_fingerprint(transformed)},
                            transformed, self._extras(name, evaluation, transformed))

    def model_context(self) -> dict[str, Any]:
        """A model column's identity but the column itself: the dataset slice, the settings that change the numbers
        and the hooks' (:func:`evaluation_identity`, :meth:`ColumnHooks.identity`). Columns measured in one context
        compare: one ``metrics.json`` holds them."""
        context = {"dataset": self.identity,
                   "evaluation": evaluation_identity(self.settings, self.baseline_id, self.depth)}
        if self.hooks is not None:
            context["extras"] = self.hooks.identity(self)
        return context

    def _candidates(self) -> dict[str, list[str]] | None:
        return self.candidates if self.settings.mode != "full" else None

    def _extras(self, name: str, evaluation: Evaluation, encoder: Encoder) -> dict[str, Any] | None:
        if self.hooks is None:
            return None
        with eval_mode(encoder), torch.inference_mode():
            return self.hooks.column_extras(self, name, evaluation, encoder)


def set_corpus_idf(encoder: Encoder, dataset: BeirDataset, source: str) -> None:
    """ColBERT-HIL's query-term IDF recomputed on ``dataset``: its queries for the authors' formula (taken over the
    target dataset's queries), else its documents."""
    if not isinstance(encoder, HILEncoder):
        raise UserError(f"--idf corpus needs a model with IDF weights (ColBERT-HIL); {source} is "
                        f"{encoder.architecture}")
    if encoder.idf_from_queries:
        encoder.set_idf_from_texts(list(dataset.queries.values()), source=f"{dataset.name} queries ({dataset.split})")
    else:
        encoder.set_idf_from_texts(dataset.documents(), source=f"{dataset.name} corpus ({dataset.split})")


def load_model(spec: ModelSpec, seed: int) -> Encoder:
    """:func:`~hil.modeling.loading.load_encoder` with the options given (an untrained head seeded with ``seed``,
    so that a rerun has the same fingerprint); a model that cannot be read is a :class:`UserError` naming
    ``--model``."""
    torch.manual_seed(seed)
    if split_ensemble_source(spec.source) is not None and spec.overrides():
        raise UserError(f"--model {spec.source}: an ensemble's members keep their own settings; "
                        f"{sorted(spec.overrides())} given")
    try:
        return load_encoder(spec.source, **spec.overrides())
    except (UserError, OSError) as error:
        message = str(error)
        raise UserError(message if message.startswith("--model") else f"--model {spec.source}: {message}") \
            from error


# -- the experiment ---------------------------------------------------------------------------------------------

def run_experiment(experiment: Experiment, on_dataset: Callable[[DatasetResult], None] | None = None,
                   hooks: ColumnHooks | None = None) -> list[DatasetResult]:
    """Measure ``experiment`` (see the module docstring); -> each dataset's result, in order. Models are loaded once
    (before any dataset, so that a model that cannot be read fails first); ``on_dataset`` sees each dataset's result
    as it is finished; ``hooks`` add measurements and derived columns (:class:`ColumnHooks`). A folder of several
    datasets (BEIR's CQADupStack) is each of its forums' result, then their mean's (:meth:`DatasetSpec.forums`,
    :func:`~hil.evaluation.results.forum_mean_result`). Misspelled datasets and missing folders were refused when
    the experiment was made, before any model (:class:`Experiment`)."""
    started = time.time_ns()  # a column written after this by another evaluation is not overwritten silently
    encoders = {spec.column: load_model(spec, experiment.seed) for spec in experiment.models}
    results: list[DatasetResult] = []

    def finished(result: DatasetResult) -> None:
        results.append(result)
        if on_dataset is not None:
            on_dataset(result)

    for spec in experiment.datasets:
        forums = spec.forums(experiment.data_dir)
        for part_spec in forums or (spec,):
            finished(run_dataset(experiment, part_spec, encoders, hooks, started))
        if forums:
            settings = {**experiment.command, "evaluation": settings_record(experiment.settings),
                        "statistics": asdict(experiment.statistics), "dataset_spec": asdict(spec)}
            finished(forum_mean_result(spec.folder_key, Path(experiment.output) / spec.folder_key,
                                       results[-len(forums):], spec.baseline_name, settings, experiment.statistics,
                                       experiment.seed))
            experiment.log(f"wrote {results[-1].metrics_path}: the mean over {len(forums)} forums")
    return results


def run_dataset(experiment: Experiment, spec: DatasetSpec, encoders: dict[str, Encoder], hooks: ColumnHooks | None,
                started: int) -> DatasetResult:
    """One dataset's columns (baseline, models, transforms, derived), kept or computed, and its results files."""
    part = DatasetRun(experiment, spec, hooks, started)
    columns = []
    baseline = part.baseline()
    if baseline is not None:
        columns.append(baseline)
    transforms_of: dict[str, str] = {}
    for model in experiment.models:
        plain = model.column_for(encoders[model.column].architecture, part.settings.mode)
        for column in part.model_columns(model, encoders[model.column]):
            if any(column.name == seen.name for seen in columns):
                raise UserError(f"two columns are named {column.name!r} on {spec.name}; name the models")
            columns.append(column)
            if column.name != plain:
                transforms_of[column.name] = plain
    for column in hooks.derived_columns(part, columns) if hooks is not None else ():
        if any(column.name == seen.name for seen in columns):
            raise UserError(f"two columns are named {column.name!r} on {spec.name}; name the models")
        columns.append(column)
    return finish_dataset(experiment, part, columns, baseline.name if baseline else None, transforms_of)


def finish_dataset(experiment: Experiment, part: DatasetRun, columns: list[Column], baseline: str | None,
                   transforms_of: dict[str, str]) -> DatasetResult:
    """Statistics over the dataset's columns and its ``metrics.json`` / ``per_query.json``, read, merged and written
    under the folder's lock: the columns another evaluation (earlier, or running at the same time) put into this
    folder's ``metrics.json`` stay in it beside this one's when they were measured in the same context (the dataset
    slice and settings, :meth:`DatasetRun.model_context`), so that two evaluations into one folder keep both; the
    others are left out, and said."""
    with file_lock(part.folder / RESULTS_LOCK, what="writing results"):
        found, left_out = other_columns(part.folder, {column.name for column in columns},
                                        normalized(part.model_context()))
        others = [Column(name, record) for name, record in found.items()]
        if others:
            experiment.log(f"{part.folder}/metrics.json: also holds {', '.join(found)} (another evaluation's "
                           "columns in this folder, measured on the same dataset with the same settings)")
        if left_out:
            experiment.log(f"{part.folder}/metrics.json: left out {', '.join(left_out)}, measured on another slice "
                           "or with other settings (their <name>.json and .trec stay)")
        names = {column.name for column in [*columns, *others]}
        for column in others:  # a transform column is compared with its plain model's, when that is here
            plain = column.record.get("model", {}).get("plain_column")
            if plain in names:
                transforms_of = {**transforms_of, column.name: plain}
        path, statistics = write_dataset_results(experiment, part, [*columns, *others], baseline, transforms_of)
    experiment.log(f"wrote {part.folder}/: metrics.json, per_query.json; per column <name>.json and <name>.trec "
                   f"({', '.join(column.name for column in [*columns, *others])})")
    return DatasetResult(part.spec.folder_key, part.dataset, columns, statistics, path, others)


def write_dataset_results(experiment: Experiment, part: DatasetRun, columns: list[Column], baseline: str | None,
                          transforms_of: dict[str, str]) -> tuple[Path, dict[str, Any] | None]:
    evaluations = [column.as_evaluation() for column in columns]
    statistics = None
    stats = experiment.statistics
    if stats.enabled and evaluations:
        statistics = evaluation_statistics(evaluations, metrics=stats.metrics,
                                           pairs=paired_comparisons(columns, baseline, transforms_of),
                                           n_bootstrap=stats.bootstrap_samples, n_permutations=stats.permutations,
                                           seed=experiment.seed, p_adjust=stats.p_adjust)
    if stats.enabled and evaluations:
        seeds = seed_statistics(columns, stats)
        if seeds:
            statistics = {**(statistics or {}), "seeds": seeds}
    models = {column.name: column.record.get("model", {}) for column in columns if column.name != baseline}
    settings = {**experiment.command, "evaluation": settings_record(part.settings),
                "statistics": asdict(stats), "dataset_spec": asdict(part.spec), "identity": part.identity}
    path = write_results(part.folder, part.dataset, evaluations, settings, models, statistics=statistics,
                         write_runs=False)
    return path, statistics


def seed_statistics(columns: Sequence[Column], stats: StatisticsSettings) -> dict[str, Any] | None:
    """Per metric, :func:`hil.evaluation.seeds.seed_table` over the columns of models given a ``seed``, grouped by
    ``method`` (transform columns left out), when some method has two seeds or more; the reference is the first
    method. None when there is nothing to summarize."""
    methods: dict[str, dict[int, Column]] = {}
    for column in columns:
        model = column.record.get("model", {})
        if model.get("seed") is not None and "transform" not in model:
            methods.setdefault(model["method"], {})[int(model["seed"])] = column
    if not any(len(per) > 1 for per in methods.values()):
        return None
    reference = next(iter(methods))
    return {metric: seed_table({name: {seed: {q: values[metric] for q, values in
                                              column.record["per_query"].items()}
                                       for seed, column in per.items()} for name, per in methods.items()},
                               reference, stats.p_adjust)
            for metric in stats.metrics}


def settings_record(settings: EvaluationSettings) -> dict[str, Any]:
    """The evaluation settings as a results file records them (back-end and search as ``class_path`` records)."""
    record = {key: value for key, value in asdict(settings).items() if key not in ("backend", "search")}
    return normalized({**record, "backend": settings.backend.record(), "search": settings.resolved_search.record()})
