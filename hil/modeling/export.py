"""Exports: our own layout for every model, and the Stanford ColBERT layout beside it for a ColBERT.

``export_model`` writes, into one folder, what ``hil`` loads (``hil_config.json``, ``hil_heads.pt``, the backbone
and tokenizer) and, for a ``ColBERTEncoder`` without a projection bias, the Stanford ColBERT layout too: the
weights file holds the backbone under its ``base_model_prefix`` plus ``linear.weight``, ``config.json`` names the
architecture ``HF_ColBERT`` and ``artifact.metadata`` carries the ColBERTConfig settings. Stanford ColBERT
(``Checkpoint(path)``) and PyLate (``models.ColBERT(path)``, through its Stanford path) then load the right head
and settings; ``AutoModel.from_pretrained`` still reads the backbone (it strips the prefix).

ColBERT-HIL (two heads, an IDF table, z-score statistics) has no counterpart in either peer: its layout is
described in ``docs/hil-format.md``. The folder appears only once complete (built beside it, then renamed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from hil.modeling.contracts import Encoder
from hil.modeling.encoder import ColBERTEncoder, MultiVectorEncoder
from hil.modeling.formats import SHARDED_INDEXES, STANFORD_ARCHITECTURE, STANFORD_METADATA, WEIGHT_FILES
from hil.provenance import atomic_directory, file_lock, lock_path, versions

STANFORD_VERSION = "colbert-v0.4"  # what ColBERTConfig.save writes into meta.version


def stanford_representable(encoder: Encoder) -> str | None:
    """Why ``encoder`` cannot be written in the Stanford layout, or None when it can."""
    if not isinstance(encoder, ColBERTEncoder):
        return f"a {encoder.architecture} model has no Stanford ColBERT counterpart (see docs/hil-format.md)"
    if encoder.projection_bias:
        return "Stanford ColBERT's projection has no bias"
    return None


def stanford_metadata(encoder: ColBERTEncoder) -> dict[str, Any]:
    """The ``artifact.metadata`` of ``encoder``: the ColBERTConfig keys that decide how it encodes."""
    settings = encoder.tokenizer.settings()
    return {"query_token_id": settings["query_marker"], "doc_token_id": settings["doc_marker"],
            "query_token": "[Q]", "doc_token": "[D]", "query_maxlen": settings["query_maxlen"],
            "doc_maxlen": settings["doc_maxlen"], "dim": encoder.dim,
            "mask_punctuation": settings["mask_punctuation"],
            "attend_to_mask_tokens": settings["attend_to_mask_tokens"], "similarity": "cosine",
            "interaction": "colbert",
            "meta": {"version": STANFORD_VERSION, "written_by": f"hil {versions().get('hil', 'unknown')}"}}


def write_stanford_files(encoder: ColBERTEncoder, directory: Path) -> None:
    """Turn a folder holding ``encoder``'s backbone (``save_pretrained``) into a Stanford ColBERT checkpoint."""
    reason = stanford_representable(encoder)
    if reason is not None:
        raise ValueError(f"cannot write the Stanford ColBERT layout: {reason}")
    prefix = encoder.backbone.base_model_prefix
    # Cloned so that no two entries share memory (safetensors refuses shared tensors).
    state = {f"{prefix}.{key}": value.detach().cpu().clone().contiguous()
             for key, value in encoder.backbone.state_dict().items()}
    state["linear.weight"] = encoder.linear.weight.detach().cpu().float().clone().contiguous()
    for name in (*WEIGHT_FILES, *SHARDED_INDEXES):
        (directory / name).unlink(missing_ok=True)
    for shard in directory.glob("model-*-of-*.safetensors"):
        shard.unlink()
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["architectures"] = [STANFORD_ARCHITECTURE]
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (directory / STANFORD_METADATA).write_text(json.dumps(stanford_metadata(encoder), indent=4) + "\n",
                                               encoding="utf-8")


def export_model(encoder: MultiVectorEncoder, directory: str | Path, extra: dict[str, Any] | None = None,
                 stanford: bool = True) -> Path:
    """Write ``encoder`` to ``directory`` (replacing it): our layout, plus the Stanford layout when it can hold the
    model and ``stanford`` is True. The folder is built beside its final place and renamed, so a crash or a second
    exporter never leaves a half-written one."""
    directory = Path(directory)
    write_stanford = stanford and stanford_representable(encoder) is None
    with file_lock(lock_path(directory), what="export"), atomic_directory(directory) as building:
        encoder.save_pretrained(building, extra={**(extra or {}), "layouts": ["hil", "stanford"] if write_stanford
                                                 else ["hil"]})
        if write_stanford:
            assert isinstance(encoder, ColBERTEncoder)
            write_stanford_files(encoder, building)
    return directory

