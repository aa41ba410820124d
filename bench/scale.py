"""The index at corpus scale, through the real builder, without encoding (issue 38).

    python bench/scale.py --factors 1,16,64,256 --output bench/results/scale.json

A base index of SciFact (fp16 vectors, encoded once under ``--work``) is tiled ``factor`` times by
:class:`hil.retrieval.vector_source.TiledVectors`: the original documents keep their ids and judgments; every other
copy is made distinct by ``--tiling``: ``shuffle`` (default: each copy's documents are bags of the base's tokens, a
seeded permutation per copy, so the corpus grows as a corpus of that domain does) or ``rotation`` (each copy turned
by a fixed random rotation: never a competitor, but each copy a cloud of its own, quantized ever more coarsely).
``build_index(..., vectors=tiled)`` then builds the compressed-as-encoded PLAID index (2-bit residuals, no fp16
kept) exactly as it builds a real corpus, minus the encoder. Per factor, each in a child process of its own, every
build from an empty folder:

- build: seconds per stage (``index.json``'s ``build_seconds``), the peak disk of the build's folder (finished and
  unfinished, polled every ``--poll`` seconds), the peak anonymous memory of the build's process tree (``RssAnon``
  of /proc: file pages of memory maps apart), bytes per token, the plan (centroids, assignment, sample);
- search: the original queries, one at a time (query encoding included): p50/p95 ms, nDCG@10 and recall@100, and
  the search process's peak ``RssAnon`` (polled the same way), with PLAID's defaults for ``--k`` and with each of
  ``--other-search``'s settings; and what compression allows: exact MaxSim of every query against the original
  documents read from the stored codes and residuals (``exact_over_originals``; with copies that rarely outrank
  an original, a drop from it to the search's figure is candidate generation's).

With ``--latency-rounds`` R, every size is searched again after all are built, size after size, R times (PLAID's
defaults only): the p50 ratios between sizes are taken from these rounds, under the same conditions for each.

At each of ``--exact-factors``, exact search over the whole tiled corpus (every copy scored exactly: the base searched
once per copy), the ceiling of any search at that size, with how often a copy outranks the best relevant original
or the 10th original.

At each of ``--agreement-factors``, the tokens of ``--agreement-docs`` documents drawn from the tiled corpus are
assigned exactly (brute force over the index's centroids) and compared with the codes the index stores (two-level
on a CPU from 2^15 centroids): the share given the same centroid. ``--paired-factor`` builds that size with
``assignment`` exact too (and two-level, unless the default build of that size was two-level already) and compares
nDCG@10 and recall@100 per query (paired t-test, :mod:`hil.evaluation.statistics`).

This file imports nothing from ``hil`` in the parent; figures are taken one child at a time (run it on an idle
machine: two cores are easily saturated).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CHILD = r"""
import dataclasses, json, sys, time
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/bench")
spec = json.loads(sys.argv[2])
import faiss, numpy as np, torch
torch.set_num_threads(spec["threads"]); faiss.omp_set_num_threads(spec["threads"])
from hil.data.beir import load_beir
from hil.modeling.loading import load_encoder
from hil.retrieval.index import TokenIndex
torch.manual_seed(spec["seed"])  # the untrained head is a seeded random projection
encoder = load_encoder(spec["model"], doc_maxlen=spec["doc_maxlen"])
dataset = load_beir(spec["dataset"], split=spec["split"])
out = {}
if spec["step"] == "base":
    from hil.retrieval.builder import open_or_build_index
    tick = time.perf_counter()
    index = open_or_build_index(encoder, dataset.doc_ids(), dataset.documents(), spec["base"],
                                corpus_fingerprint=dataset.fingerprint(), progress=False)
    out = {"seconds": time.perf_counter() - tick, "n_docs": index.n_docs, "n_tokens": index.n_tokens}
elif spec["step"] == "build":
    from hil.retrieval.backends.configs import PlaidIndexConfig
    from hil.retrieval.builder import build_index
    from hil.retrieval.vector_source import TiledVectors
    base = TokenIndex.load(spec["base"])
    tiled = TiledVectors(base, spec["factor"], seed=spec["seed"], tiling=spec["tiling"])
    config = PlaidIndexConfig(residual_bits=spec["bits"], keep_embeddings=False, **spec["plaid"])
    tick = time.perf_counter()
    index = build_index(encoder, tiled.doc_ids(), None, spec["index"], vectors=tiled, backend=config,
                        chunk_docs=spec["chunk_docs"], progress=spec["progress"], overwrite=True)
    meta = index.meta
    out = {"seconds": time.perf_counter() - tick, "n_docs": index.n_docs, "n_tokens": index.n_tokens,
           "build_seconds": meta.get("build_seconds"), "build_plan": meta.get("build_plan"),
           "params": index.backend_settings["params"], "disk_bytes": index.disk_bytes(),
           "bytes_per_token": index.disk_bytes() / index.n_tokens,
           "files": {p.name: p.stat().st_size for p in sorted(index.directory.iterdir())}}
elif spec["step"] == "search":
    from hil.evaluation.evaluate import score_run
    from hil.retrieval.backends.configs import PlaidSearchConfig
    from hil.retrieval.encoding import eval_mode
    from hil.retrieval.full_ranking import full_rank
    from hil.retrieval.search import score_documents
    index = TokenIndex.load(spec["index"])
    queries = {q: dataset.queries[q] for q in dataset.queries if q in dataset.qrels}
    if spec["queries"]:  # the judged queries searched, and only theirs scored (an unsearched query would count 0)
        queries = dict(list(queries.items())[: spec["queries"]])
        dataset = dataclasses.replace(dataset, qrels={q: dataset.qrels[q] for q in queries})
    metrics = ("ndcg@10", "recall@100")

    def searched(search):
        first = next(iter(queries))
        full_rank(encoder, index, {first: queries[first]}, k=spec["k"], search=search, batch_size=1,
                  progress=False)  # warm-up
        run, times = {}, []
        for qid, text in queries.items():
            tick = time.perf_counter()
            result = full_rank(encoder, index, {qid: text}, k=spec["k"], search=search, batch_size=1,
                               progress=False)
            times.append(1000.0 * (time.perf_counter() - tick))
            run.update(result.run)
        evaluation = score_run("scale", dataset, run, metrics=metrics)
        return {"p50_ms": float(np.percentile(times, 50)), "p95_ms": float(np.percentile(times, 95)),
                "n_queries": len(times), **{m: float(evaluation.aggregate[m]) for m in metrics},
                "per_query": {q: {m: float(v[m]) for m in metrics} for q, v in evaluation.per_query.items()},
                "search_stats": {k: v for k, v in result.stats.items() if isinstance(v, (int, float, str))}}

    out = searched(None)  # the defaults for depth k
    out["other_settings"] = {json.dumps(s, sort_keys=True): searched(PlaidSearchConfig(**s)) for s in spec["other"]}
    if spec.get("latency_only"):
        print("RESULT " + json.dumps({k: out[k] for k in ("p50_ms", "p95_ms", "n_queries", "ndcg@10")}))
        sys.exit(0)
    # What compression alone allows: exact MaxSim of every query against the original documents (copy 0, rows
    # 0..n-1), read from the stored codes and residuals (the copies left out: the "exact" step scores them too).
    n_original = index.meta["vector_source"]["base_n_docs"]
    qids = list(queries)
    with eval_mode(encoder), torch.no_grad():
        encoded = encoder.encode_queries([queries[q] for q in qids])
    scores = score_documents(encoder, encoded, index, np.arange(n_original))
    run = {q: {index.doc_ids[j]: float(scores[i, j]) for j in np.argsort(-scores[i], kind="stable")[: spec["k"]]}
           for i, q in enumerate(qids)}
    exact = score_run("exact", dataset, run, metrics=metrics)
    out["exact_over_originals"] = {m: float(exact.aggregate[m]) for m in metrics}
elif spec["step"] == "agreement":
    from hil.retrieval.vector_source import TiledVectors
    base = TokenIndex.load(spec["base"])
    index = TokenIndex.load(spec["index"])
    tiled = TiledVectors(base, spec["factor"], seed=spec["seed"], tiling=spec["tiling"])
    rng = np.random.default_rng(spec["seed"])
    rows = np.sort(rng.choice(tiled.n_docs, size=min(tiled.n_docs, spec["agreement_docs"]), replace=False))
    encoded = tiled.vectors(rows)
    offsets = np.asarray(index.doc_offsets)
    token_rows = np.concatenate([np.arange(offsets[r], offsets[r + 1]) for r in rows])
    out = {}
    for head in tiled.head_names:
        centroids = torch.from_numpy(np.load(index.directory / f"{head}.centroids.npy").astype(np.float32))
        stored = np.asarray(np.load(index.directory / f"{head}.codes.npy", mmap_mode="r")[token_rows], np.int64)
        vectors = torch.from_numpy(encoded.embeddings[head].astype(np.float32))
        exact = torch.cat([(block @ centroids.T).argmax(1) for block in vectors.split(4096)]).numpy()
        out[head] = {"tokens": int(len(exact)), "same_centroid": float((exact == stored).mean()),
                     "n_centroids": int(len(centroids))}
elif spec["step"] == "exact":
    # Exact search over the whole tiled corpus, copy by copy: a rotated copy d R_r scores MaxSim(q R_r^T, d) (the
    # base searched with the queries turned back); a shuffled copy is read from the tiling. The top k of every query
    # kept as the copies go; how often a copy outranks the best relevant original, or the 10th original.
    from hil.evaluation.evaluate import score_run
    from hil.retrieval.encoding import eval_mode
    from hil.retrieval.search import score_documents
    from hil.retrieval.store import TokenStore
    from hil.retrieval.vector_source import TiledVectors
    base = TokenIndex.load(spec["base"])
    tiled = TiledVectors(base, spec["factor"], seed=spec["seed"], tiling=spec["tiling"])
    qids = [q for q in dataset.queries if q in dataset.qrels][: spec["queries"] or None]
    dataset = dataclasses.replace(dataset, qrels={q: dataset.qrels[q] for q in qids})
    with eval_mode(encoder), torch.no_grad():
        encoded = encoder.encode_queries([dataset.queries[q] for q in qids])
    rows = np.arange(base.n_docs)
    ids = tiled.doc_ids()
    original = score_documents(encoder, encoded, base, rows)  # (Q, n)
    position = {d: i for i, d in enumerate(base.doc_ids)}
    best_relevant = np.array([max((original[i, position[d]] for d, g in dataset.qrels[q].items()
                                   if g > 0 and d in position), default=-np.inf) for i, q in enumerate(qids)])
    tenth = np.sort(original, axis=1)[:, -10]
    best_copy = np.full(len(qids), -np.inf)
    above = np.zeros(len(qids))
    k = spec["k"]
    top_scores = np.full((len(qids), k), -np.inf)
    top_rows = np.zeros((len(qids), k), dtype=np.int64)

    def merge(scores, offset):
        global top_scores, top_rows
        cut = np.argpartition(-scores, min(k, scores.shape[1]) - 1, axis=1)[:, :k]
        both_scores = np.concatenate([top_scores, np.take_along_axis(scores, cut, 1)], axis=1)
        both_rows = np.concatenate([top_rows, cut + offset], axis=1)
        keep = np.argsort(-both_scores, axis=1, kind="stable")[:, :k]
        top_scores, top_rows = np.take_along_axis(both_scores, keep, 1), np.take_along_axis(both_rows, keep, 1)

    merge(original, 0)
    for copy in range(1, spec["factor"]):
        if spec["tiling"] == "rotation":
            turned = {h: v @ tiled.rotation(copy).T for h, v in encoded.heads.items()}
            scores = score_documents(encoder, dataclasses.replace(encoded, heads=turned), base, rows)
        else:
            read = tiled.vectors(rows + copy * base.n_docs)
            store = TokenStore(base.doc_ids, base.doc_offsets, read.embeddings, read.token_ids)
            scores = score_documents(encoder, encoded, store, rows)
        best_copy = np.maximum(best_copy, scores.max(1))
        above += (scores > best_relevant[:, None]).sum(1)
        merge(scores, copy * base.n_docs)
    run = {q: {ids[r]: float(v) for r, v in zip(top_rows[i], top_scores[i])} for i, q in enumerate(qids)}
    metrics = ("ndcg@10", "recall@100")
    evaluation = score_run("exact", dataset, run, metrics=metrics)
    out = {"factor": spec["factor"], "tiling": spec["tiling"], "queries": len(qids),
           **{m: float(evaluation.aggregate[m]) for m in metrics},
           "per_query": {q: {m: float(v[m]) for m in metrics} for q, v in evaluation.per_query.items()},
           "share_of_queries_a_copy_beats_the_best_relevant": float((best_copy > best_relevant).mean()),
           "copies_above_the_best_relevant_per_query": float(above.mean()),
           "share_of_queries_a_copy_beats_the_10th_original": float((best_copy > tenth).mean()),
           "mean_best_relevant_score": float(best_relevant[np.isfinite(best_relevant)].mean()),
           "mean_10th_score": float(tenth.mean()), "mean_best_copy_score": float(best_copy.mean())}
print("RESULT " + json.dumps(out))
"""


def tree_rss_anon_kb(pid: int) -> int:
    """RssAnon (KiB) of ``pid`` and every descendant (file pages of memory maps apart)."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/status") as handle:
                for line in handle:
                    if line.startswith("RssAnon:"):
                        total += int(line.split()[1])
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as handle:
                    stack.extend(int(child) for child in handle.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def folder_bytes(folders: list[Path]) -> int:
    """Allocated bytes under ``folders`` (st_blocks, so sparse or not-yet-written pages do not count)."""
    total = 0
    for folder in folders:
        for dirpath, _, filenames in os.walk(folder):
            for name in filenames:
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
                except FileNotFoundError:
                    pass
    return total


def child(spec: dict[str, Any], watch: list[Path], poll: float) -> dict[str, Any]:
    """Run one step in a child; -> its result with the peak RssAnon of its tree and the peak disk of ``watch``."""
    load = list(os.getloadavg())
    process = subprocess.Popen([sys.executable, "-c", CHILD, str(ROOT), json.dumps(spec)], stdout=subprocess.PIPE,
                               text=True)
    peaks = {"rss_anon_kb": 0, "disk_bytes": 0}
    done = threading.Event()

    def watcher() -> None:
        while not done.is_set():
            peaks["rss_anon_kb"] = max(peaks["rss_anon_kb"], tree_rss_anon_kb(process.pid))
            if watch:
                peaks["disk_bytes"] = max(peaks["disk_bytes"], folder_bytes(watch))
            done.wait(poll)

    thread = threading.Thread(target=watcher, daemon=True)
    thread.start()
    stdout, _ = process.communicate()
    done.set()
    thread.join()
    if process.returncode != 0:
        raise SystemExit(f"scale bench: step {spec['step']} (factor {spec.get('factor')}) failed "
                         f"with exit {process.returncode}")
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    return {**result, "peak_rss_anon_mb": peaks["rss_anon_kb"] / 1024, "peak_disk_bytes": peaks["disk_bytes"],
            "load_average_before": load}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factors", default="1,16,64,256", help="corpus multiples, comma-separated")
    parser.add_argument("--dataset", default=str(ROOT.parent / "shared/data/beir/scifact"))
    parser.add_argument("--split", default="test")
    parser.add_argument("--model", default=str(ROOT.parent / "shared/models/all-MiniLM-L6-v2"))
    parser.add_argument("--doc-maxlen", type=int, default=180)
    parser.add_argument("--work", default=str(HERE / "work" / "scale"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--tiling", default="shuffle", choices=("shuffle", "rotation"),
                        help="how copies are made distinct (hil.retrieval.vector_source.TiledVectors)")
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--chunk-docs", type=int, default=8192)
    parser.add_argument("--queries", type=int, default=0, help="judged queries searched (0: all)")
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--other-search", default='[{"nprobe": 4, "ndocs": 1024, "stage2_docs": 4096}]',
                        help="JSON list of PlaidSearchConfig settings searched beside the defaults for k")
    parser.add_argument("--assignment", default="auto", choices=("auto", "exact", "two-level"))
    parser.add_argument("--paired-factor", type=int, default=0, help="build this size exact and two-level (0: no)")
    parser.add_argument("--agreement-docs", type=int, default=2000, help="documents checked against exact codes")
    parser.add_argument("--agreement-factors", default="16,256",
                        help="sizes (of --factors) whose stored codes are checked against exact assignment")
    parser.add_argument("--exact-factors", default="",
                        help="sizes searched exactly over the whole tiled corpus (slow: the base's exact search "
                             "once per copy), the ceiling of the search at that size; with the distractors' counts")
    parser.add_argument("--plaid", default="{}", help="more PlaidIndexConfig settings (JSON), e.g. n_centroids")
    parser.add_argument("--tag", default="", help="appended to every size's label (runs with other settings)")
    parser.add_argument("--latency-rounds", type=int, default=3,
                        help="after every build, the sizes searched again in turn this many times (the same "
                             "conditions for each: p50 ratios between sizes from these rounds)")
    parser.add_argument("--poll", type=float, default=1.0)
    parser.add_argument("--keep", action="store_true", help="keep each tiled index after it is measured")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--output", default=None)
    parser.add_argument("--resume", action="store_true",
                        help="go on from --output: sizes measured there are not built again (the kept ones are "
                             "searched again in the latency rounds); the earlier commands are recorded")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    common = {"threads": args.threads, "seed": args.seed, "model": args.model, "doc_maxlen": args.doc_maxlen,
              "dataset": args.dataset, "split": args.split, "base": str(work / "base"), "bits": args.bits,
              "chunk_docs": args.chunk_docs, "queries": args.queries, "k": args.k, "progress": args.progress,
              "agreement_docs": args.agreement_docs, "other": json.loads(args.other_search),
              "tiling": args.tiling}
    results: dict[str, Any] = {"base": child({**common, "step": "base"}, [], args.poll), "sizes": {}}
    if args.resume and args.output and Path(args.output).exists():
        earlier = json.loads(Path(args.output).read_text())
        results = {**earlier["results"], "base": results["base"]}  # sizes, rounds, exact searches: kept
        results["resumed_from"] = [*earlier["results"].get("resumed_from", []),
                                   {"command": earlier["command"], "created": earlier["created"],
                                    "git_commit": earlier.get("git_commit")}]
    print(f"base: {results['base']['n_tokens']} tokens", flush=True)
    plans = [(int(f), args.assignment) for f in args.factors.split(",") if f]
    if args.paired_factor:
        plans += [(args.paired_factor, "exact"), (args.paired_factor, "two-level")]
    for factor, assignment in plans:
        default = results["sizes"].get(f"x{factor}")
        if assignment == "two-level" and default and default["build"]["params"]["assignment"] == "two-level":
            continue  # the default build of this size is the two-level one
        label = f"x{factor}" + ("" if assignment == args.assignment else f"-{assignment}") + args.tag
        if label in results["sizes"]:
            continue  # measured by the run this one resumes
        folder = work / label
        index = folder / "index"
        plaid = {**json.loads(args.plaid), **({} if assignment == "auto" else {"assignment": assignment})}
        spec = {**common, "factor": factor, "index": str(index), "plaid": plaid}
        shutil.rmtree(folder, ignore_errors=True)  # a build measured whole: nothing resumed from an earlier run
        build = child({**spec, "step": "build"}, [folder], args.poll)
        search = child({**spec, "step": "search"}, [], args.poll)
        entry = {"factor": factor, "assignment": assignment, "build": build, "search": search}
        if assignment == args.assignment and str(factor) in args.agreement_factors.split(",") \
                and args.agreement_docs:
            entry["agreement"] = child({**spec, "step": "agreement"}, [], args.poll)
        results["sizes"][label] = entry
        if args.output:  # after every size: a run cut short keeps what it measured
            save(args, argv, results)
        print(f"{label}: {build['n_tokens']} tokens, build {build['seconds']:.0f} s, "
              f"{build['bytes_per_token']:.1f} B/token, peak disk {build['peak_disk_bytes'] / 2**30:.2f} GiB, "
              f"build RssAnon {build['peak_rss_anon_mb']:.0f} MB; search p50 {search['p50_ms']:.1f} ms, "
              f"nDCG@10 {search['ndcg@10']:.4f}, RssAnon {search['peak_rss_anon_mb']:.0f} MB; "
              + "; ".join(f"{k}: p50 {v['p50_ms']:.1f} ms, nDCG@10 {v['ndcg@10']:.4f}"
                          for k, v in search["other_settings"].items())
              + f"; exact over the originals nDCG@10 {search['exact_over_originals']['ndcg@10']:.4f}", flush=True)
        if not args.keep and not (args.latency_rounds and assignment == args.assignment and not args.tag):
            shutil.rmtree(folder, ignore_errors=True)
    if args.latency_rounds:
        results["latency_rounds"] = latency_rounds(args, common, work, results["sizes"])
        if args.output:
            save(args, argv, results)
    if args.paired_factor:
        results["paired"] = paired(results["sizes"], args.paired_factor, args.assignment)
    for factor in [int(f) for f in args.exact_factors.split(",") if f]:
        results.setdefault("exact", {})[f"x{factor}"] = found = child(
            {**common, "step": "exact", "factor": factor}, [], args.poll)
        print(f"x{factor} exact search over the tiled corpus: nDCG@10 {found['ndcg@10']:.4f}, recall@100 "
              f"{found['recall@100']:.4f}; a copy beats the best relevant original in "
              f"{100 * found['share_of_queries_a_copy_beats_the_best_relevant']:.1f}% of queries", flush=True)
        if args.output:
            save(args, argv, results)
    if args.output:
        save(args, argv, results)


def latency_rounds(args: argparse.Namespace, common: dict[str, Any], work: Path,
                   sizes: dict[str, Any]) -> dict[str, Any]:
    """Every kept default size searched again (PLAID's defaults only), size after size, ``--latency-rounds``
    times: each size's p50 and p95 per round, and their medians."""
    labels = [label for label, entry in sizes.items()
              if label == f"x{entry['factor']}" and (work / label / "index").is_dir()]
    rounds: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    for _ in range(args.latency_rounds):
        for label in labels:
            spec = {**common, "step": "search", "index": str(work / label / "index"), "other": [],
                    "latency_only": True}
            found = child(spec, [], args.poll)
            rounds[label].append({k: found[k] for k in ("p50_ms", "p95_ms", "peak_rss_anon_mb")})
    if not args.keep:
        for label in labels:
            shutil.rmtree(work / label, ignore_errors=True)
    return {label: {"rounds": found, "p50_ms_median": float(np.median([r["p50_ms"] for r in found])),
                    "p95_ms_median": float(np.median([r["p95_ms"] for r in found]))}
            for label, found in rounds.items()}


def save(args: argparse.Namespace, argv: list[str], results: dict[str, Any]) -> None:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT))
    from measure import write_results

    write_results(args.output, vars(args), argv, results)


def paired(sizes: dict[str, Any], factor: int, default: str) -> dict[str, Any]:
    """Exact vs two-level assignment at one size: per-query nDCG@10 and recall@100, paired t-test."""
    sys.path.insert(0, str(ROOT))
    from hil.evaluation.statistics import paired_t_test

    exact = sizes[f"x{factor}-exact"]["search"]["per_query"]
    coarse = sizes.get(f"x{factor}-two-level", sizes[f"x{factor}"])["search"]["per_query"]
    out = {}
    for metric in ("ndcg@10", "recall@100"):
        a = {q: v[metric] for q, v in coarse.items()}
        b = {q: v[metric] for q, v in exact.items()}
        test = paired_t_test(a, b)
        out[metric] = {"two_level_minus_exact": sum(a[q] - b[q] for q in a) / len(a), "p_value": test.p_value,
                       "n": len(a)}
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
