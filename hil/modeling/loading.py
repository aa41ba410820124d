"""Load any trained retriever from an export directory or a Lightning checkpoint."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Sequence

import torch

from hil.modeling.encoder import ColBERTEncoder, MultiVectorEncoder, read_export_config

ARCHITECTURES: dict[str, str] = {
    "colbert": "hil.modeling.encoder.ColBERTEncoder",
    "hil": "hil.modeling.hil.HILEncoder",
    "ensemble": "hil.modeling.ensemble.EnsembleEncoder",
}

ENSEMBLE_SEPARATOR = "+"


def _import(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def split_ensemble_source(source: str | Path | Sequence[str | Path]) -> list[str] | None:
    """The member sources of an ensemble spec (``"iso.ckpt+aniso.ckpt"`` or a list of two), else None.

    A string is split on ``+`` only when it is not itself an existing path (paths may contain ``+``).
    """
    if isinstance(source, (list, tuple)):
        return [str(s) for s in source]
    text = str(source)
    if ENSEMBLE_SEPARATOR in text and not Path(text).exists():
        return [part for part in text.split(ENSEMBLE_SEPARATOR)]
    return None


def load_encoder(source: str | Path | Sequence[str | Path], **backbone_settings) -> MultiVectorEncoder:
    """An encoder in eval mode from an export directory, a ``.ckpt``, or a bare backbone.

    A bare backbone gets an untrained ColBERT head (a random projection; seed torch first for a fixed one) built
    with ``backbone_settings`` (dim, query_maxlen, doc_maxlen). Trained models keep their own settings.

    ColBERT-lambda: ``"iso_source+aniso_source"`` or a list ``[iso_source, aniso_source]`` loads both trained
    models and returns an ``EnsembleEncoder`` (heads ``iso`` and ``aniso``, scores added); ``weights=(w_iso,
    w_aniso)`` may be passed. An exported ensemble directory loads the same way as any export.
    """
    members = split_ensemble_source(source)
    if members is not None:
        from hil.modeling.ensemble import EnsembleEncoder

        if len(members) != 2 or not all(members):
            raise ValueError(f"ensemble source {source!r}: give exactly two models, iso then aniso "
                             f"(\"iso.ckpt+aniso.ckpt\" or a list of two)")
        weights = backbone_settings.pop("weights", (1.0, 1.0))
        if backbone_settings:
            raise ValueError(f"ensemble source {source!r}: members are trained models and keep their own settings; "
                             f"unexpected {sorted(backbone_settings)}")
        loaded = [load_encoder(member) for member in members]
        return EnsembleEncoder(*loaded, weights=weights, sources=members).eval()
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
