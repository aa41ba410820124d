"""Which back-end serves which ``kind``: :data:`~hil.retrieval.backends.base.BACKENDS`, where every back-end class
registers itself when it is defined (this module imports the built-in ones; their settings classes are known to
:mod:`~hil.retrieval.backends.configs` from the start).

``index.json`` records the kind an index was built with (under ``"backend"``; ``"faiss"`` in indexes written before
0.2); building, rebuilding and searching all look the class up here instead of branching on the kind.
"""

from __future__ import annotations

from typing import Any

import torch

from hil.errors import UserError
from hil.retrieval.backends import (  # noqa: F401
    centroid,
    muvera,
    token_ann,  # noqa: F401,I001  (defining them registers them; flat, ivf* first)
)
from hil.retrieval.backends.base import BACKENDS, SearchBackend
from hil.retrieval.backends.configs import SearchConfig
from hil.retrieval.index import TokenIndex

# The built-in kinds in the order every list shows them, whichever module happened to be imported first (a module
# importing centroid.py directly registers plaid before flat); back-ends defined elsewhere follow, as registered.
BUILT_IN_KINDS = ("flat", "ivfflat", "ivfpq", "plaid", "muvera")


def backend_kinds() -> tuple[str, ...]:
    """Every registered kind: the built-ins in :data:`BUILT_IN_KINDS`' order, then the others as registered."""
    return tuple(k for k in BUILT_IN_KINDS if k in BACKENDS) + tuple(k for k in BACKENDS if k not in BUILT_IN_KINDS)


def __getattr__(name: str) -> Any:
    if name == "BACKEND_KINDS":
        return backend_kinds()
    if name == "FAISS_KINDS":  # the name before 0.2
        return backend_kinds()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def backend_class(kind: str) -> type[SearchBackend]:
    """The back-end registered as ``kind``; an unknown kind is refused with the known ones listed."""
    if kind not in BACKENDS:
        raise UserError(f"backend must be one of {backend_kinds()}, got {kind!r}")
    return BACKENDS[kind]


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
