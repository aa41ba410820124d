"""What the paper report shows, computed from the files a :mod:`hil.experiments.paper` run left.

``summarize(out, load_results(out), profile)`` reads ``eval/<dataset>/<model>.json`` and ``train/<variant>/train.json``
and returns one
record (written as ``summary.json``): bootstrap intervals and paired tests against ColBERT per dataset, the
numbers of 001's Tables 2, 3 and 5 and of the per-module table, timings, dataset notes and the machine. The report
(:mod:`hil.experiments.report`) only renders it, so ``--report-only`` never touches a model.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from hil.data.beir import BeirDataset, load_beir
from hil.errors import MissingInputError
from hil.evaluation.evaluate import Evaluation, evaluate_run_file, subset_with_first_stage
from hil.evaluation.statistics import (
    SIGNIFICANCE_LEVEL,
    add_adjusted,
    bootstrap_ci,
    paired_permutation_test,
    paired_t_test,
)
from hil.experiments.diagnostics import length_table, query_lengths
from hil.experiments.profiles import DATASETS, ENSEMBLES, FIRST_STAGES, RERANKING_SETS, VARIANTS, ZERO_SHOT, Profile
from hil.paths import DATA_DIR_ENV, resolve_dataset
from hil.provenance import git_commit, provenance, versions

METRIC = "ndcg@10"
DIAGNOSTIC_ROWS = ("hil_detach_h", "hil_fixed_temperature", "hil_attend_mask", "hil_no_clip", "hil_torch_init",
                   "colbert_attend_mask")
MAIN_ROWS = ("bm25", "colbert", "cosreg", "istar", "iso", "aniso", "lambda", "hil", "hil_corpus_idf", "hil_authors",
             "hil_authors_target_idf", *DIAGNOSTIC_ROWS)
LENGTH_ROWS = ("bm25", "colbert", "hil", "hil_authors", "hil_authors_target_idf", *DIAGNOSTIC_ROWS)
ABLATION_ROWS = ("hil_no_reg", "hil_no_reg_h", "hil_no_reg_l", "hil")
TABLE3_ROWS = ("colbert", "cosreg", "istar", "iso", "aniso", "lambda", "hil", "hil_corpus_idf")
MODULE_ROWS = ("lambda", "hil", "hil_corpus_idf", "hil_no_reg_l", "hil_no_reg_h", "hil_no_reg", "hil_authors",
               "hil_authors_target_idf", *DIAGNOSTIC_ROWS[:5])
DATASET_LABELS = {"scifact": "SciFact", "nfcorpus": "NFCorpus", **{k: s.label for k, s in RERANKING_SETS.items()}}
# The comparisons whose p-values are adjusted together (001 Table 2 marks ten variants against ColBERT per dataset).
SIGNIFICANCE_FAMILY = "every model (BM25 included) compared with ColBERT on one dataset"

Results = dict[str, dict[str, dict[str, Any]]]  # dataset key -> model name -> evaluation record


def require_local(key: str) -> None:
    """A re-ranking set is read locally with its run file, never from the hub: a :class:`MissingInputError` naming
    where it was looked for when its folder is not there."""
    _, where = DATASETS[key]
    first_stage = FIRST_STAGES.get(key)
    if first_stage is not None and resolve_dataset(where) is None:
        raise MissingInputError(f"{where}: not found under ${DATA_DIR_ENV} (a re-ranking set, read locally with its "
                                f"first-stage run {first_stage.run_file}; docs/guide.md, 'TREC DL 2019 and 2020': "
                                "where its official files come from)")


def load_dataset(key: str, profile: Profile) -> tuple[BeirDataset, Evaluation | None]:
    """A dataset of :data:`DATASETS`, sliced as the profile says, and for a re-ranking set its first stage
    (:data:`~hil.experiments.profiles.FIRST_STAGES`: the run file scored on the slice, its row named ``name``)."""
    _, where = DATASETS[key]
    first_stage = FIRST_STAGES.get(key)
    require_local(key)
    dataset = load_beir(where, judged_outside_corpus=first_stage.judged_outside_corpus if first_stage else "error",
                        relevance_level=first_stage.relevance_level if first_stage else 1)
    first = None if first_stage is None else evaluate_run_file(Path(dataset.source) / first_stage.run_file, dataset,
                                                                name=first_stage.name)
    n_queries, n_docs = profile.slices.get(key, (None, None))
    dataset, first, _ = subset_with_first_stage(dataset, first, n_queries, n_docs, profile.seed, profile.rerank_depth)
    return dataset, first


def dataset_column(key: str, rerank_depth: int) -> str:
    """A dataset's column heading: for a re-ranking set, what is re-ranked and how it is judged."""
    first_stage = FIRST_STAGES.get(key)
    if first_stage is None or DATASETS[key][0] != "rerank":
        return DATASET_LABELS[key]
    return f"{DATASET_LABELS[key]}, re-ranking {first_stage.label} top {rerank_depth}, graded qrels"


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "gpu": gpu,
            "platform": platform.platform(), "python": platform.python_version(), "commit": git_commit()}


# Files of the runner's dataset folders that are not a column's record.
NOT_COLUMNS = ("metrics.json", "per_query.json")


def load_results(out: Path) -> Results:
    """Every finished evaluation of a run (each column's ``<name>.json`` under ``eval/<dataset>/``)."""
    results: Results = {}
    for key in DATASETS:
        folder = out / "eval" / key
        if folder.is_dir():
            results[key] = {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))
                            if path.name not in NOT_COLUMNS}
    return results


def dataset_name(record: dict[str, Any]) -> str | None:
    """The dataset a column's record measured: the runner records the dataset (a mapping with its name), older
    records its name."""
    dataset = record.get("dataset")
    return dataset.get("name") if isinstance(dataset, dict) else dataset


def delta_inter_iso(inter_iso: dict[str, float]) -> float | None:
    """Anisotropic minus isotropic module (H - L, aniso - iso); None for a one-module model."""
    for iso, aniso in (("L", "H"), ("iso", "aniso")):
        if iso in inter_iso and aniso in inter_iso:
            return inter_iso[aniso] - inter_iso[iso]
    return None


def compute_statistics(results: Results, profile: Profile) -> dict[str, Any]:
    """Bootstrap intervals of every model, paired tests of every model against ColBERT, per dataset.

    Beside each raw p-value (``p_t_vs_colbert``, ``p_perm_vs_colbert``) its ``..._adjusted`` value: adjusted by
    ``profile.p_adjust`` (Holm by default) over :data:`SIGNIFICANCE_FAMILY`, each test on its own.
    """
    stats: dict[str, Any] = {}
    for key, models in results.items():
        reference = models.get("colbert")
        base = {q: m[METRIC] for q, m in reference["per_query"].items()} if reference else None
        rows: dict[str, Any] = {}
        for name, record in models.items():
            per_query = {q: m[METRIC] for q, m in record["per_query"].items()}
            boot = bootstrap_ci(per_query, n_samples=profile.n_bootstrap, seed=profile.seed)
            row: dict[str, Any] = {"mean": boot.observed, "low": boot.low, "high": boot.high, "n": len(per_query)}
            if base is not None and name != "colbert":
                t = paired_t_test(per_query, base, on="intersection")
                perm = paired_permutation_test(per_query, base, n_permutations=profile.n_permutations,
                                               seed=profile.seed, on="intersection")
                row.update(diff_vs_colbert=t.mean_diff, p_t_vs_colbert=t.p_value, p_perm_vs_colbert=perm.p_value)
            rows[name] = row
        add_adjusted(list(rows.values()), ("p_t_vs_colbert", "p_perm_vs_colbert"), lambda row: key, profile.p_adjust)
        stats[key] = rows
    return stats


def significance(profile: Profile) -> dict[str, Any]:
    """How the report marks significance: the test, its threshold, the adjustment and its family."""
    return {"test": "paired t-test against ColBERT", "level": SIGNIFICANCE_LEVEL, "p_adjust": profile.p_adjust,
            "family": SIGNIFICANCE_FAMILY}


def average(stats: dict[str, Any], name: str, keys: Sequence[str]) -> float | None:
    """A model's mean over datasets; None unless it has every one of them."""
    values = [stats[k][name]["mean"] for k in keys if k in stats and name in stats[k]]
    return float(np.mean(values)) if len(values) == len(keys) and values else None


def inter_iso_by_head(results: Results, name: str, keys: Sequence[str]) -> dict[str, float]:
    """Each head's InterIso averaged over the datasets ``keys``."""
    per_head: dict[str, list[float]] = {}
    for key in keys:
        for head, value in (results.get(key, {}).get(name) or {}).get("inter_iso", {}).items():
            per_head.setdefault(head, []).append(value)
    return {head: float(np.mean(values)) for head, values in per_head.items()}


def _present(results: Results, name: str) -> bool:
    return any(name in models for models in results.values())


def table2(results: Results, stats: dict[str, Any]) -> dict[str, Any]:
    """001 Table 2: each model's nDCG@10 per dataset and its average over the zero-shot ones."""
    keys = [k for k in ZERO_SHOT if k in stats]
    every = keys + [k for k in DATASETS if k in stats and k not in ZERO_SHOT]
    return {name: {"avg": average(stats, name, keys), **{k: stats[k].get(name, {}).get("mean") for k in every}}
            for name in MAIN_ROWS if _present(results, name)}


def table3(results: Results, stats: dict[str, Any]) -> dict[str, Any]:
    """001 Table 3: each module's InterIso (zero-shot average) and Delta InterIso, beside nDCG@10."""
    keys = [k for k in ZERO_SHOT if k in results]
    rows = {}
    for name in TABLE3_ROWS:
        if _present(results, name):
            iso = inter_iso_by_head(results, name, keys)
            rows[name] = {"inter_iso": iso, "delta_inter_iso": delta_inter_iso(iso),
                          "beir_avg": average(stats, name, keys),
                          "dl19": stats.get("dl19", {}).get(name, {}).get("mean")}
    return rows


def table5(results: Results, stats: dict[str, Any]) -> dict[str, Any]:
    """001 Table 5: the HIL ablations' in-domain score, zero-shot average and Delta InterIso."""
    keys = [k for k in ZERO_SHOT if k in results]
    return {name: {"dl19": stats.get("dl19", {}).get(name, {}).get("mean"), "beir": average(stats, name, keys),
                   "delta": delta_inter_iso(inter_iso_by_head(results, name, keys))}
            for name in ABLATION_ROWS if _present(results, name)}


def modules(results: Results) -> dict[str, Any]:
    """nDCG@10 of each module of the two-module models on its own, beside their sum (what the model ranks by)."""
    rows: dict[str, Any] = {}
    for name in MODULE_ROWS:
        for key in (k for k in DATASETS if k in results):
            record = results[key].get(name) or {}
            parts = record.get("module_metrics")
            if name == "lambda" and record:  # the members are the iso and aniso rows
                parts = {head: results[key].get(member, {}).get("metrics", {})
                         for head, member in zip(("iso", "aniso"), ENSEMBLES[name][:2])}
            if parts:
                (iso_head, iso), (aniso_head, aniso) = parts.items()
                rows.setdefault(name, {})[key] = {iso_head: iso.get(METRIC), aniso_head: aniso.get(METRIC),
                                                  "sum": record["metrics"][METRIC]}
    return rows


def other_data(results: Results, names: dict[str, str]) -> list[str]:
    """``<key>/<model> (<dataset>)`` for each evaluation that measured another dataset than ``names[key]`` (the
    deprecated DL19 pool, for one): a report must not show it under the current dataset's heading."""
    return [f"{key}/{model} ({dataset_name(record)})" for key, models in results.items()
            for model, record in models.items() if key in names and dataset_name(record) not in (None, names[key])]


def lengths_by_dataset(results: Results, profile: Profile) -> dict[str, dict[str, int]]:
    """Each evaluated zero-shot dataset's query lengths in the profile backbone's word pieces (for the
    by-query-length table); a dataset or tokenizer that cannot be loaded is left out."""
    from transformers import AutoTokenizer

    from hil.paths import resolve_model

    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(profile.training.backbone))
    except OSError:
        return {}
    lengths = {}
    for key in (k for k in ZERO_SHOT if k in results):
        try:
            dataset, _ = load_dataset(key, profile)
        except (OSError, ValueError):
            continue
        lengths[key] = query_lengths(dataset, tokenizer)
    return lengths


def judgments(key: str, profile: Profile) -> str | None:
    """A sentence on how informative a dataset's judgments are (grades used, share of the corpus judged relevant)."""
    try:
        dataset, _ = load_dataset(key, profile)
    except (OSError, ValueError):
        return None
    grades = sorted({g for judged in dataset.qrels.values() for g in judged.values()})
    level = dataset.relevance_level
    relevant = {d for judged in dataset.qrels.values() for d, g in judged.items() if g >= level and d in dataset.corpus}
    share = len(relevant) / max(1, len(dataset.corpus))
    text = (f"{DATASET_LABELS[key]}: {len(dataset.queries)} queries, {len(dataset.corpus)} documents, relevance "
            f"grades used {grades}, {100 * share:.0f}% of the documents judged relevant (grade >= {level}) to some "
            "query")
    if dataset.judged_outside_corpus:
        text += (f", and {dataset.judged_outside_corpus} judgments of documents outside the corpus, kept: they count "
                 "in the ideal DCG (as trec_eval counts them), so nDCG@10 is comparable with published figures")
    if share > 0.5 and len([g for g in grades if g > 0]) == 1:
        text += (" (nearly every document is relevant to some query, with one grade: re-ranking there is mostly "
                 "telling topics apart, so expect every model near the ceiling)")
    return text


def summarize(out: Path, results: Results, profile: Profile, *, command: str = "",
              elapsed_s: float | None = None) -> dict[str, Any]:
    """Every number of the report, from the run's evaluations (``load_results``) and training records."""
    if not results:
        raise FileNotFoundError(f"{out}: no evaluations found (run the experiment first)")
    stats = compute_statistics(results, profile)
    training = {name: json.loads((out / "train" / name / "train.json").read_text()) for name in VARIANTS
                if (out / "train" / name / "train.json").is_file()}
    timings = {key: {name: record["timings"] for name, record in models.items() if record.get("timings")}
               for key, models in results.items()}
    sizes = {key: {"queries": max(len(m["per_query"]) for m in models.values()),
                   "documents": max((m.get("n_docs") or 0 for m in models.values()), default=0)}
             for key, models in results.items()}
    return provenance(profile.budget(), command=command, machine=machine(), versions=versions(),
                      elapsed_s=elapsed_s, statistics=stats, significance=significance(profile),
                      table2=table2(results, stats),
                      table3=table3(results, stats), table5=table5(results, stats), modules=modules(results),
                      training=training, timings=timings, sizes=sizes,
                      by_query_length=length_table(results, lengths_by_dataset(results, profile), LENGTH_ROWS),
                      judgments=[note for note in (judgments(k, profile) for k in results) if note])
