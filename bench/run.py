"""Speed and memory benchmark of ``hil``: encoding, indexing, search, training, growth, and PyLate as a peer.

One command prints a table and writes JSON (``bench/results/<name>.json`` or ``--output``)::

    HIL_DATA_DIR=../shared/data HIL_MODELS_DIR=../shared/models python bench/run.py --name scifact-minilm
    python bench/run.py --quick                       # < 3 min: 256 documents, 40 queries, no growth/peer
    python bench/run.py --sections encode,peer --encode-variants fp32,onnx-int8 \
        --peer-python /tmp/pylate-venv/bin/python
    python bench/run.py --sections search --index-variants flat-onnx-int8 --export runs/demo/export

Every section runs in a fresh child process, so each peak resident memory figure (``ru_maxrss``) belongs to that
section alone. Timings on a shared machine are noisy: variants that are compared are measured in the same child,
one after the other, and reported as ratios as well as absolute numbers. The settings of every figure go into
the JSON beside it, with package versions and the machine.

Sections (``--sections``, comma-separated; default all):
    peak    fp32 matrix-multiply GFLOP/s (best and median of repeats) with the benchmark's threads
    encode  documents/s and tokens/s of document encoding, GFLOP/s achieved and its fraction of the peak,
            for each ``--encode-variants`` (fp32; int8 = PyTorch SmoothQuant + dynamic int8 Linear layers;
            onnx / onnx-int8 = ONNX Runtime fp32 / int8; compile = torch.compile), and how far each variant's
            vectors are from fp32 (cosine)
    index   build seconds (encoding and search structures apart), bytes per token, disk bytes, peak RSS, for
            each ``--index-variants`` (flat, plaid, plaid-r2 = 2-bit residuals without fp16 vectors, ...)
    search  full-ranking latency p50/p95 per query (batch of one query, query encoding included) and nDCG@10
            per index variant, beside exact brute force (its nDCG@10 and time) and BM25's nDCG@10; each variant's
            per-query nDCG@10 difference to exact search over fp32 documents, with a paired bootstrap 95% interval
            and p-value, adjusted for the several variants compared (``--p-adjust``, Holm by default)
            (``flat-int8`` / ``flat-onnx-int8``: exact search over documents encoded that way)
    train   triples/s of ColBERT and ColBERT-HIL training steps at ``--train-batch`` (forward, backward, AdamW)
    memory  peak RSS of index building against ``chunk_docs`` (the memory knob), ``--memory-model``
    growth  the corpus tiled 1x/4x/16x (SciFact repeated with new ids; the encoded vectors are tiled, not
            re-encoded): plaid build seconds, bytes, peak RSS and search latency at each size
    peer    PyLate's ColBERT over the same backbone, lengths, batch size and threads encodes the same documents
            (in ``--peer-python``); ratio of documents/s against ours
    peer-search  (only when named) PyLate's PLAID (fast-plaid) and WARP (xtr-warp-rs) indexes on the same model,
            corpus and queries (in ``--peer-python``): p50/p95 per query and nDCG@10 beside ours, time ratios

Layout: this file plans the children, runs them and prints the table; each section is a module of
``bench/sections/`` (its options as a dataclass, its jobs, what a child measures, its table rows), and
``bench/sections/config.py`` assembles the options into one typed ``BenchConfig`` and the parser.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from sections.common import INDEX_VARIANTS, setup_threads  # noqa: E402  (after the path set-up above)
from sections.config import SECTION_MODULES, BenchConfig, build_parser, config_from_dict, make_config  # noqa: E402
from sections.options import SECTIONS, Job, job_json  # noqa: E402
from sections.search import adjust_vs_exact, legend  # noqa: E402

__all__ = ["INDEX_VARIANTS", "SECTIONS", "build_parser", "make_config", "plan", "run_child", "table", "main"]
RESULT_PREFIX = "BENCH-RESULT "


def plan(config: BenchConfig) -> list[Job]:
    """Every child to run, in order: each asked section's jobs."""
    return [job for section in config.run.sections for job in SECTION_MODULES[section].jobs(config)]


def child_env(config: BenchConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """A child's environment: ``environ`` with the threads and OpenMP wait policy of ``config``.

    OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep instead of spinning. On a machine shared with other work,
    spinning threads steal each other's time slices: measured here, one tiny-model query took 520 ms with 2 spinning
    threads, 48 ms with passive ones and 77 ms with one thread. ``default``: no OMP_WAIT_POLICY at all, OpenMP's own
    rule (spin a while, then sleep): on an idle machine the fastest for search, whose every torch step would
    otherwise wake sleeping threads (bench/README.md, search).
    """
    threads, policy = str(config.common.threads), config.common.omp_wait_policy
    env = dict(environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false",
               OMP_WAIT_POLICY=policy)
    if policy == "default":
        del env["OMP_WAIT_POLICY"]
    return env


def run_child(job: Job, config: BenchConfig, timeout: float | None) -> dict[str, Any]:
    """One section's job in a fresh process (so its peak RSS is its own); its result, or ``{"error": ...}``."""
    tick = time.perf_counter()
    env = child_env(config, os.environ)
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", job.section,
                               "--child-config", job_json(config, job)], capture_output=True, text=True, env=env,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        return {"error": f"exit {done.returncode}: " + " | ".join(tail)}
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    result["wall_s"] = time.perf_counter() - tick
    return result


def child(section: str, payload: str) -> int:
    """In the child process: run one job and print its result on a ``BENCH-RESULT`` line."""
    import logging
    import warnings

    values = json.loads(payload)
    config, job = config_from_dict(values["config"]), Job(**values["job"])
    setup_threads(config.common.threads)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    result = SECTION_MODULES[section].run(config, job)
    print(RESULT_PREFIX + json.dumps(result, default=float))
    return 0


def table(results: dict[str, Any]) -> str:
    """The figures as aligned text rows (what, value, settings), each section's rows from its module, then the
    note on the p-values of the comparisons with exact search."""
    rows: list[tuple[str, str, str]] = []
    for label, result in results.items():
        if "error" in result:
            rows.append((label, "ERROR", result["error"][:160]))
        else:
            rows += SECTION_MODULES[label.split(":")[0]].rows(label, result)
    width = max((len(a) for a, _, _ in rows), default=10)
    value_width = max((len(b) for _, b, _ in rows), default=10)
    return "\n".join([f"{a:<{width}}  {b:<{value_width}}  {c}" for a, b, c in rows] + legend(results))


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.child:
        return child(args.child, args.child_config)
    config = make_config(args)
    if config.run.table:  # print the table of an earlier results file, its p-values adjusted as --p-adjust says
        results = json.loads(Path(config.run.table).read_text())["results"]
        adjust_vs_exact(results, config.run.p_adjust)
        print(table(results))
        return 0
    Path(config.common.work).mkdir(parents=True, exist_ok=True)
    from hil.provenance import provenance, write_json_atomic

    output = Path(config.run.output) if config.run.output else HERE / "results" / f"{config.run.name}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    started = time.perf_counter()
    for job in plan(config):
        print(f"[bench] {job.label} ...", file=sys.stderr, flush=True)
        results[job.label] = run_child(job, config, config.run.section_timeout)
        results[job.label]["load_average_after"] = list(os.getloadavg())
        if "error" in results[job.label]:
            print(f"[bench] {job.label}: {results[job.label]['error']}", file=sys.stderr, flush=True)
        adjust_vs_exact(results, config.run.p_adjust)  # one family: every variant compared with exact so far
        # Written after every section: an interrupted run keeps what it measured.
        record = provenance(config.record(), command=" ".join([Path(sys.argv[0]).name, *argv]),
                            machine={"cpu_count": os.cpu_count(), "platform": platform.platform(),
                                     "processor": platform.processor()},
                            results=results, total_s=time.perf_counter() - started)
        write_json_atomic(output, record)
    print(table(results))
    print(f"\nwrote {output} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
