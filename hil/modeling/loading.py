"""Load any trained retriever: an export directory, a Lightning checkpoint, a ColBERT-lambda pair, or a bare backbone.

``ARCHITECTURES`` maps the ``architecture`` recorded in every export and checkpoint to its encoder class. This module
is the only one that knows every encoder class (the encoders never import it), so the import graph stays one-way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from hil.modeling.contracts import Encoder
from hil.modeling.encoder import CONFIG_NAME, ColBERTEncoder, MultiVectorEncoder, read_export_config, upgrade_settings
from hil.modeling.ensemble import MEMBER_HEADS, EnsembleEncoder
from hil.modeling.hil import HILEncoder

ARCHITECTURES: dict[str, type[MultiVectorEncoder]] = {"colbert": ColBERTEncoder, "hil": HILEncoder}
ENSEMBLE_SEPARATOR = "+"


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


def _architecture(settings: dict[str, Any], where: Path) -> type[MultiVectorEncoder]:
    architecture = settings.get("architecture")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"{where}: unknown architecture {architecture!r}; known: "
                         f"{sorted([*ARCHITECTURES, EnsembleEncoder.architecture])}")
    return ARCHITECTURES[architecture]


def load_ensemble(directory: Path) -> EnsembleEncoder:
    """An exported ColBERT-lambda: ``<dir>/iso`` and ``<dir>/aniso`` member exports plus its ``hil_config.json``."""
    settings = read_export_config(directory)["settings"]
    weights = settings.get("weights", {})
    members = [load_encoder(directory / name) for name in MEMBER_HEADS]
    sources = settings.get("backbone") or {}
    return EnsembleEncoder(*members, weights=(float(weights.get("iso", 1.0)), float(weights.get("aniso", 1.0))),
                           sources=[sources.get(name) or str(directory / name) for name in MEMBER_HEADS])


def encoder_from_checkpoint(path: Path) -> MultiVectorEncoder:
    """The encoder of a Lightning ``.ckpt`` written by ``train.py``: built from the settings the checkpoint records
    (``checkpoint["hil"]["settings"]``), then given its ``encoder.*`` weights (every one, strictly)."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    meta = checkpoint.get("hil")
    if meta is None or "settings" not in meta:
        raise ValueError(f"{path}: not a hil checkpoint (no 'hil' record)")
    settings = upgrade_settings(meta["settings"])
    cls = _architecture(settings, path)
    settings.pop("architecture")
    encoder = cls(**settings)
    state = {k.removeprefix("encoder."): v for k, v in checkpoint["state_dict"].items() if k.startswith("encoder.")}
    encoder.load_state_dict(state)
    return encoder


def load_encoder(source: str | Path | Sequence[str | Path], **backbone_settings: Any) -> Encoder:
    """An encoder in eval mode from an export directory, a ``.ckpt``, or a bare backbone.

    A bare backbone gets an untrained ColBERT head (a random projection; seed torch first for a fixed one) built
    with ``backbone_settings`` (dim, query_maxlen, doc_maxlen). Trained models keep their own settings.

    ColBERT-lambda: ``"iso_source+aniso_source"`` or a list ``[iso_source, aniso_source]`` loads both trained
    models and returns an ``EnsembleEncoder`` (heads ``iso`` and ``aniso``, scores added); ``weights=(w_iso,
    w_aniso)`` may be passed. An exported ensemble directory loads the same way as any export.
    """
    members = split_ensemble_source(source)
    if members is not None:
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
    encoder: Encoder
    if path.is_dir() and (path / CONFIG_NAME).is_file():
        settings = read_export_config(path)["settings"]
        if settings.get("architecture") == EnsembleEncoder.architecture:
            encoder = load_ensemble(path)
        else:
            encoder = _architecture(settings, path / CONFIG_NAME).from_pretrained(path)
    elif path.is_file() and path.suffix == ".ckpt":
        encoder = encoder_from_checkpoint(path)
    else:
        encoder = ColBERTEncoder(str(source), **backbone_settings)
    return encoder.eval()
