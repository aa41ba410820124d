"""``evaluate.py``: zero-shot evaluation of a trained (or untrained) retriever on a BEIR dataset.

Examples:
    python evaluate.py --model runs/colbert/export --dataset scifact
    python evaluate.py --model sentence-transformers/all-MiniLM-L6-v2 --dataset scifact   # untrained head
    python evaluate.py --model last.ckpt --dataset nfcorpus --mode rerank
    python evaluate.py --model M --dataset msmarco/dl19 --first-stage-run ../shared/data/msmarco/dl19/bm25-top100.trec \
        --relevance-level 2                                  # TREC DL19: re-rank the official BM25 top 100
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
import os
import sys
from pathlib import Path
from typing import Any

import faiss
import torch
from transformers.utils import logging as transformers_logging

from hil.data.beir import BeirDataset, load_beir
from hil.data.errors import DEBUG_ENV, UserError, one_line, user_error
from hil.evaluation.evaluate import (Evaluation, EvaluationSettings, evaluate, evaluate_bm25, evaluate_run_file,
                                     evaluate_transformed, first_stage, subset_with_first_stage)
from hil.evaluation.results import evaluation_statistics, format_statistics, format_table, write_results
from hil.modeling.contracts import Encoder
from hil.modeling.hil import HILEncoder
from hil.modeling.loading import load_encoder
from hil.retrieval.backends.registry import FAISS_KINDS as BACKEND_KINDS
from hil.retrieval.backends.registry import backend_class
from hil.retrieval.corpus_encoding import check_processes
from hil.retrieval.devices import PRECISIONS, check_precision, resolve_device
from hil.retrieval.fast_encode import DOCUMENT_ENCODINGS
from hil.retrieval.index import encoder_fingerprint

PROG = "evaluate.py"
# Integer options that must be >= 1 when given (checked by ``check_arguments``, named in the message).
POSITIVE_OPTIONS = ("k", "ncandidates", "rerank_depth", "relevance_level", "processes", "batch_size", "threads",
                    "max_queries", "max_docs", "dim", "query_maxlen", "doc_maxlen", "transform_max_tokens",
                    "bootstrap_samples")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are a :class:`UserError` (printed by :func:`main` as one line naming the option), not a
    usage screen followed by the message."""

    def error(self, message: str):
        raise UserError(f"{message} (see {self.prog} --help)")


def json_object(text: str) -> dict[str, Any]:
    """An argparse ``type``: a JSON object of numbers or booleans (FAISS parameters)."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"nlist\": 1024}}', got {text!r}")
    for key, item in value.items():
        if not isinstance(item, (int, float)) or (not isinstance(item, bool) and not 0 <= item < float("inf")):
            raise argparse.ArgumentTypeError(f"{key!r} must be a number >= 0 or a boolean, got {item!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="export directory, Lightning .ckpt, or a backbone name/path (ColBERT head untrained)")
    parser.add_argument("--dataset", required=True, help="BEIR name (under HIL_DATA_DIR, else the hub) or folder")
    parser.add_argument("--split", default="test")
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
    parser.add_argument("--relevance-level", type=int, default=1,
                        help="lowest grade binary metrics (recall, MAP, MRR, P) count as relevant; TREC DL uses 2. "
                             "nDCG always uses the grades")
    parser.add_argument("--faiss", choices=BACKEND_KINDS, default="flat", help="the index's search back-end")
    parser.add_argument("--faiss-params", type=json_object, default=None,
                        help='JSON, e.g. \'{"nlist": 1024, "m": 16, "nbits": 8, "nprobe": 16}\'')
    parser.add_argument("--encode-documents", choices=("fp32", *DOCUMENT_ENCODINGS), default="fp32",
                        help="how the corpus is encoded (queries stay fp32): onnx-int8 = ONNX Runtime with int8 "
                             "matrix products, ~2x PyLate's speed on a CPU (bench/README has its nDCG@10 cost); "
                             "onnx = the same runtime in fp32; int8 = PyTorch SmoothQuant int8; "
                             "compile = torch.compile")
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
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch/FAISS threads")
    parser.add_argument("--max-queries", type=int, default=None, help="evaluate a slice (sampled with --seed)")
    parser.add_argument("--max-docs", type=int, default=None, help="corpus slice: judged docs + sampled others")
    parser.add_argument("--seed", type=int, default=12345, help="sampling and untrained-head initialisation")
    parser.add_argument("--keep-self-matches", action="store_true", help="do not drop doc ids equal to the query id")
    parser.add_argument("--dim", type=int, default=128, help="head size for an untrained backbone")
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
    return parser


def settings_from(args: argparse.Namespace) -> EvaluationSettings:
    """The evaluation settings the command line asks for (BM25-only runs use none)."""
    return EvaluationSettings(
        mode="full" if args.mode == "bm25" else args.mode, k=args.k, drop_self_matches=not args.keep_self_matches,
        index_root=args.index_root, backend=args.faiss, backend_params=args.faiss_params,
        ncandidates=args.ncandidates, rerank_depth=args.rerank_depth or 100, batch_size=args.batch_size,
        document_encoding=None if args.encode_documents == "fp32" else args.encode_documents,
        progress=not args.quiet, device=args.device, precision=args.precision, processes=args.processes,
        faiss_gpu=args.faiss_gpu, verify_index=args.verify_index)


def load_model(args: argparse.Namespace, dataset: BeirDataset) -> Encoder:
    """The model of ``--model`` (an untrained head with ``--dim`` etc. for a bare backbone), with its IDF
    recomputed on the evaluated corpus for ``--idf corpus``."""
    overrides = {k: v for k, v in {"dim": args.dim, "query_maxlen": args.query_maxlen,
                                   "doc_maxlen": args.doc_maxlen}.items() if v is not None}
    torch.manual_seed(args.seed)  # an untrained head is a seeded random projection
    encoder = load_encoder(args.model, **overrides)
    if args.idf == "corpus":
        if not isinstance(encoder, HILEncoder):
            raise UserError(f"--idf corpus needs a model with IDF weights (ColBERT-HIL); {args.model} is "
                            f"{encoder.architecture}")
        if encoder.idf_from_queries:  # the HIL authors' IDF is taken over the target dataset's queries
            encoder.set_idf_from_texts(list(dataset.queries.values()),
                                       source=f"{dataset.name} queries ({dataset.split})")
        else:
            encoder.set_idf_from_texts(dataset.documents(), source=f"{dataset.name} corpus ({dataset.split})")
    return encoder


def evaluate_model(args: argparse.Namespace, dataset: BeirDataset, candidates: dict[str, list[str]] | None
                   ) -> tuple[list[Evaluation], dict[str, Any]]:
    """The model as is and under each ``--transform``, over ``candidates`` when given; what each run was (source,
    settings, fingerprint)."""
    encoder = load_model(args, dataset)
    settings = settings_from(args)
    evaluations, models = [], {}
    with torch.inference_mode():
        evaluations.append(evaluate(encoder, dataset, settings, candidates=candidates))
        models[evaluations[-1].name] = {"source": args.model, "settings": encoder.settings(),
                                        "fingerprint": encoder_fingerprint(encoder)}
        for spec in args.transform:
            evaluation, transformed = evaluate_transformed(
                encoder, dataset, spec, settings, transform_mode=args.transform_mode,
                max_tokens=args.transform_max_tokens, seed=args.seed, candidates=candidates)
            evaluations.append(evaluation)
            models[evaluation.name] = {"source": args.model, "settings": transformed.settings(),
                                       "fingerprint": encoder_fingerprint(transformed)}
    return evaluations, models


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse arguments that cannot work, naming the options (a :class:`UserError`): an integer option below 1, a
    combination of options, FAISS parameters the back-end does not take, a device or precision not there; fills in
    the default ``--mode``. (Parameters that do not fit the corpus, such as an IVF ``nlist`` above its number of
    token vectors, are refused by the back-end once the corpus is encoded.)"""
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
    if args.faiss_params:
        try:  # the back-end's own list of what it accepts
            backend_class(args.faiss).check_params(args.faiss_params)
        except ValueError as error:
            raise UserError(f"--faiss-params with --faiss {args.faiss}: {error}") from None
    try:
        device = resolve_device(args.device)
        check_precision(args.precision, device)
    except ValueError as error:
        raise UserError(f"--device/--precision: {error}") from None
    try:
        check_processes(args.processes, device)
    except ValueError as error:
        raise UserError(f"--{error}") from None  # its messages start with "processes"


def load_data(args: argparse.Namespace) -> tuple[BeirDataset, Evaluation | None, dict[str, list[str]] | None]:
    """The dataset (sliced as asked), the first-stage run file scored on it, and that run's candidates."""
    # Judgments of documents outside the corpus (official BEIR qrels have some; a re-ranking set has many) are kept,
    # as BEIR and trec_eval keep them (they count in the ideal DCG): one warning gives their count, and
    # metrics.json records it.
    dataset = load_beir(args.dataset, split=args.split, data_dir=args.data_dir, judged_outside_corpus="keep",
                        relevance_level=args.relevance_level)
    first = None
    if args.first_stage_run:  # checked against the whole dataset, then sliced with it
        first = evaluate_run_file(args.first_stage_run, dataset, drop_self_matches=not args.keep_self_matches)
        first.details["rerank_depth"] = args.rerank_depth or first.details["depth"]
    dataset, first, candidates = subset_with_first_stage(
        dataset, first, args.max_queries or None, args.max_docs or None, seed=args.seed, depth=args.rerank_depth,
        drop_self_matches=not args.keep_self_matches)
    if first is not None and len(first.run) < len(dataset.queries):
        logging.getLogger(__name__).warning("%s: %d of %d judged queries have no document in the run (they score 0)",
                                            args.first_stage_run, len(dataset.queries) - len(first.run),
                                            len(dataset.queries))
    return dataset, first, candidates


def main(argv: list[str]) -> int:
    """``evaluate.py`` with ``argv``; -> the exit status. A user error (see the module docstring) is one line on
    stderr and status 2; ``HIL_DEBUG=1`` raises it with its traceback instead."""
    try:
        return run(argv)
    except Exception as error:
        shown = None if os.environ.get(DEBUG_ENV) else user_error(error)
        if shown is None:
            raise
        print(f"{PROG}: error: {one_line(shown)}", file=sys.stderr)
        return 2


def run(argv: list[str]) -> int:
    """Evaluate as ``argv`` asks and write the results; user errors are raised (``main`` prints them)."""
    args = build_parser().parse_args(argv)
    check_arguments(args)
    if args.quiet:  # transformers' own bars too ("Loading weights"), so that stderr holds only what went wrong
        transformers_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)
    dataset, first, candidates = load_data(args)
    evaluations: list[Evaluation] = [first] if first is not None else []
    models: dict[str, Any] = {}
    bm25 = None
    if first is None and (not args.no_bm25 or args.mode in ("rerank", "bm25")):
        depth = args.rerank_depth or 100
        bm25 = evaluate_bm25(dataset, k=max(args.k, depth), drop_self_matches=not args.keep_self_matches)
        evaluations.append(bm25)
        candidates = first_stage(bm25, depth) if args.mode == "rerank" else None
    if args.mode != "bm25":
        model_evaluations, models = evaluate_model(args, dataset, candidates)
        evaluations += model_evaluations
    baseline = first or bm25
    statistics = None
    if not args.no_stats and evaluations:
        model_runs = [e.name for e in evaluations if e is not baseline]
        pairs = [(name, baseline.name) for name in model_runs if baseline is not None]
        pairs += [(name, model_runs[0]) for name in model_runs[1:]]  # each transform vs the plain model
        statistics = evaluation_statistics(evaluations, metrics=("ndcg@10", "mrr@10", "recall@100"), pairs=pairs,
                                           n_bootstrap=args.bootstrap_samples, seed=args.seed)
    output = Path(args.output) if args.output else Path("results") / dataset.name / Path(args.model).name
    path = write_results(output, dataset, evaluations, vars(args), models, statistics=statistics)
    print(f"\n{dataset.name} ({dataset.split}: {len(dataset.queries)} queries, {len(dataset.corpus)} documents)")
    print(format_table(evaluations))
    if statistics is not None:
        print("\n" + format_statistics(statistics))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
