"""Say what happens (issue 31): an experiment says where each model's index is and whether it was built or reused,
which finished columns it kept instead of computing, and which files it wrote.

Broken on purpose, each failing here: the index's ``how_opened`` left at its default, the "kept" line dropped, the
"wrote" line dropped."""

from __future__ import annotations

import pytest

from hil.evaluation.evaluate import EvaluationSettings
from hil.evaluation.experiment import DatasetSpec, Experiment, ModelSpec, StatisticsSettings
from hil.evaluation.runner import run_experiment


def experiment(model_dir, out, index_root, metrics=("ndcg@10",)) -> Experiment:
    return Experiment([DatasetSpec("scifact", max_queries=4, max_docs=60, key="set")],
                      [ModelSpec(str(model_dir), name="tiny", dim=16)], out,
                      settings=EvaluationSettings(mode="full", k=10, index_root=str(index_root), progress=False,
                                                  metrics=metrics),
                      statistics=StatisticsSettings(enabled=False))


@pytest.mark.integration
def test_an_experiment_says_where_its_index_is_what_it_reused_and_what_it_wrote(tiny_model_dir, tmp_path, capsys):
    run_experiment(experiment(tiny_model_dir, tmp_path / "out", tmp_path / "indexes"))
    first = capsys.readouterr().err
    (index_dir,) = [p.parent for p in (tmp_path / "indexes").rglob("index.json")]
    assert f"tiny: index {index_dir} (built)" in first
    assert f"wrote {tmp_path / 'out' / 'set'}/: metrics.json, per_query.json" in first
    run_experiment(experiment(tiny_model_dir, tmp_path / "out", tmp_path / "indexes"))
    again = capsys.readouterr().err
    assert f"tiny on scifact: kept {tmp_path / 'out' / 'set' / 'tiny.json'} (finished with the same settings)" in again
    assert f"bm25 on scifact: kept {tmp_path / 'out' / 'set' / 'bm25.json'}" in again
    # other metrics: the column is computed again over the index built before
    run_experiment(experiment(tiny_model_dir, tmp_path / "out", tmp_path / "indexes", ("ndcg@10", "mrr@10")))
    assert f"tiny: index {index_dir} (reused)" in capsys.readouterr().err
