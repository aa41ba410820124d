"""The written contract between models and everything that uses them: ``EncodedBatch`` and ``Encoder``.

Training, indexing, search, evaluation and analysis only ever call the members of :class:`Encoder`; every model
(``ColBERTEncoder``, ``HILEncoder``), the ColBERT-lambda ``EnsembleEncoder`` and the post-hoc
``TransformedEncoder`` wrapper subclass it and implement each member themselves (no attribute forwarding), so a
missing piece is an error at construction, not a surprise deep inside a search. Anything model-specific (HIL's IDF
table, a backbone to export) is reached through the concrete class, checked with ``isinstance``.

Shapes: B batch, L tokens, D embedding dimension; ``Bq`` queries and ``Bd`` documents when they differ.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from hil.data.tokenization import ColBERTTokenizer, TokenizedBatch


@dataclass
class EncodedBatch:
    """Token embeddings of a batch, one tensor per head, sharing tokens and masks."""

    heads: dict[str, Tensor]  # head name -> (B, L, D), L2-normalized, zero where mask is False (but see below)
    mask: Tensor              # (B, L) bool: tokens that take part in late interaction
    input_ids: Tensor         # (B, L)
    # True when every row has a token and its padding positions hold copies of one of its own tokens' vectors
    # instead of zeros (hil.retrieval.store.gather_documents(repeat_padding=True)): a MaxSim over such a row needs
    # no mask, since a max is unchanged by a repeated element. Only an encoder whose ``scores_repeated_padding``
    # is True is handed such documents.
    padding_repeats_tokens: bool = False

    def __len__(self) -> int:
        return self.mask.shape[0]

    def select(self, index: Tensor | slice) -> "EncodedBatch":
        return EncodedBatch({k: v[index] for k, v in self.heads.items()}, self.mask[index], self.input_ids[index],
                            self.padding_repeats_tokens)


class Encoder(nn.Module, metaclass=ABCMeta):
    """A multi-vector retriever: text -> per-head token embeddings -> relevance scores.

    Attributes every encoder sets: ``architecture`` (the export/registry name), ``head_names`` (the heads whose
    token vectors are stored and searched, in order), ``dim`` (D of every head) and ``tokenizer`` (ColBERT's
    query/document conventions; texts are tokenized once for all heads).
    """

    architecture: str
    head_names: tuple[str, ...]
    dim: int
    tokenizer: ColBERTTokenizer

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the encoder's parameters live (inputs are moved there)."""

    @abstractmethod
    def encode(self, batch: TokenizedBatch, is_query: bool) -> EncodedBatch:
        """Token embeddings of an already tokenized batch."""

    def encode_queries(self, texts: Sequence[str]) -> EncodedBatch:
        return self.encode(self.tokenizer.encode_queries(list(texts)), is_query=True)

    def encode_documents(self, texts: Sequence[str]) -> EncodedBatch:
        return self.encode(self.tokenizer.encode_documents(list(texts)), is_query=False)

    @abstractmethod
    def score_heads(self, queries: EncodedBatch, docs: EncodedBatch, all_pairs: bool = True) -> dict[str, Tensor]:
        """Each head's own score: head -> (Bq, Bd) for every pair, or (B,) for row i with row i (``all_pairs``
        False). ``score`` combines them; analysis and the paper's per-module tables read them apart."""

    def training_head_scores(self, queries: EncodedBatch, docs: EncodedBatch, n_documents: int
                             ) -> tuple[dict[str, Tensor], dict[str, Tensor] | None]:
        """Each head's training score of every (query, own document) pair of a batch of B queries with N documents
        laid out column by column (document j of query i at row ``j B + i``): head -> (B, N); and each head's
        query-token masks of the paired queries when the encoder scores with its own (else None). Called once a
        training step (``hil.modeling.batch.RankingBatch.head_scores``). Default: :meth:`score_heads` column by
        column (for N = 2, the positives, then the negatives)."""
        b = len(queries)
        columns = [self.score_heads(queries, docs.select(slice(j * b, (j + 1) * b)), all_pairs=False)
                   for j in range(n_documents)]                                                  # head -> (B,)
        return {head: torch.stack([column[head] for column in columns], dim=1) for head in self.head_names}, None

    @abstractmethod
    def score(self, queries: EncodedBatch, docs: EncodedBatch) -> Tensor:
        """Relevance of every query to every document. -> (Bq, Bd)"""

    @abstractmethod
    def score_pairs(self, queries: EncodedBatch, docs: EncodedBatch) -> Tensor:
        """Relevance of query i to document i. -> (B,)"""

    @property
    def scores_repeated_padding(self) -> bool:
        """Whether ``score`` takes documents whose padding repeats their own tokens
        (``EncodedBatch.padding_repeats_tokens``), which saves masking the largest tensor of a search. Only a pure
        MaxSim-and-sum score may say so; anything that counts or normalises over a document's tokens may not. Such a
        score reads the documents' vectors alone: retrieval then hands it documents whose token ids were not read
        (zeros)."""
        return False

    @property
    def normalizes_per_query(self) -> bool:
        """Whether a query's scores are normalized with moments taken over all the documents it is ranked among
        (ColBERT-HIL with ``zscore_eval`` "per_query"): retrieval that scores documents in blocks must then
        accumulate ``raw_head_scores`` over every block before ranking. False for every other encoder."""
        return False

    def raw_head_scores(self, queries: EncodedBatch, docs: EncodedBatch) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
        """Per head: (sum over query tokens of S (Bq, Bd), of S^2 (Bq, Bd), token count (Bq,)); needed only when
        ``normalizes_per_query``."""
        raise NotImplementedError(f"{type(self).__name__} does not normalize per query")

    def normalize_per_query(self, sums: dict[str, tuple[Tensor, Tensor, Tensor]]) -> dict[str, Tensor]:
        """Each head's score from ``raw_head_scores`` accumulated over ALL of each query's documents:
        head -> (Bq, C). Needed only when ``normalizes_per_query``."""
        raise NotImplementedError(f"{type(self).__name__} does not normalize per query")

    @abstractmethod
    def settings(self) -> dict[str, Any]:
        """JSON-able settings that, with the weights, determine every vector and score (recorded in artifacts)."""
