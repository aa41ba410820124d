"""``evaluate.py``: zero-shot evaluation of a trained (or untrained) retriever on a BEIR dataset.

Examples:
    python evaluate.py --model runs/colbert/export --dataset scifact
    python evaluate.py --model sentence-transformers/all-MiniLM-L6-v2 --dataset scifact   # untrained head
    python evaluate.py --model last.ckpt --dataset nfcorpus --mode rerank
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="evaluate.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="export directory, Lightning .ckpt, or a backbone name/path (ColBERT head untrained)")
    parser.add_argument("--dataset", required=True, help="BEIR name (under HIL_DATA_DIR, else the hub) or folder")
    parser.add_argument("--split", default="test")
    parser.add_argument("--data-dir", default=None, help="overrides HIL_DATA_DIR")
    parser.add_argument("--mode", choices=("full", "rerank", "bm25"), default="full")
    parser.add_argument("--no-bm25", action="store_true", help="skip the BM25 baseline row")
    parser.add_argument("--k", type=int, default=1000, help="documents kept per query")
    parser.add_argument("--ncandidates", type=int, default=None, help="FAISS neighbours per query token")
    parser.add_argument("--rerank-depth", type=int, default=100)
    parser.add_argument("--faiss", choices=("flat", "ivfflat", "ivfpq"), default="flat")
    parser.add_argument("--faiss-params", type=json.loads, default=None,
                        help='JSON, e.g. \'{"nlist": 1024, "m": 16, "nbits": 8, "nprobe": 16}\'')
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
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        import faiss

        faiss.omp_set_num_threads(args.threads)
    from hil.data.beir import load_beir
    from hil.evaluation.pipeline import evaluate_bm25, evaluate_retriever, format_table, write_results
    from hil.modeling.loading import load_encoder

    dataset = load_beir(args.dataset, split=args.split, data_dir=args.data_dir)
    if args.max_queries or args.max_docs:
        dataset = dataset.subset(args.max_queries, args.max_docs, seed=args.seed)
    overrides = {k: v for k, v in {"dim": args.dim, "query_maxlen": args.query_maxlen,
                                   "doc_maxlen": args.doc_maxlen}.items() if v is not None}
    torch.manual_seed(args.seed)
    evaluations, models = [], {}
    bm25 = None
    if not args.no_bm25 or args.mode in ("rerank", "bm25"):
        bm25 = evaluate_bm25(dataset, k=max(args.k, args.rerank_depth), drop_self_matches=not args.keep_self_matches)
        evaluations.append(bm25)
    if args.mode != "bm25":
        encoder = load_encoder(args.model, **overrides)
        with torch.inference_mode():
            evaluation = evaluate_retriever(
                encoder, dataset, mode=args.mode, k=args.k, index_root=args.index_root, faiss_kind=args.faiss,
                faiss_params=args.faiss_params, ncandidates=args.ncandidates, rerank_depth=args.rerank_depth,
                batch_size=args.batch_size, drop_self_matches=not args.keep_self_matches, bm25=bm25,
                progress=not args.quiet)
        from hil.retrieval.index import encoder_fingerprint

        models[evaluation.name] = {"source": args.model, "settings": encoder.settings(),
                                   "fingerprint": encoder_fingerprint(encoder)}
        evaluations.append(evaluation)
    output = Path(args.output) if args.output else Path("results") / dataset.name / Path(args.model).name
    path = write_results(output, dataset, evaluations, vars(args), models)
    print(f"\n{dataset.name} ({dataset.split}: {len(dataset.queries)} queries, {len(dataset.corpus)} documents)")
    print(format_table(evaluations))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
