"""The interface every search back-end implements: its settings and files when building, its candidates when searching.

Full ranking (:func:`hil.retrieval.full_ranking.full_rank`) is two steps: a back-end proposes *candidates* for each
query
(cheap, approximate), then every candidate is scored exactly by the encoder over the stored vectors. A back-end
therefore only answers "which documents are worth scoring, and which head proposed each"; it never ranks.

A back-end class is registered under its ``kind`` when it is defined (the one registry:
:data:`hil.retrieval.backends.configs.REGISTRY`) and owns everything kind-specific: its typed build-time and
search-time settings (``index_config`` / ``search_config``, defined beside it; the base classes are
:mod:`hil.retrieval.backends.config_base`'s), the defaults of the build-time ones
(:meth:`SearchBackend.resolve_params`), the files it writes beside the vectors (:meth:`SearchBackend.build_head`,
:meth:`SearchBackend.head_files`), and the search itself (:meth:`SearchBackend.candidates`) under its search
settings, whose values as used it reports (:meth:`SearchBackend.search_stats`).
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Sequence

import numpy as np
import torch

from hil.errors import UserError
from hil.modeling.contracts import EncodedBatch
from hil.retrieval.backends.configs import REGISTRY, IndexConfig, SearchConfig, check_search, register
from hil.retrieval.codec import ResidualCodec
from hil.retrieval.index import TokenIndex
from hil.retrieval.store import TokenTable


@dataclass
class Candidates:
    """One query's candidate documents, and which heads' searches proposed each."""

    docs: np.ndarray   # (U,) int64 document rows, ascending
    heads: np.ndarray  # (U, H) bool: heads[u, h] when head h proposed docs[u]


@dataclass
class CandidatePairs:
    """The candidates of a batch of queries as (query, document) pairs on one device, sorted by query, then
    document: what batched full ranking scores (:func:`hil.retrieval.full_ranking.full_rank`)."""

    query: torch.Tensor  # (P,) int64: the query's row in the batch
    docs: torch.Tensor   # (P,) int64: document rows
    heads: torch.Tensor  # (P, H) bool: heads[p, h] when head h proposed the pair

    @classmethod
    def from_candidates(cls, found: Sequence[Candidates], device: torch.device) -> "CandidatePairs":
        """Per-query candidates (host arrays) as pairs on ``device``."""
        n_heads = found[0].heads.shape[1] if found else 0
        query = np.repeat(np.arange(len(found), dtype=np.int64), [len(c.docs) for c in found])
        docs = np.concatenate([np.asarray(c.docs, dtype=np.int64) for c in found]) if found else np.zeros(0, np.int64)
        flags = (np.concatenate([np.asarray(c.heads, dtype=bool).reshape(-1, n_heads) for c in found]) if found
                 else np.zeros((0, 0), dtype=bool))
        return cls(*(torch.from_numpy(a).to(device) for a in (query, docs, flags)))

    @classmethod
    def union(cls, per_head: Sequence[tuple[torch.Tensor, torch.Tensor]], n_docs: int) -> "CandidatePairs":
        """The union over heads of each head's (query, document) pairs, with which heads proposed each."""
        keys = [query * max(n_docs, 1) + docs for query, docs in per_head]
        head = torch.cat([torch.full_like(k, h) for h, k in enumerate(keys)])
        union, where = torch.unique(torch.cat(keys), sorted=True, return_inverse=True)
        flags = torch.zeros((len(union), len(per_head)), dtype=torch.bool, device=union.device)
        flags[where, head] = True
        return cls(union // max(n_docs, 1), union % max(n_docs, 1), flags)

    def per_query(self, n_queries: int) -> list[Candidates]:
        """The same candidates as per-query host arrays (one copy to the host)."""
        query, docs, flags = (t.cpu().numpy() for t in (self.query, self.docs, self.heads))
        bounds = np.searchsorted(query, np.arange(n_queries + 1))
        return [Candidates(docs[lo:hi], flags[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]


class SearchBackend(ABC):
    """Candidate generation over one opened :class:`~hil.retrieval.index.TokenIndex` (see the module docstring).

    Class attributes: ``kind`` (the registry name, recorded in ``index.json``), ``index_config`` (its build-time
    settings class), ``search_config`` (its search-time settings class) and ``stores_files`` (False when the
    structure is rebuilt in memory from the vectors). ``search`` is applied to every search of this instance;
    ``use_gpu`` / ``gpu_device`` say where FAISS searches (where faiss-gpu sees that GPU); ``device`` where torch
    search stages run (PLAID's; None: where the query vectors are, i.e. the encoder's device); ``depth``: the k
    the searches rank to, which settings left None may depend on (:meth:`SearchConfig.for_depth`).
    """

    kind: ClassVar[str]
    index_config: ClassVar[type[IndexConfig]]
    search_config: ClassVar[type[SearchConfig]]
    stores_files: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A class that names its own ``kind`` is registered under it with its settings classes (the one registry:
        :data:`~hil.retrieval.backends.configs.REGISTRY`): defining a back-end is all it takes."""
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            register(cls.kind, cls.index_config, cls.search_config, backend=cls)

    def __init__(self, index: TokenIndex, search: SearchConfig | None = None, *, use_gpu: bool = False,
                 gpu_device: int = 0, device: torch.device | None = None, depth: int | None = None):
        self.index = index
        self.search = check_search(self.kind, search)
        if depth is not None:  # defaults that depend on the ranking depth k (PLAID's) take their values now
            self.search = self.search.for_depth(depth)
        self.use_gpu = use_gpu
        self.gpu_device = gpu_device
        self.device = device

    # -- building (class methods: the index is not open yet) -----------------------------------------------------
    @classmethod
    def check_config(cls, config: IndexConfig) -> IndexConfig:
        """Refuse build-time settings of another back-end (before any work is done)."""
        if type(config) is not cls.index_config:
            raise UserError(f"{type(config).__name__} does not configure a {cls.kind!r} index (it takes "
                             f"{cls.index_config.__name__})")
        return config

    @classmethod
    @abstractmethod
    def resolve_params(cls, config: IndexConfig, n_tokens: int, dim: int) -> dict[str, Any]:
        """``config``'s values with every default filled in for a head of ``n_tokens`` (n_tokens, dim) vectors,
        checked against them (an ``nlist`` above the number of tokens, an ``m`` not dividing ``dim``, ...)."""

    @classmethod
    @abstractmethod
    def factory(cls, params: dict[str, Any]) -> str:
        """A short description of the structure built with resolved ``params`` (FAISS factory string style)."""

    @classmethod
    def head_files(cls, directory: Path, head: str) -> list[Path]:
        """The files this kind writes for ``head`` (removed when an index switches to another kind)."""
        return []

    @classmethod
    def structure_bytes(cls, params: dict[str, Any], n_tokens: int, n_docs: int, dim: int) -> int:
        """About how many bytes of files :meth:`build_head` writes for one head of ``n_tokens`` tokens with
        resolved ``params`` (an upper estimate, for the disk check before a build: :mod:`hil.retrieval.disk_plan`);
        0 by default (a structure rebuilt in memory)."""
        return 0

    @classmethod
    def search_memory_bytes(cls, params: dict[str, Any], n_tokens: int, n_docs: int, dim: int) -> int:
        """About how many bytes of host memory a search holds for one head (what FAISS loads or rebuilds in
        memory; memory-mapped files do not count): the check before a build (:mod:`hil.retrieval.disk_plan`).
        0 by default (memory-mapped, or small)."""
        return 0

    @classmethod
    def resolve_machine_params(cls, params: dict[str, Any], *, device: torch.device, use_gpu: bool = False,
                               gpu_device: int = 0) -> dict[str, Any]:
        """Resolved ``params`` with the choices that depend on the machine building them (PLAID's ``kmeans:
        auto``) made for a build on ``device``: what the build runs and ``index.json`` records. None by default."""
        return params

    @classmethod
    def build_head(cls, directory: Path, head: str, vectors: TokenTable, params: dict[str, Any], *,
                   use_gpu: bool = False, gpu_device: int = 0,
                   device: torch.device | None = None) -> ResidualCodec | None:
        """Write the structure of one head into ``directory`` (each file atomically); -> the residual codec when
        the vectors were also stored compressed, else None. ``params`` are resolved (machine choices included);
        ``device``: where torch work of the build may run (the encoder's; None: the CPU)."""
        return None

    # -- searching --------------------------------------------------------------------------------------------------
    @abstractmethod
    def candidates(self, queries: EncodedBatch, heads: Sequence[str]) -> list[Candidates]:
        """Candidate documents of every query of the batch (one entry per row), ``heads`` in the flags' order.

        Each head searches with its own query vectors; a query's candidates are the union over heads.
        """

    def candidate_pairs(self, queries: EncodedBatch, heads: Sequence[str]) -> CandidatePairs:
        """The candidates of every query of the batch as (query, document) pairs on the queries' device: the same
        documents and flags as :meth:`candidates`. A back-end whose search runs in torch (PLAID) overrides this
        to search the whole batch on the device at once; by default the per-query candidates are converted."""
        return CandidatePairs.from_candidates(self.candidates(queries, heads), queries.mask.device)

    @classmethod
    def keyword_search_values(cls, *, ncandidates: int | None, max_candidates: int | None, nprobe: int | None,
                              stage2_docs: int | None) -> dict[str, int | None]:
        """:func:`~hil.retrieval.full_ranking.full_rank`'s keyword settings as this kind's search fields (None:
        not given; fields the kind lacks are refused by its :class:`SearchConfig` when given)."""
        return {"ncandidates": ncandidates, "max_candidates": max_candidates, "nprobe": nprobe,
                "stage2_docs": stage2_docs}

    def token_transform(self, head: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(mean, matrix) of the map ``x -> normalize((x - mean) @ matrix)`` this index applies to ``head``'s token
        vectors before its search sees them (MUVERA's index-time transform), read back from the index; None (the
        default) when the search sees them as stored. Exact scoring always reads the stored vectors."""
        return None

    def candidates_per_head(self) -> tuple[str, int] | None:
        """(the setting, its value): the most documents one head proposes for a query (None: no fixed cap). A cap
        below the ranking depth makes runs shorter than ``k``, which the caller says."""
        return None

    def search_stats(self) -> dict[str, Any]:
        """The search-time settings as this back-end used them (read back from its structures where they hold
        them, e.g. a FAISS index's ``nprobe``), with its ``kind``: what a results file records."""
        return {"backend": self.kind, **self.search.values()}


def __getattr__(name: str) -> Any:
    if name == "BACKENDS":  # kind -> class, the registry's view before it was one (hil.compat lists it)
        warnings.warn("hil.retrieval.backends.base.BACKENDS is deprecated: use hil.retrieval.backends.configs.REGISTRY",
                      DeprecationWarning, stacklevel=2)
        return {kind: entry.backend for kind, entry in REGISTRY.items() if entry.backend is not None}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
