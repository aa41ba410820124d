"""Load any trained retriever from an export directory or a Lightning checkpoint."""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from hil.modeling.encoder import ColBERTEncoder, MultiVectorEncoder, read_export_config

ARCHITECTURES: dict[str, str] = {
    "colbert": "hil.modeling.encoder.ColBERTEncoder",
    "hil": "hil.modeling.hil.HILEncoder",
}


def _import(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def load_encoder(source: str | Path, **backbone_settings) -> MultiVectorEncoder:
    """An encoder in eval mode from an export directory, a ``.ckpt``, or a bare backbone.

    A bare backbone gets an untrained ColBERT head (a random projection; seed torch first for a fixed one) built
    with ``backbone_settings`` (dim, query_maxlen, doc_maxlen). Trained models keep their own settings.
    """
    path = Path(source)
    if path.is_dir() and (path / "hil_config.json").is_file():
        architecture = read_export_config(path)["settings"]["architecture"]
        if architecture not in ARCHITECTURES:
            raise ValueError(f"{path}: unknown architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
        encoder = _import(ARCHITECTURES[architecture]).from_pretrained(path)
    elif path.is_file() and path.suffix == ".ckpt":
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        meta = checkpoint.get("hil")
        if meta is None:
            raise ValueError(f"{path}: not a hil checkpoint (no 'hil' record)")
        module = _import(meta["module_class"])(**{**checkpoint["hyper_parameters"], "init_from": None})
        module.load_state_dict(checkpoint["state_dict"])
        encoder = module.encoder
    else:
        encoder = ColBERTEncoder(str(source), **backbone_settings)
    return encoder.eval()
