"""``model.init_from``: the weights a training run starts from, from any layout ``load_encoder`` reads.

- a ``.ckpt`` of ``train.py``: its ``encoder.*`` weights;
- our export: its encoder's weights;
- a Stanford ColBERT or PyLate checkpoint: its backbone and its projection, which becomes a ColBERT's ``linear``
  or a ColBERT-HIL's H head ``linear_H`` (the paper's H head is ColBERT's contextual projection); HIL's L head,
  IDF table and z-score statistics are not in such a checkpoint and start as configured (a notice says so).

The checkpoint's marker tokens must be the model's (they are vocabulary entries the backbone was trained with): a
mismatch is one line naming the setting to change. Other settings (lengths, ``attend_to_mask_tokens``,
``mask_punctuation``) may differ on purpose when fine-tuning; the differences are listed in a notice.
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch import Tensor

from hil.errors import UserError
from hil.modeling.encoder import MultiVectorEncoder, load_backbone
from hil.modeling.formats import ForeignColBERT, ModelFormatError, model_layout, read_foreign
from hil.modeling.hub import local_model_dir
from hil.modeling.loading import load_encoder, read_lightning_checkpoint

logger = logging.getLogger(__name__)
# The head a foreign projection seeds, by architecture.
SEEDED_HEAD = {"colbert": "linear", "hil": "linear_H"}
MARKERS = ("query_marker", "doc_marker")
COMPARED = ("query_maxlen", "doc_maxlen", "mask_punctuation", "attend_to_mask_tokens")


def _foreign_state(encoder: MultiVectorEncoder, foreign: ForeignColBERT, source: str) -> dict[str, Tensor]:
    ours = encoder.tokenizer.settings()
    for key in MARKERS:
        if ours[key] != foreign.settings[key]:
            raise ModelFormatError(
                f"model.init_from={source}: its {key} is {foreign.settings[key]!r} but "
                f"model.encoder.init_args.{key} is {ours[key]!r}; set it to {foreign.settings[key]!r} (and "
                f"model.encoder.init_args.backbone to {source} when that token was added to its vocabulary)")
    differing = {key: (ours[key], foreign.settings[key]) for key in COMPARED if ours[key] != foreign.settings[key]}
    if differing:
        logger.warning("model.init_from=%s: fine-tuning with settings of its own (model, checkpoint): %s",
                       source, differing)
    head = SEEDED_HEAD.get(encoder.architecture)
    if head is None:
        raise ModelFormatError(f"model.init_from={source}: a {foreign.layout} checkpoint cannot seed a "
                               f"{encoder.architecture} model")
    if foreign.bias is not None and getattr(encoder, head).bias is None:
        raise ModelFormatError(f"model.init_from={source}: its projection has a bias; this model's {head} has none "
                               f"(set model.encoder.init_args.projection_bias: true for a ColBERT)")
    backbone, _ = load_backbone(str(foreign.backbone_dir))
    state = {f"backbone.{key}": value for key, value in backbone.state_dict().items()}
    state[f"{head}.weight"] = foreign.weight
    if foreign.bias is not None:
        state[f"{head}.bias"] = foreign.bias
    if encoder.architecture == "hil":
        logger.warning("model.init_from=%s: backbone and H head from this %s checkpoint; the L head, IDF table and "
                       "z-score statistics start as configured", source, foreign.layout)
    return state


def initial_state(encoder: MultiVectorEncoder, source: str) -> tuple[dict[str, Tensor], set[str]]:
    """The state to load into ``encoder`` from ``source``, and the keys it may leave as they are."""
    path = Path(source).expanduser()
    if path.is_file():
        checkpoint = read_lightning_checkpoint(path)
        if "state_dict" not in checkpoint:
            raise ModelFormatError(f"model.init_from={source}: a checkpoint without a state_dict")
        state = {k.removeprefix("encoder."): v for k, v in checkpoint["state_dict"].items() if k.startswith("encoder.")}
        return state, set()
    try:
        directory = local_model_dir(source)
        layout = model_layout(directory)
    except UserError as error:  # the same kind of error (a missing path stays a FileNotFoundError), named
        raise type(error)(f"model.init_from={source}: {error}") from None
    if layout == "hil":
        return load_encoder(directory).state_dict(), set()
    if layout in ("stanford", "pylate"):
        state = _foreign_state(encoder, read_foreign(directory, layout), source)
        return state, set(encoder.state_dict()) - set(state) if encoder.architecture == "hil" else set()
    raise ModelFormatError(f"model.init_from={source}: a plain backbone without a ColBERT head; set "
                           f"model.encoder.init_args.backbone to it instead")
