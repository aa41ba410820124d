"""``hil share EXPORT REPO_ID [--metrics metrics.json ...]``: push an export with its model card.

``--card-only`` writes the card (``README.md``) into the export and pushes nothing. A user error (no export, a bad
repository id, a metrics file that is not ``evaluate.py``'s) is one line on stderr, exit status 2.
"""

from __future__ import annotations

import os
import sys

from hil.cli.parsers import CommandParser, returns_status
from hil.errors import exit_status
from hil.modeling.hub import push_to_hub, write_model_card


def build_parser() -> CommandParser:
    summary, _, details = (__doc__ or "").partition("\n\n")
    parser = CommandParser(prog="hil share", description=summary, epilog=details)
    parser.add_argument("export", help="an export folder (train.py --export_dir, hil.export_model)")
    parser.add_argument("repo_id", help="the hub repository, user-or-org/name")
    parser.add_argument("--metrics", nargs="*", default=[], help="metrics.json files whose figures go into the card")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    parser.add_argument("--card-only", action="store_true", help="write README.md into the export; push nothing")
    return parser


@returns_status
def main(argv: list[str] | None = None) -> int:
    """The command; -> its exit status (2 and one line for a user error)."""
    args = build_parser().parse_args(argv)

    def share() -> int:
        if args.card_only:
            print(f"wrote {write_model_card(args.export, args.metrics, args.repo_id)}")
        else:
            push_to_hub(args.export, args.repo_id, args.metrics, private=args.private,
                        token=os.environ.get("HF_TOKEN"))
            print(f"pushed {args.export} to https://huggingface.co/{args.repo_id}")
        return 0

    return exit_status("hil share", share)


if __name__ == "__main__":
    sys.exit(main())
