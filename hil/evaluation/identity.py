"""What a column's numbers depend on: its identity (:mod:`hil.evaluation.runner` keeps a finished column whose
recorded identity is the one it would compute, and recomputes any other), as JSON reads it back.

A column's identity is ``{"dataset": ..., "column": ..., "evaluation": ...}`` (and the hooks' ``extras``): the
dataset's fingerprint and slice (:func:`dataset_identity`), the model's fingerprint or the baseline's
(:func:`baseline_identity`), the settings that change the numbers (:func:`evaluation_identity`). Device, processes,
batch sizes and folders change how fast, not what, and are not part of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hil.data.beir import BeirDataset
from hil.evaluation.experiment import DatasetSpec
from hil.evaluation.settings import EvaluationSettings
from hil.provenance import fingerprint_strings


def normalized(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists), so that identities compare."""
    return json.loads(json.dumps(value, default=str))


def differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two identities."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return [prefix.rstrip(".") or "identity"] if old != new else []
    return [key for name in sorted(set(old) | set(new))
            for key in differences(old.get(name), new.get(name), f"{prefix}{name}.")]


def dataset_identity(dataset: BeirDataset, spec: DatasetSpec, seed: int) -> dict[str, Any]:
    return {"name": dataset.name, "split": dataset.split, "fingerprint": dataset.fingerprint(),
            "relevance_level": dataset.relevance_level, "judged_outside_corpus": dataset.judged_outside_corpus,
            "slice": {"max_queries": spec.max_queries, "max_docs": spec.max_docs,
                      "seed": seed if spec.max_queries or spec.max_docs else None}}


def baseline_identity(run_file: Path | None, settings: EvaluationSettings, depth: int) -> dict[str, Any]:
    """The baseline column: a run file's content, or BM25 and its depth."""
    if run_file is not None:
        return {"run_file": run_file.name, "fingerprint": fingerprint_strings(run_file.read_text().splitlines())}
    return {"bm25": "hil.data.bm25", "k": max(settings.k, depth)}


def run_file_of(path: str, dataset: BeirDataset) -> Path:
    """A first-stage run file: the path as given, else, for a relative path that is not there, the file of that
    name in the dataset's own folder (``bm25-top100.trec`` of ``msmarco/dl19``)."""
    given = Path(path).expanduser()
    beside = Path(dataset.source) / path
    if not given.exists() and not given.is_absolute() and beside.is_file():
        return beside
    return given


def evaluation_identity(settings: EvaluationSettings, baseline: dict[str, Any], depth: int) -> dict[str, Any]:
    """The settings that change a model's numbers: mode, k, metrics, self-match rule, precision and document
    encoding; full ranking adds the back-end's build-time and search-time settings, re-ranking the first stage."""
    identity: dict[str, Any] = {"mode": settings.mode, "k": settings.k, "metrics": list(settings.metrics),
                                "drop_self_matches": settings.drop_self_matches, "precision": settings.precision,
                                "document_encoding": settings.document_encoding}
    if settings.mode == "full":
        identity.update(backend=settings.backend.record(), search=settings.resolved_search.record())
        if settings.query_encoding is not None:  # only when set: identities made before it existed stay valid
            identity["query_encoding"] = settings.query_encoding
    if settings.mode == "rerank" or baseline.get("run_file"):
        identity.update(rerank_depth=depth, first_stage=baseline)
    return identity
