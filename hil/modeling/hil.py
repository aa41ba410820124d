"""ColBERT-HIL (HIL Section 3.3): an isotropic lexical head L and an anisotropic contextual head H in one model.

One training step, end to end:
    queries, positives, negatives (strings)
    -> ColBERTTokenizer -> HILEncoder
         L = normalize(Linear_L(Vocab(input_ids)))        (B, L, D)   word embeddings only, no context
         H = normalize(Linear_H(BERT(input_ids)))         (B, L, D)   the ColBERT representation
    -> S_L(q_i, d) = IDF(q_i) * max_j L_qi . L_dj ;  S_H(q_i, d) = max_j H_qi . H_dj       (q, d+) and (q, d-)
    -> z-score each head with the batch mean / std of its S values; score_late = sum_i S'
    -> L_HIL = CE_L + CE_H + lambda * (-|InterIso_L| + InterIso_H)                          (lambda = -0.3)
At inference ``score = score_late_L + score_late_H`` with the running (EMA) z-score statistics.

Choices where the paper is silent:
- "Vocab embedding layer" is the backbone's word-embedding lookup (``get_input_embeddings()``), without position
  or token-type embeddings and without the embedding LayerNorm. L is then a function of the token id alone, so a
  query token matches the same token in a document with similarity exactly 1 wherever it stands: the lexical,
  position-free match the head exists for (position embeddings would add a spurious same-position bonus). The
  word embeddings are shared with the backbone, so L's loss and regularizer also shape BERT's lowest layer, as
  the paper's layer-wise analysis (Fig. 5) implies. Both projections are bias-free like ColBERT's.
- IDF: BM25 form, special tokens and markers weighted 0 (see ``hil.data.idf``). Query tokens with weight 0 are
  left out of the lexical head altogether (its moments, its sum and InterIso_L); H uses every query token as
  ColBERT does. The table is a buffer (``idf``), so it travels with checkpoints and exports; a fresh encoder has
  uniform weights 1 until ``set_idf`` / ``set_idf_from_texts`` (at the start of training the module computes it
  from the documents the data module names, ``data.idf_source``; see ``hil.data.idf.idf_documents``).
- z-score statistics: in training, one mean and one std per head over every (query token, document) score of the
  batch's (q, d+) and (q, d-) pairs (the tokens that take part in that head), std = sqrt(var + eps), with
  gradients flowing through them (as BatchNorm). They also update running estimates (``zscore.L`` / ``zscore.H``,
  an exponential moving average with ``zscore_momentum``, the first batch copied as is). Every other use -- eval
  mode, ``score``, ``score_pairs``, indexing and search -- uses the running estimates, so a document's score never
  depends on the batch it is scored in. A fresh model's estimates are mean 0, std 1 (no normalization).

The paper's text, the authors' released code and this package differ on several points; each is a setting, a field
of ``HILSettings`` (``hil.modeling.encoder_settings``; the defaults follow the paper;
``configs/variants/colbert_hil_authors.yaml`` selects the authors' code; the table with sources is in
``docs/fidelity.md``):
- ``lexical_input``: "word_embeddings" (the paper's "vocab embedding layer", read as above) or "embedding_output"
  (the authors' ``outputs.embedding_output``: word + position + token-type embeddings after LayerNorm).
- ``idf_formula``: "bm25" (above) or "authors" (``ln(N / (1 + df))`` over the query collection, special tokens
  counted; ``hil.data.idf``). Set the collection with ``data.idf_source`` ("train_queries" for the authors').
- ``lexical_query_tokens``: "weighted" (above: zero-IDF tokens left out of L) or "all" (every query position, as
  the authors' code, whose IDF has no zero weights).
- ``zscore_std``: "population" or "unbiased" (``torch.std``, the authors').
- ``zscore_eval``: "running" (above) or "per_query": outside training each query's moments are recomputed over
  all its token scores against the documents it is ranked among (the authors' evaluation z-scores the scores it
  evaluates, so a document's score depends on the candidate set, as there). Retrieval accumulates the moments
  over every block of documents before ranking (``raw_head_scores``).
- Diagnostics (not in either source): ``zscore_detach`` lists heads whose batch moments are detached from the
  gradient; ``zscore_temperature`` divides by a fixed value instead of the batch std (the mean is still
  subtracted; in training it cancels in the pairwise CE).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hil.data.idf import AUTHORS_FORMULA, IDFTable
from hil.data.tokenization import TokenizedBatch
from hil.modeling.backbone_mask import backbone_attention_mask
from hil.modeling.contracts import EncodedBatch
from hil.modeling.distributed import pooled_moments
from hil.modeling.encoder import LoadedBackbone, MultiVectorEncoder, config_field
from hil.modeling.encoder_settings import (
    HIL_CHOICES,
    HIL_HEADS,
    HILSettings,
    IDFFormula,
    LexicalInput,
    LexicalQueryTokens,
    ZScoreEval,
    ZScoreStd,
)
from hil.modeling.hil_scoring import (
    batch_moments,
    hil_token_scores,
    lexical_query_mask,
    per_query_moments,
    zscore_from_sums,
    zscored_late_interaction,
)
from hil.modeling.scoring import sum_query_tokens

# The names this module had before the settings moved to ``hil.modeling.encoder_settings``.
HEADS = HIL_HEADS
CHOICES = HIL_CHOICES
__all__ = ["CHOICES", "HEADS", "HILEncoder", "HILSettings", "IDFFormula", "LexicalInput", "LexicalQueryTokens",
           "RunningMoments", "ZScoreEval", "ZScoreStd"]


class RunningMoments(nn.Module):
    """Running mean / std of one head's token scores, kept like BatchNorm's running statistics.

    ``update`` blends a batch's moments in: ``running <- (1 - momentum) running + momentum batch`` (the std itself
    is averaged, not the variance); the first update copies the batch values, so early estimates are not biased
    toward the initial 0 / 1. Non-finite batch moments are ignored (a skipped NaN step cannot poison them).
    """

    def __init__(self, momentum: float = 0.1):
        super().__init__()
        if not 0.0 < momentum <= 1.0:
            raise ValueError(f"zscore_momentum must lie in (0, 1], got {momentum}")
        self.momentum = float(momentum)
        self.register_buffer("mean", torch.zeros(()))
        self.register_buffer("std", torch.ones(()))
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def update(self, batch_mean: Tensor, batch_std: Tensor) -> None:
        # Decided on the device (torch.where), never read back to the host: a training step makes no host sync.
        batch_mean, batch_std = batch_mean.to(self.mean.dtype), batch_std.to(self.std.dtype)
        finite = torch.isfinite(batch_mean) & torch.isfinite(batch_std)
        first = self.updates == 0
        for running, value in ((self.mean, batch_mean), (self.std, batch_std)):
            blended = torch.where(first, value, torch.lerp(running, value, self.momentum))
            running.copy_(torch.where(finite, blended, running))
        self.updates.add_(finite.to(self.updates.dtype))

    def extra_repr(self) -> str:
        return f"momentum={self.momentum}"


class HILEncoder(MultiVectorEncoder):
    """ColBERT-HIL's encoder: heads ``L`` (lexical, isotropic) and ``H`` (contextual, anisotropic), see module doc.

    Arguments: the fields of :class:`~hil.modeling.encoder_settings.HILSettings` (shared ones first, as
    ``ColBERTEncoder``'s), positional in field order or by keyword; ``_loaded``: a backbone and tokenizer in memory.
    Buffers (saved in checkpoints and exports): ``idf`` (V,) weights, ``idf_documents`` (0 = uniform weights, no
    table set), ``zscore.L.*`` / ``zscore.H.*`` running mean / std / update count.
    """

    architecture = "hil"
    head_names = HEADS
    config_class = HILSettings
    config: HILSettings

    def __init__(self, *args: Any, _loaded: LoadedBackbone | None = None, **settings: Any):
        # One call naming the dataclass: jsonargparse follows **settings into it, so the LightningCLI lists and
        # type-checks every field (tests/test_encoder_settings.py).
        super().__init__(HILSettings(*args, **settings), _loaded=_loaded)
        word_embeddings = self.backbone.get_input_embeddings()
        self.vocab_size = int(word_embeddings.num_embeddings)
        self.linear_L = nn.Linear(int(word_embeddings.embedding_dim), self.config.dim, bias=False)
        self.linear_H = nn.Linear(self.hidden_size, self.config.dim, bias=False)
        self.init_heads(self.linear_L, self.linear_H)
        self.zscore = nn.ModuleDict({head: RunningMoments(self.config.zscore_momentum) for head in HEADS})
        self.register_buffer("idf", torch.ones(self.vocab_size))
        self.register_buffer("idf_documents", torch.zeros((), dtype=torch.long))

    lexical_input = config_field("lexical_input")
    idf_formula = config_field("idf_formula")
    lexical_query_tokens = config_field("lexical_query_tokens")
    zscore_std = config_field("zscore_std")
    zscore_eval = config_field("zscore_eval")
    zscore_detach = config_field("zscore_detach")
    zscore_temperature = config_field("zscore_temperature")
    zscore_momentum = config_field("zscore_momentum")
    zscore_eps = config_field("zscore_eps")
    idf_source = config_field("idf_source")

    # -- IDF -------------------------------------------------------------------------------------------------------
    @property
    def has_idf(self) -> bool:
        return int(self.idf_documents) > 0

    @property
    def needs_idf(self) -> bool:
        """No IDF table yet: training computes one from its collection (a loaded or resumed model keeps its own)."""
        return not self.has_idf

    def set_idf(self, table: IDFTable) -> None:
        """Store ``table``'s weights in the ``idf`` buffer (padded to the embedding count with the unseen weight)."""
        if (table.formula == AUTHORS_FORMULA) != (self.config.idf_formula == "authors"):
            raise ValueError(f"this encoder's idf_formula is {self.config.idf_formula!r} but the table was computed "
                             f"with {table.formula!r}")
        weights = table.to_tensor(self.vocab_size)
        with torch.no_grad():
            self.idf.copy_(weights.to(self.idf.device, self.idf.dtype))
            self.idf_documents.fill_(table.n_documents)
        self.config = dataclasses.replace(self.config, idf_source=table.describe())

    @property
    def idf_from_queries(self) -> bool:
        """Whether the IDF is taken over queries (the authors' form) rather than documents."""
        return self.config.idf_formula == "authors"

    def set_idf_from_texts(self, texts: Iterable[str], source: str = "", batch_size: int = 1024) -> IDFTable:
        """Compute IDF over ``texts`` with this model's tokenizer and ``idf_formula``; store it. The texts are
        documents for "bm25" (e.g. the target corpus at evaluation) and queries for "authors"."""
        if self.config.idf_formula == "authors":
            table = IDFTable.from_queries(self.tokenizer, texts, batch_size=batch_size, vocab_size=self.vocab_size,
                                          source=source)
        else:
            table = IDFTable.from_texts(self.tokenizer, texts, batch_size=batch_size, vocab_size=self.vocab_size,
                                        source=source)
        self.set_idf(table)
        return table

    def query_idf(self, queries: EncodedBatch) -> Tensor:
        """IDF weight of every query token. -> (Bq, Lq)"""
        return self.idf[queries.input_ids.to(self.idf.device)].to(queries.input_ids.device)

    # -- encoding --------------------------------------------------------------------------------------------------
    def embed(self, batch: TokenizedBatch, is_query: bool) -> dict[str, Tensor]:
        wants_embedding_output = self.config.lexical_input == "embedding_output"
        # output_hidden_states only when needed: a stand-in backbone (ONNX Runtime) returns the last state alone
        extra = {"output_hidden_states": True} if wants_embedding_output else {}
        outputs = self.backbone(input_ids=batch.input_ids, attention_mask=backbone_attention_mask(self.backbone, batch),
                                **extra)
        if wants_embedding_output:
            lexical = outputs.hidden_states[0]  # (B, L, E) the embedding layer's output: word + position + type, LN
        else:
            lexical = self.backbone.get_input_embeddings()(batch.input_ids)  # (B, L, E) word embeddings, no context
        return {"L": F.normalize(self.linear_L(lexical), p=2, dim=-1),                  # (B, L, D)
                "H": F.normalize(self.linear_H(outputs.last_hidden_state), p=2, dim=-1)}  # (B, L, D)

    # -- scoring ---------------------------------------------------------------------------------------------------
    def token_scores(self, queries: EncodedBatch, docs: EncodedBatch, all_pairs: bool
                     ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Per-head token scores S (B, Lq) or (Bq, Bd, Lq) and the query tokens taking part in each head (Bq, Lq)."""
        idf = self.query_idf(queries)                                  # (Bq, Lq)
        s_L, s_H = hil_token_scores(queries.heads["L"], docs.heads["L"], queries.heads["H"], docs.heads["H"],
                                    idf, docs.mask, all_pairs=all_pairs)
        weighted = self.config.lexical_query_tokens == "weighted"
        lexical = lexical_query_mask(queries.mask, idf) if weighted else queries.mask
        return {"L": s_L, "H": s_H}, {"L": lexical.bool(), "H": queries.mask.bool()}

    @property
    def unbiased_std(self) -> bool:
        return self.config.zscore_std == "unbiased"

    @property
    def normalizes_per_query(self) -> bool:
        """Scores outside training take per-query moments (``zscore_eval`` "per_query" in eval mode). In training
        mode ``score`` uses the running estimates, so retrieval (``score_documents``) must not switch to sums."""
        return self.config.zscore_eval == "per_query" and not self.training

    def running_moments(self, head: str) -> tuple[Tensor, Tensor]:
        """The statistics used outside training: running mean, and running std (or ``zscore_temperature``)."""
        stats = self.zscore[head]
        if self.config.zscore_temperature is not None:
            return stats.mean, torch.full_like(stats.std, self.config.zscore_temperature)
        return stats.mean, stats.std

    def score_heads(self, queries: EncodedBatch, docs: EncodedBatch, all_pairs: bool = True) -> dict[str, Tensor]:
        """``score_late`` of each head with the running z-score statistics, or (``zscore_eval`` "per_query") with
        each query's moments over the documents of this call. -> head -> (Bq, Bd) (or (B,) paired)."""
        scores, masks = self.token_scores(queries, docs, all_pairs)
        late = {}
        for head in HEADS:
            if self.normalizes_per_query:
                if all_pairs:
                    mean, std = per_query_moments(scores[head], masks[head], self.config.zscore_eps, self.unbiased_std)
                else:  # paired rows: one set of moments over the batch, as in training
                    mean, std = batch_moments(scores[head], masks[head], self.config.zscore_eps, self.unbiased_std)
                if self.config.zscore_temperature is not None:
                    std = torch.full_like(std, self.config.zscore_temperature)
            else:
                mean, std = self.running_moments(head)
            late[head] = zscored_late_interaction(scores[head], masks[head], mean, std, eps=self.config.zscore_eps)
        return late

    def raw_head_scores(self, queries: EncodedBatch, docs: EncodedBatch) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
        """Per head, what per-query z-scoring needs from one block of documents: ``sum_i S`` and ``sum_i S^2``
        over each query's tokens (Bq, Bd), and the query's token count (Bq,). See ``zscore_from_sums``."""
        scores, masks = self.token_scores(queries, docs, all_pairs=True)
        return {head: (sum_query_tokens(scores[head], masks[head]), sum_query_tokens(scores[head].square(),
                       masks[head]), masks[head].sum(dim=1)) for head in HEADS}

    def normalize_per_query(self, sums: dict[str, tuple[Tensor, Tensor, Tensor]]) -> dict[str, Tensor]:
        """z-scored ``score_late`` of each head from sums accumulated over all of each query's documents."""
        out = {}
        for head in HEADS:
            late_raw, square_sums, n_tokens = sums[head]
            if self.config.zscore_temperature is not None:  # fixed scale: only the mean comes from the sums
                n = n_tokens.to(torch.float64)[:, None]
                mean = late_raw.to(torch.float64).sum(dim=1, keepdim=True) / (n * late_raw.shape[1]).clamp(min=1.0)
                out[head] = ((late_raw - n * mean) / self.config.zscore_temperature).float()
            else:
                out[head] = zscore_from_sums(late_raw, square_sums, n_tokens, self.config.zscore_eps, self.unbiased_std)
        return out

    def score(self, queries: EncodedBatch, docs: EncodedBatch) -> Tensor:
        """``score_late_L + score_late_H`` of every query against every document (the paper's "simply add").
        -> (Bq, Bd)"""
        heads = self.score_heads(queries, docs, all_pairs=True)
        return heads["L"] + heads["H"]

    def score_pairs(self, queries: EncodedBatch, docs: EncodedBatch) -> Tensor:
        """``score_late_L + score_late_H`` of query i with document i. -> (B,)"""
        heads = self.score_heads(queries, docs, all_pairs=False)
        return heads["L"] + heads["H"]

    def batch_zscore_moments(self, head: str, scores: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """The moments one training batch is z-scored with (see the module docstring's settings)."""
        mean, std = batch_moments(scores, mask, eps=self.config.zscore_eps, unbiased=self.unbiased_std)
        if head in self.config.zscore_detach:
            mean, std = mean.detach(), std.detach()
        if self.config.zscore_temperature is not None:
            std = torch.full_like(std, self.config.zscore_temperature)
        return mean, std

    def training_head_scores(self, queries: EncodedBatch, docs: EncodedBatch, n_documents: int
                             ) -> tuple[dict[str, Tensor], dict[str, Tensor] | None]:
        """The contract's training scores (:meth:`Encoder.training_head_scores`): every one of the N B pairs
        scored in one :meth:`training_pair_scores` call (each head z-scored with the moments of the whole batch,
        the running estimates updated once), as (B, N), with each head's query-token masks."""
        b = len(queries)
        pair_index = torch.arange(b, device=docs.mask.device).repeat(n_documents)  # (N B,)
        late, masks = self.training_pair_scores(queries, docs, pair_index)        # head -> (N B,)
        return {head: torch.stack([late[head][j * b:(j + 1) * b] for j in range(n_documents)], dim=1)
                for head in self.head_names}, masks

    def training_pair_scores(self, queries: EncodedBatch, docs: EncodedBatch, pair_index: Tensor
                             ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Per-head ``score_late`` of (query ``pair_index[k]``, document k) for the training loss. -> head -> (P,).

        In training mode each head is z-scored with the moments of all its token scores in this call (all pairs
        together: pass the (q, d+) and (q, d-) pairs at once) and the running estimates are updated with the moments
        pooled over every DDP rank (the same on each rank); in eval mode the running estimates are used (or, with
        ``zscore_eval`` "per_query", the moments of this call). Also returns each head's query-token mask of the
        paired queries (P, Lq).
        """
        paired = queries.select(pair_index)
        scores, masks = self.token_scores(paired, docs, all_pairs=False)   # head -> (P, Lq)
        late = {}
        for head in HEADS:
            if self.training or self.normalizes_per_query:
                mean, std = self.batch_zscore_moments(head, scores[head], masks[head])
            else:
                mean, std = self.running_moments(head)
            if self.training:
                self.zscore[head].update(*pooled_moments(scores[head], masks[head], eps=self.config.zscore_eps,
                                                         unbiased=self.unbiased_std))
            late[head] = zscored_late_interaction(scores[head], masks[head], mean, std, eps=self.config.zscore_eps)
        return late, masks
