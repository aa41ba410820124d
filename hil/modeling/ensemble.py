"""ColBERT-lambda (HIL Section 3.2): a score-level ensemble of a ColBERT-iso and a ColBERT-aniso encoder.

    score(q, d) = w_iso * score_iso(q, d) + w_aniso * score_aniso(q, d)        (default w = 1, 1)

The paper combines the two separately trained modules "at score level" and calls it "a simple lambda-ensemble";
like HIL's inference ("simply add them together") this is a plain sum of the two late-interaction scores, with no
normalization: both members are ColBERT scores (sums of Lq cosines), already on the same scale. Weights other than
1 are a setting, not a normalization.

``EnsembleEncoder`` presents the surface every encoder has (``head_names``, ``architecture``, ``encode_queries``,
``encode_documents``, ``score``, ``score_pairs``, ``settings``, ``tokenizer``, ``device``, ``dim``), with one head
per member: ``iso`` and ``aniso``. Indexing then stores both members' vectors and full ranking searches one FAISS
index per head and records which head retrieved each candidate (the paper's Fig. 3 overlap). Text is tokenized
once: the members must tokenize identically (same vocabulary, lengths, markers, punctuation masking), and must
have the same dimension; otherwise construction is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from hil.data.tokenization import ColBERTTokenizer, TokenizedBatch
from hil.modeling.contracts import EncodedBatch, Encoder
from hil.modeling.encoder import CONFIG_NAME, MultiVectorEncoder
from hil.provenance import provenance, write_json_atomic

MEMBER_HEADS = ("iso", "aniso")
_PROBE = "Hello, World! Ünïcodé naïve café -- 3.14 co-operation [x]"


def _tokenization_mismatch(first: MultiVectorEncoder, second: MultiVectorEncoder) -> str | None:
    """Why the two encoders would tokenize a text differently, or None when they agree."""
    a, b = first.tokenizer.settings(), second.tokenizer.settings()
    differing = {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}
    if differing:
        return ", ".join(f"{k}: {x!r} vs {y!r}" for k, (x, y) in differing.items())
    if first.tokenizer.tokenizer.get_vocab() != second.tokenizer.tokenizer.get_vocab():
        return "the vocabularies differ"
    for encode in ("encode_queries", "encode_documents"):
        x = getattr(first.tokenizer, encode)([_PROBE])
        y = getattr(second.tokenizer, encode)([_PROBE])
        if not (torch.equal(x.input_ids, y.input_ids) and torch.equal(x.scoring_mask, y.scoring_mask)):
            return f"{encode} gives different tokens for the same text (e.g. casing or normalization)"
    return None


class EnsembleEncoder(Encoder):
    """ColBERT-lambda: two single-head encoders, one head each (``iso``, ``aniso``), scores added with weights.

    Args:
        iso, aniso: trained encoders with one head each (ColBERT variants), e.g. from ``load_encoder``.
        weights: (w_iso, w_aniso), default (1, 1): the paper's plain sum.
        sources: where each member was loaded from (recorded in ``settings()``).
    """

    architecture = "ensemble"
    head_names = MEMBER_HEADS

    def __init__(self, iso: MultiVectorEncoder, aniso: MultiVectorEncoder, weights: Sequence[float] = (1.0, 1.0),
                 sources: Sequence[str | None] = (None, None)):
        super().__init__()
        members = {"iso": iso, "aniso": aniso}
        for name, member in members.items():
            if len(member.head_names) != 1:
                raise ValueError(f"EnsembleEncoder: the {name} member ({member.architecture}) has heads "
                                 f"{tuple(member.head_names)}; each member must have exactly one head (a ColBERT "
                                 f"variant)")
        mismatch = _tokenization_mismatch(iso, aniso)
        if mismatch:
            raise ValueError(f"EnsembleEncoder: the iso and aniso members tokenize differently ({mismatch}); "
                             f"both must be trained/exported with the same tokenizer, query_maxlen, doc_maxlen, "
                             f"markers and mask_punctuation")
        if iso.dim != aniso.dim:
            raise ValueError(f"EnsembleEncoder: member dimensions differ (iso {iso.dim}, aniso {aniso.dim})")
        if len(weights) != 2:
            raise ValueError(f"EnsembleEncoder: weights must be (w_iso, w_aniso), got {tuple(weights)}")
        self.members = nn.ModuleDict(members)
        self.weights = tuple(float(w) for w in weights)
        self.sources = tuple(None if s is None else str(s) for s in sources)
        self.dim = iso.dim

    # -- the encoder surface ---------------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> ColBERTTokenizer:  # shared by both members (they tokenize identically)
        return self.members["iso"].tokenizer

    @property
    def device(self) -> torch.device:
        return self.members["iso"].device

    def _member_head(self, name: str) -> str:
        return self.members[name].head_names[0]

    def encode(self, batch: TokenizedBatch, is_query: bool) -> EncodedBatch:
        """Run both members on the same tokens -> one EncodedBatch with heads ``iso`` and ``aniso``."""
        heads, mask, input_ids = {}, None, None
        for name in MEMBER_HEADS:
            encoded = self.members[name].encode(batch, is_query)
            heads[name] = encoded.heads[self._member_head(name)]
            mask, input_ids = encoded.mask, encoded.input_ids
        return EncodedBatch(heads, mask, input_ids)

    def member_view(self, batch: EncodedBatch, name: str) -> EncodedBatch:
        """The part of ``batch`` that member ``name`` scores, under the member's own head name."""
        return EncodedBatch({self._member_head(name): batch.heads[name]}, batch.mask, batch.input_ids)

    def score_heads(self, queries: EncodedBatch, docs: EncodedBatch, all_pairs: bool = True) -> dict[str, Tensor]:
        """Each member's own (unweighted) score. -> head -> (Bq, Bd), or (B,) with ``all_pairs=False``."""
        out = {}
        for name in MEMBER_HEADS:
            member = self.members[name]
            q, d = self.member_view(queries, name), self.member_view(docs, name)
            out[name] = member.score(q, d) if all_pairs else member.score_pairs(q, d)
        return out

    def score(self, queries: EncodedBatch, docs: EncodedBatch) -> Tensor:
        """``w_iso * score_iso + w_aniso * score_aniso`` of every query against every document. -> (Bq, Bd)"""
        heads = self.score_heads(queries, docs, all_pairs=True)
        return self.weights[0] * heads["iso"] + self.weights[1] * heads["aniso"]

    def score_pairs(self, queries: EncodedBatch, docs: EncodedBatch) -> Tensor:
        """The same for query i with document i. -> (B,)"""
        heads = self.score_heads(queries, docs, all_pairs=False)
        return self.weights[0] * heads["iso"] + self.weights[1] * heads["aniso"]

    def settings(self) -> dict[str, Any]:
        """Shared tokenizer settings at the top level; each member's settings and source under its head name.

        ``backbone`` holds the member sources (index fingerprints leave it out, so the same members loaded from
        another path reuse an index); members' own settings are recorded without their backbone path.
        """
        members = {name: {k: v for k, v in self.members[name].settings().items() if k != "backbone"}
                   for name in MEMBER_HEADS}
        return {"architecture": self.architecture,
                "backbone": {name: source for name, source in zip(MEMBER_HEADS, self.sources)},
                "dim": self.dim, **self.tokenizer.settings(),
                "weights": dict(zip(MEMBER_HEADS, self.weights)), "members": members}

    # -- export ----------------------------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """``<dir>/iso`` and ``<dir>/aniso`` member exports plus ``<dir>/hil_config.json`` (architecture ensemble)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in MEMBER_HEADS:
            self.members[name].save_pretrained(directory / name)
        write_json_atomic(directory / CONFIG_NAME, provenance(self.settings(), **(extra or {})))
        return directory
