"""``hil analyze``: the analysis report of a retriever on a BEIR dataset (Markdown, JSON, PNG figures).

Examples:
    hil analyze --model runs/hil/export --compare-model runs/colbert/export --dataset scifact --output out
    hil analyze --model sentence-transformers/all-MiniLM-L6-v2 --transform whitening --dataset scifact \\
        --output docs/analysis-scifact
    hil analyze --model bert-tiny-splade --dataset scifact --max-queries 20 --max-docs 300 --output /tmp/a

Writes OUTPUT/report.md, OUTPUT/report.json and OUTPUT/*.png. Indexes go to --index-root (shared with evaluate.py,
so a model indexed once is reused).
"""

from __future__ import annotations

import shlex
import sys
from typing import Optional

from hil.cli.parsers import CommandParser, returns_status
from hil.errors import exit_status
from hil.evaluation.statistics import P_ADJUST_METHODS
from hil.retrieval.backends.configs import BACKEND_CHOICES


def build_parser() -> CommandParser:
    summary, _, details = (__doc__ or "").partition("\n\n")
    parser = CommandParser(prog="hil analyze", description=summary, epilog=details)
    parser.add_argument("--model", required=True, help="export directory, .ckpt, backbone name, or \"iso+aniso\"")
    parser.add_argument("--compare-model", default=None,
                        help="a second model; the reference of the per-layer log-difference (001 Fig. 5)")
    parser.add_argument("--transform", action="append", default=[], metavar="SPEC",
                        help='post-hoc transform(s) of the model, e.g. "whitening", "whitening:k=64", '
                             '"remove-pcs:n_components=1", "standardize", "nice" (repeatable)')
    parser.add_argument("--transform-mode", choices=("token", "sequence"), default="token")
    parser.add_argument("--transform-max-tokens", type=int, default=200_000)
    parser.add_argument("--dataset", required=True, help="BEIR name (under HIL_DATA_DIR, else the hub) or folder")
    parser.add_argument("--split", default=None,
                        help="the qrels split (default: the dataset's own: dev for msmarco, as BEIR, else test)")
    parser.add_argument("--data-dir", default=None, help="overrides HIL_DATA_DIR")
    parser.add_argument("--max-queries", type=int, default=None, help="a seeded slice of the queries")
    parser.add_argument("--max-docs", type=int, default=None, help="corpus slice: judged docs + sampled others")
    parser.add_argument("--output", required=True, help="report folder")
    parser.add_argument("--index-root", default="indexes")
    parser.add_argument("--seed", type=int, default=12345, help="sampling and untrained-head initialisation")
    parser.add_argument("--k", type=int, default=1000, help="documents ranked per query")
    parser.add_argument("--ncandidates", type=int, default=None)
    parser.add_argument("--backend", "--faiss", dest="backend", choices=BACKEND_CHOICES, default="flat",
                        help="the index's search back-end (--faiss: the name before 0.2)")
    parser.add_argument("--backend-params", dest="backend_params", type=Optional[dict], default=None,
                        help='its build-time and search-time settings as JSON, e.g. \'{"ndocs": 512}\' for plaid')
    parser.add_argument("--batch-size", type=int, default=None,
                        help="documents per encoding batch (default: 32 on a CPU, 128 on a GPU)")
    parser.add_argument("--dim", type=int, default=None,
                        help="head size for an untrained backbone (default 128); a trained model keeps its own")
    parser.add_argument("--query-maxlen", type=int, default=None)
    parser.add_argument("--doc-maxlen", type=int, default=None)
    parser.add_argument("--bootstrap-samples", type=int, default=1000)
    parser.add_argument("--permutations", type=int, default=10000)
    parser.add_argument("--p-adjust", choices=P_ADJUST_METHODS, default="holm",
                        help="multiple-comparison adjustment of the paired tests' p-values, shown beside the raw ones: "
                             "holm (Holm-Bonferroni), bh (Benjamini-Hochberg) or none")
    parser.add_argument("--pairs", type=int, default=64, help="(query, BM25 top document) pairs for Figs. 2 and 5")
    parser.add_argument("--isotropy-tokens", type=int, default=20_000, help="token sample per isotropy score")
    parser.add_argument("--vocab-pairs", type=int, default=100)
    parser.add_argument("--vocab-examples", type=int, default=3)
    parser.add_argument("--threshold-k", type=int, default=5, help="K of the top-K accuracy / scores (004)")
    parser.add_argument("--coe-psi", type=float, default=10.0, help="percentile of top-K scores for COE/ROE")
    parser.add_argument("--threads", type=int, default=None, help="torch/FAISS threads")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


@returns_status
def main(argv: list[str] | None = None) -> int:
    """The command; -> its exit status (2 and one line for an error a user can fix: an option, a file, a model)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return exit_status("hil analyze", lambda: run(argv))


def run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
        import faiss

        faiss.omp_set_num_threads(args.threads)
    from hil.analysis.report import AnalysisConfig, run_analysis

    config = AnalysisConfig(
        model=args.model, dataset=args.dataset, output=args.output, compare_model=args.compare_model,
        transforms=list(args.transform), transform_mode=args.transform_mode,
        transform_max_tokens=args.transform_max_tokens, split=args.split, data_dir=args.data_dir,
        max_queries=args.max_queries, max_docs=args.max_docs, seed=args.seed, index_root=args.index_root, k=args.k,
        ncandidates=args.ncandidates, backend=args.backend,
        backend_params=args.backend_params, batch_size=args.batch_size, dim=args.dim,
        query_maxlen=args.query_maxlen, doc_maxlen=args.doc_maxlen, n_bootstrap=args.bootstrap_samples,
        n_permutations=args.permutations, p_adjust=args.p_adjust, pairs=args.pairs,
        isotropy_tokens=args.isotropy_tokens,
        vocab_pairs=args.vocab_pairs, vocab_examples=args.vocab_examples, threshold_k=args.threshold_k,
        coe_psi=args.coe_psi, progress=not args.quiet,
        command="hil analyze " + " ".join(shlex.quote(a) for a in argv))
    report = run_analysis(config)
    print(f"wrote {args.output}/report.md, report.json and {len(report['figures'])} figures")
    for row in report["statistics"]["paired"]:
        if row["metric"] == "ndcg@10":
            print(f"  {row['a']} vs {row['b']}: nDCG@10 {row['mean_a']:.4f} vs {row['mean_b']:.4f}, "
                  f"t-test p={row['p_t_test']:.3g} ({args.p_adjust} {row['p_t_test_adjusted']:.3g}), "
                  f"permutation p={row['p_permutation']:.3g} ({args.p_adjust} {row['p_permutation_adjusted']:.3g})")
    return 0
