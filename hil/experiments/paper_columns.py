"""What the paper experiment measures beyond the runner's metrics, as :class:`hil.evaluation.runner.ColumnHooks`.

For each model column it computes (:meth:`PaperColumns.column_extras`): each head's dense score matrix (saved as
``<column>.scores.npz``, so that ColBERT-lambda needs no re-encoding), InterIso of each head over (query, most
relevant document) pairs (001 Table 3), each module's own ranking quality, the overlap of the two heads' top
documents (Fig. 3), timings, and on the first dataset the figure data (Fig. 2 token cosines, Fig. 5 InterIso per
layer). The derived column (:meth:`PaperColumns.derived_columns`) is ColBERT-lambda: the sum of its two trained
members' score matrices (001 Section 3.2, weights 1 and 1), kept when its members are unchanged.

Choices where 001 is vague: InterIso is measured on each query paired with its most relevant judged document
(highest grade, then smallest id; a seeded sample of ``interiso_pairs``), so every model is measured on the same
pairs.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from hil.analysis.overlap import overlap_shares
from hil.data.beir import BeirDataset
from hil.evaluation.evaluate import Evaluation, score_run
from hil.evaluation.runner import Column, DatasetRun
from hil.experiments.profiles import Profile
from hil.isotropy.metrics import inter_iso
from hil.modeling.contracts import Encoder
from hil.provenance import atomic_output
from hil.retrieval.search import rank_matrix
from hil.retrieval.store import gather_documents


class ExperimentError(RuntimeError):
    """A stage failed; the message names the log or file to look at."""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def relevant_pairs(dataset: BeirDataset, limit: int, seed: int) -> list[tuple[str, str]]:
    """(query id, its most relevant document id) for up to ``limit`` judged queries, a seeded sample."""
    pairs = []
    for qid in dataset.queries:
        judged = {doc: grade for doc, grade in dataset.qrels.get(qid, {}).items()
                  if grade > 0 and doc in dataset.corpus}
        if judged:
            pairs.append((qid, min(judged, key=lambda doc: (-judged[doc], doc))))
    if len(pairs) > limit:
        keep = set(random.Random(seed).sample(range(len(pairs)), limit))
        pairs = [pair for i, pair in enumerate(pairs) if i in keep]
    return pairs


def head_overlap(heads: dict[str, np.ndarray], depth: int) -> dict[str, Any] | None:
    """Fig. 3: over all queries, documents in only head a's top ``depth``, only head b's, or both."""
    if len(heads) != 2:
        return None
    (a, sa), (b, sb) = heads.items()
    depth = min(depth, sa.shape[1])
    only_a = only_b = both = 0
    for row in range(sa.shape[0]):
        top_a = set(np.argpartition(-sa[row], depth - 1)[:depth].tolist())
        top_b = set(np.argpartition(-sb[row], depth - 1)[:depth].tolist())
        both += len(top_a & top_b)
        only_a += len(top_a - top_b)
        only_b += len(top_b - top_a)
    return {**overlap_shares(only_a, only_b, both, (a, b)), "depth": depth}


def module_metrics(dataset: BeirDataset, qids: list[str], doc_ids: list[str], heads: dict[str, np.ndarray],
                   candidates: dict[str, list[str]] | None, k: int,
                   skip_self: bool) -> dict[str, dict[str, float]] | None:
    """Each module's own ranking quality (its score alone, among ``candidates`` when re-ranking): how much each
    head contributes (001 Table 4's H)."""
    if len(heads) < 2:
        return None
    return {head: score_run(head, dataset, rank_matrix(values, qids, doc_ids, k, candidates,
                                                       skip_self=skip_self)).aggregate
            for head, values in heads.items()}


def pair_inter_iso(encoder: Encoder, evaluation: Evaluation, pairs: list[tuple[str, str]]) -> dict[str, float]:
    """Table 3: InterIso (001 Eq. 2) of each head over (query, most relevant document) pairs, from the queries and
    documents exactly as the evaluation scored them."""
    scores, store = evaluation.head_scores, evaluation.store
    row_of = {q: i for i, q in enumerate(scores.qids)}
    rows = torch.tensor([row_of[q] for q, _ in pairs], dtype=torch.long)
    queries = scores.queries  # on the encoder's device
    docs = gather_documents(store, [store.doc_index[d] for _, d in pairs], heads=encoder.head_names,
                            device=queries.mask.device)
    return {head: float(inter_iso(queries.heads[head][rows].float(), docs.heads[head], queries.mask[rows],
                                  docs.mask).mean()) for head in encoder.head_names}


def figure_data(encoder: Encoder, name: str, dataset: BeirDataset, pairs: list[tuple[str, str]],
                folder: Path) -> dict[str, Any]:
    """Fig. 2 token cosines (saved to ``<name>.cosines.npz``) and Fig. 5 InterIso per layer of each backbone."""
    from hil.analysis.layers import encoder_layer_inter_iso
    from hil.analysis.similarity import token_cosines

    query_texts = [dataset.queries[q] for q, _ in pairs]
    doc_texts = [dataset.doc_text(d) for _, d in pairs]
    cosines = token_cosines(encoder, query_texts, doc_texts)
    save_npz_atomic(folder / f"{name}.cosines.npz",
                    **{head: values.astype(np.float16) for head, values in cosines.all_pairs.items()})
    curves = encoder_layer_inter_iso(encoder, query_texts, doc_texts, label=name)
    return {"layer_inter_iso": {label: np.asarray(curve, float).tolist() for label, curve in curves.items()}}


def save_npz_atomic(path: Path, **arrays: Any) -> None:
    with atomic_output(path) as tmp, open(tmp, "wb") as handle:
        np.savez(handle, **arrays)


def load_head_scores(path: Path) -> tuple[list[str], list[str], dict[str, np.ndarray]]:
    """(query ids, document ids, head -> score matrix) of a ``<column>.scores.npz``."""
    if not path.is_file():
        raise ExperimentError(f"{path}: missing (a member's score matrix; rerun with --force to recompute it)")
    with np.load(path) as saved:
        heads = {f[len("head_"):]: saved[f] for f in saved.files if f.startswith("head_")}
        return [str(q) for q in saved["qids"]], [str(d) for d in saved["doc_ids"]], heads


@dataclass
class PaperColumns:
    """The paper's :class:`~hil.evaluation.runner.ColumnHooks` (module docstring). ``figures_on``: the dataset key
    whose columns also get the figure data; ``ensembles``: derived column -> (iso member, aniso member)."""

    profile: Profile
    figures_on: str
    ensembles: dict[str, tuple[str, str]]

    def identity(self, part: DatasetRun) -> dict[str, Any]:
        profile = self.profile
        figures = part.spec.folder_key == self.figures_on
        return {"interiso_pairs": profile.interiso_pairs, "overlap_depth": profile.overlap_depth,
                "figure_pairs": profile.figure_pairs if figures else None, "seed": profile.seed}

    def column_extras(self, part: DatasetRun, name: str, evaluation: Evaluation,
                      encoder: Encoder) -> dict[str, Any]:
        profile, dataset = self.profile, part.dataset
        pairs = relevant_pairs(dataset, profile.interiso_pairs, profile.seed)
        figures = (figure_data(encoder, name, dataset, pairs[: profile.figure_pairs], part.folder)
                   if part.spec.folder_key == self.figures_on else {})
        interiso = pair_inter_iso(encoder, evaluation, pairs)
        qids, heads, doc_ids = evaluation.head_scores.qids, evaluation.head_scores.heads, list(evaluation.store.doc_ids)
        save_npz_atomic(part.folder / f"{name}.scores.npz", qids=np.array(qids), doc_ids=np.array(doc_ids),
                        **{f"head_{h}": v for h, v in heads.items()})
        timings = {"encode_s": evaluation.details["index_seconds"], "score_s": evaluation.details["search_seconds"]}
        log(f"  {name} on {part.spec.folder_key}: nDCG@10 {evaluation.aggregate.get('ndcg@10', float('nan')):.4f}, "
            f"InterIso {interiso}, encode {timings['encode_s']:.0f} s, score {timings['score_s']:.0f} s")
        return {"inter_iso": interiso, "interiso_pairs": len(pairs),
                "overlap": head_overlap(heads, profile.overlap_depth),
                "module_metrics": module_metrics(dataset, qids, doc_ids, heads, part.candidates, part.settings.k,
                                                 part.settings.drop_self_matches),
                "timings": {**timings, "docs_per_s": len(doc_ids) / max(timings["encode_s"], 1e-9)},
                "n_docs": len(doc_ids), "n_tokens": int(evaluation.store.n_tokens), **figures}

    def derived_columns(self, part: DatasetRun, columns: Sequence[Column]) -> list[Column]:
        by_name = {column.name: column for column in columns}
        derived = []
        for name, members in self.ensembles.items():
            if all(member in by_name for member in members):
                derived.append(self.ensemble(part, name, [by_name[member] for member in members]))
        return derived

    def ensemble(self, part: DatasetRun, name: str, members: list[Column]) -> Column:
        """ColBERT-lambda: the sum of its members' score matrices (kept when its members' identities are)."""
        identity = {"dataset": part.identity, "column": {"sum_of": {m.name: m.record["identity"] for m in members}},
                    "evaluation": {"k": part.settings.k, "metrics": list(part.settings.metrics),
                                   "drop_self_matches": part.settings.drop_self_matches,
                                   "candidates": part.baseline_id if part.candidates is not None else None}}
        record = part.finished(name, identity)
        if record is not None:
            return Column(name, record)
        heads, qids, doc_ids = {}, None, None
        for member, head in zip(members, ("iso", "aniso")):
            member_qids, member_docs, member_heads = load_head_scores(part.folder / f"{member.name}.scores.npz")
            if qids is not None and (member_qids != qids or member_docs != doc_ids):
                raise ExperimentError(f"{name}: members scored different queries or documents on "
                                      f"{part.spec.folder_key}")
            qids, doc_ids = member_qids, member_docs
            if len(member_heads) != 1:
                raise ExperimentError(f"{name}: member {member.name} has {len(member_heads)} heads (one expected)")
            (heads[head],) = member_heads.values()
        run = rank_matrix(heads["iso"] + heads["aniso"], qids, doc_ids, part.settings.k, part.candidates,
                          skip_self=part.settings.drop_self_matches)
        evaluation = score_run(name, part.dataset, run, part.settings.metrics, part.settings.drop_self_matches,
                               mode="sum of score matrices")
        inter = {head: next(iter(member.record["inter_iso"].values()))
                 for member, head in zip(members, ("iso", "aniso"))}
        log(f"  {name} on {part.spec.folder_key}: nDCG@10 {evaluation.aggregate.get('ndcg@10', float('nan')):.4f}")
        model = {"name": name, "source": "+".join(m.name for m in members),
                 "members": {m.name: m.record["model"].get("fingerprint") for m in members}}
        return part.save(name, evaluation, identity, model,
                         extras={"inter_iso": inter, "overlap": head_overlap(heads, self.profile.overlap_depth)})
