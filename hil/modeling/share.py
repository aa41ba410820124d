"""``python -m hil.modeling.share EXPORT REPO_ID [--metrics metrics.json ...]``: push an export with its model card.

``--card-only`` writes the card (``README.md``) into the export and pushes nothing. A user error (no export, a bad
repository id, a metrics file that is not ``evaluate.py``'s) is one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from hil.data.errors import UserError
from hil.modeling.hub import push_to_hub, write_model_card


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hil share", description=__doc__.splitlines()[0])
    parser.add_argument("export", help="an export folder (train.py --export_dir, hil.export_model)")
    parser.add_argument("repo_id", help="the hub repository, user-or-org/name")
    parser.add_argument("--metrics", nargs="*", default=[], help="metrics.json files whose figures go into the card")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    parser.add_argument("--card-only", action="store_true", help="write README.md into the export; push nothing")
    args = parser.parse_args(argv)
    try:
        if args.card_only:
            print(f"wrote {write_model_card(args.export, args.metrics, args.repo_id)}")
        else:
            push_to_hub(args.export, args.repo_id, args.metrics, private=args.private,
                        token=os.environ.get("HF_TOKEN"))
            print(f"pushed {args.export} to https://huggingface.co/{args.repo_id}")
    except UserError as error:
        if os.environ.get("HIL_DEBUG"):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
