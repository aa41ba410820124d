"""What an index build does on the host besides encoding and k-means (issue 29): the work a GPU build waits for,
per stage, for each ``--repo`` given, side by side in alternating rounds.

    git worktree add /tmp/before <commit>
    python bench/index_host_work.py --repo /tmp/before --repo .

On a GPU, encoding SciFact takes well under a second and k-means runs on the device, so the index build's goal
(<= 3 s) is decided by what the CPU does alone: tokenizing, checking and writing the chunks, joining them, the
inverted file, the checksums. This bench makes the encoder nearly free (a one-layer BERT of hidden size 32 with a
``--dim`` head, ``--doc-maxlen`` tokens, the ``--tokenizer`` of the real model, so the documents have their real
lengths) and times each of those stages in a child process per repository (each checkout runs its own code: this
file imports nothing from ``hil``). The stages are timed by wrapping the functions that do them, where the checkout
has them:

- ``tokenize+encode``: the whole encoding of the chunks (``encode_corpus``) minus the stages below it;
- ``finite check``, ``write chunks`` (``save_npy_atomic``), ``chunk checksums``: per chunk, inside encoding;
- ``join``: the chunks into the index's arrays; ``inverted file``: PLAID's ``build_ivf``;
- ``seal``: ``index.json`` with every file's size and SHA-256;
- k-means and code assignment are reported apart (``kmeans``, ``assign``): they run on the GPU there.

``host work`` is the sum of the stages that stay on the CPU whatever the device (all but tokenize+encode, kmeans
and assign). Rounds alternate the repositories; the first is a warm-up when there are several. Reported: the median
seconds of each stage per repository, and the ratio of ``host work`` to the first repository's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

CHILD = r"""
import collections, functools, json, shutil, sys, time
repo, spec = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, repo)
import faiss, torch
torch.set_num_threads(spec["threads"]); faiss.omp_set_num_threads(spec["threads"])
import hil
assert hil.__file__.startswith(repo), (hil.__file__, repo)
import hil.retrieval.builder as builder, hil.retrieval.chunks as chunks
import hil.retrieval.backends.centroid as centroid
from transformers import AutoTokenizer, BertConfig, BertModel
from hil.data.beir import load_beir
from hil.modeling.encoder import ColBERTEncoder
from hil.retrieval.backends.configs import PlaidIndexConfig

times = collections.Counter()
def timed(module, name, label):
    if not hasattr(module, name):
        return
    function = getattr(module, name)
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        tick = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            times[label] += time.perf_counter() - tick
    setattr(module, name, wrapper)
for module, name, label in [(builder, "encode_corpus", "encoding"), (chunks, "check_finite_vectors", "finite check"),
                            (chunks, "save_npy_atomic", "write chunks"), (chunks, "file_digest", "chunk checksums"),
                            (builder, "join_chunks", "join"), (builder, "seal_index", "seal"),
                            (centroid, "train_centroids", "kmeans"), (centroid, "assign_codes", "assign"),
                            (centroid, "build_ivf", "inverted file")]:
    timed(module, name, label)

tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
torch.manual_seed(0)
config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=512)
encoder = ColBERTEncoder("near-free-bert", dim=spec["dim"], query_maxlen=32, doc_maxlen=spec["doc_maxlen"],
                         _loaded=(BertModel(config, add_pooling_layer=False), tokenizer)).eval()
dataset = load_beir(spec["dataset"], data_dir=spec["data_dir"])
target = spec["work"] + "/index"
shutil.rmtree(target, ignore_errors=True)
tick = time.perf_counter()
index = builder.build_index(encoder, dataset.doc_ids(), dataset.documents(), target,
                            backend=PlaidIndexConfig(kmeans=spec["kmeans"]), progress=False, overwrite=True)
total = time.perf_counter() - tick
stages = dict(times)
inside = sum(stages.get(s, 0.0) for s in ("finite check", "write chunks", "chunk checksums"))
stages["tokenize+encode"] = stages.pop("encoding", 0.0) - inside
json.dump({"total": total, "n_tokens": int(index.n_tokens), "stages": stages}, sys.stdout)
"""

ON_DEVICE = ("tokenize+encode", "kmeans", "assign")


def run_child(repo: Path, spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(repo), TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, "-c", CHILD, str(repo), json.dumps(spec)], capture_output=True,
                          text=True, env=env, cwd=repo)
    if done.returncode != 0:
        raise SystemExit(f"{repo}: the build failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout)
    result["stages"]["host work"] = sum(v for k, v in result["stages"].items() if k not in ON_DEVICE)
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", action="append", type=Path, help="a checkout to measure (repeatable; default .)")
    parser.add_argument("--dataset", default="scifact")
    parser.add_argument("--data-dir",
                        default=os.environ.get("HIL_DATA_DIR", str(HERE.parent.parent / "shared" / "data")))
    parser.add_argument("--tokenizer", default=str(Path(os.environ.get("HIL_MODELS_DIR", HERE.parent.parent / "shared"
                                                                       / "models")) / "all-MiniLM-L6-v2"))
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--doc-maxlen", type=int, default=180)
    parser.add_argument("--kmeans", default="faiss", choices=("faiss", "torch"),
                        help="k-means of the build (reported apart; faiss is the faster on a CPU)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, help="results JSON (bench/results/...)")
    args = parser.parse_args(argv)
    repos = [path.resolve() for path in (args.repo or [Path(".")])]
    rounds: dict[str, list[dict[str, Any]]] = {str(repo): [] for repo in repos}
    with tempfile.TemporaryDirectory(prefix="hil-index-host-") as work:
        spec = {"dataset": args.dataset, "data_dir": args.data_dir, "tokenizer": args.tokenizer, "dim": args.dim,
                "doc_maxlen": args.doc_maxlen, "kmeans": args.kmeans, "threads": args.threads, "work": work}
        for number in range(args.rounds):
            for repo in repos:
                result = run_child(repo, spec)
                rounds[str(repo)].append(result)
                print(f"round {number} {repo}: {result['total']:.2f} s, host work "
                      f"{result['stages']['host work']:.2f} s", flush=True)
    counted = {repo: runs[1:] if len(runs) > 1 else runs for repo, runs in rounds.items()}
    summary = {}
    for repo, runs in counted.items():
        stages = sorted({stage for run in runs for stage in run["stages"]})
        summary[repo] = {stage: statistics.median(run["stages"].get(stage, 0.0) for run in runs) for stage in stages}
        summary[repo]["total"] = statistics.median(run["total"] for run in runs)
    first = summary[str(repos[0])]["host work"]
    order = ["tokenize+encode", "finite check", "write chunks", "chunk checksums", "join", "inverted file", "seal",
             "host work", "kmeans", "assign", "total"]
    print("| stage (s, median) | " + " | ".join(Path(repo).name or repo for repo in summary) + " |")
    print("|---|" + "---|" * len(summary))
    for stage in order:
        print(f"| {stage} | " + " | ".join(f"{values.get(stage, 0.0):.3f}" for values in summary.values()) + " |")
    print("| host work vs first | " + " | ".join(f"x{first / values['host work']:.2f}" for values in summary.values())
          + " |")
    if args.output:
        sys.path.insert(0, str(HERE))
        from measure import write_results

        write_results(args.output, vars(args) | {"repo": [str(r) for r in repos]}, argv,
                      {"rounds": rounds, "median": summary, "n_tokens": next(iter(rounds.values()))[0]["n_tokens"]})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
