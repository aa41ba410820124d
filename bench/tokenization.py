"""Corpus encoding that keeps a GPU busy (issue 24, item 3): the tokenization stage alone, and the memory of each
rank of a multi-process build, on a generated corpus.

    HIL_DATA_DIR=../shared/data HIL_MODELS_DIR=../shared/models python bench/tokenization.py
    python bench/tokenization.py --passages 1000000 --workers 0,1,2 --name tokenization-1m

Three measurements, JSON in ``bench/results/<name>.json`` (settings, versions, machine, load averages, figures):

1. **Tokenization stage**, passages/s: every chunk of the corpus turned into sorted, padded batches exactly as an
   index build does (:func:`hil.retrieval.token_loader.tokenized_chunks`), no model, for each ``--workers`` count
   (0: in this process; N: N DataLoader workers, the main process only receiving the batches). Beside them,
   ``before``: the build's tokenization before this change, in one process (each chunk tokenized to sort it by
   length, then each batch tokenized again from its texts). Best of ``--repeats``.
2. **What each rank receives** (``--receive``, cheap even at 1M passages): the real multi-process launch of
   :func:`hil.retrieval.corpus_encoding.encode_corpus`, with each rank's work replaced by a probe that reads its
   first chunk's texts and reports its own peak and current RSS (``VmHWM``, ``VmRSS`` of ``/proc/self/status``;
   not ``ru_maxrss``, which on Linux a spawned process inherits from its launcher's RSS at the fork), after
   (texts file) and before (texts list) this change: the cost of the corpus's texts to a rank, apart from
   encoding, whose chunk buffers dominate a rank's peak on a small corpus.
3. **Peak RSS per rank** of a ``--processes``-rank CPU build (``build_index(..., processes=N)``, the
   ``--model`` encoder, flat index) of the same corpus: each rank's ``VmHWM`` (Linux's per-process peak resident
   set), read from ``/proc`` every 0.2 s while the build runs, and the loader workers' apart. ``--compare-before``
   (default on) repeats the build with the corpus's texts sent to every rank, as before this change (the texts file
   replaced by the in-memory list), so the two can be read side by side. RSS counts shared pages in every process
   that touches them (the model's weights, torch's libraries), so the sum over ranks overstates the machine's use.

The corpus: ``--passages`` passages cycled from ``msmarco/dl19/corpus.jsonl`` (real MS MARCO passages, 383
characters on average) under ``HIL_DATA_DIR``, each made distinct by its number; generated words when that file is
absent. Timings on a machine shared with other jobs vary; the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SOURCE = Path("msmarco") / "dl19" / "corpus.jsonl"
WORDS = ("the of and a to in is for on that with as was by are this be from or at an it which can have more "
         "water cell year body cost average price blood day flea life cycle federal state county tax rate").split()


# -- the corpus ---------------------------------------------------------------------------------------------------

def base_passages(data_dir: str | None) -> list[str]:
    """Real MS MARCO passages when the data folder has them, else generated word salad of the same length."""
    source = Path(data_dir or os.environ.get("HIL_DATA_DIR", REPO.parent / "shared" / "data")) / SOURCE
    if source.is_file():
        with open(source, encoding="utf-8") as handle:
            records = [json.loads(line) for line in handle if line.strip()]
        return [f"{r.get('title') or ''} {r['text']}".strip() for r in records]
    import random

    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 90))) for _ in range(4096)]


def generated_corpus(n: int, data_dir: str | None) -> tuple[list[str], list[str]]:
    base = base_passages(data_dir)
    return [f"p{i}" for i in range(n)], [f"{base[i % len(base)]} ({i})" for i in range(n)]


# -- 1. the tokenization stage ------------------------------------------------------------------------------------

def tokenize_before(tokenizer: Any, texts: list[str], chunks: list[tuple[int, int, int]], batch_size: int) -> None:
    """The build's tokenization before tokenizing once: a chunk tokenized to sort it, then each batch again."""
    import numpy as np

    for _, start, end in chunks:
        chunk = texts[start:end]
        order = np.argsort(-tokenizer.encode_documents(chunk).attention_mask.sum(1).numpy(), kind="stable")
        for first in range(0, len(chunk), batch_size):
            tokenizer.encode_documents([chunk[i] for i in order[first: first + batch_size]])


def tokenization_rates(tokenizer: Any, texts: list[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """Passages/s of the tokenization stage for each worker count, and of the twice-tokenizing stage before."""
    from hil.retrieval.chunks import chunk_ranges
    from hil.retrieval.token_loader import tokenized_chunks

    chunks = chunk_ranges(len(texts), cfg["chunk_docs"])
    runs: dict[str, Callable[[], None]] = {"before": lambda: tokenize_before(tokenizer, texts, chunks,
                                                                             cfg["batch_size"])}
    for workers in cfg["workers"]:
        runs[f"workers={workers}"] = (lambda w=workers: sum(1 for _ in tokenized_chunks(
            tokenizer, texts, chunks, batch_size=cfg["batch_size"], workers=w)))
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(cfg["repeats"]):
        for name, run in runs.items():  # alternate, so a change of load shifts all alike
            tick, cpu_tick = time.perf_counter(), time.process_time()
            run()
            seconds[name].append(time.perf_counter() - tick)
            cpu[name].append(time.process_time() - cpu_tick)
            print(f"[bench] tokenization {name}: {seconds[name][-1]:.2f} s", file=sys.stderr, flush=True)
    best = {name: min(values) for name, values in seconds.items()}
    # What the stage leaves to the encoding process (receiving and unpacking, for workers > 0): CPU s in it.
    main_cpu = {name: min(values) for name, values in cpu.items()}
    return {"passages": len(texts), "seconds": seconds, "main_cpu_seconds": cpu,
            "passages_per_s": {name: len(texts) / s for name, s in best.items()},
            "passages_per_main_cpu_s": {name: len(texts) / max(c, 1e-9) for name, c in main_cpu.items()}}


# -- 2. peak RSS per rank -----------------------------------------------------------------------------------------

def _proc_status(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as handle:
            return dict(line.rstrip("\n").split(":\t", 1) for line in handle if ":\t" in line)
    except OSError:
        return {}


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux: every thread's children file)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class PeakWatcher:
    """Polls the peak RSS (``VmHWM``) of this process's spawned ranks and of their children (loader workers)."""

    def __init__(self, interval_s: float = 0.2):
        self.interval_s = interval_s
        self.ranks: dict[int, float] = {}
        self.workers: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            for child in _children(os.getpid()):
                if "spawn_main" not in _cmdline(child):  # the resource tracker, or anything else
                    continue
                self._record(self.ranks, child)
                for worker in _children(child):
                    self._record(self.workers, worker)
            self._stop.wait(self.interval_s)

    @staticmethod
    def _record(peaks: dict[int, float], pid: int) -> None:
        value = _proc_status(pid).get("VmHWM", "").split()
        if value:
            peaks[pid] = max(peaks.get(pid, 0.0), int(value[0]) / 1024.0)  # kB -> MiB

    def __enter__(self) -> "PeakWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class TextsInMemory(list):
    """Stands in for the texts file so that ranks receive the whole list, as before this change (``remove`` is what
    the build calls on the texts file when the ranks are done)."""

    def remove(self) -> None:  # type: ignore[override]
        pass


def _texts_sent_whole(texts: Any, folder: Any) -> TextsInMemory:
    return TextsInMemory(texts)


PROBE_DIR_ENV = "HIL_BENCH_RANK_PROBE_DIR"


def _rank_probe(fabric: Any, job: Any) -> dict[str, Any]:
    """Runs in each rank instead of encoding: read this rank's first chunk's texts, report this process's memory."""
    rank = fabric.global_rank
    size = min(job.chunk_docs, len(job.texts))
    start = rank * job.chunk_docs if rank * job.chunk_docs < len(job.texts) else 0
    n_read = len(job.texts[start: start + size])
    status = _proc_status(os.getpid())
    record = {"rank": rank, "texts_type": type(job.texts).__name__, "texts_read": n_read,
              "peak_rss_mb": int(status.get("VmHWM", "0 kB").split()[0]) / 1024.0,
              "rss_mb": int(status.get("VmRSS", "0 kB").split()[0]) / 1024.0}
    Path(os.environ[PROBE_DIR_ENV], f"rank{rank}.json").write_text(json.dumps(record))
    return {}


def receive_peaks(encoder: Any, texts: list[str], work: Path, cfg: dict[str, Any], before: bool) -> list[dict]:
    """Each rank's memory once it has received the job of a ``cfg['processes']``-rank encoding (see the module
    docstring), through the build's own launch code."""
    import hil.retrieval.corpus_encoding as corpus_encoding

    folder = work / ("receive-before" if before else "receive-after")
    (folder / "chunks").mkdir(parents=True)
    job = corpus_encoding.CorpusEncoding(encoder, texts, folder / "chunks", identity={},
                                         chunk_docs=cfg["chunk_docs"], batch_size=cfg["batch_size"], progress=False)
    originals = corpus_encoding.write_corpus_texts, corpus_encoding._encode_on_rank
    os.environ[PROBE_DIR_ENV] = str(folder)
    corpus_encoding._encode_on_rank = _rank_probe  # pickled by reference: the ranks find it in this script
    if before:
        corpus_encoding.write_corpus_texts = _texts_sent_whole
    try:
        corpus_encoding.encode_corpus(job, cfg["processes"])
    finally:
        corpus_encoding.write_corpus_texts, corpus_encoding._encode_on_rank = originals
        os.environ.pop(PROBE_DIR_ENV, None)
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(cfg["processes"])]


def build_peaks(encoder: Any, ids: list[str], texts: list[str], directory: Path, cfg: dict[str, Any],
                before: bool) -> dict[str, Any]:
    """Peak RSS (MiB) of each rank and loader worker of one ``cfg['processes']``-rank build, and its seconds."""
    import shutil

    import hil.retrieval.corpus_encoding as corpus_encoding
    from hil.retrieval.builder import build_index

    original = corpus_encoding.write_corpus_texts
    if before:
        corpus_encoding.write_corpus_texts = _texts_sent_whole
    try:
        with PeakWatcher() as watcher:
            tick = time.perf_counter()
            build_index(encoder, ids, texts, directory, batch_size=cfg["batch_size"], chunk_docs=cfg["chunk_docs"],
                        processes=cfg["processes"], tokenizer_workers=cfg["build_workers"], progress=False,
                        overwrite=True)
            seconds = time.perf_counter() - tick
    finally:
        corpus_encoding.write_corpus_texts = original
        shutil.rmtree(directory, ignore_errors=True)
    return {"seconds": seconds, "rank_peak_rss_mb": sorted(watcher.ranks.values()),
            "worker_peak_rss_mb": sorted(watcher.workers.values())}


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    import resource

    import torch

    from hil.modeling.loading import load_encoder

    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    encoder = load_encoder(cfg["model"], doc_maxlen=cfg["doc_maxlen"])
    ids, texts = generated_corpus(cfg["passages"], cfg["data_dir"])
    result: dict[str, Any] = {"text_bytes": sum(len(t.encode("utf-8")) for t in texts)}
    if cfg["workers"]:
        result["tokenization"] = tokenization_rates(encoder.tokenizer, texts, cfg)
    modes = {"after": False, **({"before": True} if cfg["compare_before"] else {})}
    if cfg["processes"] > 1 and cfg["receive"]:
        with tempfile.TemporaryDirectory(prefix="hil-tok-bench-") as work:
            result["receive"] = {name: receive_peaks(encoder, texts, Path(work), cfg, before)
                                 for name, before in modes.items()}
    if cfg["processes"] > 1 and cfg["build"]:
        with tempfile.TemporaryDirectory(prefix="hil-tok-bench-") as work:
            result["build"] = {name: build_peaks(encoder, ids, texts, Path(work) / "idx", cfg, before)
                               for name, before in modes.items()}
    result["main_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    result["load_average"] = list(os.getloadavg())
    return result


def table(result: dict[str, Any]) -> str:
    rows = [f"corpus: {result['text_bytes'] / 2**20:.1f} MiB of text"]
    tokenization = result.get("tokenization")
    if tokenization:
        rows.append(f"{'tokenization stage':<22}  {'passages/s':>10}  {'per CPU s of the encoding process':>34}")
        for name, rate in tokenization["passages_per_s"].items():
            rows.append(f"{name:<22}  {rate:>10,.0f}  {tokenization['passages_per_main_cpu_s'][name]:>34,.0f}")
    for name, ranks in result.get("receive", {}).items():
        rows.append(f"job received ({name}, texts as {ranks[0]['texts_type']}): peak RSS per rank "
                    + ", ".join(f"{r['peak_rss_mb']:,.0f}" for r in ranks) + " MiB; RSS then "
                    + ", ".join(f"{r['rss_mb']:,.0f}" for r in ranks) + " MiB")
    for name, build in result.get("build", {}).items():
        ranks = ", ".join(f"{mb:,.0f}" for mb in build["rank_peak_rss_mb"])
        workers = ", ".join(f"{mb:,.0f}" for mb in build["worker_peak_rss_mb"]) or "-"
        rows.append(f"build ({name}): {build['seconds']:.1f} s; peak RSS per rank {ranks} MiB; "
                    f"per loader worker {workers} MiB")
    rows.append(f"main process peak RSS {result['main_peak_rss_mb']:,.0f} MiB; load average "
                f"{', '.join(f'{x:.1f}' for x in result['load_average'])}")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="tokenization stage passages/s and peak RSS per rank")
    parser.add_argument("--name", default=None, help="results name (default: tokenization-<passages>)")
    parser.add_argument("--out", default=None, help="results file (default: bench/results/<name>.json)")
    parser.add_argument("--passages", type=int, default=20_000, help="generated corpus size (the issue's: 1000000)")
    parser.add_argument("--workers", default="0,1,2", help="tokenizer worker counts to time ('' skips the stage)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--processes", type=int, default=2, help="ranks of the build measured (1 skips it)")
    parser.add_argument("--build-workers", type=int, default=0, help="tokenizer_workers of that build, per rank")
    parser.add_argument("--receive", action=argparse.BooleanOptionalAction, default=True,
                        help="measure what each rank receives (a launch without encoding)")
    parser.add_argument("--build", action=argparse.BooleanOptionalAction, default=True,
                        help="measure each rank's peak RSS over a whole build")
    parser.add_argument("--compare-before", action=argparse.BooleanOptionalAction, default=True,
                        help="also build with the texts sent to every rank, as before")
    parser.add_argument("--model", default="bert-tiny-splade", help="encoder of the build (name or folder)")
    parser.add_argument("--data-dir", default=None, help="where msmarco/dl19/corpus.jsonl is (default HIL_DATA_DIR)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--chunk-docs", type=int, default=2048)
    parser.add_argument("--doc-maxlen", type=int, default=180)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--omp-wait-policy", default="PASSIVE", help="OMP_WAIT_POLICY (PASSIVE suits a shared machine)")
    return parser


def config(args: argparse.Namespace) -> dict[str, Any]:
    cfg = {k: v for k, v in vars(args).items() if k not in ("name", "out")}
    cfg["workers"] = [int(w) for w in args.workers.split(",") if w.strip()]
    return cfg


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy  # before torch is imported (run() imports it)
    cfg = config(args)
    name = args.name or f"tokenization-{args.passages}"
    from measure import write_results

    result = run(cfg)
    output = Path(args.out) if args.out else HERE / "results" / f"{name}.json"
    write_results(output, cfg, argv, result)
    print(table(result))
    print(f"\nwrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
