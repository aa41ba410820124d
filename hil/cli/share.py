"""``hil share EXPORT REPO_ID [--metrics metrics.json ...]``: push an export with its model card.

``--card_only`` writes the card (``README.md``) into the export and pushes nothing. A user error (no export, a bad
repository id, a metrics file that is not ``hil evaluate``'s) is one line on stderr, exit status 2.
"""

from __future__ import annotations

import os
import sys

from hil.cli.parsers import SettingsParser, returns_status
from hil.errors import exit_status
from hil.modeling.hub import ShareSettings, share

PROG = "hil share"


def build_parser() -> SettingsParser:
    """The options are :class:`~hil.modeling.hub.ShareSettings`' fields; EXPORT and REPO_ID may lead, unnamed."""
    summary, _, details = (__doc__ or "").partition("\n\n")
    return SettingsParser(ShareSettings, prog=PROG, description=summary, epilog=details,
                          positional=("export", "repo_id"))


@returns_status
def main(argv: list[str] | None = None) -> int:
    """The command; -> its exit status (2 and one line for a user error)."""
    parser = build_parser()
    settings = parser.settings(parser.parse_args(argv))
    return exit_status(PROG, lambda: print(share(settings, token=os.environ.get("HF_TOKEN"))) or 0)


if __name__ == "__main__":
    sys.exit(main())
