"""How much disk an index build needs (and its search's memory), known before any encoding, and the one-line
refusal when it is not there.

A build that runs out of disk after hours of encoding loses the hours. The need is estimated from the corpus
before anything is encoded: documents x tokens per document x bytes per token, the tokens per document measured on a
seeded sample of :data:`LENGTH_SAMPLE` documents (their ColBERT tokenization, markers included: an upper bound of
the tokens stored, since punctuation is dropped from what is stored; a vector source's own lengths), the bytes per
token those of the index asked for (fp16 vectors, or a compressed index's codes and residuals) plus the back-end's
structures (:meth:`~hil.retrieval.backends.base.SearchBackend.structure_bytes`), and what the build holds on the
way (one chunk, a compressed build's sample twice, a build from fp16 its structures beside the vectors). The
refusal names the folder, the need and what is free (:class:`~hil.errors.UserError`: exit 2); a resumed build counts
what its unfinished folder already holds. The same way, an index whose search would hold more than the machine's
RAM (flat or IVF-Flat over a large corpus: every token in fp32) is refused before encoding (:func:`check_memory`).
Both try the bound of every document at ``doc_maxlen`` first, and tokenize a sample only when the bound does not
fit (:class:`CorpusLengths`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from hil.errors import UserError
from hil.modeling.contracts import Encoder
from hil.retrieval.backends.configs import IndexConfig, PlaidIndexConfig
from hil.retrieval.backends.registry import backend_class
from hil.retrieval.compressed_build import compressed_as_encoded
from hil.retrieval.index import unfinished_build_dir
from hil.retrieval.vector_source import VectorSource

LENGTH_SAMPLE = 1000  # documents tokenized to estimate the tokens per document
CHUNK_DOCS = 2048
_SAMPLE_TOKENS_PER_CENTROID = 32
_IDS_BYTES = 4  # int32 token ids
_FIXED_BYTES = 1 << 16  # index.json (settings, provenance, checksums, codecs) and the arrays' headers


@dataclass(frozen=True)
class DiskNeed:
    """An estimate of a build's disk: the finished index and the peak on the way, with how it was reckoned."""

    n_docs: int
    tokens_per_doc: float
    bytes_per_token: float   # the finished index's, all heads, structures included
    index_bytes: int
    peak_bytes: int

    @property
    def n_tokens(self) -> int:
        return int(round(self.n_docs * self.tokens_per_doc))


def tokens_per_document(encoder: Encoder, texts: Sequence[str] | None, vectors: VectorSource | None,
                        seed: int = 0) -> float:
    """Mean tokens per document over a seeded sample of at most :data:`LENGTH_SAMPLE` documents."""
    n_docs = vectors.n_docs if vectors is not None else len(texts)
    rows = np.sort(np.random.default_rng(seed).choice(n_docs, size=min(LENGTH_SAMPLE, n_docs), replace=False))
    if vectors is not None:
        return float(np.mean(vectors.token_lengths(rows))) if len(rows) else 0.0
    lengths = [len(row) for row in encoder.tokenizer.document_rows([texts[int(i)] for i in rows])]
    return float(np.mean(lengths)) if lengths else 0.0


class CorpusLengths:
    """Tokens per document of a corpus, as cheaply as a question allows: the bound of every document at
    ``doc_maxlen`` costs nothing; the mean over a tokenized sample (:func:`tokens_per_document`) is measured on the
    first call of :meth:`measured` only (a vector source's lengths are read, not estimated)."""

    def __init__(self, encoder: Encoder, texts: Sequence[str] | None, vectors: VectorSource | None):
        self.encoder, self.texts, self.vectors = encoder, texts, vectors
        self._measured: float | None = None

    @property
    def bound(self) -> float:
        return self.measured() if self.vectors is not None else float(self.encoder.tokenizer.doc_maxlen)

    def measured(self) -> float:
        if self._measured is None:
            self._measured = tokens_per_document(self.encoder, self.texts, self.vectors)
        return self._measured


def sized_config(config: IndexConfig, encoder: Encoder, n_docs: int,
                 lengths: CorpusLengths) -> tuple[IndexConfig, dict[str, Any] | None]:
    """``config`` with the settings it leaves to the corpus's size decided (PLAID's storage:
    :meth:`~hil.retrieval.backends.configs.PlaidIndexConfig.sized`), from the ``doc_maxlen`` bound when even that
    keeps the corpus small, else from the measured lengths; -> (the settings, the choice's record or None)."""
    if not isinstance(config, PlaidIndexConfig) or not config.storage_left_to_corpus:
        return config, None
    fp16_per_token = 2 * int(encoder.dim) * len(encoder.head_names)
    sized, record = config.sized(int(round(n_docs * lengths.bound)), fp16_per_token)
    if sized.residual_bits or not sized.keep_embeddings:  # the bound says large: the measured length decides
        sized, record = config.sized(int(round(n_docs * lengths.measured())), fp16_per_token)
        record["tokens_per_doc"] = "measured on a sample"
    else:
        record["tokens_per_doc"] = "doc_maxlen bound"
    return sized, record


def stores_token_ids(encoder: Encoder, config: IndexConfig) -> bool:
    """Whether an index of ``config`` keeps the token ids: always, but in a compressed-as-encoded index of an encoder
    whose score reads the vectors alone (``scores_repeated_padding``: search never reads its ids)."""
    return not (compressed_as_encoded(config) and encoder.scores_repeated_padding)


def disk_need(encoder: Encoder, config: IndexConfig, doc_ids: Sequence[str], *, tokens_per_doc: float,
              chunk_docs: int = CHUNK_DOCS) -> DiskNeed:
    """The disk a build of this corpus (``tokens_per_doc`` measured, or a bound) and ``config`` (its storage
    decided: :func:`sized_config`) needs (module docstring)."""
    n_docs = len(doc_ids)
    per_doc = tokens_per_doc
    n_tokens = max(1, int(round(n_docs * per_doc)))
    heads, dim = len(encoder.head_names), int(encoder.dim)
    backend = backend_class(config.kind)
    params = backend.resolve_params(config, n_tokens, dim)
    structures = heads * backend.structure_bytes(params, n_tokens, n_docs, dim)
    ids = n_docs * (8 + 4 + max((len(d) for d in doc_ids[:1000]), default=8)) + _FIXED_BYTES  # offsets, ids
    if compressed_as_encoded(config):
        kept_ids = _IDS_BYTES if stores_token_ids(encoder, config) else 0
        index = structures + n_tokens * kept_ids + ids  # the codes and residuals are the structures' own
        chunk = chunk_docs * per_doc * (structures / n_tokens + _IDS_BYTES)
        sample = 2 * heads * min(n_tokens, (_SAMPLE_TOKENS_PER_CENTROID + 1) * params["n_centroids"]) * dim * 2
        peak = index + chunk + sample
    else:
        vectors_bytes = n_tokens * (heads * dim * 2 + _IDS_BYTES)
        index = vectors_bytes + structures + ids
        if not params.get("keep_embeddings", True):
            index -= n_tokens * heads * dim * 2
        peak = vectors_bytes + structures + ids + chunk_docs * per_doc * (heads * dim * 2 + _IDS_BYTES)
    return DiskNeed(n_docs, per_doc, index / n_tokens, int(index), int(peak))


def free_bytes(directory: Path) -> int:
    """Free bytes on the file system ``directory`` is (or would be) on."""
    probe = Path(directory).absolute()
    while not probe.exists():
        probe = probe.parent
    return int(shutil.disk_usage(probe).free)


def _held(folder: Path) -> int:
    """Bytes an unfinished build folder holds already (a resumed build needs that much less)."""
    if not folder.is_dir():
        return 0
    return int(sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()))


def check_disk(directory: Path, encoder: Encoder, config: IndexConfig, doc_ids: Sequence[str],
               lengths: CorpusLengths, *, free: int | None = None) -> None:
    """Refuse, in one line naming the folder, the need and what is free, a build that would not fit. The bound of
    every document at ``doc_maxlen`` is tried first: when even that fits, no document is tokenized for the
    estimate (a small corpus, or a large disk, costs nothing here)."""
    free = free_bytes(directory) if free is None else free
    held = _held(unfinished_build_dir(Path(directory)))
    bound = disk_need(encoder, config, doc_ids, tokens_per_doc=lengths.bound)
    if bound.peak_bytes - held <= free:
        return
    need = disk_need(encoder, config, doc_ids, tokens_per_doc=lengths.measured())
    short = need.peak_bytes - held
    if short > free:
        raise UserError(f"{directory}: not enough disk for this index: it needs about {_size(need.peak_bytes)} "
                        f"while building ({need.n_docs:,} documents x ~{need.tokens_per_doc:.0f} tokens x "
                        f"{need.bytes_per_token:.0f} B for the index, {_size(need.index_bytes)}, plus what the build "
                        f"holds on the way), and {_size(free)} is free there")


def physical_memory_bytes() -> int:
    """This machine's RAM (0 where the system does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def search_memory_need(encoder: Encoder, config: IndexConfig, n_docs: int, tokens_per_doc: float) -> int:
    """Host bytes a search of this index holds in memory (every head: :meth:`~hil.retrieval.backends.base.
    SearchBackend.search_memory_bytes`)."""
    n_tokens = max(1, int(round(n_docs * tokens_per_doc)))
    backend, dim = backend_class(config.kind), int(encoder.dim)
    params = backend.resolve_params(config, n_tokens, dim)
    return len(encoder.head_names) * backend.search_memory_bytes(params, n_tokens, n_docs, dim)


def check_memory(directory: Path, encoder: Encoder, config: IndexConfig, n_docs: int, lengths: CorpusLengths, *,
                 ram: int | None = None) -> None:
    """Refuse, in one line, an index whose search would hold more than this machine's RAM (a flat or IVF-Flat
    index of a large corpus: every token in fp32), before hours of encoding; PLAID's files are memory-mapped."""
    ram = physical_memory_bytes() if ram is None else ram
    if not ram or search_memory_need(encoder, config, n_docs, lengths.bound) <= ram:
        return
    need = search_memory_need(encoder, config, n_docs, lengths.measured())
    if need > ram:
        raise UserError(f"{directory}: a {config.kind} index of {n_docs:,} documents (~{lengths.measured():.0f} "
                        f"tokens each) holds about {_size(need)} in memory to search, and this machine has "
                        f"{_size(ram)}: use the plaid back-end (compressed as it is encoded, memory-mapped)")


def _size(n_bytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes / 1e3:.0f} kB"

