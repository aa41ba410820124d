#!/usr/bin/env python
"""``make gpu-check``: the first command to run on a GPU machine (issue 24, item 5), planned to fit its time (issue
29, item 4).

Every step is a subprocess running one of the project's own commands with this process's environment; its output
goes to ``<out>/<step>.log``. The step kinds:

- ``train-<model>-<precision>``: ``train.py fit --config configs/colbert.yaml [--config
  configs/variants/colbert_hil.yaml] --config configs/presets/gpu.yaml`` for ``--max-steps`` steps on the MS MARCO
  triples under ``HIL_DATA_DIR``, exporting the model: under DDP on N > 1 devices, with Lightning's single-device
  strategy on one (DDP on one device only adds its process group; the JSON records the strategy used);
- ``evaluate-<export>-<dataset>-cuda-fp16``: ``evaluate.py --device cuda --precision fp16 --backend plaid``;
- ``evaluate-<export>-<dataset>-cpu-fp32``: the same evaluation on the CPU in fp32, the reference printed beside
  the GPU figures (from this run, not from ``bench/results``);
- ``gpu-tests``: ``pytest -m gpu`` (the tests marked ``gpu``).

**The default plan fits 240 s** (``--budget-s``, default 240 on a GPU). One H200 ran the earlier default, cut to
SciFact and 200 steps, for over 450 s: each process starts in ~25 s (Python, the model, the data), so the check is
paid per step more than per figure. The default therefore asks for SciFact only and 120 training steps, the last 100
timed (20 warm-up steps absorb allocator growth and kernel selection; 100 timed steps are ~10 s at today's 104 ms a
step, ~1 s at the goal of 3,000 triples/s), and runs, in this priority order (``gpu_check_plan``): ColBERT
``16-mixed`` trained, evaluated on the GPU and on the CPU (the figures issue 29's goals and the GPU-CPU agreement
need); ColBERT-HIL ``16-mixed`` trained and evaluated on the GPU; ColBERT, then ColBERT-HIL, trained in
``bf16-mixed`` (throughput only: a ``bf16-mixed`` export ranks as the ``16-mixed`` one, so its evaluation comes
later); then the rest (those evaluations, the other CPU reference, the GPU tests) while it fits. Each step is
estimated before it runs (start-up plus work at measured rates, ``gpu_check_plan``), from the issue's H200 table or,
when ``<out>/gpu-check.json`` holds an earlier check on the same GPU, from its figures; the steps that do not fit
are listed with their reasons, in the output and the JSON. At the H200 table's rates the default keeps ColBERT's
training, GPU evaluation and CPU reference and ColBERT-HIL's training (~213 s); once the work of issue 29 makes
training and evaluation fast, the estimates refined from that first run keep more (``--budget-s 0`` runs everything;
``--plan-only`` shows the plan).

**A check stopped at any point keeps its figures.** ``<out>/gpu-check.json`` (atomic) is rewritten at the start and
as each step starts and ends, with ``status: running``, the figures of the steps done and the running step's process
id, so even SIGKILL leaves valid JSON;
SIGINT and SIGTERM (``timeout`` in ``shared/gpu/run.sh``) stop the running step, write ``status: interrupted`` and
print the table (exit 130 for SIGINT, 143 for SIGTERM); a step that fails stops the check with one line naming it
and its log (exit 1); a step running past ``--step-limit-factor`` times its estimate plus 60 s is stopped and recorded
as timed out (exit 1). ``--table PATH`` prints the table of such a file, whole or partial. ``--exports DIR``
evaluates given exports without training (``gpu_check_exports``).

Figures: triples/s of training (every rank's triples over the steps after ``--skip-steps``), documents/s (the
corpus over ``index_seconds`` of ``metrics.json``: the whole index build, encoding and PLAID structures), queries/s
(queries over ``search_seconds``: query encoding and search), where those seconds went (the index build's stages,
``build_seconds`` of ``index.json``; the search's query encoding, candidates and exact scoring), nDCG@10
(``metrics.json``), peak GPU memory (``torch.cuda.max_memory_allocated``; of training, the largest over ranks) and
each step's wall seconds. A Lightning
callback added on ``train.py``'s own command line (``bench/gpu_check_callback.py``) and a wrapper that runs
``evaluate.py`` unchanged in its process (``bench/gpu_check_probe.py``) report what neither program does. The machine
(GPUs, driver, torch and FAISS builds) is read in a subprocess where there is a GPU, so that this process never
holds a CUDA context.

``--dry-run`` runs the same steps on the CPU, small: the tiny BERT of ``HIL_MODELS_DIR``, ``presets/smoke.yaml``,
4 steps under DDP over 2 CPU processes (gloo) in ``32-true`` and ``bf16-mixed``, evaluations in bf16 on slices of
8 queries and 64 documents of SciFact and NFCorpus (their judged documents kept), no budget unless given: how the
script itself is tested (tests/test_gpu_check.py).

    python bench/gpu_check.py                      # on the GPU machine (make gpu-check)
    python bench/gpu_check.py --plan-only          # what it would run, and its estimate
    python bench/gpu_check.py --dry-run            # anywhere (make gpu-check DRY_RUN=1)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))
from gpu_check_exports import find_exports  # noqa: E402
from gpu_check_plan import (  # noqa: E402
    Budget,
    Plan,
    Step,
    budget_plan,
    candidate_steps,
    dataset_size,
    estimate_s,
    estimates_for,
    read_earlier,
)
from gpu_check_report import format_plan, format_summary  # noqa: E402
from gpu_check_run import Interrupted, StepFailed, signals_interrupt  # noqa: E402
from gpu_check_run import run_step as run_command  # noqa: E402

MODEL_CONFIGS = {"colbert": [], "colbert_hil": ["configs/variants/colbert_hil.yaml"]}
STEP_KINDS = ("tests", "train", "evaluate")
LIMIT_SLACK_S = 60.0  # a step's limit: --step-limit-factor x its estimate + this (start-up varies most)
__all__ = ["Plan", "StepFailed", "build_parser", "evaluation_figures", "junit_counts", "main", "plan_from",
           "run_step", "training_figures"]


def csv(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU with the tiny model")
    parser.add_argument("--out", default=None, help="folder for the JSON, logs and runs (default runs/gpu-check, "
                                                    "runs/gpu-check-dry with --dry-run)")
    parser.add_argument("--budget-s", type=float, default=None, metavar="SECONDS",
                        help="keep the steps, in priority order, whose estimates fit (default 240 on a GPU; no "
                             "budget with --dry-run; 0: no budget)")
    parser.add_argument("--step-limit-factor", type=float, default=4.0,
                        help=f"stop a step running past this many times its estimate + {LIMIT_SLACK_S:.0f} s "
                             "(default 4; 0: no limit)")
    parser.add_argument("--plan-only", action="store_true",
                        help="print the plan and its estimates, run nothing (without a GPU: the plan for one)")
    parser.add_argument("--table", default=None, metavar="PATH",
                        help="print the table of an existing gpu-check.json (a partial one too) and exit")
    parser.add_argument("--exports", default=None, metavar="DIR",
                        help="evaluate these exports without training: an export folder, or a folder of them")
    parser.add_argument("--steps", type=csv, default=None,
                        help="tests,train,evaluate (default: all; tests,evaluate with --exports)")
    parser.add_argument("--models", type=csv, default=tuple(MODEL_CONFIGS), help="colbert,colbert_hil")
    parser.add_argument("--precisions", type=csv, default=None,
                        help="training precisions (default 16-mixed,bf16-mixed; dry run 32-true,bf16-mixed)")
    parser.add_argument("--datasets", type=csv, default=None,
                        help="default scifact (dry run: scifact,nfcorpus)")
    parser.add_argument("--backbone", default=None,
                        help="default sentence-transformers/all-MiniLM-L6-v2 (HIL_MODELS_DIR's copy when there); "
                             "dry run: bert-tiny-splade")
    parser.add_argument("--triples", default="msmarco/triples.train.small.head1000.tsv",
                        help="training triples, relative to HIL_DATA_DIR")
    parser.add_argument("--devices", type=int, default=None,
                        help="training devices, DDP when > 1 (default: every GPU torch sees; dry run: 2 CPU "
                             "processes)")
    parser.add_argument("--max-steps", type=int, default=None, help="training steps (default 120; dry run 4)")
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
    """The plan for ``args`` on a machine with ``cuda_devices`` GPUs; a ``ValueError`` (``UserError``) names what
    cannot work."""
    dry = args.dry_run
    if not dry and cuda_devices == 0:
        raise ValueError("torch sees no CUDA GPU (install a CUDA build of torch), or run with --dry-run")
    exports = find_exports(args.exports) if args.exports is not None else ()
    steps = args.steps if args.steps is not None else tuple(s for s in STEP_KINDS if not (exports and s == "train"))
    unknown = [s for s in steps if s not in STEP_KINDS] + [m for m in args.models if m not in MODEL_CONFIGS]
    if unknown:
        raise ValueError(f"unknown --steps/--models value(s) {unknown}; steps: {STEP_KINDS}, models: "
                         f"{tuple(MODEL_CONFIGS)}")
    if exports and "train" in steps:
        raise ValueError("--exports evaluates the given exports: --steps train does not go with it")
    if "evaluate" in steps and "train" not in steps and not exports:
        raise ValueError("--steps evaluate needs train (it evaluates the models this run trains), or --exports")
    def pick(given, dry_value, gpu_value):
        return given if given is not None else (dry_value if dry else gpu_value)

    devices = pick(args.devices, 2, cuda_devices)
    budget = pick(args.budget_s, None, 240.0)
    plan = Plan(
        dry_run=dry, out=pick(args.out, "runs/gpu-check-dry", "runs/gpu-check"), steps=tuple(steps),
        models=tuple(args.models), precisions=pick(args.precisions, ("32-true", "bf16-mixed"),
                                                   ("16-mixed", "bf16-mixed")),
        datasets=pick(args.datasets, ("scifact", "nfcorpus"), ("scifact",)),
        backbone=pick(args.backbone, "bert-tiny-splade", "sentence-transformers/all-MiniLM-L6-v2"),
        triples=args.triples, preset="configs/presets/smoke.yaml" if dry else "configs/presets/gpu.yaml",
        accelerator="cpu" if dry else "gpu", devices=devices, strategy="ddp" if devices > 1 else "single-device",
        max_steps=pick(args.max_steps, 4, 120), skip_steps=pick(args.skip_steps, 1, 20),
        batch_size=pick(args.batch_size, 8, 32), lr=args.lr, eval_device="cpu" if dry else "cuda",
        eval_precision="bf16" if dry else "fp16", max_docs=pick(args.max_docs, 64, None),
        max_queries=pick(args.max_queries, 8, None), cpu_reference=not args.no_cpu_reference,
        budget_s=budget or None, step_limit_factor=args.step_limit_factor, exports=exports)
    if not 0 <= plan.skip_steps < plan.max_steps:
        raise ValueError(f"--skip-steps {plan.skip_steps} must lie in 0..--max-steps - 1 ({plan.max_steps - 1})")
    if min(plan.devices, plan.batch_size) < 1 or not (plan.models and plan.precisions and plan.datasets):
        raise ValueError("--devices and --batch-size must be >= 1, and --models/--precisions/--datasets non-empty")
    if (plan.budget_s or 0) < 0 or plan.step_limit_factor < 0:
        raise ValueError("--budget-s and --step-limit-factor must be >= 0")
    for dataset in plan.datasets:
        dataset_size(dataset, plan.max_docs, plan.max_queries)  # a dataset of unknown size fails here, not later
    return plan


def subprocess_env() -> dict[str, str]:
    """This process's environment, with ``bench/`` importable (the training probe) and unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_step(step: str, command: list[str], out: Path, limit_s: float | None = None,
             on_start: Callable[[int], None] | None = None) -> Path:
    """Run ``command`` in the repository root, its output to ``out/<step>.log`` (``gpu_check_run.run_step``;
    ``on_start`` is told its process id)."""
    return run_command(step, command, out, REPO, subprocess_env(), limit_s, on_start)


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
            "peak_rss_bytes": probe["peak_rss_bytes"],
            # Where the time went: the index build's stages (index.json's build_seconds, when this evaluation built
            # it) and the search's (query encoding, candidates, exact scoring).
            "index_build_seconds": run.get("index_build_seconds"),
            "search_step_seconds": {step: (run.get("search_stats") or {}).get(step)
                                    for step in ("encode_s", "ann_s", "score_s")}}


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def train(plan: Plan, step: Step, out: Path, work: Path, limit_s: float | None,
          on_start: Callable[[int], None] | None = None) -> dict[str, Any]:
    root = work / "train" / step.label
    probe_dir = root / "probe"
    configs = ["configs/colbert.yaml", *MODEL_CONFIGS[step.model], plan.preset]
    command = [sys.executable, "train.py", "fit", *[a for c in configs for a in ("--config", c)],
               "--trainer.accelerator", plan.accelerator,
               "--trainer.strategy", "ddp" if plan.strategy == "ddp" else "auto",
               "--trainer.devices", str(plan.devices), "--trainer.precision", step.precision,
               "--trainer.max_steps", str(plan.max_steps), "--trainer.log_every_n_steps", "10",
               "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root),
               "--export_dir", str(root / "export"), "--model.encoder.init_args.backbone", plan.backbone,
               "--model.optimizer.init_args.lr", str(plan.lr), "--data.source", "TextTriples",
               "--data.source.path", plan.triples,
               "--data.batch_size", str(plan.batch_size),
               "--trainer.callbacks+=gpu_check_callback.TrainingProbe", f"--trainer.callbacks.report_dir={probe_dir}",
               f"--trainer.callbacks.skip_steps={plan.skip_steps}"]
    log = run_step(step.name, command, out, limit_s, on_start)
    reports = [read_json(path) for path in sorted(probe_dir.glob("rank*.json"))]
    if len(reports) != plan.devices:
        raise StepFailed(step.name, 0, log, f"{len(reports)} probe reports in {probe_dir} for {plan.devices} ranks")
    return {"step": step.name, "model": step.model, "precision": step.precision, "strategy": plan.strategy,
            "devices": plan.devices, "batch_size_per_device": plan.batch_size, "export": str(root / "export"),
            "log": str(log), **training_figures(reports)}


def evaluate(plan: Plan, step: Step, out: Path, work: Path, limit_s: float | None,
             on_start: Callable[[int], None] | None = None) -> dict[str, Any]:
    export = step.export or str(work / "train" / step.label / "export")
    results = work / "eval" / step.label / f"{step.dataset}-{step.device}-{step.eval_precision}"
    probe = results.with_name(f"{results.name}.probe.json")
    command = [sys.executable, str(BENCH / "gpu_check_probe.py"), str(probe), "evaluate.py",
               "--model", export, "--dataset", step.dataset, "--device", step.device,
               "--precision", step.eval_precision, "--backend", "plaid",
               "--index-root", str(work / f"indexes-{step.device}-{step.eval_precision}"),
               "--output", str(results), "--no-bm25", "--no-stats", "--quiet"]
    for option, value in (("--max-docs", plan.max_docs), ("--max-queries", plan.max_queries)):
        command += [option, str(value)] if value is not None else []
    log = run_step(step.name, command, out, limit_s, on_start)
    return {"step": step.name, "label": step.label, "model": step.model, "trained_precision": step.precision,
            "export": export, "dataset": step.dataset, "device": step.device, "precision": step.eval_precision,
            "backend": "plaid", "metrics": str(results / "metrics.json"), "log": str(log),
            **evaluation_figures(read_json(results / "metrics.json"), read_json(probe))}


def gpu_tests(out: Path, limit_s: float | None, on_start: Callable[[int], None] | None = None) -> dict[str, Any]:
    junit, files = out / "gpu-tests.xml", gpu_test_files()
    log = run_step("gpu-tests", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                 f"--junitxml={junit}", *files], out, limit_s, on_start)
    return {"step": "gpu-tests", "selection": "pytest -m gpu", "files": files, "log": str(log), **junit_counts(junit)}


SECTIONS = {"train": "training", "evaluate": "evaluation", "reference": "cpu_reference"}


def run_plan(plan: Plan, budget: Budget, out: Path, report: dict[str, Any], save: Callable[[], None],
             elapsed: Callable[[], float]) -> None:
    """The kept steps in order, each recorded in ``report`` and saved as it starts and as it finishes; a step whose
    estimate no longer fits in what is left of the budget is left out. Raises what stops the check (:class:`StepFailed`,
    :class:`Interrupted`) after recording the step it stopped."""
    work = out / "work"
    # A reused index would make documents/s the speed of reading it; given exports may lie under work/train.
    for stale in [work / "eval", *work.glob("indexes-*"), *([work / "train"] if not plan.exports else [])]:
        shutil.rmtree(stale, ignore_errors=True)
    for step, estimate in budget.kept:
        if plan.budget_s is not None and elapsed() + estimate > plan.budget_s:
            report["budget"]["left_out"].append({
                "step": step.name, "estimate_s": round(estimate, 1), "reason": f"at {elapsed():.0f} s the steps "
                f"before it had run past their estimates; {plan.budget_s - elapsed():.0f} s of the budget left"})
            save()
            continue
        limit = plan.step_limit_factor * estimate + LIMIT_SLACK_S if plan.step_limit_factor else None
        entry = {"step": step.name, "kind": step.kind, "status": "running", "estimate_s": round(estimate, 1),
                 "limit_s": None if limit is None else round(limit, 1)}
        report["steps"].append(entry)

        def running(pid: int) -> None:  # a check killed from now on says which step, in which process, it was in
            entry["pid"] = pid
            save()

        started = time.monotonic()
        try:
            if step.kind == "tests":
                figures = gpu_tests(out, limit, running)
            elif step.kind == "train":
                figures = train(plan, step, out, work, limit, running)
            else:
                figures = evaluate(plan, step, out, work, limit, running)
        except StepFailed as error:
            entry.update(status="timed out" if error.timed_out else "failed")
            raise
        except (KeyError, OSError, ValueError) as error:  # it did not start, or left no whole figures
            entry.update(status="failed")
            raise StepFailed(step.name, 0, out / f"{step.name}.log", f"no figures from it ({error!r})") from error
        except Interrupted:
            entry.update(status="interrupted")
            raise
        finally:
            entry["seconds"] = round(time.monotonic() - started, 2)
        figures["seconds"] = entry["seconds"]
        entry["status"] = "done"
        if step.kind == "tests":
            report["gpu_tests"] = figures
        else:
            report[SECTIONS[step.kind]].append(figures)
        save()


def print_table(path: str) -> int:
    """``--table PATH``: the table of an existing (possibly partial) gpu-check.json; exit 2 when it is not one."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(record, dict) or not {"status", "plan", "training", "evaluation"} <= set(record):
            raise ValueError("not a gpu-check.json (no status, plan, training, evaluation)")
    except (OSError, ValueError) as error:
        print(f"gpu-check: error: --table {path}: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    print(format_summary(record))
    return 0


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = build_parser().parse_args(argv)
    if args.table is not None:
        return print_table(args.table)
    import torch  # after parsing: --help and --table stay fast

    try:
        cuda_devices = torch.cuda.device_count()
        plan = plan_from(args, max(cuda_devices, 1) if args.plan_only else cuda_devices)
    except ValueError as error:
        print(f"gpu-check: error: {error}", file=sys.stderr)
        return 2
    out = Path(plan.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu-check.json"
    from hil.provenance import provenance, write_json_atomic

    report: dict[str, Any] = {"status": "running", "dry_run": plan.dry_run, "plan": asdict(plan), "environment": None,
                              "estimates": None, "budget": None, "steps": [], "elapsed_s": 0.0, "gpu_tests": None,
                              "training": [], "evaluation": [], "cpu_reference": []}
    base = provenance(None)

    def save() -> None:
        report["elapsed_s"] = round(time.monotonic() - started, 1)
        write_json_atomic(path, {**base, **report})

    failure: Exception | None = None
    with signals_interrupt():
        try:
            earlier = read_earlier(path)
            if not args.plan_only:
                save()  # from now on the JSON is this check's, whatever stops it
            budget = plan_steps(plan, read_environment(out, cuda_devices), earlier, report)
            print(format_plan(report), flush=True)
            if args.plan_only:
                return 0
            save()
            run_plan(plan, budget, out, report, save, lambda: time.monotonic() - started)
            report["status"] = "ok"
        except StepFailed as error:
            failure = error
            report.update(status="failed", failed_step=error.step, failed_log=str(error.log), failure=str(error))
        except Interrupted as error:
            failure = error
            running = [s["step"] for s in report["steps"] if s["status"] == "interrupted"]
            report.update(status="interrupted", interrupted_by=signal.Signals(error.signum).name,
                          interrupted_step=running[0] if running else None)
        save()
        if report["environment"] is not None:
            print(format_summary({**base, **report}))
        print(f"wrote {path}")
    if isinstance(failure, Interrupted):
        where = f" during step {report['interrupted_step']}" if report["interrupted_step"] else ""
        print(f"gpu-check: {failure}{where}", file=sys.stderr)
        return 128 + failure.signum
    if failure is not None:
        print(f"gpu-check: {failure}", file=sys.stderr)
        return 1
    return 0


def plan_steps(plan: Plan, environment: dict[str, Any], earlier: dict[str, Any] | None,
               report: dict[str, Any]) -> Budget:
    """The steps kept within the budget, estimated at the rates of the table or of ``earlier``; the machine, the
    estimates and the budget go into ``report``."""
    rates, source = estimates_for(plan, environment, earlier)
    steps = candidate_steps(plan)
    budget = budget_plan(steps, {s.name: estimate_s(s, plan, rates) for s in steps}, plan.budget_s,
                         rates.overhead_s)
    report.update(environment=environment, estimates={**asdict(rates), "note": source},
                  budget={"budget_s": budget.budget_s, "estimate_s": round(budget.estimate_s, 1),
                          "kept": [{"step": s.name, "estimate_s": round(e, 1)} for s, e in budget.kept],
                          "left_out": list(budget.left_out)})
    return budget


def read_environment(out: Path, cuda_devices: int) -> dict[str, Any]:
    """The machine (``gpu_check_report.environment``): in a subprocess where there is a GPU, so that its CUDA context
    ends with it and this process holds none while the steps run; in this process where there is none."""
    if cuda_devices == 0:
        from gpu_check_report import environment

        return environment()
    return environment_in_subprocess(out)


def environment_in_subprocess(out: Path) -> dict[str, Any]:
    target = out / "environment.json"
    run_step("environment", [sys.executable, str(BENCH / "gpu_check_report.py"), str(target)], out, limit_s=300)
    return read_json(target)


if __name__ == "__main__":
    sys.exit(main())
