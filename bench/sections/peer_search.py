"""peer-search: PyLate's PLAID (fast-plaid) and WARP (xtr-warp-rs) indexes against ours, on the same model, corpus
and queries: latency p50/p95 per query (one query at a time, query encoding included, warm-up queries excluded,
the same threads) and nDCG@10, with the ratios of PyLate's times to ours.

PyLate runs in ``--peer-python`` (its own pins; bench/README.md) through ``bench/peer_search_pylate.py``, which
loads the model we search with (exported once as a Stanford ColBERT checkpoint: a ``hil`` ColBERT export is one,
``bench/interop.py`` checks PyLate reads it to 1e-5), builds its indexes in ``--work`` (kept and reused), times its
queries with the same loop as ours (:func:`peer_search_pylate.time_one_at_a_time`) and hands back each query's
milliseconds and top ``--k``; both runs are scored here, by the same pytrec_eval code (:func:`sections.common.ndcg`),
with a paired bootstrap interval of ours minus PyLate's per-query nDCG@10. With ``--peer-search-rounds R`` ours and
PyLate's alternate R times (so a change of load hits both) and the percentiles are over every round's queries.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sections.common import (
    INDEX_VARIANTS,
    base_folder,
    base_index,
    fmt,
    judged_queries,
    load_dataset,
    load_model,
    ndcg,
    variant_index,
)
from sections.options import BENCH, Job, comma_list, option

if TYPE_CHECKING:
    from sections.config import BenchConfig

PEER_SCRIPT = BENCH / "peer_search_pylate.py"
PROTOCOL = 1  # the version of the JSON the peer script writes (its module docstring)
PEER_INDEXES = ("plaid", "warp")


class PeerError(RuntimeError):
    """The peer did not run, or what it wrote is not the protocol's shape (one line, for the table)."""


@dataclass(frozen=True)
class Config:
    """PyLate's PLAID and WARP indexes searched beside ours (in ``--peer-python``), same model and queries."""

    indexes: tuple[str, ...] = option("--peer-search-indexes", PEER_INDEXES, "PyLate's indexes: plaid (fast-plaid), "
                                      "warp (xtr-warp-rs)", type=comma_list)
    ours: str = option("--peer-search-ours", "plaid", "our index variant timed beside them (--index-variants name)")
    queries: int | None = option("--peer-search-queries", None, "queries timed (default: all judged)", type=int)
    warmup: int = option("--peer-search-warmup", 3, "queries searched untimed before timing, on each side")
    rounds: int = option("--peer-search-rounds", 1, "rounds of ours then PyLate's (percentiles over all of them)")
    plaid_n_full_scores: int = option("--peer-plaid-n-full-scores", 8192, "PyLate PLAID: documents scored in full "
                                      "(PyLate 1.6.0's default)")
    plaid_n_ivf_probe: int = option("--peer-plaid-n-ivf-probe", 8, "PyLate PLAID: centroids probed per query token")
    warp_n_ivf_probe: int = option("--peer-warp-n-ivf-probe", 32, "PyLate WARP: centroids probed per query token")
    nbits: int = option("--peer-nbits", 4, "PyLate indexes: residual bits per dimension (PyLate's default)")


def check(settings: Config) -> None:
    """Unknown index names stop the run before any child starts."""
    if settings.ours not in INDEX_VARIANTS:
        raise SystemExit(f"bench: unknown index variant {settings.ours!r} for --peer-search-ours; known: "
                         f"{tuple(INDEX_VARIANTS)}")
    bad = [kind for kind in settings.indexes if kind not in PEER_INDEXES]
    if bad or not settings.indexes:
        raise SystemExit(f"bench: unknown PyLate indexes {bad} in --peer-search-indexes; known: {PEER_INDEXES}")


def jobs(config: BenchConfig) -> list[Job]:
    return [Job("peer-search", "peer-search")]


def peer_arguments(config: BenchConfig, model_dir: Path, corpus: Path, queries: Path, work: Path,
                   corpus_digest: str) -> list[str]:
    """The peer script's command-line arguments (without ``--out``): the same k, threads and warm-up as ours."""
    settings, common = config.peer_search, config.common
    return ["--model", str(model_dir), "--corpus", str(corpus), "--queries", str(queries), "--work", str(work),
            "--indexes", ",".join(settings.indexes), "--corpus-digest", corpus_digest, "--k", str(common.k),
            "--threads", str(common.threads), "--warmup", str(settings.warmup),
            "--batch-size", str(common.batch_size), "--nbits", str(settings.nbits),
            "--plaid-n-full-scores", str(settings.plaid_n_full_scores),
            "--plaid-n-ivf-probe", str(settings.plaid_n_ivf_probe),
            "--warp-n-ivf-probe", str(settings.warp_n_ivf_probe)]


def call_peer(python: str, script: Path, arguments: list[str], out: Path, indexes: tuple[str, ...],
              query_ids: list[str], timeout: float | None = None) -> dict[str, Any]:
    """Run the peer script in ``python`` and read what it wrote to ``out`` (:func:`read_peer`)."""
    out.unlink(missing_ok=True)
    try:
        done = subprocess.run([python, str(script), *arguments, "--out", str(out)], capture_output=True, text=True,
                              timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise PeerError(f"PyLate did not run in {python}: {error}") from None
    if done.returncode != 0 or not out.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PeerError(f"PyLate did not run in {python} (exit {done.returncode}): {tail[0][:300]}")
    return read_peer(json.loads(out.read_text()), indexes, query_ids)


def read_peer(found: dict[str, Any], indexes: tuple[str, ...], query_ids: list[str]) -> dict[str, Any]:
    """The peer's result, checked against what was asked: the protocol version, every index asked for, one time per
    query in the order given, a ranking only of queries asked."""
    if found.get("protocol") != PROTOCOL:
        raise PeerError(f"peer protocol {found.get('protocol')!r}, expected {PROTOCOL}")
    asked = set(query_ids)
    for kind in indexes:
        side = found.get("indexes", {}).get(kind)
        if side is None:
            raise PeerError(f"the peer returned no {kind!r} index")
        if len(side.get("times_ms", ())) != len(query_ids):
            raise PeerError(f"peer {kind}: {len(side.get('times_ms', ()))} times for {len(query_ids)} queries")
        unknown = set(side.get("run", {})) - asked
        if unknown:
            raise PeerError(f"peer {kind}: rankings of queries not asked for: {sorted(unknown)[:3]}")
    return found


def search_alone(side: dict[str, Any]) -> dict[str, Any]:
    """``{"search_alone": percentiles}`` of each call's time minus its query-encoding part (``encode_ms``, one per
    entry of ``times_ms``), or nothing when the side did not time its encoding."""
    from measure import percentiles

    encode = side.get("encode_ms")
    if encode is None or len(encode) != len(side["times_ms"]):
        return {}
    alone = np.asarray(side["times_ms"], dtype=np.float64) - np.asarray(encode, dtype=np.float64)
    return {"search_alone": percentiles(alone), "encode": percentiles(encode)}


def compare(dataset: Any, ours: dict[str, Any], peers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each side's latency percentiles (over its ``times_ms``) and nDCG@10 (of its ``run``, scored against
    ``dataset``'s qrels by the same code), and for each peer index: ``time_ratio_p50`` / ``time_ratio_p95`` =
    PyLate's milliseconds / ours (above 1: ours is faster) and ours minus PyLate's per-query nDCG@10 (mean, paired
    bootstrap 95% interval, p-value). Sides that timed their query encoding (``encode_ms``) also get the
    percentiles of search alone (each call minus its encoding) and ``search_time_ratio_p50`` / ``_p95``."""
    from hil.evaluation.statistics import paired_bootstrap_test
    from measure import percentiles

    ours_ndcg, ours_per_query = ndcg(dataset, ours["run"])
    mine = {**percentiles(ours["times_ms"]), "ndcg10": ours_ndcg, **search_alone(ours)}
    out: dict[str, Any] = {"ours": mine, "pylate": {}}
    for kind, side in peers.items():
        value, per_query = ndcg(dataset, side["run"])
        stats = {**percentiles(side["times_ms"]), **search_alone(side)}
        test = paired_bootstrap_test(ours_per_query, per_query, n_samples=10000, seed=0)
        ratios = {f"search_time_ratio_{p}": stats["search_alone"][f"{p}_ms"] / mine["search_alone"][f"{p}_ms"]
                  for p in ("p50", "p95") if "search_alone" in stats and "search_alone" in mine}
        out["pylate"][kind] = {**stats, "ndcg10": value, **ratios,
                               "time_ratio_p50": stats["p50_ms"] / mine["p50_ms"],
                               "time_ratio_p95": stats["p95_ms"] / mine["p95_ms"],
                               "ndcg10_ours_minus_pylate": {"mean_diff": test.mean_diff, "ci95": list(test.ci),
                                                            "p_value": test.p_value, "queries": test.n}}
    return out


def pylate_model(encoder: Any, folder: Path) -> Path:
    """``encoder`` as a Stanford ColBERT checkpoint PyLate loads (written once per encoder fingerprint)."""
    from hil.modeling.export import export_model

    if not (folder / "artifact.metadata").is_file():
        export_model(encoder, folder)
    if not (folder / "artifact.metadata").is_file():
        raise PeerError(f"PyLate reads Stanford ColBERT checkpoints and this model has none ({folder}): "
                        "only a ColBERT (not ColBERT-HIL) export can be searched by PyLate")
    return folder


def run(config: BenchConfig, job: Job) -> dict[str, Any]:
    from hil.retrieval.full_ranking import full_rank
    from hil.retrieval.index import encoder_fingerprint
    from measure import peak_rss_mb
    from peer_search_pylate import time_one_at_a_time

    settings, common = config.peer_search, config.common
    dataset = load_dataset(config)
    encoder = load_model(config, export=common.export)
    base, _ = base_index(config, dataset, encoder)
    index, ours_build_s = variant_index(config, base, settings.ours)
    queries = judged_queries(dataset, settings.queries)
    judged = replace(dataset, queries=queries, qrels={q: dataset.qrels[q] for q in queries})
    options: dict[str, Any] = dict(config.search.options())  # --nprobe / --ndocs / --stage2-docs, as search does
    if config.search.encode_queries == "onnx":  # --encode-queries onnx: queries through ONNX Runtime, as search does
        from hil.retrieval.onnx_encode import onnx_query_encoder

        options["query_encoder"] = onnx_query_encoder(encoder)

    applied: dict[str, Any] = {}
    ours_encode: list[float] = []  # the query-encoding part of every call (full_rank's encode_s)

    def ours_search(qid: str, text: str) -> dict[str, float]:
        result = full_rank(encoder, index, {qid: text}, k=common.k, batch_size=1, progress=False, **options)
        applied.update(result.stats["search"])  # the values the back-end used (PLAID's defaults depend on k)
        ours_encode.append(1000.0 * result.stats["encode_s"])
        return result.run.get(qid, {})

    work = Path(common.work) / f"pylate-{base_folder(config, dataset, encoder).name}"
    work.mkdir(parents=True, exist_ok=True)
    corpus_path, queries_path = work / "corpus.json", work / f"queries-{len(queries)}.json"
    corpus_path.write_text(json.dumps({"ids": dataset.doc_ids(), "texts": dataset.documents()}))
    queries_path.write_text(json.dumps({"ids": list(queries), "texts": list(queries.values())}))
    python = config.peer.python or sys.executable
    out: dict[str, Any] = {"queries": len(queries), "k": common.k, "threads": common.threads,
                           "warmup": settings.warmup, "rounds": settings.rounds, "ours_variant": settings.ours,
                           "ours_search_options": config.search.options(), "ours_structure_build_s": ours_build_s,
                           "ours_query_encoding": config.search.encode_queries,
                           "model": common.export or common.model, "peer_python": python}
    ours_times: list[float] = []
    peer_times: dict[str, list[float]] = {kind: [] for kind in settings.indexes}
    peer_encode: dict[str, list[float]] = {kind: [] for kind in settings.indexes}
    ours_run: dict[str, dict[str, float]] = {}
    peer: dict[str, Any] | None = None
    try:
        model_dir = pylate_model(encoder, Path(common.work) / f"pylate-model-{encoder_fingerprint(encoder)}")
        arguments = peer_arguments(config, model_dir, corpus_path, queries_path, work, dataset.fingerprint())
    except PeerError as error:
        out["peer_error"], arguments = str(error), None
    ours_encode_timed: list[float] = []
    for _ in range(max(1, settings.rounds)):  # ours, then PyLate's, alternating: a change of load hits both
        ours_encode.clear()
        ours_run, times = time_one_at_a_time(ours_search, queries, settings.warmup)
        ours_times += times
        ours_encode_timed += ours_encode[len(ours_encode) - len(times):]  # the warm-up calls come first
        if arguments is None or "peer_error" in out:
            continue
        try:
            peer = call_peer(python, PEER_SCRIPT, arguments, work / "peer-result.json", settings.indexes,
                             list(queries))
        except PeerError as error:
            out["peer_error"] = str(error)
            continue
        for kind in settings.indexes:
            peer_times[kind] += peer["indexes"][kind]["times_ms"]
            peer_encode[kind] += peer["indexes"][kind].get("encode_ms", [])
    peers = {} if peer is None or "peer_error" in out else \
        {kind: {"times_ms": peer_times[kind], "encode_ms": peer_encode[kind], "run": peer["indexes"][kind]["run"]}
         for kind in settings.indexes}
    out["ours_search_applied"] = applied
    out.update(compare(judged, {"times_ms": ours_times, "encode_ms": ours_encode_timed, "run": ours_run}, peers))
    out["ours"]["times_ms"], out["ours"]["encode_ms"] = ours_times, ours_encode_timed
    for kind in peers:
        side = peer["indexes"][kind]  # type: ignore[index]
        out["pylate"][kind].update(times_ms=peer_times[kind], encode_ms=peer_encode[kind], settings=side["settings"],
                                   build=side["build"])
    if peer is not None:
        out["pylate_versions"] = {"pylate": peer["pylate"], "torch": peer["torch"], **peer["versions"]}
        out["pylate_threads"] = peer["threads"]
        out["pylate_peak_rss_mb"] = peer.get("peak_rss_mb")
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def applied_settings(search: dict[str, Any]) -> str:
    """``nprobe 2, ndocs 256, stage2_docs 1024`` from a search's recorded settings (empty: not recorded)."""
    return ", ".join(f"{key} {value}" for key, value in search.items() if key != "backend") or "not recorded"


def alone_text(side: dict[str, Any]) -> str:
    """``; search alone p50 .. / p95 .. ms`` when the side timed its query encoding, else nothing."""
    alone = side.get("search_alone")
    return f"; search alone p50 {alone['p50_ms']:.1f} ms, p95 {alone['p95_ms']:.1f} ms" if alone else ""


def rows(label: str, result: dict[str, Any]) -> list[tuple[str, str, str]]:
    r, ours = result, result["ours"]
    found = [(f"peer-search ours {r['ours_variant']}", f"p50 {ours['p50_ms']:.1f} ms, p95 {ours['p95_ms']:.1f} ms"
              + alone_text(ours),
              f"nDCG@10 {fmt(ours.get('ndcg10'), 4)}; {r['queries']} queries one at a time, k {r.get('k')}, query "
              f"encoding included ({r.get('ours_query_encoding', 'fp32')}), threads {r['threads']}, {r['warmup']} "
              f"warm-up, {r['rounds']} round(s); search {applied_settings(r.get('ours_search_applied', {}))}")]
    if "peer_error" in r:
        return found + [("peer-search PyLate", "not run", r["peer_error"])]
    versions = r.get("pylate_versions", {})
    backend = {"plaid": "fast-plaid", "warp": "xtr-warp-rs"}
    for kind, side in r["pylate"].items():
        diff = side["ndcg10_ours_minus_pylate"]
        low, high = diff["ci95"]
        search_ratio = (f"; search alone x{side['search_time_ratio_p50']:.2f} p50, "
                        f"x{side['search_time_ratio_p95']:.2f} p95" if "search_time_ratio_p50" in side else "")
        found.append((f"peer-search PyLate {kind}", f"p50 {side['p50_ms']:.1f} ms, p95 {side['p95_ms']:.1f} ms"
                      + alone_text(side),
                      f"PyLate/ours time x{side['time_ratio_p50']:.2f} p50, x{side['time_ratio_p95']:.2f} p95"
                      f"{search_ratio} "
                      f"(above 1: ours faster); nDCG@10 {side['ndcg10']:.4f} (ours {diff['mean_diff']:+.4f}, 95% CI "
                      f"[{low:+.4f}, {high:+.4f}], p {fmt(diff['p_value'], 2)}); pylate {versions.get('pylate')} "
                      f"{backend.get(kind, kind)} {versions.get(backend.get(kind, kind))}"))
    return found
