"""Which back-end serves which ``kind``: the one place that knows every back-end class.

``index.json`` records the kind an index was built with (under ``"faiss"``, the historical name); building,
rebuilding and searching all look the class up here instead of branching on the kind.
"""

from __future__ import annotations

from hil.retrieval.backends.base import CandidateSettings, SearchBackend
from hil.retrieval.backends.centroid import PlaidBackend
from hil.retrieval.backends.token_ann import FlatBackend, IvfFlatBackend, IvfPqBackend
from hil.retrieval.index import TokenIndex

BACKENDS: dict[str, type[SearchBackend]] = {
    backend.kind: backend for backend in (FlatBackend, IvfFlatBackend, IvfPqBackend, PlaidBackend)}
FAISS_KINDS = tuple(BACKENDS)


def backend_class(kind: str) -> type[SearchBackend]:
    """The back-end registered as ``kind``; an unknown kind is refused with the known ones listed."""
    if kind not in BACKENDS:
        raise ValueError(f"faiss_kind must be one of {FAISS_KINDS}, got {kind!r}")
    return BACKENDS[kind]


def open_backend(index: TokenIndex, settings: CandidateSettings | None = None) -> SearchBackend:
    """The back-end of ``index``'s kind, bound to it with search-time ``settings`` (defaults when None).

    Cheap: what it loads (FAISS indexes, centroid plans) is kept with the opened index, not with the back-end.
    """
    return backend_class(index.faiss_settings["kind"])(index, settings or CandidateSettings())
