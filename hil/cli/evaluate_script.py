"""``evaluate.py``: zero-shot evaluation of a trained (or untrained) retriever on a BEIR dataset.

Examples:
    python evaluate.py --model runs/colbert/export --dataset scifact
    python evaluate.py --model sentence-transformers/all-MiniLM-L6-v2 --dataset scifact   # untrained head
    python evaluate.py --model last.ckpt --dataset nfcorpus --mode rerank
    python evaluate.py --model M --dataset msmarco/dl19 --first-stage-run ../shared/data/msmarco/dl19/bm25-top100.trec \
        --relevance-level 2                                  # TREC DL19: re-rank the official BM25 top 100
    python evaluate.py --model M --dataset irds:beir/scifact/test   # any ir_datasets id (pip install ir_datasets)
    python evaluate.py --model runs/colbert/export --dataset scifact --transform whitening   # + post-hoc whitening
    python evaluate.py --model M --dataset scifact --transform "whitening:k=64" --transform "remove-pcs:n_components=1"
    python evaluate.py --model runs/colbert/export --dataset scifact --encode-documents onnx-int8   # fast CPU indexing

With --transform, the model is evaluated as is and with each post-hoc transform (fitted on the corpus tokens of the
base index, saved as transform_<head>.pt in the derived index folder); metrics.json then also holds bootstrap
intervals and paired tests of every run against the untransformed model (and BM25).

On a GPU machine the model runs on the GPU by default (--device auto); --precision fp16 encodes the corpus with
autocast, --processes N encodes it on N GPUs (or N CPU processes) through Lightning Fabric:
    python evaluate.py --model runs/colbert/export --dataset scifact --device cuda --precision fp16
    python evaluate.py --model runs/colbert/export --dataset nfcorpus --device cuda --processes 4

Judgments of documents that are not in the corpus (some official BEIR qrels have them; a re-ranking set such as
TREC DL19's has many) are kept, as BEIR and trec_eval keep them (they count in the ideal DCG), with one warning
giving their count, recorded in metrics.json.

With --first-stage-run, the candidates are a TREC run file's (each query's best --rerank-depth documents by score,
all of them by default); the run itself, scored as given, is the baseline row instead of BM25.

A user error is one line on stderr, "evaluate.py: error: <message>", naming the option, file and line, or key, with
exit status 2 and no traceback (HIL_DEBUG=1 keeps it): an option out of range, a malformed data or run file, a
missing dataset or split, a model that cannot be loaded, FAISS parameters that do not fit the corpus.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hil.cli.parsers import CommandParser, namespace_dict, returns_status
from hil.errors import UserError, exit_status
from hil.evaluation.statistics import P_ADJUST_METHODS
from hil.retrieval.backends.configs import BACKEND_CHOICES, configs_from_params, with_search_values
from hil.retrieval.choices import DOCUMENT_ENCODINGS, PRECISIONS

if TYPE_CHECKING:  # the functions import what they run: --help loads no torch
    from hil.evaluation.evaluate import EvaluationSettings
    from hil.evaluation.runner import Experiment

PROG = "evaluate.py"
# Integer options that must be >= 1 when given (checked by ``check_arguments``, named in the message).
POSITIVE_OPTIONS = ("k", "ncandidates", "rerank_depth", "relevance_level", "processes", "batch_size",
                    "query_batch_size", "threads",
                    "max_queries", "max_docs", "dim", "query_maxlen", "doc_maxlen", "transform_max_tokens",
                    "bootstrap_samples")


def json_object(text: str | dict[str, Any]) -> dict[str, Any]:
    """An option's ``type``: a JSON object of numbers or booleans (a back-end's parameters), given as text or (from a
    ``--config`` file, or already decoded by jsonargparse) as a mapping."""
    try:
        value = text if isinstance(text, dict) else json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"nlist\": 1024}}', got {text!r}")
    for key, item in value.items():
        if not isinstance(item, (int, float)) or (not isinstance(item, bool) and not 0 <= item < float("inf")):
            raise argparse.ArgumentTypeError(f"{key!r} must be a number >= 0 or a boolean, got {item!r}")
    return value


def build_parser() -> CommandParser:
    summary, _, details = (__doc__ or "").partition("\n\n")
    parser = CommandParser(prog=PROG, description=summary, epilog=details)
    parser.add_argument("--model", required=True,
                        help="export directory, Lightning .ckpt, or a backbone name/path (ColBERT head untrained)")
    parser.add_argument("--dataset", required=True,
                        help="BEIR name (under HIL_DATA_DIR, else the hub) or folder, or irds:<ir_datasets id> "
                             "(e.g. irds:beir/scifact/test, irds:msmarco-passage/trec-dl-2019/judged; needs "
                             "pip install ir_datasets)")
    parser.add_argument("--split", default=None,
                        help="the qrels split (default: the dataset's own: dev for msmarco, as BEIR, else test)")
    parser.add_argument("--data-dir", default=None, help="overrides HIL_DATA_DIR")
    parser.add_argument("--mode", choices=("full", "rerank", "exhaustive", "bm25"), default=None,
                        help="full ranking through the index's back-end (default), re-ranking the first stage's top "
                             "--rerank-depth (default with --first-stage-run), exhaustive exact scoring of every "
                             "document (of the candidates, with --first-stage-run), or BM25 alone")
    parser.add_argument("--first-stage-run", default=None, metavar="PATH",
                        help="a TREC run file (qid Q0 docid rank score tag) whose documents are re-ranked instead of "
                             "BM25's, e.g. ../shared/data/msmarco/dl19/bm25-top100.trec; it is the baseline row")
    parser.add_argument("--no-bm25", action="store_true", help="skip the BM25 baseline row")
    parser.add_argument("--k", type=int, default=1000, help="documents kept per query")
    parser.add_argument("--ncandidates", type=int, default=None, help="FAISS neighbours per query token")
    parser.add_argument("--rerank-depth", type=int, default=None,
                        help="candidates re-ranked per query (default: BM25's top 100, or every document of "
                             "--first-stage-run)")
    parser.add_argument("--relevance-level", type=int, default=None,
                        help="lowest grade binary metrics (recall, MAP, MRR, P) count as relevant; TREC DL uses 2 "
                             "(default: 1, or for irds: the level of the dataset's official measures). nDCG always "
                             "uses the grades")
    parser.add_argument("--backend", "--faiss", dest="backend", choices=BACKEND_CHOICES, default="flat",
                        help="the index's search back-end (--faiss: the name before 0.2)")
    parser.add_argument("--backend-params", "--faiss-params", dest="backend_params", type=json_object, default=None,
                        help='its settings as JSON, build-time and search-time together, e.g. \'{"nlist": 1024, '
                             '"m": 16, "nbits": 8, "nprobe": 16}\' (ivfpq) or \'{"n_centroids": 4096, "nprobe": 2, '
                             '"ndocs": 256, "stage2_docs": 1024}\' (plaid; unset: ColBERTv2\'s values for --k); '
                             'build-time ones decide the index, '
                             'search-time ones are applied at every search (hil.retrieval.backends.configs)')
    parser.add_argument("--encode-documents", choices=("fp32", *DOCUMENT_ENCODINGS), default="fp32",
                        help="how the corpus is encoded (queries stay fp32): onnx-int8 = ONNX Runtime with int8 "
                             "matrix products, ~2x PyLate's speed on a CPU (bench/README has its nDCG@10 cost); "
                             "onnx = the same runtime in fp32; int8 = PyTorch SmoothQuant int8; "
                             "compile = torch.compile")
    parser.add_argument("--tokenizer-workers", type=int, default=None,
                        help="DataLoader workers that tokenize the corpus ahead of the encoder (keeps a GPU busy; "
                             "the index is the same; default: 0 on a CPU, 2 on a GPU)")
    parser.add_argument("--encode-queries", choices=("fp32", "onnx"), default="fp32",
                        help="full ranking on a CPU: onnx encodes the queries through ONNX Runtime's fused fp32 graph "
                             "(the same vectors to float rounding, ~1.6x faster per query here)")
    parser.add_argument("--verify-index", choices=("auto", "sizes", "full"), default="auto",
                        help="how a reused index's files are checked against what index.json recorded: sizes always, "
                             "SHA-256 checksums too for indexes up to 1 GiB (auto), always (full) or never (sizes)")
    parser.add_argument("--device", default="auto",
                        help="where the model runs: auto (the GPU when there is one), cpu, cuda, cuda:N")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="corpus encoding autocast: fp16 or bf16 on a GPU (bf16 also on a CPU); queries stay fp32")
    parser.add_argument("--processes", type=int, default=1,
                        help="processes that encode the corpus (Lightning Fabric): one per GPU with --device cuda, "
                             "CPU processes otherwise; the index is the same as a one-process build's")
    parser.add_argument("--faiss-gpu", action=argparse.BooleanOptionalAction, default=None,
                        help="FAISS search on the GPU (default: on the model's GPU when faiss-gpu is installed)")
    parser.add_argument("--index-root", default="indexes")
    parser.add_argument("--output", default=None, help="results folder (default results/<dataset>/<model>)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="documents per encoding batch (default: 32 on a CPU, 128 on a GPU)")
    parser.add_argument("--query-batch-size", type=int, default=None,
                        help="queries encoded and, in full ranking, searched together (default: 64 on a CPU, 1024 on "
                             "a GPU)")
    parser.add_argument("--per-query-search", action="store_true",
                        help="full ranking one query at a time (the same rankings as batched; for latency)")
    parser.add_argument("--threads", type=int, default=None, help="torch/FAISS threads")
    parser.add_argument("--max-queries", type=int, default=None, help="evaluate a slice (sampled with --seed)")
    parser.add_argument("--max-docs", type=int, default=None, help="corpus slice: judged docs + sampled others")
    parser.add_argument("--seed", type=int, default=12345, help="sampling and untrained-head initialisation")
    parser.add_argument("--keep-self-matches", action="store_true", help="do not drop doc ids equal to the query id")
    parser.add_argument("--dim", type=int, default=None,
                        help="head size for an untrained backbone (default 128); a trained model keeps its own")
    parser.add_argument("--query-maxlen", type=int, default=None)
    parser.add_argument("--doc-maxlen", type=int, default=None)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--idf", choices=("model", "corpus"), default="model",
                        help="ColBERT-HIL query-term IDF: the table stored with the model (default), or recomputed on "
                             "the evaluated dataset: its corpus, or its queries for a model with the authors' IDF "
                             "formula (the index is then keyed to that IDF)")
    parser.add_argument("--transform", action="append", default=[], metavar="SPEC",
                        help='post-hoc transform of the heads\' vectors, e.g. "whitening", "whitening:k=64", '
                             '"remove-pcs:n_components=1", "standardize", "nice" (repeatable; the untransformed '
                             'model is evaluated too)')
    parser.add_argument("--transform-mode", choices=("token", "sequence"), default="token",
                        help="fit on corpus token vectors (token-wise) or on mean-pooled documents (sequence-wise)")
    parser.add_argument("--transform-max-tokens", type=int, default=200_000,
                        help="corpus tokens sampled (seeded) to fit a token-wise transform")
    parser.add_argument("--no-stats", action="store_true",
                        help="skip bootstrap intervals and paired significance tests")
    parser.add_argument("--bootstrap-samples", type=int, default=1000)
    parser.add_argument("--p-adjust", choices=P_ADJUST_METHODS, default="holm",
                        help="multiple-comparison adjustment of the paired tests' p-values, printed and recorded "
                             "beside the raw ones: holm (Holm-Bonferroni), bh (Benjamini-Hochberg) or none")
    return parser


def settings_from(args: argparse.Namespace) -> EvaluationSettings:
    """The evaluation settings the command line asks for (BM25-only runs use none)."""
    from hil.evaluation.evaluate import EvaluationSettings

    backend, search = configs_from_params(args.backend, args.backend_params)
    search = with_search_values(args.backend, search, {"ncandidates": args.ncandidates})
    return EvaluationSettings(
        mode="full" if args.mode == "bm25" else args.mode, k=args.k, drop_self_matches=not args.keep_self_matches,
        index_root=args.index_root, backend=backend, search=search,
        rerank_depth=args.rerank_depth or 100, batch_size=args.batch_size, query_batch_size=args.query_batch_size,
        batched_search=not args.per_query_search,
        document_encoding=None if args.encode_documents == "fp32" else args.encode_documents,
        query_encoding=None if args.encode_queries == "fp32" else args.encode_queries,
        progress=not args.quiet, device=args.device, precision=args.precision, processes=args.processes,
        tokenizer_workers=args.tokenizer_workers,
        faiss_gpu=args.faiss_gpu, verify_index=args.verify_index)


def experiment_from(args: argparse.Namespace) -> Experiment:
    """The experiment the command line describes: one dataset (sliced, with its first-stage run), the model as is and
    under each ``--transform``, BM25 or the run file as baseline, written into ``--output`` itself."""
    from hil.evaluation.evaluate import run_name
    from hil.evaluation.runner import DatasetSpec, Experiment, ModelSpec, StatisticsSettings

    dataset = DatasetSpec(args.dataset, split=args.split, first_stage_run=args.first_stage_run,
                          rerank_depth=args.rerank_depth, relevance_level=args.relevance_level,
                          max_queries=args.max_queries, max_docs=args.max_docs)
    models = [] if args.mode == "bm25" else [ModelSpec(
        args.model, name="{architecture}-{mode}", transforms=tuple(args.transform),
        transform_name="{architecture}+{transform}-{transform_mode}-{mode}", transform_mode=args.transform_mode,
        transform_max_tokens=args.transform_max_tokens, idf=args.idf, dim=args.dim, query_maxlen=args.query_maxlen,
        doc_maxlen=args.doc_maxlen)]
    statistics = StatisticsSettings(enabled=not args.no_stats, bootstrap_samples=args.bootstrap_samples,
                                    p_adjust=args.p_adjust)
    output = args.output or Path("results") / run_name(Path(args.dataset.removeprefix("irds:")).name) / \
        Path(args.model).name
    return Experiment([dataset], models, output, settings=settings_from(args), statistics=statistics,
                      baseline=not args.no_bm25 or args.mode == "bm25", folders="flat", seed=args.seed,
                      data_dir=args.data_dir, quiet=True, command=namespace_dict(args))


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse arguments that cannot work, naming the options (a :class:`UserError`): an integer option below 1, a
    combination of options, FAISS parameters the back-end does not take, a device or precision not there; fills in
    the default ``--mode``. (Parameters that do not fit the corpus, such as an IVF ``nlist`` above its number of
    token vectors, are refused by the back-end once the corpus is encoded.)"""
    from hil.retrieval.corpus_encoding import check_processes
    from hil.retrieval.devices import check_precision, resolve_device

    if args.mode is None:
        args.mode = "rerank" if args.first_stage_run else "full"
    for option in POSITIVE_OPTIONS:
        value = getattr(args, option)
        if value is not None and value < 1:
            raise UserError(f"--{option.replace('_', '-')} must be >= 1 (got {value})")
    if args.mode == "bm25" and args.transform:
        raise UserError("--transform needs a model (not --mode bm25)")
    if args.first_stage_run and args.mode not in ("rerank", "exhaustive"):
        raise UserError(f"--first-stage-run gives candidates to re-rank: it needs --mode rerank or exhaustive, not "
                        f"{args.mode}")
    try:  # the back-end's own settings classes: unknown keys and out-of-range values, before any work
        _, search = configs_from_params(args.backend, args.backend_params)
        with_search_values(args.backend, search, {"ncandidates": args.ncandidates})
    except ValueError as error:
        raise UserError(f"--backend-params / --ncandidates with --backend {args.backend}: {error}") from None

    try:
        device = resolve_device(args.device)
        check_precision(args.precision, device)
    except ValueError as error:
        raise UserError(f"--device/--precision: {error}") from None
    try:
        check_processes(args.processes, device)
    except ValueError as error:
        raise UserError(f"--{error}") from None  # its messages start with "processes"


@returns_status
def main(argv: list[str] | None = None) -> int:
    """``evaluate.py`` with ``argv``; -> the exit status. A user error (see the module docstring) is one line on
    stderr and status 2; ``HIL_DEBUG=1`` raises it with its traceback instead."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return exit_status(PROG, lambda: run(argv))


def run(argv: list[str]) -> int:
    """Evaluate as ``argv`` asks and write the results; user errors are raised (``main`` prints them)."""
    args = build_parser().parse_args(argv)  # before the imports below: --help and refused options load no torch
    import faiss
    import torch
    from transformers.utils import logging as transformers_logging

    from hil.evaluation.results import format_statistics, format_table
    from hil.evaluation.runner import run_experiment

    if any(arg.split("=")[0] in ("--faiss", "--faiss-params") for arg in argv):
        logging.getLogger(__name__).warning("--faiss / --faiss-params are deprecated (one release): use --backend / "
                                            "--backend-params")
    check_arguments(args)
    if args.quiet:  # transformers' own bars too ("Loading weights"), so that stderr holds only what went wrong
        transformers_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)
    (result,) = run_experiment(experiment_from(args))
    dataset, evaluations, path = result.dataset, result.evaluations(), result.metrics_path
    print(f"\n{dataset.name} ({dataset.split}: {len(dataset.queries)} queries, {len(dataset.corpus)} documents)")
    print(format_table(evaluations))
    if result.statistics is not None:
        print("\n" + format_statistics(result.statistics))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
