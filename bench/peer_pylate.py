"""Peer mode: encode documents with PyLate's ColBERT over the same backbone and lengths; print one JSON line.

Run by ``bench/run.py`` with the Python that has PyLate (``--peer-python``), e.g. a separate virtual environment,
so PyLate's own pins (it may bring another torch) never touch the project's environment. Self-contained: it
imports nothing from ``hil``.

    python bench/peer_pylate.py --model DIR --texts FILE.json --doc-maxlen 180 --batch-size 32 --threads 2
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="backbone directory or hub name")
    parser.add_argument("--texts", required=True, help="a JSON list of document texts")
    parser.add_argument("--doc-maxlen", type=int, default=180)
    parser.add_argument("--query-maxlen", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from pylate import models

    with open(args.texts, encoding="utf-8") as handle:
        texts = json.load(handle)
    model = models.ColBERT(model_name_or_path=args.model, document_length=args.doc_maxlen,
                           query_length=args.query_maxlen, embedding_size=args.dim, device="cpu")
    model.encode(texts[: min(8, len(texts))], is_query=False, batch_size=args.batch_size,
                 show_progress_bar=False)  # warm-up
    rates = []
    tokens = 0
    for _ in range(args.repeats):
        tick = time.perf_counter()
        out = model.encode(texts, is_query=False, batch_size=args.batch_size, show_progress_bar=False)
        seconds = time.perf_counter() - tick
        rates.append(len(texts) / seconds)
        tokens = int(sum(len(x) for x in out))
    import pylate

    print(json.dumps({"docs_per_s": max(rates), "docs_per_s_all": rates, "docs": len(texts), "stored_tokens": tokens,
                      "pylate": getattr(pylate, "__version__", "?"), "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "batch_size": args.batch_size,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
