"""Isotropy x engine: which retrieval engines a model's token geometry breaks, and whether isotropy repairs them.

LightOn's LateOn-regularized model card (2026) reports that recent ColBERT token embeddings are highly anisotropic,
that this does not hurt PLAID but breaks single-vector schemes such as MUVERA's fixed dimensional encodings
(Dhulipala et al. 2024), and that mean-centering helps without being enough. This study measures it, per model:

1. **exact**: every query against every document (``exhaustive``), its top ``depth`` (100) the reference;
2. every **engine** (a back-end with its build- and search-time settings, :class:`Engine`; by default token ANN
   (FAISS IVF over token vectors, ColBERT v1's first stage), PLAID, MUVERA, and MUVERA over mean-centered and over
   whitened tokens (``MuveraIndexConfig.transform``, an index-time option of the back-end)): full ranking over one
   index of the model (the vectors are encoded once; only the search structures change);
3. per engine: **candidate recall@depth** against exact (:func:`candidate_recall`: the share of exact MaxSim's top
   ``depth`` that the engine's top ``depth`` holds; 1 means the engine loses nothing), and nDCG@10, each with a
   bootstrap interval over queries;
4. the model's **isotropy** on a sample of its document tokens, per head (average cosine, I(W), IsoScore, effective
   rank: :mod:`hil.isotropy.metrics`), and of the same sample as each MUVERA transform sees it (the mean and matrix
   read back from the built index).

``engines.json`` holds every number with its settings, ``engines.md`` the tables and ``engines_isotropy.png`` the
figure: MUVERA's recall against the average cosine of the tokens its SimHash sees (the most anisotropic head of the
model), one point per model x transform. Run: ``hil engines``.

A model given as ``name@seed=path`` is one training of the method ``name``; a method with two or more seeds gets a
summary over its seeds (mean, sample standard deviation, range of each engine's recall and of the isotropy).
``engines.json`` is rewritten after each model: a rerun with the same settings reuses (and says so) every model whose
source, seed and weights (:func:`~hil.retrieval.index.encoder_fingerprint`) are unchanged.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from hil.analysis.similarity import isotropy_scores
from hil.data.beir import BeirDataset, load_beir
from hil.data.ranking import id_rank, top_k_indices
from hil.errors import UserError
from hil.evaluation.evaluate import EvaluationSettings, document_store, evaluate
from hil.evaluation.experiment import ModelSpec
from hil.evaluation.runner import load_model
from hil.evaluation.statistics import bootstrap_ci
from hil.evaluation.tables import fmt, markdown_table
from hil.experiments.engines_settings import EngineStudySettings, model_spec
from hil.isotropy.metrics import effective_rank
from hil.modeling.contracts import Encoder
from hil.provenance import provenance, write_json_atomic, write_text_atomic
from hil.retrieval.backends.configs import (
    IndexConfig,
    IvfFlatIndexConfig,
    MuveraIndexConfig,
    PlaidIndexConfig,
    SearchConfig,
)
from hil.retrieval.backends.muvera import apply_token_transform
from hil.retrieval.backends.registry import open_backend
from hil.retrieval.index import TokenIndex, encoder_fingerprint
from hil.retrieval.transformed import sample_token_vectors

METRIC = "ndcg@10"


@dataclass(frozen=True)
class Engine:
    """One engine of the study: a name, its back-end's build-time settings and search-time settings (None: the
    back-end's defaults for the ranking depth)."""

    name: str
    backend: IndexConfig
    search: SearchConfig | None = None

    @property
    def transform(self) -> str:
        return getattr(self.backend, "transform", "none")


DEFAULT_ENGINES = (Engine("token ANN (IVF)", IvfFlatIndexConfig()), Engine("PLAID", PlaidIndexConfig()),
                   Engine("MUVERA", MuveraIndexConfig()),
                   Engine("MUVERA, centered", MuveraIndexConfig(transform="center")),
                   Engine("MUVERA, whitened", MuveraIndexConfig(transform="whiten")))


def top_documents(run: Mapping[str, float], depth: int) -> list[str]:
    """A query's ``depth`` best documents by the package's one ranking rule (:mod:`hil.data.ranking`)."""
    ids = list(run)
    scores = np.asarray([run[d] for d in ids], dtype=np.float64)
    return [ids[i] for i in top_k_indices(scores, id_rank(ids), depth)] if ids else []


def candidate_recall(run: Mapping[str, Mapping[str, float]], exact: Mapping[str, Mapping[str, float]],
                     depth: int) -> dict[str, float]:
    """Per query of ``exact``: ``|top_depth(run) & top_depth(exact)| / |top_depth(exact)|`` (a query the engine
    returned nothing for scores 0; a query without exact documents is left out)."""
    recall = {}
    for qid, scores in exact.items():
        wanted = set(top_documents(scores, depth))
        if wanted:
            recall[qid] = len(wanted & set(top_documents(run.get(qid, {}), depth))) / len(wanted)
    return recall


def token_isotropy(points: torch.Tensor, seed: int) -> dict[str, float]:
    """Average cosine, I(W), IsoScore (:func:`~hil.analysis.similarity.isotropy_scores`) and effective rank."""
    return {**isotropy_scores(points, max_points=None, seed=seed), "effective_rank": float(effective_rank(points))}


def transform_of(index: TokenIndex, head: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (mean, matrix) an engine's index applies to ``head``'s tokens before its search (MUVERA's index-time
    transform), as its back-end reads it back from the built index; None when the search sees them as stored."""
    fitted = open_backend(index).token_transform(head)
    if fitted is None:
        return None
    mean, matrix = fitted
    return torch.as_tensor(mean, dtype=torch.float32), torch.as_tensor(matrix, dtype=torch.float32)


def interval(per_query: Mapping[str, float], n_bootstrap: int, seed: int) -> dict[str, float]:
    result = bootstrap_ci(dict(per_query), n_samples=n_bootstrap, seed=seed)
    return {"mean": result.observed, "low": result.low, "high": result.high}


def model_record(name: str, encoder: Encoder, dataset: BeirDataset, engines: Sequence[Engine], settings:
                 EvaluationSettings, *, depth: int, max_tokens: int, n_bootstrap: int, seed: int) -> dict[str, Any]:
    """Exact search, every engine and the isotropy measures of one model (see the module docstring)."""
    settings = replace(settings, backend=engines[0].backend, k=depth)
    say(f"{name}: exact search over {len(dataset.corpus):,} documents (the reference of every engine)")
    index = document_store(encoder, dataset, settings)
    exact = evaluate(encoder, dataset, replace(settings, mode="exhaustive"), name="exact", store=index)
    samples = {head: sample_token_vectors(index, head, max_tokens, seed=seed) for head in encoder.head_names}
    record: dict[str, Any] = {
        "exact": {METRIC: interval({q: m[METRIC] for q, m in exact.per_query.items()}, n_bootstrap, seed)},
        "isotropy": {head: {"none": token_isotropy(points, seed)} for head, points in samples.items()},
        "engines": {}}
    for engine in engines:
        say(f"{name}: {engine.name}")
        index = document_store(encoder, dataset, replace(settings, backend=engine.backend))
        found = evaluate(encoder, dataset, replace(settings, backend=engine.backend, search=engine.search),
                         name=engine.name, store=index)
        recall = candidate_recall(found.run, exact.run, depth)
        record["engines"][engine.name] = {
            "backend": engine.backend.record(), "search_stats": found.details.get("search_stats"),
            "transform": engine.transform, f"recall@{depth}_vs_exact": interval(recall, n_bootstrap, seed),
            METRIC: interval({q: m[METRIC] for q, m in found.per_query.items()}, n_bootstrap, seed),
            "search_seconds": found.details.get("search_seconds")}
        for head, points in samples.items():
            fitted = transform_of(index, head)
            if fitted is not None and engine.transform not in record["isotropy"][head]:
                record["isotropy"][head][engine.transform] = token_isotropy(
                    apply_token_transform(points, *fitted), seed)
    say(f"{name}: " + ", ".join(
        f"{e} recall {r[f'recall@{depth}_vs_exact']['mean']:.3f}" for e, r in record["engines"].items()))
    return record


def say(line: str) -> None:
    """A line of the study's progress on stderr: each model's stages take seconds to minutes, with no bar."""
    print(f"[engines] {line}", file=sys.stderr, flush=True)


def engine_study(models: Sequence[ModelSpec], dataset: BeirDataset, out: Path, *,
                 engines: Sequence[Engine] = DEFAULT_ENGINES, depth: int = 100, index_root: str | Path,
                 max_tokens: int = 20_000, n_bootstrap: int = 1000, seed: int = 12345,
                 settings: EvaluationSettings | None = None, command: str = "") -> dict[str, Any]:
    """Every model of ``models`` on ``dataset`` (see the module docstring); writes ``engines.json``, ``engines.md``
    and the figure into ``out``. -> the record."""
    if not models:
        raise UserError("the engine study needs at least one model")
    columns = [spec.column for spec in models]
    trainings = [(spec.method, spec.seed) for spec in models if spec.seed is not None]
    if len(set(trainings)) != len(trainings):
        raise UserError("`model`: one method has the same seed twice")
    if len(set(columns)) != len(columns):
        raise UserError(f"`model`: two models share a name ({sorted(c for c in columns if columns.count(c) > 1)[0]})")
    settings = settings or EvaluationSettings(progress=False)
    settings = replace(settings, mode="full", index_root=str(index_root), metrics=(METRIC,))
    study = {"dataset": dataset.name, "dataset_fingerprint": dataset.fingerprint(), "depth": depth,
             "max_tokens": max_tokens, "n_bootstrap": n_bootstrap, "seed": seed,
             "engines": [{"name": e.name, "backend": e.backend.record(),
                          "search": e.search.record() if e.search is not None else None} for e in engines]}
    previous = reusable_models(out / "engines.json", study)
    records: dict[str, Any] = {}
    out.mkdir(parents=True, exist_ok=True)
    for spec in models:
        say(f"{spec.column}: loading {spec.source}")
        encoder = load_model(spec, seed)
        identity = {"source": spec.source, "seed": spec.seed, "method": spec.method or spec.column,
                    "encoder_fingerprint": encoder_fingerprint(encoder)}
        old = previous.get(spec.column)
        if old is not None and all(old.get(key) == value for key, value in identity.items()):
            say(f"{spec.column}: reused from {out / 'engines.json'}")
            records[spec.column] = old
            continue
        with torch.inference_mode():
            records[spec.column] = {**identity, **model_record(
                spec.column, encoder, dataset, engines, settings, depth=depth, max_tokens=max_tokens,
                n_bootstrap=n_bootstrap, seed=seed)}
        # written after each model: an interrupted study resumes from the models it finished
        write_json_atomic(out / "engines.json", study_record(study, dataset, records, command))
    record = study_record(study, dataset, records, command)
    write_json_atomic(out / "engines.json", record)
    figure = plot_isotropy_recall(record, out / "engines_isotropy.png")
    write_text_atomic(out / "engines.md", "\n".join(engine_lines(record, figure.name)) + "\n")
    return record


def run_study(settings: EngineStudySettings, command: str = "") -> dict[str, Any]:
    """The study ``settings`` describe (``hil engines``): its dataset loaded and sliced, then :func:`engine_study`
    with the default engines. -> the record."""
    dataset = load_beir(settings.dataset)
    if settings.max_queries or settings.max_docs:
        dataset = dataset.subset(settings.max_queries, settings.max_docs, seed=settings.seed)
    return engine_study(settings.models(), dataset, Path(settings.output), depth=settings.depth,
                        index_root=settings.index_root, max_tokens=settings.max_tokens,
                        n_bootstrap=settings.bootstrap_samples, seed=settings.seed, command=command)


def study_record(study: Mapping[str, Any], dataset: BeirDataset, records: Mapping[str, Any],
                 command: str) -> dict[str, Any]:
    return provenance(dict(study), command=command, n_queries=len(dataset.queries), n_docs=len(dataset.corpus),
                      models=dict(records))


def reusable_models(path: Path, study: Mapping[str, Any]) -> dict[str, Any]:
    """The model entries of an earlier ``engines.json`` made with the same study settings (else none)."""
    if not path.is_file():
        return {}
    try:
        earlier = json.loads(path.read_text())
    except ValueError:
        return {}
    if earlier.get("settings") != json.loads(json.dumps(study)):
        say(f"{path}: made with other settings; every model is measured again")
        return {}
    return dict(earlier.get("models") or {})


def muvera_points(record: Mapping[str, Any]) -> list[tuple[str, str, float, float]]:
    """(model, transform, average cosine the SimHash sees (the model's most anisotropic head), MUVERA recall)."""
    depth = record["settings"]["depth"]
    points = []
    for model, entry in record["models"].items():
        for engine in entry["engines"].values():
            if engine["backend"]["class_path"].endswith("MuveraIndexConfig"):
                transform = engine["transform"]
                cosine = max(head[transform]["avg_cos"] for head in entry["isotropy"].values())
                points.append((model, transform, cosine, engine[f"recall@{depth}_vs_exact"]["mean"]))
    return points


def plot_isotropy_recall(record: Mapping[str, Any], path: Path) -> Path:
    """MUVERA's recall against the average cosine of the tokens it hashes: a colour per method (a model's seeds
    share it), a marker per transform."""
    from hil.analysis.plots import plot_groups

    methods = {name: entry.get("method") or name for name, entry in record["models"].items()}
    points = muvera_points(record)
    return plot_groups([(methods[m], t, x, y) for m, t, x, y in points], path,
                        xlabel="average cosine of the tokens MUVERA hashes (most anisotropic head)",
                        ylabel=f"MUVERA recall@{record['settings']['depth']} vs exact MaxSim",
                        title=f"Isotropy and MUVERA on {record['settings']['dataset']}")


def engine_lines(record: Mapping[str, Any], figure: str) -> list[str]:
    """The study as Markdown: isotropy per model and head (and per transform), then every engine per model."""
    settings, depth = record["settings"], record["settings"]["depth"]
    lines = [f"# Isotropy x engine on {settings['dataset']} ({record['n_queries']} queries, {record['n_docs']} "
             f"documents)", "", f"Candidate recall@{depth}: the share of exact MaxSim's top {depth} that the "
             f"engine's top {depth} holds; 95% bootstrap intervals over queries ({settings['n_bootstrap']} samples). "
             f"Isotropy on {settings['max_tokens']} sampled document tokens per head.", "", "## Isotropy", ""]
    rows = []
    for model, entry in record["models"].items():
        for head, per_transform in entry["isotropy"].items():
            for transform, scores in per_transform.items():
                rows.append([model, head, transform, scores["avg_cos"], scores["I(W)"], scores["isoscore"],
                             f"{scores['effective_rank']:.1f} / {scores['dim']}"])
    lines += markdown_table(["Model", "head", "tokens", "avg cos", "I(W)", "IsoScore", "effective rank"], rows)
    lines += ["", "## Engines", ""]
    rows = []
    for model, entry in record["models"].items():
        exact = entry["exact"][METRIC]
        rows.append([model, "exact", "all", "1", _ci(exact)])
        for name, engine in entry["engines"].items():
            rows.append([model, name, fmt((engine.get("search_stats") or {}).get("candidates_mean"), 0),
                         _ci(engine[f"recall@{depth}_vs_exact"]), _ci(engine[METRIC])])
    lines += markdown_table(["Model", "engine", "candidates / query", f"recall@{depth} vs exact", "nDCG@10"], rows)
    over_seeds = summary_table(record, singles=False, cell=_spread)
    if over_seeds:
        lines += ["", "## Over training seeds", "",
                  f"Per method with two or more seeds: each figure's mean over its seeds, +- the sample standard "
                  f"deviation, [min, max]; recall@{depth} per engine. avg cos: the most anisotropic head's raw "
                  "tokens.", "", *over_seeds]
    return lines + ["", f"![isotropy against MUVERA recall]({figure})"]


def seed_summary(record: Mapping[str, Any], singles: bool = False) -> dict[str, dict[str, Any]]:
    """Per method with two or more seeded models: the spread over seeds of the raw tokens' average cosine (the most
    anisotropic head) and of each engine's mean candidate recall (:func:`hil.evaluation.seeds.seed_spread`).
    ``singles``: every other model too, as a group of one (its own name), in the record's order."""
    from hil.evaluation.seeds import seed_spread

    depth = record["settings"]["depth"]
    by_method: dict[str, list[Mapping[str, Any]]] = {}
    for name, entry in record["models"].items():
        if entry.get("seed") is not None:
            by_method.setdefault(entry.get("method"), []).append(entry)
        elif singles:
            by_method[name] = [{**entry, "seed": 0}]
    summary = {}
    for method, entries in by_method.items():
        if len(entries) < 2 and not singles:
            continue
        engines = [e for e in entries[0]["engines"] if all(e in other["engines"] for other in entries)]
        summary[method] = {
            "n_seeds": len(entries),
            "avg_cos": seed_spread({e["seed"]: max(h["none"]["avg_cos"] for h in e["isotropy"].values())
                                    for e in entries}),
            "engines": {name: seed_spread({e["seed"]: e["engines"][name][f"recall@{depth}_vs_exact"]["mean"]
                                           for e in entries}) for name in engines}}
    return summary


def summary_lines(record: Mapping[str, Any], figure: str, details: str) -> list[str]:
    """The study in one table: per method (mean +- sd over its seeds) or single model, the raw tokens' average
    cosine and each engine's candidate recall; then the figure and where the per-model tables are (``details``)."""
    depth = record["settings"]["depth"]

    def cell(spread: Mapping[str, Any]) -> str:
        return fmt(spread["mean"]) + (f" +- {fmt(spread['sd'])}" if spread["sd"] is not None else "")

    return [f"Candidate recall@{depth} against exact MaxSim's top {depth} on {record['settings']['dataset']} "
            f"({record['n_queries']} queries, {record['n_docs']} documents): mean +- sample sd over a method's "
            "trainings; avg cos: the raw document tokens of the most anisotropic head.", "",
            *summary_table(record, singles=True, cell=cell), "",
            f"Per model and head, with nDCG@10 and intervals: [{details}]({details}).", "",
            f"![isotropy against MUVERA recall]({figure})"]


def summary_table(record: Mapping[str, Any], *, singles: bool, cell: Callable[[Mapping[str, Any]], str]
                  ) -> list[str]:
    """:func:`seed_summary` as a Markdown table (none when it is empty), each spread written by ``cell``."""
    summary = seed_summary(record, singles=singles)
    if not summary:
        return []
    engines = list(next(iter(summary.values()))["engines"])
    rows = [[method, str(entry["n_seeds"]), cell(entry["avg_cos"]), *(cell(entry["engines"][e]) for e in engines)]
            for method, entry in summary.items()]
    return markdown_table(["Model", "trainings", "avg cos", *engines], rows)


def _spread(spread: Mapping[str, Any]) -> str:
    return f"{fmt(spread['mean'])} +- {fmt(spread['sd'])} [{fmt(spread['min'])}, {fmt(spread['max'])}]"


def _ci(value: Mapping[str, float]) -> str:
    return f"{fmt(value['mean'])} [{fmt(value['low'])}, {fmt(value['high'])}]"


def model_specs(text: str) -> list[ModelSpec]:
    """``name=path`` or ``name@seed=path`` (one training of the method ``name``), comma-separated
    (:func:`hil.experiments.engines_settings.model_spec` reads each)."""
    return [model_spec(part) for part in filter(None, text.split(","))]
