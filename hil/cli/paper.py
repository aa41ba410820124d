"""``hil paper``: HIL (001)'s tables and figures at a chosen scale, in one resumable command
(:mod:`hil.experiments.paper`, whose docstring is this command's help)."""

from __future__ import annotations

import os
import sys

from hil.cli.parsers import Renamed, SettingsParser, as_options, module_doc, returns_status
from hil.errors import DEBUG_ENV, one_line, user_error
from hil.experiments.paper_settings import PaperSettings

PROG = "hil paper"


# the spelling of 0.2 (hil.compat.SHIMS): one name per idea across the commands, as hil evaluate spells it
RENAMED = {"--out": Renamed("output")}


def build_parser() -> SettingsParser:
    """The options are :class:`~hil.experiments.paper_settings.PaperSettings`' fields."""
    summary, details = module_doc("hil.experiments.paper")
    return SettingsParser(PaperSettings, prog=PROG, description=summary, epilog=details, renamed=RENAMED)


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
    parser = build_parser()
    settings = parser.settings(parser.parse_args(argv))
    from hil.experiments.paper import run_paper

    report = as_options(lambda: run_paper(settings, "hil paper " + " ".join(argv if argv is not None else
                                                                              sys.argv[1:])))
    if settings.report_only:
        print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
