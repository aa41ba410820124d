"""peak: the fp32 matrix-multiply GFLOP/s of this machine with the benchmark's threads (best and median of repeats),
the yardstick of the encode section's "fraction of peak"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sections.options import Job, option

if TYPE_CHECKING:
    from sections.config import BenchConfig


@dataclass(frozen=True)
class Config:
    """The fp32 matmul peak (measured again inside the encode child)."""

    size: int = option("--peak-size", 1024)
    repeats: int = option("--peak-repeats", 10)


def jobs(config: BenchConfig) -> list[Job]:
    return [Job("peak", "peak")]


def run(config: BenchConfig, job: Job) -> dict[str, Any]:
    from measure import matmul_peak_gflops

    return {"matmul_fp32_gflops": matmul_peak_gflops(config.peak.size, repeats=config.peak.repeats)}


def rows(label: str, result: dict[str, Any]) -> list[tuple[str, str, str]]:
    m = result["matmul_fp32_gflops"]
    return [("fp32 matmul peak", f"{m['best']:.1f} GFLOP/s", f"median {m['median']:.1f}, {m['size']}^3")]
