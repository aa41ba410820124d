"""ColBERTv1 tokenization: ``[CLS] [Q]/[D] tokens [SEP]``, ``[MASK]`` query augmentation, punctuation masking.

Choices (ColBERT v1, Khattab & Zaharia 2020, and the issue):
- The marker tokens are the unused vocabulary entries ``[unused0]`` (query) and ``[unused1]`` (document), as in
  the original ColBERT; another tokenizer can name its own markers. A tokenizer without them is refused.
- Queries are padded with ``[MASK]`` to exactly ``query_maxlen`` (query augmentation) and every query position
  takes part in scoring. Whether the encoder *attends* to the ``[MASK]`` padding is ``attend_to_mask_tokens``:
  False (the default) is ColBERT v1 (``QueryTokenizer.tensorize`` on the ``colbertv1`` branch of
  stanford-futuredata/ColBERT replaces the padding ids by ``[MASK]`` but keeps the tokenizer's attention mask, 0
  there; ColBERTv2 names this ``attend_to_mask_tokens=False``): each ``[MASK]`` output is a contextual vector
  computed from the real tokens, but no token attends to a ``[MASK]``. True attends to them as well (ColBERTv2's
  option, and this package before the setting existed).
- Documents are truncated to ``doc_maxlen`` tokens in total (markers included), padded to the longest in the batch.
  Punctuation tokens stay in the encoder input but are dropped from scoring (``scoring_mask``), as ColBERT does.
"""

from __future__ import annotations

import dataclasses
import string
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

QUERY_MARKER = "[unused0]"
DOC_MARKER = "[unused1]"


@dataclass
class TokenizedBatch:
    input_ids: Tensor       # (B, L) long
    attention_mask: Tensor  # (B, L) long, what the encoder attends to
    scoring_mask: Tensor    # (B, L) bool, which output vectors take part in late interaction
    # Whether any attention_mask entry is 0, known on the host when the batch was built (None: not known). The
    # encoder hands it to the backbone, which would otherwise read the mask back from the device to find out.
    has_padding: bool | None = None

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> "TokenizedBatch":
        """The batch on ``device``. ``non_blocking`` None: asynchronous exactly when the copy goes from pinned host
        memory to a GPU (the only direction in which an asynchronous copy is always safe: the host memory is
        kept until the copy is done, and the device reads it in stream order)."""
        if non_blocking is None:
            non_blocking = torch.device(device).type == "cuda" and self.input_ids.is_pinned()
        return dataclasses.replace(self, **{name: getattr(self, name).to(device, non_blocking=non_blocking)
                                            for name in TENSOR_FIELDS})

    def pin_memory(self) -> "TokenizedBatch":
        """A copy in page-locked host memory (what a DataLoader with ``pin_memory=True`` calls)."""
        return dataclasses.replace(self, **{name: getattr(self, name).pin_memory() for name in TENSOR_FIELDS})

    def __len__(self) -> int:
        return self.input_ids.shape[0]


TENSOR_FIELDS = ("input_ids", "attention_mask", "scoring_mask")


class MarkerTokenError(ValueError):
    pass


class ColBERTTokenizer:
    """Wraps a Hugging Face tokenizer with ColBERT's query/document conventions."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, query_maxlen: int = 32, doc_maxlen: int = 180,
                 query_marker: str = QUERY_MARKER, doc_marker: str = DOC_MARKER, mask_punctuation: bool = True,
                 attend_to_mask_tokens: bool = False):
        if query_maxlen < 4 or doc_maxlen < 3:
            raise ValueError(f"query_maxlen must be >= 4 and doc_maxlen >= 3 (got {query_maxlen}, {doc_maxlen})")
        limit = getattr(tokenizer, "model_max_length", None) or 10**9
        if max(query_maxlen, doc_maxlen) > limit:
            raise ValueError(f"query_maxlen/doc_maxlen ({query_maxlen}/{doc_maxlen}) exceed the tokenizer's "
                             f"model_max_length {limit}")
        self.tokenizer = tokenizer
        self.query_maxlen = query_maxlen
        self.doc_maxlen = doc_maxlen
        self.mask_punctuation = mask_punctuation
        self.attend_to_mask_tokens = bool(attend_to_mask_tokens)
        self.query_marker_id = self._marker_id(query_marker, "query_marker")
        self.doc_marker_id = self._marker_id(doc_marker, "doc_marker")
        # Kept as given: an added token such as PyLate's "[Q] " reads back normalized ("[q] ") from its id, and
        # that spelling is not in the vocabulary.
        self.query_marker, self.doc_marker = query_marker, doc_marker
        for name in ("cls_token_id", "sep_token_id", "pad_token_id", "mask_token_id"):
            if getattr(tokenizer, name) is None:
                raise MarkerTokenError(f"tokenizer {tokenizer.name_or_path!r} has no {name.removesuffix('_id')}; "
                                       "ColBERT needs [CLS], [SEP], [PAD] and [MASK] (use a BERT-family tokenizer)")
        self.punctuation_ids = torch.tensor(sorted(self._punctuation_ids()), dtype=torch.long)

    def _marker_id(self, token: str, field: str) -> int:
        ids = self.tokenizer.convert_tokens_to_ids([token])
        unk = self.tokenizer.unk_token_id
        if not ids or ids[0] is None or ids[0] == unk:
            raise MarkerTokenError(
                f"tokenizer {self.tokenizer.name_or_path!r} has no token {token!r} for the {field}; "
                f"set model.encoder.init_args.{field} (--model.encoder.init_args.{field} on the command line) to an "
                f"unused vocabulary token of this tokenizer")
        return int(ids[0])

    def _punctuation_ids(self) -> set[int]:
        ids = set()
        for symbol in string.punctuation:
            pieces = self.tokenizer.encode(symbol, add_special_tokens=False)
            if len(pieces) == 1:
                ids.add(pieces[0])
        return ids

    def _encode(self, texts: list[str], marker_id: int, body_len: int) -> list[list[int]]:
        # Tokenize without special tokens, then build [CLS] marker body [SEP] ourselves: model-independent.
        bodies = self.tokenizer(list(texts), add_special_tokens=False, truncation=True, max_length=body_len,
                                return_attention_mask=False)["input_ids"]
        cls, sep = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        return [[cls, marker_id, *body, sep] for body in bodies]

    def encode_queries(self, texts: list[str]) -> TokenizedBatch:
        rows = self._encode(texts, self.query_marker_id, self.query_maxlen - 3)
        ids = torch.full((len(rows), self.query_maxlen), self.tokenizer.mask_token_id, dtype=torch.long)
        attention = torch.ones_like(ids) if self.attend_to_mask_tokens else torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            attention[i, : len(row)] = 1
        padded = not self.attend_to_mask_tokens and any(len(row) < self.query_maxlen for row in rows)
        return TokenizedBatch(ids, attention, torch.ones_like(ids, dtype=torch.bool), has_padding=padded)

    def encode_documents(self, texts: list[str]) -> TokenizedBatch:
        return self.document_batch(self.document_rows(texts))

    def document_rows(self, texts: list[str]) -> list[list[int]]:
        """Each document's ids ``[CLS] [D] body [SEP]``, truncated to ``doc_maxlen``, unpadded. A text's row does
        not depend on the other texts, so a corpus can be tokenized once and its rows batched in any grouping by
        :meth:`document_batch` (what index building does: :mod:`hil.retrieval.token_loader`)."""
        return self._encode(texts, self.doc_marker_id, self.doc_maxlen - 3)

    def document_batch(self, rows: Sequence[Sequence[int]]) -> TokenizedBatch:
        """Rows of :meth:`document_rows` padded to the longest, with their attention and scoring masks."""
        width = max((len(r) for r in rows), default=3)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            attention[i, : len(row)] = 1
        scoring = attention.bool()
        if self.mask_punctuation and len(self.punctuation_ids):
            scoring &= ~torch.isin(ids, self.punctuation_ids)
        return TokenizedBatch(ids, attention, scoring, has_padding=any(len(row) < width for row in rows))

    def settings(self) -> dict:
        return {"query_maxlen": self.query_maxlen, "doc_maxlen": self.doc_maxlen,
                "query_marker": self.query_marker, "doc_marker": self.doc_marker,
                "mask_punctuation": self.mask_punctuation, "attend_to_mask_tokens": self.attend_to_mask_tokens}
