"""The ColBERT checkpoint layouts of the ecosystem, read (and the Stanford one written) by our own code.

Stanford ColBERT (stanford-futuredata/ColBERT, ``colbert/modeling/hf_colbert.py`` and ``checkpoint.py``): one
Hugging Face folder whose ``config.json`` names the architecture ``HF_ColBERT``; its weights hold the backbone
under the backbone's ``base_model_prefix`` (``bert.`` for BERT) and the projection as ``linear.weight`` (no bias);
``artifact.metadata`` is the JSON dump of its ``ColBERTConfig`` (``query_token_id``, ``doc_token_id``,
``query_maxlen``, ``doc_maxlen``, ``dim``, ``mask_punctuation``, ``attend_to_mask_tokens``, ``similarity``, ...,
and a ``meta`` record), read back by ``BaseConfig.from_path``, which unwraps a ``config`` key when there is one.
Settings the metadata lacks take Stanford's defaults (``colbert/infra/config/settings.py``: doc_maxlen 220, ...).

PyLate (lightonai/pylate, ``pylate/models/colbert.py`` and ``pylate/models/Dense.py``): a sentence-transformers
folder: ``modules.json`` lists a ``Transformer`` (the backbone and its tokenizer, to which PyLate added its prefix
tokens ``"[Q] "``/``"[D] "``) and ``Dense`` modules (``<i>_Dense/config.json``: in/out features, ``bias``,
``activation_function``, ``use_residual``; weights ``linear.weight``/``linear.bias``);
``config_sentence_transformers.json`` carries ``query_prefix``, ``document_prefix``, ``query_length``,
``document_length``, ``attend_to_expansion_tokens``, ``do_query_expansion`` and ``skiplist_words`` (absent keys
take PyLate's defaults: 32, 180, False, True, ``string.punctuation``).

Both tokenize as our ``ColBERTTokenizer`` does (``[CLS] marker body [SEP]``, queries padded with ``[MASK]`` to
their length, punctuation skipped in documents), so a checkpoint of either is a ``ColBERTEncoder`` with the
settings read here. What cannot be represented -- a non-identity activation, a residual Dense, no query expansion,
an empty prefix, another skiplist, L2 similarity -- is refused with one line naming the file and key: never a
head that scores differently from the peer's.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from hil.errors import UserError
from hil.modeling.encoder import CONFIG_NAME

Layout = Literal["hil", "stanford", "pylate", "sentence-transformers", "backbone"]
STANFORD_METADATA = "artifact.metadata"
STANFORD_ARCHITECTURE = "HF_ColBERT"
ST_MODULES = "modules.json"
ST_CONFIG = "config_sentence_transformers.json"
ST_TRANSFORMER_CONFIG = "sentence_bert_config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SHARDED_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# ColBERTConfig defaults (stanford-futuredata/ColBERT colbert/infra/config/settings.py).
STANFORD_DEFAULTS = {"query_token_id": "[unused0]", "doc_token_id": "[unused1]", "query_maxlen": 32,
                     "doc_maxlen": 220, "dim": 128, "mask_punctuation": True, "attend_to_mask_tokens": False,
                     "similarity": "cosine", "interaction": "colbert"}
# ColBERT.__init__ defaults (lightonai/pylate pylate/models/colbert.py).
PYLATE_DEFAULTS = {"query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": 32, "document_length": 180,
                   "attend_to_expansion_tokens": False, "do_query_expansion": True,
                   "skiplist_words": list(string.punctuation)}
IDENTITY_ACTIVATIONS = ("torch.nn.modules.linear.Identity", "torch.nn.Identity")
DENSE_TYPES = ("pylate.models.Dense.Dense", "pylate.models.Dense", "sentence_transformers.models.Dense",
               "sentence_transformers.models.Dense.Dense")
TRANSFORMER_TYPES = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Transformer.Transformer")


class ModelFormatError(UserError):
    """A model folder we cannot read faithfully; the message names the file and key."""


@dataclass
class ForeignColBERT:
    """A ColBERT checkpoint of another tool: its backbone folder, its projection and our encoder settings for it."""

    layout: Layout
    backbone_dir: Path                 # what AutoModel / AutoTokenizer.from_pretrained read
    weight: Tensor                     # (dim, hidden) projection
    bias: Tensor | None                # (dim,) or None
    settings: dict[str, Any]           # ColBERTEncoder keyword arguments (backbone excluded)
    notes: list[str] = field(default_factory=list)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except json.JSONDecodeError as error:
        raise ModelFormatError(f"{path}:{error.lineno}: not valid JSON ({error.msg})") from None
    if not isinstance(value, (dict, list)):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return value


def _architectures(directory: Path) -> list[str]:
    config = directory / "config.json"
    if not config.is_file():
        return []
    return list(_read_json(config).get("architectures") or [])


def _is_pylate(directory: Path) -> bool:
    modules = _read_json(directory / ST_MODULES)
    if any(str(entry.get("type", "")).startswith("pylate.") for entry in modules if isinstance(entry, dict)):
        return True
    config_path = directory / ST_CONFIG
    config = _read_json(config_path) if config_path.is_file() else {}
    return config.get("similarity_fn_name") == "MaxSim" or "query_length" in config or "document_length" in config


def model_layout(directory: Path) -> Layout:
    """Which layout a local model folder is in; a folder that is no model at all is a ``ModelFormatError``.

    Our own export is recognised first: a ColBERT export also carries the Stanford files (``export_model``).
    """
    if not directory.is_dir():
        raise ModelFormatError(f"{directory}: not a model folder")
    if (directory / CONFIG_NAME).is_file():
        return "hil"
    if STANFORD_ARCHITECTURE in _architectures(directory) or (directory / STANFORD_METADATA).is_file():
        return "stanford"
    if (directory / ST_MODULES).is_file():
        return "pylate" if _is_pylate(directory) else "sentence-transformers"
    if (directory / "config.json").is_file():
        return "backbone"
    raise ModelFormatError(f"{directory}: not a model folder (no {CONFIG_NAME}, config.json, {ST_MODULES} or "
                           f"{STANFORD_METADATA}); give an export, a .ckpt, a Hugging Face model folder or hub name")


# -- weights --------------------------------------------------------------------------------------------------------
def _weight_file(directory: Path, key: str) -> Path:
    """The file of ``directory`` holding ``key``: a single weights file or the shard an index names."""
    for name in SHARDED_INDEXES:
        if (directory / name).is_file():
            shard = _read_json(directory / name).get("weight_map", {}).get(key)
            if shard is None:
                raise ModelFormatError(f"{directory / name}: no {key!r} in its weight_map")
            return directory / shard
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return directory / name
    raise ModelFormatError(f"{directory}: no weights ({' or '.join(WEIGHT_FILES)})")


def read_tensors(path: Path, keys: tuple[str, ...]) -> dict[str, Tensor]:
    """The named tensors of a safetensors or torch weights file (only those present)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as handle:
            present = set(handle.keys())
            return {key: handle.get_tensor(key) for key in keys if key in present}
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {key: state[key] for key in keys if key in state}


# -- Stanford ColBERT -----------------------------------------------------------------------------------------------
def _stanford_settings(directory: Path, dim: int) -> tuple[dict[str, Any], list[str]]:
    path = directory / STANFORD_METADATA
    notes: list[str] = []
    if path.is_file():
        metadata = _read_json(path)
        metadata = metadata.get("config", metadata)
    else:
        metadata = {}
        notes.append(f"{directory}: no {STANFORD_METADATA}; Stanford ColBERT's default settings used")
    # dim: the projection's own shape when the metadata does not say.
    defaults = {**STANFORD_DEFAULTS, "dim": dim}
    values = {key: metadata[key] if metadata.get(key) is not None else default for key, default in defaults.items()}
    if values["similarity"] != "cosine":
        raise ModelFormatError(f"{path}: similarity {values['similarity']!r} is not supported (cosine only: "
                               f"hil scores L2-normalized tokens by dot product)")
    if values["interaction"] != "colbert":
        raise ModelFormatError(f"{path}: interaction {values['interaction']!r} is not supported (colbert only)")
    if int(values["dim"]) != dim:
        raise ModelFormatError(f"{path}: dim {values['dim']} but linear.weight projects to {dim}")
    settings = {"dim": dim, "query_maxlen": int(values["query_maxlen"]), "doc_maxlen": int(values["doc_maxlen"]),
                "query_marker": str(values["query_token_id"]), "doc_marker": str(values["doc_token_id"]),
                "mask_punctuation": bool(values["mask_punctuation"]),
                "attend_to_mask_tokens": bool(values["attend_to_mask_tokens"])}
    return settings, notes


def read_stanford(directory: Path) -> ForeignColBERT:
    """A Stanford ColBERT (v2 ``HF_ColBERT``) folder: backbone, ``linear.weight`` and ``artifact.metadata``."""
    file = _weight_file(directory, "linear.weight")
    tensors = read_tensors(file, ("linear.weight", "linear.bias"))
    if "linear.weight" not in tensors:
        raise ModelFormatError(f"{file}: a Stanford ColBERT folder ({STANFORD_ARCHITECTURE} or {STANFORD_METADATA}) "
                               f"without the projection 'linear.weight'; cannot read its ColBERT head")
    if "linear.bias" in tensors:
        raise ModelFormatError(f"{file}: 'linear.bias' found, but Stanford ColBERT's projection has no bias")
    weight = tensors["linear.weight"].float()
    settings, notes = _stanford_settings(directory, int(weight.shape[0]))
    return ForeignColBERT("stanford", directory, weight, None, settings, notes)


# -- PyLate / sentence-transformers ----------------------------------------------------------------------------------
def _modules(directory: Path) -> tuple[Path, list[Path]]:
    """The Transformer folder and the Dense folders, in order, of a sentence-transformers ``modules.json``."""
    path = directory / ST_MODULES
    entries = sorted(_read_json(path), key=lambda entry: int(entry.get("idx", 0)))
    if not entries or entries[0].get("type") not in TRANSFORMER_TYPES:
        raise ModelFormatError(f"{path}: the first module must be a sentence_transformers Transformer, "
                               f"got {entries[0].get('type') if entries else None!r}")
    dense = []
    for entry in entries[1:]:
        if entry.get("type") not in DENSE_TYPES:
            raise ModelFormatError(f"{path}: module {entry.get('name')!r} of type {entry.get('type')!r} cannot be "
                                   f"represented (a ColBERT model here is a Transformer followed by Dense layers)")
        dense.append(directory / str(entry.get("path", "")))
    if not dense:
        raise ModelFormatError(f"{path}: a PyLate model without a Dense projection")
    return directory / str(entries[0].get("path", "")), dense


def _read_dense(folder: Path) -> tuple[Tensor, Tensor | None]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelFormatError(f"{config_path}: missing (a Dense module's settings)")
    config = _read_json(config_path)
    activation = str(config.get("activation_function", IDENTITY_ACTIVATIONS[0]))
    if activation not in IDENTITY_ACTIVATIONS:
        raise ModelFormatError(f"{config_path}: activation_function {activation!r} cannot be represented "
                               f"(identity only: ColBERT normalizes a linear projection)")
    if config.get("use_residual"):
        raise ModelFormatError(f"{config_path}: use_residual true cannot be represented")
    file = _weight_file(folder, "linear.weight")
    tensors = read_tensors(file, ("linear.weight", "linear.bias"))
    if "linear.weight" not in tensors:
        raise ModelFormatError(f"{file}: no 'linear.weight'; cannot read this Dense layer")
    weight = tensors["linear.weight"].float()
    expected = (int(config.get("out_features", weight.shape[0])), int(config.get("in_features", weight.shape[1])))
    if tuple(weight.shape) != expected:
        raise ModelFormatError(f"{file}: linear.weight is {tuple(weight.shape)}, {config_path} says {expected}")
    bias = tensors.get("linear.bias")
    if bool(config.get("bias", bias is not None)) != (bias is not None):
        raise ModelFormatError(f"{config_path}: bias is {config.get('bias')} but {file} "
                               f"{'has' if bias is not None else 'lacks'} 'linear.bias'")
    return weight, None if bias is None else bias.float()


def fold_dense(layers: list[tuple[Tensor, Tensor | None]]) -> tuple[Tensor, Tensor | None]:
    """Identity-activated Dense layers applied in turn as one: ``W = W_n ... W_1``, ``b = W_n(...(W_2 b_1 + b_2)...)``.

    Exact in real arithmetic; in float32 it differs from applying the layers one by one by rounding only.
    """
    weight, bias = layers[0]
    for next_weight, next_bias in layers[1:]:
        bias = None if bias is None else next_weight @ bias
        if next_bias is not None:
            bias = next_bias if bias is None else bias + next_bias
        weight = next_weight @ weight
    return weight, bias


def _pylate_settings(directory: Path, dim: int) -> dict[str, Any]:
    path = directory / ST_CONFIG
    config = {**PYLATE_DEFAULTS, **{k: v for k, v in (_read_json(path) if path.is_file() else {}).items()
                                    if v is not None}}
    if not config["do_query_expansion"]:
        raise ModelFormatError(f"{path}: do_query_expansion false cannot be represented (queries are always "
                               f"padded with [MASK] to their length here)")
    for key in ("query_prefix", "document_prefix"):
        if not config[key]:
            raise ModelFormatError(f"{path}: an empty {key} cannot be represented (ColBERT inserts a marker token)")
    if config.get("default_prompt_name"):
        raise ModelFormatError(f"{path}: default_prompt_name {config['default_prompt_name']!r} cannot be represented "
                               f"(no prompt is prepended here)")
    skiplist = set(config["skiplist_words"])
    if skiplist and skiplist != set(string.punctuation):
        raise ModelFormatError(f"{path}: skiplist_words other than string.punctuation (or empty) cannot be "
                               f"represented (mask_punctuation skips exactly the punctuation tokens)")
    return {"dim": dim, "query_maxlen": int(config["query_length"]), "doc_maxlen": int(config["document_length"]),
            "query_marker": str(config["query_prefix"]), "doc_marker": str(config["document_prefix"]),
            "mask_punctuation": bool(skiplist), "attend_to_mask_tokens": bool(config["attend_to_expansion_tokens"])}


def read_pylate(directory: Path) -> ForeignColBERT:
    """A PyLate (sentence-transformers) ColBERT folder: Transformer, Dense layer(s), ColBERT settings."""
    transformer, dense_folders = _modules(directory)
    bert_config = transformer / ST_TRANSFORMER_CONFIG
    if bert_config.is_file() and _read_json(bert_config).get("do_lower_case"):
        raise ModelFormatError(f"{bert_config}: do_lower_case true cannot be represented (the tokenizer's own "
                               f"normalization is used)")
    layers = [_read_dense(folder) for folder in dense_folders]
    notes = [] if len(layers) == 1 else [f"{directory}: {len(layers)} Dense layers folded into one projection"]
    weight, bias = fold_dense(layers)
    return ForeignColBERT("pylate", transformer, weight, bias, _pylate_settings(directory, int(weight.shape[0])),
                          notes)


def read_foreign(directory: Path, layout: Layout) -> ForeignColBERT:
    if layout == "stanford":
        return read_stanford(directory)
    if layout == "pylate":
        return read_pylate(directory)
    raise ValueError(f"{layout!r} is not a foreign ColBERT layout")
