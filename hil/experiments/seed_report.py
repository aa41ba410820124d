"""The paper experiment over several training seeds: ``seeds.json`` and ``seeds.md`` beside one run per seed.

``hil paper --seeds 1,2,3`` runs the whole experiment once per seed into ``<out>/seed-<s>/`` (each a complete,
resumable run with its own report; only the training seed differs, the evaluation data and its seed are the same),
then summarizes every variant over the seeds and compares it with ColBERT (:mod:`hil.evaluation.seeds`: spread,
per-seed signs, a paired t-test over queries on per-query means over seeds and a t-test over seeds, both adjusted
within "every variant against ColBERT on one dataset and metric").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from hil.errors import UserError
from hil.evaluation.seeds import SEED_LEVEL, seed_table
from hil.evaluation.tables import fmt, markdown_table, p_with_adjusted
from hil.experiments.profiles import CORPUS_IDF, DATASETS, VARIANTS, Profile
from hil.experiments.records import DATASET_LABELS, load_results
from hil.provenance import provenance, write_json_atomic, write_text_atomic

REFERENCE = "colbert"
# recall@100 only where the whole corpus is ranked: a re-ranked top 100 has the first stage's recall whatever the model
METRICS = {"full": ("ndcg@10", "recall@100"), "rerank": ("ndcg@10",)}


def seed_folder(out: Path, seed: int) -> Path:
    return out / f"seed-{seed}"


def seed_records(out: Path, seeds: Sequence[int], p_adjust: str = "holm") -> dict[str, Any]:
    """dataset -> metric -> :func:`~hil.evaluation.seeds.seed_table` over the variants every seed has, read from
    ``<out>/seed-<s>/eval/<dataset>/<variant>.json``."""
    results = {seed: load_results(seed_folder(out, seed)) for seed in seeds}
    tables: dict[str, Any] = {}
    for key in sorted({key for per in results.values() for key in per}, key=list(DATASET_LABELS).index):
        names = [name for name in [*VARIANTS, *CORPUS_IDF]
                 if all(name in results[seed].get(key, {}) for seed in seeds)]
        if REFERENCE not in names or len(names) < 2:
            continue
        for name in names:
            for seed in seeds:
                recorded = results[seed][key][name].get("model", {}).get("seed")
                if recorded is not None and recorded != seed:
                    raise UserError(f"{seed_folder(out, seed)}/eval/{key}/{name}.json was trained with seed "
                                    f"{recorded}, not {seed}")
        tables[key] = {metric: seed_table({name: {seed: {q: v[metric] for q, v in
                                                         results[seed][key][name]["per_query"].items()}
                                                  for seed in seeds} for name in names}, REFERENCE, p_adjust)
                       for metric in METRICS[DATASETS[key][0]]}
    return tables


def seed_lines(tables: dict[str, Any], seeds: Sequence[int], metrics: Sequence[str] | None = None) -> list[str]:
    """Per dataset and metric (``metrics``: only those): each variant's seeds, mean +- sd, range; against ColBERT:
    the mean difference, per-seed signs, both tests (raw and adjusted) and the verdict."""
    lines = [f"Seeds {', '.join(map(str, seeds))}. Tests against ColBERT: *queries* = paired t-test over queries of "
             "per-query means over seeds (scipy `ttest_rel`); *seeds* = one-sample t-test of the per-seed differences "
             f"(scipy `ttest_1samp`, df = n_seeds - 1). Verdict: *exceeds seed noise* when every seed agrees in sign "
             f"and the seed test's adjusted p < {SEED_LEVEL}. Adjustment within every variant against ColBERT on one "
             "dataset and metric (each test apart).", ""]
    for key, per_metric in tables.items():
        for metric, table in per_metric.items():
            if metrics is not None and metric not in metrics:
                continue
            method = table["p_adjust"]
            lines += [f"### {DATASET_LABELS.get(key, key)}, {metric} ({table['n_queries']} queries)", ""]
            rows = []
            for name, spread in table["spread"].items():
                comparison = table["comparisons"].get(name)
                per_seed = " / ".join(fmt(v) for v in spread["per_seed"].values())
                row = [VARIANTS.get(name, CORPUS_IDF.get(name, (None, name)))[1], per_seed,
                       f"{fmt(spread['mean'])} ± {fmt(spread['sd'])}", fmt(spread["range"])]
                if comparison is None:
                    row += ["(reference)", "", "", "", ""]
                else:
                    row += [f"{comparison['mean_difference']:+.4f}", comparison["signs"],
                            p_with_adjusted(comparison["p_t_test_queries"], comparison["p_t_test_queries_adjusted"],
                                            method),
                            p_with_adjusted(comparison["p_t_test_seeds"], comparison["p_t_test_seeds_adjusted"],
                                            method),
                            comparison["verdict"]]
                rows.append(row)
            lines += markdown_table(["Model", "per seed", "mean ± sd", "range", "Δ vs ColBERT", "signs",
                                     "p queries (adj.)", "p seeds (adj.)", "verdict"], rows)
            lines.append("")
    return lines


def statement_lines(tables: dict[str, Any], metric: str = "ndcg@10") -> list[str]:
    """Per dataset, one plain sentence per variant: its mean difference to ColBERT, the seeds' signs and the verdict
    (numbers from ``tables`` only)."""
    lines = []
    for key, per_metric in tables.items():
        table = per_metric.get(metric)
        if table is None:
            continue
        parts = []
        for name, c in table["comparisons"].items():
            label = VARIANTS.get(name, CORPUS_IDF.get(name, (None, name)))[1]
            parts.append(f"{label} {c['mean_difference']:+.4f} (seeds {c['signs']}, p seeds "
                         f"{table['p_adjust']} {fmt(c['p_t_test_seeds_adjusted'], 2)}): {c['verdict']}")
        lines.append(f"- **{DATASET_LABELS.get(key, key)}** ({metric} against ColBERT, "
                     f"ColBERT's seed sd {fmt(table['spread'][REFERENCE]['sd'])}): " + "; ".join(parts) + ".")
    return lines


def write_seed_report(out: Path, profile: Profile, seeds: Sequence[int], *, command: str = "") -> Path:
    """``seeds.json`` and ``seeds.md`` in ``out`` from the per-seed runs. -> the Markdown path."""
    tables = seed_records(out, seeds, p_adjust=profile.p_adjust)
    if not tables:
        raise UserError(f"{out}: no dataset has ColBERT and another variant under every seed {list(seeds)}")
    write_json_atomic(out / "seeds.json", provenance({"profile": profile.name, "seeds": list(seeds)},
                                                     command=command, tables=tables))
    lines = [f"# HIL (001) over training seeds, profile `{profile.name}`", "", *statement_lines(tables), "",
             *seed_lines(tables, seeds)]
    path = out / "seeds.md"
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path
