#!/usr/bin/env python
"""``make gpu-check``: the first command to run on a GPU machine (issue 24, item 5).

Every step is a subprocess running one of the project's own commands with this process's environment; its output
goes to ``<out>/<step>.log``, and a step that fails stops the check with one line naming the step and its log
(exit status 1). The steps:

1. ``gpu-tests``: ``pytest -m gpu`` (the tests marked ``gpu``; they skip without a CUDA GPU);
2. ``train-<model>-<precision>``: ``train.py fit --config configs/colbert.yaml [--config
   configs/variants/colbert_hil.yaml] --config configs/presets/gpu.yaml`` for ``--max-steps`` steps under DDP on every
   GPU (``--trainer.strategy ddp --trainer.devices N``) in each of ``16-mixed`` and ``bf16-mixed``, on the MS MARCO
   triples under ``HIL_DATA_DIR``, exporting the model;
3. ``evaluate-<model>-<precision>-<dataset>-<device>-<precision>``: ``evaluate.py --device cuda --precision fp16
   --backend plaid`` (PLAID on the GPU) on SciFact and NFCorpus for each export, and the same evaluation on the CPU
   in fp32 (``--device cpu --precision fp32``) for the exports of the first training precision: the CPU figures
   printed beside the GPU ones come from this run, not from ``bench/results``.

Figures: triples/s of training (every rank's triples over the steps after ``--skip-steps``), documents/s (the
corpus over ``index_seconds`` of ``metrics.json``: the whole index build, encoding and PLAID structures), queries/s
(queries over ``search_seconds``: query encoding and search), nDCG@10 (``metrics.json``) and peak GPU memory
(``torch.cuda.max_memory_allocated``; of training, the largest over ranks). Neither program reports triples/s or
peak memory, so their subprocesses report them: a Lightning callback added on ``train.py``'s own command line
(``bench/gpu_check_callback.py``), and a wrapper that runs ``evaluate.py`` unchanged in its process
(``bench/gpu_check_probe.py``). Everything is printed and written, with versions, GPU names, driver, torch and
FAISS builds, to ``<out>/gpu-check.json`` (atomically; also when a step fails, then with ``status: failed`` and the
step).

``--dry-run`` runs the same steps on the CPU, small: the tiny BERT of ``HIL_MODELS_DIR``, ``presets/smoke.yaml``,
4 steps under DDP over 2 CPU processes (gloo) in ``32-true`` and ``bf16-mixed``, evaluations in bf16 on slices of
8 queries and 64 documents (their judged documents kept): how the script itself is tested (tests/test_gpu_check.py).

    python bench/gpu_check.py                      # on the GPU machine (make gpu-check)
    python bench/gpu_check.py --dry-run            # anywhere (make gpu-check DRY_RUN=1)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))
from gpu_check_report import environment, format_summary  # noqa: E402

MODEL_CONFIGS = {"colbert": [], "colbert_hil": ["configs/variants/colbert_hil.yaml"]}
STEP_KINDS = ("tests", "train", "evaluate")


@dataclass(frozen=True)
class Plan:
    """What the check runs (``--dry-run`` changes the defaults, not the steps)."""
    dry_run: bool
    out: str
    steps: tuple[str, ...]
    models: tuple[str, ...]
    precisions: tuple[str, ...]
    datasets: tuple[str, ...]
    backbone: str
    triples: str
    preset: str
    accelerator: str
    devices: int
    max_steps: int
    skip_steps: int
    batch_size: int
    lr: float
    eval_device: str
    eval_precision: str
    max_docs: int | None
    max_queries: int | None
    cpu_reference: bool


class StepFailed(Exception):
    """A step that failed: its name, exit status and log; the message is one line, ending with the log's last line
    (``reason`` instead, where the step exited 0 but left no figures)."""

    def __init__(self, step: str, status: int, log: Path, reason: str | None = None):
        super().__init__(f"step {step} failed (exit {status}): {reason or last_line(log)}; log: {log}")
        self.step, self.status, self.log = step, status, log


def last_line(log: Path) -> str:
    """The log's last non-empty line (a one-line ``error: ...`` where the program printed one)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def csv(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU with the tiny model")
    parser.add_argument("--out", default=None, help="folder for the JSON, logs and runs (default runs/gpu-check, "
                                                    "runs/gpu-check-dry with --dry-run)")
    parser.add_argument("--steps", type=csv, default=STEP_KINDS, help="tests,train,evaluate (default: all)")
    parser.add_argument("--models", type=csv, default=tuple(MODEL_CONFIGS), help="colbert,colbert_hil")
    parser.add_argument("--precisions", type=csv, default=None,
                        help="training precisions (default 16-mixed,bf16-mixed; dry run 32-true,bf16-mixed)")
    parser.add_argument("--datasets", type=csv, default=("scifact", "nfcorpus"))
    parser.add_argument("--backbone", default=None,
                        help="default sentence-transformers/all-MiniLM-L6-v2 (HIL_MODELS_DIR's copy when there); "
                             "dry run: bert-tiny-splade")
    parser.add_argument("--triples", default="msmarco/triples.train.small.head1000.tsv",
                        help="training triples, relative to HIL_DATA_DIR")
    parser.add_argument("--devices", type=int, default=None,
                        help="DDP processes (default: every GPU torch sees; dry run: 2 CPU processes)")
    parser.add_argument("--max-steps", type=int, default=None, help="training steps (default 300; dry run 4)")
    parser.add_argument("--skip-steps", type=int, default=None,
                        help="first steps left out of triples/s (default 20; dry run 1)")
    parser.add_argument("--batch-size", type=int, default=None, help="triples per device (default 32; dry run 8)")
    parser.add_argument("--lr", type=float, default=2e-5,
                        help="learning rate (presets/cpu.yaml's, for runs of a few hundred steps)")
    parser.add_argument("--max-docs", type=int, default=None, help="corpus slice (default all; dry run 64)")
    parser.add_argument("--max-queries", type=int, default=None, help="query slice (default all; dry run 8)")
    parser.add_argument("--no-cpu-reference", action="store_true", help="skip the CPU fp32 evaluations")
    return parser


def plan_from(args: argparse.Namespace, cuda_devices: int) -> Plan:
    """The plan for ``args`` on a machine with ``cuda_devices`` GPUs; a ``ValueError`` names what cannot work."""
    dry = args.dry_run
    if not dry and cuda_devices == 0:
        raise ValueError("torch sees no CUDA GPU (install a CUDA build of torch), or run with --dry-run")
    unknown = [s for s in args.steps if s not in STEP_KINDS] + [m for m in args.models if m not in MODEL_CONFIGS]
    if unknown:
        raise ValueError(f"unknown --steps/--models value(s) {unknown}; steps: {STEP_KINDS}, models: "
                         f"{tuple(MODEL_CONFIGS)}")
    if "evaluate" in args.steps and "train" not in args.steps:
        raise ValueError("--steps evaluate needs train (it evaluates the models this run trains)")
    pick = (lambda given, dry_value, gpu_value: given if given is not None else (dry_value if dry else gpu_value))
    plan = Plan(
        dry_run=dry, out=pick(args.out, "runs/gpu-check-dry", "runs/gpu-check"), steps=tuple(args.steps),
        models=tuple(args.models), precisions=pick(args.precisions, ("32-true", "bf16-mixed"),
                                                   ("16-mixed", "bf16-mixed")),
        datasets=tuple(args.datasets),
        backbone=pick(args.backbone, "bert-tiny-splade", "sentence-transformers/all-MiniLM-L6-v2"),
        triples=args.triples, preset="configs/presets/smoke.yaml" if dry else "configs/presets/gpu.yaml",
        accelerator="cpu" if dry else "gpu", devices=pick(args.devices, 2, cuda_devices),
        max_steps=pick(args.max_steps, 4, 300), skip_steps=pick(args.skip_steps, 1, 20),
        batch_size=pick(args.batch_size, 8, 32), lr=args.lr, eval_device="cpu" if dry else "cuda",
        eval_precision="bf16" if dry else "fp16", max_docs=pick(args.max_docs, 64, None),
        max_queries=pick(args.max_queries, 8, None), cpu_reference=not args.no_cpu_reference)
    if not 0 <= plan.skip_steps < plan.max_steps:
        raise ValueError(f"--skip-steps {plan.skip_steps} must lie in 0..--max-steps - 1 ({plan.max_steps - 1})")
    if min(plan.devices, plan.batch_size) < 1 or not (plan.models and plan.precisions and plan.datasets):
        raise ValueError("--devices and --batch-size must be >= 1, and --models/--precisions/--datasets non-empty")
    return plan


def subprocess_env() -> dict[str, str]:
    """This process's environment, with ``bench/`` importable (the training probe) and unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_step(step: str, command: list[str], out: Path) -> Path:
    """Run ``command`` in the repository root, its output to ``out/<step>.log``; -> the log. Raises
    :class:`StepFailed` when it exits non-zero."""
    log = out / f"{step}.log"
    print(f"[gpu-check] {step}: {' '.join(command[1:])}", flush=True)
    with open(log, "w", encoding="utf-8") as handle:
        handle.write(" ".join(command) + "\n\n")
        handle.flush()
        status = subprocess.run(command, cwd=REPO, env=subprocess_env(), stdout=handle, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL).returncode
    if status != 0:
        raise StepFailed(step, status, log)
    return log


def gpu_test_files() -> list[str]:
    """The test files that mark tests ``gpu`` (collecting only these, not the whole suite, saves ~20 s)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())


def junit_counts(path: Path) -> dict[str, int]:
    """Test counts of a pytest JUnit XML report (``passed`` = tests - failures - errors - skipped)."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def training_figures(rank_reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One training run's figures from its ranks' probe reports: triples/s = every rank's timed triples over the
    longest rank's timed seconds (ranks step together under DDP); peak memory = the largest rank's."""
    if not rank_reports or any(r["seconds"] is None for r in rank_reports):
        raise ValueError("a rank reported no timed steps (--skip-steps too large?)")
    seconds = max(r["seconds"] for r in rank_reports)
    triples = sum(r["timed_triples"] for r in rank_reports)
    cuda = [r["cuda_max_memory_allocated_bytes"] for r in rank_reports]
    return {"ranks": len(rank_reports), "world_size": rank_reports[0]["world_size"],
            "device": rank_reports[0]["device"], "steps": rank_reports[0]["steps"],
            "timed_steps": rank_reports[0]["timed_steps"], "timed_triples": triples, "timed_seconds": seconds,
            "triples_per_s": triples / seconds,
            "peak_gpu_memory_bytes": max(cuda) if all(c is not None for c in cuda) else None,
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rank_reports)}


def evaluation_figures(metrics: dict[str, Any], probe: dict[str, Any]) -> dict[str, Any]:
    """One evaluation's figures from the ``metrics.json`` it wrote and its probe report."""
    runs = {name: run for name, run in metrics["results"].items() if name != "bm25"}
    if len(runs) != 1:
        raise ValueError(f"expected one model run in metrics.json, found {sorted(runs)}")
    name, run = next(iter(runs.items()))
    documents, queries = metrics["dataset"]["documents"], metrics["dataset"]["queries"]
    return {"run": name, "documents": documents, "queries": queries, "ndcg@10": run["metrics"]["ndcg@10"],
            "device_used": run["device"], "index_seconds": run["index_seconds"],
            "documents_per_s": documents / run["index_seconds"], "search_seconds": run["search_seconds"],
            "queries_per_s": queries / run["search_seconds"],
            "peak_gpu_memory_bytes": probe["cuda_max_memory_allocated_bytes"],
            "peak_rss_bytes": probe["peak_rss_bytes"]}


def train(plan: Plan, model: str, precision: str, out: Path, work: Path) -> dict[str, Any]:
    step = f"train-{model}-{precision}"
    root = work / "train" / f"{model}-{precision}"
    probe_dir = root / "probe"
    configs = ["configs/colbert.yaml", *MODEL_CONFIGS[model], plan.preset]
    command = [sys.executable, "train.py", "fit", *[a for c in configs for a in ("--config", c)],
               "--trainer.accelerator", plan.accelerator, "--trainer.strategy", "ddp",
               "--trainer.devices", str(plan.devices), "--trainer.precision", precision,
               "--trainer.max_steps", str(plan.max_steps), "--trainer.log_every_n_steps", "10",
               "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root),
               "--export_dir", str(root / "export"), "--model.encoder.init_args.backbone", plan.backbone,
               "--model.optimizer.init_args.lr", str(plan.lr), "--data.triples", plan.triples,
               "--data.batch_size", str(plan.batch_size),
               "--trainer.callbacks+=gpu_check_callback.TrainingProbe", f"--trainer.callbacks.report_dir={probe_dir}",
               f"--trainer.callbacks.skip_steps={plan.skip_steps}"]
    log = run_step(step, command, out)
    reports = [read_json(path) for path in sorted(probe_dir.glob("rank*.json"))]
    if len(reports) != plan.devices:
        raise StepFailed(step, 0, log, f"{len(reports)} probe reports in {probe_dir} for {plan.devices} ranks")
    return {"step": step, "model": model, "precision": precision, "strategy": "ddp", "devices": plan.devices,
            "batch_size_per_device": plan.batch_size, "export": str(root / "export"), "log": str(log),
            **training_figures(reports)}


def evaluate(plan: Plan, trained: dict[str, Any], dataset: str, device: str, precision: str, out: Path,
             work: Path) -> dict[str, Any]:
    step = f"evaluate-{trained['model']}-{trained['precision']}-{dataset}-{device}-{precision}"
    results = work / "eval" / f"{trained['model']}-{trained['precision']}" / f"{dataset}-{device}-{precision}"
    probe = results.with_name(f"{results.name}.probe.json")
    command = [sys.executable, str(BENCH / "gpu_check_probe.py"), str(probe), "evaluate.py",
               "--model", trained["export"], "--dataset", dataset, "--device", device, "--precision", precision,
               "--backend", "plaid", "--index-root", str(work / f"indexes-{device}-{precision}"),
               "--output", str(results), "--no-bm25", "--no-stats", "--quiet"]
    for option, value in (("--max-docs", plan.max_docs), ("--max-queries", plan.max_queries)):
        command += [option, str(value)] if value is not None else []
    log = run_step(step, command, out)
    return {"step": step, "model": trained["model"], "trained_precision": trained["precision"], "dataset": dataset,
            "device": device, "precision": precision, "backend": "plaid", "metrics": str(results / "metrics.json"),
            "log": str(log), **evaluation_figures(read_json(results / "metrics.json"), read_json(probe))}


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def run_checks(plan: Plan, out: Path, report: dict[str, Any]) -> None:
    """The steps, filling ``report`` as they finish (so a failure still leaves the figures measured before it)."""
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)  # a reused index would make documents/s the speed of reading it
    if "tests" in plan.steps:
        junit = out / "gpu-tests.xml"
        files = gpu_test_files()
        log = run_step("gpu-tests", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                     f"--junitxml={junit}", *files], out)
        report["gpu_tests"] = {"selection": "pytest -m gpu", "files": files, "log": str(log), **junit_counts(junit)}
    trained = []
    if "train" in plan.steps:
        for model in plan.models:
            for precision in plan.precisions:
                trained.append(train(plan, model, precision, out, work))
                report["training"].append(trained[-1])
    if "evaluate" in plan.steps:
        for run in trained:
            for dataset in plan.datasets:
                report["evaluation"].append(evaluate(plan, run, dataset, plan.eval_device, plan.eval_precision,
                                                     out, work))
        if plan.cpu_reference:
            for run in (r for r in trained if r["precision"] == plan.precisions[0]):
                for dataset in plan.datasets:
                    report["cpu_reference"].append(evaluate(plan, run, dataset, "cpu", "fp32", out, work))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch  # after parsing: --help stays fast

    try:
        plan = plan_from(args, torch.cuda.device_count())
    except ValueError as error:
        print(f"gpu-check: error: {error}", file=sys.stderr)
        return 2
    out = Path(plan.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if plan.dry_run:
        print(f"[gpu-check] dry run on the CPU: {plan.backbone}, DDP over {plan.devices} CPU processes (gloo), "
              f"{plan.max_steps} steps, evaluation in {plan.eval_precision} on slices of {plan.max_docs} documents")
    report: dict[str, Any] = {"status": "running", "dry_run": plan.dry_run, "plan": asdict(plan),
                              "gpu_tests": None, "training": [], "evaluation": [], "cpu_reference": []}
    failure = None
    try:
        run_checks(plan, out, report)
        report["status"] = "ok"
    except StepFailed as error:
        failure = error
        report.update(status="failed", failed_step=error.step, failed_log=str(error.log))
    from hil.provenance import provenance, write_json_atomic

    record = provenance(None, environment=environment(), **report)
    path = out / "gpu-check.json"
    write_json_atomic(path, record)
    if failure is not None:
        print(f"gpu-check: {failure}", file=sys.stderr)
        return 1
    print(format_summary(record))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
