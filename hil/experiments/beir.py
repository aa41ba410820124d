"""The whole of BEIR in one command, as HIL (001) Table 2: BM25 and each model's nDCG@10 per dataset.

    python -m hil.experiments.beir --model runs/colbert/export --model HIL=runs/hil/export
    python -m hil.experiments.beir --model M --datasets scifact,nfcorpus,cqadupstack --mode exhaustive
    python -m hil.experiments.beir --model M --max-queries 50 --max-docs 2000 --out results/beir-slice

``--datasets all`` (the default) evaluates every BEIR dataset found under the data dir (``<dir>/beir/<name>`` or
``<dir>/<name>``; :mod:`hil.experiments.beir_sets`) and names the missing ones in one notice; a list of names
evaluates those, loading the ones not found locally from the Hugging Face hub. Every model is evaluated through
:func:`hil.evaluation.evaluate.evaluate`; BM25 through :func:`~hil.evaluation.evaluate.evaluate_bm25`, except on a
dataset that ships a first-stage run (TREC DL19's ``bm25-top100.trec``), which is scored as given as the BM25 column
and re-ranked by every model. Qrels judging documents outside the corpus are kept (they count in the ideal DCG, as
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
import os
import pickle
import re
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import torch
from transformers.utils import logging as transformers_logging

from hil.data.beir import BeirDataset, load_beir
from hil.data.errors import DEBUG_ENV, DataFormatError, UserError, one_line, user_error
from hil.evaluation.evaluate import (MODES, Evaluation, EvaluationSettings, evaluate, evaluate_bm25, evaluate_run_file,
                                     run_name, subset_with_first_stage)
from hil.evaluation.results import dataset_record
from hil.evaluation.runs import candidates_from_run, read_trec_run, write_trec_run
from hil.experiments.beir_sets import BY_KEY, BeirSet, Selection, data_root, evaluation_order, missing_notice, select
from hil.experiments.beir_table import BM25, build_table, render_markdown
from hil.modeling.contracts import Encoder
from hil.modeling.loading import load_encoder, split_ensemble_source
from hil.paths import resolve_model
from hil.provenance import fingerprint_strings, provenance, write_json_atomic, write_text_atomic
from hil.retrieval.backends.registry import FAISS_KINDS
from hil.retrieval.devices import PRECISIONS, check_precision, resolve_device
from hil.retrieval.index import encoder_fingerprint

PROG = "python -m hil.experiments.beir"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
EXPORT_FOLDER_NAMES = ("export",)  # train.py --export_dir folders: the column is named after their parent


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (``<prog>: error: ...``), not a usage screen followed by the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    summary, _, details = __doc__.partition("\n\n")
    parser = OneLineParser(prog=PROG, description=summary, epilog=details,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", action="append", required=True, metavar="[NAME=]PATH",
        help="export folder, Lightning .ckpt or backbone (untrained head); repeatable; NAME is its column "
             "(default: the folder's name, its parent's for an 'export' folder)")
    add("--baseline", default=None, help="the model the others are compared with (default: the first --model)")
    add("--datasets", default="all", help="'all' (every one found locally) or a comma-separated list of: "
        f"{', '.join(BY_KEY)}")
    add("--data-dir", default=None, help="overrides HIL_DATA_DIR")
    add("--out", default="results/beir", help="output folder (results per dataset, table.md, table.json)")
    add("--mode", choices=MODES, default="full", help="full ranking through the index (001's setting), exhaustive "
        "exact scoring of every document, or re-ranking BM25's top --rerank-depth; a dataset that ships a "
        "first-stage run is always re-ranked")
    add("--k", type=int, default=1000, help="documents ranked per query")
    add("--rerank-depth", type=int, default=100, help="first-stage candidates re-ranked per query")
    add("--faiss", choices=FAISS_KINDS, default="flat", help="the index's search back-end (mode full)")
    add("--faiss-params", type=json.loads, default=None, help='JSON, e.g. \'{"nlist": 1024, "nprobe": 16}\'')
    add("--index-root", default="indexes", help="where indexes live; 'none' encodes in memory (not with mode full)")
    add("--batch-size", type=int, default=32, help="documents per encoding batch")
    add("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add("--precision", choices=PRECISIONS, default="fp32", help="the corpus encoding's autocast")
    add("--processes", type=int, default=1, help="corpus-encoding processes")
    add("--max-queries", type=int, default=None, help="evaluate a slice of each dataset (sampled with --seed)")
    add("--max-docs", type=int, default=None, help="corpus slice: judged documents plus sampled others")
    add("--seed", type=int, default=12345, help="slices, untrained-head initialisation, bootstrap")
    add("--dim", type=int, default=None, help="head size for an untrained backbone")
    add("--bootstrap-samples", type=int, default=1000, help="bootstrap samples of the 95%% intervals and tests")
    add("--quiet", action="store_true", help="no progress bars or progress lines")
    return parser


# -- arguments -------------------------------------------------------------------------------------------------

def evaluation_settings(args: argparse.Namespace) -> EvaluationSettings:
    """The settings every model is evaluated with (a first-stage dataset overrides the mode)."""
    for option in ("k", "rerank_depth", "batch_size", "processes", "bootstrap_samples"):
        if getattr(args, option) < 1:
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
        return EvaluationSettings(mode=args.mode, k=args.k, index_root=index_root, backend=args.faiss,
                                  backend_params=args.faiss_params, rerank_depth=args.rerank_depth,
                                  batch_size=args.batch_size, progress=not args.quiet, device=args.device,
                                  precision=args.precision, processes=args.processes)
    except ValueError as error:
        raise UserError(f"evaluation settings: {error}") from None


def column_name(source: str) -> str:
    """A model's column when not named: its folder's (or checkpoint's) name; an export folder's parent's."""
    path = Path(source.rstrip("/"))
    name = path.stem if path.suffix == ".ckpt" else path.name
    if name in EXPORT_FOLDER_NAMES and path.parent.name:
        name = path.parent.name
    return run_name(name)


def model_spec(value: str) -> tuple[str, str]:
    """``NAME=PATH`` or ``PATH`` -> (column name, source)."""
    if "=" not in value or Path(value).expanduser().exists():
        return column_name(value), value
    name, _, source = value.partition("=")
    if not _NAME.match(name) or not source:
        raise UserError(f"--model {value!r}: give NAME=PATH, NAME of letters, digits and _ . + - (starting with a "
                        "letter or digit), PATH not empty")
    return name, source


def model_specs(values: list[str], baseline: str | None) -> tuple[list[tuple[str, str]], str]:
    """The (name, source) of every ``--model`` and the baseline's name, checked."""
    specs = [model_spec(value) for value in values]
    names = [name for name, _ in specs]
    for name in names:
        if name.lower() == BM25:
            raise UserError(f"--model: the column name {name!r} is BM25's; name the model NAME=PATH")
        if names.count(name) > 1:
            raise UserError(f"--model: two models are named {name!r}; name them NAME=PATH")
    baseline = baseline or names[0]
    if baseline not in names:
        raise UserError(f"--baseline {baseline!r} is not among the models ({', '.join(names)})")
    return specs, baseline


def _looks_local(source: str) -> bool:
    """A path rather than a hub id (``org/name``): it must then exist."""
    return source.startswith((".", "/", "~")) or source.endswith(".ckpt") or source.count("/") > 1


@dataclass
class Model:
    """A column: the loaded encoder, where it came from and its fingerprint (weights and settings)."""

    name: str
    source: str
    encoder: Encoder
    fingerprint: str

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "fingerprint": self.fingerprint,
                "architecture": self.encoder.architecture, "settings": self.encoder.settings()}


def load_model(name: str, source: str, seed: int, dim: int | None) -> Model:
    """``load_encoder`` (an untrained head seeded with ``seed``, so that a rerun has the same fingerprint)."""
    members = split_ensemble_source(source) or [source]
    for member in members:
        if _looks_local(member) and not Path(member).expanduser().exists() and resolve_model(member) == member:
            raise UserError(f"--model {source}: {member}: no such file or folder")
    torch.manual_seed(seed)
    try:
        encoder = load_encoder(source, **({"dim": dim} if dim is not None else {}))
    except (OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError) as error:  # not a model it can read
        raise UserError(f"--model {source}: {type(error).__name__}: {error}") from error
    return Model(name, source, encoder, encoder_fingerprint(encoder))


# -- the sweep -------------------------------------------------------------------------------------------------

@dataclass
class Sweep:
    """What every (dataset, column) evaluation of a run shares."""

    out: Path
    settings: EvaluationSettings
    models: list[Model]
    selection: Selection
    data_dir: str | None
    max_queries: int | None
    max_docs: int | None
    seed: int
    quiet: bool
    command: dict[str, Any] = field(default_factory=dict)  # the run's options, recorded with every result

    def log(self, message: str) -> None:
        if not self.quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def load_part(beir_set: BeirSet, part: str, sweep: Sweep) -> tuple[BeirDataset, Evaluation | None,
                                                                    dict[str, list[str]] | None]:
    """A dataset (or forum) sliced as asked, and for a set that ships a first-stage run, that run scored on the
    slice (named ``bm25``) and its candidates."""
    folder, first = sweep.selection.local.get(part), beir_set.first_stage
    if first is not None and folder is None:
        raise FileNotFoundError(f"{part}: not found under {data_root(sweep.data_dir)} (it is read locally, with its "
                                f"first-stage run {first.run_file})")
    dataset = load_beir(folder or part, split=beir_set.split, data_dir=sweep.data_dir, judged_outside_corpus="keep",
                        relevance_level=first.relevance_level if first else 1)
    given = evaluate_run_file(folder / first.run_file, dataset, name=BM25) if first is not None else None
    return subset_with_first_stage(dataset, given, sweep.max_queries, sweep.max_docs, seed=sweep.seed,
                                   depth=sweep.settings.rerank_depth)


def part_settings(beir_set: BeirSet, sweep: Sweep) -> EvaluationSettings:
    """The run's settings, re-ranking on a set that ships a first stage."""
    return replace(sweep.settings, mode="rerank") if beir_set.first_stage else sweep.settings


def dataset_identity(dataset: BeirDataset, part: str) -> dict[str, Any]:
    return {"part": part, "split": dataset.split, "fingerprint": dataset.fingerprint(),
            "relevance_level": dataset.relevance_level}


def bm25_identity(beir_set: BeirSet, dataset: BeirDataset, part: str, sweep: Sweep) -> dict[str, Any]:
    """What BM25's numbers on a dataset depend on: the data, and BM25's depth or the shipped run's content."""
    settings = sweep.settings
    if beir_set.first_stage is not None:
        run_file = sweep.selection.local[part] / beir_set.first_stage.run_file
        column: dict[str, Any] = {"run_file": run_file.name,
                                  "fingerprint": fingerprint_strings(run_file.read_text().splitlines())}
    else:
        column = {"bm25": "hil.data.bm25", "k": max(settings.k, settings.rerank_depth)}
    return {"dataset": dataset_identity(dataset, part), "column": column,
            "evaluation": {"metrics": list(settings.metrics), "drop_self_matches": settings.drop_self_matches}}


def model_identity(model: Model, settings: EvaluationSettings, bm25: dict[str, Any]) -> dict[str, Any]:
    """What a model's numbers on a dataset depend on (see the module docstring); re-ranking adds the first stage's
    identity, full ranking the back-end's settings."""
    evaluation: dict[str, Any] = {"mode": settings.mode, "k": settings.k, "metrics": list(settings.metrics),
                                  "drop_self_matches": settings.drop_self_matches, "precision": settings.precision}
    if settings.mode == "full":
        evaluation.update(backend=settings.backend, backend_params=dict(settings.backend_params or {}),
                          ncandidates=settings.ncandidates)
    if settings.mode == "rerank":
        evaluation.update(rerank_depth=settings.rerank_depth, first_stage=bm25["column"])
    return {"dataset": bm25["dataset"], "column": {"fingerprint": model.fingerprint}, "evaluation": evaluation}


def normalized(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists), so that identities compare."""
    return json.loads(json.dumps(value, default=str))


def differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two identities."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return [prefix.rstrip(".") or "identity"] if old != new else []
    return [key for name in sorted(set(old) | set(new))
            for key in differences(old.get(name), new.get(name), f"{prefix}{name}.")]


def finished(path: Path, identity: dict[str, Any], sweep: Sweep) -> dict[str, Any] | None:
    """The results record at ``path`` when it was made with ``identity``, else None (saying why it is redone)."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        sweep.log(f"{path}: unreadable, recomputed")
        return None
    changed = differences(record.get("identity"), normalized(identity))
    if changed:
        sweep.log(f"{path}: made with other settings ({', '.join(changed)}), recomputed")
        return None
    return record


def save(folder: Path, name: str, evaluation: Evaluation, dataset: BeirDataset, identity: dict[str, Any],
         sweep: Sweep, **extra: Any) -> dict[str, Any]:
    """The run, then the results record (its presence marks the pair finished), both written atomically."""
    write_trec_run(folder / f"{name}.trec", evaluation.run, tag=name)
    record = provenance(sweep.command, identity=normalized(identity), dataset=dataset_record(dataset), **extra,
                        metrics=evaluation.aggregate, per_query=evaluation.per_query,
                        details={k: v for k, v in evaluation.details.items() if k != "sources"})
    write_json_atomic(folder / f"{name}.json", record)
    return record


def bm25_column(beir_set: BeirSet, part: str, dataset: BeirDataset, given: Evaluation | None,
                sweep: Sweep) -> tuple[dict[str, Any], dict[str, Any], Evaluation | None]:
    """BM25's record on a part (kept, or computed: the shipped run, else BM25), its identity, and its evaluation
    when computed now."""
    identity = bm25_identity(beir_set, dataset, part, sweep)
    record = finished(sweep.out / part / f"{BM25}.json", identity, sweep)
    if record is not None:
        return record, identity, None
    settings = sweep.settings
    evaluation = given or evaluate_bm25(dataset, k=max(settings.k, settings.rerank_depth), metrics=settings.metrics,
                                        drop_self_matches=settings.drop_self_matches)
    record = save(sweep.out / part, BM25, evaluation, dataset, identity, sweep,
                  model={"name": BM25, **identity["column"]})
    return record, identity, evaluation


def evaluate_part(beir_set: BeirSet, part: str, sweep: Sweep) -> dict[str, dict[str, Any]]:
    """Every column's record on one dataset (or forum): kept when finished with the same identity, else computed."""
    dataset, given, shipped = load_part(beir_set, part, sweep)
    settings = part_settings(beir_set, sweep)
    bm25, bm25_id, fresh = bm25_column(beir_set, part, dataset, given, sweep)
    records, candidates = {BM25: bm25}, shipped
    for model in sweep.models:
        identity = model_identity(model, settings, bm25_id)
        record = finished(sweep.out / part / f"{model.name}.json", identity, sweep)
        if record is None:
            if settings.mode == "rerank" and candidates is None:
                run = fresh.run if fresh is not None else read_trec_run(sweep.out / part / f"{BM25}.trec",
                                                                       dataset.queries, dataset.corpus)
                candidates = candidates_from_run(run, settings.rerank_depth)
            sweep.log(f"evaluate {model.name} on {part} ({len(dataset.queries)} queries, {len(dataset.corpus)} "
                      f"documents, {settings.mode})")
            with torch.inference_mode():
                evaluation = evaluate(model.encoder, dataset, settings, name=model.name,
                                      candidates=candidates if settings.mode != "full" else None)
            record = save(sweep.out / part, model.name, evaluation, dataset, identity, sweep, model=model.record())
        records[model.name] = record
    return records


def run_sweep(sweep: Sweep) -> dict[str, dict[str, dict[str, Any]]]:
    """Every selected part's records (part -> column -> record)."""
    results = {}
    for beir_set, part in evaluation_order(sweep.selection):
        try:
            results[part] = evaluate_part(beir_set, part, sweep)
        except (FileNotFoundError, DataFormatError) as error:
            raise UserError(f"--datasets {beir_set.key}: {error}") from error
        sweep.log(f"{part}: nDCG@10 " + ", ".join(f"{name} {record['metrics']['ndcg@10']:.4f}"
                                                  for name, record in results[part].items()))
    return results


# -- the command -----------------------------------------------------------------------------------------------

def write_table(sweep: Sweep, results: dict[str, dict[str, dict[str, Any]]], baseline: str,
                n_bootstrap: int) -> str:
    """``table.json`` and ``table.md`` from the run's records; -> the markdown."""
    selection = sweep.selection
    columns = [BM25] + [model.name for model in sweep.models]
    table = build_table(results, selection.parts, selection.sets, columns, baseline, n_bootstrap=n_bootstrap,
                        seed=sweep.seed, missing=selection.missing)
    table["models"] = {model.name: {"source": model.source, "fingerprint": model.fingerprint}
                       for model in sweep.models}
    markdown = render_markdown(table)
    write_json_atomic(sweep.out / "table.json", provenance(sweep.command, **table))
    write_text_atomic(sweep.out / "table.md", markdown)
    return markdown


def prepare(args: argparse.Namespace) -> tuple[Sweep, str]:
    """Every check that needs no dataset, then the models: the sweep to run and the baseline's name."""
    settings = evaluation_settings(args)
    specs, baseline = model_specs(args.model, args.baseline)
    try:
        selection = select(args.datasets, args.data_dir)
    except ValueError as error:
        raise UserError(str(error)) from None
    command = {key: value for key, value in vars(args).items() if key != "quiet"}
    models = [load_model(name, source, args.seed, args.dim) for name, source in specs]
    sweep = Sweep(Path(args.out), settings, models, selection, args.data_dir, args.max_queries, args.max_docs,
                  args.seed, args.quiet, command)
    return sweep, baseline


def run(args: argparse.Namespace) -> int:
    sweep, baseline = prepare(args)
    notice = missing_notice(sweep.selection, data_root(args.data_dir))
    if notice:
        print(notice, file=sys.stderr)
    results = run_sweep(sweep)
    print(write_table(sweep, results, baseline, args.bootstrap_samples))
    sweep.log(f"wrote {sweep.out / 'table.md'} and {sweep.out / 'table.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quiet:
        transformers_logging.disable_progress_bar()
    try:
        return run(args)
    except Exception as error:  # a UserError (or a refused value raised in hil: hil.data.errors.user_error)
        shown = None if os.environ.get(DEBUG_ENV) else user_error(error)
        if shown is None:
            raise
        print(f"{PROG}: error: {' '.join(one_line(shown).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
