"""Which head retrieved which document (HIL Figure 3): the overlap of a two-head model's retrieved sets.

Full ranking records, per ranked document, the heads whose ANN search produced it (``SearchResult.sources``) and
the counts over every first-stage candidate (``stats["candidate_sources"]``, keyed ``"a"``, ``"b"``, ``"a+b"``).
HIL Fig. 3 is a Venn diagram of the *first-stage* passages of the isotropic and anisotropic modules
(ColBERT-lambda's iso/aniso members, HIL's L/H heads); :func:`candidate_overlap` reads it from the stats, and
:func:`ranked_overlap` gives the same split for the top ``k`` of the final ranking.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from hil.evaluation.runs import ranked


def overlap_shares(only_a: int, only_b: int, both: int, heads: Sequence[str]) -> dict[str, Any]:
    """Counts and shares of documents found by only head a, only head b, or both (the Fig. 3 record)."""
    total = only_a + only_b + both
    share = (lambda n: n / total) if total else (lambda n: 0.0)  # noqa: E731
    a, b = heads
    return {"heads": list(heads), f"only_{a}": only_a, f"only_{b}": only_b, "both": both, "total": total,
            "share_only_a": share(only_a), "share_only_b": share(only_b), "share_both": share(both),
            # HIL reports e.g. "ColBERT-iso retrieves 91.65%": the share of passages a head found at all.
            f"share_{a}": share(only_a + both), f"share_{b}": share(only_b + both)}


def candidate_overlap(stats: Mapping[str, Any], heads: Sequence[str]) -> dict[str, Any]:
    """First-stage candidates found by only head a, only head b, or both, summed over queries (HIL Fig. 3)."""
    if len(heads) != 2:
        raise ValueError(f"candidate_overlap: needs a two-head model, got heads {list(heads)}")
    counts = stats.get("candidate_sources")
    if not counts:
        raise ValueError("candidate_overlap: the search stats have no 'candidate_sources' (not a full ranking?)")
    a, b = heads
    return overlap_shares(int(counts.get(a, 0)), int(counts.get(b, 0)), int(counts.get(f"{a}+{b}", 0)), heads)


def ranked_overlap(run: Mapping[str, Mapping[str, float]], sources: Mapping[str, Mapping[str, Sequence[str]]],
                   heads: Sequence[str], k: int = 100) -> dict[str, Any]:
    """The same split over each query's top ``k`` ranked documents (documents with no recorded source are skipped)."""
    if len(heads) != 2:
        raise ValueError(f"ranked_overlap: needs a two-head model, got heads {list(heads)}")
    a, b = heads
    only_a = only_b = both = 0
    for qid, docs in run.items():
        found = sources.get(qid, {})
        for docid, _ in ranked(docs, k):
            origin = set(found.get(docid, ()))
            if origin == {a}:
                only_a += 1
            elif origin == {b}:
                only_b += 1
            elif origin == {a, b}:
                both += 1
    return {**overlap_shares(only_a, only_b, both, heads), "k": k}
