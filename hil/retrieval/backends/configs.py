"""Typed settings of the search back-ends: what is fixed when an index is built, and what steers each search.

Every back-end (:mod:`hil.retrieval.backends`) declares two classes:

- an :class:`IndexConfig` (build time): the structure written beside the vectors (IVF lists, PQ codes, PLAID
  centroids, residual codes). An index records its resolved values in ``index.json``; a reused index is compared
  on these only (:func:`hil.retrieval.builder.open_or_build_index`), and a different value rebuilds the structure.
- a :class:`SearchConfig` (search time): how many lists or centroids a query probes, how many candidates survive.
  Nothing of it is stored with the index: it is applied at every search, and the values the back-end used are read
  back from it after the search (``SearchBackend.search_stats``) for the results file.

Both are frozen dataclasses selectable by ``class_path`` in YAML (as Lightning IR's ``FaissIVFPQIndexConfig`` and
``SearchConfig``), e.g.::

    backend: {class_path: hil.retrieval.backends.configs.PlaidIndexConfig, init_args: {residual_bits: 2}}
    search: {class_path: hil.retrieval.backends.configs.PlaidSearchConfig, init_args: {nprobe: 16}}

An untyped ``faiss_params`` / ``backend_params`` dict (the spelling before these classes) is split into the two by
:func:`configs_from_params`, which names a key that belongs to neither.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, ClassVar, Mapping

from hil.errors import UserError

# PlaidIndexConfig.kmeans: which k-means builds PLAID's centroids (hil.retrieval.kmeans.kmeans_engine)
KMEANS_CHOICES = ("auto", "faiss", "torch")
# PlaidIndexConfig.assignment: how each token's nearest centroid is found (hil.retrieval.plaid.CentroidAssignment)
ASSIGNMENTS = ("auto", "exact", "two-level")
# MuveraSearchConfig: the fewest candidates a search takes by default (a candidate recall@100 needs 100)
MUVERA_MIN_CANDIDATES = 100
# PlaidIndexConfig's storage when left to the corpus (residual_bits / keep_embeddings None): the fp16 vectors of
# every head are kept (exact scores from fp16) while they take at most this many bytes; above it the index is
# compressed as it is encoded, LARGE_CORPUS_RESIDUAL_BITS bits, no fp16. Why 4 GiB: measured on SciFact
# (bench/README.md), 2-bit residuals cost -0.002..+0.005 nDCG@10 against fp16 and search ~1.4x slower, so fp16 is
# the better default where its 7.5x disk is cheap and its table stays in a small machine's page cache (exact
# scoring reads it at random); 4 GiB is 16.8M tokens at D = 128 (SciFact x16, Quora, FiQA below it; TREC-COVID,
# Touche, CQADupStack and the large half of BEIR above: docs/results.md).
KEEP_FP16_UP_TO_BYTES = 4 << 30
LARGE_CORPUS_RESIDUAL_BITS = 2


def _at_least(owner: object, name: str, value: int | None, low: int = 1) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
        raise UserError(f"{type(owner).__name__}.{name} must be an integer >= {low} (got {value!r})")


class BackendConfig:
    """Shared behaviour of both kinds of settings: the back-end ``kind`` they belong to, and their values."""

    kind: ClassVar[str]

    def values(self) -> dict[str, Any]:
        """Every field, ``None`` for "the back-end's default" (for records)."""
        return asdict(self)  # type: ignore[call-overload]

    def given(self) -> dict[str, Any]:
        """The fields set to something other than None (what a back-end resolves defaults around)."""
        return {key: value for key, value in self.values().items() if value is not None}

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))  # type: ignore[arg-type]

    def record(self) -> dict[str, Any]:
        """``{"class_path": ..., "init_args": ...}``: how a YAML config names these settings."""
        return {"class_path": f"{type(self).__module__}.{type(self).__name__}", "init_args": self.values()}


class IndexConfig(BackendConfig):
    """Build-time settings of a back-end (see the module docstring)."""


class SearchConfig(BackendConfig):
    """Search-time settings of a back-end (see the module docstring)."""

    def for_depth(self, k: int) -> "SearchConfig":
        """The settings a search ranking ``k`` documents applies: these, unless a back-end's defaults depend on k
        (PLAID's do: :meth:`PlaidSearchConfig.for_depth`)."""
        return self


# -- build time -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FlatIndexConfig(IndexConfig):
    """``flat``: exact inner-product search (FAISS ``IndexFlatIP``), rebuilt in memory from the stored vectors."""

    kind: ClassVar[str] = "flat"


@dataclass(frozen=True)
class IvfFlatIndexConfig(IndexConfig):
    """``ivfflat``: an inverted file of ``nlist`` k-means lists (default ``min(4 sqrt(n_tokens), n_tokens / 39)``),
    trained on ``train_size`` seeded sampled tokens (default ``min(n_tokens, max(100 nlist, 65536))``)."""

    kind: ClassVar[str] = "ivfflat"
    nlist: int | None = None
    train_size: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _at_least(self, "nlist", self.nlist)
        _at_least(self, "train_size", self.train_size)
        _at_least(self, "seed", self.seed, low=0)


@dataclass(frozen=True)
class IvfPqIndexConfig(IvfFlatIndexConfig):
    """``ivfpq``: IVF lists of product-quantized vectors, ``m`` sub-vectors (default the largest divisor of the
    dimension up to 16, ColBERT v1's 16 bytes per token) of ``nbits`` bits each (default 8)."""

    kind: ClassVar[str] = "ivfpq"
    m: int | None = None
    nbits: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self, "m", self.m)
        _at_least(self, "nbits", self.nbits)


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
            _at_least(self, name, getattr(self, name))
        if self.assignment_nprobe != "auto":  # "auto" (as None): the measured default, as resolved settings say
            _at_least(self, "assignment_nprobe", self.assignment_nprobe)
        if self.assignment not in ASSIGNMENTS:
            raise UserError(f"PlaidIndexConfig.assignment must be one of {', '.join(ASSIGNMENTS)} "
                             f"(got {self.assignment!r})")
        _at_least(self, "seed", self.seed, low=0)
        for name in ("residual_bits", "keep_embeddings"):  # "auto" (as resolved settings say it): None
            if getattr(self, name) == "auto":
                object.__setattr__(self, name, None)
        _at_least(self, "residual_bits", self.residual_bits, low=0)
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


# MuveraIndexConfig.transform: the index-time transform of the token vectors before their FDEs are formed
MUVERA_TRANSFORMS = ("none", "center", "whiten")


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
        _at_least(self, "k_sim", self.k_sim, low=0)
        if self.k_sim > 16:
            raise UserError(f"MuveraIndexConfig.k_sim must be at most 16 (2^16 buckets), got {self.k_sim}")
        for name in ("d_proj", "r_reps", "d_final"):
            _at_least(self, name, getattr(self, name))
        _at_least(self, "seed", self.seed, low=0)
        if not isinstance(self.fill_empty, bool):
            raise UserError(f"MuveraIndexConfig.fill_empty must be true or false (got {self.fill_empty!r})")
        if self.transform not in MUVERA_TRANSFORMS:
            raise UserError(f"MuveraIndexConfig.transform must be one of {', '.join(MUVERA_TRANSFORMS)} "
                             f"(got {self.transform!r})")


# -- search time ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FlatSearchConfig(SearchConfig):
    """Token ANN search (ColBERT v1, Sec. 3.6): ``ncandidates`` nearest stored tokens per query token and head;
    ``max_candidates`` caps a query's candidates by their approximate score (None: all are scored exactly)."""

    kind: ClassVar[str] = "flat"
    ncandidates: int = 256
    max_candidates: int | None = None

    def __post_init__(self) -> None:
        _at_least(self, "ncandidates", self.ncandidates)
        _at_least(self, "max_candidates", self.max_candidates)


@dataclass(frozen=True)
class IvfSearchConfig(FlatSearchConfig):
    """Token ANN search in an IVF index (``ivfflat`` and ``ivfpq``): also ``nprobe`` lists visited per query
    token."""

    kind: ClassVar[str] = "ivf"
    nprobe: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self, "nprobe", self.nprobe)


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
            _at_least(self, name, getattr(self, name))

    def for_depth(self, k: int) -> "PlaidSearchConfig":
        """Every field set: the given ones kept, the others ColBERTv2's for ranking depth ``k`` (class docstring)."""
        _at_least(self, "k", k)
        cells, colbert_ndocs = (1, 256) if k <= 10 else (2, 1024) if k <= 100 else (4, max(4 * k, 4096))
        ndocs = self.ndocs if self.ndocs is not None else min(colbert_ndocs // 4, self.stage2_docs or colbert_ndocs)
        stage2_docs = self.stage2_docs if self.stage2_docs is not None else (
            4 * self.ndocs if self.ndocs is not None else colbert_ndocs)
        return PlaidSearchConfig(self.nprobe if self.nprobe is not None else cells, ndocs, stage2_docs)

    @property
    def resolved(self) -> bool:
        return None not in (self.nprobe, self.ndocs, self.stage2_docs)


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
        _at_least(self, "n_candidates", self.n_candidates)

    def for_depth(self, k: int) -> "MuveraSearchConfig":
        _at_least(self, "k", k)
        return self if self.n_candidates is not None else MuveraSearchConfig(max(k, MUVERA_MIN_CANDIDATES))


# kind -> its build-time and search-time settings: the built-in kinds (their settings are this module's), and every
# other back-end class as it is defined (:meth:`hil.retrieval.backends.base.SearchBackend.__init_subclass__`).
INDEX_CONFIGS: dict[str, type[IndexConfig]] = {
    "flat": FlatIndexConfig, "ivfflat": IvfFlatIndexConfig, "ivfpq": IvfPqIndexConfig, "plaid": PlaidIndexConfig,
    "muvera": MuveraIndexConfig}
SEARCH_CONFIGS: dict[str, type[SearchConfig]] = {
    "flat": FlatSearchConfig, "ivfflat": IvfSearchConfig, "ivfpq": IvfSearchConfig, "plaid": PlaidSearchConfig,
    "muvera": MuveraSearchConfig}


def register_kind(kind: str, index: type[IndexConfig], search: type[SearchConfig]) -> None:
    """Make ``kind`` known with its settings classes (a second, different registration is refused)."""
    if INDEX_CONFIGS.get(kind, index) is not index or SEARCH_CONFIGS.get(kind, search) is not search:
        raise ValueError(f"back-end kind {kind!r} is already registered with other settings classes")
    INDEX_CONFIGS[kind], SEARCH_CONFIGS[kind] = index, search


def __getattr__(name: str) -> Any:
    if name == "BACKEND_KINDS":  # the kinds registered so far, in the order their classes were defined
        return tuple(INDEX_CONFIGS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_kind(kind: str) -> str:
    if kind not in INDEX_CONFIGS:
        raise UserError(f"backend must be one of {tuple(INDEX_CONFIGS)} (got {kind!r})")
    return kind


def index_config(backend: str | IndexConfig) -> IndexConfig:
    """``backend`` as build-time settings: a config as is, a kind name with every default."""
    if isinstance(backend, IndexConfig):
        return backend
    return INDEX_CONFIGS[check_kind(backend)]()


def default_search(kind: str) -> SearchConfig:
    """The search-time defaults of back-end ``kind``."""
    return SEARCH_CONFIGS[check_kind(kind)]()


def check_search(kind: str, search: SearchConfig | None) -> SearchConfig:
    """``search`` (default: ``kind``'s defaults), refused when it steers another back-end than ``kind``'s."""
    if search is None:
        return default_search(kind)
    expected = SEARCH_CONFIGS[check_kind(kind)]
    if type(search) is not expected:
        raise UserError(f"search settings {type(search).__name__} do not apply to a {kind!r} index "
                        f"(it takes {expected.__name__})")
    return search


def with_search_values(kind: str, search: SearchConfig | None, values: Mapping[str, Any]) -> SearchConfig:
    """``search`` (or ``kind``'s defaults) with the non-None ``values`` set; a key it has no field for is refused
    (e.g. ``nprobe`` on a ``flat`` index)."""
    search = check_search(kind, search)
    values = {key: value for key, value in values.items() if value is not None}
    unknown = set(values) - type(search).field_names()
    if unknown:
        raise UserError(f"search settings {sorted(unknown)} do not apply to a {kind!r} index "
                        f"(its settings: {sorted(type(search).field_names())})")
    return type(search)(**{**search.values(), **values})


def configs_from_params(kind: str, params: Mapping[str, Any] | None) -> tuple[IndexConfig, SearchConfig]:
    """An untyped parameter dict (``--faiss-params``, ``backend_params``) split into ``kind``'s build-time and
    search-time settings; a key that belongs to neither is refused, naming the keys ``kind`` takes."""
    params = dict(params or {})
    build, search = INDEX_CONFIGS[check_kind(kind)], SEARCH_CONFIGS[kind]
    unknown = set(params) - build.field_names() - search.field_names()
    if unknown:
        raise UserError(f"parameters {sorted(unknown)} do not apply to backend {kind!r} (build time: "
                        f"{sorted(build.field_names())}; search time: {sorted(search.field_names())})")
    return (build(**{k: v for k, v in params.items() if k in build.field_names()}),
            search(**{k: v for k, v in params.items() if k in search.field_names()}))
