"""One analysis run: retrieval with intervals and significance, isotropy, figures and vocabulary projections.

``run_analysis(AnalysisConfig(model=..., dataset=..., output=...))`` evaluates the model (and optionally a
second model, and the model under post-hoc transforms) on a BEIR dataset and writes ``report.md``,
``report.json`` and PNG figures to ``output``. Sections and the papers they follow:

==============================  =============================================================================
retrieval / intervals           nDCG@10, success@k with bootstrap 95% CIs (004 Sec. 2.1)
significance                    paired t-test, permutation and bootstrap tests (001 Table 2 dagger)
BM25-Easy                       top half of BM25's per-query nDCG@10 (001 Table 4)
isotropy                        I(W), Avg-Cos, IsoScore of query / document tokens, before and after each
                                transform (000 Table 1, 004 Sec. 2.5, 001 A.1)
token cosines                   query-document token cosine distributions per head (001 Fig. 2)
layers                          InterIso per backbone layer, log-difference to a reference (001 Fig. 5)
head overlap                    documents retrieved by each head of a two-head model (001 Fig. 3)
thresholds, COE / ROE           004 Secs. 2.2-2.3
vocabulary projections          top tokens through the MLM head, token amnesia (003 Secs. 5-6)
==============================  =============================================================================

Layout: this module describes its evaluations as one experiment run by the runner (:func:`evaluate_variants`,
:mod:`hil.evaluation.runner`), calls one function of
:mod:`hil.analysis.sections` per section and draws the figures (:mod:`hil.analysis.plots`); the report dict it
writes as report.json is rendered to report.md by :func:`hil.analysis.render.render_markdown` alone.

Choices: every model sees the same (query, document) pairs for the token and layer analyses -- each query with
BM25's top document, for the first ``pairs`` queries in id order; vocabulary projections pair a query with its
best-judged relevant document (003 uses gold passages); all sampling is seeded with ``seed``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hil.analysis import plots
from hil.analysis.render import render_markdown
from hil.analysis.sections import (
    Variant,
    head_overlap_section,
    isotropy_section,
    layers_section,
    statistics_section,
    thresholds_section,
    token_cosines_section,
    vocabulary_section,
)
from hil.analysis.similarity import top_pairs
from hil.evaluation.evaluate import Evaluation, EvaluationSettings, run_name
from hil.evaluation.metrics import DEFAULT_METRICS
from hil.evaluation.runner import DatasetSpec, Experiment, ModelSpec, StatisticsSettings, run_experiment
from hil.provenance import StageClock, provenance, write_json_atomic
from hil.retrieval.backends.configs import configs_from_params, with_search_values
from hil.retrieval.index import encoder_fingerprint

__all__ = ["AnalysisConfig", "Variant", "REPORT_METRICS", "STAT_METRICS", "evaluate_variants", "run_analysis",
           "render_markdown"]

logger = logging.getLogger(__name__)

REPORT_METRICS = (*DEFAULT_METRICS, "success@1", "success@5", "success@10")
STAT_METRICS = ("ndcg@10", "success@1", "success@5")


@dataclass
class AnalysisConfig:
    """Everything one analysis run depends on (recorded in report.json)."""

    model: str
    dataset: str
    output: str
    compare_model: str | None = None
    transforms: list[str] = field(default_factory=list)
    transform_mode: str = "token"
    transform_max_tokens: int = 200_000
    split: str | None = None  # the dataset's own (hil.data.beir.default_split)
    data_dir: str | None = None
    max_queries: int | None = None
    max_docs: int | None = None
    seed: int = 12345
    index_root: str = "indexes"
    k: int = 1000
    ncandidates: int | None = None
    backend: str = "flat"  # a registered kind: flat, ivfflat, ivfpq, plaid, muvera, or one defined outside
    backend_params: dict[str, Any] | None = None  # its build-time and search-time settings (configs_from_params)
    batch_size: int | None = None  # documents per encoding batch (None: by device, EvaluationSettings)
    dim: int | None = None  # an untrained head's size (None: 128); a trained model keeps its own
    query_maxlen: int | None = None
    doc_maxlen: int | None = None
    n_bootstrap: int = 1000
    n_permutations: int = 10000
    p_adjust: str = "holm"  # multiple-comparison adjustment of the paired tests (statistics.adjust_p_values)
    pairs: int = 64
    isotropy_tokens: int = 20_000
    vocab_pairs: int = 100
    vocab_examples: int = 3
    vocab_top_k: int = 20
    threshold_k: int = 5
    coe_psi: float = 10.0
    progress: bool = True
    command: str | None = None


def _label(source: str, taken: set[str]) -> str:
    """A short unique run name from a model source: its folder / file name ("iso+aniso" for an ensemble)."""
    from hil.modeling.loading import split_ensemble_source

    parts = split_ensemble_source(source) or [source]
    base = run_name("+".join(Path(str(p).rstrip("/")).name.removesuffix(".ckpt") for p in parts) or "model")
    label, i = base, 2
    while label in taken or label == "bm25":
        label, i = f"{base}-{i}", i + 1
    taken.add(label)
    return label


def _finite(value: Any) -> Any:
    """JSON-safe numbers: NaN / inf become None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, np.generic):
        return _finite(value.item())
    if isinstance(value, np.ndarray):
        return _finite(value.tolist())
    return value


def analysis_experiment(config: AnalysisConfig) -> Experiment:
    """The evaluations the report analyses, as one experiment: BM25, the model, the model under each transform and
    the comparison model, full ranking with the same settings, every column computed afresh (the sections need the
    evaluations, encoders and indexes themselves), written under ``<output>/runs``."""
    taken: set[str] = set()
    head = {"dim": config.dim, "query_maxlen": config.query_maxlen, "doc_maxlen": config.doc_maxlen}
    models = [ModelSpec(config.model, name=_label(config.model, taken), transforms=tuple(config.transforms),
                        transform_name="{column}+{transform}" + ("" if config.transform_mode == "token"
                                                                 else "-sequence"),
                        transform_mode=config.transform_mode, transform_max_tokens=config.transform_max_tokens,
                        **head)]
    if config.compare_model:
        models.append(ModelSpec(config.compare_model, name=_label(config.compare_model, taken), **head))
    backend, search = configs_from_params(config.backend, config.backend_params)
    search = with_search_values(config.backend, search, {"ncandidates": config.ncandidates})
    settings = EvaluationSettings(mode="full", k=config.k, index_root=config.index_root, backend=backend,
                                  search=search, batch_size=config.batch_size, metrics=REPORT_METRICS,
                                  progress=config.progress)
    dataset = DatasetSpec(config.dataset, split=config.split, max_queries=config.max_queries,
                          max_docs=config.max_docs)
    return Experiment([dataset], models, Path(config.output) / "runs", settings=settings,
                      statistics=StatisticsSettings(enabled=False), folders="flat", seed=config.seed,
                      data_dir=config.data_dir, quiet=not config.progress, resume=False,
                      command={"analysis": asdict(config)})


def evaluate_variants(config: AnalysisConfig) -> tuple[Any, Evaluation, list[Variant], Variant | None]:
    """Run :func:`analysis_experiment` (:func:`hil.evaluation.runner.run_experiment`). -> (the dataset as evaluated,
    BM25's evaluation, the variants, the comparison model's variant or None); ``variants[0]`` is the model, the
    comparison model (when given) the last variant."""
    experiment = analysis_experiment(config)
    (result,) = run_experiment(experiment)
    bm25, *columns = result.columns
    compared = experiment.models[-1].column if config.compare_model else None
    variants, compare = [], None
    for column in columns:
        model = column.record["model"]
        variant = Variant(column.name, model["source"], column.encoder, column.evaluation, column.evaluation.store,
                          transform=model.get("transform", {}).get("transform"))
        variants.append(variant)
        if column.name == compared:
            compare = variant
    return result.dataset, bm25.evaluation, variants, compare


def run_analysis(config: AnalysisConfig) -> dict[str, Any]:
    """Run every instrument and write ``report.json``, ``report.md`` and the PNG figures to ``config.output``."""
    output = Path(config.output)
    output.mkdir(parents=True, exist_ok=True)
    clock, notes, seed = StageClock(digits=2), [], config.seed
    lap = clock.stage
    dataset, bm25, variants, compare = evaluate_variants(config)
    lap("evaluations")
    base = variants[0]

    statistics = statistics_section(bm25, variants, metrics=STAT_METRICS, n_bootstrap=config.n_bootstrap,
                                    n_permutations=config.n_permutations, seed=seed, p_adjust=config.p_adjust)
    lap("statistics")
    figures = {"intervals": plots.plot_intervals(statistics["bootstrap"], "ndcg@10",
                                                 output / "ndcg_intervals.png").name}
    thresholds = thresholds_section(variants, dataset, k=config.threshold_k, psi=config.coe_psi, seed=seed,
                                    notes=notes)
    lap("thresholds")

    pair_ids = top_pairs(bm25.run, depth=1, max_queries=config.pairs)  # each query with BM25's top document
    query_texts, doc_texts = [dataset.queries[q] for q, _ in pair_ids], [dataset.doc_text(d) for _, d in pair_ids]
    cosines, series = token_cosines_section(variants, query_texts, doc_texts)
    figures["token_cosines"] = plots.plot_cosine_distributions(series, output / "token_cosines.png").name
    lap("token cosines")
    layers, curves = layers_section([base, compare] if compare is not None else [base], query_texts, doc_texts,
                                    reference=compare.name if compare is not None else None)
    figures["layers"] = plots.plot_layer_inter_iso(curves, output / "layer_inter_iso.png",
                                                   reference=layers["reference"]).name
    lap("layers")

    overlaps = head_overlap_section(variants, k=min(config.k, 100), notes=notes)
    if overlaps:
        figures["overlap"] = plots.plot_overlap({k: o["first_stage"] for k, o in overlaps.items()},
                                                output / "head_overlap.png",
                                                title="First-stage candidates retrieved by each head").name
    isotropy = isotropy_section(variants, dataset, max_tokens=config.isotropy_tokens, seed=seed)
    figures["isotropy"] = plots.plot_isotropy(isotropy, output / "isotropy.png").name
    lap("isotropy")
    vocab = vocabulary_section(base, dataset, n_pairs=config.vocab_pairs, n_examples=config.vocab_examples,
                               top_k=config.vocab_top_k, notes=notes)
    lap("vocabulary")

    report = _finite({
        **provenance(asdict(config)), "dataset": _dataset_record(dataset), "runs": _runs_record(bm25, variants),
        "statistics": statistics, "thresholds": thresholds, "token_cosines": cosines,
        "token_cosine_pairs": len(pair_ids), "layers": layers, "head_overlap": overlaps, "isotropy": isotropy,
        "vocabulary": vocab, "figures": figures, "notes": notes, "timings_s": clock.stages})
    write_json_atomic(output / "report.json", report)
    (output / "report.md").write_text(render_markdown(report, STAT_METRICS), encoding="utf-8")
    return report


def _dataset_record(dataset: Any) -> dict[str, Any]:
    return {"name": dataset.name, "split": dataset.split, "fingerprint": dataset.fingerprint(),
            "documents": len(dataset.corpus), "queries": len(dataset.queries)}


def _runs_record(bm25: Evaluation, variants: list[Variant]) -> dict[str, Any]:
    """Per run: aggregate metrics, the evaluation's details (but the per-document head sources) and, for a model,
    its source, transform, fingerprint and settings."""
    runs = {}
    for evaluation, v in [(bm25, None), *((v.evaluation, v) for v in variants)]:
        model = {"source": v.source, "transform_spec": v.transform, "fingerprint": encoder_fingerprint(v.encoder),
                 "settings": v.encoder.settings()} if v else {}
        runs[evaluation.name] = {"metrics": evaluation.aggregate, **model,
                                 **{k: val for k, val in evaluation.details.items() if k != "sources"}}
    return runs
