"""What ``bench/gpu_check.py`` runs, in which order, and how long each step should take (issue 29, item 4).

**Steps, in priority order** (:func:`candidate_steps`; M models, P training precisions, D datasets, the first of
each is what matters most):

1. for each model: train it in the first precision, evaluate its export on the first dataset on the GPU, and, for
   the first model, the CPU reference of that evaluation (``--device cpu --precision fp32``; a CPU reference is
   kept only with the GPU evaluation it is the reference of);
2. the other precisions' trainings (training throughput is the figure; their exports rank the same);
3. the first precision's exports on the other datasets;
4. the other precisions' exports on every dataset;
5. the other CPU references (every model's first-precision export on every dataset);
6. ``pytest -m gpu`` (the GPU tests; their own command, last because no figure depends on them).

With ``--exports`` the given exports take the place of the trained ones (no training steps).

**The budget** (:func:`budget_plan`): in that order, a step is kept when the steps kept before it, the check's own
overhead and its estimate fit in the budget, and when the training it evaluates was kept; the others are left out,
each with its reason. While the check runs, a step whose estimate no longer fits in what is left of the budget
(the steps before it ran long) is left out too.

**The cost model** (:class:`Rates`, :func:`estimate_s`): a step takes its process's start-up plus its work at a
measured rate: training ``max_steps x batch`` triples per device at ``train`` triples/s per device (DDP on N devices
moves N times the triples in the same time); an evaluation ``documents / index`` plus ``queries / search`` seconds;
the GPU tests a fixed time. :data:`H200_TABLE` holds the rates the issue measured on one H200 (MiniLM-L6, SciFact
test, batch 32); :func:`refine` replaces them by the figures of an earlier ``gpu-check.json`` of the same kind of
run on the same GPU.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hil.paths import resolve_dataset

KINDS = ("tests", "train", "evaluate", "reference")

# BEIR test splits (documents, queries with judgements), as the shared copies hold them.
DATASET_SIZES = {"scifact": (5183, 300), "nfcorpus": (3633, 323)}


@dataclass(frozen=True)
class GivenExport:
    """An export given with ``--exports``: its label (the folder's name), path, and model and training precision
    as its records say (``unknown`` where they do not)."""
    label: str
    path: str
    model: str
    precision: str
    precision_source: str


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
    strategy: str
    max_steps: int
    skip_steps: int
    batch_size: int
    lr: float
    eval_device: str
    eval_precision: str
    max_docs: int | None
    max_queries: int | None
    cpu_reference: bool
    budget_s: float | None
    step_limit_factor: float
    exports: tuple[GivenExport, ...] = ()


@dataclass(frozen=True)
class Step:
    """One step: ``kind`` (:data:`KINDS`; ``reference`` is the CPU fp32 evaluation), the export it trains or
    evaluates (``label``: ``<model>-<precision>`` for one this check trains, the folder's name for a given one),
    and for evaluations the dataset, device and precision. ``needs``: the training step whose export it evaluates."""
    kind: str
    label: str = ""
    model: str = ""
    precision: str = ""
    dataset: str = ""
    device: str = ""
    eval_precision: str = ""
    export: str = ""
    needs: str = ""

    @property
    def name(self) -> str:
        if self.kind == "tests":
            return "gpu-tests"
        if self.kind == "train":
            return f"train-{self.label}"
        return f"evaluate-{self.label}-{self.dataset}-{self.device}-{self.eval_precision}"


@dataclass(frozen=True)
class Rates:
    """The cost model's constants: process start-up seconds by step kind; triples/s per device by ``"<model>
    <precision>"``; documents/s (the whole index build) and queries/s (query encoding and search) by ``"<model>
    <kind>"``; the GPU tests' and the check's own seconds. A key not listed takes ``"*"`` where given, else the
    slowest rate listed for its model, else the slowest of all (an estimate errs long)."""
    startup_s: dict[str, float]
    train: dict[str, float]
    index: dict[str, float]
    search: dict[str, float]
    tests_s: float
    overhead_s: float
    source: str
    measured: tuple[str, ...] = field(default=())

    def rate(self, family: str, model: str, key: str) -> float:
        """The ``family`` (``train``, ``index``, ``search``) rate of ``model`` for ``key`` (a precision or a kind)."""
        return rate_in(getattr(self, family), f"{model} {key}")


# SciFact test as the issue measured it: 5,183 documents, 300 queries.
_DOCS, _QUERIES = DATASET_SIZES["scifact"]
# The H200 table (issue 29; torch 2.11 + CUDA 13, faiss-cpu; MiniLM-L6, batch 32, SciFact test).
# Start-up: the 200-step check ran 450 s for 4 trainings, 3 GPU evaluations and part of a 4th. Their measured
# work is 6,400 triples at 301/257/281/269 triples/s (93 s) plus 35.0+3.84, 35.0+3.84, 55.5+9.2 s of index and
# search (142 s); the 150-215 s left over 8 process starts (Python imports, model and data loading, the DDP group,
# the export) is 19-27 s each: 25 s. The CPU (16 cores of the same machine) encodes 156 documents/s and searches
# in 4.9 s; HIL on the CPU was not measured: ColBERT's CPU rates times HIL's GPU slow-down (35.0/55.5, 3.84/9.2).
# The GPU tests' 60 s and the check's own 10 s (imports, the environment probe) are assumptions, not measured.
H200_TABLE = Rates(
    startup_s={"train": 25.0, "evaluate": 25.0, "reference": 25.0},
    train={"colbert 16-mixed": 301.0, "colbert bf16-mixed": 257.0, "colbert_hil 16-mixed": 281.0,
           "colbert_hil bf16-mixed": 269.0},
    index={"colbert evaluate": _DOCS / 35.0, "colbert_hil evaluate": _DOCS / 55.5,
           "colbert reference": 156.0, "colbert_hil reference": 156.0 * 35.0 / 55.5},
    search={"colbert evaluate": _QUERIES / 3.84, "colbert_hil evaluate": _QUERIES / 9.2,
            "colbert reference": _QUERIES / 4.9, "colbert_hil reference": _QUERIES / 4.9 * 3.84 / 9.2},
    tests_s=60.0, overhead_s=10.0, source="the H200 table of issue 29")
# ``--dry-run`` on the project's 2-core CPU (tiny BERT; training under DDP over 2 gloo processes takes 17-25 s, an
# evaluation of 64 documents 10-13 s, mostly start-up; ``pytest -m gpu`` with every test skipped ~20 s). Only
# what the dry run's own tests need: a finite estimate of the right shape.
DRY_RUN_TABLE = Rates(
    startup_s={"train": 18.0, "evaluate": 10.0, "reference": 10.0}, train={"*": 15.0},
    index={"*": 200.0}, search={"*": 20.0}, tests_s=25.0, overhead_s=4.0,
    source="dry runs on the project's 2-core CPU")


def dataset_size(name: str, max_docs: int | None, max_queries: int | None) -> tuple[int, int]:
    """(documents, queries) an evaluation of ``name`` searches: BEIR's test split, cut to the slices. A dataset not
    in :data:`DATASET_SIZES` is counted from its files under ``HIL_DATA_DIR``; ``ValueError`` when not there."""
    if name in DATASET_SIZES:
        documents, queries = DATASET_SIZES[name]
    else:
        folder = resolve_dataset(name)
        qrels = None if folder is None else folder / "qrels" / "test.tsv"
        if folder is None or not (folder / "corpus.jsonl").is_file() or not qrels.is_file():
            raise ValueError(f"--datasets {name}: its size is not known (not one of {sorted(DATASET_SIZES)}, nor "
                             f"a BEIR folder with corpus.jsonl and qrels/test.tsv under HIL_DATA_DIR)")
        with open(folder / "corpus.jsonl", "rb") as handle:
            documents = sum(1 for line in handle if line.strip())
        with open(qrels, encoding="utf-8") as handle:
            queries = len({line.split("\t")[0] for line in list(handle)[1:] if line.strip()})
    return (min(documents, max_docs or documents), min(queries, max_queries or queries))


def estimate_s(step: Step, plan: Plan, rates: Rates) -> float:
    """Seconds ``step`` should take (the module's cost model)."""
    if step.kind == "tests":
        return rates.tests_s
    if step.kind == "train":
        triples_per_device = plan.max_steps * plan.batch_size
        return rates.startup_s["train"] + triples_per_device / rates.rate("train", step.model, step.precision)
    documents, queries = dataset_size(step.dataset, plan.max_docs, plan.max_queries)
    return (rates.startup_s[step.kind] + documents / rates.rate("index", step.model, step.kind)
            + queries / rates.rate("search", step.model, step.kind))


def candidate_steps(plan: Plan) -> list[Step]:
    """Every step ``plan`` asks for, in priority order (the module's list)."""
    if plan.exports:
        first = [Step("train", e.label, e.model, e.precision, export=e.path) for e in plan.exports]
        rest: list[Step] = []
    else:
        trained = [[Step("train", f"{m}-{p}", m, p) for m in plan.models] for p in plan.precisions]
        first, rest = trained[0], [training for precision in trained[1:] for training in precision]

    def train(export: Step) -> list[Step]:
        return [export] if "train" in plan.steps and not plan.exports else []

    def on(export: Step, dataset: str, kind: str) -> list[Step]:
        """The evaluation of ``export`` on ``dataset`` on the GPU (``evaluate``) or the CPU (``reference``)."""
        if "evaluate" not in plan.steps or (kind == "reference" and not plan.cpu_reference):
            return []
        on_gpu = replace(export, kind="evaluate", dataset=dataset, device=plan.eval_device,
                         eval_precision=plan.eval_precision, needs="" if plan.exports else export.name)
        if kind == "evaluate":
            return [on_gpu]
        return [replace(on_gpu, kind=kind, device="cpu", eval_precision="fp32", needs=on_gpu.name)]

    head, others = plan.datasets[0], plan.datasets[1:]
    steps = []
    for index, export in enumerate(first):
        steps += train(export) + on(export, head, "evaluate") + (on(export, head, "reference") if index == 0 else [])
    for export in rest:
        steps += train(export)
    steps += [s for dataset in others for export in first for s in on(export, dataset, "evaluate")]
    steps += [s for export in rest for dataset in plan.datasets for s in on(export, dataset, "evaluate")]
    steps += [s for dataset in plan.datasets for i, export in enumerate(first) if (i, dataset) != (0, head)
              for s in on(export, dataset, "reference")]
    return steps + ([Step("tests")] if "tests" in plan.steps else [])


@dataclass(frozen=True)
class Budget:
    """The steps kept with their estimates, those left out with their reasons, and the kept steps' estimate (the
    check's overhead included)."""
    budget_s: float | None
    kept: tuple[tuple[Step, float], ...]
    left_out: tuple[dict[str, Any], ...]
    estimate_s: float


def budget_plan(steps: list[Step], estimates: dict[str, float], budget_s: float | None,
                overhead_s: float) -> Budget:
    """Keep ``steps`` in their order while their estimates fit in ``budget_s`` (None: no budget): a step that does
    not fit is left out and the next ones are still tried; an evaluation of a training left out is left out."""
    total, kept, left_out, kept_names = overhead_s, [], [], set()
    for step in steps:
        estimate = estimates[step.name]
        if step.needs and step.needs not in kept_names:
            reason = f"it needs {step.needs}, left out"
        elif budget_s is not None and total + estimate > budget_s:
            reason = f"estimate {estimate:.0f} s, {max(budget_s - total, 0):.0f} s of the {budget_s:.0f} s budget left"
        else:
            kept.append((step, estimate))
            kept_names.add(step.name)
            total += estimate
            continue
        left_out.append({"step": step.name, "estimate_s": round(estimate, 1), "reason": reason})
    return Budget(budget_s, tuple(kept), tuple(left_out), total)


def _geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def comparable(earlier: dict[str, Any], plan: Plan, gpus: list[str]) -> str | None:
    """Why ``earlier`` (a gpu-check.json) cannot refine ``plan``'s estimates, or None when it can: it must be of the
    same kind (dry run or not), with the same backbone and batch size, on the same GPUs."""
    earlier_plan, environment = earlier.get("plan") or {}, earlier.get("environment") or {}
    earlier_gpus = [g.get("name") for g in environment.get("gpus") or []]
    for what, then, now in (("dry run", earlier.get("dry_run"), plan.dry_run),
                            ("backbone", earlier_plan.get("backbone"), plan.backbone),
                            ("batch size", earlier_plan.get("batch_size"), plan.batch_size),
                            ("GPUs", earlier_gpus, gpus)):
        if then != now:
            return f"its {what} ({then}) differs from this run's ({now})"
    return None


def _rescaled(old: dict[str, float], found: dict[str, float], groups: tuple[str, ...]) -> dict[str, float]:
    """``old`` with the ``found`` rates, and every rate not found scaled by how the found ones of its group (keys
    ending in the group's word) moved from ``old``; ``"*"`` by how all of them moved."""
    def ratio(keys: list[str]) -> float:
        return _geometric_mean([found[key] / rate_in(old, key) for key in keys]) if keys else 1.0

    table = {}
    for key, rate in old.items():
        group = next((g for g in groups if key.endswith(g)), None)
        table[key] = rate * ratio([k for k in found if group is None or k.endswith(group)])
    return {**table, **found}


def rate_in(table: dict[str, float], key: str) -> float:
    """``table``'s rate for ``key`` (``"<model> <rest>"``): as listed, else ``"*"``, else the slowest of the same
    model, else the slowest of all."""
    if key in table:
        return table[key]
    if "*" in table:
        return table["*"]
    model = key.split(" ")[0]
    return min([rate for listed, rate in table.items() if listed.split(" ")[0] == model] or table.values())


def refine(rates: Rates, earlier: dict[str, Any]) -> Rates:
    """``rates`` with the figures an earlier check measured: per-device triples/s of each training, documents/s and
    queries/s of each evaluation, the GPU tests' seconds, and each kind's start-up as the longest of its steps'
    seconds less their work at the measured rates. A rate it did not measure is scaled by how the measured ones of
    its family moved (training; indexing and search by kind, ``evaluate`` or ``reference``; geometric mean of the
    ratios), so a check that got faster everywhere is not planned at yesterday's speed for what it did not run."""
    found: dict[str, dict[str, float]] = {"train": {}, "index": {}, "search": {}}
    startups: dict[str, list[float]] = {}
    for run in earlier.get("training") or []:
        per_device = run["triples_per_s"] / run["ranks"]
        found["train"][f"{run['model']} {run['precision']}"] = per_device
        if run.get("seconds") is not None:
            work = run["steps"] * run["batch_size_per_device"] / per_device
            startups.setdefault("train", []).append(run["seconds"] - work)
    for kind, runs in (("evaluate", earlier.get("evaluation") or []),
                       ("reference", earlier.get("cpu_reference") or [])):
        for run in runs:
            found["index"][f"{run['model']} {kind}"] = run["documents_per_s"]
            found["search"][f"{run['model']} {kind}"] = run["queries_per_s"]
            if run.get("seconds") is not None:
                startups.setdefault(kind, []).append(run["seconds"] - run["index_seconds"] - run["search_seconds"])
    tests = earlier.get("gpu_tests") or {}
    startup = {kind: max(max(values), 0.0) for kind, values in startups.items()}
    measured = ([f"{family} {key}" for family, rates_found in found.items() for key in sorted(rates_found)]
                + [f"startup {kind}" for kind in sorted(startup)] + (["tests"] if "seconds" in tests else []))
    return replace(rates, startup_s={**rates.startup_s, **startup},
                   train=_rescaled(rates.train, found["train"], ()),
                   index=_rescaled(rates.index, found["index"], ("evaluate", "reference")),
                   search=_rescaled(rates.search, found["search"], ("evaluate", "reference")),
                   tests_s=tests.get("seconds", rates.tests_s),
                   source=f"{rates.source}, refined from the check of {earlier.get('created', '?')}",
                   measured=tuple(measured))


def read_earlier(path: Path) -> dict[str, Any] | None:
    """An earlier check's JSON in the output folder, None when there is none that can be read."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def estimates_for(plan: Plan, environment: dict[str, Any], earlier: dict[str, Any] | None) -> tuple[Rates, str]:
    """The rates to plan with (the table, refined by an earlier comparable check) and a line saying which."""
    table = DRY_RUN_TABLE if plan.dry_run else H200_TABLE
    if earlier is None:
        return table, f"estimates from {table.source}"
    why_not = comparable(earlier, plan, [g["name"] for g in environment.get("gpus", [])])
    if why_not is not None:
        return table, f"estimates from {table.source} (the earlier gpu-check.json is not used: {why_not})"
    try:
        rates = refine(table, earlier)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        return table, f"estimates from {table.source} (the earlier gpu-check.json is not used: {error!r})"
    startups = [m.split(" ")[1] for m in rates.measured if m.startswith("startup ")]
    rated = len([m for m in rates.measured if not m.startswith(("startup ", "tests"))])
    return rates, (f"estimates from {rates.source} ({rated} rates, start-up of {', '.join(startups) or 'nothing'}"
                   f"{', the GPU tests' if 'tests' in rates.measured else ''} measured there)")
