"""``hil teacher``: distillation data made here -- candidates mined, scored by a teacher, written as n-way examples
(:mod:`hil.experiments.teacher`, whose docstring is this command's help)."""

from __future__ import annotations

import sys

from hil.cli.parsers import CommandParser, module_doc, returns_status
from hil.errors import UserError, check_output_path, exit_status
from hil.experiments.teacher_settings import FORMATS, KINDS, output_files

PROG = "hil teacher"


def build_parser() -> CommandParser:
    summary, details = module_doc("hil.experiments.teacher")
    parser = CommandParser(prog=PROG, description=summary, epilog=details)
    parser.add_argument("--queries", help="qid TAB text (a path, or relative to HIL_DATA_DIR)")
    parser.add_argument("--collection", help="pid TAB text (with --queries)")
    parser.add_argument("--dataset", help="a BEIR dataset name or folder instead of --queries/--collection")
    parser.add_argument("--split", default="train", help="the BEIR split whose judged queries are used")
    parser.add_argument("--data-dir", default=None, help="overrides HIL_DATA_DIR")
    parser.add_argument("--qrels", help="judgments for --positives first (BEIR TSV or TREC qrels; with --queries)")
    parser.add_argument("--positives", choices=("none", "first"), default="none",
                        help="first: each query's judged positive leads its line (default none: the teacher ranks)")
    parser.add_argument("--relevance-level", type=int, default=1, help="the least grade that is a positive")
    parser.add_argument("--miner", default="bm25", help="bm25, or a model hil loads")
    parser.add_argument("--index-root", default=None,
                        help="a model miner searches an index built here (default: exact, in memory)")
    parser.add_argument("--depth", type=int, default=100, help="candidates mined per query")
    parser.add_argument("--nway", type=int, default=32, help="documents written per query")
    parser.add_argument("--teacher", required=True, help="a model hil loads, or a Hugging Face model")
    parser.add_argument("--teacher-kind", choices=KINDS, default="auto")
    parser.add_argument("--batch-size", type=int, default=32, help="pairs (or texts) per teacher forward pass")
    parser.add_argument("--max-length", type=int, default=None,
                        help="tokens per pair or text (Hugging Face teachers; default: the model's "
                             "sentence_bert_config.json max_seq_length, else 512)")
    parser.add_argument("--max-queries", type=int, default=None, help="only the first N queries")
    parser.add_argument("--format", choices=FORMATS, default="colbert")
    parser.add_argument("--output", required=True,
                        help="the examples file to write (refused when it or a file written beside it exists)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier --output (the examples, their .meta.json and texts)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


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
    args = build_parser().parse_args(argv)

    def make_and_report() -> int:
        check_output_path(args.output, "--output", folder=False)  # before mining and scoring, not after
        refuse_existing_outputs(args.output, args.dataset is not None, args.overwrite)
        if not args.quiet:  # a first line at once: torch, the texts and the teacher take seconds to load
            print(f"[teacher] loading {args.dataset or args.queries} and the teacher {args.teacher}",
                  file=sys.stderr, flush=True)
        from transformers.utils import logging as transformers_logging

        from hil.experiments import teacher

        if args.quiet:
            transformers_logging.disable_progress_bar()
        record = teacher.run(args)
        counts = record["counts"]
        print(f"wrote {counts['written']} of {counts['queries']} queries to {record['files']['examples']} "
              f"({record['files']['meta']}); train from it: hil fit ... --data.teacher_output "
              f"{record['files']['examples']}")
        return 0

    return exit_status(PROG, make_and_report)


if __name__ == "__main__":
    sys.exit(main())
