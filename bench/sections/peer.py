"""peer: PyLate's ColBERT over the same backbone, lengths, batch size and threads encodes the same documents (in
``--peer-python``), alternating with ours; the ratio of documents/s against ours."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sections.common import document_encoder, load_dataset, load_model
from sections.options import BENCH, Job, option

if TYPE_CHECKING:
    from sections.config import BenchConfig


@dataclass(frozen=True)
class Config:
    """PyLate encoding the encode section's documents with its variants, in another Python."""

    python: str | None = option("--peer-python", None, "a Python with PyLate (default: this one)")


def jobs(config: BenchConfig) -> list[Job]:
    return [Job("peer", "peer")]


def run(config: BenchConfig, job: Job) -> dict[str, Any]:
    from hil.paths import resolve_model
    from hil.retrieval.encoding import encode_document_tokens, eval_mode

    common, encode = config.common, config.encode
    dataset = load_dataset(config)
    texts = dataset.documents()[: encode.docs]
    python = config.peer.python or sys.executable
    model_dir = resolve_model(common.model)
    encoder = load_model(config)
    calibration = dataset.documents()[: common.calibration_docs]
    ours = {mode: document_encoder(encoder, mode, calibration) for mode in encode.variants}
    with tempfile.TemporaryDirectory() as tmp:
        texts_path = Path(tmp) / "texts.json"
        texts_path.write_text(json.dumps(texts))
        rates: dict[str, float] = {}
        peer: dict[str, Any] | None = None
        error = None
        for _ in range(encode.repeats):  # ours and PyLate's alternate, so load changes hit both
            for mode, model in ours.items():
                with eval_mode(model):
                    encode_document_tokens(model, texts[:8], batch_size=common.batch_size)
                    tick = time.perf_counter()
                    encode_document_tokens(model, texts, batch_size=common.batch_size)
                    rates[mode] = max(rates.get(mode, 0.0), len(texts) / (time.perf_counter() - tick))
            command = [python, str(BENCH / "peer_pylate.py"), "--model", model_dir, "--texts", str(texts_path),
                       "--doc-maxlen", str(common.doc_maxlen), "--batch-size", str(common.batch_size),
                       "--threads", str(common.threads)]
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


def rows(label: str, result: dict[str, Any]) -> list[tuple[str, str, str]]:
    r = result
    if "pylate" not in r:
        return [("peer PyLate", "not run", r.get("peer_error", ""))]
    ratios = ", ".join(f"{m} x{v:.2f}" for m, v in r["ratio_vs_pylate"].items())
    return [("peer PyLate", f"{r['pylate']['docs_per_s']:.1f} docs/s",
             f"ours {', '.join(f'{m} {v:.1f}' for m, v in r['ours_docs_per_s'].items())} docs/s; "
             f"ratio {ratios}; pylate {r['pylate']['pylate']} torch {r['pylate']['torch']}")]
