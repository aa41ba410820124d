"""Checkpoints across tools, with PyLate itself: PyLate loads a ``hil`` export, and ``hil`` loads a model PyLate
saved; in both directions the token embeddings must agree to 1e-5.

    python bench/interop.py --peer-python /tmp/pylate-venv/bin/python [--model DIR] [--out results/interop.json]

PyLate runs in its own Python (``--peer-python``, see bench/README.md), through ``bench/peer_formats.py``. Exit
status 1 when an embedding differs by more than ``--tolerance``; ``tests/test_slow_interop.py`` runs this.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
QUERIES = ["what is the capital of france?", "do vaccines cause autism", "isotropy of token embeddings"]
DOCUMENTS = ["Paris is the capital of France.", "Vaccines do not cause autism; many studies, e.g. (a), show it!",
             "short", "Late interaction scores each query token against its best document token, then sums."]


def peer(python: str, *args: str) -> None:
    subprocess.run([python, str(HERE / "peer_formats.py"), *args], check=True, stdout=subprocess.DEVNULL)


def largest_difference(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    if [tuple(t.shape) for t in ours] != [tuple(t.shape) for t in theirs]:
        return float("inf")  # a different number of tokens is a disagreement, whatever the values
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(ours, theirs))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-python", required=True, help="a Python where `import pylate` works")
    parser.add_argument("--model", default=os.path.join(os.environ.get("HIL_MODELS_DIR", "../shared/models"),
                                                        "bert-tiny-splade"), help="the backbone both start from")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)

    import hil
    from hil.modeling.encoder import ColBERTEncoder

    work = Path(tempfile.mkdtemp(prefix="hil-interop-"))
    texts = work / "texts.json"
    texts.write_text(json.dumps({"queries": QUERIES, "documents": DOCUMENTS}))
    figures = {}

    torch.manual_seed(0)  # hil -> PyLate: an export of a ColBERT (its random head is what must travel)
    ours = ColBERTEncoder(args.model, dim=24, query_maxlen=12, doc_maxlen=40).eval()
    hil.export_model(ours, work / "hil-export")
    peer(args.peer_python, "encode", "--model", str(work / "hil-export"), "--texts", str(texts),
         "--out", str(work / "pylate-of-hil.pt"))
    theirs = torch.load(work / "pylate-of-hil.pt")
    figures["pylate_loads_hil_export"] = {
        "documents": largest_difference(hil.encode_documents(ours, DOCUMENTS), theirs["documents"]),
        "queries": largest_difference(hil.encode_queries(ours, QUERIES), theirs["queries"])}

    # PyLate -> hil: a model PyLate built and saved itself (its own [Q]/[D] tokens, its own Dense layer).
    peer(args.peer_python, "save", "--base", args.model, "--out", str(work / "pylate-saved"), "--texts", str(texts),
         "--embeddings", str(work / "pylate-own.pt"))
    theirs = torch.load(work / "pylate-own.pt")
    loaded = hil.load_model(work / "pylate-saved", device="cpu")
    figures["hil_loads_pylate_model"] = {
        "documents": largest_difference(hil.encode_documents(loaded, DOCUMENTS), theirs["documents"]),
        "queries": largest_difference(hil.encode_queries(loaded, QUERIES), theirs["queries"])}

    worst = max(value for pair in figures.values() for value in pair.values())
    result = {"tolerance": args.tolerance, "largest_difference": worst, **figures}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
