"""``hil beir``: the whole of BEIR in one command, as HIL (001) Table 2 (:mod:`hil.experiments.beir`, whose
docstring is this command's help)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from hil.cli.parsers import CommandParser, module_doc, namespace_dict, returns_status
from hil.errors import exit_status
from hil.evaluation.settings import MODES
from hil.evaluation.statistics import P_ADJUST_METHODS
from hil.experiments.beir_sets import BY_KEY, check_selection
from hil.retrieval.backends.configs import BACKEND_CHOICES
from hil.retrieval.choices import PRECISIONS

PROG = "hil beir"


def build_parser() -> CommandParser:
    summary, details = module_doc("hil.experiments.beir")
    parser = CommandParser(prog=PROG, description=summary, epilog=details)
    add = parser.add_argument
    add("--model", action="append", required=True, metavar="[NAME=]PATH",
        help="export folder, Lightning .ckpt or backbone (untrained head); repeatable; NAME is its column "
             "(default: the folder's name, its parent's for an 'export' folder)")
    add("--baseline", default=None, help="the model the others are compared with (default: the first --model)")
    add("--datasets", default="all", help="'all' (every one found locally) or a comma-separated list of: "
        f"{', '.join(BY_KEY)}")
    add("--data-dir", default=None, help="overrides HIL_DATA_DIR")
    add("--output", "--out", default="results/beir",
        help="output folder (results per dataset, table.md, table.json)")
    add("--mode", choices=MODES, default="full", help="full ranking through the index (001's setting), exhaustive "
        "exact scoring of every document, or re-ranking BM25's top --rerank-depth; a dataset that ships a "
        "first-stage run is always re-ranked")
    add("--k", type=int, default=1000, help="documents ranked per query")
    add("--rerank-depth", type=int, default=100, help="first-stage candidates re-ranked per query")
    add("--backend", "--faiss", dest="backend", choices=BACKEND_CHOICES, default="flat",
        help="the index's search back-end (mode full; --faiss: the name before 0.2)")
    add("--backend-params", "--faiss-params", dest="backend_params", type=Optional[dict], default=None,
        help='its build-time and search-time settings as JSON, e.g. \'{"nlist": 1024, "nprobe": 16}\'')
    add("--index-root", default="indexes", help="where indexes live; 'none' encodes in memory (not with mode full)")
    add("--batch-size", type=int, default=None,
        help="documents per encoding batch (default: 32 on a CPU, 128 on a GPU)")
    add("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add("--precision", choices=PRECISIONS, default="fp32", help="the corpus encoding's autocast")
    add("--encode-queries", choices=("fp32", "onnx"), default="fp32",
        help="full ranking on a CPU: queries through ONNX Runtime's fused fp32 graph (same vectors, faster)")
    add("--processes", type=int, default=1, help="corpus-encoding processes")
    add("--max-queries", type=int, default=None, help="evaluate a slice of each dataset (sampled with --seed)")
    add("--max-docs", type=int, default=None, help="corpus slice: judged documents plus sampled others")
    add("--seed", type=int, default=12345, help="slices, untrained-head initialisation, bootstrap")
    add("--dim", type=int, default=None, help="head size for an untrained backbone")
    add("--bootstrap-samples", type=int, default=1000, help="bootstrap samples of the 95%% intervals and tests")
    add("--p-adjust", choices=P_ADJUST_METHODS, default="holm", help="multiple-comparison adjustment of the paired "
        "tests' p-values, shown beside the raw ones and used for the dagger: holm (Holm-Bonferroni), bh "
        "(Benjamini-Hochberg) or none")
    add("--quiet", action="store_true", help="no progress bars or progress lines")
    return parser


@returns_status
def main(argv: list[str] | None = None) -> int:
    args = argparse.Namespace(**namespace_dict(build_parser().parse_args(argv)))
    if exit_status(PROG, lambda: check_selection(args.datasets, args.data_dir)):  # before any model (torch) code
        return 2
    from transformers.utils import logging as transformers_logging

    from hil.experiments import beir

    if args.quiet:
        transformers_logging.disable_progress_bar()
    return exit_status(PROG, lambda: beir.run(args))


if __name__ == "__main__":
    sys.exit(main())
