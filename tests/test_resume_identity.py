"""A resumed experiment is the experiment run afresh (issue 31's unguarded bugs): a setting that changes a column's
numbers or run must be in that column's identity, so a rerun under the new setting recomputes the column instead of
keeping the one made under the old. Each case runs the experiment under setting A, then under B in the same folder,
and compares every column with B run in a fresh folder (the independent reference); the case also checks that A
and B really differ, so the comparison can fail.

Broken on purpose, each failing here: ``drop_self_matches`` left out of ``evaluation_identity`` (the model column
made under the other self-match rule kept), the baseline identity keyed on ``k`` alone (a stale BM25 column kept
after ``rerank_depth`` changed), ``Experiment``'s statistics defaulting to unadjusted p-values.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hil.evaluation.evaluate import EvaluationSettings
from hil.evaluation.experiment import DatasetSpec, Experiment, ModelSpec, StatisticsSettings
from hil.evaluation.runner import run_experiment

WORDS = ["gene", "cell", "protein", "cancer", "heart", "brain", "water", "climate", "energy", "virus", "bone",
         "blood", "sugar", "sleep", "light"]


def self_match_folder(root: Path) -> Path:
    """A BEIR folder whose queries are also corpus documents under the same id, with the query's text (as ArguAna
    and Quora): the self-match rule decides whether a query's own document ranks first."""
    rng = np.random.default_rng(5)
    queries = {f"q{i}": " ".join(rng.choice(WORDS, size=4)) for i in range(6)}
    corpus = {f"d{i:02d}": " ".join(rng.choice(WORDS, size=int(rng.integers(3, 9)))) for i in range(40)}
    corpus.update(queries)
    root.mkdir(parents=True)
    (root / "corpus.jsonl").write_text("".join(json.dumps({"_id": d, "title": "", "text": t}) + "\n"
                                               for d, t in corpus.items()))
    (root / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in queries.items()))
    (root / "qrels").mkdir()
    lines = ["query-id\tcorpus-id\tscore"] + [f"q{i}\td{(5 * i + j) % 40:02d}\t1" for i in range(6) for j in range(3)]
    (root / "qrels" / "test.tsv").write_text("\n".join(lines) + "\n")
    return root


def experiment(data: Path, model_dir: Path, out: Path, settings: EvaluationSettings,
               rerank_depth: int | None = None) -> Experiment:
    return Experiment([DatasetSpec(str(data), key="set", rerank_depth=rerank_depth)],
                      [ModelSpec(str(model_dir), name="tiny", dim=16)], out, settings=settings,
                      statistics=StatisticsSettings(enabled=False), quiet=True)


def columns(out: Path) -> dict[str, dict]:
    """Each column's numbers and identity, and its run file's lines (what a stale column would show)."""
    found = {}
    for path in sorted((out / "set").glob("*.json")):
        record = json.loads(path.read_text())
        if "per_query" in record and "identity" in record:
            trec = path.with_suffix(".trec")
            found[path.stem] = {"metrics": record["metrics"], "per_query": record["per_query"],
                                "identity": record["identity"],
                                "run": trec.read_text().splitlines() if trec.is_file() else None}
    return found


BASE = EvaluationSettings(mode="exhaustive", k=10, index_root=None, progress=False,
                          metrics=("ndcg@10", "recall@10", "recall@50"))
CASES = {
    # BEIR's self-match rule: a model column made under the other rule has other numbers
    "drop_self_matches": (dict(settings=BASE), dict(settings=replace(BASE, drop_self_matches=False))),
    # the baseline's depth is max(k, rerank_depth): its run and its recall@50 change with rerank_depth
    "rerank_depth": (dict(settings=BASE, rerank_depth=50), dict(settings=BASE, rerank_depth=20)),
}


@pytest.mark.integration
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resumed_experiment_equals_a_fresh_one_after_a_setting_changed(case, tiny_model_dir, tmp_path):
    data = self_match_folder(tmp_path / "data")
    first, second = CASES[case]
    run_experiment(experiment(data, tiny_model_dir, tmp_path / "resumed", **first))
    run_experiment(experiment(data, tiny_model_dir, tmp_path / "resumed", **second))
    run_experiment(experiment(data, tiny_model_dir, tmp_path / "fresh-a", **first))
    run_experiment(experiment(data, tiny_model_dir, tmp_path / "fresh-b", **second))
    resumed, fresh_a, fresh_b = (columns(tmp_path / n) for n in ("resumed", "fresh-a", "fresh-b"))
    assert set(resumed) == set(fresh_b) == {"bm25", "tiny"}
    changed = [name for name in fresh_b if (fresh_a[name]["metrics"], fresh_a[name]["run"])
               != (fresh_b[name]["metrics"], fresh_b[name]["run"])]
    assert changed, f"the construction must make {case} change a column"
    for name in fresh_b:
        assert resumed[name] == fresh_b[name], f"{name}: kept from the run under the other {case}"


def test_an_experiment_built_in_python_adjusts_p_values_with_holm_by_default(tmp_path):
    """The documented default (``StatisticsSettings.p_adjust``): an ``Experiment`` made without ``statistics=``
    reports Holm-adjusted p-values, as the command line does."""
    made = Experiment([DatasetSpec("scifact")], [], tmp_path / "out")
    assert made.statistics.p_adjust == "holm" and made.statistics.enabled
    assert StatisticsSettings().p_adjust == "holm"
