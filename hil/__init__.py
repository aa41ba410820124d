"""hil: isotropy-regularized late-interaction retrievers (ColBERT, ColBERT-HIL).

The Python API (``hil.api``) is available from here: ``hil.load_model``, ``hil.encode_queries``,
``hil.encode_documents``, ``hil.score``, ``hil.build_index``, ``hil.open_index``, ``hil.search``,
``hil.evaluate_run``, ``hil.load_dataset``, ``hil.export_model``, ``hil.push_to_hub``, ``hil.write_model_card``.
They are imported on first use (PEP 562), so ``import hil.data`` stays light and the package's layers stay
one-way.
"""

from typing import Any

__version__ = "0.2.0"  # the one version source: pyproject.toml reads it (tool.setuptools.dynamic)
API = ("load_model", "encode_queries", "encode_documents", "score", "build_index", "open_index", "search",
       "evaluate_run", "load_dataset", "export_model", "push_to_hub", "write_model_card")
__all__ = ["__version__", *API]


def __getattr__(name: str) -> Any:
    if name in API:
        from hil import api

        return getattr(api, name)
    raise AttributeError(f"module 'hil' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *API])
