"""What evaluations leave behind: statistics between runs, ``metrics.json`` / per-query / TREC files, printed tables.

``evaluation_statistics`` gives bootstrap intervals per run and paired tests between runs (``hil.evaluation.
statistics``) and the BM25-Easy split; ``write_results`` records them with the settings, versions and fingerprints
that made them (docs/design.md: settings travel with artifacts).

Results files are written whole and by one process at a time: every file goes through a temporary name and a rename
(:func:`hil.provenance.atomic_output`), ``metrics.json`` last, all under the folder's lock file
(:data:`RESULTS_LOCK`, :func:`hil.provenance.file_lock`), so two evaluations writing the same folder at once leave
complete files, never a mix within a file, and a killed writer leaves the previous files. Under that lock the
experiment runner reads the folder's ``metrics.json`` before writing it and keeps the other evaluation's columns
measured in the same context (:func:`other_columns`): two evaluations of different models into one folder, side by
side, leave one ``metrics.json`` holding both.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Collection, Sequence

import numpy as np

from hil.data.beir import BeirDataset
from hil.evaluation.evaluate import Evaluation
from hil.evaluation.runs import write_trec_run
from hil.evaluation.statistics import (P_ADJUST_NAMES, SIGNIFICANCE_LEVEL, add_adjusted, adjust_p_values,
                                       bm25_easy_split, bootstrap_ci, paired_bootstrap_test, paired_permutation_test,
                                       paired_t_test)
from hil.provenance import file_lock, provenance, write_json_atomic

RESULTS_LOCK = ".hil-results.lock"  # inside the results folder (which is never replaced as a whole)
# The comparisons adjusted together: a reference run's several challengers on one metric (every model against BM25;
# every transform against the plain model), as 001 Table 2 compares every variant with ColBERT.
PAIRED_FAMILY = "the runs compared with one reference run (b) on one metric"


def evaluation_statistics(evaluations: Sequence[Evaluation], *, metrics: Sequence[str] = ("ndcg@10",),
                          pairs: Sequence[tuple[str, str]] | None = None, n_bootstrap: int = 1000,
                          n_permutations: int = 10000, confidence: float = 0.95, seed: int = 0,
                          p_adjust: str = "holm") -> dict[str, Any]:
    """Bootstrap CIs per run and metric, paired tests between runs, and the BM25-Easy split (when BM25 ran).

    ``bootstrap``: 004 Section 2.1 percentile intervals of the mean per-query metric (m = ``n_bootstrap``
    samples of all queries). ``paired``: for each (a, b) in ``pairs`` (default: every run against the first, e.g.
    the model vs BM25) the paired t-test, the paired permutation test and the paired bootstrap test of ``a - b``
    on each metric (001 Table 2's dagger). ``bm25_easy``: 001 Table 4, each run's mean on the queries in the top
    half of BM25's per-query nDCG@10 and on the rest. Metrics a run lacks per query are skipped.

    Each paired row also carries ``p_t_test_adjusted``, ``p_permutation_adjusted`` and ``p_bootstrap_adjusted``:
    adjusted for multiple comparisons by ``p_adjust`` (``hil.evaluation.statistics.adjust_p_values``: "holm",
    "bh" or "none") within the family :data:`PAIRED_FAMILY`, recorded under ``p_adjust``.
    """
    by_name = {e.name: e for e in evaluations}

    result: dict[str, Any] = {"confidence": confidence, "n_bootstrap": n_bootstrap,
                              "n_permutations": n_permutations, "seed": seed, "bootstrap": {}, "paired": [],
                              "p_adjust": {"method": p_adjust, "family": PAIRED_FAMILY,
                                           "significance": SIGNIFICANCE_LEVEL}}
    adjust_p_values([], p_adjust)  # an unknown method is refused before any test runs
    for evaluation in evaluations:
        rows = {}
        for metric in metrics:
            per_query = _metric_values(evaluation, metric)
            if per_query:
                rows[metric] = asdict(bootstrap_ci(per_query, n_samples=n_bootstrap, confidence=confidence, seed=seed))
        result["bootstrap"][evaluation.name] = rows
    if pairs is None:
        pairs = [(e.name, evaluations[0].name) for e in evaluations[1:]]
    for a, b in pairs:
        if a not in by_name or b not in by_name:
            raise KeyError(f"evaluation_statistics: no run named {a if a not in by_name else b!r}; "
                           f"runs: {sorted(by_name)}")
        for metric in metrics:
            va, vb = _metric_values(by_name[a], metric), _metric_values(by_name[b], metric)
            if not va or not vb:
                continue
            t = paired_t_test(va, vb, on="intersection")
            perm = paired_permutation_test(va, vb, n_permutations=n_permutations, seed=seed, on="intersection")
            boot = paired_bootstrap_test(va, vb, n_samples=n_bootstrap, seed=seed, confidence=confidence,
                                         on="intersection")
            shared = sorted(set(va) & set(vb))
            result["paired"].append({"a": a, "b": b, "metric": metric, "n": t.n,
                                     "mean_a": float(np.mean([va[q] for q in shared])),
                                     "mean_b": float(np.mean([vb[q] for q in shared])), "mean_diff": t.mean_diff,
                                     "t": t.statistic, "p_t_test": t.p_value, "p_permutation": perm.p_value,
                                     "permutation_method": perm.method, "p_bootstrap": boot.p_value,
                                     "diff_ci": list(boot.ci) if boot.ci else None})
    add_adjusted(result["paired"], ("p_t_test", "p_permutation", "p_bootstrap"),
                 lambda row: (row["metric"], row["b"]), p_adjust)
    bm25 = next((e for e in evaluations if e.name == "bm25"), None)
    if bm25 is not None and _metric_values(bm25, "ndcg@10"):
        result["bm25_easy"] = _bm25_easy(evaluations, bm25, metrics)
    return result


def _metric_values(evaluation: Evaluation, metric: str) -> dict[str, float] | None:
    found = {qid: row[metric] for qid, row in evaluation.per_query.items() if metric in row}
    return found or None


def _bm25_easy(evaluations: Sequence[Evaluation], bm25: Evaluation, metrics: Sequence[str]) -> dict[str, Any]:
    """001 Table 4: each run's mean on the queries in the top half of BM25's per-query nDCG@10, and on the rest."""
    easy = bm25_easy_split(_metric_values(bm25, "ndcg@10"))
    split: dict[str, Any] = {"n_easy": len(easy), "n_hard": len(bm25.per_query) - len(easy), "runs": {}}
    for evaluation in evaluations:
        rows = {}
        for metric in metrics:
            per_query = _metric_values(evaluation, metric)
            if not per_query:
                continue
            in_easy = [v for q, v in per_query.items() if q in easy]
            in_hard = [v for q, v in per_query.items() if q not in easy]
            rows[metric] = {"easy": float(np.mean(in_easy)) if in_easy else None,
                            "hard": float(np.mean(in_hard)) if in_hard else None}
        split["runs"][evaluation.name] = rows
    return split


def format_statistics(statistics: dict[str, Any]) -> str:
    """A plain-text summary of :func:`evaluation_statistics` (intervals, then paired tests)."""
    lines = [f"bootstrap {100 * statistics['confidence']:.0f}% intervals ({statistics['n_bootstrap']} samples)"]
    for name, rows in statistics["bootstrap"].items():
        for metric, row in rows.items():
            lines.append(f"  {name:<40} {metric:<12} {row['observed']:.4f}  [{row['low']:.4f}, {row['high']:.4f}]")
    if statistics["paired"]:
        method = statistics.get("p_adjust", {}).get("method", "none")
        lines.append("paired tests (a - b)" + ("" if method == "none" else
                     f"; in parentheses p adjusted by {P_ADJUST_NAMES[method]} over {PAIRED_FAMILY}"))
        for row in statistics["paired"]:
            lines.append(f"  {row['a']} vs {row['b']} {row['metric']}: diff {row['mean_diff']:+.4f} " + " ".join(
                f"{test} p={_p_text(row, key, method)}" for test, key in
                (("t-test", "p_t_test"), ("permutation", "p_permutation"), ("bootstrap", "p_bootstrap")))
                + f" (n={row['n']})")
    return "\n".join(lines)


def _p_text(row: dict[str, Any], key: str, method: str) -> str:
    """``0.0031`` or, adjusted, ``0.0031 (holm 0.0093)``."""
    adjusted = row.get(f"{key}_adjusted")
    return f"{row[key]:.3g}" + ("" if method == "none" or adjusted is None else f" ({method} {adjusted:.3g})")


def dataset_record(dataset: BeirDataset) -> dict[str, Any]:
    """What a results file says of the dataset it measured: identity, size, and the qrels conventions that shape
    its numbers (judgments of documents outside the corpus, kept as trec_eval counts them; the relevance level of
    the binary metrics)."""
    return {"name": dataset.name, "split": dataset.split, "source": dataset.source,
            "fingerprint": dataset.fingerprint(), "documents": len(dataset.corpus), "queries": len(dataset.queries),
            "judgments": sum(map(len, dataset.qrels.values())),
            "judged_outside_corpus": dataset.judged_outside_corpus, "relevance_level": dataset.relevance_level}


def write_results(directory: str | Path, dataset: BeirDataset, evaluations: list[Evaluation],
                  settings: dict[str, Any], models: dict[str, Any],
                  statistics: dict[str, Any] | None = None, write_runs: bool = True) -> Path:
    """``metrics.json`` (settings, versions, dataset/model fingerprints, aggregates, optional statistics),
    per-query JSON, TREC runs (unless ``write_runs`` is False: the experiment runner writes each column's run
    itself); each file atomically, ``metrics.json`` last, under the folder's lock (module docstring)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    record = provenance(settings,
                        dataset=dataset_record(dataset),
                        models=models,
                        results={e.name: {"metrics": e.aggregate,
                                          **{k: v for k, v in e.details.items() if k != "sources"}}
                                 for e in evaluations},
                        **({"statistics": statistics} if statistics is not None else {}))
    with file_lock(directory / RESULTS_LOCK, what="writing results"):
        for evaluation in evaluations if write_runs else ():
            write_trec_run(directory / f"{evaluation.name}.trec", evaluation.run, tag=evaluation.name)
        write_json_atomic(directory / "per_query.json", {e.name: e.per_query for e in evaluations})
        write_json_atomic(directory / "metrics.json", record)  # last: complete results are those it names
    return directory / "metrics.json"


def other_columns(directory: str | Path, own: Collection[str],
                  context: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The columns that ``directory``'s ``metrics.json`` holds besides ``own`` (another evaluation's, into the same
    folder), split by their records (``<name>.json``): -> those whose identity, its ``column`` part aside, is
    ``context`` (the same dataset slice and settings: they compare with this evaluation's), by name; and the names
    of the others (measured otherwise, or whose record is gone). Call it under the folder's lock."""
    directory = Path(directory)
    try:
        named = json.loads((directory / "metrics.json").read_text(encoding="utf-8"))["results"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}, []  # no results yet (or not this package's): nothing to keep
    kept: dict[str, dict[str, Any]] = {}
    left_out: list[str] = []
    for name in named:
        if name in own:
            continue
        try:
            record = json.loads((directory / f"{name}.json").read_text(encoding="utf-8"))
            identity = {key: value for key, value in record["identity"].items() if key != "column"}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            left_out.append(name)
            continue
        if identity == context:
            kept[name] = record
        else:
            left_out.append(name)
    return kept, left_out


def format_table(evaluations: list[Evaluation], metrics: Sequence[str] | None = None) -> str:
    """One row per evaluation; a column per metric (default: every metric measured, in the order measured)."""
    names = list(metrics) if metrics is not None else list(dict.fromkeys(m for e in evaluations for m in e.aggregate))
    width = max(len(e.name) for e in evaluations) + 2
    lines = ["model".ljust(width) + "".join(f"{m:>13}" for m in names)]
    for e in evaluations:
        lines.append(e.name.ljust(width) + "".join(f"{e.aggregate[m]:>13.4f}" if m in e.aggregate else f"{'-':>13}"
                                                   for m in names))
    return "\n".join(lines)
