"""Which back-end class serves which ``kind``: the one registry
(:data:`~hil.retrieval.backends.configs.REGISTRY`) with every built-in back-end class in it, which this module
imports (defining them completes their entries), and an index's back-end opened by its kind.

``index.json`` records the kind an index was built with (under ``"backend"``; ``"faiss"`` in indexes written before
0.2); building, rebuilding and searching all look the class up here instead of branching on the kind.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from hil.errors import UserError
from hil.retrieval.backends import (  # noqa: F401  (defining them registers their classes)
    centroid,
    muvera,
    token_ann,
)
from hil.retrieval.backends.base import SearchBackend
from hil.retrieval.backends.configs import REGISTRY, SearchConfig, backend_kinds, check_kind
from hil.retrieval.index import TokenIndex


def __getattr__(name: str) -> Any:
    if name == "BACKENDS":  # kind -> class: the registry's view before it was one (hil.compat lists it)
        warnings.warn("hil.retrieval.backends.registry.BACKENDS is deprecated: use backend_class(kind), "
                      "backend_classes() or hil.retrieval.backends.configs.REGISTRY", DeprecationWarning, stacklevel=2)
        return {kind: backend_class(kind) for kind in backend_kinds()}
    if name == "BACKEND_KINDS":  # hil.compat lists it
        warnings.warn("hil.retrieval.backends.registry.BACKEND_KINDS is deprecated: use "
                      "hil.retrieval.backends.configs.backend_kinds()", DeprecationWarning, stacklevel=2)
        return backend_kinds()
    if name == "FAISS_KINDS":  # the name before 0.2
        return backend_kinds()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def backend_class(kind: str) -> type[SearchBackend]:
    """The back-end registered as ``kind``; an unknown kind is refused with the known ones listed."""
    backend = REGISTRY[check_kind(kind)].backend
    if backend is None:  # settings registered without a class (a built-in's are all imported above)
        raise UserError(f"backend {kind!r} has settings but no SearchBackend class: import the module defining it")
    return backend


def backend_classes() -> tuple[type[SearchBackend], ...]:
    """The class of every registered kind, in :func:`~hil.retrieval.backends.configs.backend_kinds`' order."""
    return tuple(entry.backend for entry in REGISTRY.values() if entry.backend is not None)


def open_backend(index: TokenIndex, search: SearchConfig | None = None, *, use_gpu: bool = False,
                 gpu_device: int = 0, device: torch.device | None = None, depth: int | None = None
                 ) -> SearchBackend:
    """The back-end of ``index``'s kind, bound to it with search-time settings ``search`` (the kind's defaults when
    None; settings of another kind are refused); ``device``: where its torch stages run (None: the queries');
    ``depth``: the k its searches rank to (PLAID's defaults depend on it).

    Cheap: what it loads (FAISS indexes, centroid plans) is kept with the opened index, not with the back-end.
    """
    return backend_class(index.backend_settings["kind"])(index, search, use_gpu=use_gpu, gpu_device=gpu_device,
                                                          device=device, depth=depth)
