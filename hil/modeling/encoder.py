"""Multi-vector encoders: a Hugging Face backbone, one or more linear heads, L2-normalized token embeddings.

``ColBERTEncoder`` is ColBERT v1: ``normalize(W h_i)`` for each last-hidden-state vector ``h_i`` (no bias, as
the original). Every encoder implements the ``Encoder`` contract (``hil.modeling.contracts``), so training,
indexing and search do not care which model they hold. Its settings live in one frozen dataclass,
``encoder.config`` (``hil.modeling.encoder_settings``); the constructor takes that dataclass's fields.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoModel, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from hil.data.idf import IDFTable
from hil.data.tokenization import ColBERTTokenizer, TokenizedBatch
from hil.errors import UserError
from hil.modeling.backbone_mask import backbone_attention_mask
from hil.modeling.contracts import EncodedBatch, Encoder
from hil.modeling.encoder_settings import HEAD_INITS, ColBERTSettings, EncoderSettings, HeadInit, upgrade_settings
from hil.modeling.scoring import late_interaction, late_interaction_matrix
from hil.paths import resolve_model
from hil.provenance import provenance, write_json_atomic

CONFIG_NAME = "hil_config.json"
HEADS_NAME = "hil_heads.pt"
# A backbone and its tokenizer already in memory (tests, views), instead of loading ``config.backbone``.
LoadedBackbone = tuple[PreTrainedModel, PreTrainedTokenizerBase]


def config_field(name: str) -> property:
    """A read-only attribute that reads ``self.config.<name>`` (the names encoders had before ``config``)."""
    return property(lambda self: getattr(self.config, name), doc=f"``config.{name}`` (read-only)")


def init_head(layer: nn.Linear, how: HeadInit, std: float) -> None:
    """Initialize a projection head.

    "bert": normal(0, std) weights and zero bias, std = the backbone's ``initializer_range`` (0.02 for BERT): what
    ColBERT v1 gets from ``BertPreTrainedModel.init_weights()`` (``_init_weights`` on every ``nn.Linear``), and the
    HIL authors' code too (their ``linear`` and ``lexical_linear`` are built before ``init_weights()``).
    "torch": ``nn.Linear``'s own Kaiming-uniform default (this package before the setting existed).
    """
    if how not in HEAD_INITS:
        raise ValueError(f"head_init must be one of {HEAD_INITS}, got {how!r}")
    if how == "bert":
        with torch.no_grad():
            layer.weight.normal_(0.0, std)
            if layer.bias is not None:
                layer.bias.zero_()


@contextmanager
def _quiet_transformers():
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)


def load_backbone(name_or_path: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a BERT-family backbone and its tokenizer from a hub name or local directory (no pooler or MLM head used)."""
    source = resolve_model(name_or_path)
    with _quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except OSError as error:
            raise UserError(
                f"cannot load a tokenizer from {name_or_path!r}: not a local model directory, not reachable on the "
                f"Hugging Face hub, and not found under HIL_MODELS_DIR ({error.__class__.__name__})") from None
        try:
            model, info = AutoModel.from_pretrained(source, add_pooling_layer=False, output_loading_info=True)
        except TypeError:  # architectures without a pooler flag
            model, info = AutoModel.from_pretrained(source, output_loading_info=True)
        except (OSError, ValueError) as error:
            raise UserError(f"cannot load a backbone from {name_or_path!r}: "
                            f"{str(error).splitlines()[0] if str(error) else error.__class__.__name__}") from None
    # transformers fills weights it did not find with random values; a backbone is never partly random here.
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        raise UserError(f"{name_or_path}: the backbone's weights lack {len(missing)} tensors ({missing[:3]}...); "
                        f"transformers would initialize them at random")
    return model, tokenizer


class MultiVectorEncoder(Encoder):
    """An encoder over a Hugging Face backbone (ColBERT, ColBERT-HIL): tokenizer, encoding, settings, export.

    Subclasses define ``embed`` (the heads) and the scores; this is what ``RetrieverModule`` trains and exports.
    Each subclass names its settings dataclass (``config_class``) and takes its fields as constructor arguments,
    positional in field order or by keyword: ``Sub(*args, _loaded=None, **settings)`` builds
    ``SubSettings(*args, **settings)`` and passes it here. Written as that one call, the LightningCLI (jsonargparse's
    AST resolver) lists every field of the dataclass as ``model.encoder.init_args.<field>``.
    """

    architecture: ClassVar[str]
    head_names: ClassVar[tuple[str, ...]]
    config_class: ClassVar[type[EncoderSettings]] = EncoderSettings
    config: EncoderSettings

    def __init__(self, config: EncoderSettings, _loaded: LoadedBackbone | None = None):
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = config
        self.backbone, hf_tokenizer = _loaded if _loaded is not None else load_backbone(config.backbone)
        self.tokenizer = ColBERTTokenizer(hf_tokenizer, **config.tokenizer_settings())
        self.hidden_size = int(self.backbone.config.hidden_size)

    @classmethod
    def from_config(cls, config: EncoderSettings, _loaded: LoadedBackbone | None = None) -> "MultiVectorEncoder":
        """An encoder with the settings ``config`` (``dataclasses.replace(encoder.config, ...)`` for a variant)."""
        return cls(**config.constructor_arguments(), _loaded=_loaded)

    backbone_name = config_field("backbone")
    dim = config_field("dim")
    head_init = config_field("head_init")

    def init_heads(self, *layers: nn.Linear) -> None:
        """Initialize the projection heads as ``head_init`` says (see :func:`init_head`)."""
        std = float(getattr(self.backbone.config, "initializer_range", 0.02))
        for layer in layers:
            init_head(layer, self.config.head_init, std)

    # -- what subclasses define (and ``score``, ``score_pairs``, ``score_heads`` of the contract) ------------------
    @abstractmethod
    def embed(self, batch: TokenizedBatch, is_query: bool) -> dict[str, Tensor]:
        """Head name -> (B, L, D) L2-normalized token embeddings."""

    @property
    def needs_idf(self) -> bool:
        """Whether training must first give this encoder query-term IDF weights (``set_idf_from_texts``, ColBERT-HIL);
        the documents come from the data module (``data.idf_source``)."""
        return False

    def set_idf_from_texts(self, texts: Iterable[str], source: str = "", batch_size: int = 1024) -> IDFTable:
        raise TypeError(f"a {self.architecture} encoder has no IDF weights")

    # -- shared -------------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def encode(self, batch: TokenizedBatch, is_query: bool) -> EncodedBatch:
        batch = batch.to(self.device)
        heads = self.embed(batch, is_query)
        keep = batch.scoring_mask.unsqueeze(-1).to(next(iter(heads.values())).dtype)
        return EncodedBatch({k: v * keep for k, v in heads.items()}, batch.scoring_mask, batch.input_ids)

    def settings(self) -> dict[str, Any]:
        """``architecture`` and the flat settings record (``config.as_settings()``): what exports, checkpoints and
        fingerprints hold, keys and values exactly as before settings had a dataclass."""
        return {"architecture": self.architecture, **self.config.as_settings()}

    def save_pretrained(self, directory: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Write backbone + tokenizer (loadable by ``AutoModel.from_pretrained``), the heads and a settings JSON."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(directory)
        self.tokenizer.tokenizer.save_pretrained(directory)
        head_state = {k: v.detach().cpu() for k, v in self.state_dict().items() if not k.startswith("backbone.")}
        torch.save(head_state, directory / HEADS_NAME)
        write_json_atomic(directory / CONFIG_NAME, provenance(self.settings(), **(extra or {})))
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "MultiVectorEncoder":
        directory = Path(directory)
        config = read_export_config(directory)
        settings = upgrade_settings(config["settings"])
        if settings.pop("architecture") != cls.architecture:
            raise ValueError(f"{directory / CONFIG_NAME}: architecture is {config['settings']['architecture']!r}, "
                             f"not {cls.architecture!r}; use hil.modeling.load_encoder")
        settings["backbone"] = str(directory)
        encoder = cls(**settings)
        heads = torch.load(directory / HEADS_NAME, map_location="cpu", weights_only=True)
        missing, unexpected = encoder.load_state_dict(heads, strict=False)
        unexpected = [k for k in unexpected if not k.startswith("backbone.")]
        missing = [k for k in missing if not k.startswith("backbone.")]
        if missing or unexpected:
            raise ValueError(f"{directory / HEADS_NAME}: missing {missing}, unexpected {unexpected}")
        return encoder


def read_export_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: not an exported hil model (no {CONFIG_NAME})")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


class ColBERTEncoder(MultiVectorEncoder):
    """ColBERT v1: a bias-free linear projection of the last hidden state to ``dim``, then L2 normalization.

    Arguments: the fields of :class:`~hil.modeling.encoder_settings.ColBERTSettings` (ColBERT v1's defaults:
    ``[MASK]`` query padding scored but not attended, BERT-style head initialization), positional in field order
    (``backbone`` first) or by keyword; ``_loaded``: a backbone and tokenizer already in memory.
    """

    architecture = "colbert"
    head_names = ("colbert",)
    config_class = ColBERTSettings
    config: ColBERTSettings

    def __init__(self, *args: Any, _loaded: LoadedBackbone | None = None, **settings: Any):
        # One call naming the dataclass: jsonargparse follows **settings into it, so the LightningCLI lists and
        # type-checks every field (tests/test_encoder_settings.py).
        super().__init__(ColBERTSettings(*args, **settings), _loaded=_loaded)
        # ColBERT v1/v2 project without a bias; a PyLate Dense layer may carry one (``bias=True``), kept when loaded.
        self.linear = nn.Linear(self.hidden_size, self.config.dim, bias=self.config.projection_bias)
        self.init_heads(self.linear)

    projection_bias = config_field("projection_bias")

    def hidden_states(self, batch: TokenizedBatch) -> Tensor:
        # the mask built on the host where the batch's padding is known (no read-back from the device)
        mask = backbone_attention_mask(self.backbone, batch)
        return self.backbone(input_ids=batch.input_ids, attention_mask=mask).last_hidden_state

    def embed(self, batch: TokenizedBatch, is_query: bool) -> dict[str, Tensor]:
        return {"colbert": F.normalize(self.linear(self.hidden_states(batch)), p=2, dim=-1)}

    def score(self, queries: EncodedBatch, docs: EncodedBatch) -> Tensor:
        doc_mask = None if docs.padding_repeats_tokens else docs.mask  # repeats change no max (EncodedBatch)
        return late_interaction_matrix(queries.heads["colbert"].float(), docs.heads["colbert"].float(),
                                       queries.mask, doc_mask)

    @property
    def scores_repeated_padding(self) -> bool:
        # Eq. 1 is a max over document tokens summed over query tokens; a subclass with its own score opts in itself.
        return type(self).score is ColBERTEncoder.score

    def score_heads(self, queries: EncodedBatch, docs: EncodedBatch, all_pairs: bool = True) -> dict[str, Tensor]:
        return {"colbert": self.score(queries, docs) if all_pairs else self.score_pairs(queries, docs)}

    def score_pairs(self, queries: EncodedBatch, docs: EncodedBatch) -> Tensor:
        return late_interaction(queries.heads["colbert"].float(), docs.heads["colbert"].float(),
                                queries.mask, docs.mask)
