"""The runner's ColumnHooks (what the paper experiment adds to its columns): extras recorded with a column,
columns recomputed when the hooks' identity changes and kept when it does not, derived columns kept or redone
with their members, the paper's ColBERT-lambda equal to a by-hand sum of its members' saved score matrices."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pytest

from hil.evaluation.evaluate import EvaluationSettings, score_run
from hil.evaluation.runner import (
    Column,
    DatasetRun,
    DatasetSpec,
    Experiment,
    ModelSpec,
    StatisticsSettings,
    run_experiment,
)
from hil.experiments.paper_columns import PaperColumns
from hil.experiments.profiles import PROFILES
from hil.modeling.loading import load_encoder


@dataclass
class CountingHooks:
    """Records what the runner asked; ``version`` is the hooks' identity."""

    version: int = 1
    extras_for: list[str] = field(default_factory=list)
    derived_made: int = 0

    def identity(self, part: DatasetRun) -> dict[str, Any]:
        return {"version": self.version}

    def column_extras(self, part: DatasetRun, name: str, evaluation, encoder) -> dict[str, Any]:
        self.extras_for.append(name)
        assert not encoder.training  # measured in eval mode
        return {"n_queries_seen": len(evaluation.per_query), "version": self.version}

    def derived_columns(self, part: DatasetRun, columns: Sequence[Column]) -> list[Column]:
        (model,) = [c for c in columns if c.name == "tiny"]
        identity = {"dataset": part.identity, "of": model.record["identity"]}
        record = part.finished("copy", identity)
        if record is not None:
            return [Column("copy", record)]
        self.derived_made += 1
        evaluation = model.as_evaluation()
        run = {q: {} for q in evaluation.per_query}
        return [part.save("copy", score_run("copy", part.dataset, run), identity, {"name": "copy"})]


def experiment(tiny_model_dir, out, **changes) -> Experiment:
    settings = EvaluationSettings(mode="exhaustive", k=20, index_root=None, progress=False)
    return Experiment([DatasetSpec("scifact", max_queries=5, max_docs=80)], [ModelSpec(str(tiny_model_dir),
                                                                                       name="tiny", dim=16)],
                      out, settings=settings, statistics=StatisticsSettings(enabled=False), quiet=True, **changes)


@pytest.mark.integration
def test_extras_are_recorded_and_the_hooks_identity_decides_reuse(tiny_model_dir, tmp_path):
    hooks = CountingHooks()
    (result,) = run_experiment(experiment(tiny_model_dir, tmp_path), hooks=hooks)
    assert [c.name for c in result.columns] == ["bm25", "tiny", "copy"] and hooks.extras_for == ["tiny"]
    record = json.loads((tmp_path / "scifact" / "tiny.json").read_text())
    assert record["n_queries_seen"] == 5 and record["version"] == 1 and record["identity"]["extras"] == {"version": 1}
    assert "copy" in json.loads((tmp_path / "scifact" / "metrics.json").read_text())["results"]

    run_experiment(experiment(tiny_model_dir, tmp_path), hooks=hooks)  # same identity: kept, nothing measured
    assert hooks.extras_for == ["tiny"] and hooks.derived_made == 1

    hooks.version = 2  # the hooks measure otherwise: the model column, then the derived one, are redone
    run_experiment(experiment(tiny_model_dir, tmp_path), hooks=hooks)
    assert hooks.extras_for == ["tiny", "tiny"] and hooks.derived_made == 2
    assert json.loads((tmp_path / "scifact" / "tiny.json").read_text())["version"] == 2


@pytest.mark.integration
def test_extras_may_not_replace_the_records_own_keys(tiny_model_dir, tmp_path):
    class Clashing(CountingHooks):
        def column_extras(self, part, name, evaluation, encoder):
            return {"metrics": {"ndcg@10": 1.0}}

    with pytest.raises(ValueError, match="metrics"):
        run_experiment(experiment(tiny_model_dir, tmp_path), hooks=Clashing())


@pytest.mark.integration
def test_paper_lambda_is_the_sum_of_its_members_matrices(tiny_model_dir, tmp_path):
    """PaperColumns: each member's matrix saved, ColBERT-lambda ranked by their sum (checked by hand with numpy,
    trec_eval's tie order aside: random float scores), InterIso per member head recorded."""
    for seed, name in ((1, "iso"), (2, "aniso")):
        import torch

        torch.manual_seed(seed)
        load_encoder(str(tiny_model_dir), dim=16).save_pretrained(tmp_path / name)
    profile = PROFILES["smoke"]
    settings = EvaluationSettings(mode="exhaustive", k=10, index_root=None, keep_head_scores=True, progress=False)
    spec = Experiment([DatasetSpec("scifact", max_queries=6, max_docs=60, key="scifact")],
                      [ModelSpec(str(tmp_path / n), name=n) for n in ("iso", "aniso")], tmp_path / "eval",
                      settings=settings, statistics=StatisticsSettings(enabled=False), quiet=True)
    hooks = PaperColumns(profile, figures_on="none", ensembles={"lambda": ("iso", "aniso")})
    (result,) = run_experiment(spec, hooks=hooks)
    folder = tmp_path / "eval" / "scifact"
    assert [c.name for c in result.columns] == ["bm25", "iso", "aniso", "lambda"]
    saved = {n: np.load(folder / f"{n}.scores.npz") for n in ("iso", "aniso")}
    total = saved["iso"]["head_colbert"] + saved["aniso"]["head_colbert"]
    qids, doc_ids = [str(q) for q in saved["iso"]["qids"]], [str(d) for d in saved["iso"]["doc_ids"]]
    ranked: dict[str, list[str]] = {}
    for line in (folder / "lambda.trec").read_text().splitlines():
        ranked.setdefault(line.split()[0], []).append(line.split()[2])
    for row, qid in enumerate(qids):
        order = [doc_ids[i] for i in np.argsort(-total[row], kind="stable") if doc_ids[i] != qid][:10]
        assert ranked[qid] == order
    lam = json.loads((folder / "lambda.json").read_text())
    iso = json.loads((folder / "iso.json").read_text())
    assert lam["inter_iso"] == {"iso": iso["inter_iso"]["colbert"],
                                "aniso": json.loads((folder / "aniso.json").read_text())["inter_iso"]["colbert"]}
    assert iso["n_docs"] == 60 and iso["interiso_pairs"] >= 1 and "layer_inter_iso" not in iso

    # A rerun keeps lambda; a member trained again (other weights) makes lambda follow it.
    before = (folder / "lambda.json").stat().st_mtime_ns
    run_experiment(spec, hooks=hooks)
    assert (folder / "lambda.json").stat().st_mtime_ns == before
    import torch

    torch.manual_seed(3)
    load_encoder(str(tiny_model_dir), dim=16).save_pretrained(tmp_path / "aniso")
    run_experiment(spec, hooks=hooks)
    assert (folder / "lambda.json").stat().st_mtime_ns != before
    with np.load(folder / "aniso.scores.npz") as aniso:
        total = saved["iso"]["head_colbert"] + aniso["head_colbert"]
    first = [line.split()[2] for line in (folder / "lambda.trec").read_text().splitlines()
             if line.split()[0] == qids[0]][:3]
    assert first == [doc_ids[i] for i in np.argsort(-total[0], kind="stable") if doc_ids[i] != qids[0]][:3]
