"""Peer mode for search: PyLate's PLAID (fast-plaid) and WARP (xtr-warp-rs) indexes over a corpus, each query
encoded and searched one at a time; writes one JSON file (``--out``) with each query's milliseconds and ranking.

Run by ``bench/sections/peer_search.py`` (``bench/run.py --sections peer-search``) with the Python that has PyLate
(``--peer-python``), so PyLate's own pins (its torch) never touch the project's environment. Self-contained: it
imports nothing from ``hil`` and nothing but the standard library at module level, so the ``hil`` side imports
:func:`time_one_at_a_time` from here and both sides time queries with the same loop.

    python bench/peer_search_pylate.py --model EXPORT --corpus CORPUS.json --queries QUERIES.json \
        --work DIR --indexes plaid,warp --k 100 --threads 2 --warmup 3 --out RESULT.json

``CORPUS.json``: ``{"ids": [...], "texts": [...]}``; ``QUERIES.json``: ``{"ids": [...], "texts": [...]}``.
The output (protocol 1)::

    {"protocol": 1, "pylate": "1.6.0", "torch": "...", "threads": 2, "warmup": 3, "k": 100,
     "versions": {"fast_plaid": "...", "xtr_warp": "..."},
     "indexes": {"plaid": {"settings": {...}, "build": {...}, "times_ms": [...], "run": {qid: {doc_id: score}}},
                 "warp": {...}},
     "peak_rss_mb": ...}

``times_ms[i]`` is query ``ids[i]``'s time: ``model.encode([text], is_query=True)`` plus the index's search, as a
PyLate user runs them. Indexes are kept in ``--work`` (one folder per index kind and build settings, with a
``hil-bench.json`` marker written once the build has finished) and reused by later runs over the same corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

PROTOCOL = 1
MARKER = "hil-bench.json"  # written into an index folder once its build has finished


def time_one_at_a_time(search: Callable[[str, str], dict[str, float]], queries: dict[str, str], warmup: int,
                       clock: Callable[[], float] = time.perf_counter
                       ) -> tuple[dict[str, dict[str, float]], list[float]]:
    """Search each query alone, in order, and time each call; the first ``warmup`` queries are searched once
    before, untimed (thread pools, caches, lazy loads), so no timed call pays for start-up.

    ``search(qid, text)`` returns the query's ranking (doc_id -> score). Returns the run and the milliseconds of
    each query, in the order of ``queries`` (one entry per query: the warm-up calls are not in it).
    """
    items = list(queries.items())
    for qid, text in items[:max(0, warmup)]:
        search(qid, text)
    run: dict[str, dict[str, float]] = {}
    times: list[float] = []
    for qid, text in items:
        tick = clock()
        ranking = search(qid, text)
        times.append(1000.0 * (clock() - tick))
        run[qid] = ranking
    return run, times


def read_pairs(path: str) -> dict[str, str]:
    """``{"ids": [...], "texts": [...]}`` -> id -> text, in file order."""
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if len(data["ids"]) != len(data["texts"]):
        raise SystemExit(f"{path}: {len(data['ids'])} ids but {len(data['texts'])} texts")
    return dict(zip(data["ids"], data["texts"]))


def index_settings(kind: str, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(build-time, search-time) keyword arguments of PyLate's index class for ``kind``. Build-time ones name the
    index folder; search-time ones are PyLate's defaults unless given (``n_full_scores`` 8192 and
    ``n_ivf_probe`` 8 for PLAID, ``n_ivf_probe`` 32 for WARP in PyLate 1.6.0)."""
    build = {"nbits": args.nbits, "kmeans_niters": args.kmeans_niters, "seed": args.seed}
    if kind == "plaid":
        return build, {"n_ivf_probe": args.plaid_n_ivf_probe, "n_full_scores": args.plaid_n_full_scores,
                       "num_threads": args.threads}
    if kind == "warp":
        return build, {"n_ivf_probe": args.warp_n_ivf_probe, "num_threads": args.threads}
    raise SystemExit(f"unknown index kind {kind!r}: plaid or warp")


def open_index(kind: str, args: argparse.Namespace, embed_corpus: Callable[[], tuple[list[str], list[Any], float]]
               ) -> tuple[Any, dict[str, Any]]:
    """PyLate's ``kind`` index over the corpus: the one in ``--work`` when its marker says it was built with these
    settings, else built now (``embed_corpus`` gives ids, embeddings and the seconds they took, computed once)."""
    from pylate import indexes

    build, search = index_settings(kind, args)
    name = f"{kind}-" + "-".join(f"{key}{value}" for key, value in sorted(build.items()))
    folder = os.path.join(args.work, name)
    marker = os.path.join(folder, MARKER)
    recorded = None
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as handle:
            recorded = json.load(handle)
    reuse = recorded is not None and recorded.get("build") == build and recorded.get("corpus") == args.corpus_digest
    common = {"index_folder": args.work, "index_name": name, "override": not reuse, "show_progress": False,
              "device": "cpu", **build, **search}
    cls = indexes.PLAID if kind == "plaid" else indexes.WARP
    if reuse:
        return cls(**common), {**recorded, "built_now": False}
    ids, embeddings, encode_s = embed_corpus()
    tick = time.perf_counter()
    index = cls(**common)
    index.add_documents(documents_ids=ids, documents_embeddings=embeddings)
    record = {"build": build, "corpus": args.corpus_digest, "docs": len(ids), "encode_s": encode_s,
              "index_s": time.perf_counter() - tick, "tokens": int(sum(len(e) for e in embeddings))}
    with open(marker, "w", encoding="utf-8") as handle:
        json.dump(record, handle)
    return index, {**record, "built_now": True}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a ColBERT folder PyLate loads (a hil export is one)")
    parser.add_argument("--corpus", required=True, help='JSON {"ids": [...], "texts": [...]}')
    parser.add_argument("--queries", required=True, help='JSON {"ids": [...], "texts": [...]}')
    parser.add_argument("--work", required=True, help="folder of the indexes (reused between runs)")
    parser.add_argument("--out", required=True, help="where the result JSON is written")
    parser.add_argument("--indexes", default="plaid,warp", help="comma-separated: plaid, warp")
    parser.add_argument("--corpus-digest", default="", help="the corpus's fingerprint: an index is reused only "
                        "when it was built from the same one")
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="documents per batch when encoding the corpus")
    parser.add_argument("--nbits", type=int, default=4)
    parser.add_argument("--kmeans-niters", type=int, default=4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--plaid-n-full-scores", type=int, default=8192)
    parser.add_argument("--plaid-n-ivf-probe", type=int, default=8)
    parser.add_argument("--warp-n-ivf-probe", type=int, default=32)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)

    import resource

    import torch

    torch.set_num_threads(args.threads)
    import pylate
    from pylate import models

    corpus, queries = read_pairs(args.corpus), read_pairs(args.queries)
    model = models.ColBERT(model_name_or_path=args.model, device="cpu")
    os.makedirs(args.work, exist_ok=True)
    embedded: list[tuple[list[str], list[Any], float]] = []

    def embed_corpus() -> tuple[list[str], list[Any], float]:
        if not embedded:
            tick = time.perf_counter()
            vectors = model.encode(list(corpus.values()), is_query=False, batch_size=args.batch_size,
                                   show_progress_bar=False)
            embedded.append((list(corpus), list(vectors), time.perf_counter() - tick))
        return embedded[0]

    out: dict[str, Any] = {"protocol": PROTOCOL, "pylate": getattr(pylate, "__version__", "?"),
                           "torch": torch.__version__, "threads": args.threads, "warmup": args.warmup, "k": args.k,
                           "versions": {}, "indexes": {}}
    for distribution in ("fast-plaid", "xtr-warp-rs", "sentence-transformers", "transformers"):
        try:
            from importlib.metadata import version

            out["versions"][distribution] = version(distribution)
        except Exception:  # not installed: recorded as missing, the index that needs it fails below
            out["versions"][distribution] = None
    for kind in [part for part in args.indexes.split(",") if part]:
        index, build = open_index(kind, args, embed_corpus)

        encode_ms: list[float] = []  # the query-encoding part of every call (warm-up ones first)

        def search(qid: str, text: str, index: Any = index, encode_ms: list[float] = encode_ms) -> dict[str, float]:
            tick = time.perf_counter()
            encoded = model.encode([text], is_query=True, show_progress_bar=False)
            encode_ms.append(1000.0 * (time.perf_counter() - tick))
            return {hit["id"]: float(hit["score"]) for hit in index(encoded, k=args.k)[0]}

        run, times = time_one_at_a_time(search, queries, args.warmup)
        out["indexes"][kind] = {"settings": dict(zip(("build", "search"), index_settings(kind, args))),
                                "build": build, "times_ms": times, "encode_ms": encode_ms[len(encode_ms) - len(times):],
                                "run": run, "threads_after": torch.get_num_threads()}
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(out, handle)
    os.replace(tmp, args.out)
    print(json.dumps({"protocol": PROTOCOL, "indexes": list(out["indexes"]), "out": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
