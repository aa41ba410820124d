"""Full ranking before and after (issue 29): one index and one query set searched by each ``--repo``'s own code,
side by side in alternating rounds, on this machine's CPU (or wherever ``--device`` says).

    git worktree add /tmp/before <commit>
    python bench/search_before_after.py --index bench/work/scifact-...--plaid --repo /tmp/before --repo .

Each pass is a child process running that checkout's ``full_rank`` (this file imports nothing from ``hil``): a
checkout that has ``hil.retrieval.full_ranking`` is searched both ways (``batched`` and ``per-query``), an older one
its own way (``hil.retrieval.search.full_rank``, one query at a time). Every pass searches all judged queries of
``--dataset`` (queries encoded in batches of 64, as evaluation does), at each ``--k``; the index's encoder is
rebuilt as ``bench/run.py`` built it (``--model`` with an untrained head seeded by ``--seed``, ``--doc-maxlen``).
Rounds alternate the variants, so a change of the machine's load touches all of them alike; the first round is a
warm-up and is not counted when there are several. Reported per variant and k: the median seconds of a pass,
queries/s, the ratio to the first variant, and whether its run is the first variant's (the same documents in the
same order; the largest score difference).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, sys, time
repo, spec = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, repo)
import faiss, torch
torch.set_num_threads(spec["threads"]); faiss.omp_set_num_threads(spec["threads"])
from hil.data.beir import load_beir
from hil.modeling.loading import load_encoder
from hil.retrieval.index import TokenIndex
try:
    from hil.retrieval.full_ranking import full_rank
    options = {"batched": spec["mode"] == "batched"}
except ImportError:
    from hil.retrieval.search import full_rank
    options = {}
import hil
assert hil.__file__.startswith(repo), (hil.__file__, repo)
torch.manual_seed(spec["seed"])
encoder = load_encoder(spec["model"], doc_maxlen=spec["doc_maxlen"]).to(spec["device"])
index = TokenIndex.load(spec["index"])
dataset = load_beir(spec["dataset"], split=spec["split"])
queries = {q: dataset.queries[q] for q in dataset.queries if q in dataset.qrels}
full_rank(encoder, index, dict(list(queries.items())[:4]), k=spec["k"], progress=False, **options)  # warm-up
tick = time.perf_counter()
result = full_rank(encoder, index, queries, k=spec["k"], batch_size=64, progress=False, **options)
seconds = time.perf_counter() - tick
json.dump({"seconds": seconds, "queries": len(queries), "run": result.run,
           "steps": {s: result.stats.get(s) for s in ("encode_s", "ann_s", "score_s")},
           "search": result.stats.get("search")}, open(spec["out"], "w"))
"""


def variants(repos: list[Path]) -> list[tuple[str, Path, str]]:
    """(label, repo, mode) of every variant: both ways for a checkout that has batched search, else its own."""
    found = []
    for repo in repos:
        has_batched = (repo / "hil" / "retrieval" / "full_ranking.py").is_file()
        for mode in (("per-query", "batched") if has_batched else ("per-query",)):
            found.append((f"{repo.name}:{mode}", repo, mode))
    return found


def run_pass(python: str, repo: Path, mode: str, k: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    spec = {"mode": mode, "k": k, "index": str(Path(args.index).resolve()), "model": args.model, "seed": args.seed,
            "doc_maxlen": args.doc_maxlen, "dataset": args.dataset, "split": args.split, "threads": args.threads,
            "device": args.device, "out": str(out)}
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), PYTHONPATH="")
    done = subprocess.run([python, "-c", CHILD, str(repo), json.dumps(spec)], cwd=repo, env=env, text=True,
                          capture_output=True)
    if done.returncode:
        raise SystemExit(f"{repo} ({mode}, k={k}) failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def compare(run: dict[str, dict[str, float]], reference: dict[str, dict[str, float]]) -> dict[str, Any]:
    same_order = all(list(run.get(q, {})) == list(ranked) for q, ranked in reference.items())
    diffs = [abs(run[q][d] - s) for q, ranked in reference.items() for d, s in ranked.items() if d in run.get(q, {})]
    return {"same_documents_in_order": same_order, "identical": same_order and max(diffs, default=0.0) == 0.0,
            "max_score_difference": max(diffs, default=0.0)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", required=True, help="an index folder (built by bench/run.py)")
    parser.add_argument("--repo", action="append", type=Path, required=True, help="a checkout (repeat)")
    parser.add_argument("--k", default="10,1000", help="ranking depths, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dataset", default="scifact")
    parser.add_argument("--split", default="test")
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--doc-maxlen", type=int, default=180)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--output", type=Path, default=HERE / "results" / "search_before_after.json")
    args = parser.parse_args(argv)
    repos = [repo.resolve() for repo in args.repo]
    plan = variants(repos)
    rows = []
    with tempfile.TemporaryDirectory(prefix="search-before-after-") as tmp:
        for k in (int(v) for v in args.k.split(",")):
            seconds: dict[str, list[float]] = {label: [] for label, _, _ in plan}
            last: dict[str, dict[str, Any]] = {}
            for round_ in range(args.rounds):
                for label, repo, mode in plan:
                    result = run_pass(args.python, repo, mode, k, args, Path(tmp) / "pass.json")
                    seconds[label].append(result["seconds"])
                    last[label] = result
                    print(f"k={k} round {round_} {label}: {result['seconds']:.2f} s", flush=True)
            reference = plan[0][0]
            for label, repo, mode in plan:
                counted = seconds[label][1:] if len(seconds[label]) > 1 else seconds[label]
                median = statistics.median(counted)
                base = statistics.median(seconds[reference][1:] if args.rounds > 1 else seconds[reference])
                rows.append({"k": k, "variant": label, "repo": str(repo), "mode": mode, "seconds": seconds[label],
                             "median_s": median, "queries_per_s": last[label]["queries"] / median,
                             "speedup_vs_first": base / median, "steps_s": last[label]["steps"],
                             "search": last[label]["search"],
                             "vs_first": compare(last[label]["run"], last[reference]["run"])})
                r = rows[-1]
                print(f"k={k:<5} {label:<22} {median:7.2f} s  {r['queries_per_s']:7.1f} q/s  "
                      f"x{r['speedup_vs_first']:.2f}  vs first: {r['vs_first']}", flush=True)
    from measure import write_results

    settings = {k: [str(r) for r in v] if k == "repo" else str(v) if isinstance(v, Path) else v
                for k, v in vars(args).items()}
    result = {"load_average": os.getloadavg(), "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows}
    write_results(args.output, settings, sys.argv[1:] if argv is None else argv, result)
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
