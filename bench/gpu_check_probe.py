"""What ``bench/gpu_check.py`` needs to know from inside its subprocesses: throughput and peak memory.

Neither ``train.py`` nor ``evaluate.py`` reports peak GPU memory, and ``train.py`` reports no triples/s, so each
subprocess reports them itself, without a change to either program:

- training: ``gpu_check_callback.TrainingProbe``, a Lightning callback added on ``train.py``'s own command line;
- evaluation: ``python bench/gpu_check_probe.py REPORT.json evaluate.py ARGS...`` runs ``evaluate.py`` in this
  process exactly as ``python evaluate.py ARGS...`` would (same ``sys.argv``, ``sys.path[0]`` and exit status) and
  writes ``REPORT.json`` when it exits. Its throughput comes from the ``metrics.json`` it writes (``index_seconds``,
  ``search_seconds``), so only the memory is taken here. Nothing beyond the standard library is imported before
  ``evaluate.py`` runs (torch only afterwards, to read the peak), so the figures are the program's own.

Peak memory is ``torch.cuda.max_memory_allocated`` (what PyTorch's allocator handed out on this process's GPU, not
the CUDA context nor FAISS's GPU memory), None when this process never used CUDA, and the process's peak RSS
(``ru_maxrss``) in any case.
"""

from __future__ import annotations

import json
import os
import resource
import runpy
import sys
import time
from pathlib import Path

__all__ = ["memory_report", "run_script", "synchronize", "write_report"]


def memory_report() -> dict[str, int | None]:
    """This process's peak memory: PyTorch's CUDA allocator peak on its current GPU (None without CUDA) and peak
    RSS in bytes (Linux reports ``ru_maxrss`` in KiB)."""
    torch = sys.modules.get("torch")  # a process that never imported torch never used CUDA
    cuda = torch.cuda.max_memory_allocated() if torch is not None and torch.cuda.is_initialized() else None
    return {"cuda_max_memory_allocated_bytes": cuda,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def write_report(path: Path, record: dict) -> None:
    """``record`` as JSON through a temporary name and a rename (a reader never sees half of it). The probe runs
    inside the measured programs, so it writes with the standard library alone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def synchronize() -> None:
    """Wait for the GPU work queued so far (nothing without CUDA)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def run_script(report: str | Path, script: str, args: list[str]) -> None:
    """Run ``script`` as ``python script args...`` would, then write its exit status, wall time and peak memory to
    ``report`` (also when it fails); the script's own exit status is kept."""
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).resolve().parent)
    started, status = time.perf_counter(), 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        raise
    except BaseException:
        status = 1
        raise
    finally:
        write_report(Path(report), {"script": script, "exit_status": status,
                                    "seconds": time.perf_counter() - started, **memory_report()})


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python bench/gpu_check_probe.py REPORT.json SCRIPT.py [ARGS...]")
    run_script(sys.argv[1], sys.argv[2], sys.argv[3:])
