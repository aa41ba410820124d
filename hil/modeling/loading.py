"""Load any retriever: our export, a Lightning checkpoint, a ColBERT-lambda pair, a Stanford ColBERT or PyLate
checkpoint (``hil.modeling.formats``), or a bare backbone (a random head, with a one-line notice saying so).

``ARCHITECTURES`` maps the ``architecture`` recorded in every export and checkpoint to its encoder class. This module
is the only one that knows every encoder class (the encoders never import it), so the import graph stays one-way.
"""

from __future__ import annotations

import logging
import pickle
import zipfile
from pathlib import Path
from typing import Any, Sequence

import torch

from hil.modeling.contracts import Encoder
from hil.modeling.encoder import ColBERTEncoder, MultiVectorEncoder, read_export_config, upgrade_settings
from hil.modeling.ensemble import MEMBER_HEADS, EnsembleEncoder
from hil.modeling.formats import ForeignColBERT, Layout, ModelFormatError, model_layout, read_foreign
from hil.modeling.hil import HILEncoder
from hil.modeling.hub import local_model_dir
from hil.modeling.model_files import check_model_files

logger = logging.getLogger(__name__)

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
        raise ModelFormatError(f"{where}: unknown architecture {architecture!r}; known: "
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
    checkpoint = read_lightning_checkpoint(path)
    meta = checkpoint.get("hil")
    if not isinstance(meta, dict) or "settings" not in meta or "state_dict" not in checkpoint:
        raise ModelFormatError(f"{path}: a Lightning checkpoint without hil's record (not written by train.py)")
    settings = upgrade_settings(meta["settings"])
    cls = _architecture(settings, path)
    settings.pop("architecture")
    encoder = cls(**settings)
    state = {k.removeprefix("encoder."): v for k, v in checkpoint["state_dict"].items() if k.startswith("encoder.")}
    encoder.load_state_dict(state)
    return encoder


def read_lightning_checkpoint(path: Path) -> dict[str, Any]:
    """A ``.ckpt`` file's dictionary; a file that is not one is a one-line ``ModelFormatError``."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, RuntimeError, ValueError, AttributeError,
            ModuleNotFoundError) as error:
        raise ModelFormatError(f"{path}: not a readable PyTorch checkpoint ({error.__class__.__name__}: "
                               f"{str(error).splitlines()[0] if str(error) else ''})") from None
    if not isinstance(checkpoint, dict):
        raise ModelFormatError(f"{path}: not a Lightning checkpoint (holds a {type(checkpoint).__name__})")
    return checkpoint


FOREIGN_OVERRIDES = ("query_maxlen", "doc_maxlen")
UNTRAINED_HEAD_DIM = 128  # the head size of an untrained ColBERT head when none is asked


def check_kept_settings(encoder: Encoder, source: str | Path, requested: dict[str, Any]) -> None:
    """A trained model keeps its own settings: a requested value that differs from the model's is refused, naming
    it (silently ignoring it would evaluate something else than what was asked); equal values are accepted."""
    actual = encoder.settings()
    differing = {key: value for key, value in requested.items() if actual.get(key) != value}
    if differing:
        have = {key: actual.get(key) for key in differing}
        raise ModelFormatError(f"{source}: a trained {encoder.architecture} model keeps its own settings "
                               f"{have}; {differing} asked (these options apply to an untrained backbone)")


def encoder_from_foreign(foreign: ForeignColBERT, **overrides: Any) -> ColBERTEncoder:
    """A ``ColBERTEncoder`` scoring exactly as the peer's checkpoint: its backbone, projection and settings.

    ``query_maxlen``/``doc_maxlen`` may be overridden (as both peers allow at load time); ``dim`` must agree.
    """
    for note in foreign.notes:
        logger.warning(note)
    dim = overrides.pop("dim", None)
    if dim is not None and int(dim) != foreign.settings["dim"]:
        raise ModelFormatError(f"{foreign.backbone_dir}: dim {dim} asked, but the checkpoint's projection gives "
                               f"{foreign.settings['dim']}")
    unknown = sorted(set(overrides) - set(FOREIGN_OVERRIDES))
    if unknown:
        raise ModelFormatError(f"{foreign.backbone_dir}: a trained {foreign.layout} checkpoint keeps its own "
                               f"{unknown}")
    settings = {**foreign.settings, **overrides, "projection_bias": foreign.bias is not None}
    encoder = ColBERTEncoder(str(foreign.backbone_dir), **settings)
    if tuple(encoder.linear.weight.shape) != tuple(foreign.weight.shape):
        raise ModelFormatError(f"{foreign.backbone_dir}: the projection is {tuple(foreign.weight.shape)}, but the "
                               f"backbone's hidden size is {encoder.hidden_size}")
    with torch.no_grad():
        encoder.linear.weight.copy_(foreign.weight)
        if foreign.bias is not None:
            encoder.linear.bias.copy_(foreign.bias)
    return encoder


def load_encoder(source: str | Path | Sequence[str | Path], layout: Layout | None = None,
                 **backbone_settings: Any) -> Encoder:
    """An encoder in eval mode from any model the field publishes.

    ``source``: our export folder, a ``.ckpt`` of ``train.py``, a Stanford ColBERT or PyLate checkpoint folder, a
    plain Hugging Face backbone, each as a local path, a name under ``HIL_MODELS_DIR`` or a hub id. ``layout``
    forces how a folder is read (``"stanford"`` reads our ColBERT export through its Stanford files, say).

    A bare backbone (``layout`` "backbone" or "sentence-transformers", i.e. no ColBERT head) gets an untrained
    ColBERT head, a random projection (seed torch first for a fixed one) built with ``backbone_settings`` (dim,
    query_maxlen, doc_maxlen), and a one-line notice says so. Trained models keep their own settings.

    ColBERT-lambda: ``"iso_source+aniso_source"`` or a list ``[iso_source, aniso_source]`` loads both trained
    models and returns an ``EnsembleEncoder`` (heads ``iso`` and ``aniso``, scores added); ``weights=(w_iso,
    w_aniso)`` may be passed. An exported ensemble directory loads the same way as any export.
    """
    members = split_ensemble_source(source)
    if members is not None:
        if len(members) != 2 or not all(members):
            raise ModelFormatError(f"ensemble source {source!r}: give exactly two models, iso then aniso "
                                   f"(\"iso.ckpt+aniso.ckpt\" or a list of two)")
        weights = backbone_settings.pop("weights", (1.0, 1.0))
        if backbone_settings:
            raise ModelFormatError(f"ensemble source {source!r}: members are trained models and keep their own "
                                   f"settings; unexpected {sorted(backbone_settings)}")
        loaded = [load_encoder(member) for member in members]
        return EnsembleEncoder(*loaded, weights=weights, sources=members).eval()
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix != ".ckpt":
            raise ModelFormatError(f"{path}: a file, but not a Lightning .ckpt; give a .ckpt or a model folder")
        encoder = encoder_from_checkpoint(path)
        check_kept_settings(encoder, path, backbone_settings)
        return encoder.eval()
    directory = local_model_dir(source)
    check_model_files(directory)  # a damaged file: one line naming it, before any library reads it
    found = layout or model_layout(directory)
    if found == "hil":
        settings = read_export_config(directory)["settings"]
        if settings.get("architecture") == EnsembleEncoder.architecture:
            encoder = load_ensemble(directory)
        else:
            encoder = _architecture(settings, directory).from_pretrained(directory)
        check_kept_settings(encoder, directory, backbone_settings)
    elif found in ("stanford", "pylate"):
        encoder = encoder_from_foreign(read_foreign(directory, found), **backbone_settings)
    else:
        backbone_settings.setdefault("dim", UNTRAINED_HEAD_DIM)
        logger.warning("%s: a %s without a ColBERT head; its projection head is untrained (random, dim %s)",
                       source, "sentence-transformers model" if found == "sentence-transformers" else "backbone",
                       backbone_settings["dim"])
        encoder = ColBERTEncoder(str(directory), **backbone_settings)
    return encoder.eval()
