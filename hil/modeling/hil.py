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
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hil.data.idf import IDFTable
from hil.data.tokenization import DOC_MARKER, QUERY_MARKER, TokenizedBatch
from hil.modeling.contracts import EncodedBatch
from hil.modeling.distributed import pooled_moments
from hil.modeling.encoder import MultiVectorEncoder
from hil.modeling.hil_scoring import (DEFAULT_EPS, batch_moments, hil_token_scores, lexical_query_mask,
                                      zscored_late_interaction)

HEADS = ("L", "H")


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
        if not (torch.isfinite(batch_mean) and torch.isfinite(batch_std)):
            return
        if int(self.updates) == 0:
            self.mean.copy_(batch_mean)
            self.std.copy_(batch_std)
        else:
            self.mean.lerp_(batch_mean.to(self.mean.dtype), self.momentum)
            self.std.lerp_(batch_std.to(self.std.dtype), self.momentum)
        self.updates.add_(1)

    def extra_repr(self) -> str:
        return f"momentum={self.momentum}"


class HILEncoder(MultiVectorEncoder):
    """ColBERT-HIL's encoder: heads ``L`` (lexical, isotropic) and ``H`` (contextual, anisotropic), see module doc.

    Buffers (saved in checkpoints and exports): ``idf`` (V,) weights, ``idf_documents`` (0 = uniform weights, no
    table set), ``zscore.L.*`` / ``zscore.H.*`` running mean / std / update count.
    """

    architecture = "hil"
    head_names = HEADS

    def __init__(self, backbone: str = "bert-base-uncased", dim: int = 128, query_maxlen: int = 32,
                 doc_maxlen: int = 180, query_marker: str = QUERY_MARKER, doc_marker: str = DOC_MARKER,
                 mask_punctuation: bool = True, zscore_momentum: float = 0.1, zscore_eps: float = DEFAULT_EPS,
                 idf_source: str | None = None,
                 _loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase] | None = None):
        super().__init__(backbone, dim=dim, query_maxlen=query_maxlen, doc_maxlen=doc_maxlen,
                         query_marker=query_marker, doc_marker=doc_marker, mask_punctuation=mask_punctuation,
                         _loaded=_loaded)
        if zscore_eps <= 0:
            raise ValueError(f"zscore_eps must be > 0, got {zscore_eps}")
        word_embeddings = self.backbone.get_input_embeddings()
        self.vocab_size = int(word_embeddings.num_embeddings)
        self.linear_L = nn.Linear(int(word_embeddings.embedding_dim), dim, bias=False)
        self.linear_H = nn.Linear(self.hidden_size, dim, bias=False)
        self.zscore_momentum = float(zscore_momentum)
        self.zscore_eps = float(zscore_eps)
        self.zscore = nn.ModuleDict({head: RunningMoments(zscore_momentum) for head in HEADS})
        self.idf_source = idf_source
        self.register_buffer("idf", torch.ones(self.vocab_size))
        self.register_buffer("idf_documents", torch.zeros((), dtype=torch.long))

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
        weights = table.to_tensor(self.vocab_size)
        with torch.no_grad():
            self.idf.copy_(weights.to(self.idf.device, self.idf.dtype))
            self.idf_documents.fill_(table.n_documents)
        self.idf_source = table.describe()

    def set_idf_from_texts(self, texts: Iterable[str], source: str = "", batch_size: int = 1024) -> IDFTable:
        """Compute IDF over ``texts`` (e.g. the target corpus at evaluation) with this model's tokenizer; store it."""
        table = IDFTable.from_texts(self.tokenizer, texts, batch_size=batch_size, vocab_size=self.vocab_size,
                                    source=source)
        self.set_idf(table)
        return table

    def query_idf(self, queries: EncodedBatch) -> Tensor:
        """IDF weight of every query token. -> (Bq, Lq)"""
        return self.idf[queries.input_ids.to(self.idf.device)].to(queries.input_ids.device)

    # -- encoding --------------------------------------------------------------------------------------------------
    def embed(self, batch: TokenizedBatch, is_query: bool) -> dict[str, Tensor]:
        vocab = self.backbone.get_input_embeddings()(batch.input_ids)  # (B, L, E) word embeddings, no context
        hidden = self.backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        return {"L": F.normalize(self.linear_L(vocab), p=2, dim=-1),     # (B, L, D)
                "H": F.normalize(self.linear_H(hidden), p=2, dim=-1)}    # (B, L, D)

    def extra_settings(self) -> dict[str, Any]:
        return {"zscore_momentum": self.zscore_momentum, "zscore_eps": self.zscore_eps, "idf_source": self.idf_source}

    # -- scoring ---------------------------------------------------------------------------------------------------
    def token_scores(self, queries: EncodedBatch, docs: EncodedBatch, all_pairs: bool
                     ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Per-head token scores S (B, Lq) or (Bq, Bd, Lq) and the query tokens taking part in each head (Bq, Lq)."""
        idf = self.query_idf(queries)                                  # (Bq, Lq)
        s_L, s_H = hil_token_scores(queries.heads["L"], docs.heads["L"], queries.heads["H"], docs.heads["H"],
                                    idf, docs.mask, all_pairs=all_pairs)
        masks = {"L": lexical_query_mask(queries.mask, idf), "H": queries.mask.bool()}
        return {"L": s_L, "H": s_H}, masks

    def running_moments(self, head: str) -> tuple[Tensor, Tensor]:
        stats = self.zscore[head]
        return stats.mean, stats.std

    def score_heads(self, queries: EncodedBatch, docs: EncodedBatch, all_pairs: bool = True) -> dict[str, Tensor]:
        """``score_late`` of each head with the running z-score statistics. -> head -> (Bq, Bd) (or (B,) paired)."""
        scores, masks = self.token_scores(queries, docs, all_pairs)
        return {head: zscored_late_interaction(scores[head], masks[head], *self.running_moments(head),
                                               eps=self.zscore_eps) for head in HEADS}

    def score(self, queries: EncodedBatch, docs: EncodedBatch) -> Tensor:
        """``score_late_L + score_late_H`` of every query against every document (the paper's "simply add"). -> (Bq, Bd)"""
        heads = self.score_heads(queries, docs, all_pairs=True)
        return heads["L"] + heads["H"]

    def score_pairs(self, queries: EncodedBatch, docs: EncodedBatch) -> Tensor:
        """``score_late_L + score_late_H`` of query i with document i. -> (B,)"""
        heads = self.score_heads(queries, docs, all_pairs=False)
        return heads["L"] + heads["H"]

    def training_pair_scores(self, queries: EncodedBatch, docs: EncodedBatch, pair_index: Tensor
                             ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Per-head ``score_late`` of (query ``pair_index[k]``, document k) for the training loss. -> head -> (P,).

        In training mode each head is z-scored with the moments of all its token scores in this call (all pairs
        together: pass the (q, d+) and (q, d-) pairs at once) and the running estimates are updated with the moments
        pooled over every DDP rank (the same on each rank); in eval mode
        the running estimates are used. Also returns each head's query-token mask of the paired queries (P, Lq).
        """
        paired = queries.select(pair_index)
        scores, masks = self.token_scores(paired, docs, all_pairs=False)   # head -> (P, Lq)
        late = {}
        for head in HEADS:
            if self.training:
                mean, std = batch_moments(scores[head], masks[head], eps=self.zscore_eps)
                self.zscore[head].update(*pooled_moments(scores[head], masks[head], eps=self.zscore_eps))
            else:
                mean, std = self.running_moments(head)
            late[head] = zscored_late_interaction(scores[head], masks[head], mean, std, eps=self.zscore_eps)
        return late, masks
