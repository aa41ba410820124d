"""Peer mode for the checkpoint round trip: PyLate encodes with a model folder, or saves one; run by
``bench/interop.py`` with the Python that has PyLate (``--peer-python``). Self-contained: imports nothing of ``hil``.

    python bench/peer_formats.py encode --model DIR --texts FILE.json --out FILE.pt
    python bench/peer_formats.py save --base BACKBONE --dim 24 --query-length 12 --document-length 40 --out DIR \
        --texts FILE.json --embeddings FILE.pt
"""

from __future__ import annotations

import argparse
import json
import sys


def encode(model, texts: dict) -> dict:
    import torch

    queries = model.encode(texts["queries"], is_query=True, batch_size=8, show_progress_bar=False)
    documents = model.encode(texts["documents"], is_query=False, batch_size=8, show_progress_bar=False)
    return {"queries": [torch.as_tensor(q) for q in queries], "documents": [torch.as_tensor(d) for d in documents]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("encode", "save"))
    parser.add_argument("--model", help="model folder PyLate loads (encode)")
    parser.add_argument("--base", help="backbone folder a new PyLate ColBERT is built on (save)")
    parser.add_argument("--dim", type=int, default=24)
    parser.add_argument("--query-length", type=int, default=12)
    parser.add_argument("--document-length", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--texts", required=True, help='JSON {"queries": [...], "documents": [...]}')
    parser.add_argument("--out", required=True, help="embeddings file (encode) or the saved model folder (save)")
    parser.add_argument("--embeddings", help="where save writes PyLate's own embeddings of --texts")
    args = parser.parse_args(argv)

    import torch
    from pylate import models

    torch.manual_seed(args.seed)
    with open(args.texts, encoding="utf-8") as handle:
        texts = json.load(handle)
    if args.action == "encode":
        model = models.ColBERT(model_name_or_path=args.model, device="cpu")
        torch.save(encode(model, texts), args.out)
    else:
        model = models.ColBERT(model_name_or_path=args.base, embedding_size=args.dim, query_length=args.query_length,
                               document_length=args.document_length, device="cpu")
        model.save(args.out)
        torch.save(encode(model, texts), args.embeddings)
    print(json.dumps({"action": args.action, "torch": torch.__version__,
                      "pylate": __import__("pylate").__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
