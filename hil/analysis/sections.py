"""The analysis report's instruments, one function per section, each returning a JSON-able record.

Every function takes the evaluated models (:class:`Variant`) and plain settings, never the report's config, so each
can be called on its own; :func:`hil.analysis.report.run_analysis` calls them in order and
:mod:`hil.analysis.render` turns their records into Markdown. A section that cannot run appends one line to
``notes`` and returns an empty record. Where a figure needs the raw values behind a record (every token cosine,
each layer curve), the function returns them beside it.

==============================  ==================================  =========================================
section                         function                            papers
==============================  ==================================  =========================================
intervals, significance,        :func:`statistics_section`          004 Sec. 2.1, 001 Table 2 dagger, 001
BM25-Easy                                                           Table 4
thresholds, COE / ROE           :func:`thresholds_section`          004 Secs. 2.2-2.3
token cosines                   :func:`token_cosines_section`       001 Fig. 2
layers                          :func:`layers_section`              001 Fig. 5
head overlap                    :func:`head_overlap_section`        001 Fig. 3
isotropy                        :func:`isotropy_section`            000 Table 1, 004 Sec. 2.5, 001 A.1
vocabulary projections          :func:`vocabulary_section`          003 Secs. 5-6
==============================  ==================================  =========================================
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import torch

from hil.analysis.layers import backbones, encoder_layer_inter_iso, log_difference
from hil.analysis.overlap import candidate_overlap, ranked_overlap
from hil.analysis.similarity import isotropy_scores, query_token_vectors, token_cosines
from hil.analysis.thresholds import similarity_sets
from hil.analysis.vocab import load_mlm_head, project_pairs, summarize_projections
from hil.evaluation.evaluate import Evaluation
from hil.evaluation.results import evaluation_statistics
from hil.evaluation.runs import ranked
from hil.evaluation.score_distributions import bootstrap_thresholds, overlap_coe_roe, threshold_analysis
from hil.modeling.contracts import Encoder
from hil.retrieval.store import TokenStore
from hil.retrieval.transformed import sample_token_vectors


@dataclass
class Variant:
    """A model as evaluated: its run name, encoder, evaluation and token index."""

    name: str
    source: str
    encoder: Encoder
    evaluation: Evaluation
    index: TokenStore
    transform: str | None = None


def statistics_section(bm25: Evaluation, variants: Sequence[Variant], *, metrics: Sequence[str], n_bootstrap: int,
                       n_permutations: int, seed: int, p_adjust: str = "holm") -> dict[str, Any]:
    """Intervals of every run; paired tests of each model against BM25 and of the others against the first, their
    p-values also adjusted by ``p_adjust`` over each reference's comparisons on one metric."""
    pairs = [(v.name, "bm25") for v in variants] + [(v.name, variants[0].name) for v in variants[1:]]
    return evaluation_statistics([bm25, *(v.evaluation for v in variants)], metrics=metrics, pairs=pairs,
                                 n_bootstrap=n_bootstrap, n_permutations=n_permutations, seed=seed,
                                 p_adjust=p_adjust)


def thresholds_section(variants: Sequence[Variant], dataset: Any, *, k: int, psi: float, seed: int,
                       notes: list[str]) -> dict[str, Any]:
    """004 Secs. 2.2-2.3 per model: mean scores, a threshold table, COE / ROE and the best bootstrapped threshold."""
    thresholds: dict[str, Any] = {}
    with torch.inference_mode():
        for v in variants:
            correct, topk, random = similarity_sets(v.encoder, v.index, dataset.queries, dataset.qrels,
                                                    v.evaluation.run, k=k, seed=seed)
            if not correct:
                notes.append(f"{v.name}: no query has a relevant document in the index; thresholds skipped")
                continue
            correct_scores = np.concatenate([np.ravel(x) for x in correct.values()])
            table = threshold_analysis(correct, random, thresholds=np.percentile(correct_scores, [10, 25, 50, 75, 90]))
            coe = overlap_coe_roe(correct, topk, random, psi=psi, n_samples=500, seed=seed)
            accuracy = bootstrap_thresholds(v.evaluation.run, dataset.qrels, k=k, n_samples=500, seed=seed)
            best = max(accuracy, key=lambda row: (row.accuracy, -row.psi))
            thresholds[v.name] = {
                "n_queries": len(correct),
                "mean_correct": float(np.mean([s for x in correct.values() for s in x])),
                "mean_topk": float(np.mean([s for x in topk.values() for s in x])),
                "mean_random": float(np.mean([s for x in random.values() for s in x])),
                "threshold_table": [asdict(row) for row in table], "coe_roe": asdict(coe),
                "bootstrap_thresholds": [asdict(row) for row in accuracy], "best_threshold": asdict(best)}
    return thresholds


def token_cosines_section(variants: Sequence[Variant], query_texts: Sequence[str], doc_texts: Sequence[str]
                          ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """001 Fig. 2: the summary per model and head, and every cosine per "model" (or "model:head") for the figure."""
    cosines: dict[str, Any] = {}
    series: dict[str, np.ndarray] = {}
    with torch.inference_mode():
        for v in variants:
            result = token_cosines(v.encoder, query_texts, doc_texts, batch_size=16)
            cosines[v.name] = result.summary()
            for head, values in result.all_pairs.items():
                series[v.name if len(result.all_pairs) == 1 else f"{v.name}:{head}"] = values
    return cosines, series


def layers_section(variants: Sequence[Variant], query_texts: Sequence[str], doc_texts: Sequence[str], *,
                   reference: str | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """001 Fig. 5: InterIso per layer of each model's backbone(s), and the curves for the figure.

    ``reference``: the name of the model whose (first) curve the others are compared to as a log10 difference.
    """
    curves: dict[str, np.ndarray] = {}
    with torch.inference_mode():
        for v in variants:
            curves.update(encoder_layer_inter_iso(v.encoder, query_texts, doc_texts, label=v.name))
    label = next((name for name in curves if reference is not None and name.startswith(reference)), None)
    differences = ({name: log_difference(curve, curves[label]).tolist() for name, curve in curves.items()
                    if name != label} if label else None)
    return {"values": {name: curve.tolist() for name, curve in curves.items()}, "reference": label,
            "log10_difference": differences}, curves


def head_overlap_section(variants: Sequence[Variant], *, k: int, notes: list[str]) -> dict[str, Any]:
    """001 Fig. 3: first-stage candidates and the top ``k`` of each two-head model, by the head(s) that found them."""
    overlaps: dict[str, Any] = {}
    for v in variants:
        heads = tuple(v.encoder.head_names)
        if len(heads) != 2:
            continue
        overlaps[v.name] = {"first_stage": candidate_overlap(v.evaluation.details["search_stats"], heads),
                            "ranked": ranked_overlap(v.evaluation.run, v.evaluation.details["sources"], heads, k=k)}
    if not overlaps:
        notes.append("head overlap (001 Fig. 3): no two-head model (HIL or ColBERT-lambda) analysed; skipped")
    return overlaps


def isotropy_section(variants: Sequence[Variant], dataset: Any, *, max_tokens: int, seed: int
                     ) -> list[dict[str, Any]]:
    """I(W), Avg-Cos, IsoScore per model, head and side: every query token (of up to 2,000 queries in id order)
    and up to ``max_tokens`` document tokens sampled from the model's index."""
    rows: list[dict[str, Any]] = []
    query_list = [dataset.queries[q] for q in sorted(dataset.queries)][:2000]
    with torch.inference_mode():
        for v in variants:
            q_vectors = query_token_vectors(v.encoder, query_list, batch_size=64)
            for head in v.encoder.head_names:
                for side, points in (("queries", q_vectors[head]),
                                     ("documents", sample_token_vectors(v.index, head, max_tokens, seed=seed))):
                    rows.append({"variant": v.name, "head": head, "side": side,
                                 **isotropy_scores(points, max_tokens, seed=seed)})
    return rows


def judged_pairs(dataset: Any, n: int) -> list[tuple[str, str]]:
    """The first ``n`` queries in id order that have a judged relevant document in the corpus, each with its best
    one (highest grade, then smallest id)."""
    pairs = []
    for qid in sorted(dataset.queries):
        judged = [(rel, d) for d, rel in dataset.qrels.get(qid, {}).items() if int(rel) > 0 and d in dataset.corpus]
        if judged:
            pairs.append((qid, min(judged, key=lambda item: (-int(item[0]), item[1]))[1]))
        if len(pairs) >= n:
            break
    return pairs


def vocabulary_section(base: Variant, dataset: Any, *, n_pairs: int, n_examples: int, top_k: int,
                       notes: list[str]) -> dict[str, Any]:
    """003: (query, best relevant document) pairs projected through the MLM head of ``base``'s backbone."""
    head, why = load_mlm_head(base.encoder)
    if head is None:
        notes.append(f"vocabulary projections (003) skipped for {base.name}: {why}")
        return {"available": False, "note": why}
    backbone, tokenizer = next(iter(backbones(base.encoder).values()))
    pairs = judged_pairs(dataset, n_pairs)
    if not pairs:
        notes.append("vocabulary projections (003): no judged query-document pair; skipped")
        return {"available": False, "note": "no judged pairs"}
    projections = project_pairs(head, backbone, tokenizer, pairs, [dataset.queries[q] for q, _ in pairs],
                                [dataset.doc_text(d) for _, d in pairs], top_k=top_k)
    for projection in projections:
        order = [d for d, _ in ranked(base.evaluation.run.get(projection.qid, {}))]
        projection.retrieved_rank = order.index(projection.docid) + 1 if projection.docid in order else None
    return {"available": True, "source": head.source, "pooling": "mean over scored tokens",
            "summary": summarize_projections(projections),
            "examples": [asdict(p) for p in projections[:n_examples]]}
