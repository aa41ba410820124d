"""The whole of BEIR in one command, as HIL (001) Table 2: BM25 and each model's nDCG@10 per dataset.

    python -m hil.experiments.beir --model runs/colbert/export --model HIL=runs/hil/export
    python -m hil.experiments.beir --model M --datasets scifact,nfcorpus,cqadupstack --mode exhaustive
    python -m hil.experiments.beir --model M --max-queries 50 --max-docs 2000 --out results/beir-slice

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
import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from transformers.utils import logging as transformers_logging

from hil.data.errors import OneLineArgumentParser, UserError, exit_status
from hil.data.option_files import parse_with_option_files
from hil.evaluation.evaluate import MODES, EvaluationSettings
from hil.evaluation.runner import (DatasetResult, DatasetSpec, Experiment, ModelSpec, StatisticsSettings,
                                   run_experiment)
from hil.evaluation.statistics import P_ADJUST_METHODS
from hil.experiments.beir_sets import BY_KEY, Selection, data_root, evaluation_order, missing_notice, select
from hil.experiments.beir_table import BM25, build_table, render_markdown
from hil.provenance import provenance, write_json_atomic, write_text_atomic
from hil.retrieval.backends.configs import BACKEND_KINDS, configs_from_params
from hil.retrieval.devices import PRECISIONS, check_precision, resolve_device

PROG = "hil beir"  # also python -m hil.experiments.beir
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


def build_parser() -> argparse.ArgumentParser:
    summary, _, details = __doc__.partition("\n\n")
    parser = OneLineArgumentParser(prog=PROG, description=summary, epilog=details,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", action="append", required=True, metavar="[NAME=]PATH",
        help="export folder, Lightning .ckpt or backbone (untrained head); repeatable; NAME is its column "
             "(default: the folder's name, its parent's for an 'export' folder)")
    add("--baseline", default=None, help="the model the others are compared with (default: the first --model)")
    add("--datasets", default="all", help="'all' (every one found locally) or a comma-separated list of: "
        f"{', '.join(BY_KEY)}")
    add("--data-dir", default=None, help="overrides HIL_DATA_DIR")
    add("--output", "--out", dest="out", default="results/beir",
        help="output folder (results per dataset, table.md, table.json)")
    add("--mode", choices=MODES, default="full", help="full ranking through the index (001's setting), exhaustive "
        "exact scoring of every document, or re-ranking BM25's top --rerank-depth; a dataset that ships a "
        "first-stage run is always re-ranked")
    add("--k", type=int, default=1000, help="documents ranked per query")
    add("--rerank-depth", type=int, default=100, help="first-stage candidates re-ranked per query")
    add("--backend", "--faiss", dest="backend", choices=BACKEND_KINDS, default="flat",
        help="the index's search back-end (mode full; --faiss: the name before 0.2)")
    add("--backend-params", "--faiss-params", dest="backend_params", type=json.loads, default=None,
        help='its build-time and search-time settings as JSON, e.g. \'{"nlist": 1024, "nprobe": 16}\'')
    add("--index-root", default="indexes", help="where indexes live; 'none' encodes in memory (not with mode full)")
    add("--batch-size", type=int, default=None, help="documents per encoding batch (default: 32 on a CPU, 128 on a GPU)")
    add("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add("--precision", choices=PRECISIONS, default="fp32", help="the corpus encoding's autocast")
    add("--encode-queries", choices=("fp32", "onnx"), default="fp32",
        help="full ranking on a CPU: queries through ONNX Runtime's fused fp32 graph (same vectors, faster)")
    add("--processes", type=int, default=1, help="corpus-encoding processes")
    add("--max-queries", type=int, default=None, help="evaluate a slice of each dataset (sampled with --seed)")
    add("--max-docs", type=int, default=None, help="corpus slice: judged documents plus sampled others")
    add("--seed", type=int, default=12345, help="slices, untrained-head initialisation, bootstrap")
    add("--dim", type=int, default=None, help="head size for an untrained backbone")
    add("--bootstrap-samples", type=int, default=1000, help="bootstrap samples of the 95%% intervals and tests")
    add("--p-adjust", choices=P_ADJUST_METHODS, default="holm", help="multiple-comparison adjustment of the paired "
        "tests' p-values, shown beside the raw ones and used for the dagger: holm (Holm-Bonferroni), bh "
        "(Benjamini-Hochberg) or none")
    add("--quiet", action="store_true", help="no progress bars or progress lines")
    return parser


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
    """``NAME=PATH`` or ``PATH`` -> its model (column NAME, or the folder's name: :func:`hil.evaluation.runner.column_name`)."""
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
    experiment = Experiment(dataset_specs(selection, args), models, args.out, settings=settings,
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
    experiment.log(f"wrote {Path(args.out) / 'table.md'} and {Path(args.out) / 'table.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_with_option_files(build_parser(), argv)
    if args.quiet:
        transformers_logging.disable_progress_bar()
    return exit_status(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
