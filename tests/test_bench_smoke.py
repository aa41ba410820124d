"""The benchmark's own arithmetic and plumbing (bench/run.py, bench/sections/, bench/measure.py), on tiny inputs; no
timings asserted."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
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


def config(bench, *argv: str):
    return bench.make_config(bench.build_parser().parse_args(list(argv)))


def test_quick_plan_covers_sections_without_peer_or_growth(bench):
    cfg = config(bench, "--quick", "--index-variants", "flat,plaid-r2")
    labels = [job.label for job in bench.plan(cfg)]
    assert labels[0] == "peak" and "encode" in labels
    assert {"index:flat", "index:plaid-r2", "search:exact", "search:bm25", "search:plaid-r2"} <= set(labels)
    assert not any(label.startswith(("growth", "peer")) for label in labels)
    assert cfg.common.docs == 256 and cfg.run.name.endswith("-quick") and cfg.encode.docs == 64
    assert cfg.train.models == ("bert-tiny-splade",) and cfg.memory.chunks == (64, 256)
    with pytest.raises(SystemExit, match="unknown"):
        config(bench, "--sections", "peak,nope")
    with pytest.raises(SystemExit, match="unknown index"):
        config(bench, "--index-variants", "bogus")


def test_plan_of_every_section(bench):
    cfg = config(bench, "--index-variants", "flat,plaid", "--train-models", "a,b/c", "--train-archs", "colbert",
                 "--growth", "1,4", "--memory-chunks", "8", "--export", "runs/x/export")
    labels = [job.label for job in bench.plan(cfg)]
    assert labels == ["peak", "encode", "index:flat", "index:plaid", "search:bm25", "search:exact", "search:plaid",
                      "search:v1", "search:export-exact", "search:export-plaid", "train:colbert:a",
                      "train:colbert:c", "growth:x1", "growth:x4", "peer", "memory:chunk8", "batched:plaid",
                      "batched:flat"]
    jobs = {job.label: job for job in bench.plan(cfg)}
    assert (jobs["train:colbert:c"].train_model, jobs["growth:x4"].factor, jobs["memory:chunk8"].chunk) == \
        ("b/c", 4, 8)
    assert [j.label for j in bench.plan(config(bench, "--growth", "", "--sections", "growth,peak"))] == ["peak"]


def test_options_are_typed_and_travel_to_the_child_unchanged(bench):
    from sections.config import config_from_dict
    from sections.options import Job, job_json

    cfg = config(bench, "--plaid-params", '{"nbits": 2}', "--nprobe", "4", "--memory-chunks", "64,512",
                 "--encode-variants", "fp32,onnx-int8", "--section-timeout", "30", "--threads", "3")
    assert cfg.index.plaid_params == {"nbits": 2} and cfg.search.nprobe == 4 and cfg.run.section_timeout == 30.0
    assert cfg.common.threads == 3 and cfg.common.k == 100 and cfg.growth.factors == (1, 4, 16)
    assert cfg.memory.chunks == (64, 512) and cfg.encode.variants == ("fp32", "onnx-int8")
    assert cfg.search.options() == {"nprobe": 4}  # the search-time settings given, in full_rank's names
    job = Job("growth:x4", "growth", factor=4)
    payload = json.loads(job_json(cfg, job))
    assert config_from_dict(payload["config"]) == cfg and Job(**payload["job"]) == job
    assert cfg.record()["search"]["nprobe"] == 4  # the results JSON records every option by section


def test_every_command_of_the_readme_parses(bench):
    """The flags bench/README.md shows in its commands are the parser's (and the Makefile's plain run)."""
    readme = (REPO / "bench" / "README.md").read_text()
    commands = [line.split("#")[0] for line in readme.splitlines() if line.startswith("python bench/run.py")]
    commands += re.findall(r"`(python bench/run\.py [^`]+)`", readme.replace("\n", " "))
    commands = [command for command in commands if "--help" not in command.split()]
    assert len(commands) >= 8
    for command in commands:
        cfg = config(bench, *shlex.split(command.replace("<export dir>", "export"))[2:])
        assert cfg.run.sections
    assert "bench/run.py" in (REPO / "Makefile").read_text()


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
                         "peak_rss_mb": 600.0, "ndcg10_vs_exact": {"mean_diff": -0.002, "ci95": [-0.01, 0.006],
                                                                   "p_value": 0.3, "queries": 300}},
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
                     "12.00 triples/s", "growth x4", "not run", "ERROR", "memory chunk_docs=64",
                     "-0.0020 vs exact, 95% CI [-0.0100, +0.0060], p 0.30)", "vs exact: paired bootstrap test"):
        assert expected in text, expected


def test_search_variants_against_exact_are_one_family(bench):
    from hil.evaluation.statistics import holm_adjusted

    from sections.search import adjust_vs_exact

    def compared(p: float) -> dict:
        return {"p50_ms": 1.0, "p95_ms": 2.0, "ndcg10": 0.5, "queries": 10, "peak_rss_mb": 1.0,
                "ndcg10_vs_exact": {"mean_diff": 0.01, "ci95": [0.0, 0.02], "p_value": p, "queries": 10}}

    results = {"search:exact": {"ndcg10": 0.5, "queries": 10}, "search:plaid": compared(0.01),
               "search:plaid-r2": compared(0.04), "search:v1": {"p50_ms": 1.0, "p95_ms": 2.0, "queries": 5,
                                                                 "peak_rss_mb": 1.0},
               "index:plaid": {"ndcg10_vs_exact": {"p_value": 0.001}}, "search:ivfpq": compared(0.02)}
    adjust_vs_exact(results, "holm")
    family = [results[label]["ndcg10_vs_exact"] for label in ("search:plaid", "search:plaid-r2", "search:ivfpq")]
    assert [row["p_value_adjusted"] for row in family] == pytest.approx(holm_adjusted([0.01, 0.04, 0.02]))
    assert "p_value_adjusted" not in results["index:plaid"]["ndcg10_vs_exact"]  # not a search row
    text = bench.table({k: v for k, v in results.items() if not k.startswith("index")})
    assert "p 0.01, holm 0.03)" in text and "Holm-Bonferroni" in text and "3 comparisons" in text
    adjust_vs_exact(results, "none")
    assert results["search:plaid"]["ndcg10_vs_exact"]["p_value_adjusted"] == 0.01
    assert "holm" not in bench.table({"search:plaid": results["search:plaid"]})


def test_tiled_index_repeats_documents_with_new_ids(bench, tiny_random_colbert, tmp_path):
    from hil.retrieval.builder import build_index
    from hil.retrieval.search import exact_rank

    ids, texts = ["a", "b", "c"], ["gene therapy", "brain tumor, mouse", "vaccine"]
    base = build_index(tiny_random_colbert, ids, texts, tmp_path / "base", progress=False)
    from sections.growth import tiled_index

    tiled = tiled_index(base, 3, tmp_path / "x3")
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
    from sections.options import Job

    cfg = config(bench, "--peak-size", "64", "--peak-repeats", "2", "--threads", "1")
    result = bench.run_child(Job("peak", "peak"), cfg, timeout=120)
    assert "error" not in result, result
    assert result["matmul_fp32_gflops"]["best"] > 0 and result["wall_s"] > 0


@pytest.mark.parametrize("policy", ["PASSIVE", "ACTIVE", "default"])
def test_children_get_the_threads_and_the_openmp_wait_policy(bench, policy):
    env = bench.child_env(config(bench, "--threads", "3", "--omp-wait-policy", policy),
                          {"OMP_WAIT_POLICY": "ACTIVE", "KEEP": "1"})
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3" and env["KEEP"] == "1"
    if policy == "default":  # unset, even when the parent had one: OpenMP's own spin-then-sleep
        assert "OMP_WAIT_POLICY" not in env
    else:
        assert env["OMP_WAIT_POLICY"] == policy


def test_encode_profile_groups_kernel_time_by_operator():
    profile = load("encode_profile")
    events = [
        {"cat": "Node", "name": "attn_0_kernel_time", "dur": 30, "args": {"op_name": "QAttention"}},
        {"cat": "Node", "name": "attn_1_kernel_time", "dur": 20, "args": {"op_name": "QAttention"}},
        {"cat": "Node", "name": "ln_0_kernel_time", "dur": 70, "args": {"op_name": "SkipLayerNormalization"}},
        {"cat": "Node", "name": "ln_0_fence_before", "dur": 999, "args": {"op_name": "SkipLayerNormalization"}},
        {"cat": "Session", "name": "model_run", "dur": 5000},
    ]
    assert list(profile.operator_shares(events).items()) == [("SkipLayerNormalization", 70.0), ("QAttention", 50.0)]
    options = profile.profiled_session_options("/tmp/x")()
    assert options.enable_profiling and options.profile_file_prefix == "/tmp/x"
