"""The machine ``bench/gpu_check.py`` runs on (GPUs, driver, torch and FAISS builds) and its printed plan and table.

``python bench/gpu_check_report.py OUT.json`` writes :func:`environment` to ``OUT.json``: on a GPU machine the check
reads the machine in this subprocess, so that its own process never holds a CUDA context while the steps run."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
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
    """GPUs (name, memory, compute capability), driver, torch/CUDA/cuDNN and FAISS builds, CPU count."""
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


def _budget_line(record: dict[str, Any]) -> str:
    budget, estimates = record["budget"], record.get("estimates") or {}
    limit = "no budget" if budget["budget_s"] is None else f"a {budget['budget_s']:.0f} s budget"
    return (f"plan: {len(budget['kept'])} steps, estimate {budget['estimate_s']:.0f} s for {limit}; "
            f"{estimates.get('note', 'estimates: -')}")


def _left_out_lines(record: dict[str, Any]) -> list[str]:
    return [f"  left out: {item['step']} ({item['reason']})" for item in record["budget"]["left_out"]]


def format_plan(record: dict[str, Any]) -> str:
    """The plan before it runs: the kept steps with their estimates, and what was left out and why."""
    lines = [f"[gpu-check] {_budget_line(record)}"]
    lines += [f"  {item['step']:<58}{item['estimate_s']:>8.0f} s" for item in record["budget"]["kept"]]
    return "\n".join(lines + _left_out_lines(record))


def format_summary(record: dict[str, Any]) -> str:
    """The check's figures as text, from a whole or a partial record: the machine, the plan and each step's time,
    the GPU tests, training, then each GPU evaluation beside its CPU reference (``[cpu]``; ``-`` where none ran)."""
    env = record.get("environment") or {}
    gpus = ", ".join(g["name"] for g in env.get("gpus", [])) or "no GPU"
    where = "dry run on the CPU" if record.get("dry_run") else gpus
    faiss = env.get("faiss") or {}
    lines = [f"gpu-check {record['status']} ({where}; driver {env.get('driver') or '-'}, torch {env.get('torch', '-')} "
             f"(CUDA {env.get('torch_cuda') or '-'}), faiss {faiss.get('version', '-')} with {faiss.get('gpus', '-')} "
             f"GPUs)"]
    if record.get("budget"):
        lines += [_budget_line(record), f"  {'step':<58}{'status':>12}{'seconds':>10}{'estimate':>10}"]
        lines += [f"  {s['step']:<58}{s['status']:>12}{_number(s.get('seconds')):>10}{_number(s['estimate_s']):>10}"
                  for s in record.get("steps", [])]
        lines += _left_out_lines(record)
        lines.append(f"  elapsed {_number(record.get('elapsed_s'))} s")
    tests = record.get("gpu_tests")
    if tests:
        lines.append(f"GPU tests ({tests['selection']}): {tests['passed']} passed, {tests['skipped']} skipped, "
                     f"{tests['failures']} failed, {tests['errors']} errors")
    if record["training"]:
        first = record["training"][0]
        strategy = first.get("strategy", "ddp")
        how = (f"DDP over {first['devices']} {first['device'].split(':')[0]} processes" if strategy == "ddp"
               else f"one {first['device'].split(':')[0]} device, {strategy}")
        lines.append(f"\ntraining ({how}, {first['batch_size_per_device']} triples per device, "
                     f"{first['timed_steps']} timed steps)")
        lines.append(f"  {'model':<28}{'triples/s':>12}{'peak GPU mem':>16}{'peak RSS':>14}")
        for run in record["training"]:
            lines.append(f"  {run['model'] + ' ' + run['precision']:<28}{_number(run['triples_per_s']):>12}"
                         f"{_memory(run['peak_gpu_memory_bytes']):>16}{_memory(run['peak_rss_bytes']):>14}")
    if record["evaluation"]:
        def export(run: dict[str, Any]) -> Any:  # records written before exports were named: model and precision
            return run.get("export") or (run["model"], run["trained_precision"])

        cpu = {(export(r), r["dataset"]): r for r in record.get("cpu_reference", [])}
        first = record["evaluation"][0]
        lines.append(f"\nevaluation ({first['backend']}, {first['device']} {first['precision']}; [cpu] = the same "
                     f"evaluation on the CPU in fp32, this run)")
        lines.append(f"  {'model':<28}{'dataset':<10}{'nDCG@10 [cpu]':>18}{'docs/s [cpu]':>22}"
                     f"{'queries/s [cpu]':>22}{'peak GPU mem':>14}")
        for run in record["evaluation"]:
            ref = cpu.get((export(run), run["dataset"]), {})
            name = f"{run['model']} {run['trained_precision']}"
            if run.get("label") not in (None, f"{run['model']}-{run['trained_precision']}"):
                name += f" ({run['label']})"  # a given export: its folder's name
            lines.append(
                f"  {name:<28}{run['dataset']:<10}"
                f"{_number(run['ndcg@10'], 4) + ' [' + _number(ref.get('ndcg@10'), 4) + ']':>18}"
                f"{_number(run['documents_per_s']) + ' [' + _number(ref.get('documents_per_s')) + ']':>22}"
                f"{_number(run['queries_per_s']) + ' [' + _number(ref.get('queries_per_s')) + ']':>22}"
                f"{_memory(run['peak_gpu_memory_bytes']):>14}")
            lines.extend(_time_split(run))
    return "\n".join(lines)


def _time_split(run: dict[str, Any]) -> list[str]:
    """Where an evaluation's time went (records from before these figures: nothing)."""
    out = []
    build = run.get("index_build_seconds")
    if build:
        out.append(f"    index {_number(run['index_seconds'], 2)} s: "
                   + ", ".join(f"{name.replace('_', ' ')} {_number(value, 2)} s" for name, value in build.items()))
    steps = run.get("search_step_seconds") or {}
    if any(value is not None for value in steps.values()):
        names = {"encode_s": "query encoding", "ann_s": "candidates", "score_s": "exact scoring"}
        out.append(f"    search {_number(run['search_seconds'], 2)} s: "
                   + ", ".join(f"{names[step]} {_number(value, 2)} s" for step, value in steps.items()
                               if value is not None))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/gpu_check_report.py OUT.json")
    from gpu_check_probe import write_report

    write_report(Path(sys.argv[1]), environment())
