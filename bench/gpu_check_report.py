"""The machine ``bench/gpu_check.py`` ran on (GPUs, driver, torch and FAISS builds) and its printed summary."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from typing import Any

GIB = 1024 ** 3


def nvidia_driver() -> str | None:
    """The NVIDIA driver's version as ``nvidia-smi`` reports it (None without one)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def environment() -> dict[str, Any]:
    """GPUs (name, memory, compute capability), driver, torch/CUDA/cuDNN and FAISS builds, CPU count. Called after
    the steps, so this process holds no CUDA context while they run."""
    import faiss
    import torch

    cuda = torch.cuda.is_available()
    gpus = []
    for index in range(torch.cuda.device_count() if cuda else 0):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": props.name, "memory_bytes": props.total_memory,
                     "capability": f"{props.major}.{props.minor}"})
    return {"gpus": gpus, "driver": nvidia_driver(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None,
            "bf16_supported": torch.cuda.is_bf16_supported() if cuda else None,
            "faiss": {"version": faiss.__version__,
                      "gpus": faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0},
            "cpu_count": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform()}


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _memory(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f} GiB"


def format_summary(record: dict[str, Any]) -> str:
    """The check's figures as text: the machine, the GPU tests, training, then each GPU evaluation beside its CPU
    reference (``[cpu]``; ``-`` where none ran)."""
    env = record["environment"]
    gpus = ", ".join(g["name"] for g in env["gpus"]) or "no GPU"
    where = "dry run on the CPU" if record["dry_run"] else gpus
    lines = [f"gpu-check {record['status']} ({where}; driver {env['driver'] or '-'}, torch {env['torch']} "
             f"(CUDA {env['torch_cuda'] or '-'}), faiss {env['faiss']['version']} with {env['faiss']['gpus']} GPUs)"]
    tests = record.get("gpu_tests")
    if tests:
        lines.append(f"GPU tests ({tests['selection']}): {tests['passed']} passed, {tests['skipped']} skipped, "
                     f"{tests['failures']} failed, {tests['errors']} errors")
    if record["training"]:
        first = record["training"][0]
        lines.append(f"\ntraining (DDP over {first['devices']} {first['device'].split(':')[0]} processes, "
                     f"{first['batch_size_per_device']} triples per device, {first['timed_steps']} timed steps)")
        lines.append(f"  {'model':<28}{'triples/s':>12}{'peak GPU mem':>16}{'peak RSS':>14}")
        for run in record["training"]:
            lines.append(f"  {run['model'] + ' ' + run['precision']:<28}{_number(run['triples_per_s']):>12}"
                         f"{_memory(run['peak_gpu_memory_bytes']):>16}{_memory(run['peak_rss_bytes']):>14}")
    if record["evaluation"]:
        cpu = {(r["model"], r["trained_precision"], r["dataset"]): r for r in record["cpu_reference"]}
        first = record["evaluation"][0]
        lines.append(f"\nevaluation ({first['backend']}, {first['device']} {first['precision']}; [cpu] = the same "
                     f"evaluation on the CPU in fp32, this run)")
        lines.append(f"  {'model':<28}{'dataset':<10}{'nDCG@10 [cpu]':>18}{'docs/s [cpu]':>22}"
                     f"{'queries/s [cpu]':>22}{'peak GPU mem':>14}")
        for run in record["evaluation"]:
            ref = cpu.get((run["model"], run["trained_precision"], run["dataset"]), {})
            lines.append(
                f"  {run['model'] + ' ' + run['trained_precision']:<28}{run['dataset']:<10}"
                f"{_number(run['ndcg@10'], 4) + ' [' + _number(ref.get('ndcg@10'), 4) + ']':>18}"
                f"{_number(run['documents_per_s']) + ' [' + _number(ref.get('documents_per_s')) + ']':>22}"
                f"{_number(run['queries_per_s']) + ' [' + _number(ref.get('queries_per_s')) + ']':>22}"
                f"{_memory(run['peak_gpu_memory_bytes']):>14}")
    return "\n".join(lines)
