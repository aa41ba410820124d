"""Inverse document frequency of vocabulary tokens, the term weight of ColBERT-HIL's lexical head (HIL Sec. 3.3).

HIL multiplies the lexical MaxSim of each query token by ``IDF(q_i)`` (``S_L(q_i, d) = IDF(q_i) * M(q_i, d)``),
"approximating term importance (Formal et al., 2021)" without giving the formula. Choices made here:

- **Formula**: the BM25 / Lucene form ``idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))``
  (:func:`bm25_idf`). Unlike the plain ``ln(N / df)`` of SPLADE it is finite for ``df = 0`` and strictly positive
  even for a term in every document (a term found everywhere gets ``ln(1 + 0.5 / (N + 0.5)) ~ 0.5 / N``, close to
  0 but never negative, so a multiplied MaxSim never changes sign).
- **Unit**: WordPiece token ids, as the model sees them (``[CLS]``/marker-free tokenization of each whole document,
  without truncation: document frequency is a property of the collection, not of ``doc_maxlen``). A document
  counts once per distinct token.
- **Unseen tokens** (``df = 0``) get ``ln(1 + (N + 0.5) / 0.5) = ln(2N + 2)``, the largest value the formula
  takes: a never-seen term is treated as the rarest possible term. This falls out of the formula; nothing
  special is done for it.
- **The authors' form** (``formula=AUTHORS_FORMULA``, :func:`authors_idf`, :meth:`IDFTable.from_queries`): the HIL
  authors' released code (its ``qidf.pickle`` script) takes ``ln(N / (1 + df))`` over the *query* collection (the
  MS MARCO training queries in training, the target dataset's queries at evaluation), each query tokenized as the
  model sees it, ``[CLS] [Q] tokens [SEP]`` padded with ``[MASK]`` to ``query_maxlen`` (body not truncated), and
  counts every token alike: markers, ``[CLS]``, ``[SEP]`` and ``[MASK]`` get their (near-zero, possibly
  negative) weight and nothing is set to 0. A token no query contains gets ``ln N`` (the authors' dictionary has
  no entry for it; the formula at df = 0).
- **Special tokens get weight 0**: ``[CLS]``, ``[SEP]``, ``[PAD]``, ``[MASK]``, ``[UNK]`` and the ``[Q]``/``[D]``
  markers (``zero_ids``). They carry no lexical term. In particular ColBERT pads every query to ``query_maxlen``
  with ``[MASK]`` (query augmentation); in the lexical head ``L`` a ``[MASK]`` is the same context-free vector at
  every position, so with a non-zero weight each padding position would add the same spurious "match" and make the
  lexical score depend on how short the query is. With weight 0 these tokens contribute nothing to ``S_L``; they
  still take part in the contextual head ``H`` exactly as in ColBERT. ``[CLS]`` and the markers occur in every
  document anyway, so their IDF would be ~0 if counted. ``[UNK]`` stands for different unknown strings, so an
  ``[UNK]``-``[UNK]`` match is not lexical evidence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

FORMULA = "bm25: ln(1 + (N - df + 0.5) / (df + 0.5))"
AUTHORS_FORMULA = "authors: ln(N / (1 + df)) over query-tokenized texts"
FORMULAS: tuple[str, ...] = (FORMULA, AUTHORS_FORMULA)


def bm25_idf(document_frequency: Tensor, n_documents: int) -> Tensor:
    """``idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))`` (Robertson-Sparck Jones with Lucene's +1).

    document_frequency (V,) integer counts in [0, N], n_documents N >= 1 -> (V,) float32, > 0, decreasing in df;
    ``df = 0`` gives the maximum ``ln(2N + 2)``.
    """
    if n_documents < 1:
        raise ValueError(f"hil.data.idf: IDF needs at least one document (n_documents={n_documents})")
    df = document_frequency.to(torch.float64)
    if bool((df < 0).any()) or bool((df > n_documents).any()):
        raise ValueError(f"hil.data.idf: document frequencies must lie in [0, N={n_documents}]")
    return torch.log1p((n_documents - df + 0.5) / (df + 0.5)).to(torch.float32)


def authors_idf(document_frequency: Tensor, n_documents: int) -> Tensor:
    """``idf(t) = ln(N / (1 + df(t)))``, the HIL authors' released code (their query-IDF script).

    document_frequency (V,) in [0, N] -> (V,) float32; ``df = 0`` gives ``ln N``; a token in every text gets
    ``ln(N / (N + 1)) < 0``.
    """
    if n_documents < 1:
        raise ValueError(f"hil.data.idf: IDF needs at least one document (n_documents={n_documents})")
    df = document_frequency.to(torch.float64)
    if bool((df < 0).any()) or bool((df > n_documents).any()):
        raise ValueError(f"hil.data.idf: document frequencies must lie in [0, N={n_documents}]")
    return torch.log(n_documents / (1.0 + df)).to(torch.float32)


def _hf_tokenizer(tokenizer: Any) -> Any:
    """Accept a Hugging Face tokenizer or a ColBERTTokenizer (which wraps one as ``.tokenizer``)."""
    inner = getattr(tokenizer, "tokenizer", None)
    return inner if inner is not None and hasattr(inner, "all_special_ids") else tokenizer


def count_document_frequency(tokenizer: Any, texts: Iterable[str], vocab_size: int, batch_size: int = 1024,
                             wrap: Callable[[list[int]], list[int]] | None = None) -> tuple[Tensor, int]:
    """How many of ``texts`` contain each token id, tokenized without special tokens and without truncation
    (``wrap`` may add tokens around each text's ids first: the authors' query form adds markers and padding).

    -> (df (vocab_size,) int64, number of documents). Token ids >= ``vocab_size`` raise (tokenizer and model
    disagree on the vocabulary).
    """
    from transformers.utils import logging as hf_logging

    hf = _hf_tokenizer(tokenizer)
    counts = np.zeros(vocab_size, dtype=np.int64)
    n_documents = 0
    batch: list[str] = []
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "sequence longer than model_max_length" is expected: nothing is fed to a model

    def flush() -> None:
        nonlocal n_documents
        if not batch:
            return
        rows = hf(batch, add_special_tokens=False, truncation=False, return_attention_mask=False,
                  return_token_type_ids=False)["input_ids"]
        if wrap is not None:
            rows = [wrap(list(row)) for row in rows]
        distinct = [np.unique(np.asarray(row, dtype=np.int64)) for row in rows]
        flat = np.concatenate(distinct) if distinct else np.zeros(0, dtype=np.int64)
        if flat.size and int(flat.max()) >= vocab_size:
            raise ValueError(f"hil.data.idf: the tokenizer produced token id {int(flat.max())} but the vocabulary "
                             f"has {vocab_size} entries")
        counts[:] += np.bincount(flat, minlength=vocab_size)
        n_documents += len(batch)
        batch.clear()

    try:
        for text in texts:
            if not isinstance(text, str):
                raise TypeError(f"hil.data.idf: document {n_documents + len(batch)} is {type(text).__name__}, "
                                f"not a string")
            batch.append(text)
            if len(batch) >= batch_size:
                flush()
        flush()
    finally:
        hf_logging.set_verbosity(previous)
    return torch.from_numpy(counts), n_documents


@dataclass
class IDFTable:
    """Document frequencies of a collection and the IDF weights derived from them (see the module docstring).

    ``weights(input_ids)`` looks the weights up for a (B, L) batch of token ids; ``to_tensor()`` is the (V,)
    table that a model stores as a buffer (``HILEncoder.set_idf``).
    """

    document_frequency: Tensor       # (V,) int64
    n_documents: int
    zero_ids: tuple[int, ...] = ()   # token ids whose weight is 0 (special tokens, markers)
    source: str = ""                 # where the documents came from (for provenance)
    formula: str = field(default=FORMULA)

    def __post_init__(self) -> None:
        if self.formula not in FORMULAS:
            raise ValueError(f"hil.data.idf: unknown IDF formula {self.formula!r}; known: {FORMULAS}")
        if self.document_frequency.dim() != 1:
            raise ValueError("hil.data.idf: document_frequency must be (V,), "
                             f"got {tuple(self.document_frequency.shape)}")
        self.zero_ids = tuple(sorted({int(i) for i in self.zero_ids}))
        bad = [i for i in self.zero_ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"hil.data.idf: zero_ids {bad} lie outside the vocabulary of {self.vocab_size}")

    @property
    def vocab_size(self) -> int:
        return int(self.document_frequency.shape[0])

    @property
    def unseen_idf(self) -> float:
        """The weight of a token that no document contains (the largest weight of the table): ``ln(2N + 2)``
        (BM25 form) or ``ln N`` (the authors' form)."""
        if self.formula == AUTHORS_FORMULA:
            return math.log(self.n_documents)
        return math.log1p((self.n_documents + 0.5) / 0.5)

    @classmethod
    def from_queries(cls, tokenizer: Any, queries: Iterable[str], batch_size: int = 1024,
                     vocab_size: int | None = None, source: str = "") -> "IDFTable":
        """The HIL authors' query IDF: ``ln(N / (1 + df))`` over ``queries`` tokenized like queries (see the module
        docstring). ``tokenizer`` is a ColBERTTokenizer (markers and ``query_maxlen`` are its own)."""
        hf = _hf_tokenizer(tokenizer)
        size = int(vocab_size) if vocab_size is not None else len(hf)
        prefix = [hf.cls_token_id, int(tokenizer.query_marker_id)]
        maxlen, mask_id, sep_id = int(tokenizer.query_maxlen), hf.mask_token_id, hf.sep_token_id

        def as_query(body: list[int]) -> list[int]:
            return [*prefix, *body, sep_id] + [mask_id] * max(0, maxlen - (len(body) + 3))

        df, n = count_document_frequency(hf, queries, size, batch_size, wrap=as_query)
        if n == 0:
            raise ValueError(f"hil.data.idf: no queries to compute IDF from (source {source or '?'})")
        return cls(df, n, (), source, formula=AUTHORS_FORMULA)

    @classmethod
    def from_texts(cls, tokenizer: Any, texts: Iterable[str], batch_size: int = 1024,
                   zero_ids: Sequence[int] | None = None, extra_zero_ids: Sequence[int] = (),
                   vocab_size: int | None = None, source: str = "") -> "IDFTable":
        """Count document frequencies of ``texts`` with ``tokenizer`` (Hugging Face, or a ColBERTTokenizer).

        zero_ids: token ids weighted 0; default the tokenizer's special tokens (``all_special_ids``: [CLS], [SEP],
        [PAD], [MASK], [UNK]) plus ``extra_zero_ids`` (the [Q]/[D] markers; a ColBERTTokenizer adds its own).
        vocab_size: length of the table, default ``len(tokenizer)``; give the model's embedding count when larger.
        """
        hf = _hf_tokenizer(tokenizer)
        size = int(vocab_size) if vocab_size is not None else len(hf)
        if zero_ids is None:
            zeros = set(int(i) for i in hf.all_special_ids)
            for name in ("query_marker_id", "doc_marker_id"):  # a ColBERTTokenizer knows its markers
                if hasattr(tokenizer, name):
                    zeros.add(int(getattr(tokenizer, name)))
        else:
            zeros = set(int(i) for i in zero_ids)
        zeros.update(int(i) for i in extra_zero_ids)
        df, n = count_document_frequency(hf, texts, size, batch_size)
        if n == 0:
            raise ValueError(f"hil.data.idf: no documents to compute IDF from (source {source or '?'})")
        return cls(df, n, tuple(zeros), source)

    def to_tensor(self, vocab_size: int | None = None) -> Tensor:
        """The (V,) float32 weight of every token id; ``vocab_size`` > V pads with the unseen-token weight."""
        idf = authors_idf if self.formula == AUTHORS_FORMULA else bm25_idf
        table = idf(self.document_frequency, self.n_documents)
        if self.zero_ids:
            table[list(self.zero_ids)] = 0.0
        if vocab_size is not None and vocab_size != self.vocab_size:
            if vocab_size < self.vocab_size:
                raise ValueError(f"hil.data.idf: the table has {self.vocab_size} entries, more than the "
                                 f"{vocab_size} asked for (tokenizer and model vocabularies differ)")
            pad = torch.full((vocab_size - self.vocab_size,), self.unseen_idf, dtype=table.dtype)
            table = torch.cat([table, pad])
        return table

    def weights(self, input_ids: Tensor) -> Tensor:
        """IDF weight of each token: input_ids (B, L) long -> (B, L) float32 on the same device."""
        return self.to_tensor().to(input_ids.device)[input_ids]

    def describe(self) -> str:
        """One line for settings / provenance."""
        return f"{self.source or 'texts'} ({self.n_documents} documents; {self.formula})"

    # -- persistence (the model keeps the weights as a buffer; this file is for reuse across models) ---------------
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"document_frequency": self.document_frequency.cpu(), "n_documents": self.n_documents,
                    "zero_ids": list(self.zero_ids), "source": self.source, "formula": self.formula}, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "IDFTable":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no IDF table file")
        state = torch.load(path, map_location="cpu", weights_only=True)
        missing = [k for k in ("document_frequency", "n_documents", "zero_ids") if k not in state]
        if missing:
            raise ValueError(f"{path}: not an IDF table (missing {missing})")
        formula = state.get("formula", FORMULA)
        if formula not in FORMULAS:
            raise ValueError(f"{path}: IDF formula {formula!r} is not one of this version's {FORMULAS}")
        return cls(state["document_frequency"], int(state["n_documents"]), tuple(state["zero_ids"]),
                   str(state.get("source", "")), formula)
