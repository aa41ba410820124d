"""Settings of the token ANN back-ends (:mod:`hil.retrieval.backends.token_ann`, beside this module): ``flat``,
``ivfflat`` and ``ivfpq``, at build time and at search time. Torch-free, so that a command line is parsed against
them without loading what searches (:mod:`hil.retrieval.backends.configs` registers them under their kinds)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hil.retrieval.backends.config_base import IndexConfig, SearchConfig, at_least, built_in


@built_in
@dataclass(frozen=True)
class FlatIndexConfig(IndexConfig):
    """``flat``: exact inner-product search (FAISS ``IndexFlatIP``), rebuilt in memory from the stored vectors."""

    kind: ClassVar[str] = "flat"


@built_in
@dataclass(frozen=True)
class IvfFlatIndexConfig(IndexConfig):
    """``ivfflat``: an inverted file of ``nlist`` k-means lists (default ``min(4 sqrt(n_tokens), n_tokens / 39)``),
    trained on ``train_size`` seeded sampled tokens (default ``min(n_tokens, max(100 nlist, 65536))``)."""

    kind: ClassVar[str] = "ivfflat"
    nlist: int | None = None
    train_size: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        at_least(self, "nlist", self.nlist)
        at_least(self, "train_size", self.train_size)
        at_least(self, "seed", self.seed, low=0)


@built_in
@dataclass(frozen=True)
class IvfPqIndexConfig(IvfFlatIndexConfig):
    """``ivfpq``: IVF lists of product-quantized vectors, ``m`` sub-vectors (default the largest divisor of the
    dimension up to 16, ColBERT v1's 16 bytes per token) of ``nbits`` bits each (default 8)."""

    kind: ClassVar[str] = "ivfpq"
    m: int | None = None
    nbits: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self, "m", self.m)
        at_least(self, "nbits", self.nbits)



@built_in
@dataclass(frozen=True)
class FlatSearchConfig(SearchConfig):
    """Token ANN search (ColBERT v1, Sec. 3.6): ``ncandidates`` nearest stored tokens per query token and head;
    ``max_candidates`` caps a query's candidates by their approximate score (None: all are scored exactly)."""

    kind: ClassVar[str] = "flat"
    ncandidates: int = 256
    max_candidates: int | None = None

    def __post_init__(self) -> None:
        at_least(self, "ncandidates", self.ncandidates)
        at_least(self, "max_candidates", self.max_candidates)


@built_in
@dataclass(frozen=True)
class IvfSearchConfig(FlatSearchConfig):
    """Token ANN search in an IVF index (``ivfflat`` and ``ivfpq``): also ``nprobe`` lists visited per query
    token."""

    kind: ClassVar[str] = "ivf"
    nprobe: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self, "nprobe", self.nprobe)

