"""The benchmark's own arithmetic and plumbing (bench/run.py, bench/measure.py), on tiny inputs; no timings asserted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def load(name: str):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(REPO / "bench"))


@pytest.fixture(scope="module")
def bench():
    return load("run")


@pytest.fixture(scope="module")
def measure():
    return load("measure")


def test_encoder_flops_matches_hand_count(measure):
    # two documents of 3 and 5 tokens, 10 linear weights, 2 layers, hidden 4
    flops = measure.encoder_flops(np.array([3, 5]), linear_params=10, n_layers=2, hidden=4)
    assert flops == (2 * 10 * 3 + 4 * 2 * 4 * 9) + (2 * 10 * 5 + 4 * 2 * 4 * 25)


def test_linear_parameters_count_float_and_quantized(measure):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    assert measure.linear_parameters(model) == 12 + 6
    quantized = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    assert measure.linear_parameters(quantized) == 12 + 6


def test_percentiles_and_peak(measure):
    stats = measure.percentiles(list(range(1, 101)))
    assert stats["p50_ms"] == pytest.approx(50.5) and stats["p95_ms"] == pytest.approx(95.05)
    assert stats["n"] == 100
    assert np.isnan(measure.percentiles([])["p50_ms"])
    peak = measure.matmul_peak_gflops(64, repeats=2)
    assert peak["best"] >= peak["median"] > 0
    assert measure.peak_rss_mb() > 10


def test_quick_plan_covers_sections_without_peer_or_growth(bench):
    cfg = bench.make_config(bench.build_parser().parse_args(["--quick", "--index-variants", "flat,plaid-r2"]))
    labels = [label for label, _, _ in bench.plan(cfg)]
    assert labels[0] == "peak" and "encode" in labels
    assert {"index:flat", "index:plaid-r2", "search:exact", "search:bm25", "search:plaid-r2"} <= set(labels)
    assert not any(label.startswith(("growth", "peer")) for label in labels)
    assert cfg["docs"] == 256 and cfg["name"].endswith("-quick")
    with pytest.raises(SystemExit, match="unknown"):
        bench.plan({**cfg, "sections": "peak,nope"})
    with pytest.raises(SystemExit, match="unknown index"):
        bench.make_config(bench.build_parser().parse_args(["--index-variants", "bogus"]))


def test_table_formats_every_section(bench):
    results = {
        "peak": {"matmul_fp32_gflops": {"best": 120.0, "median": 100.0, "size": 1024}},
        "encode": {"docs": 8, "variants": {"fp32": {"docs_per_s": 20.0, "tokens_per_s": 3000.0, "gflops": 80.0,
                                                      "fraction_of_peak": 0.66, "speedup_vs_fp32": 1.0,
                                                      "cosine_to_fp32_min": 1.0, "cosine_to_fp32_mean": 1.0}}},
        "index:flat": {"variant": "flat", "build_s": 10.0, "structure_build_s": 0.0, "bytes_per_token": 256,
                       "disk_bytes_per_token": 260.0, "peak_rss_mb": 500.0, "encode": {"peak_rss_mb": 400.0},
                       "n_tokens": 1000},
        "search:plaid": {"p50_ms": 20.0, "p95_ms": 40.0, "ndcg10": 0.68, "queries": 300, "candidates_mean": 256.0,
                         "peak_rss_mb": 600.0},
        "search:exact": {"ndcg10": 0.682, "ms_per_query_batched": 50.0, "queries": 300},
        "train:colbert:tiny": {"triples_per_s": 12.0, "batch": 32, "s_per_step": 2.6, "steps_timed": 3,
                               "peak_rss_mb": 900.0},
        "growth:x4": {"factor": 4, "p50_ms": 30.0, "p95_ms": 60.0, "n_docs": 40, "n_tokens": 4000,
                      "structure_build_s": 3.0, "disk_bytes": 2 ** 20, "peak_rss_mb": 700.0},
        "peer": {"peer_error": "PyLate did not run"},
        "memory:chunk64": {"chunk_docs": 64, "peak_rss_mb": 700.0, "peak_above_model_mb": 80.0, "docs": 256,
                           "index_vectors_mb": 10.0, "model": "tiny", "build_s": 5.0},
        "train:hil:tiny": {"error": "exit 1: boom"},
    }
    text = bench.table(results)
    for expected in ("120.0 GFLOP/s", "20.0 docs/s", "66% of peak", "10.0 s build", "p50 20.0 ms", "0.6800",
                     "12.00 triples/s", "growth x4", "not run", "ERROR", "memory chunk_docs=64"):
        assert expected in text, expected


def test_tiled_index_repeats_documents_with_new_ids(bench, tiny_random_colbert, tmp_path):
    from hil.retrieval.builder import build_index
    from hil.retrieval.search import exact_rank

    ids, texts = ["a", "b", "c"], ["gene therapy", "brain tumor, mouse", "vaccine"]
    base = build_index(tiny_random_colbert, ids, texts, tmp_path / "base", progress=False)
    tiled = bench._tiled_index(base, 3, tmp_path / "x3")
    assert tiled.n_docs == 9 and tiled.n_tokens == 3 * base.n_tokens
    assert tiled.doc_ids[:4] == ["a", "b", "c", "a#1"]
    for r in range(3):
        for i in range(3):
            np.testing.assert_array_equal(tiled.embeddings["colbert"][tiled.doc_offsets[3 * r + i]:
                                                                      tiled.doc_offsets[3 * r + i + 1]],
                                          base.embeddings["colbert"][base.doc_offsets[i]: base.doc_offsets[i + 1]])
    run = exact_rank(tiny_random_colbert, tiled, {"q": "gene"}, k=9, progress=False).run["q"]
    assert run["a"] == pytest.approx(run["a#1"]) == pytest.approx(run["a#2"])


def test_peak_section_runs_as_a_child(bench):
    cfg = bench.make_config(bench.build_parser().parse_args(["--peak-size", "64", "--peak-repeats", "2",
                                                             "--threads", "1"]))
    result = bench.run_child("peak", cfg, timeout=120)
    assert "error" not in result, result
    assert result["matmul_fp32_gflops"]["best"] > 0 and result["wall_s"] > 0
