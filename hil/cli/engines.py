"""``hil engines``: the isotropy x engine study (:mod:`hil.experiments.engines`, whose docstring is this command's
help)."""

from __future__ import annotations

import sys
from pathlib import Path

from hil.cli.parsers import CommandParser, module_doc, returns_status
from hil.errors import UserError, exit_status


def build_parser() -> CommandParser:
    summary, details = module_doc("hil.experiments.engines")
    parser = CommandParser(prog="hil engines", description=summary, epilog=details)
    parser.add_argument("--models", required=True, help="comma-separated name=path (exports, checkpoints, ...)")
    parser.add_argument("--dataset", required=True, help="a BEIR name or folder")
    parser.add_argument("--max-queries", type=int, default=None, help="a seeded slice of the queries")
    parser.add_argument("--max-docs", type=int, default=None, help="a seeded slice of the corpus (judged kept)")
    parser.add_argument("--output", "--out", required=True,
                        help="output folder (engines.json, engines.md, the figure)")
    parser.add_argument("--index-root", default="indexes", help="where the models' indexes are built or reused")
    parser.add_argument("--depth", type=int, default=100, help="documents ranked; recall is measured at it")
    parser.add_argument("--max-tokens", type=int, default=20_000, help="document tokens sampled for isotropy")
    parser.add_argument("--n-bootstrap", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=12345, help="slices, token samples, bootstrap")
    return parser


@returns_status
def main(argv: list[str] | None = None) -> int:
    """The command; -> its exit status (2 and one line for a user error)."""
    return exit_status("hil engines", lambda: run_command(argv))


def run_command(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from hil.data.beir import load_beir
    from hil.experiments.engines import engine_study, model_specs

    if args.depth < 1 or args.max_tokens < 2:
        raise UserError("--depth must be >= 1 and --max-tokens >= 2")
    models = model_specs(args.models)
    dataset = load_beir(args.dataset)
    if args.max_queries or args.max_docs:
        dataset = dataset.subset(args.max_queries, args.max_docs, seed=args.seed)
    engine_study(models, dataset, Path(args.output), depth=args.depth, index_root=args.index_root,
                 max_tokens=args.max_tokens, n_bootstrap=args.n_bootstrap, seed=args.seed,
                 command="hil engines " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(Path(args.output) / "engines.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
