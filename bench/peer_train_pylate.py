"""Peer mode for training throughput: PyLate's ColBERT trained with its ``losses.Contrastive`` (in-batch negatives
over query, positive, negative triples) on given batches; prints one JSON line.

Run by ``bench/training_throughput.py --sweeps peer`` with the Python that has PyLate (``--peer-python``), so
PyLate's own pins (its torch) never touch the project's environment. Self-contained: imports nothing from ``hil``.
Each step is what ours times (``RetrieverModule.compute_loss`` with ``InBatchCE``): tokenizing the step's texts,
the forward pass of queries, positives and negatives, the loss, backward and an AdamW step; the first ``--warmup``
steps are not timed. Texts are tokenized as PyLate's trainer does (``utils.ColBERTCollator``: ``pad=True``, every
document padded to ``--document-length``, which its ``Contrastive`` needs to stack positives and negatives), where
ours pads to the longest text of the batch: the same maximum lengths, each tool's own padding.

    python bench/peer_train_pylate.py --model DIR --batches FILE.json --query-length 32 --document-length 180 \
        --dim 128 --threads 2 --warmup 1

``FILE.json``: a list of steps, each ``{"queries": [...], "positives": [...], "negatives": [...]}`` (one negative
per query). The printed line (protocol 1) has ``s_per_step``, ``queries_per_s``, ``documents_per_s`` (queries x 2),
``step_s`` (each timed step), ``peak_memory_mb`` (``ru_maxrss``) and the versions.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

PROTOCOL = 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="backbone directory or hub name")
    parser.add_argument("--batches", required=True, help="JSON list of steps (queries, positives, negatives)")
    parser.add_argument("--query-length", type=int, default=32)
    parser.add_argument("--document-length", type=int, default=180)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (ours runs on the same)")
    args = parser.parse_args(argv)

    import torch

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    import pylate
    from pylate import losses, models

    with open(args.batches, encoding="utf-8") as handle:
        steps = json.load(handle)
    if len(steps) <= args.warmup:
        raise SystemExit(f"{args.batches}: {len(steps)} steps, none left to time after {args.warmup} warm-up")
    model = models.ColBERT(model_name_or_path=args.model, embedding_size=args.dim, query_length=args.query_length,
                           document_length=args.document_length, device=args.device)
    loss_function = losses.Contrastive(model=model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step, batch in enumerate(steps):
        if cuda:
            torch.cuda.synchronize()
        tick = time.perf_counter()
        # As PyLate's trainer tokenizes (utils.ColBERTCollator: pad=True, so documents are padded to
        # --document-length; Contrastive stacks positives and negatives, which needs one length).
        features = [model.tokenize(batch["queries"], is_query=True, pad=True),
                    model.tokenize(batch["positives"], is_query=False, pad=True),
                    model.tokenize(batch["negatives"], is_query=False, pad=True)]
        features = [{key: value.to(args.device) for key, value in part.items()} for part in features]
        loss = loss_function(features)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - tick)
    queries = len(steps[0]["queries"])
    seconds = sum(times)
    print(json.dumps({"protocol": PROTOCOL, "s_per_step": seconds / len(times), "step_s": times,
                      "steps_timed": len(times), "queries": queries, "nway": 2,
                      "queries_per_s": queries * len(times) / seconds,
                      "documents_per_s": 2 * queries * len(times) / seconds, "loss": "pylate.losses.Contrastive",
                      "last_loss": float(loss.detach()), "pylate": getattr(pylate, "__version__", "?"),
                      "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "peak_memory_mb": torch.cuda.max_memory_allocated() / 2 ** 20 if cuda
                      else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
                      "memory_kind": "cuda_max_allocated" if cuda else "ru_maxrss", "device": args.device}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
