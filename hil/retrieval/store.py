"""Documents as flat token arrays, and reading them back as padded batches for scoring.

A :class:`TokenStore` holds, per encoder head, every stored token vector of a corpus in one ``(n_tokens, D)``
table, and ``doc_offsets`` (n_docs + 1,): document i owns rows ``[offsets[i], offsets[i + 1])``. Only tokens
that take part in late interaction are stored, so a padded batch gathered from the store
(:func:`gather_documents`) scores exactly like the encoder's own output for those documents.

Scoring many documents of different lengths pads each batch to its longest document; sorting by length and
cutting into :func:`length_blocks` keeps both the padding and the memory of one block bounded. Exact scoring
(:mod:`hil.retrieval.search`) and PLAID's centroid interaction (:mod:`hil.retrieval.plaid`) both block this way.
"""

from __future__ import annotations

from functools import cached_property
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from hil.data.ranking import id_rank
from hil.modeling.contracts import EncodedBatch
from hil.retrieval.codec import CompressedEmbeddings
from hil.retrieval.devices import host_tensor

# A head's token table: an fp16/fp32 array or memmap, or a decompressing view of residual codes.
TokenTable = np.ndarray | CompressedEmbeddings


class TokenStore:
    """Documents as flat token arrays: ``embeddings[head]`` (n_tokens, D) and ``doc_offsets`` (n_docs + 1,).

    The in-memory form (re-ranking texts encoded on the fly) and the base of
    :class:`~hil.retrieval.index.TokenIndex`. ``token_ids`` (n_tokens,) is None for an index that stores none (a
    compressed index of an encoder whose score reads the vectors alone): reading them is then refused.
    """

    def __init__(self, doc_ids: list[str], doc_offsets: np.ndarray, embeddings: dict[str, TokenTable],
                 token_ids: np.ndarray | None):
        self.doc_ids = list(doc_ids)
        self.doc_offsets = np.asarray(doc_offsets, dtype=np.int64)
        self.embeddings = embeddings
        self.token_ids = token_ids
        if len(self.doc_offsets) != len(self.doc_ids) + 1:
            raise ValueError(f"doc_offsets has {len(self.doc_offsets)} entries for {len(self.doc_ids)} documents "
                             "(expected n_docs + 1)")

    @property
    def head_names(self) -> tuple[str, ...]:
        return tuple(self.embeddings)

    @property
    def n_docs(self) -> int:
        return len(self.doc_ids)

    @property
    def n_tokens(self) -> int:
        return int(self.doc_offsets[-1])

    @property
    def dims(self) -> dict[str, int]:
        return {head: int(array.shape[1]) for head, array in self.embeddings.items()}

    def torch_view(self, name: str) -> torch.Tensor:
        """A CPU tensor sharing memory with ``embeddings[name]`` (or ``token_ids`` for ``"token_ids"``), cached.

        Read-only memmaps become read-only-backed tensors (torch warns about that once; the tensors are only read).
        Not for compressed heads (they have no array to share: read them with :func:`gather_documents`).
        """
        views = self.__dict__.setdefault("_torch_views", {})
        if name not in views:
            array = self.stored_token_ids() if name == "token_ids" else self.embeddings[name]
            views[name] = host_tensor(array)
        return views[name]

    def stored_token_ids(self) -> np.ndarray:
        """``token_ids``, refused in one line where none are stored."""
        if self.token_ids is None:
            where = getattr(self, "directory", "this token store")
            raise ValueError(f"{where} stores no token ids (built for an encoder whose score reads the vectors "
                             "alone): a score that reads token ids needs an index built for it")
        return self.token_ids

    @cached_property
    def doc_lengths(self) -> np.ndarray:
        """(n_docs,) int64: stored (scored) tokens per document."""
        return np.diff(self.doc_offsets)

    @cached_property
    def token_doc(self) -> np.ndarray:
        """(n_tokens,) int32: the document index of every stored token."""
        return np.repeat(np.arange(self.n_docs, dtype=np.int32), self.doc_lengths)

    @cached_property
    def doc_index(self) -> dict[str, int]:
        """Document id -> row."""
        return {doc_id: i for i, doc_id in enumerate(self.doc_ids)}

    @cached_property
    def doc_id_rank(self) -> np.ndarray:
        """(n_docs,) int64: the position of each document id in sorted id order (to break score ties by id:
        :mod:`hil.data.ranking`)."""
        return id_rank(self.doc_ids)


# -- blocking by length -----------------------------------------------------------------------------------------

def length_blocks(sorted_lengths: np.ndarray, block_tokens: int) -> list[tuple[int, int]]:
    """Cut ascending lengths into consecutive ``[start, end)`` blocks whose padded size fits ``block_tokens``.

    The padded size of a block is ``count * longest`` (an empty item counts as length 1: it still takes a row).
    Each block is as long as the budget allows (greedy, so the blocks are few) and holds at least one item even
    when that item alone is over budget.
    """
    blocks, start, n = [], 0, len(sorted_lengths)
    while start < n:
        # No block can hold more than block_tokens items (each is at least 1 long): look no further than that.
        window = np.maximum(sorted_lengths[start: start + block_tokens], 1)
        padded = np.arange(1, len(window) + 1) * window  # nondecreasing: count and longest both grow
        end = start + max(1, int(np.searchsorted(padded, block_tokens, side="right")))
        blocks.append((start, end))
        start = end
    return blocks


def device_length_blocks(sorted_lengths: torch.Tensor, budget: int) -> Iterator[tuple[slice, int]]:
    """:func:`length_blocks` on the lengths' device (a tensor): consecutive blocks of ascending lengths
    whose padded size ``count * longest`` (an empty item counts 1) fits ``budget``, greedy, at least one item each.
    -> (block, its longest length): two scalars cross to the host per block, no array."""
    start, n = 0, len(sorted_lengths)
    while start < n:
        window = sorted_lengths[start: start + budget].clamp(min=1)
        padded = torch.arange(1, len(window) + 1, device=window.device) * window  # nondecreasing
        count = max(1, int((padded <= budget).sum()))
        yield slice(start, start + count), int(window[count - 1])
        start += count


# -- gathering stored documents ---------------------------------------------------------------------------------

def padded_rows(doc_offsets: np.ndarray, docs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of ``docs`` padded to the longest: (rows (N, Lmax) int64, mask (N, Lmax) bool).

    Padding positions repeat the document's first row (the last stored row for an empty last document, row 0
    for an empty store), so every position can be read and the padding masked afterwards.
    """
    starts = doc_offsets[docs]
    lengths = doc_offsets[docs + 1] - starts
    width = max(int(lengths.max(initial=0)), 1)
    positions = np.arange(width)
    mask = positions[None, :] < lengths[:, None]
    last_row = max(int(doc_offsets[-1]) - 1, 0)
    rows = np.where(mask, starts[:, None] + positions[None, :], np.minimum(starts, last_row)[:, None])
    return torch.from_numpy(rows), torch.from_numpy(mask)


def gather_documents(store: TokenStore, doc_indices: Sequence[int] | np.ndarray, *,
                     heads: Sequence[str] | None = None, device: torch.device | str | None = None,
                     repeat_padding: bool = False, token_ids: bool | None = None) -> EncodedBatch:
    """Stored documents as a padded :class:`EncodedBatch`: heads (C, Lmax, D) fp32, mask (C, Lmax), input_ids.

    Every stored token takes part in scoring (only scored tokens are stored), so the mask is True exactly on the
    first ``doc_lengths[i]`` positions; padding is zero vectors with input id 0. One ``index_select`` per head
    reads the rows (padding positions re-read a stored row, then are zeroed): no per-document loop and no large
    zero-filled buffer. A compressed head is decompressed for exactly the rows read.

    ``repeat_padding``: leave the vectors at padding positions as read, i.e. copies of the document's own first
    token, and say so (``padding_repeats_tokens``) when every document has a token; a MaxSim then needs no mask
    (:attr:`hil.modeling.contracts.Encoder.scores_repeated_padding`). Token ids are zeroed either way.

    ``token_ids=False``: the token ids are not read (a score that reads the vectors alone); ``input_ids`` is then
    zeros (one expanded element, no memory). None (default): read where the store keeps them; True where it keeps
    none is refused.
    """
    token_ids = store.token_ids is not None if token_ids is None else token_ids
    doc_indices = np.asarray(doc_indices, dtype=np.int64)
    rows, mask = padded_rows(store.doc_offsets, doc_indices)
    n, width = mask.shape
    padding = (~mask).to(device)  # (C, Lmax)
    # With no token stored at all there is no row to read: read nothing and zero everything.
    flat_rows = rows.reshape(-1) if store.n_tokens else None
    # An empty document's padding is another document's token: only when every one has a token are repeats its own.
    repeats = repeat_padding and flat_rows is not None and bool(mask[:, 0].all())

    def zero_padding(picked: torch.Tensor) -> torch.Tensor:  # in place: ``picked`` is always a fresh tensor
        return picked.masked_fill_(padding.view(n, width, *([1] * (picked.dim() - 2))), 0)

    def vectors_padding(picked: torch.Tensor) -> torch.Tensor:
        return picked if repeats else zero_padding(picked)

    def read(table: torch.Tensor, dtype: torch.dtype, fill: Callable[[torch.Tensor], torch.Tensor] = zero_padding
             ) -> torch.Tensor:  # -> (C, Lmax, *table.shape[1:])
        if flat_rows is None:
            return torch.zeros((n, width, *table.shape[1:]), dtype=dtype, device=device)
        # Move before widening: half the bytes cross to an accelerator.
        return fill(table.index_select(0, flat_rows).view(n, width, *table.shape[1:]).to(device).to(dtype))

    def read_vectors(head: str) -> torch.Tensor:  # -> (C, Lmax, D) float32
        array = store.embeddings[head]
        if flat_rows is None:
            return torch.zeros((n, width, int(array.shape[1])), dtype=torch.float32, device=device)
        if isinstance(array, CompressedEmbeddings):
            return vectors_padding(array.rows_torch(flat_rows, device=device).view(n, width, -1))
        return read(store.torch_view(head), torch.float32, vectors_padding)

    encoded = {head: read_vectors(head) for head in (heads if heads is not None else store.head_names)}
    ids = (read(store.torch_view("token_ids"), torch.long) if token_ids
           else torch.zeros((), dtype=torch.long, device=device).expand(n, width))
    return EncodedBatch(encoded, ~padding, ids, repeats)
