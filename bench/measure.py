"""Small measuring helpers for the benchmark: peak memory, the machine's matmul peak, encoder FLOPs, percentiles."""

from __future__ import annotations

import resource
import time
from typing import Any, Callable

import numpy as np
import torch


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * resource.getpagesize() / 2 ** 20


def matmul_peak_gflops(size: int = 1024, repeats: int = 8, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Best-of-``repeats`` GFLOP/s of a (size x size) @ (size x size) product with the current torch threads.

    The best run estimates what the machine can do when nothing else is running; the median is closer to what a
    shared machine gives. Both are reported.
    """
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up: thread pool and caches
    rates = []
    for _ in range(repeats):
        tick = time.perf_counter()
        torch.mm(a, b)
        rates.append(2.0 * size ** 3 / (time.perf_counter() - tick) / 1e9)
    return {"best": float(max(rates)), "median": float(np.median(rates)), "size": size, "repeats": repeats}


def linear_parameters(model: torch.nn.Module) -> int:
    """Weights of the Linear layers (the multiply-adds every token goes through), float or quantized."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            total += module.weight.numel()
        elif hasattr(module, "weight") and callable(getattr(module, "weight")) and "Linear" in type(module).__name__:
            total += module.weight().numel()  # dynamic-quantized Linear keeps its weight behind a method
    return total


def encoder_flops(lengths: np.ndarray, linear_params: int, n_layers: int, hidden: int) -> float:
    """FLOPs of a BERT-style forward pass over documents of the given (attended) lengths.

    Per token ``2 * linear_params`` for the projections and feed-forward layers, plus attention's two products
    ``QK^T`` and ``AV``: ``4 * L * hidden`` per token and layer. Embeddings, softmax and LayerNorm are left out
    (well under 5% here), so the figure slightly understates the work done.
    """
    lengths = np.asarray(lengths, dtype=np.float64)
    return float((2.0 * linear_params * lengths + 4.0 * n_layers * hidden * lengths ** 2).sum())


def percentiles(values_ms: list[float] | np.ndarray) -> dict[str, float]:
    values = np.asarray(values_ms, dtype=np.float64)
    if values.size == 0:
        return {"p50_ms": float("nan"), "p95_ms": float("nan"), "mean_ms": float("nan"), "n": 0}
    return {"p50_ms": float(np.percentile(values, 50)), "p95_ms": float(np.percentile(values, 95)),
            "mean_ms": float(values.mean()), "n": int(values.size)}


def timed(function: Callable[[], Any]) -> tuple[Any, float]:
    tick = time.perf_counter()
    result = function()
    return result, time.perf_counter() - tick


def write_results(output: Any, settings: dict[str, Any], argv: list[str], result: dict[str, Any]) -> None:
    """A standalone bench script's results file: ``result`` with the settings, command, versions and machine."""
    import os
    import platform
    import sys
    from pathlib import Path

    from hil.provenance import provenance, write_json_atomic

    write_json_atomic(Path(output), provenance(settings, command=" ".join([Path(sys.argv[0]).name, *argv]),
                                               machine={"cpu_count": os.cpu_count(), "platform": platform.platform()},
                                               results=result))
