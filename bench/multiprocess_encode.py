"""Documents/s of building a token index on 1 and N processes (``build_index(..., processes=N)``), in one run.

    HIL_DATA_DIR=../shared/data HIL_MODELS_DIR=../shared/models python bench/multiprocess_encode.py
    python bench/multiprocess_encode.py --docs 2048 --processes 1,2 --repeats 2 --model bert-tiny-splade

Each build encodes the first ``--docs`` documents of the corpus from scratch (flat index, fp16 vectors) and is
timed whole: for N > 1 that includes starting N processes through Lightning Fabric (each imports torch,
transformers and Lightning), reported apart as ``launch_s`` (a launch of a function that does nothing, same
Fabric settings). The one-process build runs with ``--threads`` torch threads (default: every core); each of N
ranks gets ``cpu_count // N``. Process counts alternate within each repeat, so a machine whose load changes
during the run shifts them alike; the ratio to one process is reported beside the absolute figures, and whether
every index equals the one-process index byte for byte. As in ``bench/run.py``, OpenMP threads wait passively
(``--omp-wait-policy``, set before torch starts and inherited by the ranks). Results go to
``bench/results/<name>.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _do_nothing(fabric: Any) -> None:
    """What a Fabric launch runs to time the launch alone."""


def launch_seconds(processes: int, accelerator: str) -> float:
    """Wall seconds of a Fabric ``ddp_spawn`` launch of a function that does nothing (process start-up)."""
    from lightning_fabric import Fabric

    port = os.environ.get("MASTER_PORT")
    tick = time.perf_counter()
    Fabric(accelerator=accelerator, devices=processes, strategy="ddp_spawn").launch(_do_nothing)
    seconds = time.perf_counter() - tick
    if port is None:
        os.environ.pop("MASTER_PORT", None)  # let the next launch pick a free port again
    return seconds


def corpus(cfg: dict[str, Any]) -> tuple[list[str], list[str]]:
    from hil.data.beir import load_beir

    dataset = load_beir(cfg["dataset"], split="test")
    return dataset.doc_ids()[: cfg["docs"]], dataset.documents()[: cfg["docs"]]


def timed_build(encoder: Any, ids: list[str], texts: list[str], directory: Path, processes: int,
                cfg: dict[str, Any]) -> float:
    """Seconds of one build from scratch into ``directory`` (removed first)."""
    from hil.retrieval.builder import build_index
    from hil.retrieval.index import unfinished_build_dir

    for folder in (directory, unfinished_build_dir(directory)):
        shutil.rmtree(folder, ignore_errors=True)
    tick = time.perf_counter()
    build_index(encoder, ids, texts, directory, batch_size=cfg["batch_size"], chunk_docs=cfg["chunk_docs"],
                processes=processes, precision=cfg["precision"], progress=False)
    return time.perf_counter() - tick


def same_arrays(directory: Path, reference: Path) -> bool:
    """Every file but index.json byte for byte equal."""
    names = sorted(p.name for p in reference.iterdir() if p.name != "index.json")
    return all((directory / n).read_bytes() == (reference / n).read_bytes() for n in names)


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    from hil.modeling.loading import load_encoder

    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])  # the untrained ColBERT head is a seeded random projection
    encoder = load_encoder(cfg["model"], doc_maxlen=cfg["doc_maxlen"]).to(cfg["device"])
    ids, texts = corpus(cfg)
    seconds: dict[int, list[float]] = {n: [] for n in cfg["processes"]}
    identical: dict[int, bool] = {}
    with tempfile.TemporaryDirectory(prefix="hil-mp-bench-") as work:
        work_dir = Path(work)
        for _ in range(cfg["repeats"]):
            for n in cfg["processes"]:
                seconds[n].append(timed_build(encoder, ids, texts, work_dir / f"p{n}", n, cfg))
                print(f"[bench] {n} process(es): {seconds[n][-1]:.1f} s", file=sys.stderr, flush=True)
        reference = work_dir / f"p{min(cfg['processes'])}"
        identical = {n: same_arrays(work_dir / f"p{n}", reference) for n in cfg["processes"]}
    launches = {n: launch_seconds(n, torch.device(cfg["device"]).type) for n in cfg["processes"] if n > 1}
    best = {n: min(values) for n, values in seconds.items()}
    base = best[min(best)]
    return {"docs": len(ids), "seconds": seconds, "best_s": best,
            "docs_per_s": {n: len(ids) / s for n, s in best.items()},
            # What a corpus large enough to hide the start-up would see (the launch timed apart, subtracted).
            "docs_per_s_after_launch": {n: len(ids) / (s - launches.get(n, 0.0)) for n, s in best.items()},
            "ratio_vs_fewest_processes": {n: base / s for n, s in best.items()},
            "launch_s": launches, "identical_to_fewest_processes": identical, "load_average": list(os.getloadavg())}


def table(result: dict[str, Any]) -> str:
    header = (f"{'processes':>9}  {'best s':>7}  {'docs/s':>7}  {'ratio':>6}  {'launch s':>8}  "
              f"{'docs/s after launch':>19}  identical")
    rows = [header]
    for n, best in result["best_s"].items():
        launch = result["launch_s"].get(n)
        rows.append(f"{n:>9}  {best:>7.1f}  {result['docs_per_s'][n]:>7.1f}  "
                    f"x{result['ratio_vs_fewest_processes'][n]:>5.2f}  "
                    f"{'-' if launch is None else f'{launch:.1f}':>8}  "
                    f"{result['docs_per_s_after_launch'][n]:>19.1f}  {result['identical_to_fewest_processes'][n]}")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="documents/s of index building on 1 and N processes")
    parser.add_argument("--name", default=None, help="results name (default: multiprocess-<dataset>-<model>)")
    parser.add_argument("--dataset", default="scifact")
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--docs", type=int, default=1024)
    parser.add_argument("--processes", default="1,2", help="comma-separated process counts")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of one process")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--chunk-docs", type=int, default=128, help="small enough to give every process chunks")
    parser.add_argument("--doc-maxlen", type=int, default=180)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--omp-wait-policy", default="PASSIVE", help="OMP_WAIT_POLICY (PASSIVE suits a shared machine)")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy  # before torch is imported (run() imports it)
    cfg = {k: v for k, v in vars(args).items() if k != "name"}
    cfg["processes"] = sorted({int(n) for n in args.processes.split(",")})
    name = args.name or f"multiprocess-{args.dataset}-{Path(args.model).name}"
    from measure import write_results

    result = run(cfg)
    output = HERE / "results" / f"{name}.json"
    write_results(output, cfg, argv, result)
    print(table(result))
    print(f"\nwrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
