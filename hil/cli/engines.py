"""``hil engines``: the isotropy x engine study (:mod:`hil.experiments.engines`, whose docstring is this command's
help)."""

from __future__ import annotations

import sys
from pathlib import Path

from hil.cli.parsers import Renamed, SettingsParser, as_options, module_doc, returns_status
from hil.errors import exit_status
from hil.experiments.engines_settings import EngineStudySettings

PROG = "hil engines"
# the spellings of 0.2 (hil.compat.SHIMS): one name per idea across the commands, as hil evaluate spells them
RENAMED = {"--models": Renamed("model", split=True), "--out": Renamed("output"),
           "--n_bootstrap": Renamed("bootstrap_samples")}


def build_parser() -> SettingsParser:
    """The options are :class:`~hil.experiments.engines_settings.EngineStudySettings`' fields."""
    summary, details = module_doc("hil.experiments.engines")
    return SettingsParser(EngineStudySettings, prog=PROG, description=summary, epilog=details, renamed=RENAMED)


@returns_status
def main(argv: list[str] | None = None) -> int:
    """The command; -> its exit status (2 and one line for a user error)."""
    return exit_status(PROG, lambda: run_command(argv))


def run_command(argv: list[str] | None) -> int:
    parser = build_parser()
    settings = parser.settings(parser.parse_args(argv))
    from hil.experiments.engines import run_study

    command = "hil engines " + " ".join(argv if argv is not None else sys.argv[1:])
    as_options(lambda: run_study(settings, command))
    print(Path(settings.output) / "engines.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
