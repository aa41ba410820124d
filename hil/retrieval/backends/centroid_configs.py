"""Settings of the ``plaid`` back-end (:mod:`hil.retrieval.backends.centroid`, beside this module): PLAID / ColBERTv2
centroids, residual codes and storage at build time; probed cells and surviving documents at search time.
Torch-free, so that a command line is parsed against them without loading what searches
(:mod:`hil.retrieval.backends.configs` registers them under their kind)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from hil.errors import UserError
from hil.retrieval.backends.config_base import IndexConfig, SearchConfig, at_least, built_in

# PlaidIndexConfig.kmeans: which k-means builds PLAID's centroids (hil.retrieval.kmeans.kmeans_engine)
KMEANS_CHOICES = ("auto", "faiss", "torch")
# PlaidIndexConfig.assignment: how each token's nearest centroid is found (hil.retrieval.plaid.CentroidAssignment)
ASSIGNMENTS = ("auto", "exact", "two-level")
# PlaidIndexConfig's storage when left to the corpus (residual_bits / keep_embeddings None): the fp16 vectors of
# every head are kept (exact scores from fp16) while they take at most this many bytes; above it the index is
# compressed as it is encoded, LARGE_CORPUS_RESIDUAL_BITS bits, no fp16. Why 4 GiB: measured on SciFact
# (bench/README.md), 2-bit residuals cost -0.002..+0.005 nDCG@10 against fp16 and search ~1.4x slower, so fp16 is
# the better default where its 7.5x disk is cheap and its table stays in a small machine's page cache (exact
# scoring reads it at random); 4 GiB is 16.8M tokens at D = 128 (SciFact x16, Quora, FiQA below it; TREC-COVID,
# Touche, CQADupStack and the large half of BEIR above: docs/results.md).
KEEP_FP16_UP_TO_BYTES = 4 << 30
LARGE_CORPUS_RESIDUAL_BITS = 2


@built_in
@dataclass(frozen=True)
class PlaidIndexConfig(IndexConfig):
    """``plaid``: PLAID / ColBERTv2 centroids (default ``2**floor(log2(16 sqrt(n_tokens)))``), k-means on
    ``train_size`` sampled tokens (default ``min(n_tokens, 32 n_centroids)``) for ``niter`` iterations (ColBERTv2's
    4), ``seed``; ``residual_bits`` (0 = none; 1, 2, 4 or 8) adds ColBERTv2 residual codes, and
    ``keep_embeddings=False`` (only with residuals) drops the fp16 vectors.

    Storage left to the corpus (``residual_bits`` / ``keep_embeddings`` None, the default): a corpus whose fp16
    vectors (all heads) would take at most :data:`KEEP_FP16_UP_TO_BYTES` keeps them and no residuals (exact scores
    from fp16, as before); a larger one gets :data:`LARGE_CORPUS_RESIDUAL_BITS`-bit residuals and no fp16, built
    compressed as encoded. A value given is kept (``residual_bits=2`` alone keeps the fp16 vectors of a small
    corpus beside the residuals and drops them for a large one). The choice is made from the corpus's estimated
    size before any encoding (:meth:`sized`) and recorded in ``index.json`` (``storage_choice``); a reused index
    matches an unset value whatever was chosen.

    ``kmeans`` is which k-means (and nearest-centroid assignment) builds the centroids: ``faiss`` (FAISS, on the
    GPU where faiss-gpu sees it), ``torch`` (:mod:`hil.retrieval.kmeans`, on the build's GPU, else the CPU), or
    ``auto`` (default: faiss-gpu where it sees the GPU, else torch on a GPU build, else FAISS on the CPU:
    :func:`~hil.retrieval.kmeans.kmeans_engine`). ``index.json`` records the one that ran; ``auto`` accepts an index
    built by either (an index moved to another machine is not rebuilt because ``auto`` chooses otherwise there),
    an explicit name only an index built by that one.

    ``assignment`` is how each token's nearest centroid is found (``hil.retrieval.plaid.CentroidAssignment``):
    ``exact`` (every centroid scored), ``two-level`` (centroids trained by two-level k-means in torch, each token
    assigned among the members of its ``assignment_nprobe`` nearest coarse groups: ~sqrt(C) scores per group
    instead of C), or ``auto`` (default: ``two-level`` on a CPU build with at least
    ``hil.retrieval.backends.centroid.TWO_LEVEL_MIN_CENTROIDS`` centroids, where exact assignment would take
    hours to days; ``exact`` on a GPU and below that size). ``assignment_nprobe`` None (or ``auto``) takes the measured
    default. Both are recorded as resolved; ``auto`` accepts an index assigned either way.

    A compressed-only index (``residual_bits`` with ``keep_embeddings=False``) is built compressed as it is encoded
    (:mod:`hil.retrieval.compressed_build`): its centroids and buckets come from a sample of the corpus, drawn
    first, and no fp16 vector is ever written."""

    kind: ClassVar[str] = "plaid"
    n_centroids: int | None = None
    train_size: int | None = None
    niter: int = 4
    seed: int = 0
    residual_bits: int | str | None = None
    keep_embeddings: bool | str | None = None
    kmeans: str = "auto"
    assignment: str = "auto"
    assignment_nprobe: int | str | None = None

    def __post_init__(self) -> None:
        for name in ("n_centroids", "train_size", "niter"):
            at_least(self, name, getattr(self, name))
        if self.assignment_nprobe != "auto":  # "auto" (as None): the measured default, as resolved settings say
            at_least(self, "assignment_nprobe", self.assignment_nprobe)
        if self.assignment not in ASSIGNMENTS:
            raise UserError(f"PlaidIndexConfig.assignment must be one of {', '.join(ASSIGNMENTS)} "
                             f"(got {self.assignment!r})")
        at_least(self, "seed", self.seed, low=0)
        for name in ("residual_bits", "keep_embeddings"):  # "auto" (as resolved settings say it): None
            if getattr(self, name) == "auto":
                object.__setattr__(self, name, None)
        at_least(self, "residual_bits", self.residual_bits, low=0)
        if self.keep_embeddings is not None and not isinstance(self.keep_embeddings, bool):
            raise UserError(f"PlaidIndexConfig.keep_embeddings must be true, false or null (got "
                            f"{self.keep_embeddings!r})")
        if self.kmeans not in KMEANS_CHOICES:
            raise UserError(f"PlaidIndexConfig.kmeans must be one of {', '.join(KMEANS_CHOICES)} "
                             f"(got {self.kmeans!r})")


    @property
    def storage_left_to_corpus(self) -> bool:
        """Whether the corpus's size decides ``residual_bits`` or ``keep_embeddings`` (class docstring)."""
        return self.residual_bits is None or self.keep_embeddings is None

    def sized(self, n_tokens: int, fp16_bytes_per_token: int) -> tuple["PlaidIndexConfig", dict[str, Any]]:
        """These settings with the storage left to the corpus decided for ``n_tokens`` tokens of
        ``fp16_bytes_per_token`` (every head's ``2 D``); -> (the settings, what ``index.json`` records as
        ``storage_choice``). Settings given are kept."""
        fp16_bytes = int(n_tokens) * int(fp16_bytes_per_token)
        large = fp16_bytes > KEEP_FP16_UP_TO_BYTES
        wants_residuals = large or self.keep_embeddings is False  # no fp16 asked: the vectors are the residuals
        bits = self.residual_bits if self.residual_bits is not None else (
            LARGE_CORPUS_RESIDUAL_BITS if wants_residuals else 0)
        keep = self.keep_embeddings if self.keep_embeddings is not None else not (large and bits)
        record = {"asked": {"residual_bits": self.residual_bits, "keep_embeddings": self.keep_embeddings},
                  "n_tokens_estimate": int(n_tokens), "fp16_bytes_estimate": fp16_bytes,
                  "keep_fp16_up_to_bytes": KEEP_FP16_UP_TO_BYTES, "residual_bits": bits, "keep_embeddings": keep}
        return replace(self, residual_bits=bits, keep_embeddings=keep), record



@built_in
@dataclass(frozen=True)
class PlaidSearchConfig(SearchConfig):
    """PLAID's three candidate stages (:mod:`hil.retrieval.plaid`): each query token probes ``nprobe`` centroids,
    ``stage2_docs`` documents survive the probed-cells bound, and each head keeps its ``ndocs`` best documents by
    centroid interaction for exact scoring.

    A field left None takes ColBERTv2's value for the ranking depth ``k`` (:meth:`for_depth`; stanford-futuredata/
    ColBERT, ``Searcher.dense_search``): k <= 10: 1 cell, 256 documents; k <= 100: 2 cells, 1,024; else 4 cells,
    max(4k, 4,096). ColBERTv2's count is our ``stage2_docs``; it scores a quarter of them exactly
    (``ndocs = stage2_docs / 4``: 64, 256, max(k, 1,024)), so a search never returns fewer than k documents by
    default. Given only ``ndocs``, ``stage2_docs`` is ``4 * ndocs`` (the same ratio); given only ``stage2_docs``,
    ``ndocs`` is the default for k, at most ``stage2_docs``.
    """

    kind: ClassVar[str] = "plaid"
    nprobe: int | None = None
    ndocs: int | None = None
    stage2_docs: int | None = None

    def __post_init__(self) -> None:
        for name in ("nprobe", "ndocs", "stage2_docs"):
            at_least(self, name, getattr(self, name))

    def for_depth(self, k: int) -> "PlaidSearchConfig":
        """Every field set: the given ones kept, the others ColBERTv2's for ranking depth ``k`` (class docstring)."""
        at_least(self, "k", k)
        cells, colbert_ndocs = (1, 256) if k <= 10 else (2, 1024) if k <= 100 else (4, max(4 * k, 4096))
        ndocs = self.ndocs if self.ndocs is not None else min(colbert_ndocs // 4, self.stage2_docs or colbert_ndocs)
        stage2_docs = self.stage2_docs if self.stage2_docs is not None else (
            4 * self.ndocs if self.ndocs is not None else colbert_ndocs)
        return PlaidSearchConfig(self.nprobe if self.nprobe is not None else cells, ndocs, stage2_docs)

    @property
    def resolved(self) -> bool:
        return None not in (self.nprobe, self.ndocs, self.stage2_docs)

