"""Tokenizing a corpus's chunks once, ahead of the encoder: a ``torch.utils.data.DataLoader`` whose workers turn
each chunk's texts into ready batches while the encoder runs over the previous chunk.

Why: ColBERT's document tokenization (Rust WordPiece, then markers, padding and the punctuation mask in Python)
runs at a few thousand passages/s per core, and a GPU encodes bert-base at ~20,000 passages/s (``bench/README.md``):
tokenizing in the encoding process, between GPU batches, leaves the GPU idle most of the time. Here the encoding
process only runs the model; ``workers`` loader processes tokenize the chunks to come.

What a worker does for one chunk is :func:`hil.retrieval.encoding.sorted_document_batches` (tokenize once, sort by
length, pad into batches): the same batches, in the same order, as encoding the chunk in one process, so the
vectors and every index file are byte for byte those of ``workers=0``. Choices:

- **One item = one chunk** (not one batch): a chunk's batches depend on the length sort of the whole chunk, so
  the unit of work that can run ahead is the chunk. A ``DataLoader`` over the chunks keeps their order (its
  workers take items round robin and it yields them in index order) and holds ``prefetch_factor`` (2) chunks per
  worker ready; a tokenized chunk of 2,048 passages is a few MB.
- **Plain arrays on the wire.** A worker returns the chunk's batches packed into four numpy arrays
  (:class:`TokenizedChunk`), pickled through the loader's queue; the encoding process cuts them back into
  :class:`~hil.data.tokenization.TokenizedBatch` views without copying. Returning the batches as tensors would
  put each of a chunk's ~200 tensors into shared memory with a file descriptor of its own, and a few chunks ahead
  would approach the usual limit of 1,024 open files.
- **Workers start as the platform does** (fork on Linux): the texts stay where they are (the caller's list, or the
  per-rank file of :mod:`hil.retrieval.corpus_texts`) and each worker reads only the chunks it is given. Where
  processes are spawned (macOS, Windows) the dataset is pickled into each worker, texts included; pass texts read
  from disk (:class:`~hil.retrieval.corpus_texts.CorpusTextsFile`, a path on the wire) there.
- ``workers=0`` tokenizes each chunk in this process just before encoding it (no loader, no extra process).
- **Pinned for a GPU** (``pin_memory``): a chunk's three flat arrays are copied once into page-locked memory (by
  the loader's pinning thread, or here with ``workers=0``), so each batch, a view of them, goes up to the GPU
  without the host waiting for the device (:func:`hil.retrieval.encoding.encode_sorted_batches`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from hil.data.tokenization import ColBERTTokenizer, TokenizedBatch
from hil.retrieval.encoding import SortedBatches, sorted_document_batches

ChunkRange = tuple[int, int, int]  # (chunk number, first document, end): hil.retrieval.chunks.chunk_ranges


@dataclass
class TokenizedChunk:
    """One chunk's documents tokenized and sorted into padded batches, packed into flat arrays: batch ``i`` is
    ``shapes[i] = (B, L)``, its tensors the next ``B * L`` entries of each flat array (row-major)."""

    number: int
    start: int
    end: int
    order: np.ndarray           # (n,) int64: input positions within the chunk, in encoding order
    shapes: np.ndarray          # (n_batches, 2) int64: (B, L) of each batch
    # The token arrays: numpy as packed, torch tensors in pinned memory after pin_memory().
    input_ids: np.ndarray | torch.Tensor       # (sum of B * L,) int64
    attention_mask: np.ndarray | torch.Tensor  # (sum of B * L,) int64
    scoring_mask: np.ndarray | torch.Tensor    # (sum of B * L,) bool
    # (n_batches,) bool: whether each batch holds padding (known on the host: the backbone's mask needs no device read)
    padded: np.ndarray | None = None

    @classmethod
    def pack(cls, chunk: ChunkRange, tokenized: SortedBatches) -> "TokenizedChunk":
        number, start, end = chunk
        shapes = np.array([tuple(batch.input_ids.shape) for batch in tokenized.batches], dtype=np.int64)

        def flat(field: str, dtype: type) -> np.ndarray:
            parts = [getattr(batch, field).numpy().reshape(-1) for batch in tokenized.batches]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

        padded = np.array([bool((batch.attention_mask == 0).any()) if batch.has_padding is None else batch.has_padding
                           for batch in tokenized.batches], dtype=bool)
        return cls(number, start, end, np.asarray(tokenized.order, dtype=np.int64), shapes.reshape(-1, 2),
                   flat("input_ids", np.int64), flat("attention_mask", np.int64), flat("scoring_mask", np.bool_),
                   padded)

    def pin_memory(self) -> "TokenizedChunk":
        """The chunk with its token arrays copied into pinned memory (what ``DataLoader(pin_memory=True)`` calls on
        an item, in its pinning thread). Needs CUDA."""
        return replace(self, **{name: torch.as_tensor(getattr(self, name)).pin_memory()
                                for name in ("input_ids", "attention_mask", "scoring_mask")})

    def sorted_batches(self) -> SortedBatches:
        """The batches as tensors (views of the flat arrays, pinned ones included), in encoding order."""
        batches, cursor = [], 0
        padded = self.padded.tolist() if self.padded is not None else [None] * len(self.shapes)
        for (rows, width), has_padding in zip(self.shapes.tolist(), padded):
            cut = slice(cursor, cursor + rows * width)
            batches.append(TokenizedBatch(*(torch.as_tensor(array[cut]).reshape(rows, width)
                                            for array in (self.input_ids, self.attention_mask, self.scoring_mask)),
                                          has_padding=has_padding))
            cursor += rows * width
        return SortedBatches(self.order, batches)


class ChunkTokenization(Dataset):
    """Item ``i``: the ``i``-th chunk of ``chunks`` tokenized into sorted batches of ``batch_size``."""

    def __init__(self, tokenizer: ColBERTTokenizer, texts: Sequence[str], chunks: Sequence[ChunkRange],
                 batch_size: int):
        self.tokenizer = tokenizer
        self.texts = texts
        self.chunks = list(chunks)
        self.batch_size = batch_size

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, item: int) -> TokenizedChunk:
        _, start, end = self.chunks[item]
        tokenized = sorted_document_batches(self.tokenizer, self.texts[start:end], self.batch_size)
        return TokenizedChunk.pack(self.chunks[item], tokenized)


def _as_is(item: TokenizedChunk) -> TokenizedChunk:
    """The loader's collate function: a chunk is already what the encoder takes (module-level: picklable)."""
    return item


def tokenized_chunks(tokenizer: ColBERTTokenizer, texts: Sequence[str], chunks: Sequence[ChunkRange], *,
                     batch_size: int, workers: int = 0, pin_memory: bool = False) -> Iterator[TokenizedChunk]:
    """``chunks`` of ``texts`` tokenized into sorted batches, in the order given: in this process, each just
    before it is needed (``workers=0``), or by ``workers`` loader processes running ahead (see the module
    docstring). The batches are the same either way. ``pin_memory`` (for a GPU encoder): each chunk's token arrays
    in pinned memory."""
    if workers < 0:
        raise ValueError(f"tokenizer_workers must be >= 0 (got {workers})")
    dataset = ChunkTokenization(tokenizer, texts, chunks, batch_size)
    if workers == 0 or len(dataset) == 0:
        for item in range(len(dataset)):
            yield dataset[item].pin_memory() if pin_memory else dataset[item]
        return
    # batch_size=None: one item is one chunk, passed through unchanged (then pinned by the loader's thread).
    loader = DataLoader(dataset, batch_size=None, shuffle=False, num_workers=min(workers, len(dataset)),
                        collate_fn=_as_is, pin_memory=pin_memory)
    yield from loader
