"""The one registry of search back-ends: every ``kind`` with its build-time and search-time settings classes and
the :class:`~hil.retrieval.backends.base.SearchBackend` class that serves it (:data:`REGISTRY`), and the look-ups
every caller uses (a kind's settings, its defaults, a command's ``--backend`` choices).

A back-end is registered by being defined: ``SearchBackend.__init_subclass__`` records a class that names its own
``kind``, with its ``index_config`` and ``search_config``, so a back-end written outside the package is known (to
``hil evaluate``, and among every command's ``--backend`` choices, read when a command line is parsed) as soon as
its module is imported, e.g. by naming its settings by ``class_path`` in YAML. The built-in kinds are registered
here from the start with their settings, which are defined beside their searchers (``token_ann_configs``,
``centroid_configs``, ``muvera_configs``) and torch-free, so that a command line is parsed and checked without
torch; their back-end classes join their entries when :mod:`hil.retrieval.backends.registry` imports them.

The settings themselves (:class:`IndexConfig`, :class:`SearchConfig`: :mod:`~hil.retrieval.backends.config_base`)
and every built-in's classes are exported here under the names YAML uses, e.g.::

    backend: {class_path: hil.retrieval.backends.configs.PlaidIndexConfig, init_args: {residual_bits: 2}}
    search: {class_path: hil.retrieval.backends.configs.PlaidSearchConfig, init_args: {nprobe: 16}}

An untyped ``faiss_params`` / ``backend_params`` dict (the spelling before these classes) is split into the two by
:func:`configs_from_params`, which names a key that belongs to neither.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Mapping

from hil.errors import UserError
from hil.retrieval.backends.centroid_configs import (
    ASSIGNMENTS,
    KEEP_FP16_UP_TO_BYTES,
    KMEANS_CHOICES,
    LARGE_CORPUS_RESIDUAL_BITS,
    PlaidIndexConfig,
    PlaidSearchConfig,
)
from hil.retrieval.backends.config_base import BackendConfig, IndexConfig, SearchConfig
from hil.retrieval.backends.muvera_configs import (
    MUVERA_MIN_CANDIDATES,
    MUVERA_TRANSFORMS,
    MuveraIndexConfig,
    MuveraSearchConfig,
)
from hil.retrieval.backends.token_ann_configs import (
    FlatIndexConfig,
    FlatSearchConfig,
    IvfFlatIndexConfig,
    IvfPqIndexConfig,
    IvfSearchConfig,
)

__all__ = [
    "REGISTRY", "BACKEND_CHOICES", "BackendKind", "register", "backend_kinds", "check_kind", "index_config",
    "default_search", "check_search", "with_search_values", "configs_from_params",
    "BackendConfig", "IndexConfig", "SearchConfig",
    "FlatIndexConfig", "FlatSearchConfig", "IvfFlatIndexConfig", "IvfPqIndexConfig", "IvfSearchConfig",
    "PlaidIndexConfig", "PlaidSearchConfig", "MuveraIndexConfig", "MuveraSearchConfig",
    "ASSIGNMENTS", "KEEP_FP16_UP_TO_BYTES", "KMEANS_CHOICES", "LARGE_CORPUS_RESIDUAL_BITS", "MUVERA_MIN_CANDIDATES",
    "MUVERA_TRANSFORMS"]


@dataclass(frozen=True)
class BackendKind:
    """One registered kind: its settings classes and the back-end class that serves it (``backend``: a
    ``SearchBackend`` subclass, None while it is not defined yet: a built-in's until its module is imported)."""

    kind: str
    index_config: type[IndexConfig]
    search_config: type[SearchConfig]
    backend: type | None = None


REGISTRY: dict[str, BackendKind] = {}  # kind -> its entry, in the order kinds were registered (built-ins first)


def register(kind: str, index_config: type[IndexConfig], search_config: type[SearchConfig],
             backend: type | None = None) -> BackendKind:
    """Make ``kind`` known with its settings classes (and the back-end class serving it, when given); -> its entry.

    Registering a kind again with the same settings completes its entry with a back-end class (a built-in's, when
    its module is imported); other settings classes, or a second, different back-end class, are refused."""
    if getattr(index_config, "kind", None) != kind:
        raise ValueError(f"{index_config.__qualname__}.kind must be {kind!r} to configure back-end kind {kind!r}")
    entry = REGISTRY.get(kind)
    if entry is None:
        entry = BackendKind(kind, index_config, search_config, backend)
    elif (entry.index_config, entry.search_config) != (index_config, search_config):
        raise ValueError(f"back-end kind {kind!r} is already registered with {entry.index_config.__qualname__} / "
                         f"{entry.search_config.__qualname__}")
    elif backend is not None and entry.backend not in (None, backend):
        raise ValueError(f"back-end kind {kind!r} is already {entry.backend.__qualname__}")
    elif backend is not None:
        entry = replace(entry, backend=backend)
    REGISTRY[kind] = entry
    return entry


# The built-in kinds, in the order every list shows them; their back-end classes join when they are defined.
for _index, _search in ((FlatIndexConfig, FlatSearchConfig), (IvfFlatIndexConfig, IvfSearchConfig),
                        (IvfPqIndexConfig, IvfSearchConfig), (PlaidIndexConfig, PlaidSearchConfig),
                        (MuveraIndexConfig, MuveraSearchConfig)):
    register(_index.kind, _index, _search)
del _index, _search


def backend_kinds() -> tuple[str, ...]:
    """Every registered kind: the built-ins, then the others in the order they were defined."""
    return tuple(REGISTRY)


class RegisteredKinds(list):
    """The registered kinds as a command's ``--backend`` choices: read from :data:`REGISTRY` whenever they are
    asked for (an option checked, ``--help`` shown), not when the parser is built, so that a back-end defined
    after that, outside the package, is among them. A ``list`` that holds nothing itself only because jsonargparse
    copies choices of any other type into a tuple when the option is declared, which would freeze them."""

    def __iter__(self) -> Iterator[str]:
        return iter(backend_kinds())

    def __getitem__(self, index: Any) -> Any:
        return backend_kinds()[index]

    def __len__(self) -> int:
        return len(REGISTRY)

    def __contains__(self, kind: object) -> bool:
        return kind in REGISTRY

    def __repr__(self) -> str:
        return repr(backend_kinds())


BACKEND_CHOICES = RegisteredKinds()

# The registry's views before it was one (hil.compat lists them): kind -> settings class, and the kinds.
_VIEWS = {"INDEX_CONFIGS": lambda: {kind: entry.index_config for kind, entry in REGISTRY.items()},
          "SEARCH_CONFIGS": lambda: {kind: entry.search_config for kind, entry in REGISTRY.items()},
          "BACKEND_KINDS": backend_kinds}


def __getattr__(name: str) -> Any:
    if name in _VIEWS:
        warnings.warn(f"hil.retrieval.backends.configs.{name} is deprecated: use REGISTRY (kind -> BackendKind) or "
                      "backend_kinds()", DeprecationWarning, stacklevel=2)
        return _VIEWS[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_kind(kind: str) -> str:
    """``kind`` when it is registered; else refused, naming the registered kinds."""
    if kind not in REGISTRY:
        raise UserError(f"backend must be one of {backend_kinds()}, got {kind!r}")
    return kind


def index_config(backend: str | IndexConfig) -> IndexConfig:
    """``backend`` as build-time settings: a config as is, a kind name with every default."""
    if isinstance(backend, IndexConfig):
        return backend
    return REGISTRY[check_kind(backend)].index_config()


def default_search(kind: str) -> SearchConfig:
    """The search-time defaults of back-end ``kind``."""
    return REGISTRY[check_kind(kind)].search_config()


def check_search(kind: str, search: SearchConfig | None) -> SearchConfig:
    """``search`` (default: ``kind``'s defaults), refused when it steers another back-end than ``kind``'s."""
    if search is None:
        return default_search(kind)
    expected = REGISTRY[check_kind(kind)].search_config
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
    entry = REGISTRY[check_kind(kind)]
    build, search = entry.index_config, entry.search_config
    unknown = set(params) - build.field_names() - search.field_names()
    if unknown:
        raise UserError(f"parameters {sorted(unknown)} do not apply to backend {kind!r} (build time: "
                        f"{sorted(build.field_names())}; search time: {sorted(search.field_names())})")
    return (build(**{k: v for k, v in params.items() if k in build.field_names()}),
            search(**{k: v for k, v in params.items() if k in search.field_names()}))
