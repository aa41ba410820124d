"""memory: peak RSS of building an index against ``chunk_docs`` (the memory knob of ``build_index``), with
``--memory-model``."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sections.common import load_dataset, load_model
from sections.options import Job, comma_ints, option

if TYPE_CHECKING:
    from sections.config import BenchConfig


@dataclass(frozen=True)
class Config:
    """Peak RSS of index building against chunk_docs."""

    chunks: tuple[int, ...] = option("--memory-chunks", (64, 512, 2048), "chunk_docs values (memory section)",
                                     type=comma_ints)
    docs: int = option("--memory-docs", 2048, "documents indexed per memory run")
    model: str = option("--memory-model", "bert-tiny-splade", "model of the memory section")


def jobs(config: BenchConfig) -> list[Job]:
    return [Job(f"memory:chunk{chunk}", "memory", chunk=chunk) for chunk in config.memory.chunks]


def run(config: BenchConfig, job: Job) -> dict[str, Any]:
    """Peak RSS of building an index with ``job.chunk`` documents per chunk."""
    from hil.retrieval.builder import build_index
    from measure import current_rss_mb, peak_rss_mb

    settings = config.memory
    dataset = load_dataset(config)
    ids, texts = dataset.doc_ids()[: settings.docs], dataset.documents()[: settings.docs]
    encoder = load_model(config, backbone=settings.model)
    with tempfile.TemporaryDirectory(dir=config.common.work) as tmp:
        baseline = current_rss_mb()
        tick = time.perf_counter()
        index = build_index(encoder, ids, texts, Path(tmp) / "idx", chunk_docs=job.chunk,
                            batch_size=config.common.batch_size, progress=False)
        seconds = time.perf_counter() - tick
        vector_mb = index.n_tokens * index.bytes_per_token() / 2 ** 20
    peak = peak_rss_mb()
    return {"chunk_docs": job.chunk, "docs": len(ids), "model": settings.model, "build_s": seconds,
            "rss_after_model_load_mb": baseline, "peak_rss_mb": peak, "peak_above_model_mb": peak - baseline,
            "index_vectors_mb": vector_mb}


def rows(label: str, result: dict[str, Any]) -> list[tuple[str, str, str]]:
    r = result
    return [(f"memory chunk_docs={r['chunk_docs']}", f"peak RSS {r['peak_rss_mb']:.0f} MB",
             f"{r['peak_above_model_mb']:.0f} MB above the loaded model; {r['docs']} docs "
             f"({r['index_vectors_mb']:.0f} MB of vectors), {r['model']}, {r['build_s']:.0f} s")]
