"""Encoding documents into stored tokens: what a document encoder must offer, and the encoding loop itself.

Every document is tokenized once: :func:`sorted_document_batches` tokenizes a list of texts, sorts them by token
length and pads them into batches; :func:`encode_sorted_batches` runs only the encoder over those batches. Index
building tokenizes each chunk in loader workers ahead of the encoder (:mod:`hil.retrieval.token_loader`);
:func:`encode_document_tokens` does both steps in this process. (Before, the length sort tokenized every text and
each batch was tokenized again from its texts: the same tensors, twice the work.)

Indexing only ever encodes documents, and may do it through a cheaper stand-in for the caller's encoder (an int8
copy, a ``torch.compile`` or ONNX Runtime view: :mod:`hil.retrieval.fast_encode`). What that needs is written
down once as :class:`DocumentEncoder`; every :class:`~hil.modeling.contracts.Encoder` satisfies it, and
:class:`DocumentEncoderView` wraps a stand-in together with the description an index records of it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence

import numpy as np
import torch
from torch import nn

from hil.data.tokenization import ColBERTTokenizer, TokenizedBatch
from hil.modeling.contracts import EncodedBatch, Encoder
from hil.retrieval.store import TokenStore


class DocumentEncoder(Protocol):
    """What encoding documents into a token store needs: the heads and their dimension, ColBERT's document
    tokenization (done once, apart from the encoder) and the token embeddings of tokenized documents."""

    @property
    def head_names(self) -> tuple[str, ...]: ...

    @property
    def dim(self) -> int: ...

    @property
    def tokenizer(self) -> ColBERTTokenizer: ...

    @property
    def device(self) -> torch.device: ...

    def encode(self, batch: TokenizedBatch, is_query: bool) -> EncodedBatch: ...


class DocumentEncoderView(nn.Module):
    """The encoder indexing runs documents through, and what ``index.json`` records about it.

    ``encoder`` is the caller's encoder itself (``document_encoding`` empty) or a stand-in for it: a quantized copy,
    or a view sharing its heads whose backbone runs elsewhere. Queries are never encoded through it.
    """

    def __init__(self, encoder: Encoder, document_encoding: dict[str, Any] | None = None):
        super().__init__()
        self.encoder = encoder
        self.document_encoding: dict[str, Any] = dict(document_encoding or {})
        # Mirror the wrapped encoder's mode, so that eval_mode(view) restores the encoder's own flag afterwards.
        self.training = encoder.training

    @property
    def head_names(self) -> tuple[str, ...]:
        return tuple(self.encoder.head_names)

    @property
    def dim(self) -> int:
        return int(self.encoder.dim)

    @property
    def tokenizer(self) -> ColBERTTokenizer:
        return self.encoder.tokenizer

    @property
    def device(self) -> torch.device:
        return torch.device(self.encoder.device)

    def encode(self, batch: TokenizedBatch, is_query: bool) -> EncodedBatch:
        return self.encoder.encode(batch, is_query)

    def encode_documents(self, texts: Sequence[str]) -> EncodedBatch:
        return self.encoder.encode_documents(texts)


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Evaluation mode (no dropout) and no autograd for the duration; the training flag is restored after."""
    was_training = module.training
    # eval() / train() set a flag on every submodule (~2 ms for a BERT, per query in full ranking): skip both when
    # everything is already in eval mode, which is then exactly what they would have left.
    switch = any(m.training for m in module.modules())
    if switch:
        module.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        if switch:
            module.train(was_training)


@dataclass
class EncodedTokens:
    """Scored tokens of a list of documents, in the input order: the content of a :class:`TokenStore`."""

    embeddings: dict[str, np.ndarray]  # head -> (n_tokens, D)
    token_ids: np.ndarray              # (n_tokens,) int32
    lengths: np.ndarray                # (n_docs,) int64

    def to_store(self, doc_ids: list[str]) -> TokenStore:
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=offsets[1:])
        return TokenStore(doc_ids, offsets, self.embeddings, self.token_ids)


def document_token_lengths(encoder: DocumentEncoder, texts: Sequence[str]) -> np.ndarray:
    """Tokens per document after the encoder's tokenization (markers included): what batches are sorted by."""
    return np.array([len(row) for row in encoder.tokenizer.document_rows(list(texts))], dtype=np.int64)


@dataclass
class SortedBatches:
    """A list of documents tokenized once, in encoding order: longest first, cut into padded batches."""

    order: np.ndarray                # (n,) int64: the input position of each document, in encoding order
    batches: list[TokenizedBatch]    # batch i holds documents order[i * batch_size: (i + 1) * batch_size]


def sorted_document_batches(tokenizer: ColBERTTokenizer, texts: Sequence[str], batch_size: int) -> SortedBatches:
    """Tokenize ``texts`` once, sort them by token length (longest first, so running out of memory shows up at
    once; ties keep input order) and pad each run of ``batch_size`` into a batch: little padding. Each batch is
    the tensors ``tokenizer.encode_documents`` gives for its texts (:meth:`ColBERTTokenizer.document_rows`)."""
    rows = tokenizer.document_rows(list(texts))
    order = np.argsort(-np.array([len(row) for row in rows], dtype=np.int64), kind="stable")
    batches = [tokenizer.document_batch([rows[i] for i in order[start: start + batch_size]])
               for start in range(0, len(rows), batch_size)]
    return SortedBatches(order, batches)


def _input_order_gather(order: np.ndarray, sorted_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Documents were encoded in ``order``; -> (lengths in input order, token rows that put them back in order).

    New token t of input document i comes from document i's contiguous block in the sorted concatenation.
    """
    sorted_offsets = np.concatenate([[0], np.cumsum(sorted_lengths)])
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order))  # input document -> its place in the encoding order
    lengths = sorted_lengths[position]
    new_offsets = np.concatenate([[0], np.cumsum(lengths)])
    gather = np.repeat(sorted_offsets[position] - new_offsets[:-1], lengths) + np.arange(new_offsets[-1])
    return lengths, gather


def _on_device(batch: TokenizedBatch, device: torch.device) -> TokenizedBatch:
    """``batch`` on ``device``: on a GPU copied from pinned memory without waiting (a copy from pageable memory
    blocks the host until the device has finished everything queued before it, i.e. a sync per batch); on the CPU
    as it is."""
    if device.type != "cuda":
        return batch
    # Through the batch's own methods, which keep has_padding: without it the backbone reads its mask back from the
    # device to find out (transformers' padding check), a sync per batch.
    return batch.pin_memory().to(device, non_blocking=True)


def _to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """``tensors`` as host arrays: from a GPU through pinned buffers, every copy queued before the one wait."""
    if not tensors or tensors[0].device.type != "cuda":
        return [tensor.cpu().numpy() for tensor in tensors]
    pinned = [torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True) for tensor in tensors]
    for target, tensor in zip(pinned, tensors):
        target.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return [target.numpy() for target in pinned]


def encode_sorted_batches(encoder: DocumentEncoder, tokenized: SortedBatches, *,
                          dtype: np.dtype | type = np.float16, progress_bar: Any = None) -> EncodedTokens:
    """Run ``encoder`` over batches already tokenized and keep only the scored tokens of each document, flattened
    in input order. Call inside :func:`eval_mode`. ``progress_bar`` (tqdm) is advanced per batch.

    Nothing waits for the device between batches: the token tensors go up from pinned memory without blocking,
    each batch's vectors stay on the encoder's device in ``dtype`` (padded rows included), and once all batches
    are queued the scored tokens are gathered there in input order and come to the host in one piece per head
    (pinned). The vectors are those of a per-batch selection (fp32 -> fp16 rounds to nearest even in torch as
    in numpy): on a CPU the files are byte for byte those of the loop this replaced.
    """
    heads = tuple(encoder.head_names)
    dim = int(encoder.dim)
    stored = torch.from_numpy(np.zeros(0, dtype=dtype)).dtype
    device = torch.device(encoder.device)
    rows_of = [len(tokens) * tokens.input_ids.shape[1] for tokens in tokenized.batches]  # B * L of each batch
    vectors: dict[str, torch.Tensor] = {}
    masks, ids, doc_lengths = [], [], []
    cursor = 0
    for tokens, rows in zip(tokenized.batches, rows_of):
        batch = encoder.encode(_on_device(tokens, device), is_query=False)
        for head in heads:
            output = batch.heads[head].detach()  # (B, L, D)
            if head not in vectors:  # every batch's padded rows in one table, on the device the encoder used
                vectors[head] = torch.empty((sum(rows_of), dim), dtype=stored, device=output.device)
            vectors[head][cursor: cursor + rows] = output.reshape(rows, dim)  # shape mismatch: raises here
        masks.append(batch.mask.bool().reshape(-1))
        ids.append(batch.input_ids.reshape(-1))
        doc_lengths.append(batch.mask.bool().sum(dim=1))
        cursor += rows
        if progress_bar is not None:
            progress_bar.update(len(tokens))
    if not masks:
        return EncodedTokens({head: np.zeros((0, dim), dtype=dtype) for head in heads},
                             np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64))

    (sorted_lengths,) = _to_host([torch.cat(doc_lengths).to(torch.int64)])
    lengths, gather = _input_order_gather(tokenized.order, sorted_lengths)
    # Row-major (B, L) order keeps each document's tokens contiguous and in order, as boolean indexing did.
    kept = torch.nonzero(torch.cat(masks)).squeeze(1)
    rows = kept[torch.from_numpy(gather).to(kept.device)]  # (n_tokens,) padded row of each token, input order
    host = _to_host([vectors[head][rows] for head in heads] + [torch.cat(ids)[rows].to(torch.int32)])
    return EncodedTokens(dict(zip(heads, host[:-1])), host[-1], lengths)


def encode_document_tokens(encoder: DocumentEncoder, texts: Sequence[str], *, batch_size: int = 32,
                           dtype: np.dtype | type = np.float16, progress_bar: Any = None) -> EncodedTokens:
    """Encode ``texts`` and keep only the scored tokens of each document, flattened in input order: tokenized once
    and sorted into batches here (:func:`sorted_document_batches`), then encoded (:func:`encode_sorted_batches`).
    Call inside :func:`eval_mode`. ``progress_bar`` (tqdm) is advanced per batch.
    """
    return encode_sorted_batches(encoder, sorted_document_batches(encoder.tokenizer, texts, batch_size),
                                 dtype=dtype, progress_bar=progress_bar)
