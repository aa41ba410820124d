"""A model folder checked before anything reads it: a damaged or truncated file is one line naming it.

An interrupted download or copy is the common way a model folder goes bad, and the libraries that read it fail far
from the cause (a ``SafetensorError`` about a header, a ``JSONDecodeError`` deep in the tokenizer, a tokenizer
loader blaming the hub). :func:`check_model_files` reads what can be checked cheaply and completely, before the
model is built, and raises :class:`~hil.modeling.formats.ModelFormatError` naming the file:

- every ``*.json`` and ``artifact.metadata`` must parse as JSON;
- every ``*.safetensors`` must have a readable header whose tensors exactly cover the file (a truncated file does
  not; ``safetensors`` checks this when it opens one);
- every ``*.pt`` / ``*.bin`` / ``*.ckpt`` written by ``torch.save`` (a zip archive) must pass the archive's CRC-32
  check of every member (:meth:`zipfile.ZipFile.testzip`), which catches truncation and flipped bytes alike;
  a file that is not a zip archive must at least unpickle (``torch.load(weights_only=True)``).

Not caught: flipped bytes inside a safetensors file's tensor data (the format keeps no checksum); such weights load,
and a non-finite score they produce is refused at search time (:mod:`hil.retrieval.integrity`).
"""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path

from hil.modeling.formats import ModelFormatError

JSON_FILES = ("*.json", "artifact.metadata")
TORCH_FILES = ("*.pt", "*.bin", "*.ckpt")
DAMAGED = "damaged or truncated (an interrupted download or copy?); fetch or export it again"


def check_json_file(path: Path) -> None:
    try:
        with open(path, encoding="utf-8") as handle:
            json.load(handle)
    except UnicodeDecodeError as error:
        raise ModelFormatError(f"{path}: not UTF-8 text at byte {error.start}: {DAMAGED}") from None
    except json.JSONDecodeError as error:
        raise ModelFormatError(f"{path}: invalid JSON at line {error.lineno}, column {error.colno} "
                               f"({error.msg}): {DAMAGED}") from None


def check_safetensors_file(path: Path) -> None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except (SafetensorError, OSError, ValueError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ModelFormatError(f"{path}: unreadable safetensors file ({reason}): {DAMAGED}") from None


def check_torch_file(path: Path) -> None:
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
            raise ModelFormatError(f"{path}: unreadable torch archive ({error}): {DAMAGED}") from None
        if bad is not None:
            raise ModelFormatError(f"{path}: member {bad!r} fails its CRC check: {DAMAGED}")
        return
    import torch

    try:  # a legacy (non-zip) torch.save file: it must at least unpickle
        torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, OSError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ModelFormatError(f"{path}: not a readable torch file ({reason[:200]}): {DAMAGED}") from None


def _files(directory: Path, pattern: str) -> list[Path]:
    """``pattern`` in ``directory`` and in its sub-folders (a sentence-transformers / PyLate model keeps modules
    such as ``1_Dense/`` there), hidden folders left out."""
    found = [*directory.glob(pattern), *directory.glob(f"*/{pattern}")]
    return sorted(path for path in found if path.is_file() and not path.parent.name.startswith("."))


def check_model_files(directory: Path) -> None:
    """Check every JSON, safetensors and torch file of ``directory`` (see the module docstring)."""
    if not directory.is_dir():
        return
    for pattern in JSON_FILES:
        for path in _files(directory, pattern):
            check_json_file(path)
    for path in _files(directory, "*.safetensors"):
        check_safetensors_file(path)
    for pattern in TORCH_FILES:
        for path in _files(directory, pattern):
            check_torch_file(path)
