"""What the sections' children share: the dataset slice, the model, the base index and its variants, nDCG@10 of a
run, and per-query search latencies.

Heavy packages (torch, FAISS, ``hil``) are imported inside the functions, so the parent process, which only plans
and prints, never loads them.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sections.config import BenchConfig

# Index variants: name -> (back-end kind, its build-time settings, document encoding). The base index (fp32 encoding,
# fp16 vectors) is encoded once; each variant derives its structures from it (or is encoded again for int8).
INDEX_VARIANTS: dict[str, tuple[str, dict[str, Any], str]] = {
    "flat": ("flat", {}, "fp32"),
    "plaid": ("plaid", {}, "fp32"),
    "plaid-r2": ("plaid", {"residual_bits": 2, "keep_embeddings": False}, "fp32"),
    "plaid-r4": ("plaid", {"residual_bits": 4, "keep_embeddings": False}, "fp32"),
    "ivfpq": ("ivfpq", {}, "fp32"),
    "flat-int8": ("flat", {}, "int8"),
    "flat-onnx-int8": ("flat", {}, "onnx-int8"),
    "plaid-onnx-int8": ("plaid", {}, "onnx-int8"),
    "muvera": ("muvera", {}, "fp32"),  # the paper's k_sim 5, d_proj 16, R 20: 10,240 floats per document
    "muvera-centered": ("muvera", {"transform": "center"}, "fp32"),
}


def setup_threads(threads: int) -> None:
    import faiss
    import torch

    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)


def load_dataset(config: BenchConfig) -> Any:
    """The dataset, sliced by ``--docs`` / ``--queries`` (seeded) when asked."""
    from hil.data.beir import load_beir

    common = config.common
    dataset = load_beir(common.dataset, split=common.split)
    if common.docs or common.queries:
        dataset = dataset.subset(common.queries, common.docs, seed=common.seed)
    return dataset


def load_model(config: BenchConfig, *, backbone: str | None = None, export: str | None = None) -> Any:
    """A trained ``export`` as saved, else ``backbone`` (default ``--model``) with an untrained head seeded by
    ``--seed`` and ``--doc-maxlen``."""
    import torch

    from hil.modeling.loading import load_encoder

    torch.manual_seed(config.common.seed)  # the untrained head is a seeded random projection
    if export:
        return load_encoder(export)
    return load_encoder(backbone or config.common.model, doc_maxlen=config.common.doc_maxlen)


def document_encoder(encoder: Any, mode: str, calibration: list[str]) -> Any:
    from hil.retrieval.fast_encode import document_encoder as wrap

    return wrap(encoder, None if mode == "fp32" else mode, calibration_texts=calibration)


def base_folder(config: BenchConfig, dataset: Any, encoder: Any, encoding: str = "fp32") -> Path:
    from hil.retrieval.index import encoder_fingerprint

    name = f"{dataset.name}-{dataset.fingerprint()[:8]}-{encoder_fingerprint(encoder)[:12]}"
    folder = Path(config.common.work) / name
    return folder.with_name(folder.name + ("" if encoding == "fp32" else f"-{encoding}"))


def base_index(config: BenchConfig, dataset: Any, encoder: Any, encoding: str = "fp32") -> tuple[Any, dict]:
    """The fp16 base index of this corpus and encoder under the work folder (built once, then reused), and the
    record of how long its encoding took and how much memory it needed (kept beside it)."""
    from hil.retrieval.builder import open_or_build_index

    common = config.common
    folder = base_folder(config, dataset, encoder, encoding)
    record_path = folder.with_name(folder.name + ".build.json")
    fresh = not (folder / "index.json").is_file()
    tick = time.perf_counter()
    options = {} if encoding == "fp32" else {"quantize": encoding, "calibration_docs": common.calibration_docs}
    index = open_or_build_index(encoder, dataset.doc_ids(), dataset.documents(), folder,
                                corpus_fingerprint=dataset.fingerprint(), batch_size=common.batch_size,
                                chunk_docs=common.chunk_docs, progress=False, **options)
    if fresh or not record_path.is_file():
        from measure import peak_rss_mb

        record = {"encode_and_write_s": time.perf_counter() - tick, "peak_rss_mb": peak_rss_mb(),
                  "chunk_docs": common.chunk_docs, "batch_size": common.batch_size, "measured_now": fresh,
                  "threads": common.threads}
        record_path.write_text(json.dumps(record))
    return index, json.loads(record_path.read_text())


def variant_index(config: BenchConfig, base: Any, name: str) -> tuple[Any, float]:
    """A copy of ``base`` (vectors hard-linked, not copied) with the variant's search structures; build seconds."""
    from hil.provenance import write_json_atomic
    from hil.retrieval.backends.configs import REGISTRY
    from hil.retrieval.builder import rebuild_search_structures
    from hil.retrieval.index import TokenIndex

    kind, params, _ = INDEX_VARIANTS[name]
    target = base.directory.with_name(base.directory.name + f"--{name}")
    if (target / "index.json").is_file():
        existing = TokenIndex.load(target)
        if existing.meta.get("bench_build_s") is not None:
            return existing, float(existing.meta["bench_build_s"])
        shutil.rmtree(target)
    elif target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for path in base.directory.iterdir():
        if path.suffix == ".faiss" or any(path.name.endswith(f".{x}.npy") for x in
                                          ("centroids", "codes", "ivf_offsets", "ivf_docs", "residuals")):
            continue
        os.link(path, target / path.name) if path.name.endswith(".npy") else shutil.copy(path, target / path.name)
    tick = time.perf_counter()
    settings = {**params, **config.index.plaid_params} if kind == "plaid" else params
    index = rebuild_search_structures(TokenIndex.load(target), REGISTRY[kind].index_config(**settings), progress=False)
    seconds = time.perf_counter() - tick
    write_json_atomic(target / "index.json", {**index.meta, "bench_build_s": seconds})
    return TokenIndex.load(target), seconds


def ndcg(dataset: Any, run: dict[str, dict[str, float]]) -> tuple[float, dict[str, float]]:
    """Mean nDCG@10 of ``run`` and each query's value (``hil.evaluation``'s scoring of a run)."""
    from hil.evaluation.evaluate import score_run

    evaluation = score_run("bench", dataset, run, metrics=("ndcg@10",))
    return float(evaluation.aggregate["ndcg@10"]), {q: float(v["ndcg@10"]) for q, v in evaluation.per_query.items()}


def judged_queries(dataset: Any, limit: int | None) -> dict[str, str]:
    qids = [q for q in dataset.queries if q in dataset.qrels]
    return {q: dataset.queries[q] for q in (qids[:limit] if limit else qids)}


def latencies(encoder: Any, index: Any, queries: dict[str, str], k: int, **options: Any
              ) -> tuple[dict[str, dict[str, float]], list[float], dict[str, Any]]:
    """Full ranking one query at a time (query encoding included): the run and each query's milliseconds."""
    from hil.retrieval.full_ranking import full_rank

    run, times, last = {}, [], {}
    first = next(iter(queries))
    full_rank(encoder, index, {first: queries[first]}, k=k, batch_size=1, progress=False, **options)  # warm-up
    for qid, text in queries.items():
        tick = time.perf_counter()
        result = full_rank(encoder, index, {qid: text}, k=k, batch_size=1, progress=False, **options)
        times.append(1000.0 * (time.perf_counter() - tick))
        run.update(result.run)
        last = result.stats
    return run, times, last


def fmt(value: Any, digits: int = 1) -> str:
    """A figure in the printed table: ``digits`` decimals (scientific below 0.01), "-" when missing."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) >= 0.01 or value == 0 else f"{value:.2e}"
    return str(value)
