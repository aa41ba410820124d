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

import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from jsonargparse import ArgumentParser

from hil.cli.parsers import CommandParser
from hil.errors import UserError, check_output_path, exit_status

if TYPE_CHECKING:  # the subcommands import what they run (``hil --help`` imports no torch)
    from hil.evaluation.evaluate import EvaluationSettings
    from hil.evaluation.experiment import DatasetSpec, Experiment, ModelSpec

PROG = "hil"
DELEGATED = ("beir", "paper", "teacher", "engines", "analyze", "share")  # hil.cli.<name>.main(argv) each
TRAINING = ("fit", "validate", "test", "predict")


def experiment_parser(prog: str) -> ArgumentParser:
    """An :class:`Experiment` from YAML and options, with ``--model`` / ``--dataset`` shortcuts."""
    from hil.evaluation.experiment import Experiment

    parser = CommandParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=str, default=[], action="append",
                        help="add a model (a path, a hub id, NAME=PATH); repeatable")
    parser.add_argument("--dataset", type=str, default=[], action="append",
                        help="add a dataset (a BEIR name or folder, irds:<id>); repeatable")
    for option, what in (("docs", "documents (judged ones kept)"), ("queries", "queries")):
        parser.add_argument(f"--max_{option}", type=Optional[int],
                            default=None, help=f"a seeded slice of every dataset's {what} (a dataset's own "
                                               f"max_{option} wins)")
    parser.add_class_arguments(Experiment, nested_key=None, fail_untyped=False,
                               default={"datasets": [], "models": [], "output": "results/hil-evaluate"})
    return parser


SLICE_SHORTCUTS = ("max_docs", "max_queries")


def with_slices(dataset: Any, slices: dict[str, int | None]) -> dict[str, Any]:
    """A dataset entry (a dict or a parsed namespace) with the ``--max-docs`` / ``--max-queries`` it does not set."""
    entry = dataset.as_dict() if hasattr(dataset, "as_dict") else dict(dataset)
    return {**entry, **{key: value for key, value in slices.items()
                        if value is not None and entry.get(key) is None}}


def parse_experiment(argv: list[str], prog: str, *, run_file: bool = False) -> Experiment:
    """The experiment ``argv`` describes; with ``--print_config`` it is printed as YAML (``--model`` / ``--dataset``
    folded into ``models`` / ``datasets``, so that the output given back as ``--config`` is the same experiment) and
    :class:`SystemExit` (0) ends the command. ``run_file``: ``--output`` names a run file (``hil search``), checked
    as a file; the experiment writes its records into ``<output>.parts/``."""
    printing = "--print_config" in argv  # printed below, with --model / --dataset folded in
    parser = experiment_parser(prog)
    config = parser.parse_args([arg for arg in argv if arg != "--print_config"])
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
    fields = {key: value for key, value in vars(parser.instantiate(config)).items()
              if key not in ("config", "model", "dataset", *SLICE_SHORTCUTS) and not key.startswith("__")}
    if not fields["datasets"]:
        raise UserError("no dataset: give --dataset NAME or datasets in a --config file")
    if run_file:
        check_output_path(fields["output"], "--output", folder=False)
        fields["output"] = f"{fields['output']}.parts"
    from hil.evaluation.experiment import Experiment

    return Experiment(**{**fields, "command": {"argv": argv}})


def evaluate_command(argv: list[str]) -> int:
    """Run the experiment (``--print_config``: print it as YAML, jsonargparse's own, and stop)."""
    experiment = parse_experiment(argv, f"{PROG} evaluate")  # first: --help and refusals load no model code
    from hil.evaluation.results import format_statistics, format_table
    from hil.evaluation.runner import run_experiment

    for result in run_experiment(experiment):
        dataset = result.dataset
        print(f"\n{dataset.name} ({dataset.split}: {len(dataset.queries)} queries, {len(dataset.corpus)} documents)")
        print(format_table(result.evaluations()))
        if result.statistics is not None:
            print("\n" + format_statistics(result.statistics))
        print(f"wrote {result.metrics_path}")
    return 0


def single(experiment: Experiment, what: str) -> tuple[ModelSpec, DatasetSpec, EvaluationSettings]:
    if len(experiment.models) != 1 or len(experiment.datasets) != 1:
        raise UserError(f"{what} takes one --model and one --dataset (got {len(experiment.models)} and "
                        f"{len(experiment.datasets)})")
    return experiment.models[0], experiment.datasets[0], experiment.settings


def index_command(argv: list[str]) -> int:
    """Build the index of one model over one dataset's corpus (or check and reuse it); print where it is."""
    experiment = parse_experiment(argv, f"{PROG} index")
    from hil.data.beir import load_beir
    from hil.evaluation.evaluate import document_store, place_encoder
    from hil.evaluation.runner import load_model

    model, dataset_spec, settings = single(experiment, "hil index")
    if settings.index_root is None:
        raise UserError("hil index writes an index: give --settings.index_root")
    dataset = load_beir(dataset_spec.name, split=dataset_spec.split, data_dir=experiment.data_dir)
    encoder = load_model(model, experiment.seed)
    place_encoder(encoder, settings)
    index = document_store(encoder, dataset, settings)
    print(f"{index.directory}: {index.n_docs} documents, {index.n_tokens} tokens, "
          f"backend {index.backend_settings['kind']} {index.backend_settings['params']}")
    return 0


def search_command(argv: list[str]) -> int:
    """One model's ranking of one dataset's queries, written as a TREC run (``--output`` is the run file; the
    experiment's column files, which let a rerun with the same settings reuse the ranking, go to
    ``<output>.parts/``, whose run is the same file as ``--output``: a hard link, not a second copy)."""
    experiment = parse_experiment(argv, f"{PROG} search", run_file=True)
    from hil.evaluation.runner import run_experiment

    single(experiment, "hil search")
    folder = Path(experiment.output)
    run_file = folder.with_name(folder.name[: -len(".parts")])
    (result,) = run_experiment(replace(experiment, folders="flat", baseline=False,
                                       statistics=replace(experiment.statistics, enabled=False)))
    column = result.columns[-1]
    link_run(folder / f"{column.name}.trec", run_file)
    print(f"wrote {run_file} ({column.name}: nDCG@10 {column.record['metrics'].get('ndcg@10', float('nan')):.4f}; "
          f"the records that let a rerun reuse it: {folder}/)")
    return 0


def link_run(source: Path, run_file: Path) -> None:
    """``run_file`` becomes the same file as ``source`` (a hard link, replacing what was there atomically); a copy
    where the file system has no hard links."""
    if run_file.exists() and os.path.samefile(source, run_file):
        return  # a rerun that reused the ranking (rename() between two links of one file would do nothing)
    staging = run_file.with_name(f".{run_file.name}.{os.getpid()}.tmp")
    staging.unlink(missing_ok=True)
    try:
        os.link(source, staging)
    except OSError:
        shutil.copyfile(source, staging)
    os.replace(staging, run_file)


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
