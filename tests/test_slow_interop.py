"""PyLate itself loads a ``hil`` export, and ``hil`` loads a model PyLate saved: embeddings equal to 1e-5.

Runs ``bench/interop.py`` with the Python named by ``HIL_PEER_PYTHON`` (PyLate pins its own torch, so it usually
lives in its own virtual environment: bench/README.md), or this Python when it imports ``pylate``; skipped when
neither has PyLate.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[1]


def peer_python() -> str | None:
    named = os.environ.get("HIL_PEER_PYTHON")
    if named:
        return named
    return sys.executable if importlib.util.find_spec("pylate") is not None else None


@pytest.mark.skipif(peer_python() is None, reason="PyLate is not importable (set HIL_PEER_PYTHON)")
def test_pylate_and_hil_read_each_others_checkpoints(shared_dir, tmp_path):
    out = tmp_path / "interop.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "interop.py"), "--peer-python", peer_python(),
                             "--model", str(shared_dir / "models" / "bert-tiny-splade"), "--out", str(out)],
                            capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["largest_difference"] <= 1e-5
    assert set(figures) >= {"pylate_loads_hil_export", "hil_loads_pylate_model"}
