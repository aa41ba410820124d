"""Where ONNX document encoding spends its time: ONNX Runtime's own per-node profile, grouped by operator.

    python bench/encode_profile.py --model all-MiniLM-L6-v2 --docs 512 --threads 2

Encodes ``--docs`` documents of ``--dataset`` through the ``--mode`` document encoder (``onnx-int8`` by default,
calibrated on the first ``--calibration-docs`` documents, as indexing does) with profiling switched on in the
session, then prints documents/s and each operator type's share of the node time (``*_kernel_time`` events of
ONNX Runtime's profile). Profiling adds a little overhead: read the shares, and time speed with ``bench/run.py``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def operator_shares(events: list[dict[str, Any]]) -> dict[str, float]:
    """Microseconds of kernel time per operator type, from ONNX Runtime's profile events."""
    totals: dict[str, float] = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and str(event.get("name", "")).endswith("_kernel_time"):
            totals[event["args"]["op_name"]] += float(event["dur"])
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def profiled_session_options(prefix: str) -> Any:
    """ONNX Runtime's ``SessionOptions`` class, patched so every session made while it is installed profiles."""
    import onnxruntime as ort

    base = ort.SessionOptions

    class Profiled(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = prefix

    return Profiled


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all-MiniLM-L6-v2", help="encoder (name or folder)")
    parser.add_argument("--dataset", default="scifact")
    parser.add_argument("--docs", type=int, default=512)
    parser.add_argument("--calibration-docs", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--doc-maxlen", type=int, default=180)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", default="onnx-int8", choices=("onnx", "onnx-int8"))
    parser.add_argument("--seed", type=int, default=12345)
    args = parser.parse_args(argv)

    import tempfile

    import numpy as np
    import onnxruntime as ort
    import torch

    from hil.data.beir import load_beir
    from hil.modeling.loading import load_encoder
    from hil.retrieval.encoding import encode_document_tokens, eval_mode
    from hil.retrieval.fast_encode import document_encoder

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # an untrained head is a seeded random projection
    documents = load_beir(args.dataset).documents()
    texts = documents[: args.docs]
    encoder = load_encoder(args.model, doc_maxlen=args.doc_maxlen)
    with tempfile.TemporaryDirectory(prefix="hil-ort-profile-") as folder:
        original = ort.SessionOptions
        ort.SessionOptions = profiled_session_options(str(Path(folder) / "profile"))
        try:
            view = document_encoder(encoder, args.mode, calibration_texts=documents[: args.calibration_docs])
        finally:
            ort.SessionOptions = original
        with eval_mode(view):
            encode_document_tokens(view, texts[:8], batch_size=args.batch_size)  # warm-up
            tick = time.perf_counter()
            encode_document_tokens(view, texts, batch_size=args.batch_size, dtype=np.float32)
            seconds = time.perf_counter() - tick
        path = view.encoder.backbone.session.end_profiling()
        shares = operator_shares(json.loads(Path(path).read_text()))
    total = sum(shares.values()) or 1.0
    print(f"{args.mode}, {len(texts)} documents: {len(texts) / seconds:.1f} documents/s ({seconds:.2f} s, "
          f"profiling on; node time {total / 1e6:.2f} s)")
    for name, micros in shares.items():
        if micros / total >= 0.001:
            print(f"  {name:<28} {micros / 1e6:7.2f} s  {100 * micros / total:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
