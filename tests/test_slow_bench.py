"""`make test-slow`: the benchmark end to end in its quick form (about 1.5 minutes idle; every section a child)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_quick_runs_every_section(shared_dir, tmp_path):
    output = tmp_path / "quick.json"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    completed = subprocess.run([sys.executable, str(REPO / "bench" / "run.py"), "--quick", "--output", str(output),
                                "--work", str(tmp_path / "work")], capture_output=True, text=True, env=env,
                               timeout=1200)
    assert completed.returncode == 0, completed.stderr[-2000:]
    results = json.loads(output.read_text())["results"]
    errors = {name: row["error"] for name, row in results.items() if isinstance(row, dict) and "error" in row}
    assert not errors, errors
    for section in ("peak", "encode", "index:flat", "index:plaid", "index:plaid-r2", "search:exact",
                    "search:plaid", "search:plaid-r2", "train:colbert:bert-tiny-splade",
                    "train:hil:bert-tiny-splade"):
        assert section in results, section
    assert results["index:plaid-r2"]["bytes_per_token"] <= 64  # the compressed option's size target
    assert results["index:flat"]["bytes_per_token"] == 256  # fp16 x 128
    for variant in ("plaid", "plaid-r2"):
        row = results[f"search:{variant}"]
        assert 0.0 <= row["ndcg10"] <= 1.0 and 0.0 <= row["overlap10_vs_exact"] <= 1.0
        assert 0 < row["p50_ms"] <= row["p95_ms"]
        low, high = row["ndcg10_vs_exact"]["ci95"]  # the paired interval against exact search
        assert low <= row["ndcg10_vs_exact"]["mean_diff"] <= high
        assert abs(row["ndcg10"] - results["search:exact"]["ndcg10"] - row["ndcg10_vs_exact"]["mean_diff"]) < 1e-9
    encoded = results["encode"]["variants"]
    assert set(encoded) == {"fp32", "int8", "onnx-int8"}
    assert encoded["onnx-int8"]["cosine_to_fp32_mean"] > 0.99 and encoded["onnx-int8"]["docs_per_s"] > 0
    assert "search plaid" in completed.stdout  # the table is printed
