"""``hil paper``: HIL (001)'s tables and figures at a chosen scale, in one resumable command
(:mod:`hil.experiments.paper`, whose docstring is this command's help)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from hil.cli.parsers import CommandParser, module_doc, returns_status
from hil.errors import DEBUG_ENV, UserError, one_line, user_error
from hil.evaluation.statistics import P_ADJUST_METHODS
from hil.experiments.profiles import DATASETS, PROFILES, REPO_CONFIGS, VARIANTS
from hil.retrieval.choices import PRECISIONS

PROG = "hil paper"


def build_parser() -> CommandParser:
    summary, details = module_doc("hil.experiments.paper")
    parser = CommandParser(prog=PROG, description=summary, epilog=details)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    parser.add_argument("--output", "--out", default=None, help="output folder (default results/<profile>)")
    parser.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--datasets", default=None, help=f"comma-separated subset of {','.join(DATASETS)}")
    parser.add_argument("--max-steps", type=int, default=None, help="override the profile's training steps")
    parser.add_argument("--configs", default=str(REPO_CONFIGS),
                        help="config folder (colbert.yaml, variants/, presets/)")
    parser.add_argument("--device", default=None,
                        help="where models are evaluated: auto (the GPU when there is one; the default), cpu, cuda, "
                             "cuda:N")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="corpus encoding autocast at evaluation (default: the profile's, fp32)")
    parser.add_argument("--p-adjust", choices=P_ADJUST_METHODS, default=None,
                        help="multiple-comparison adjustment of the tests against ColBERT, shown beside the raw "
                             "p-values and used for the dagger: holm (Holm-Bonferroni; the default), bh "
                             "(Benjamini-Hochberg) or none")
    parser.add_argument("--seeds", default=None,
                        help="comma-separated training seeds: the experiment once per seed into <out>/seed-<s>/, "
                             "then <out>/seeds.md (every variant over the seeds, against ColBERT); default: one run "
                             "with the config's seed_everything")
    parser.add_argument("--no-corpus-idf", action="store_true",
                        help="leave out the ColBERT-HIL columns with IDF recomputed on each evaluated dataset")
    parser.add_argument("--force", action="store_true", help="redo finished stages instead of skipping them")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the report from finished stages")
    parser.add_argument("--publish", default=None, metavar="DIR",
                        help="then copy the report, summary.json, figures and per-model metric JSONs (no runs, "
                             "score matrices or models) to DIR, e.g. docs/paper-cpu")
    return parser


@returns_status
def main(argv: list[str] | None = None) -> int:
    """The command; -> its exit status: 2 and one line for a user error (an option, a variant or dataset name, a
    folder without results: ``hil.errors.user_error``), 1 and one line naming the log when a stage failed
    (:class:`ExperimentError`); ``HIL_DEBUG=1`` keeps the traceback."""
    try:
        return run_command(argv)
    except Exception as error:
        if os.environ.get(DEBUG_ENV):
            raise
        from hil.experiments.paper_columns import ExperimentError

        shown = error if isinstance(error, ExperimentError) else user_error(error)
        if shown is None:
            raise
        print(f"error: {one_line(shown)}", file=sys.stderr)
        return 1 if isinstance(shown, ExperimentError) else 2


def run_command(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from hil.experiments.paper import (
        log,
        names,
        publish,
        publish_seeds,
        run_profile,
        run_seeds,
        seed_list,
        write_outputs,
    )
    from hil.experiments.seed_report import write_seed_report
    from hil.retrieval.devices import check_precision, resolve_device

    profile = PROFILES[args.profile]
    if args.max_steps is not None:
        if args.max_steps < 1:
            raise UserError(f"--max-steps must be at least 1 (got {args.max_steps})")
        profile = replace(profile, max_steps=args.max_steps)
    variants, datasets = names("--variants", args.variants, VARIANTS), names("--datasets", args.datasets, DATASETS)
    profile = replace(profile, configs=Path(args.configs))
    overrides = {k: v for k, v in (("device", args.device), ("precision", args.precision),
                                   ("p_adjust", args.p_adjust)) if v is not None}
    if overrides:
        profile = replace(profile, **overrides)
    try:
        check_precision(profile.precision, resolve_device(profile.device))
    except ValueError as error:
        raise UserError(f"--device/--precision: {error}") from None
    if args.no_corpus_idf:
        profile = replace(profile, corpus_idf=False)
    seeds = seed_list(args.seeds)
    out = Path(args.output or Path("results") / profile.name)
    command = "hil paper " + " ".join(argv if argv is not None else sys.argv[1:])
    if seeds is not None:
        if args.report_only:
            print(write_seed_report(out, profile, seeds, command=command))
        else:
            run_seeds(profile, out, seeds, variants=variants, datasets=datasets, force=args.force, command=command)
        if args.publish:
            log(f"published {publish_seeds(out, seeds, Path(args.publish))}")
        return 0
    if args.report_only:
        recorded = out / "profile.json"  # the command that ran the experiment, not this rewrite
        if recorded.is_file():
            command = json.loads(recorded.read_text()).get("command") or command
        print(write_outputs(out, profile, command=command))
    else:
        run_profile(profile, out, variants=variants, datasets=datasets, force=args.force, command=command)
    if args.publish:
        log(f"published {publish(out, Path(args.publish))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
