"""Diagnostics of where a model loses to ColBERT: nDCG@10 by query length (issue 13).

Query length is counted in word pieces of the backbone's tokenizer, without special tokens, markers or truncation:
the number of real query tokens the model scores (the rest of ``query_maxlen`` is ``[MASK]`` padding, which a
short query has more of). Buckets: <= 3, 4-6, 7-12, >= 13.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from hil.data.beir import BeirDataset

LENGTH_BUCKETS: tuple[tuple[int, int | None, str], ...] = ((0, 3, "<= 3"), (4, 6, "4-6"), (7, 12, "7-12"),
                                                           (13, None, ">= 13"))


def query_lengths(dataset: BeirDataset, tokenizer: Any) -> dict[str, int]:
    """Word pieces of each query (no special tokens, no truncation). ``tokenizer``: a Hugging Face tokenizer."""
    qids = list(dataset.queries)
    rows = tokenizer([dataset.queries[q] for q in qids], add_special_tokens=False, truncation=False,
                     return_attention_mask=False)["input_ids"]
    return {qid: len(row) for qid, row in zip(qids, rows)}


def bucket_of(length: int) -> str:
    for low, high, label in LENGTH_BUCKETS:
        if length >= low and (high is None or length <= high):
            return label
    raise ValueError(f"query length {length} is in no bucket")


def metric_by_length(per_query: Mapping[str, Mapping[str, float]], lengths: Mapping[str, int],
                     metric: str = "ndcg@10", baseline: Mapping[str, Mapping[str, float]] | None = None
                     ) -> dict[str, dict[str, float | int | None]]:
    """Mean ``metric`` over the queries of each length bucket (queries without a length are skipped), and with a
    ``baseline`` the mean paired difference on the queries both have. -> bucket -> {n, mean, diff}"""
    out: dict[str, dict[str, float | int | None]] = {}
    for _, _, label in LENGTH_BUCKETS:
        qids = [q for q in per_query if q in lengths and bucket_of(lengths[q]) == label]
        values = [float(per_query[q][metric]) for q in qids]
        diff = None
        if baseline is not None:
            paired = [float(per_query[q][metric]) - float(baseline[q][metric]) for q in qids if q in baseline]
            diff = float(np.mean(paired)) if paired else None
        out[label] = {"n": len(qids), "mean": float(np.mean(values)) if values else None, "diff": diff}
    return out


def length_table(results: Mapping[str, Mapping[str, Mapping[str, Any]]], lengths: Mapping[str, Mapping[str, int]],
                 rows: Sequence[str], baseline: str = "colbert", metric: str = "ndcg@10") -> dict[str, Any]:
    """``metric_by_length`` of every model in ``rows`` on every dataset with lengths: dataset -> model -> bucket."""
    table: dict[str, Any] = {}
    for key, models in results.items():
        if key not in lengths:
            continue
        base = models.get(baseline, {}).get("per_query")
        table[key] = {name: metric_by_length(models[name]["per_query"], lengths[key], metric,
                                             None if name == baseline else base)
                      for name in rows if name in models}
    return table
