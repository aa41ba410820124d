"""growth: the corpus tiled 1x/4x/16x (the dataset repeated with new ids; the encoded vectors are tiled, not
re-encoded): plaid build seconds, bytes, peak RSS and search latency at each size."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sections.common import INDEX_VARIANTS, base_index, judged_queries, latencies, load_dataset, load_model
from sections.options import Job, comma_ints, option

if TYPE_CHECKING:
    from sections.config import BenchConfig


@dataclass(frozen=True)
class Config:
    """The corpus tiled: multiples, queries timed, the PLAID variant."""

    factors: tuple[int, ...] = option("--growth", (1, 4, 16), "corpus multiples (empty: skip)", type=comma_ints)
    queries: int = option("--growth-queries", 100)
    variant: str = option("--growth-variant", "plaid", choices=("plaid", "plaid-r2"))


def jobs(config: BenchConfig) -> list[Job]:
    return [Job(f"growth:x{factor}", "growth", factor=factor) for factor in config.growth.factors]


def tiled_index(base: Any, factor: int, directory: Path) -> Any:
    """``base`` repeated ``factor`` times (copy r of document d gets id ``d#r``), streamed through memmaps."""
    from hil.provenance import write_json_atomic
    from hil.retrieval.index import TokenIndex, save_npy_atomic, seal_index

    if (directory / "index.json").is_file():
        return TokenIndex.load(directory)
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    n_tokens = base.n_tokens * factor
    for head, array in base.embeddings.items():
        target = np.lib.format.open_memmap(directory / f"{head}.embeddings.npy", mode="w+", dtype=np.float16,
                                           shape=(n_tokens, array.shape[1]))
        for r in range(factor):
            target[r * base.n_tokens: (r + 1) * base.n_tokens] = array
        target.flush()
        del target
    np.save(directory / "token_ids.npy", np.tile(np.asarray(base.token_ids), factor))
    lengths = np.tile(base.doc_lengths, factor)
    save_npy_atomic(directory / "doc_offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    ids = [d if r == 0 else f"{d}#{r}" for r in range(factor) for d in base.doc_ids]
    write_json_atomic(directory / "doc_ids.json", ids)
    # Sealed: index.json records the sizes and checksums of these new files (a copy of base.meta's would not match).
    seal_index(directory, {**base.meta, "n_docs": len(ids), "n_tokens": n_tokens,
                           "faiss": {"kind": "flat", "params": {}, "factory": "Flat", "metric": "inner_product",
                                     "stored": False},
                           "corpus_fingerprint": f"{base.corpus_fingerprint}x{factor}",
                           "tiled_from": str(base.directory), "tiling": factor})
    return TokenIndex.load(directory)


def run(config: BenchConfig, job: Job) -> dict[str, Any]:
    from hil.retrieval.backends.configs import PlaidIndexConfig
    from hil.retrieval.builder import rebuild_search_structures
    from hil.retrieval.index import TokenIndex
    from measure import peak_rss_mb, percentiles

    factor = job.factor
    dataset = load_dataset(config)
    encoder = load_model(config)
    base, record = base_index(config, dataset, encoder)
    directory = base.directory.with_name(base.directory.name + f"--x{factor}")
    tick = time.perf_counter()
    tiled = tiled_index(base, factor, directory)
    tile_s = time.perf_counter() - tick
    params = {**INDEX_VARIANTS[config.growth.variant][1], **config.index.plaid_params}
    tick = time.perf_counter()
    index = rebuild_search_structures(tiled, PlaidIndexConfig(**params), progress=False)
    build_s = time.perf_counter() - tick
    index = TokenIndex.load(index.directory)
    queries = judged_queries(dataset, config.growth.queries)
    _, times, stats = latencies(encoder, index, queries, config.common.k)
    # The original documents keep their ids, so nDCG@10 is comparable (copies tie with originals and the id
    # tie-break, descending as trec_eval's, decides between them; it measures the pruning, not a new corpus).
    return {"factor": factor, "n_docs": index.n_docs, "n_tokens": index.n_tokens, "tile_s": tile_s,
            "structure_build_s": build_s, "encode_s_estimated": record["encode_and_write_s"] * factor,
            "params": index.backend_settings["params"], "bytes_per_token": index.bytes_per_token(),
            "disk_bytes": index.disk_bytes(), **percentiles(times), "candidates_mean": stats.get("candidates_mean"),
            "peak_rss_mb": peak_rss_mb()}


def rows(label: str, result: dict[str, Any]) -> list[tuple[str, str, str]]:
    r = result
    return [(f"growth x{r['factor']}", f"p50 {r['p50_ms']:.1f} ms, p95 {r['p95_ms']:.1f} ms",
             f"{r['n_docs']} docs, {r['n_tokens']} tokens; plaid build {r['structure_build_s']:.1f} s; "
             f"{r['disk_bytes'] / 2 ** 20:.0f} MiB on disk; peak RSS {r['peak_rss_mb']:.0f} MB")]
