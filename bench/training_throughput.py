"""Training throughput of n-way batches (issue 22): queries/s and documents/s for N = 2, 8, 32 at equal memory, and
what GradCache costs.

    python bench/training_throughput.py                                   # CPU, the shared tiny BERT
    python bench/training_throughput.py --model all-MiniLM-L6-v2 --device cuda --documents 512 --steps 20
    python bench/training_throughput.py --sweeps peer --model all-MiniLM-L6-v2 --peer-python /tmp/pylate-venv/bin/python

Sweeps (``--sweeps``; nway and gradcache by default), each configuration in a fresh child process (so its peak
memory -- ``ru_maxrss`` on CPU,
``torch.cuda.max_memory_allocated`` on a GPU -- is its own):

- ``nway``: ``--documents`` documents a step (the memory a step needs grows with the documents encoded, so equal
  documents is equal memory), split as B = documents / N queries of N documents, for each N of ``--nway``
  (N = 2 is ColBERT v1's triples); the objective is ``--loss`` (``kl``: KLDistillation on random teacher scores;
  ``nway``: NWayCE).
- ``gradcache``: one large batch (``--large-queries`` x ``--large-nway``) computed whole, then with GradCache in
  chunks of each ``--chunks`` texts: seconds a step and peak memory (GradCache encodes every text twice, once
  without a graph; its point is the memory).
- ``peer`` (``--sweeps peer``): ColBERT with in-batch negatives (``InBatchCE``) against PyLate's ``Contrastive``
  (the same objective) in ``--peer-python`` (``bench/peer_train_pylate.py``), on the same triples at
  ``--peer-batch`` queries, the same lengths and threads, ``--peer-rounds`` times alternating; the best round of
  each and ``ratio_vs_pylate`` = our queries/s / PyLate's (above 1: ours faster).

Every step is forward + backward + AdamW step through ``RetrieverModule.compute_loss`` (what training runs), on
texts from the shared MS MARCO triples (real lengths). The first ``--warmup`` steps are not timed. Timings are only
comparable on one machine in one run: take them on an idle machine (``bench/README.md`` says which). Prints a table
and writes JSON to ``bench/results/training_throughput.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RESULT_PREFIX = "BENCH-RESULT "
TRIPLES = "msmarco/triples.train.small.head1000.tsv"


def batches(queries: int, nway: int, steps: int, seed: int) -> list[dict[str, Any]]:
    """``steps`` string batches of ``queries`` x ``nway`` (the data module's layout), texts drawn from the shared
    triples, random teacher scores."""
    import torch

    from hil.data.triples import read_triples
    from hil.paths import resolve_data_file

    triples = read_triples(resolve_data_file(TRIPLES))
    passages = list(dict.fromkeys(text for t in triples for text in (t.positive, t.negative)))
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        picks = torch.randint(len(triples), (queries,), generator=generator).tolist()
        docs = torch.randint(len(passages), (nway - 1, queries), generator=generator).tolist()  # column by column
        out.append({"queries": [triples[p].query for p in picks],
                    "documents": [[triples[p].positive, *(passages[column[i]] for column in docs)]
                                  for i, p in enumerate(picks)],
                    "teacher_scores": torch.randn(queries, nway, generator=generator)})
    return out


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration, in this (child) process."""
    import torch

    from hil.modeling.encoder import ColBERTEncoder
    from hil.modeling.hil import HILEncoder
    from hil.modeling.losses import InBatchCE, KLDistillation, NWayCE
    from hil.modeling.module import RetrieverModule

    torch.manual_seed(spec["seed"])
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    encoder_class = HILEncoder if spec["arch"] == "hil" else ColBERTEncoder
    encoder = encoder_class(backbone=spec["model"], query_maxlen=spec["query_maxlen"], doc_maxlen=spec["doc_maxlen"])
    if spec["loss"] == "kl":
        loss = KLDistillation(heads="each" if spec["arch"] == "hil" else "sum")
    else:
        loss = InBatchCE() if spec["loss"] == "inbatch" else NWayCE()
    module = RetrieverModule(encoder, loss, gradcache_chunk_size=spec["chunk"]).to(device)
    module.train()
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-6)
    data = batches(spec["queries"], spec["nway"], spec["warmup"] + spec["steps"], spec["seed"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step, batch in enumerate(data):
        batch = {**batch, "teacher_scores": batch["teacher_scores"].to(device)}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tick = time.perf_counter()
        loss_value, _ = module.compute_loss(batch)
        loss_value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= spec["warmup"]:
            times.append(time.perf_counter() - tick)
    seconds = sum(times)
    peak = (torch.cuda.max_memory_allocated(device) / 2 ** 20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)
    return {**spec, "s_per_step": seconds / len(times), "queries_per_s": spec["queries"] * len(times) / seconds,
            "documents_per_s": spec["queries"] * spec["nway"] * len(times) / seconds,
            "peak_memory_mb": peak, "memory_kind": "cuda_max_allocated" if device.type == "cuda" else "ru_maxrss"}


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"measurement {spec} failed:\n{done.stderr[-3000:]}")


PEER_SCRIPT = HERE / "peer_train_pylate.py"
PEER_PROTOCOL = 1


def call_peer(python: str, script: Path, arguments: list[str]) -> dict[str, Any]:
    """Run the peer script in ``python``; its JSON line (protocol checked)."""
    done = subprocess.run([python, str(script), *arguments], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"PyLate did not run in {python} (exit {done.returncode}): {tail[0][:300]}")
    found = json.loads(lines[-1])
    if found.get("protocol") != PEER_PROTOCOL:
        raise RuntimeError(f"peer protocol {found.get('protocol')!r}, expected {PEER_PROTOCOL}")
    return found


def peer_comparison(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    """The best round of each side (most queries/s, as the encoding peer keeps the best rate) and
    ``ratio_vs_pylate`` = our queries/s / PyLate's (above 1: ours faster)."""
    best_ours = max(ours, key=lambda row: row["queries_per_s"])
    best_theirs = max(theirs, key=lambda row: row["queries_per_s"])
    return {"ours": best_ours, "pylate": best_theirs,
            "ratio_vs_pylate": best_ours["queries_per_s"] / best_theirs["queries_per_s"], "rounds": len(ours)}


def peer_sweep(args: argparse.Namespace, base: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Ours (ColBERT, InBatchCE) and PyLate's Contrastive on the same batches, alternating ``--peer-rounds``
    times: the rows of the table and the comparison."""
    import tempfile

    from hil.paths import resolve_model

    spec = {**base, "arch": "colbert", "loss": "inbatch", "queries": args.peer_batch, "nway": 2, "chunk": None}
    steps = [{"queries": batch["queries"], "positives": [docs[0] for docs in batch["documents"]],
              "negatives": [docs[1] for docs in batch["documents"]]}  # PyLate's triples (bench/peer_train_pylate.py)
             for batch in batches(args.peer_batch, 2, args.warmup + args.steps, args.seed)]  # what measure() trains on
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "batches.json"
        path.write_text(json.dumps(steps))
        arguments = ["--model", resolve_model(args.model), "--batches", str(path), "--query-length",
                     str(args.query_maxlen), "--document-length", str(args.doc_maxlen), "--threads", str(args.threads),
                     "--warmup", str(args.warmup), "--seed", str(args.seed), "--device", base["device"]]
        for _ in range(args.peer_rounds):
            ours.append({"sweep": "peer", **run_child(spec)})
            theirs.append({"sweep": "peer-pylate", "chunk": None, **call_peer(args.peer_python, PEER_SCRIPT,
                                                                              arguments)})
    comparison = peer_comparison(ours, theirs)
    return [comparison["ours"], comparison["pylate"]], comparison


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="bert-tiny-splade")
    parser.add_argument("--arch", choices=("colbert", "hil"), default="colbert")
    parser.add_argument("--loss", choices=("kl", "nway", "inbatch"), default="kl")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument("--documents", type=int, default=64, help="documents a step in the n-way sweep")
    parser.add_argument("--nway", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--large-queries", type=int, default=16)
    parser.add_argument("--large-nway", type=int, default=8)
    parser.add_argument("--chunks", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--query-maxlen", type=int, default=32)
    parser.add_argument("--doc-maxlen", type=int, default=180)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=str(HERE / "results" / "training_throughput.json"))
    parser.add_argument("--sweeps", nargs="+", choices=("nway", "gradcache", "peer"), default=["nway", "gradcache"])
    parser.add_argument("--peer-python", default=sys.executable, help="a Python with PyLate (peer sweep)")
    parser.add_argument("--peer-batch", type=int, default=32, help="queries a step in the peer sweep (triples)")
    parser.add_argument("--peer-rounds", type=int, default=1, help="ours then PyLate's, this many times")
    args = parser.parse_args(argv)
    if args.one:
        print(RESULT_PREFIX + json.dumps(measure(json.loads(args.one))))
        return 0
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    base = {"model": args.model, "arch": args.arch, "loss": args.loss, "device": device, "seed": args.seed,
            "query_maxlen": args.query_maxlen, "doc_maxlen": args.doc_maxlen, "steps": args.steps,
            "warmup": args.warmup, "threads": args.threads}
    rows = []
    for n in args.nway if "nway" in args.sweeps else ():
        if args.documents % n:
            parser.error(f"--documents {args.documents} is not a multiple of N = {n}")
        rows.append({"sweep": "nway", **run_child({**base, "queries": args.documents // n, "nway": n, "chunk": None})})
    for chunk in (None, *args.chunks) if "gradcache" in args.sweeps else ():
        rows.append({"sweep": "gradcache", **run_child({**base, "queries": args.large_queries,
                                                        "nway": args.large_nway, "chunk": chunk})})
    comparison = None
    if "peer" in args.sweeps:
        found, comparison = peer_sweep(args, base)
        rows += found
    print(f"{'sweep':<10} {'B':>4} {'N':>4} {'chunk':>6} {'s/step':>8} {'queries/s':>10} {'docs/s':>9} {'peak MB':>9}")
    for row in rows:
        print(f"{row['sweep']:<10} {row['queries']:>4} {row['nway']:>4} {str(row['chunk']):>6} "
              f"{row['s_per_step']:>8.3f} {row['queries_per_s']:>10.1f} {row['documents_per_s']:>9.1f} "
              f"{row['peak_memory_mb']:>9.0f}")
    if comparison:
        print(f"peer: ours (InBatchCE) / PyLate (Contrastive) queries/s x{comparison['ratio_vs_pylate']:.2f} "
              f"(above 1: ours faster; best of {comparison['rounds']} round(s); pylate "
              f"{comparison['pylate']['pylate']}, torch {comparison['pylate']['torch']})")
    from hil.provenance import provenance, write_json_atomic

    write_json_atomic(args.output, provenance(vars(args) | {"device": device}, rows=rows, peer=comparison,
                                              machine=platform.platform()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
