"""Where data and models live: settings, never paths inside the code.

``HIL_DATA_DIR``   a folder holding BEIR datasets as ``<dir>/beir/<name>`` or ``<dir>/<name>``,
                   and MS MARCO files under ``<dir>/msmarco``.
``HIL_MODELS_DIR`` a folder holding Hugging Face model directories by their base name; a hub name such as
                   ``sentence-transformers/all-MiniLM-L6-v2`` resolves to ``<dir>/all-MiniLM-L6-v2`` when it exists.
``HIL_CACHE_DIR``  a folder for derived files (the line offsets of big training files, ``hil.data.line_index``):
                   when set they go there, instead of beside their data (or ``~/.cache/hil`` for read-only data).

Anything not found locally is passed through unchanged so that Hugging Face hub loading works online.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "HIL_DATA_DIR"
MODELS_DIR_ENV = "HIL_MODELS_DIR"
CACHE_DIR_ENV = "HIL_CACHE_DIR"


def _env_dir(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def resolve_model(name_or_path: str | os.PathLike) -> str:
    """A local directory for ``name_or_path`` if there is one, else the name itself (a hub id)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return str(path)
    models_dir = _env_dir(MODELS_DIR_ENV)
    if models_dir is not None:
        candidate = models_dir / Path(str(name_or_path)).name
        if candidate.is_dir():
            return str(candidate)
    return str(name_or_path)


def resolve_dataset(name_or_path: str | os.PathLike, data_dir: str | os.PathLike | None = None) -> Path | None:
    """The local BEIR folder for a dataset name or path, or None when it is only on the hub."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    root = Path(data_dir).expanduser() if data_dir is not None else _env_dir(DATA_DIR_ENV)
    if root is None:
        return None
    for candidate in (root / "beir" / str(name_or_path), root / str(name_or_path)):
        if candidate.is_dir():
            return candidate
    return None


def resolve_data_file(name_or_path: str | os.PathLike, data_dir: str | os.PathLike | None = None) -> Path:
    """A data file given as a path, or relative to ``HIL_DATA_DIR`` (e.g. ``msmarco/triples.tsv``)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    root = Path(data_dir).expanduser() if data_dir is not None else _env_dir(DATA_DIR_ENV)
    if root is not None and (root / path).exists():
        return root / path
    hint = f" (also looked under {DATA_DIR_ENV}={root})" if root is not None else f" (set {DATA_DIR_ENV} to look there)"
    raise FileNotFoundError(f"{name_or_path}: no such file{hint}")


CONFIGS_DIR = Path(__file__).resolve().parent / "configs"  # the YAML recipes, installed with the package


def resolve_config(value: str) -> str:
    """A ``--config`` value: an existing file as given, else a recipe of the package named ``colbert``,
    ``colbert_hil``, ``variants/colbert_hil``, ``presets/smoke`` (``.yaml`` optional); anything else unchanged (the
    CLI then says the file is missing)."""
    if Path(value).expanduser().exists() or not value or "\n" in value or value.lstrip().startswith(("{", "[")):
        return value
    name = value.removesuffix(".yaml").removeprefix("configs/")
    direct = CONFIGS_DIR / f"{name}.yaml"
    if direct.is_file():
        return str(direct)
    matches = sorted(CONFIGS_DIR.rglob(f"{Path(name).name}.yaml")) if "/" not in name else []
    return str(matches[0]) if len(matches) == 1 else value
