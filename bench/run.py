"""Speed and memory benchmark of ``hil``: encoding, indexing, search, training, growth, and PyLate as a peer.

One command prints a table and writes JSON (``bench/results/<name>.json`` or ``--output``)::

    HIL_DATA_DIR=../shared/data HIL_MODELS_DIR=../shared/models python bench/run.py --name scifact-minilm
    python bench/run.py --quick                       # < 3 min: 256 documents, 40 queries, no growth/peer
    python bench/run.py --sections encode,peer --encode-variants fp32,onnx-int8 \
        --peer-python /tmp/pylate-venv/bin/python
    python bench/run.py --sections search --index-variants flat-onnx-int8 --export runs/demo/export

Every section runs in a fresh child process, so each peak resident memory figure (``ru_maxrss``) belongs to that
section alone. Timings on a shared machine are noisy: variants that are compared are measured in the same child,
one after the other, and reported as ratios as well as absolute numbers. The settings of every figure go into
the JSON beside it, with package versions and the machine.

Sections (``--sections``, comma-separated; default all):
    peak    fp32 matrix-multiply GFLOP/s (best and median of repeats) with the benchmark's threads
    encode  documents/s and tokens/s of document encoding, GFLOP/s achieved and its fraction of the peak,
            for each ``--encode-variants`` (fp32; int8 = PyTorch SmoothQuant + dynamic int8 Linear layers;
            onnx / onnx-int8 = ONNX Runtime fp32 / int8; compile = torch.compile), and how far each variant's
            vectors are from fp32 (cosine)
    index   build seconds (encoding and search structures apart), bytes per token, disk bytes, peak RSS, for
            each ``--index-variants`` (flat, plaid, plaid-r2 = 2-bit residuals without fp16 vectors, ...)
    search  full-ranking latency p50/p95 per query (batch of one query, query encoding included) and nDCG@10
            per index variant, beside exact brute force (its nDCG@10 and time) and BM25's nDCG@10; each variant's
            per-query nDCG@10 difference to exact search over fp32 documents, with a paired bootstrap 95% interval
            (``flat-int8`` / ``flat-onnx-int8``: exact search over documents encoded that way)
    train   triples/s of ColBERT and ColBERT-HIL training steps at ``--train-batch`` (forward, backward, AdamW)
    memory  peak RSS of index building against ``chunk_docs`` (the memory knob), ``--memory-model``
    growth  the corpus tiled 1x/4x/16x (SciFact repeated with new ids; the encoded vectors are tiled, not
            re-encoded): plaid build seconds, bytes, peak RSS and search latency at each size
    peer    PyLate's ColBERT over the same backbone, lengths, batch size and threads encodes the same documents
            (in ``--peer-python``); ratio of documents/s against ours
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

SECTIONS = ("peak", "encode", "index", "search", "train", "growth", "peer", "memory")
RESULT_PREFIX = "BENCH-RESULT "
# Index variants: name -> (faiss_kind, faiss_params, document encoding). The base index (fp32 encoding, fp16
# vectors) is encoded once; each variant derives its structures from it (or is encoded again for int8).
INDEX_VARIANTS: dict[str, tuple[str, dict[str, Any], str]] = {
    "flat": ("flat", {}, "fp32"),
    "plaid": ("plaid", {}, "fp32"),
    "plaid-r2": ("plaid", {"residual_bits": 2, "keep_embeddings": False}, "fp32"),
    "plaid-r4": ("plaid", {"residual_bits": 4, "keep_embeddings": False}, "fp32"),
    "ivfpq": ("ivfpq", {}, "fp32"),
    "flat-int8": ("flat", {}, "int8"),
    "flat-onnx-int8": ("flat", {}, "onnx-int8"),
    "plaid-onnx-int8": ("plaid", {}, "onnx-int8"),
}


# -- shared set-up (children) ----------------------------------------------------------------------------------

def _setup_threads(threads: int) -> None:
    import faiss
    import torch

    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)


def _dataset(cfg: dict[str, Any]) -> Any:
    from hil.data.beir import load_beir

    dataset = load_beir(cfg["dataset"], split=cfg["split"])
    if cfg.get("docs") or cfg.get("queries"):
        dataset = dataset.subset(cfg.get("queries"), cfg.get("docs"), seed=cfg["seed"])
    return dataset


def _encoder(cfg: dict[str, Any], source: str | None = None) -> Any:
    import torch

    from hil.modeling.loading import load_encoder

    torch.manual_seed(cfg["seed"])  # the untrained head is a seeded random projection
    return load_encoder(source or cfg["model"], **({} if source else {"doc_maxlen": cfg["doc_maxlen"]}))


def _document_encoder(encoder: Any, mode: str, calibration: list[str]) -> Any:
    from hil.retrieval.fast_encode import document_encoder

    return document_encoder(encoder, None if mode == "fp32" else mode, calibration_texts=calibration)


def _base_folder(cfg: dict[str, Any], dataset: Any, encoder: Any, encoding: str = "fp32") -> Path:
    from hil.retrieval.index import encoder_fingerprint

    folder = Path(cfg["work"]) / f"{dataset.name}-{dataset.fingerprint()[:8]}-{encoder_fingerprint(encoder)[:12]}"
    return folder.with_name(folder.name + ("" if encoding == "fp32" else f"-{encoding}"))


def _base_index(cfg: dict[str, Any], dataset: Any, encoder: Any, encoding: str = "fp32") -> tuple[Any, dict]:
    """The fp16 base index of this corpus and encoder under the work folder (built once, then reused), and the
    record of how long its encoding took and how much memory it needed (kept beside it)."""
    from hil.retrieval.builder import open_or_build_index

    folder = _base_folder(cfg, dataset, encoder, encoding)
    record_path = folder.with_name(folder.name + ".build.json")
    fresh = not (folder / "index.json").is_file()
    tick = time.perf_counter()
    options = {} if encoding == "fp32" else {"quantize": encoding, "calibration_docs": cfg["calibration_docs"]}
    index = open_or_build_index(encoder, dataset.doc_ids(), dataset.documents(), folder,
                                corpus_fingerprint=dataset.fingerprint(), batch_size=cfg["batch_size"],
                                chunk_docs=cfg["chunk_docs"], progress=False, **options)
    if fresh or not record_path.is_file():
        from measure import peak_rss_mb

        record = {"encode_and_write_s": time.perf_counter() - tick, "peak_rss_mb": peak_rss_mb(),
                  "chunk_docs": cfg["chunk_docs"], "batch_size": cfg["batch_size"], "measured_now": fresh,
                  "threads": cfg["threads"]}
        record_path.write_text(json.dumps(record))
    return index, json.loads(record_path.read_text())


def _variant_index(cfg: dict[str, Any], base: Any, name: str) -> tuple[Any, float]:
    """A copy of ``base`` (vectors hard-linked, not copied) with the variant's search structures; build seconds."""
    from hil.retrieval.builder import rebuild_faiss
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
    index = rebuild_faiss(TokenIndex.load(target), kind, {**params, **cfg.get("plaid_params", {})}
                          if kind == "plaid" else params, progress=False)
    seconds = time.perf_counter() - tick
    from hil.provenance import write_json_atomic

    write_json_atomic(target / "index.json", {**index.meta, "bench_build_s": seconds})
    return TokenIndex.load(target), seconds


def _ndcg(dataset: Any, run: dict[str, dict[str, float]]) -> tuple[float, dict[str, float]]:
    """Mean nDCG@10 of ``run`` and each query's value (``hil.evaluation``'s scoring of a run)."""
    from hil.evaluation.evaluate import score_run

    evaluation = score_run("bench", dataset, run, metrics=("ndcg@10",))
    return float(evaluation.aggregate["ndcg@10"]), {q: float(v["ndcg@10"]) for q, v in evaluation.per_query.items()}


def _vs_exact(result: dict[str, Any]) -> str:
    diff = result.get("ndcg10_vs_exact")
    if not diff:
        return ""
    low, high = diff["ci95"]
    return f" ({diff['mean_diff']:+.4f} vs exact, 95% CI [{low:+.4f}, {high:+.4f}])"


def _paired_difference(exact_ndcg_path: Path, per_query: dict[str, float]) -> dict[str, Any] | None:
    """Mean per-query nDCG@10 difference to exact search, with a paired bootstrap 95% interval and p-value
    (None before the exact run is saved): whether a variant's change is larger than the queries' noise."""
    from hil.evaluation.statistics import paired_bootstrap_test

    if not exact_ndcg_path.is_file():
        return None
    exact = json.loads(exact_ndcg_path.read_text())
    test = paired_bootstrap_test(per_query, exact, n_samples=10000, seed=0)
    changed = sum(abs(per_query[q] - exact[q]) > 1e-9 for q in exact)
    return {"mean_diff": test.mean_diff, "ci95": list(test.ci), "p_value": test.p_value, "queries": test.n,
            "queries_changed": int(changed)}


def _overlap(exact_path: Path, run: dict[str, dict[str, float]]) -> float | None:
    """Mean share of the exact top 10 that ``run``'s top 10 also holds (None before the exact run is saved)."""
    if not exact_path.is_file():
        return None
    exact = json.loads(exact_path.read_text())
    shares = [len(set(list(run.get(q, {}))[:10]) & set(top)) / max(1, len(top)) for q, top in exact.items()]
    return float(np.mean(shares)) if shares else None


def _judged_queries(dataset: Any, limit: int | None) -> dict[str, str]:
    qids = [q for q in dataset.queries if q in dataset.qrels]
    return {q: dataset.queries[q] for q in (qids[:limit] if limit else qids)}


def _latencies(encoder: Any, index: Any, queries: dict[str, str], k: int, **options: Any
               ) -> tuple[dict[str, dict[str, float]], list[float], dict[str, Any]]:
    """Full ranking one query at a time (query encoding included): the run and each query's milliseconds."""
    from hil.retrieval.search import full_rank

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


# -- sections (each runs in its own child process) -------------------------------------------------------------

def section_peak(cfg: dict[str, Any]) -> dict[str, Any]:
    from measure import matmul_peak_gflops

    return {"matmul_fp32_gflops": matmul_peak_gflops(cfg["peak_size"], repeats=cfg["peak_repeats"])}


def section_encode(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    from hil.retrieval.encoding import document_token_lengths, encode_document_tokens, eval_mode
    from measure import encoder_flops, linear_parameters, matmul_peak_gflops, peak_rss_mb

    dataset = _dataset(cfg)
    texts = dataset.documents()[: cfg["encode_docs"]]
    encoder = _encoder(cfg)
    peak = matmul_peak_gflops(cfg["peak_size"], repeats=cfg["peak_repeats"])
    lengths = document_token_lengths(encoder, texts)
    backbone_config = encoder.backbone.config
    flops = encoder_flops(lengths, linear_parameters(encoder.backbone) + linear_parameters(
        torch.nn.ModuleList([m for n, m in encoder.named_children() if n != "backbone"])),
        backbone_config.num_hidden_layers, backbone_config.hidden_size)
    calibration = dataset.documents()[: cfg["calibration_docs"]]
    variants, vectors = {}, {}
    encoders = {mode: _document_encoder(encoder, mode, calibration) for mode in cfg["encode_variants"]}
    for repeat in range(cfg["encode_repeats"]):
        for mode, model in encoders.items():  # interleaved: load changes hit every variant alike
            with eval_mode(model):
                encode_document_tokens(model, texts[:8], batch_size=cfg["batch_size"])  # warm-up
                tick = time.perf_counter()
                out = encode_document_tokens(model, texts, batch_size=cfg["batch_size"], dtype=np.float32)
                seconds = time.perf_counter() - tick
            best = variants.get(mode, {}).get("seconds")
            if best is None or seconds < best:
                variants[mode] = {"seconds": seconds, "docs_per_s": len(texts) / seconds,
                                  "tokens_per_s": float(lengths.sum()) / seconds,
                                  "gflops": flops / seconds / 1e9,
                                  "fraction_of_peak": flops / seconds / 1e9 / peak["best"]}
            vectors[mode] = out.embeddings[encoder.head_names[0]]
    for mode in variants:
        cosine = (vectors[mode] * vectors["fp32"]).sum(axis=1) if "fp32" in vectors else None
        if cosine is not None:
            variants[mode]["cosine_to_fp32_mean"] = float(cosine.mean())
            variants[mode]["cosine_to_fp32_min"] = float(cosine.min())
        if "fp32" in variants:
            variants[mode]["speedup_vs_fp32"] = variants["fp32"]["seconds"] / variants[mode]["seconds"]
    return {"docs": len(texts), "attended_tokens": int(lengths.sum()), "mean_doc_tokens": float(lengths.mean()),
            "flops": flops, "matmul_fp32_gflops": peak, "variants": variants, "peak_rss_mb": peak_rss_mb(),
            "settings": {"batch_size": cfg["batch_size"], "doc_maxlen": cfg["doc_maxlen"],
                         "repeats": cfg["encode_repeats"], "calibration_docs": cfg["calibration_docs"],
                         "attn_implementation": getattr(encoder.backbone.config, "_attn_implementation", None)}}


def section_index(cfg: dict[str, Any]) -> dict[str, Any]:
    from measure import peak_rss_mb

    name = cfg["variant"]
    dataset = _dataset(cfg)
    encoder = _encoder(cfg)
    encoding = INDEX_VARIANTS[name][2]
    base, record = _base_index(cfg, dataset, encoder, encoding)
    index, seconds = _variant_index(cfg, base, name)
    return {"variant": name, "faiss": index.faiss_settings.get("factory"), "params": index.faiss_settings["params"],
            "n_docs": index.n_docs, "n_tokens": index.n_tokens, "encode": record, "structure_build_s": seconds,
            "build_s": record["encode_and_write_s"] + seconds, "bytes_per_token": index.bytes_per_token(),
            "disk_bytes": index.disk_bytes(), "disk_bytes_per_token": index.disk_bytes() / max(1, index.n_tokens),
            "peak_rss_mb": peak_rss_mb(), "document_encoding": encoding}


def section_search(cfg: dict[str, Any]) -> dict[str, Any]:
    from hil.evaluation.evaluate import EvaluationSettings, evaluate
    from measure import peak_rss_mb, percentiles

    name = cfg["variant"]
    dataset = _dataset(cfg)
    encoder = _encoder(cfg, cfg.get("export"))
    base, _ = _base_index(cfg, dataset, encoder, INDEX_VARIANTS.get(name, (0, 0, "fp32"))[2])
    queries = _judged_queries(dataset, cfg.get("search_queries"))
    out: dict[str, Any] = {"variant": name, "queries": len(queries), "k": cfg["k"],
                           "model": cfg.get("export") or cfg["model"]}
    # Exact search over fp32-encoded documents is the reference every variant is compared with.
    exact_stem = _base_folder(cfg, dataset, encoder).name + f".exact-top10-{len(queries)}"
    exact_path = Path(cfg["work"]) / f"{exact_stem}.json"
    exact_ndcg_path = Path(cfg["work"]) / f"{exact_stem}.ndcg10.json"
    if name == "exact" or INDEX_VARIANTS.get(name, ("",))[0] == "flat":  # a flat index is searched exhaustively
        tick = time.perf_counter()
        judged = replace(dataset, queries=queries, qrels={q: dataset.qrels[q] for q in queries})
        result = evaluate(encoder, judged, EvaluationSettings(mode="exhaustive", k=cfg["k"], metrics=("ndcg@10",),
                                                              progress=False), store=base)
        ndcg10 = float(result.aggregate["ndcg@10"])
        per_query = {q: float(v["ndcg@10"]) for q, v in result.per_query.items()}
        out.update(ndcg10=ndcg10, ms_per_query_batched=1000 * (time.perf_counter() - tick)
                   / max(1, len(queries)), document_encoding=base.meta.get("document_encoding"))
        if name == "exact":
            exact_path.write_text(json.dumps({q: list(docs)[:10] for q, docs in result.run.items()}))
            exact_ndcg_path.write_text(json.dumps(per_query))
        else:
            out["overlap10_vs_exact"] = _overlap(exact_path, result.run)
            out["ndcg10_vs_exact"] = _paired_difference(exact_ndcg_path, per_query)
    elif name == "v1":  # ColBERT v1 full ranking: flat FAISS token search, ncandidates per query token
        limited = dict(list(queries.items())[: cfg["v1_queries"]])
        run, times, stats = _latencies(encoder, base, limited, cfg["k"], ncandidates=cfg["ncandidates"])
        out.update(percentiles(times), queries=len(limited), candidates_mean=stats.get("candidates_mean"),
                   ncandidates=cfg["ncandidates"])
    elif name == "bm25":
        from hil.evaluation.evaluate import evaluate_bm25

        out.update(ndcg10=float(evaluate_bm25(dataset).aggregate["ndcg@10"]), variant="bm25")
    else:
        index, _ = _variant_index(cfg, base, name)
        options = {k: v for k, v in cfg.get("search_options", {}).items() if v is not None}
        run, times, stats = _latencies(encoder, index, queries, cfg["k"], **options)
        ndcg10, per_query = _ndcg(dataset, run)
        out.update(percentiles(times), ndcg10=ndcg10, overlap10_vs_exact=_overlap(exact_path, run),
                   ndcg10_vs_exact=_paired_difference(exact_ndcg_path, per_query),
                   candidates_mean=stats.get("candidates_mean"),
                   plaid=stats.get("plaid"), bytes_per_token=index.bytes_per_token(),
                   encode_s=stats.get("encode_s"), ann_s=stats.get("ann_s"), score_s=stats.get("score_s"))
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def section_train(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    from hil.data.triples import read_triples
    from hil.paths import resolve_data_file
    from measure import peak_rss_mb

    arch, model = cfg["arch"], cfg["train_model"]
    triples = read_triples(resolve_data_file(cfg["triples"]), limit=cfg["train_batch"] * (cfg["train_steps"] + 1))
    torch.manual_seed(cfg["seed"])
    from hil.modeling.encoder import ColBERTEncoder
    from hil.modeling.hil import HILEncoder
    from hil.modeling.losses import HILLoss, PairwiseCE
    from hil.modeling.module import RetrieverModule

    if arch == "colbert":
        module = RetrieverModule(ColBERTEncoder(backbone=model, doc_maxlen=cfg["doc_maxlen"]), PairwiseCE())
    else:  # uniform IDF weights: no table is computed (the cost measured is the training step's)
        module = RetrieverModule(HILEncoder(backbone=model, doc_maxlen=cfg["doc_maxlen"]), HILLoss())
    module.train()
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-6)
    batches = [triples[i: i + cfg["train_batch"]] for i in range(0, len(triples), cfg["train_batch"])]
    times = []
    for step, chunk in enumerate(batches):
        batch = {"queries": [t.query for t in chunk], "positives": [t.positive for t in chunk],
                 "negatives": [t.negative for t in chunk]}
        tick = time.perf_counter()
        loss, _ = module.compute_loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step > 0:  # the first step pays for allocation and thread start-up
            times.append(time.perf_counter() - tick)
    seconds = float(np.sum(times))
    return {"arch": arch, "model": model, "batch": cfg["train_batch"], "steps_timed": len(times),
            "triples_per_s": cfg["train_batch"] * len(times) / seconds if seconds else None,
            "s_per_step": seconds / max(1, len(times)), "peak_rss_mb": peak_rss_mb()}


def _tiled_index(base: Any, factor: int, directory: Path) -> Any:
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


def section_growth(cfg: dict[str, Any]) -> dict[str, Any]:
    from hil.retrieval.builder import rebuild_faiss
    from hil.retrieval.index import TokenIndex
    from measure import peak_rss_mb, percentiles

    factor = cfg["factor"]
    dataset = _dataset(cfg)
    encoder = _encoder(cfg)
    base, record = _base_index(cfg, dataset, encoder)
    directory = base.directory.with_name(base.directory.name + f"--x{factor}")
    tick = time.perf_counter()
    tiled = _tiled_index(base, factor, directory)
    tile_s = time.perf_counter() - tick
    params = {**INDEX_VARIANTS[cfg["growth_variant"]][1], **cfg.get("plaid_params", {})}
    tick = time.perf_counter()
    index = rebuild_faiss(tiled, "plaid", params, progress=False)
    build_s = time.perf_counter() - tick
    index = TokenIndex.load(index.directory)
    queries = _judged_queries(dataset, cfg.get("growth_queries"))
    run, times, stats = _latencies(encoder, index, queries, cfg["k"])
    # The original documents keep their ids, so nDCG@10 is comparable (copies tie with originals and lose the
    # id tie-break only to ids sorting earlier; it measures the pruning, not a new corpus).
    return {"factor": factor, "n_docs": index.n_docs, "n_tokens": index.n_tokens, "tile_s": tile_s,
            "structure_build_s": build_s, "encode_s_estimated": record["encode_and_write_s"] * factor,
            "params": index.faiss_settings["params"], "bytes_per_token": index.bytes_per_token(),
            "disk_bytes": index.disk_bytes(), **percentiles(times), "candidates_mean": stats.get("candidates_mean"),
            "peak_rss_mb": peak_rss_mb()}


def section_peer(cfg: dict[str, Any]) -> dict[str, Any]:
    from hil.paths import resolve_model
    from hil.retrieval.encoding import encode_document_tokens, eval_mode

    dataset = _dataset(cfg)
    texts = dataset.documents()[: cfg["encode_docs"]]
    python = cfg.get("peer_python") or sys.executable
    model_dir = resolve_model(cfg["model"])
    encoder = _encoder(cfg)
    calibration = dataset.documents()[: cfg["calibration_docs"]]
    ours = {mode: _document_encoder(encoder, mode, calibration) for mode in cfg["encode_variants"]}
    with tempfile.TemporaryDirectory() as tmp:
        texts_path = Path(tmp) / "texts.json"
        texts_path.write_text(json.dumps(texts))
        rates: dict[str, float] = {}
        peer: dict[str, Any] | None = None
        error = None
        for _ in range(cfg["encode_repeats"]):  # ours and PyLate's alternate, so load changes hit both
            for mode, model in ours.items():
                with eval_mode(model):
                    encode_document_tokens(model, texts[:8], batch_size=cfg["batch_size"])
                    tick = time.perf_counter()
                    encode_document_tokens(model, texts, batch_size=cfg["batch_size"])
                    rates[mode] = max(rates.get(mode, 0.0), len(texts) / (time.perf_counter() - tick))
            command = [python, str(HERE / "peer_pylate.py"), "--model", model_dir, "--texts", str(texts_path),
                       "--doc-maxlen", str(cfg["doc_maxlen"]), "--batch-size", str(cfg["batch_size"]),
                       "--threads", str(cfg["threads"])]
            done = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or not lines:
                error = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                break
            found = json.loads(lines[-1])
            if peer is None or found["docs_per_s"] > peer["docs_per_s"]:
                peer = found
    out: dict[str, Any] = {"docs": len(texts), "ours_docs_per_s": rates, "peer_python": python}
    if peer is None:
        out["peer_error"] = f"PyLate did not run in {python}: {error}"
        return out
    out["pylate"] = peer
    out["ratio_vs_pylate"] = {mode: rate / peer["docs_per_s"] for mode, rate in rates.items()}
    return out


def section_memory(cfg: dict[str, Any]) -> dict[str, Any]:
    """Peak RSS of building an index with ``chunk_docs`` documents per chunk (the memory knob of build_index)."""
    from hil.retrieval.builder import build_index
    from measure import current_rss_mb, peak_rss_mb

    dataset = _dataset(cfg)
    ids, texts = dataset.doc_ids()[: cfg["memory_docs"]], dataset.documents()[: cfg["memory_docs"]]
    encoder = _encoder({**cfg, "model": cfg["memory_model"]})
    with tempfile.TemporaryDirectory(dir=cfg["work"]) as tmp:
        baseline = current_rss_mb()
        tick = time.perf_counter()
        index = build_index(encoder, ids, texts, Path(tmp) / "idx", chunk_docs=cfg["chunk"],
                            batch_size=cfg["batch_size"], progress=False)
        seconds = time.perf_counter() - tick
        vector_mb = index.n_tokens * index.bytes_per_token() / 2 ** 20
    peak = peak_rss_mb()
    return {"chunk_docs": cfg["chunk"], "docs": len(ids), "model": cfg["memory_model"], "build_s": seconds,
            "rss_after_model_load_mb": baseline, "peak_rss_mb": peak, "peak_above_model_mb": peak - baseline,
            "index_vectors_mb": vector_mb}


CHILDREN = {"memory": section_memory, "peak": section_peak, "encode": section_encode, "index": section_index, "search": section_search,
            "train": section_train, "growth": section_growth, "peer": section_peer}


# -- the parent: plan, run children, print, write -----------------------------------------------------------------

def run_child(section: str, cfg: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    tick = time.perf_counter()
    # OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep instead of spinning. On a machine shared with other
    # work, spinning threads steal each other's time slices: measured here, one tiny-model query took 520 ms with
    # 2 spinning threads, 48 ms with passive ones and 77 ms with one thread. On an idle machine it costs little.
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg["threads"]), MKL_NUM_THREADS=str(cfg["threads"]),
               TOKENIZERS_PARALLELISM="false", OMP_WAIT_POLICY=cfg["omp_wait_policy"])
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", section,
                               "--child-config", json.dumps(cfg)], capture_output=True, text=True, env=env,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        return {"error": f"exit {done.returncode}: " + " | ".join(tail)}
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    result["wall_s"] = time.perf_counter() - tick
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="hil speed / memory benchmark (see the module docstring)")
    parser.add_argument("--name", default=None, help="results name (default: <dataset>-<model>[-quick])")
    parser.add_argument("--output", default=None, help="JSON path (default bench/results/<name>.json)")
    parser.add_argument("--quick", action="store_true", help="a < 3 min run: few documents and queries")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--dataset", default="scifact")
    parser.add_argument("--split", default="test")
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--export", default=None, help="a trained export/ckpt: searched as well (its nDCG@10)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--doc-maxlen", type=int, default=180)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--chunk-docs", type=int, default=2048, help="documents encoded per chunk when indexing")
    parser.add_argument("--docs", type=int, default=None, help="corpus slice (judged docs + sampled others)")
    parser.add_argument("--queries", type=int, default=None, help="query slice for the corpus subset")
    parser.add_argument("--encode-docs", type=int, default=512, help="documents timed in encode / peer")
    parser.add_argument("--encode-repeats", type=int, default=2)
    parser.add_argument("--encode-variants", default="fp32,int8,onnx-int8")
    parser.add_argument("--calibration-docs", type=int, default=32, help="int8: documents to calibrate on")
    parser.add_argument("--index-variants", default="flat,plaid,plaid-r2",
                        help=f"comma-separated subset of {tuple(INDEX_VARIANTS)}")
    parser.add_argument("--plaid-params", type=json.loads, default={}, help="extra plaid build params (JSON)")
    parser.add_argument("--nprobe", type=int, default=None, help="plaid search: centroids per query token")
    parser.add_argument("--ndocs", type=int, default=None, help="plaid search: documents scored exactly per head")
    parser.add_argument("--stage2-docs", type=int, default=None, help="plaid search: documents into stage 3")
    parser.add_argument("--search-queries", type=int, default=None, help="queries timed (default: all judged)")
    parser.add_argument("--v1-queries", type=int, default=20, help="queries timed for ColBERT v1 flat search")
    parser.add_argument("--ncandidates", type=int, default=256, help="ColBERT v1: hits per query token")
    parser.add_argument("--k", type=int, default=100, help="documents returned per query")
    parser.add_argument("--train-models", default="sentence-transformers/all-MiniLM-L6-v2,bert-tiny-splade")
    parser.add_argument("--train-archs", default="colbert,hil")
    parser.add_argument("--train-batch", type=int, default=32)
    parser.add_argument("--train-steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--triples", default="msmarco/triples.train.small.head1000.tsv")
    parser.add_argument("--growth", default="1,4,16", help="corpus multiples (empty: skip)")
    parser.add_argument("--growth-queries", type=int, default=100)
    parser.add_argument("--growth-variant", default="plaid", choices=("plaid", "plaid-r2"))
    parser.add_argument("--memory-chunks", default="64,512,2048", help="chunk_docs values (memory section)")
    parser.add_argument("--memory-docs", type=int, default=2048, help="documents indexed per memory run")
    parser.add_argument("--memory-model", default="bert-tiny-splade", help="model of the memory section")
    parser.add_argument("--peer-python", default=None, help="a Python with PyLate (default: this one)")
    parser.add_argument("--omp-wait-policy", default="PASSIVE", choices=("PASSIVE", "ACTIVE"),
                        help="OMP_WAIT_POLICY of the children (PASSIVE suits a shared machine)")
    parser.add_argument("--peak-size", type=int, default=1024)
    parser.add_argument("--peak-repeats", type=int, default=10)
    parser.add_argument("--work", default=str(HERE / "work"), help="index folder (reused between runs)")
    parser.add_argument("--section-timeout", type=float, default=None, help="seconds per child (default none)")
    parser.add_argument("--table", default=None, metavar="JSON", help="only print the table of a results file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-config", default=None, help=argparse.SUPPRESS)
    return parser


def make_config(args: argparse.Namespace) -> dict[str, Any]:
    cfg = {k: v for k, v in vars(args).items() if k not in ("child", "child_config")}
    if args.quick:
        cfg.update(docs=cfg["docs"] or 256, queries=cfg["queries"] or 40, encode_docs=min(cfg["encode_docs"], 64),
                   encode_repeats=1, growth="", v1_queries=min(cfg["v1_queries"], 5), train_steps=1,
                   train_models="bert-tiny-splade", peak_repeats=4, memory_chunks="64,256", memory_docs=256,
                   sections=",".join(s for s in cfg["sections"].split(",") if s != "peer"))
    cfg["encode_variants"] = [v for v in cfg["encode_variants"].split(",") if v]
    cfg["index_variants"] = [v for v in cfg["index_variants"].split(",") if v]
    unknown = [v for v in cfg["index_variants"] if v not in INDEX_VARIANTS]
    if unknown:
        raise SystemExit(f"bench: unknown index variants {unknown}; known: {sorted(INDEX_VARIANTS)}")
    cfg["search_options"] = {"nprobe": args.nprobe, "max_candidates": args.ndocs, "stage2_docs": args.stage2_docs}
    cfg["name"] = args.name or f"{args.dataset}-{Path(args.model).name}" + ("-quick" if args.quick else "")
    return cfg


def plan(cfg: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, section, config) of every child to run, in order."""
    sections = [s for s in cfg["sections"].split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise SystemExit(f"bench: unknown sections {bad}; known: {SECTIONS}")
    jobs: list[tuple[str, str, dict[str, Any]]] = []
    for section in sections:
        if section == "index":
            jobs += [(f"index:{v}", "index", {**cfg, "variant": v}) for v in cfg["index_variants"]]
        elif section == "search":
            variants = ["bm25", "exact"] + [v for v in cfg["index_variants"] if v != "flat"] + \
                (["v1"] if cfg["v1_queries"] else [])
            jobs += [(f"search:{v}", "search", {**cfg, "variant": v}) for v in variants]
            if cfg.get("export"):
                jobs += [(f"search:export-{v}", "search", {**cfg, "variant": v})
                         for v in ("exact", cfg["index_variants"][-1])]
        elif section == "train":
            jobs += [(f"train:{a}:{Path(m).name}", "train", {**cfg, "arch": a, "train_model": m})
                     for m in cfg["train_models"].split(",") if m for a in cfg["train_archs"].split(",") if a]
        elif section == "memory":
            jobs += [(f"memory:chunk{c}", "memory", {**cfg, "chunk": int(c)})
                     for c in cfg["memory_chunks"].split(",") if c]
        elif section == "growth":
            jobs += [(f"growth:x{f}", "growth", {**cfg, "factor": int(f)}) for f in cfg["growth"].split(",") if f]
        else:
            jobs.append((section, section, cfg))
    return jobs


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) >= 0.01 or value == 0 else f"{value:.2e}"
    return str(value)


def table(results: dict[str, Any]) -> str:
    """The figures as aligned text rows: what, value, settings."""
    rows: list[tuple[str, str, str]] = []
    for label, r in results.items():
        if "error" in r:
            rows.append((label, "ERROR", r["error"][:160]))
            continue
        section = label.split(":")[0]
        if section == "peak":
            m = r["matmul_fp32_gflops"]
            rows.append(("fp32 matmul peak", f"{m['best']:.1f} GFLOP/s", f"median {m['median']:.1f}, {m['size']}^3"))
        elif section == "encode":
            for mode, v in r["variants"].items():
                rows.append((f"encode {mode}", f"{v['docs_per_s']:.1f} docs/s, {v['tokens_per_s']:.0f} tok/s",
                             f"{v['gflops']:.1f} GFLOP/s = {100 * v['fraction_of_peak']:.0f}% of peak; "
                             f"x{v.get('speedup_vs_fp32', 1):.2f} vs fp32; cos>={_fmt(v.get('cosine_to_fp32_min'), 3)}"
                             f" mean {_fmt(v.get('cosine_to_fp32_mean'), 4)}; {r['docs']} docs"))
        elif section == "index":
            rows.append((f"index {r['variant']}", f"{r['build_s']:.1f} s build",
                         f"structures {r['structure_build_s']:.1f} s, {r['bytes_per_token']} B/token vectors, "
                         f"{r['disk_bytes_per_token']:.1f} B/token on disk, peak RSS {r['peak_rss_mb']:.0f} MB "
                         f"(encoding peak {_fmt(r['encode'].get('peak_rss_mb'), 0)} MB), {r['n_tokens']} tokens"))
        elif section == "search":
            name = label.split(":", 1)[1]
            if "p50_ms" in r:
                rows.append((f"search {name}", f"p50 {r['p50_ms']:.1f} ms, p95 {r['p95_ms']:.1f} ms",
                             f"nDCG@10 {_fmt(r.get('ndcg10'), 4)}{_vs_exact(r)}, top-10 overlap with exact "
                             f"{_fmt(r.get('overlap10_vs_exact'), 3)}; {r['queries']} queries, "
                             f"{_fmt(r.get('candidates_mean'), 0)} docs scored exactly; peak RSS "
                             f"{r['peak_rss_mb']:.0f} MB"))
            else:
                rows.append((f"search {name}", f"nDCG@10 {r['ndcg10']:.4f}{_vs_exact(r)}",
                             f"exhaustive, {_fmt(r.get('ms_per_query_batched'))} ms/query batched; "
                             f"top-10 overlap with exact {_fmt(r.get('overlap10_vs_exact'), 3)}; "
                             f"{r.get('queries', '')} queries"))
        elif section == "train":
            rows.append((label.replace("train:", "train "), f"{_fmt(r['triples_per_s'], 2)} triples/s",
                         f"batch {r['batch']}, {r['s_per_step']:.1f} s/step over {r['steps_timed']} steps, "
                         f"peak RSS {r['peak_rss_mb']:.0f} MB"))
        elif section == "growth":
            rows.append((f"growth x{r['factor']}", f"p50 {r['p50_ms']:.1f} ms, p95 {r['p95_ms']:.1f} ms",
                         f"{r['n_docs']} docs, {r['n_tokens']} tokens; plaid build {r['structure_build_s']:.1f} s; "
                         f"{r['disk_bytes'] / 2 ** 20:.0f} MiB on disk; peak RSS {r['peak_rss_mb']:.0f} MB"))
        elif section == "memory":
            rows.append((f"memory chunk_docs={r['chunk_docs']}", f"peak RSS {r['peak_rss_mb']:.0f} MB",
                         f"{r['peak_above_model_mb']:.0f} MB above the loaded model; {r['docs']} docs "
                         f"({r['index_vectors_mb']:.0f} MB of vectors), {r['model']}, {r['build_s']:.0f} s"))
        elif section == "peer":
            if "pylate" in r:
                ratios = ", ".join(f"{m} x{v:.2f}" for m, v in r["ratio_vs_pylate"].items())
                rows.append(("peer PyLate", f"{r['pylate']['docs_per_s']:.1f} docs/s",
                             f"ours {', '.join(f'{m} {v:.1f}' for m, v in r['ours_docs_per_s'].items())} docs/s; "
                             f"ratio {ratios}; pylate {r['pylate']['pylate']} torch {r['pylate']['torch']}"))
            else:
                rows.append(("peer PyLate", "not run", r.get("peer_error", "")))
    width = max((len(a) for a, _, _ in rows), default=10)
    value_width = max((len(b) for _, b, _ in rows), default=10)
    return "\n".join(f"{a:<{width}}  {b:<{value_width}}  {c}" for a, b, c in rows)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.table:  # print the table of an earlier results file
        print(table(json.loads(Path(args.table).read_text())["results"]))
        return 0
    if args.child:
        cfg = json.loads(args.child_config)
        _setup_threads(cfg["threads"])
        import warnings

        warnings.filterwarnings("ignore")
        import logging

        logging.disable(logging.WARNING)
        result = CHILDREN[args.child](cfg)
        print(RESULT_PREFIX + json.dumps(result, default=float))
        return 0
    cfg = make_config(args)
    Path(cfg["work"]).mkdir(parents=True, exist_ok=True)
    from hil.provenance import provenance, write_json_atomic

    output = Path(args.output) if args.output else HERE / "results" / f"{cfg['name']}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    started = time.perf_counter()
    for label, section, job in plan(cfg):
        print(f"[bench] {label} ...", file=sys.stderr, flush=True)
        results[label] = run_child(section, job, args.section_timeout)
        results[label]["load_average_after"] = list(os.getloadavg())
        if "error" in results[label]:
            print(f"[bench] {label}: {results[label]['error']}", file=sys.stderr, flush=True)
        # Written after every section: an interrupted run keeps what it measured.
        record = provenance({k: v for k, v in cfg.items() if k != "search_options"},
                            command=" ".join([Path(sys.argv[0]).name, *argv]), search_options=cfg["search_options"],
                            machine={"cpu_count": os.cpu_count(), "platform": platform.platform(),
                                     "processor": platform.processor()},
                            results=results, total_s=time.perf_counter() - started)
        write_json_atomic(output, record)
    print(table(results))
    print(f"\nwrote {output} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
