"""Devices and precision of evaluation (``--device``, ``--precision``, FAISS on a GPU), and official-BEIR judgments
of documents outside the corpus. CPU paths run everywhere; the GPU paths are skipped on a machine without one."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import pytrec_eval
import torch

from hil.cli.evaluate_script import main
from hil.data.beir import load_beir
from hil.evaluation.evaluate import EvaluationSettings, evaluate, evaluate_bm25
from hil.retrieval import devices
from hil.retrieval.devices import autocast, check_precision, faiss_gpu_for, resolve_device
from test_first_stage import N_QUERIES, cli, write_rerank_set

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


# -- device selection -------------------------------------------------------------------------------------------

def test_auto_is_the_gpu_when_torch_sees_one_else_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") and resolve_device(None) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)  # the current device, made explicit
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"has 2 CUDA GPU\(s\) \(cuda:0..cuda:1\)"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("spec, words", [("gpu", "not one of auto, cpu, cuda or cuda:N"),
                                         ("cuda:x", "not one of"), ("cpu:0", "not one of")])
def test_unknown_device_spellings_are_refused(spec, words):
    with pytest.raises(ValueError, match=words):
        resolve_device(spec)


def test_cuda_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(" CPU ") == torch.device("cpu")
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        resolve_device("cuda:0")


def test_precision_checks():
    check_precision("fp32", torch.device("cpu"))
    check_precision("bf16", torch.device("cpu"))
    with pytest.raises(ValueError, match="fp16' needs a GPU"):
        check_precision("fp16", torch.device("cpu"))
    with pytest.raises(ValueError, match="not one of fp32, fp16, bf16"):
        check_precision("int4", torch.device("cpu"))


def test_autocast_runs_matrix_products_in_the_asked_precision():
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with autocast(torch.device("cpu"), "fp32"):
        assert layer(x).dtype == torch.float32
    with autocast(torch.device("cpu"), "bf16"):
        assert layer(x).dtype == torch.bfloat16


def test_faiss_stays_on_the_cpu_without_faiss_gpu(monkeypatch, caplog):
    assert faiss_gpu_for(torch.device("cpu")) is None
    monkeypatch.setattr(devices, "faiss_gpu_count", lambda: 0)
    monkeypatch.setattr(devices, "_warned_faiss_cpu", [])
    with caplog.at_level(logging.WARNING, logger="hil.retrieval.devices"):
        assert faiss_gpu_for(torch.device("cuda", 0)) is None
        assert faiss_gpu_for(torch.device("cuda", 0)) is None
    assert sum("searched by FAISS on the CPU" in r.getMessage() for r in caplog.records) == 1  # said once
    monkeypatch.setattr(devices, "faiss_gpu_count", lambda: 2)
    assert faiss_gpu_for(torch.device("cuda", 1)) == 1  # the encoder's GPU, not always GPU 0
    assert faiss_gpu_for(torch.device("cuda", 2)) is None


# -- evaluation on a device -------------------------------------------------------------------------------------

@pytest.fixture
def small_set(tmp_path):
    folder, _ = write_rerank_set(tmp_path / "set")
    return load_beir(folder, judged_outside_corpus="keep")


def test_evaluate_records_device_and_precision_and_refuses_a_missing_gpu(tiny_random_colbert, small_set,
                                                                         monkeypatch):
    settings = EvaluationSettings(mode="exhaustive", index_root=None, progress=False, k=10, device="cpu")
    evaluation = evaluate(tiny_random_colbert, small_set, settings)
    assert evaluation.details["device"] == "cpu" and evaluation.details["precision"] == "fp32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        evaluate(tiny_random_colbert, small_set, EvaluationSettings(mode="exhaustive", index_root=None,
                                                                    device="cuda", progress=False))
    with pytest.raises(ValueError, match="precision must be one of"):
        EvaluationSettings(precision="half")
    with pytest.raises(ValueError, match="processes must be >= 1"):
        EvaluationSettings(processes=0)


def test_bf16_corpus_encoding_is_autocast_and_close_to_fp32(tiny_random_colbert, small_set):
    def store(precision: str) -> np.ndarray:
        settings = EvaluationSettings(mode="exhaustive", index_root=None, progress=False, k=10, device="cpu",
                                      precision=precision)
        evaluation = evaluate(tiny_random_colbert, small_set, settings)
        assert evaluation.details["precision"] == precision
        return np.asarray(evaluation.store.embeddings["colbert"], dtype=np.float32)

    full, half = store("fp32"), store("bf16")
    assert full.shape == half.shape and not np.array_equal(full, half)  # autocast was applied
    cosine = (full * half).sum(1) / np.linalg.norm(full, axis=1) / np.linalg.norm(half, axis=1)
    assert cosine.min() > 0.99


@pytest.mark.parametrize("args, words", [
    (("--device", "gpu"), "--device/--precision: device 'gpu' is not one of"),
    (("--device", "cpu", "--precision", "fp16"), "precision 'fp16' needs a GPU"),
    (("--processes", "0"), "--processes must be >= 1"),
])
def test_cli_device_errors_are_one_line(small_set, tmp_path, capsys, args, words):
    assert main(cli("--dataset", small_set.source, "--output", str(tmp_path / "o"), *args)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and words in err, err
    assert not (tmp_path / "o").exists()


def test_cli_cuda_without_a_gpu_is_one_line(small_set, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(cli("--dataset", small_set.source, "--device", "cuda", "--output", str(tmp_path / "o"))) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "torch sees no CUDA GPU" in err


# -- judgments of documents outside the corpus (official BEIR qrels have some) ----------------------------------

def test_outside_judgments_are_kept_and_count_in_the_ideal_dcg(small_set):
    assert small_set.judged_outside_corpus == 2 * N_QUERIES
    bm25 = evaluate_bm25(small_set, k=100)
    measured = pytrec_eval.RelevanceEvaluator(small_set.qrels, {"ndcg_cut.10"}).evaluate(bm25.run)
    assert any(d not in small_set.corpus for judged in small_set.qrels.values() for d in judged)
    expected = np.mean([m["ndcg_cut_10"] for m in measured.values()] +
                       [0.0] * (len(small_set.qrels) - len(measured)))
    assert bm25.aggregate["ndcg@10"] == pytest.approx(expected, abs=1e-12)
    inside = {q: {d: g for d, g in judged.items() if d in small_set.corpus} for q, judged in small_set.qrels.items()}
    dropped = pytrec_eval.RelevanceEvaluator(inside, {"ndcg_cut.10"}).evaluate(bm25.run)
    assert np.mean([m["ndcg_cut_10"] for m in dropped.values()]) > expected + 0.01  # the outside ones matter


def test_cli_evaluates_a_set_with_outside_judgments(small_set, tmp_path, caplog):
    out = tmp_path / "o"
    with caplog.at_level(logging.WARNING, logger="hil.data.beir"):
        assert main(cli("--dataset", small_set.source, "--mode", "exhaustive", "--k", "10", "--device", "cpu",
                        "--index-root", str(tmp_path / "indexes"), "--output", str(out))) == 0
    warnings = [r.getMessage() for r in caplog.records if "outside the corpus" in r.getMessage()]
    assert len(warnings) == 1 and "8 of 20 judgments" in warnings[0]
    record = json.loads((out / "metrics.json").read_text())
    assert record["dataset"]["judged_outside_corpus"] == 8
    assert record["results"]["colbert-exhaustive"]["device"] == "cpu"


# -- on a GPU (skipped here) ------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_gpu_evaluation_ranks_as_the_cpu_does(tiny_random_colbert, small_set, tmp_path, precision):
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    base = dict(mode="full", k=10, index_root=str(tmp_path / "idx"), progress=False)
    cpu = evaluate(tiny_random_colbert, small_set, EvaluationSettings(**base, device="cpu"))
    gpu = evaluate(tiny_random_colbert, small_set, EvaluationSettings(**base, device="cuda", precision=precision))
    assert next(tiny_random_colbert.parameters()).is_cuda and gpu.details["device"].startswith("cuda")
    tolerance = 1e-4 if precision == "fp32" else 0.05
    assert gpu.aggregate["ndcg@10"] == pytest.approx(cpu.aggregate["ndcg@10"], abs=tolerance)
    tiny_random_colbert.cpu()


@pytest.mark.gpu
@needs_gpu
def test_faiss_gpu_search_when_faiss_gpu_is_installed(tiny_random_colbert, small_set, tmp_path):
    if devices.faiss_gpu_count() == 0:
        pytest.skip("faiss-cpu installed")
    base = dict(mode="full", k=10, index_root=str(tmp_path / "idx"), progress=False, device="cuda")
    on_gpu = evaluate(tiny_random_colbert, small_set, EvaluationSettings(**base, faiss_gpu=True))
    on_cpu = evaluate(tiny_random_colbert, small_set, EvaluationSettings(**base, faiss_gpu=False))
    assert on_gpu.aggregate["ndcg@10"] == pytest.approx(on_cpu.aggregate["ndcg@10"], abs=1e-4)
    tiny_random_colbert.cpu()


@pytest.mark.gpu
@needs_two_gpus
def test_second_gpu(tiny_random_colbert, small_set):
    settings = EvaluationSettings(mode="exhaustive", index_root=None, progress=False, k=10, device="cuda:1")
    evaluation = evaluate(tiny_random_colbert, small_set, settings)
    assert evaluation.details["device"] == "cuda:1"
    tiny_random_colbert.cpu()


@pytest.mark.gpu
@needs_gpu
def test_plaid_structures_built_on_faiss_gpu(tiny_random_colbert, small_set, tmp_path):
    if devices.faiss_gpu_count() == 0:
        pytest.skip("faiss-cpu installed")
    params = {"n_centroids": 8, "nprobe": 8, "ndocs": 64, "stage2_docs": 64}
    base = dict(mode="full", k=10, progress=False, device="cuda", backend="plaid", backend_params=params)
    on_gpu = evaluate(tiny_random_colbert, small_set, EvaluationSettings(**base, index_root=str(tmp_path / "g"),
                                                                         faiss_gpu=True))
    on_cpu = evaluate(tiny_random_colbert, small_set, EvaluationSettings(**base, index_root=str(tmp_path / "c"),
                                                                         faiss_gpu=False))
    # every centroid probed and every document kept: both rank by exact scores, whatever the k-means found
    assert on_gpu.aggregate["ndcg@10"] == pytest.approx(on_cpu.aggregate["ndcg@10"], abs=1e-4)
    tiny_random_colbert.cpu()
