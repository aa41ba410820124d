"""The ``hil`` command: every stage behind one name, in the Lightning convention (YAML, ``--config``,
``--print_config``).

    hil fit --config colbert --config presets/cpu                  # training: the LightningCLI of train.py
    hil evaluate --config eval/scifact --model runs/demo/export    # an experiment: datasets x models x settings
    hil evaluate --model M --dataset scifact --config eval/plaid --print_config
    hil index --model M --dataset scifact --settings.backend plaid # build (or check and reuse) the index only
    hil search --model M --dataset scifact --output run.trec        # one model's run, written as a TREC file
    hil beir | paper | analyze | share | teacher | engines ...      # the experiments and tools

``hil evaluate`` parses an :class:`~hil.evaluation.experiment.Experiment` (datasets, models, evaluation settings
with the back-end's build-time and search-time settings chosen by ``class_path``, statistics, output) from YAML
files and options, later ones winning; ``--model`` and ``--dataset`` add one model / dataset each. The recipes in
``hil/configs/eval/`` are found by name (``--config eval/plaid``). It is run by
:func:`hil.evaluation.runner.run_experiment`, the engine ``evaluate.py`` and the BEIR command use.

Errors a user can fix are one line, ``error: ...``, exit status 2 (``HIL_DEBUG=1`` keeps the traceback).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from jsonargparse import ArgumentParser

from hil.cli.parsers import CommandParser
from hil.errors import UserError, check_output_path, exit_status

if TYPE_CHECKING:  # the subcommands import what they run (``hil --help`` imports no torch)
    from hil.evaluation.evaluate import EvaluationSettings
    from hil.evaluation.experiment import DatasetSpec, Experiment, ModelSpec
    from hil.evaluation.search_run import QuerySearch

PROG = "hil"
DELEGATED = ("beir", "paper", "teacher", "engines", "analyze", "share")  # hil.cli.<name>.main(argv) each
TRAINING = ("fit", "validate", "test", "predict")


# What each command is for (its --help's first lines), and the experiment's options it does not take: every option
# a command lists is one it honours (hil index writes no results and compares no numbers; hil search writes one
# run file, with neither a baseline nor statistics).
COMMAND_DESCRIPTIONS = {
    "evaluate": "hil evaluate: measure models on datasets (datasets x models under one set of evaluation settings), "
                "beside BM25 or a first-stage run, with bootstrap intervals and paired tests; writes metrics.json, "
                "per_query.json and each column's <name>.json and <name>.trec into --output.",
    "index": "hil index: build the index of one model over one dataset's corpus (the slice --max_docs / "
             "--max_queries give) under --settings.index_root, or check and reuse it, and print where it is. "
             "hil search and hil evaluate given the same model, dataset, slice and build-time settings search "
             "this index.",
    "search": "hil search: rank one dataset's queries (evaluated as hil evaluate does), or your own without "
              "judgments, with one model and write the run as a TREC file (--output). Your own: --queries FILE "
              "(a BEIR queries.jsonl, or id<TAB>text lines) or --query TEXT (repeatable; ids q1, q2, ...; each "
              "query's top hits printed). Searched: the index hil index built "
              "for the same model, dataset, slice and build-time settings (or built now), or an index folder "
              "(--index, its model read from its record). --jsonl writes each query's top --hits documents with "
              "their texts.",
}
NOT_TAKEN = {
    "evaluate": {"command", "settings.keep_head_scores", "settings.keep_candidate_sources"},
    "index": {"command", "output", "statistics", "baseline", "folders", "resume", *(f"settings.{key}" for key in (
        "mode", "k", "metrics", "drop_self_matches", "search", "backend_params", "ncandidates", "rerank_depth",
        "query_batch_size", "batched_search", "query_encoding", "keep_candidate_sources", "keep_head_scores"))},
    "search": {"command", "output", "statistics", "baseline", "folders", "settings.keep_head_scores",
               "settings.keep_candidate_sources"},
}
SLICE_HELP = {
    "evaluate": {"docs": "a seeded slice of every dataset's documents (judged ones kept; a dataset's own max_docs "
                         "wins)",
                 "queries": "a seeded slice of every dataset's queries (a dataset's own max_queries wins)"},
    "index": {"docs": "index a seeded slice of the documents (those judged for the slice's queries kept); give hil "
                      "search the same slice to search this index",
              "queries": "the slice's queries: the documents judged for them are always in the index (give hil "
                         "search the same)"},
    "search": {"docs": "a seeded slice of the documents searched (judged ones kept; hil index with the same slice "
                       "built its index)",
               "queries": "a seeded slice of the queries ranked"},
}
EVALUATE_OUTPUT = "results/hil-evaluate"


def experiment_parser(prog: str, command: str = "evaluate") -> ArgumentParser:
    """An :class:`Experiment` from YAML and options, with ``--model`` / ``--dataset`` shortcuts, listing only the
    options ``command`` (``evaluate``, ``index``, ``search``) honours (:data:`NOT_TAKEN`)."""
    from hil.evaluation.experiment import Experiment
    from hil.evaluation.settings import EvaluationSettings

    parser = CommandParser(prog=prog, description=textwrap.fill(COMMAND_DESCRIPTIONS[command], 100))
    one = command in ("index", "search")
    parser.add_argument("--model", type=str, default=[], action="append",
                        help="the model (a path, a hub id, NAME=PATH)" if one else
                             "add a model (a path, a hub id, NAME=PATH); repeatable")
    parser.add_argument("--dataset", type=str, default=[], action="append",
                        help="the dataset (a BEIR name or folder, irds:<id>)" if one else
                             "add a dataset (a BEIR name or folder, irds:<id>); repeatable")
    for option in ("docs", "queries"):
        parser.add_argument(f"--max_{option}", type=Optional[int], default=None, help=SLICE_HELP[command][option])
    if command == "evaluate":
        parser.add_argument("--output", type=str, default=EVALUATE_OUTPUT,
                            help="the results folder: metrics.json, per_query.json, <column>.json and <column>.trec "
                                 "(per dataset in <output>/<dataset>/ unless --folders flat). Columns there made "
                                 "with the same settings are kept; another evaluation's columns in it are kept "
                                 "beside this one's")
    elif command == "search":
        parser.add_argument("--output", type=str, required=True,
                            help="the TREC run file written (one line per ranked document); an existing file is "
                                 "refused unless --overwrite. The records that let a rerun reuse the ranking of a "
                                 "dataset's judged queries go to <output>.parts/")
        parser.add_argument("--overwrite", action="store_true",
                            help="replace the run file --output (and --jsonl) when it is there")
        parser.add_argument("--queries", type=str | None, default=None, metavar="FILE",
                            help="rank these queries (no judgments needed) instead of the dataset's: a BEIR "
                                 "queries.jsonl or id<TAB>text lines (.jsonl / .tsv / .txt, else told by the first "
                                 "line); a bad line is refused naming file:line")
        parser.add_argument("--query", type=list[str], default=[], metavar="TEXT",
                            help="rank this text (repeatable; ids q1, q2, ... in order) and print its top --hits")
        parser.add_argument("--index", type=str | None, default=None, metavar="FOLDER",
                            help="search this index folder (what hil index printed) instead of a dataset's; the "
                                 "model is the one it records unless --model is given (it must be the model the "
                                 "index was built with)")
        parser.add_argument("--jsonl", type=str | None, default=None, metavar="FILE",
                            help="also write each query's top --hits as JSON lines: query_id, query, rank, doc_id, "
                                 "score, title, text (refused when there unless --overwrite)")
        parser.add_argument("--hits", type=int, default=10,
                            help="the hits per query printed (--query) and written to --jsonl")
    parser.add_class_arguments(Experiment, nested_key=None, fail_untyped=False,
                               skip={"output", "settings", *NOT_TAKEN[command]}, default={"datasets": [], "models": []})
    # a group of its own: jsonargparse skips a nested dataclass's keys only when it is added by itself
    parser.add_class_arguments(EvaluationSettings, "settings", fail_untyped=False,
                               skip={key.removeprefix("settings.") for key in NOT_TAKEN[command]
                                     if key.startswith("settings.")})
    return parser


SLICE_SHORTCUTS = ("max_docs", "max_queries")


def with_slices(dataset: Any, slices: dict[str, int | None]) -> dict[str, Any]:
    """A dataset entry (a dict or a parsed namespace) with the ``--max-docs`` / ``--max-queries`` it does not set."""
    entry = dataset.as_dict() if hasattr(dataset, "as_dict") else dict(dataset)
    return {**entry, **{key: value for key, value in slices.items()
                        if value is not None and entry.get(key) is None}}


def parse_experiment(argv: list[str], prog: str, *, command: str = "evaluate") -> Experiment:
    """The experiment ``argv`` describes to ``command`` (``evaluate``, ``index``, ``search``: each its own options,
    :func:`experiment_parser`); with ``--print_config`` it is printed as YAML (``--model`` / ``--dataset`` folded
    into ``models`` / ``datasets``, so that the output given back as ``--config`` is the same experiment) and
    :class:`SystemExit` (0) ends the command."""
    return parse_command(argv, prog, command)[0]


def parse_command(argv: list[str], prog: str, command: str) -> tuple[Experiment | None, dict[str, Any]]:
    """:func:`parse_experiment`, and the options that are the command's own, not the experiment's (``hil search``'s
    ``overwrite``, and its own queries: then ``own["request"]`` is what :func:`query_search` made of them, and the
    experiment is None). Every output is checked before any work (:func:`hil.errors.check_output_path`):
    ``hil search``'s ``--output`` is a run file, refused when it is there unless ``--overwrite`` (the experiment
    writes its records into ``<output>.parts/``); ``hil index`` writes nothing but the index, so its experiment's
    output is the index root (never written into: a dataset's files are written only when a column is)."""
    printing = "--print_config" in argv  # printed below, with --model / --dataset folded in
    parser = experiment_parser(prog, command)
    config = parser.parse_args([arg for arg in joined_queries(argv) if arg != "--print_config"])
    argv = parser.argv  # --config recipes resolved to their files
    for value in config.pop("model") or []:
        named = "=" in value and not os.path.exists(value)
        name, _, source = value.partition("=") if named else ("", "", value)
        config.models = [*config.models, {"source": source, **({"name": name} if name else {})}]
    config.datasets = [*config.datasets, *({"name": name} for name in config.pop("dataset") or [])]
    slices = {key: config.pop(key) for key in SLICE_SHORTCUTS}
    if any(value is not None for value in slices.values()):
        config.datasets = [with_slices(dataset, slices) for dataset in config.datasets]
    config.pop("config", None)
    config = parser.parse_object({key: value for key, value in config.as_dict().items()})  # typed again
    if printing:
        dumped = config.clone()
        for shortcut in ("config", "model", "dataset", *SLICE_SHORTCUTS):  # folded into models / datasets above
            dumped.pop(shortcut, None)
        print(parser.dump(dumped, skip_validation=True))
        raise SystemExit(0)
    if command == "index" and config.settings.index_root is None:
        raise UserError("hil index writes an index: give --settings.index_root")
    fields = {key: value for key, value in vars(parser.instantiate(config)).items()
              if key not in ("config", "model", "dataset", *SLICE_SHORTCUTS) and not key.startswith("__")}
    own = {key: fields.pop(key) for key in ("overwrite", *QUERY_OPTIONS) if key in fields}
    if command == "search" and (own["query"] or own["queries"] or own["index"]):
        own["request"] = query_search(fields, own, slices, argv)
        return None, own
    if not fields["datasets"]:
        raise UserError("no dataset: give --dataset NAME or datasets in a --config file")
    if command == "search":
        run_file = Path(fields["output"])
        check_output_path(run_file, "--output", folder=False)
        if run_file.exists() and not own["overwrite"]:
            raise UserError(f"--output {run_file}: the file is there; give --overwrite to replace it, or another "
                            "path")
        own["run_file"] = run_file
        fields["output"] = f"{run_file}.parts"
    elif command == "index":
        fields["output"] = fields["settings"].index_root
    from hil.evaluation.experiment import Experiment

    return Experiment(**{**fields, "command": {"argv": argv}}), own


QUERY_OPTIONS = ("query", "queries", "index", "jsonl", "hits")  # hil search's own queries (query_search)


def joined_queries(argv: list[str]) -> list[str]:
    """``argv`` with its ``--query TEXT`` options (repeatable, free text) joined into one ``--query`` JSON list where
    the first was: the form a typed list option reads (a YAML value, so ``a: b`` or ``[x]`` in a text would not
    be read as typed), and the ``query:`` list ``--print_config`` prints."""
    texts, out, position = [], [], None
    arguments = iter(argv)
    for arg in arguments:
        if arg in ("--query", "--query+") or arg.startswith(("--query=", "--query+=")):
            text = arg.partition("=")[2] if "=" in arg else next(arguments, None)
            if text is None:
                raise UserError("--query: give the query's text after it")
            texts.append(text)
            position = len(out) if position is None else position
        else:
            out.append(arg)
    if position is not None:
        out[position:position] = ["--query", json.dumps(texts, ensure_ascii=False)]
    return out


def query_search(fields: dict[str, Any], own: dict[str, Any], slices: dict[str, int | None],
                 argv: list[str]) -> QuerySearch:
    """``hil search`` over the user's own queries (:mod:`hil.evaluation.search_run`): the queries read (a bad line
    refused naming file:line), the index's record read, the dataset found, every output checked, all before any
    model loads."""
    from hil.data.beir import dataset_source
    from hil.data.irds import is_irds_name
    from hil.data.query_files import inline_queries, read_queries_file
    from hil.evaluation.experiment import Experiment
    from hil.evaluation.search_run import (
        QuerySearch,
        check_new_file,
        read_index_record,
        recorded_model,
        settings_for_index,
    )

    if own["query"] and own["queries"]:
        raise UserError("give --query TEXT or --queries FILE, not both")
    if not (own["query"] or own["queries"]):
        raise UserError(f"--index {own['index']} searches the queries you give: add --query TEXT or --queries FILE")
    if own["hits"] < 1:
        raise UserError(f"--hits must be >= 1 (got {own['hits']})")
    models, datasets, settings = fields["models"], fields["datasets"], fields["settings"]
    if len(models) > 1:
        raise UserError(f"hil search ranks with one --model (got {len(models)})")
    if models and models[0].transforms:
        raise UserError("hil search ranks your queries with the model itself; post-hoc transforms are measured by "
                        "hil evaluate")
    run_file = check_new_file(fields["output"], "--output", own["overwrite"])
    jsonl = check_new_file(own["jsonl"], "--jsonl", own["overwrite"]) if own["jsonl"] else None
    if jsonl is not None and jsonl.resolve() == run_file.resolve():
        raise UserError(f"--jsonl {jsonl}: the same file as --output; give two paths")
    queries = inline_queries(own["query"]) if own["query"] else read_queries_file(own["queries"])
    if own["query"]:  # made-up ids (q1, ...) never name the query's own document, as BEIR's rule assumes
        settings = replace(settings, drop_self_matches=False)
    common = {"queries": queries, "run_file": run_file, "jsonl": jsonl, "overwrite": own["overwrite"],
              "hits": own["hits"], "printed": bool(own["query"]), "seed": fields["seed"],
              "data_dir": fields["data_dir"], "quiet": fields["quiet"]}
    if own["index"]:
        index = Path(own["index"])
        if datasets or any(value is not None for value in slices.values()):
            raise UserError(f"--index {index} searches that index's own corpus (and slice): leave out --dataset and "
                            "--max_docs / --max_queries, or leave out --index to search a dataset")
        meta = read_index_record(index)
        settings = settings_for_index(settings, index, meta)
        model = models[0] if models else recorded_model(index, meta)
        return QuerySearch(settings=settings, index=index, index_meta=meta, model=model,
                           model_from_index=not models, **common)
    if len(models) != 1 or len(datasets) != 1:
        raise UserError(f"hil search takes one --model and one --dataset, or --index (got {len(models)} and "
                        f"{len(datasets)})")
    if datasets[0].first_stage_run is not None:
        raise UserError(f"dataset {datasets[0].name}: its first_stage_run ranks its own queries; yours are ranked "
                        "by the model (settings.mode full or exhaustive, or rerank of BM25's candidates)")
    if not is_irds_name(datasets[0].name):  # a misspelled dataset or a missing folder: refused before the model
        dataset_source(datasets[0].name, fields["data_dir"])
    experiment = Experiment(**{**fields, "settings": settings, "output": str(run_file.parent),
                               "command": {"argv": argv}})
    return QuerySearch(settings=settings, experiment=experiment, **common)


def evaluate_command(argv: list[str]) -> int:
    """Run the experiment (``--print_config``: print it as YAML, jsonargparse's own, and stop)."""
    experiment = parse_experiment(argv, f"{PROG} evaluate")  # first: --help and refusals load no model code
    from hil.evaluation.results import format_statistics, format_table
    from hil.evaluation.runner import run_experiment

    for result in run_experiment(experiment):  # a folder of forums (cqadupstack): each forum, then their mean
        print(f"\n{result.describe()}")
        print(format_table([*result.evaluations(), *(column.as_evaluation() for column in result.others)]))
        if result.others:
            print(f"(also in metrics.json: {', '.join(column.name for column in result.others)}, written into "
                  f"{result.metrics_path.parent} by another evaluation with the same settings)")
        if result.statistics is not None:
            print("\n" + format_statistics(result.statistics))
        print(f"wrote {result.metrics_path}")
    return 0


def single(experiment: Experiment, what: str) -> tuple[ModelSpec, DatasetSpec, EvaluationSettings]:
    if len(experiment.models) != 1 or len(experiment.datasets) != 1:
        raise UserError(f"{what} takes one --model and one --dataset (got {len(experiment.models)} and "
                        f"{len(experiment.datasets)})")
    forums = experiment.datasets[0].forums(experiment.data_dir)
    if forums:  # BEIR's cqadupstack: one index and one run per forum
        raise UserError(f"{what} takes one dataset; --dataset {experiment.datasets[0].name} is a folder of "
                        f"{len(forums)} ({', '.join(Path(forum.name).name for forum in forums)}): give one of them, "
                        f"e.g. {forums[0].name} (hil evaluate takes the folder whole)")
    return experiment.models[0], experiment.datasets[0], experiment.settings


def index_command(argv: list[str]) -> int:
    """Build the index of one model over one dataset's corpus (or check and reuse it); print where it is. The
    dataset is loaded and sliced as ``hil search`` and ``hil evaluate`` load and slice it
    (:class:`~hil.evaluation.runner.DatasetRun`), and the model given the IDF they give it, so that the index is
    theirs: the same corpus and encoder fingerprints, the same folder. Beside it, ``corpus.json`` records the dataset
    slice (:func:`~hil.evaluation.search_run.write_corpus_record`), and the index records the model by its absolute
    path when it is a local one, so that ``hil search --index`` finds both from anywhere."""
    experiment = parse_experiment(argv, f"{PROG} index", command="index")
    model, dataset_spec, _ = single(experiment, "hil index")
    if os.path.exists(model.source):
        model = replace(model, source=str(Path(model.source).resolve()))
    if model.transforms:
        raise UserError(f"hil index builds the index of the model itself; a post-hoc transform's "
                        f"({', '.join(model.transforms)}) is derived from it by hil evaluate: give the transforms "
                        "there")
    from hil.evaluation.evaluate import document_store, place_encoder
    from hil.evaluation.runner import DatasetRun, load_model, set_corpus_idf
    from hil.evaluation.search_run import write_corpus_record

    part = DatasetRun(experiment, dataset_spec)
    encoder = load_model(model, experiment.seed)
    if model.idf == "corpus":
        set_corpus_idf(encoder, part.dataset, model.source)
    place_encoder(encoder, part.settings)
    index = document_store(encoder, part.dataset, part.settings)
    write_corpus_record(index.directory, experiment, dataset_spec, part.dataset.fingerprint())
    print(f"{index.directory} ({index.how_opened}): {index.n_docs} documents, {index.n_tokens} tokens, "
          f"backend {index.backend_settings['kind']} {index.backend_settings['params']}")
    return 0


def search_command(argv: list[str]) -> int:
    """One model's ranking of one dataset's queries, written as a TREC run (``--output`` is the run file; the
    experiment's column files, which let a rerun with the same settings reuse the ranking, go to
    ``<output>.parts/``, whose run is the same file as ``--output``: a hard link, not a second copy). With the
    user's own queries (``--queries`` / ``--query`` / ``--index``): :func:`own_queries_search`."""
    experiment, own = parse_command(argv, f"{PROG} search", "search")
    if experiment is None:
        return own_queries_search(own["request"])
    model, _, _ = single(experiment, "hil search")
    if len(model.transforms) > 1:
        raise UserError(f"hil search writes one run: give it one transform at most (got {len(model.transforms)}; "
                        "hil evaluate measures several)")
    from hil.evaluation.runner import run_experiment

    folder, run_file = Path(experiment.output), own["run_file"]
    (result,) = run_experiment(replace(experiment, folders="flat", baseline=False,
                                       statistics=replace(experiment.statistics, enabled=False)))
    column = result.columns[-1]
    link_run(folder / f"{column.name}.trec", run_file, overwrite=own["overwrite"])
    print(f"wrote {run_file} ({column.name}: nDCG@10 {column.record['metrics'].get('ndcg@10', float('nan')):.4f}; "
          f"the records that let a rerun reuse it: {folder}/)")
    return 0


def own_queries_search(request: QuerySearch) -> int:
    """Rank the user's queries (no judgments), write the run (and the JSONL hits), print each typed query's top
    hits (:mod:`hil.evaluation.search_run`)."""
    from hil.evaluation.search_run import hit_lines, run_query_search, write_outputs

    result = run_query_search(request)
    write_outputs(result, request)
    details = result.details
    where = details.get("index_dir") or "the corpus encoded in memory"
    if request.printed:
        for qid in result.queries:
            print("\n".join(hit_lines(result, qid, request.hits)) + "\n")
        if result.texts is None:
            print(f"(no texts: {request.index} has no record of its corpus; hil index writes one)")
    print(f"wrote {request.run_file} ({len(result.run)} queries, {details.get('mode')} search of {where})"
          + (f" and {request.jsonl}" if request.jsonl is not None else ""))
    return 0


def link_run(source: Path, run_file: Path, *, overwrite: bool = True) -> None:
    """``run_file`` becomes the same file as ``source`` (:func:`hil.provenance.place_file`); without ``overwrite`` a
    file another process wrote there since the command started is refused, not replaced."""
    from hil.provenance import place_file

    try:
        place_file(source, run_file, overwrite=overwrite)
    except FileExistsError:
        raise UserError(f"--output {run_file}: written by another process while this search ran; this ranking is "
                        f"kept in {source} (give --overwrite to replace the file)") from None


def training(argv: list[str]) -> int:
    from hil.cli.train import train_main

    train_main(argv)
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {"evaluate": evaluate_command, "index": index_command,
                                                   "search": search_command}


def usage() -> str:
    return (f"usage: {PROG} {{{','.join([*TRAINING, *COMMANDS, *DELEGATED])}}} [options]  "
            f"({PROG} <command> --help for each)")


def main(argv: list[str] | None = None) -> int:
    """The ``hil`` console script; -> its exit status (2 and one line for a user error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage() + "\n\n" + __doc__)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]

    def dispatch() -> int:
        if command in TRAINING:
            return training(argv)
        if command in DELEGATED:
            import importlib

            return int(importlib.import_module(f"hil.cli.{command}").main(rest) or 0)
        if command not in COMMANDS:
            raise UserError(f"unknown command {command!r}; {usage()}")
        return COMMANDS[command](rest)

    try:
        return exit_status(f"{PROG} {command}", dispatch)
    except SystemExit as exit_:  # argparse / LightningCLI / --print_config: the message is already printed
        return int(exit_.code or 0) if not isinstance(exit_.code, str) else 2


if __name__ == "__main__":
    sys.exit(main())
