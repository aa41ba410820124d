"""How much disk an index build needs, known before any encoding, and the one-line refusal when it is not there.

A build that runs out of disk after hours of encoding loses the hours. The need is estimated from the corpus
before anything is encoded: documents x tokens per document x bytes per token, the tokens per document measured on a
seeded sample of :data:`LENGTH_SAMPLE` documents (their ColBERT tokenization, markers included: an upper bound of
the tokens stored, since punctuation is dropped from what is stored; a vector source's own lengths), the bytes per
token those of the index asked for (fp16 vectors, or a compressed index's codes and residuals) plus the back-end's
structures (:meth:`~hil.retrieval.backends.base.SearchBackend.structure_bytes`), and what the build holds on the
way (one chunk, a compressed build's sample twice, a build from fp16 its structures beside the vectors). The
refusal names the folder, the need and what is free (:class:`~hil.errors.UserError`: exit 2); a resumed build counts
what its unfinished folder already holds.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from hil.errors import UserError
from hil.modeling.contracts import Encoder
from hil.retrieval.backends.configs import IndexConfig
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


def disk_need(encoder: Encoder, config: IndexConfig, doc_ids: Sequence[str], texts: Sequence[str] | None,
              vectors: VectorSource | None, chunk_docs: int = CHUNK_DOCS) -> DiskNeed:
    """The disk a build of this corpus and ``config`` needs (module docstring)."""
    n_docs = len(doc_ids)
    per_doc = tokens_per_document(encoder, texts, vectors)
    n_tokens = max(1, int(round(n_docs * per_doc)))
    heads, dim = len(encoder.head_names), int(encoder.dim)
    backend = backend_class(config.kind)
    params = backend.resolve_params(config, n_tokens, dim)
    structures = heads * backend.structure_bytes(params, n_tokens, n_docs, dim)
    ids = n_docs * (8 + 4 + max((len(d) for d in doc_ids[:1000]), default=8)) + _FIXED_BYTES  # offsets, ids
    if compressed_as_encoded(config):
        index = structures + n_tokens * _IDS_BYTES + ids  # the codes and residuals are the structures' own
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


def check_disk(directory: Path, need: DiskNeed, *, free: int | None = None) -> None:
    """Refuse, in one line naming the folder, the need and what is free, a build that would not fit."""
    free = free_bytes(directory) if free is None else free
    short = need.peak_bytes - _held(unfinished_build_dir(Path(directory)))
    if short > free:
        raise UserError(f"{directory}: not enough disk for this index: it needs about {_size(need.peak_bytes)} "
                        f"while building ({need.n_docs:,} documents x ~{need.tokens_per_doc:.0f} tokens x "
                        f"{need.bytes_per_token:.0f} B for the index, {_size(need.index_bytes)}, plus what the build "
                        f"holds on the way), and {_size(free)} is free there")


def _size(n_bytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes / 1e3:.0f} kB"


def describe(need: DiskNeed) -> dict[str, Any]:
    """The estimate as ``index.json`` records it."""
    return {"n_docs": need.n_docs, "tokens_per_doc_estimate": round(need.tokens_per_doc, 2),
            "bytes_per_token_estimate": round(need.bytes_per_token, 2), "index_bytes_estimate": need.index_bytes,
            "peak_bytes_estimate": need.peak_bytes}
