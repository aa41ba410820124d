"""The two kinds of typed settings every search back-end declares: what is fixed when an index is built, and what
steers each search.

- an :class:`IndexConfig` (build time): the structure written beside the vectors (IVF lists, PQ codes, PLAID
  centroids, residual codes). An index records its resolved values in ``index.json``; a reused index is compared
  on these only (:func:`hil.retrieval.builder.open_or_build_index`), and a different value rebuilds the structure.
- a :class:`SearchConfig` (search time): how many lists or centroids a query probes, how many candidates survive.
  Nothing of it is stored with the index: it is applied at every search, and the values the back-end used are read
  back from it after the search (``SearchBackend.search_stats``) for the results file.

Both are frozen dataclasses selectable by ``class_path`` in YAML (as Lightning IR's ``FaissIVFPQIndexConfig`` and
``SearchConfig``). Each back-end's own classes are defined beside its searcher (``token_ann_configs``,
``centroid_configs``, ``muvera_configs`` beside ``token_ann``, ``centroid``, ``muvera``); the one registry of kinds
(:mod:`hil.retrieval.backends.configs`) exports them all and re-exports these base classes. This module is below
both, so that the registry can import every built-in's settings (torch-free: a command line is parsed against them)
and they can import these.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, ClassVar, TypeVar

from hil.errors import UserError

# The module the built-in settings classes are recorded under (``class_path`` in results and ``--print_config``,
# their YAML name, part of the identity of every finished full-ranking column): the registry, which exports them
# and defined them before they moved beside their searchers. Recording the module they moved to would change those
# identities, and every finished column would be computed again.
BUILT_IN_HOME = "hil.retrieval.backends.configs"

Config = TypeVar("Config", bound=type)


def at_least(owner: object, name: str, value: int | None, low: int = 1) -> None:
    """Refuse ``owner.name`` unless it is None or an integer >= ``low`` (a bool is not an integer here)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
        raise UserError(f"{type(owner).__name__}.{name} must be an integer >= {low} (got {value!r})")


def built_in(cls: Config) -> Config:
    """Mark ``cls`` as a built-in back-end's settings: recorded under :data:`BUILT_IN_HOME` (not inherited, so a
    subclass defined elsewhere is recorded under its own module)."""
    cls.home = BUILT_IN_HOME
    return cls


class BackendConfig:
    """Shared behaviour of both kinds of settings: the back-end ``kind`` they belong to, and their values."""

    kind: ClassVar[str]
    home: ClassVar[str | None] = None  # the module a class is recorded under when not its own (see built_in)

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
        cls = type(self)
        module = cls.__dict__.get("home") or cls.__module__
        return {"class_path": f"{module}.{cls.__name__}", "init_args": self.values()}


class IndexConfig(BackendConfig):
    """Build-time settings of a back-end (see the module docstring)."""


class SearchConfig(BackendConfig):
    """Search-time settings of a back-end (see the module docstring)."""

    def for_depth(self, k: int) -> "SearchConfig":
        """The settings a search ranking ``k`` documents applies: these, unless a back-end's defaults depend on k
        (PLAID's do: :meth:`PlaidSearchConfig.for_depth`)."""
        return self

