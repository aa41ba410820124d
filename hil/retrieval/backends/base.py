"""The interface every search back-end implements: its settings and files when building, its candidates when searching.

Full ranking (:func:`hil.retrieval.search.full_rank`) is two steps: a back-end proposes *candidates* for each query
(cheap, approximate), then every candidate is scored exactly by the encoder over the stored vectors. A back-end
therefore only answers "which documents are worth scoring, and which head proposed each"; it never ranks.

A back-end class is registered under its ``kind`` (:mod:`hil.retrieval.backends.registry`) and owns everything
kind-specific: which ``faiss_params`` it accepts and their defaults (:meth:`SearchBackend.resolve_params`), the
files it writes beside the vectors (:meth:`SearchBackend.build_head`, :meth:`SearchBackend.head_files`), and the
search itself (:meth:`SearchBackend.candidates`), given the search-time :class:`CandidateSettings`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Sequence

import numpy as np

from hil.data.errors import UserError
from hil.modeling.contracts import EncodedBatch
from hil.retrieval.codec import ResidualCodec
from hil.retrieval.index import TokenIndex
from hil.retrieval.store import TokenTable


@dataclass(frozen=True)
class CandidateSettings:
    """Search-time settings of candidate generation (the arguments of ``full_rank``)."""

    ncandidates: int = 256              # token ANN: nearest stored tokens per query token and head
    max_candidates: int | None = None   # cap per query; token ANN: by approximate score, plaid: ``ndocs`` per head
    nprobe: int | None = None           # IVF lists / PLAID centroids probed per query token (None: the index's)
    stage2_docs: int | None = None      # plaid: documents kept by the probed-cells bound (None: the index's)
    use_gpu: bool = False               # FAISS on the GPU (where faiss-gpu sees one)
    gpu_device: int = 0                 # which GPU (``--device cuda:N`` searches on GPU N)


@dataclass
class Candidates:
    """One query's candidate documents, and which heads' searches proposed each."""

    docs: np.ndarray   # (U,) int64 document rows, ascending
    heads: np.ndarray  # (U, H) bool: heads[u, h] when head h proposed docs[u]


class SearchBackend(ABC):
    """Candidate generation over one opened :class:`~hil.retrieval.index.TokenIndex` (see the module docstring).

    Class attributes: ``kind`` (the registry name, recorded in ``index.json``), ``accepted_params`` (the
    ``faiss_params`` keys it takes), ``search_time_params`` (those that only steer search: changing them never
    rebuilds anything) and ``stores_files`` (False when the structure is rebuilt in memory from the vectors).
    """

    kind: ClassVar[str]
    accepted_params: ClassVar[frozenset[str]] = frozenset()
    search_time_params: ClassVar[frozenset[str]] = frozenset()
    stores_files: ClassVar[bool] = True

    def __init__(self, index: TokenIndex, settings: CandidateSettings = CandidateSettings()):
        self.index = index
        self.settings = settings

    # -- building (class methods: the index is not open yet) -----------------------------------------------------
    @classmethod
    def check_params(cls, params: dict[str, Any] | None) -> dict[str, Any]:
        """Reject a parameter that does not apply to this kind (before any work is done); -> a copy."""
        params = dict(params or {})
        unknown = set(params) - cls.accepted_params
        if unknown:
            raise UserError(f"faiss_params {sorted(unknown)} do not apply to faiss_kind={cls.kind!r} "
                             f"(known: {sorted(cls.accepted_params)})")
        return params

    @classmethod
    @abstractmethod
    def resolve_params(cls, params: dict[str, Any] | None, n_tokens: int, dim: int) -> dict[str, Any]:
        """Complete ``params`` with defaults for a head of ``n_tokens`` (n_tokens, dim) vectors, checking them."""

    @classmethod
    @abstractmethod
    def factory(cls, params: dict[str, Any]) -> str:
        """A short description of the structure built with resolved ``params`` (FAISS factory string style)."""

    @classmethod
    def head_files(cls, directory: Path, head: str) -> list[Path]:
        """The files this kind writes for ``head`` (removed when an index switches to another kind)."""
        return []

    @classmethod
    def build_head(cls, directory: Path, head: str, vectors: TokenTable, params: dict[str, Any], *,
                   use_gpu: bool = False, gpu_device: int = 0) -> ResidualCodec | None:
        """Write the structure of one head into ``directory`` (each file atomically); -> the residual codec when
        the vectors were also stored compressed, else None. ``params`` are resolved."""
        return None

    # -- searching --------------------------------------------------------------------------------------------------
    @abstractmethod
    def candidates(self, queries: EncodedBatch, heads: Sequence[str]) -> list[Candidates]:
        """Candidate documents of every query of the batch (one entry per row), ``heads`` in the flags' order.

        Each head searches with its own query vectors; a query's candidates are the union over heads.
        """

    def search_stats(self) -> dict[str, Any]:
        """Settings this back-end resolved for the search, for the search statistics (empty by default)."""
        return {}
