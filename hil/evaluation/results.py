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

A folder of several datasets (BEIR's CQADupStack, a folder per forum) is reported as BEIR reports it: the mean of
its forums' means, every forum counting the same whatever its number of queries (:func:`forum_mean`, the one rule
of ``hil evaluate``'s row, :func:`forum_mean_result`, and of ``hil beir``'s table, :mod:`hil.experiments.beir_table`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

import numpy as np

from hil.data.beir import BeirDataset
from hil.evaluation.evaluate import Evaluation
from hil.evaluation.experiment import StatisticsSettings
from hil.evaluation.runs import write_trec_run
from hil.evaluation.statistics import (
    P_ADJUST_NAMES,
    SIGNIFICANCE_LEVEL,
    add_adjusted,
    adjust_p_values,
    bm25_easy_split,
    bootstrap_ci,
    paired_bootstrap_test,
    paired_permutation_test,
    paired_t_test,
    stratified_bootstrap_ci,
)
from hil.modeling.contracts import Encoder
from hil.provenance import file_lock, provenance, write_json_atomic

RESULTS_LOCK = ".hil-results.lock"  # inside the results folder (which is never replaced as a whole)
# The comparisons adjusted together: a reference run's several challengers on one metric (every model against BM25;
# every transform against the plain model), as 001 Table 2 compares every variant with ColBERT.
PAIRED_FAMILY = "the runs compared with one reference run (b) on one metric"


@dataclass
class Column:
    """A finished column: its record (as on disk) and, when computed in this run, its evaluation and the encoder
    that made it (the transformed encoder for a transform column)."""

    name: str
    record: dict[str, Any]
    evaluation: Evaluation | None = None
    encoder: Encoder | None = None

    def as_evaluation(self) -> Evaluation:
        """The evaluation, or one rebuilt from the record (per-query metrics; the run stays in its .trec file)."""
        if self.evaluation is not None:
            return self.evaluation
        return Evaluation(self.name, {}, self.record["metrics"], self.record["per_query"],
                          self.record.get("details", {}))


@dataclass
class DatasetResult:
    """One dataset's columns (baseline first) and statistics, and where they were written; ``others``: the columns
    of other evaluations into the same folder that ``metrics.json`` (and the statistics) hold beside them. For a
    folder of several datasets (:func:`forum_mean_result`): ``forums``, each part's result, and no ``dataset``."""

    key: str
    dataset: BeirDataset | None
    columns: list[Column]
    statistics: dict[str, Any] | None
    metrics_path: Path
    others: list[Column] = field(default_factory=list)
    forums: list["DatasetResult"] = field(default_factory=list)

    def evaluations(self) -> list[Evaluation]:
        return [column.as_evaluation() for column in self.columns]

    def describe(self) -> str:
        """``name (split: N queries, M documents)``; for a mean over forums, which ones, and their sizes summed."""
        if self.dataset is not None:
            return (f"{self.dataset.name} ({self.dataset.split}: {len(self.dataset.queries)} queries, "
                    f"{len(self.dataset.corpus)} documents)")
        parts = [part.dataset for part in self.forums if part.dataset is not None]
        return (f"{self.key} (the mean of {len(parts)} forums, as BEIR reports it: "
                f"{', '.join(part.name for part in parts)}; {parts[0].split}: "
                f"{sum(len(part.queries) for part in parts)} queries, {sum(len(part.corpus) for part in parts)} "
                "documents)")


def paired_comparisons(columns: Sequence[Column], baseline: str | None,
                       transforms_of: dict[str, str]) -> list[tuple[str, str]]:
    """Every model column against the baseline, and each transform column against its plain model."""
    names = [column.name for column in columns if column.name != baseline]
    pairs = [(name, baseline) for name in names if baseline is not None]
    return pairs + [(name, plain) for name, plain in transforms_of.items() if name in names]


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


# -- a folder of several datasets (BEIR's CQADupStack) -------------------------------------------------------------

@dataclass(frozen=True)
class Cell:
    """One column on one dataset and metric: the mean and per-query values whose plain mean it is; for a mean over
    forums, each forum's own per-query values (``strata``)."""

    mean: float
    per_query: dict[str, float]
    strata: dict[str, list[float]] | None = None


def record_cell(record: Mapping[str, Any], metric: str) -> Cell:
    """A results record's mean metric and its per-query values."""
    return Cell(float(record["metrics"][metric]), {q: float(row[metric]) for q, row in record["per_query"].items()})


def forum_mean(forums: Mapping[str, Cell]) -> Cell:
    """CQADupStack: the mean of the forums' means (BEIR's convention); per-query values (``<forum>/<qid>``) scaled
    by N / (F * n_f) so that their plain mean is that mean. Forums are taken in name order, so that every command
    adds the same numbers in the same order."""
    forums = dict(sorted(forums.items()))
    total = sum(len(cell.per_query) for cell in forums.values())
    per_query = {f"{forum}/{qid}": value * total / (len(forums) * len(cell.per_query))
                 for forum, cell in forums.items() for qid, value in cell.per_query.items()}
    return Cell(float(np.mean([cell.mean for cell in forums.values()])), per_query,
                {forum: list(cell.per_query.values()) for forum, cell in forums.items()})


def forum_mean_result(key: str, folder: Path, forums: Sequence[DatasetResult], baseline: str | None,
                      settings: dict[str, Any], statistics: StatisticsSettings | None, seed: int) -> DatasetResult:
    """The row of a folder of several datasets from its forums' results: every metric of each column the mean of
    the forums' (:func:`forum_mean`), each forum's own figures beside it; written as ``folder/metrics.json`` (under
    the folder's lock; the per-query values stay in each forum's folder). A column is in the row when every forum
    has it. ``statistics``: intervals stratified by forum and paired tests on the pooled scaled values
    (:func:`forum_statistics`), as ``hil beir``'s table computes them."""
    by_forum = {part.key.rsplit("/", 1)[-1]: {column.name: column.record for column in [*part.columns, *part.others]}
                for part in forums}
    first = next(iter(by_forum.values()))
    names = [name for name in first if all(name in records for records in by_forum.values())]
    cells: dict[str, dict[str, Cell]] = {}
    columns = []
    for name in names:
        of_column = {forum: records[name] for forum, records in by_forum.items()}
        metrics = [m for m in first[name]["metrics"] if all(m in record["metrics"] for record in of_column.values())]
        cells[name] = {m: forum_mean({forum: record_cell(record, m) for forum, record in of_column.items()})
                       for m in metrics}
        columns.append(Column(name, {"metrics": {m: cell.mean for m, cell in cells[name].items()},
                                     "forums": {forum: record["metrics"] for forum, record in of_column.items()},
                                     "per_query": {}, "model": first[name].get("model", {})}))
    transforms_of = {name: plain for name in names
                     if (plain := first[name].get("model", {}).get("plain_column")) in names}
    tested = statistics is not None and statistics.enabled and columns
    stats = forum_statistics(cells, paired_comparisons(columns, baseline if baseline in names else None,
                                                       transforms_of), statistics, seed) if tested else None
    parts = {forum: next(iter(records.values()))["dataset"] for forum, records in by_forum.items()}
    dataset = {"name": key, "split": next(iter(parts.values())).get("split"), "forums": parts,
               "mean_over": "forums (BEIR's convention: each forum counts the same)",
               **{size: sum(int(part.get(size) or 0) for part in parts.values())
                  for size in ("documents", "queries", "judgments", "judged_outside_corpus")}}
    record = provenance(settings, dataset=dataset,
                        models={c.name: c.record["model"] for c in columns if c.name != baseline},
                        results={c.name: {"metrics": c.record["metrics"], "forums": c.record["forums"]}
                                 for c in columns},
                        **({"statistics": stats} if stats is not None else {}))
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / RESULTS_LOCK, what="writing results"):
        write_json_atomic(folder / "metrics.json", record)
    return DatasetResult(key, None, columns, stats, folder / "metrics.json", forums=list(forums))


def forum_statistics(cells: Mapping[str, Mapping[str, Cell]], pairs: Sequence[tuple[str, str]],
                     settings: StatisticsSettings, seed: int) -> dict[str, Any]:
    """:func:`evaluation_statistics` of a mean over forums (``cells``: column -> metric -> :func:`forum_mean`):
    paired tests on the pooled per-query values scaled per forum, whose mean differences are the differences of
    the forum means (none with fewer than two queries); each interval resampled within each forum
    (:func:`~hil.evaluation.statistics.stratified_bootstrap_ci`), so that every forum keeps its weight. No BM25-Easy
    split: scaled values of different forums do not rank against each other."""
    evaluations = []
    for name, by_metric in cells.items():
        pooled: dict[str, dict[str, float]] = {}
        for metric, cell in by_metric.items():
            for query, value in cell.per_query.items():
                pooled.setdefault(query, {})[metric] = value
        evaluations.append(Evaluation(name, {}, {m: cell.mean for m, cell in by_metric.items()}, pooled))
    testable = min((len(e.per_query) for e in evaluations), default=0) >= 2
    result = evaluation_statistics(evaluations, metrics=settings.metrics, pairs=pairs if testable else [],
                                   n_bootstrap=settings.bootstrap_samples, n_permutations=settings.permutations,
                                   seed=seed, p_adjust=settings.p_adjust)
    result.pop("bm25_easy", None)
    for name, by_metric in cells.items():
        for metric in result["bootstrap"][name]:
            result["bootstrap"][name][metric] = asdict(stratified_bootstrap_ci(
                by_metric[metric].strata or {}, n_samples=settings.bootstrap_samples, seed=seed))
    result["forums"] = "intervals resampled within each forum; tests on per-query values scaled by N / (F * n_f)"
    return result
