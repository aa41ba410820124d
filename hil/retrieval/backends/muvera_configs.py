"""Settings of the ``muvera`` back-end (:mod:`hil.retrieval.backends.muvera`, beside this module): the fixed
dimensional encodings and their index-time transform at build time; the candidates per head at search time.
Torch-free, so that a command line is parsed against them without loading what searches
(:mod:`hil.retrieval.backends.configs` registers them under their kind)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hil.errors import UserError
from hil.retrieval.backends.config_base import IndexConfig, SearchConfig, at_least, built_in

# MuveraSearchConfig: the fewest candidates a search takes by default (a candidate recall@100 needs 100)
MUVERA_MIN_CANDIDATES = 100
# MuveraIndexConfig.transform: the index-time transform of the token vectors before their FDEs are formed
MUVERA_TRANSFORMS = ("none", "center", "whiten")


@built_in
@dataclass(frozen=True)
class MuveraIndexConfig(IndexConfig):
    """``muvera``: one fixed dimensional encoding per document (Dhulipala et al. 2024; :mod:`hil.retrieval.fde`) in a
    FAISS inner-product index. ``k_sim`` SimHash bits (2^k_sim buckets, at most 16), inner projection to ``d_proj``
    dimensions (None: none, the identity), ``r_reps`` repetitions, optional final projection to ``d_final``
    coordinates (a Count Sketch), empty document buckets filled from the nearest token (``fill_empty``), every
    random draw from ``seed``. Defaults k_sim = 5, d_proj = 16, R = 20: d_FDE = 10,240, the FDE size of the
    paper's retrieval experiments (Sec. 3).

    ``transform`` (``none``, ``center``, ``whiten``) maps every token vector before its FDE is formed: minus the
    mean of the head's corpus tokens, or that then times ``Sigma^-1/2`` (ZCA whitening, a small ridge), then
    L2-normalized; fitted on the corpus at build time, stored with the index and applied to the queries too. It
    only steers candidate generation: candidates are scored exactly on the stored, untransformed vectors."""

    kind: ClassVar[str] = "muvera"
    k_sim: int = 5
    d_proj: int | None = 16
    r_reps: int = 20
    d_final: int | None = None
    fill_empty: bool = True
    seed: int = 0
    transform: str = "none"

    def __post_init__(self) -> None:
        at_least(self, "k_sim", self.k_sim, low=0)
        if self.k_sim > 16:
            raise UserError(f"MuveraIndexConfig.k_sim must be at most 16 (2^16 buckets), got {self.k_sim}")
        for name in ("d_proj", "r_reps", "d_final"):
            at_least(self, name, getattr(self, name))
        at_least(self, "seed", self.seed, low=0)
        if not isinstance(self.fill_empty, bool):
            raise UserError(f"MuveraIndexConfig.fill_empty must be true or false (got {self.fill_empty!r})")
        if self.transform not in MUVERA_TRANSFORMS:
            raise UserError(f"MuveraIndexConfig.transform must be one of {', '.join(MUVERA_TRANSFORMS)} "
                             f"(got {self.transform!r})")



@built_in
@dataclass(frozen=True)
class MuveraSearchConfig(SearchConfig):
    """MUVERA's search: each head's query FDE retrieves its ``n_candidates`` documents of largest FDE inner product
    (exact FAISS search over the document FDEs); the union over heads is scored exactly.

    None (default) takes ``max(k, 100)`` for ranking depth ``k`` (:meth:`for_depth`): never fewer candidates than
    the documents ranked, and at least the 100 a candidate recall@100 needs; 100 when no depth is given. The
    MUVERA paper re-ranks a tuned number of FDE candidates; nothing in it fixes a default."""

    kind: ClassVar[str] = "muvera"
    n_candidates: int | None = None

    def __post_init__(self) -> None:
        at_least(self, "n_candidates", self.n_candidates)

    def for_depth(self, k: int) -> "MuveraSearchConfig":
        at_least(self, "k", k)
        return self if self.n_candidates is not None else MuveraSearchConfig(max(k, MUVERA_MIN_CANDIDATES))

