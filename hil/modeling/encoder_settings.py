"""Every encoder setting in one typed home: what all encoders share (``EncoderSettings``) and what each architecture
adds (``ColBERTSettings``, ``HILSettings``), with defaults, sources and validation.

An encoder keeps its settings as ``encoder.config`` (frozen; as Lightning IR's ``LightningIRConfig`` / ``ColConfig``,
but flat). The constructors take the fields as keyword arguments (``ColBERTEncoder(backbone=..., dim=...)``, and
positionally in field order, as before), so the same flat names are what

- a training config sets: ``model.encoder.init_args.<field>`` (the LightningCLI follows the constructor's
  ``**settings`` into the dataclass, so it lists and type-checks every field, with the documentation below as help);
- ``encoder.settings()`` records: ``architecture`` then ``as_settings()``, keys in field order. That record is
  every export's ``hil_config.json`` ``settings``, every checkpoint's ``hil.settings`` and, minus the backbone, part of
  every index's encoder fingerprint (``hil.retrieval.index.encoder_fingerprint``): its keys, order and values must
  not change for an unchanged model, so a new field needs a default that reproduces the old behaviour and, if older
  records lack it, an entry in ``upgrade_settings``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, Sequence

from hil.data.tokenization import DOC_MARKER, QUERY_MARKER
from hil.errors import UserError
from hil.modeling.hil_scoring import DEFAULT_EPS

HeadInit = Literal["bert", "torch"]
HEAD_INITS: tuple[str, ...] = ("bert", "torch")
# ColBERTTokenizer's layouts: a query is [CLS] [Q] tokens [SEP] padded with at least one [MASK]; a document
# [CLS] [D] tokens [SEP].
MIN_QUERY_MAXLEN = 4
MIN_DOC_MAXLEN = 3
TOKENIZER_FIELDS = ("query_maxlen", "doc_maxlen", "query_marker", "doc_marker", "mask_punctuation",
                    "attend_to_mask_tokens")

HIL_HEADS: tuple[str, ...] = ("L", "H")
LexicalInput = Literal["word_embeddings", "embedding_output"]
IDFFormula = Literal["bm25", "authors"]
LexicalQueryTokens = Literal["weighted", "all"]
ZScoreStd = Literal["population", "unbiased"]
ZScoreEval = Literal["running", "per_query"]
HIL_CHOICES: dict[str, tuple[str, ...]] = {
    "lexical_input": ("word_embeddings", "embedding_output"), "idf_formula": ("bm25", "authors"),
    "lexical_query_tokens": ("weighted", "all"), "zscore_std": ("population", "unbiased"),
    "zscore_eval": ("running", "per_query")}


def upgrade_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings recorded by an older version, completed with the values that model was actually built with.

    Exports and checkpoints written before ``attend_to_mask_tokens`` existed attended to the ``[MASK]`` padding:
    they keep doing so (the new default, False, would silently change their query encodings).
    """
    upgraded = dict(settings)
    upgraded.setdefault("attend_to_mask_tokens", True)
    return upgraded


def _integer(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise UserError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise UserError(f"{name} must be true or false, got {value!r}")


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"{name} must be one of {choices}, got {value!r}")


@dataclass(frozen=True)
class EncoderSettings:
    """Settings of every encoder over a Hugging Face backbone. Defaults are ColBERT v1's (Khattab & Zaharia 2020;
    the ``colbertv1`` branch of stanford-futuredata/ColBERT), which HIL (001, Appendix A.3) trains with too.

    Attributes:
        backbone: Hugging Face model: a local folder, a name under HIL_MODELS_DIR or a hub id. Default
            bert-base-uncased (ColBERT v1; HIL A.3: "the base version (Uncased) of BERT").
        dim: Size D of every head's token vectors. Default 128 (ColBERT v1's m = 128; colbertv1
            ``colbert/utils/parser.py`` ``--dim 128``).
        query_maxlen: Query length in tokens, markers included; queries are padded with [MASK] to exactly this
            (query augmentation). Default 32 (ColBERT v1's N_q, ``--query_maxlen 32``; HIL A.3).
        doc_maxlen: Longest document in tokens, markers included; longer ones are truncated. Default 180 (ColBERT
            v1 ``--doc_maxlen 180``; HIL A.3).
        query_marker: Vocabulary token put after [CLS] in queries. Default [unused0], ColBERT v1's [Q]
            (``QueryTokenizer``); another tokenizer may name its own (PyLate's "[Q] ").
        doc_marker: Vocabulary token put after [CLS] in documents. Default [unused1], ColBERT v1's [D].
        mask_punctuation: Leave punctuation tokens out of scoring (they stay in the encoder input). Default true,
            as ColBERT v1 is trained and evaluated (``--mask-punctuation`` in its README's commands).
        attend_to_mask_tokens: Let every token attend to the [MASK] query padding. Default false: ColBERT v1
            (``QueryTokenizer.tensorize`` keeps attention 0 there; ColBERTv2's ``attend_to_mask_tokens=False``).
            True is ColBERTv2's option and what hil did before the setting existed (``upgrade_settings``).
        head_init: Initialization of the projection heads: "bert" normal(0, initializer_range), as ColBERT v1's
            ``init_weights()`` and the HIL authors' code; "torch" nn.Linear's Kaiming-uniform (hil before the
            setting existed). See ``hil.modeling.encoder.init_head``.
    """

    backbone: str = "bert-base-uncased"
    dim: int = 128
    query_maxlen: int = 32
    doc_maxlen: int = 180
    query_marker: str = QUERY_MARKER
    doc_marker: str = DOC_MARKER
    mask_punctuation: bool = True
    attend_to_mask_tokens: bool = False
    head_init: HeadInit = "bert"

    def __post_init__(self) -> None:
        """Every field checked before a backbone is loaded; a bad value is one line naming the field."""
        for name in ("backbone", "query_marker", "doc_marker"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise UserError(f"{name} must be a non-empty string, got {value!r}")
        _integer("dim", self.dim, 1)
        _integer("query_maxlen", self.query_maxlen, MIN_QUERY_MAXLEN)
        _integer("doc_maxlen", self.doc_maxlen, MIN_DOC_MAXLEN)
        _flag("mask_punctuation", self.mask_punctuation)
        _flag("attend_to_mask_tokens", self.attend_to_mask_tokens)
        _choice("head_init", self.head_init, HEAD_INITS)

    def tokenizer_settings(self) -> dict[str, Any]:
        """The keyword arguments of ``ColBERTTokenizer`` (and its ``settings()``), in the tokenizer's order."""
        return {name: getattr(self, name) for name in TOKENIZER_FIELDS}

    def as_settings(self) -> dict[str, Any]:
        """The flat, JSON-able record of these settings (``encoder.settings()`` less ``architecture``), in field
        order. Subclasses adjust values that JSON or older records need in another form."""
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def constructor_arguments(self) -> dict[str, Any]:
        """Every field by name: what the encoder class takes to rebuild an encoder with these settings."""
        return {field.name: getattr(self, field.name) for field in fields(self)}


@dataclass(frozen=True)
class ColBERTSettings(EncoderSettings):
    """ColBERT v1's settings (``ColBERTEncoder``).

    Attributes:
        projection_bias: Give the projection a bias. Default false: ColBERT v1 and v2 project without one; a PyLate
            Dense layer may carry one (true when such a checkpoint is loaded). Recorded only when true, as before
            the setting existed.
    """

    projection_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _flag("projection_bias", self.projection_bias)

    def as_settings(self) -> dict[str, Any]:
        settings = super().as_settings()
        if not self.projection_bias:
            del settings["projection_bias"]
        return settings


@dataclass(frozen=True)
class HILSettings(EncoderSettings):
    """ColBERT-HIL's settings (``HILEncoder``). Defaults follow the paper (001, Sec. 3.3); the HIL authors' released
    code differs on several, each selectable (``configs/variants/colbert_hil_authors.yaml``; sources in
    ``docs/fidelity.md`` and ``hil.modeling.hil``).

    Attributes:
        lexical_input: Input of the lexical head L: "word_embeddings" (the paper's "vocab embedding layer": the
            word-embedding lookup alone) or "embedding_output" (the authors' ``outputs.embedding_output``: word +
            position + token-type embeddings after LayerNorm).
        idf_formula: Query-term IDF of L: "bm25" (BM25's IDF over documents, special tokens weighted 0) or
            "authors" (ln(N / (1 + df)) over queries, special tokens counted); see ``hil.data.idf``.
        lexical_query_tokens: Query tokens in L: "weighted" (tokens with IDF 0 left out) or "all" (every position,
            as the authors' code).
        zscore_std: Std of the z-scores: "population" or "unbiased" (``torch.std``, the authors').
        zscore_eval: Moments outside training: "running" (the EMA kept in training; a score never depends on the
            other documents) or "per_query" (each query's moments over the documents it is ranked among, as the
            authors' evaluation).
        zscore_detach: Heads (L, H) whose batch moments are detached from the gradient (a diagnostic, in neither
            source). Kept in the order L, H.
        zscore_temperature: A fixed value the scores are divided by instead of the std (the mean is still
            subtracted); null: the std (a diagnostic, in neither source).
        zscore_momentum: Weight of a batch's moments in the running estimates (EMA, as BatchNorm's momentum), in
            (0, 1]. Default 0.1.
        zscore_eps: Added to the variance before the square root: std = sqrt(var + eps). Default 1e-5 (BatchNorm's).
        idf_source: A label of the collection the IDF table was computed on; written when the table is set (not a
            setting to choose: training computes the table from ``data.idf_source``).
    """

    lexical_input: LexicalInput = "word_embeddings"
    idf_formula: IDFFormula = "bm25"
    lexical_query_tokens: LexicalQueryTokens = "weighted"
    zscore_std: ZScoreStd = "population"
    zscore_eval: ZScoreEval = "running"
    zscore_detach: Sequence[str] = ()
    zscore_temperature: float | None = None
    zscore_momentum: float = 0.1
    zscore_eps: float = DEFAULT_EPS
    idf_source: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, choices in HIL_CHOICES.items():
            _choice(name, getattr(self, name), choices)
        if isinstance(self.zscore_detach, str):
            raise UserError(f"zscore_detach must be a list of heads, got {self.zscore_detach!r}")
        unknown = sorted(set(self.zscore_detach) - set(HIL_HEADS))
        if unknown:
            raise UserError(f"zscore_detach lists unknown heads {unknown}; the heads are {list(HIL_HEADS)}")
        if self.zscore_temperature is not None and not self.zscore_temperature > 0:
            raise UserError(f"zscore_temperature must be > 0 or null, got {self.zscore_temperature}")
        if not 0.0 < self.zscore_momentum <= 1.0:
            raise UserError(f"zscore_momentum must lie in (0, 1], got {self.zscore_momentum}")
        if not self.zscore_eps > 0:
            raise UserError(f"zscore_eps must be > 0, got {self.zscore_eps}")
        # Normalized once (frozen, hence object.__setattr__): heads in HIL_HEADS order, numbers as floats.
        detach = set(self.zscore_detach)
        object.__setattr__(self, "zscore_detach", tuple(head for head in HIL_HEADS if head in detach))
        if self.zscore_temperature is not None:
            object.__setattr__(self, "zscore_temperature", float(self.zscore_temperature))
        object.__setattr__(self, "zscore_momentum", float(self.zscore_momentum))
        object.__setattr__(self, "zscore_eps", float(self.zscore_eps))

    def as_settings(self) -> dict[str, Any]:
        settings = super().as_settings()
        settings["zscore_detach"] = list(self.zscore_detach)  # as JSON reads it back
        return settings


__all__ = ["ColBERTSettings", "EncoderSettings", "HEAD_INITS", "HIL_CHOICES", "HIL_HEADS", "HILSettings", "HeadInit",
           "IDFFormula", "LexicalInput", "LexicalQueryTokens", "TOKENIZER_FIELDS", "ZScoreEval", "ZScoreStd",
           "upgrade_settings"]
