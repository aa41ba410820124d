"""The whole of BEIR in one command, as HIL (001) Table 2: BM25 and each model's nDCG@10 per dataset.

    hil beir --model runs/colbert/export --model HIL=runs/hil/export
    hil beir --model M --datasets scifact,nfcorpus,cqadupstack --mode exhaustive
    hil beir --model M --max-queries 50 --max-docs 2000 --out results/beir-slice

``--datasets all`` (the default) evaluates every BEIR dataset found under the data dir (``<dir>/beir/<name>`` or
``<dir>/<name>``; :mod:`hil.experiments.beir_sets`) and names the missing ones in one notice; a list of names
evaluates those, loading the ones not found locally from the Hugging Face hub. Every model is evaluated through
:func:`hil.evaluation.evaluate.evaluate`; BM25 through :func:`~hil.evaluation.evaluate.evaluate_bm25`, except on a
dataset that ships a first-stage run (TREC DL19's and DL20's ``bm25-top100.trec``:
:data:`~hil.experiments.profiles.RERANKING_SETS`), which is scored as given as the BM25 column and re-ranked by every
model. Qrels judging documents outside the corpus are kept (they count in the ideal DCG, as
in trec_eval), with one warning line and their count in the results.

Output (``--out``, default ``results/beir``)::

    <dataset>/<column>.json     metrics, per-query metrics, the dataset (fingerprint, sizes, judgments outside
                                the corpus), the model (source, fingerprint), the settings, versions
    <dataset>/<column>.trec     the run
    table.json, table.md        Table 2 (:mod:`hil.experiments.beir_table`), printed too

CQADupStack's forums are evaluated one by one (``cqadupstack/<forum>/``) and its row is their mean, as BEIR reports
it. A rerun resumes: a (dataset, column) whose results file records the same ``identity`` (dataset and model
fingerprints, and the settings that change the numbers: mode, k, metrics, back-end, re-ranking depth, precision)
is kept; one whose identity differs is recomputed. Device, processes, batch size and the index folder change how
fast, not what, and do not force a recomputation.

A user error (an unknown dataset, a model that cannot be loaded, a bad ``NAME=PATH``, a ``--baseline`` that is not
a model, no dataset found, a dataset that cannot be loaded) is one line on stderr naming the option, exit status 2;
``HIL_DEBUG=1`` keeps the traceback.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from hil.errors import UserError
from hil.evaluation.evaluate import EvaluationSettings
from hil.evaluation.runner import DatasetResult, DatasetSpec, Experiment, ModelSpec, StatisticsSettings, run_experiment
from hil.experiments.beir_sets import Selection, data_root, evaluation_order, missing_notice, select
from hil.experiments.beir_table import BM25, build_table, render_markdown
from hil.provenance import provenance, write_json_atomic, write_text_atomic
from hil.retrieval.backends.configs import configs_from_params
from hil.retrieval.devices import check_precision, resolve_device

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


# -- arguments -------------------------------------------------------------------------------------------------

def evaluation_settings(args: argparse.Namespace) -> EvaluationSettings:
    """The settings every model is evaluated with (a first-stage dataset overrides the mode)."""
    for option in ("k", "rerank_depth", "batch_size", "processes", "bootstrap_samples"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            raise UserError(f"--{option.replace('_', '-')} must be >= 1 (got {getattr(args, option)})")
    for option in ("max_queries", "max_docs", "dim"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            raise UserError(f"--{option.replace('_', '-')} must be >= 1 (got {getattr(args, option)})")
    index_root = None if args.index_root.lower() == "none" else args.index_root
    if args.mode == "full" and index_root is None:
        raise UserError("--index-root none: mode full searches an index on disk (give a folder, or --mode "
                        "exhaustive)")
    try:
        check_precision(args.precision, resolve_device(args.device))
    except ValueError as error:
        raise UserError(f"--device {args.device} --precision {args.precision}: {error}") from None
    try:
        backend, search = configs_from_params(args.backend, args.backend_params)
        return EvaluationSettings(mode=args.mode, k=args.k, index_root=index_root, backend=backend, search=search,
                                  rerank_depth=args.rerank_depth,
                                  batch_size=args.batch_size, progress=not args.quiet, device=args.device,
                                  precision=args.precision, processes=args.processes,
                                  query_encoding=None if args.encode_queries == "fp32" else args.encode_queries)
    except ValueError as error:
        raise UserError(f"evaluation settings: {error}") from None


def model_spec(value: str) -> ModelSpec:
    """``NAME=PATH`` or ``PATH`` -> its model (column NAME, or the folder's name:
    :func:`hil.evaluation.runner.column_name`)."""
    if "=" not in value or Path(value).expanduser().exists():
        return ModelSpec(value)
    name, _, source = value.partition("=")
    if not _NAME.match(name) or not source:
        raise UserError(f"--model {value!r}: give NAME=PATH, NAME of letters, digits and _ . + - (starting with a "
                        "letter or digit), PATH not empty")
    return ModelSpec(source, name=name)


def model_specs(values: list[str], baseline: str | None, dim: int | None) -> tuple[list[ModelSpec], str]:
    """Every ``--model`` and the baseline's column, checked (names unique, not BM25's)."""
    specs = [replace(model_spec(value), dim=dim) for value in values]
    names = [spec.column for spec in specs]
    for name in names:
        if name.lower() == BM25:
            raise UserError(f"--model: the column name {name!r} is BM25's; name the model NAME=PATH")
        if names.count(name) > 1:
            raise UserError(f"--model: two models are named {name!r}; name them NAME=PATH")
    baseline = baseline or names[0]
    if baseline not in names:
        raise UserError(f"--baseline {baseline!r} is not among the models ({', '.join(names)})")
    return specs, baseline


def dataset_specs(selection: Selection, args: argparse.Namespace) -> list[DatasetSpec]:
    """Every part to evaluate, in evaluation order: a local folder or a hub name, with the run a re-ranking set ships
    (its BM25 column), its relevance level, and the slice."""
    specs = []
    for beir_set, part in evaluation_order(selection):
        folder, first = selection.local.get(part), beir_set.first_stage
        if first is not None and folder is None:
            raise UserError(f"--datasets {beir_set.key}: {part}: not found under {data_root(args.data_dir)} (it is "
                            f"read locally, with its first-stage run {first.run_file}; docs/guide.md, "
                            "'TREC DL 2019 and 2020': where the official files come from)")
        specs.append(DatasetSpec(str(folder) if folder is not None else part, split=beir_set.split,
                                 first_stage_run=str(folder / first.run_file) if first is not None else None,
                                 first_stage_name=BM25, always_rerank=True, rerank_depth=args.rerank_depth,
                                 relevance_level=first.relevance_level if first else None,
                                 max_queries=args.max_queries, max_docs=args.max_docs, key=part))
    return specs


def records_of(results: list[DatasetResult]) -> dict[str, dict[str, dict[str, Any]]]:
    """part -> column -> record, as the table wants them."""
    return {result.key: {column.name: column.record for column in result.columns} for result in results}


# -- the command -----------------------------------------------------------------------------------------------

def write_table(experiment: Experiment, selection: Selection, results: dict[str, dict[str, dict[str, Any]]],
                baseline: str, p_adjust: str = "holm") -> str:
    """``table.json`` and ``table.md`` from the run's records; -> the markdown."""
    columns = [BM25] + [model.column for model in experiment.models]
    table = build_table(results, selection.parts, selection.sets, columns, baseline,
                        n_bootstrap=experiment.statistics.bootstrap_samples, seed=experiment.seed,
                        missing=selection.missing, p_adjust=p_adjust)
    first = next(iter(results.values()), {})
    table["models"] = {column: {"source": record["model"]["source"], "fingerprint": record["model"]["fingerprint"]}
                       for column, record in first.items() if column != BM25}
    markdown = render_markdown(table)
    out = Path(experiment.output)
    write_json_atomic(out / "table.json", provenance(experiment.command, **table))
    write_text_atomic(out / "table.md", markdown)
    return markdown


def prepare(args: argparse.Namespace) -> tuple[Experiment, Selection, str]:
    """Every check that needs no dataset: the experiment to run, what it selects, and the baseline's column."""
    settings = evaluation_settings(args)
    models, baseline = model_specs(args.model, args.baseline, args.dim)
    try:
        selection = select(args.datasets, args.data_dir)
    except ValueError as error:
        raise UserError(str(error)) from None
    command = {key: value for key, value in vars(args).items() if key != "quiet"}
    # Table 2 compares the models with BM25 and the baseline per dataset: its own tests (beir_table), not the
    # per-dataset statistics of metrics.json.
    experiment = Experiment(dataset_specs(selection, args), models, args.output, settings=settings,
                            statistics=StatisticsSettings(enabled=False, bootstrap_samples=args.bootstrap_samples,
                                                          p_adjust=args.p_adjust),
                            seed=args.seed, data_dir=args.data_dir, quiet=args.quiet, command=command)
    return experiment, selection, baseline


def run(args: argparse.Namespace) -> int:
    experiment, selection, baseline = prepare(args)
    notice = missing_notice(selection, data_root(args.data_dir))
    if notice:
        print(notice, file=sys.stderr)

    def done(result: DatasetResult) -> None:
        experiment.log(f"{result.key}: nDCG@10 " + ", ".join(f"{column.name} {column.record['metrics']['ndcg@10']:.4f}"
                                                             for column in result.columns))

    results = run_experiment(experiment, on_dataset=done)
    print(write_table(experiment, selection, records_of(results), baseline, args.p_adjust))
    experiment.log(f"wrote {Path(args.output) / 'table.md'} and {Path(args.output) / 'table.json'}")
    return 0
