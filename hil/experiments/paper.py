"""Reproduce HIL (001) Tables 2, 3 and 5 and Figures 2, 3 and 5 at a chosen scale, in one resumable command.

    hil paper --profile cpu          # about two hours on 2 CPU cores
    hil paper --profile smoke        # minutes; the test suite runs it
    hil paper --profile paper        # 001's settings, for a GPU

Stages, each skipped when its output already exists (a rerun resumes; ``--force`` redoes everything):

1. train every variant of :data:`~hil.experiments.profiles.VARIANTS` with ``train.py``'s CLI in a subprocess,
   same budget for all (:class:`~hil.experiments.profiles.Profile`), exported to ``train/<variant>/export``;
   the export is written under a temporary name and renamed when training succeeded, so a killed run retrains
   that variant from the start;
2. evaluate every model on every dataset, as one experiment of the runner (:func:`paper_experiment`,
   :mod:`hil.evaluation.runner`: a column is kept when its recorded identity is today's, recomputed otherwise):
   BM25 (on TREC DL19 and DL20 the official BM25 run, ``bm25-top100.trec``, scored as given: nDCG@10 0.5058 on
   the whole of DL19); exact late interaction of every query against every document (``full``: the top ``k`` of
   the whole corpus, i.e. full ranking without first-stage approximation; ``rerank``: that run's top
   ``rerank_depth`` re-scored, TREC DL: :data:`~hil.experiments.profiles.RERANKING_SETS`; DL20 only when its
   folder is laid out, or when named); what only the paper measures is added to each column by
   :class:`~hil.experiments.paper_columns.PaperColumns`: each head's score matrix (ColBERT-lambda is the sum of
   its trained members' matrices, no re-encoding; Fig. 3 counts the documents each head puts in its own top
   ``overlap_depth``), InterIso of each head over (query, most relevant document) pairs (Table 3), figure data;
3. write ``report.md`` (tables with bootstrap intervals and paired tests against ColBERT), ``summary.json`` and
   the figures under ``results/<profile>/``.

Choices where 001 is vague: "ColBERT-cosreg" and "ColBERT-istar" are the isotropic settings of 001 A.3 (lambda
0.2): both methods were proposed to make embeddings isotropic. Delta InterIso is InterIso(anisotropic module) -
InterIso(isotropic module): H - L for ColBERT-HIL and its ablations, aniso - iso for ColBERT-lambda; one-module
models have no Delta and their own InterIso is shown instead. InterIso is measured on each query paired with its
most relevant judged document (highest grade, then smallest id), so every model is measured on the same pairs.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from hil.errors import UserError
from hil.evaluation.evaluate import EvaluationSettings
from hil.evaluation.runner import DatasetSpec, Experiment, ModelSpec, StatisticsSettings, run_experiment
from hil.experiments.paper_columns import ExperimentError, PaperColumns, head_overlap, log, relevant_pairs
from hil.experiments.paper_settings import PaperSettings
from hil.experiments.profiles import (
    CORPUS_IDF,
    DATASETS,
    DEFAULT_VARIANTS,
    ENSEMBLES,
    FIRST_STAGES,
    VARIANTS,
    Profile,
    default_datasets,
)
from hil.experiments.records import load_dataset, load_results, other_data, require_local, summarize
from hil.experiments.report import write_report
from hil.experiments.seed_report import seed_folder, write_seed_report
from hil.modeling.encoder import CONFIG_NAME
from hil.paths import DATA_DIR_ENV
from hil.provenance import provenance, write_json_atomic

# Re-exported: the paper's own measurements live in hil.experiments.paper_columns.
__all__ = ["ExperimentError", "PaperColumns", "head_overlap", "paper_experiment", "relevant_pairs", "run_profile"]

# -- training ------------------------------------------------------------------------------------------------

def train_variant(name: str, profile: Profile, out: Path, force: bool = False) -> Path:
    """Train ``name`` under ``profile`` (skipped when its export exists). -> the export folder."""
    workdir = out / "train" / name
    export = workdir / "export"
    partial = workdir / "export.partial"
    command = [sys.executable, "-m", "hil", "fit",
               *profile.config_args(name), "--trainer.default_root_dir", str(workdir), "--export_dir", str(partial)]
    budget = {"variant": VARIANTS[name][0] or "colbert", **asdict(profile.training)}
    if (export / CONFIG_NAME).is_file() and not force:
        recorded = trained_with(workdir)
        if recorded == budget:
            log(f"train {name}: done before, skipped")
            return export
        changed = sorted(k for k in budget if (recorded or {}).get(k) != budget[k]) if recorded else ["no record"]
        log(f"train {name}: trained before with other settings ({', '.join(changed)}), trained again")
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    log(f"train {name}: {budget['max_steps']} steps x {budget['batch_size']} triples, seed {budget['seed']} "
        f"(log: {workdir / 'train.log'})")
    started = time.perf_counter()
    with open(workdir / "train.log", "w") as stream:
        completed = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT,
                                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    seconds = time.perf_counter() - started
    if completed.returncode != 0 or not (partial / CONFIG_NAME).is_file():
        tail = (workdir / "train.log").read_text(errors="replace").strip().splitlines()[-3:]
        raise ExperimentError(f"training {name} failed (exit {completed.returncode}); see {workdir / 'train.log'}: "
                              + " | ".join(tail))
    partial.rename(export)
    write_json_atomic(workdir / "train.json", {
        "variant": name, "config": VARIANTS[name][0] or "colbert", "command": command[3:], "budget": budget,
        "seconds": seconds,
        "peak_rss_mb_children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024})
    log(f"train {name}: {seconds:.0f} s")
    return export


def trained_with(workdir: Path) -> dict[str, Any] | None:
    """The budget ``train.json`` records for an earlier training in ``workdir`` (None: no record), so that a rerun
    retrains a variant whose budget (seed, steps, backbone, ...) changed instead of keeping it."""
    try:
        return json.loads((workdir / "train.json").read_text())["budget"]
    except (OSError, ValueError, KeyError):
        return None


# -- evaluation ----------------------------------------------------------------------------------------------

def paper_experiment(profile: Profile, out: Path, exports: dict[str, Path], datasets: list[str], *,
                     force: bool = False, command: str = "") -> Experiment:
    """Stage 2 as an experiment of the runner: every dataset (sliced as the profile says; a re-ranking set with its
    given first stage), every trained variant and each ``CORPUS_IDF`` variant, scored exhaustively with each head's
    matrix kept; statistics are the report's own (against ColBERT, :mod:`hil.experiments.records`)."""
    specs = []
    for key in datasets:
        where = DATASETS[key][1]
        require_local(key)
        first = FIRST_STAGES.get(key)
        n_queries, n_docs = profile.slices.get(key, (None, None))
        specs.append(DatasetSpec(where, key=key, max_queries=n_queries, max_docs=n_docs,
                                 rerank_depth=profile.rerank_depth,
                                 first_stage_run=first.run_file if first else None,
                                 first_stage_name=first.name if first else None,
                                 relevance_level=first.relevance_level if first else None))
    seed = profile.training.seed
    models = [ModelSpec(str(export), name=name, seed=seed) for name, export in exports.items()]
    if profile.corpus_idf:
        models += [ModelSpec(str(exports[base]), name=name, idf="corpus", seed=seed)
                   for name, (base, _) in CORPUS_IDF.items() if base in exports]
    settings = EvaluationSettings(mode="exhaustive", k=profile.k, index_root=None, keep_head_scores=True,
                                  rerank_depth=profile.rerank_depth, batch_size=profile.encode_batch_size,
                                  progress=False, device=profile.device, precision=profile.precision)
    return Experiment(specs, models, out / "eval", settings=settings, statistics=StatisticsSettings(enabled=False),
                      seed=profile.seed, resume=not force,
                      command={"command": command, "profile": profile.name})


def run_profile(profile: Profile, out: Path, *, variants: list[str] | None = None,
                datasets: list[str] | None = None, force: bool = False, command: str = "") -> Path:
    """Every stage for ``profile`` into ``out``; returns the report path."""
    variants = variants or list(DEFAULT_VARIANTS)
    if not datasets:
        datasets, absent = default_datasets()
        for key in absent:  # e.g. TREC DL20, which is not in ../shared: evaluated once its folder is laid out
            log(f"{key}: {DATASETS[key][1]} not found under ${DATA_DIR_ENV}, left out "
                f"(docs/guide.md, 'TREC DL 2019 and 2020')")
    unknown = sorted(set(variants) - set(VARIANTS)) + sorted(set(datasets) - set(DATASETS))
    if unknown:
        raise ExperimentError(f"unknown variant or dataset {unknown}; variants {list(VARIANTS)}, "
                              f"datasets {list(DATASETS)}")
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    write_json_atomic(out / "profile.json", provenance(profile.budget(), command=command))
    exports = {name: train_variant(name, profile, out, force) for name in variants}
    ensembles = {name: (iso, aniso) for name, (iso, aniso, _) in ENSEMBLES.items()
                 if iso in exports and aniso in exports}
    experiment = paper_experiment(profile, out, exports, datasets, force=force, command=command)
    run_experiment(experiment, hooks=PaperColumns(profile, figures_on=datasets[0], ensembles=ensembles))
    report = write_outputs(out, profile, command=command, elapsed_s=time.perf_counter() - started)
    log(f"report: {report}")
    return report


def run_seeds(profile: Profile, out: Path, seeds: list[int], *, variants: list[str] | None = None,
              datasets: list[str] | None = None, force: bool = False, command: str = "") -> Path:
    """The whole experiment once per training seed into ``out/seed-<s>/``, then ``seeds.md`` / ``seeds.json``
    (:mod:`hil.experiments.seed_report`); returns the seed report's path."""
    for seed in seeds:
        log(f"seed {seed}: {seed_folder(out, seed)}")
        run_profile(replace(profile, train_seed=seed), seed_folder(out, seed), variants=variants, datasets=datasets,
                    force=force, command=command)
    report = write_seed_report(out, profile, seeds, command=command)
    log(f"seed report: {report}")
    return report


def write_outputs(out: Path, profile: Profile, *, command: str = "", elapsed_s: float | None = None) -> Path:
    """``summary.json`` (every number, :func:`hil.experiments.records.summarize`) and ``report.md`` (rendered from
    it, with the figures) from the files the run left. -> the report path."""
    results = load_results(out)
    names = {}
    for key in results:
        try:
            names[key] = load_dataset(key, profile)[0].name
        except (OSError, ValueError):
            continue
    stale = other_data(results, names)
    if stale:
        raise ExperimentError(f"{out}: {len(stale)} evaluations measured other data than today's datasets "
                              f"({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}); rerun the experiment, "
                              "which redoes them")
    summary = summarize(out, results, profile, command=command, elapsed_s=elapsed_s)
    report = write_report(out, profile, summary, results)
    write_json_atomic(out / "summary.json", summary)
    return report


def publish(out: Path, target: Path) -> Path:
    """Copy what a reader of the report needs (small files) from ``out`` to ``target``; returns the copied report."""
    if not (out / "report.md").is_file():
        raise ExperimentError(f"{out}: no report.md to publish (run the experiment first)")
    if target.exists():
        shutil.rmtree(target)
    for pattern in ("report.md", "summary.json", "profile.json", "figures/*.png", "eval/*/*.json",
                    "train/*/train.json"):
        for path in sorted(out.glob(pattern)):
            destination = target / path.relative_to(out)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, destination)
    return target / "report.md"


def publish_seeds(out: Path, seeds: list[int], target: Path) -> Path:
    """:func:`publish` for a run over seeds: ``seeds.md`` / ``seeds.json`` and each seed's published files."""
    if not (out / "seeds.md").is_file():
        raise ExperimentError(f"{out}: no seeds.md to publish (run the experiment first)")
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for name in ("seeds.md", "seeds.json"):
        shutil.copy2(out / name, target / name)
    for seed in seeds:
        publish(seed_folder(out, seed), seed_folder(target, seed))
    return target / "seeds.md"


def run_paper(settings: PaperSettings, command: str = "") -> Path:
    """The run ``settings`` describe (``hil paper``): the experiment (once per seed with ``seeds``), or only its
    report; then published when asked. -> the report written."""
    from hil.retrieval.devices import check_precision, resolve_device

    profile, out = settings.profile_settings(), settings.output_folder()
    try:
        check_precision(profile.precision, resolve_device(profile.device))
    except ValueError as error:
        raise UserError(f"`device` / `precision`: {error}") from None
    variants, datasets, seeds = settings.variant_names(), settings.dataset_names(), settings.seed_list()
    if seeds is not None:
        if settings.report_only:
            report = write_seed_report(out, profile, seeds, command=command)
        else:
            report = run_seeds(profile, out, seeds, variants=variants, datasets=datasets, force=settings.force,
                               command=command)
        if settings.publish:
            log(f"published {publish_seeds(out, seeds, Path(settings.publish))}")
        return report
    if settings.report_only:
        recorded = out / "profile.json"  # the command that ran the experiment, not this rewrite
        if recorded.is_file():
            command = json.loads(recorded.read_text()).get("command") or command
        report = write_outputs(out, profile, command=command)
    else:
        report = run_profile(profile, out, variants=variants, datasets=datasets, force=settings.force,
                             command=command)
    if settings.publish:
        log(f"published {publish(out, Path(settings.publish))}")
    return report
