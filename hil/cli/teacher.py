"""``hil teacher``: distillation data made here -- candidates mined, scored by a teacher, written as n-way examples
(:mod:`hil.experiments.teacher`, whose docstring is this command's help)."""

from __future__ import annotations

import sys

from hil.cli.parsers import SettingsParser, as_options, module_doc, returns_status
from hil.errors import UserError, check_output_path, exit_status
from hil.experiments.teacher_settings import TeacherSettings, output_files

PROG = "hil teacher"


def build_parser() -> SettingsParser:
    """The options are :class:`~hil.experiments.teacher_settings.TeacherSettings`' fields."""
    summary, details = module_doc("hil.experiments.teacher")
    return SettingsParser(TeacherSettings, prog=PROG, description=summary, epilog=details)


def refuse_existing_outputs(output: str, beir: bool, overwrite: bool) -> None:
    """Nothing of the user's is replaced unasked: the examples file, or a file the teacher writes beside it (a
    BEIR dataset's ``.queries.tsv`` may well be the user's own), exists and ``--overwrite`` is not given."""
    files = output_files(output, beir)
    there = [path for path in files.values() if path.exists()]
    if there and not overwrite:
        beside = "" if there[0] == files["examples"] else f": {there[0]} (written beside it)"
        raise UserError(f"--output {output}{beside} exists; pass --overwrite to replace it")


@returns_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parsed = parser.parse_args(argv)

    def make_and_report() -> int:
        settings = parser.settings(parsed)
        check_output_path(settings.output, "--output", folder=False)  # before mining and scoring, not after
        refuse_existing_outputs(settings.output, settings.dataset is not None, settings.overwrite)
        if not settings.quiet:  # a first line at once: torch, the texts and the teacher take seconds to load
            print(f"[teacher] loading {settings.dataset or settings.queries} and the teacher {settings.teacher}",
                  file=sys.stderr, flush=True)
        from transformers.utils import logging as transformers_logging

        from hil.experiments import teacher

        if settings.quiet:
            transformers_logging.disable_progress_bar()
        record = as_options(lambda: teacher.run(settings))
        counts = record["counts"]
        print(f"wrote {counts['written']} of {counts['queries']} queries to {record['files']['examples']} "
              f"({record['files']['meta']}); train from it: hil fit ... --data.source TeacherOutput "
              f"--data.source.path {record['files']['examples']}")
        return 0

    return exit_status(PROG, make_and_report)


if __name__ == "__main__":
    sys.exit(main())
