"""Where a build's document vectors come from: the encoder run over the texts, or vectors computed beforehand.

An index build needs, for any set of document rows, their scored token vectors (fp16, per head), token ids and
lengths: an :class:`~hil.retrieval.encoding.EncodedTokens`. :class:`DocumentVectors` is that one call. Two kinds
satisfy it:

- :class:`EncodedDocuments`: the texts encoded by the (document view of the) encoder, in batches sorted by length,
  exactly as a chunk of the corpus is encoded (:func:`hil.retrieval.encoding.encode_document_tokens`): what every
  real build uses, for the sample the compressed build draws first (:mod:`hil.retrieval.compressed_build`).
- a :class:`VectorSource`: vectors that exist already (another index's, a tiling of them for a scale benchmark:
  :class:`TiledVectors`). ``build_index(..., vectors=source)`` then builds from it without encoding anything; the
  index records the source (:meth:`VectorSource.record`) beside the encoder whose settings and fingerprint it
  carries, so that the encoder's queries search it.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from hil.provenance import fingerprint_strings
from hil.retrieval.encoding import DocumentEncoder, EncodedTokens, encode_document_tokens


class DocumentVectors(Protocol):
    """Token vectors of any documents of a corpus, by row."""

    def vectors(self, rows: np.ndarray) -> EncodedTokens:
        """The documents at ``rows`` (ascending int64), in that order: fp16 vectors per head, int32 token ids,
        int64 lengths."""


@runtime_checkable
class VectorSource(DocumentVectors, Protocol):
    """Precomputed document vectors a build reads instead of encoding (module docstring)."""

    @property
    def n_docs(self) -> int: ...

    @property
    def head_names(self) -> tuple[str, ...]: ...

    def token_lengths(self, rows: np.ndarray) -> np.ndarray:
        """Stored tokens of the documents at ``rows``, without reading their vectors (for size estimates)."""

    def fingerprint(self) -> str:
        """Identifies the vectors (a build's corpus fingerprint when none is given)."""

    def record(self) -> dict[str, Any]:
        """What ``index.json`` records of the source (JSON-able)."""


class EncodedDocuments:
    """:class:`DocumentVectors` of ``texts`` through ``encoder`` (a document view), ``batch_size`` documents per
    batch. Call inside :func:`~hil.retrieval.encoding.eval_mode` and the build's autocast."""

    def __init__(self, encoder: DocumentEncoder, texts: Sequence[str], batch_size: int):
        self.encoder = encoder
        self.texts = texts
        self.batch_size = batch_size

    def vectors(self, rows: np.ndarray) -> EncodedTokens:
        return encode_document_tokens(self.encoder, [self.texts[int(i)] for i in rows], batch_size=self.batch_size)


def random_rotation(dim: int, seed: int) -> np.ndarray:
    """A (dim, dim) orthogonal matrix drawn uniformly (Haar) from ``seed``: QR of a Gaussian matrix with the signs
    of R's diagonal moved into Q (Mezzadri 2007, "How to generate random matrices from the classical compact
    groups", Sec. 5), float64."""
    rng = np.random.default_rng(seed)
    q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
    return q * np.sign(np.diag(r))[None, :]


TILINGS = ("shuffle", "rotation")


class TiledVectors:
    """A corpus ``factor`` times as large as ``base`` (a :class:`~hil.retrieval.store.TokenStore`, e.g. an opened
    index of fp16 vectors), for scale benchmarks: copy ``r`` of document ``d`` is row ``r * n + d`` with id
    ``d`` for ``r = 0`` (the original documents keep their ids, and so their judgments) and ``d#r`` after. Copy 0
    is the base itself; how a copy ``r >= 1`` is made distinct is the ``tiling``:

    - ``shuffle`` (default): its documents are bags of the base's tokens: copy r of d holds, at each of d's token
      positions, the base token at ``perm_r[offsets[d] + j]`` for a seeded permutation ``perm_r`` of all base
      token rows (vectors and ids together). Every copy draws from the base's own token distribution, so the
      corpus grows as a real corpus of that domain does: its centroids get denser in the same space, its inverted
      lists longer. A bag matches a query only by chance, so it is a distractor, not a tie (``bench/scale.py``
      checks how often one outranks a relevant original).
    - ``rotation``: every token vector turned by one fixed random rotation per copy (:func:`random_rotation` of
      ``seed + r``, applied in fp32, rounded to fp16). A rotation keeps a copy's geometry but moves it elsewhere on
      the sphere: its documents never outrank the originals, but each copy is a cloud of its own, so C centroids
      are shared by ``factor`` clouds and every copy is quantized more coarsely as the factor grows, unlike a real
      corpus (``bench/README.md``).

    Token ids and lengths follow the tokens.
    """

    def __init__(self, base: Any, factor: int, seed: int = 0, tiling: str = "shuffle"):
        if factor < 1:
            raise ValueError(f"factor must be >= 1 (got {factor})")
        if tiling not in TILINGS:
            raise ValueError(f"tiling must be one of {TILINGS} (got {tiling!r})")
        self.base = base
        self.factor = int(factor)
        self.seed = int(seed)
        self.tiling = tiling
        self._rotations: dict[int, torch.Tensor] = {}

    @property
    def n_docs(self) -> int:
        return self.base.n_docs * self.factor

    @property
    def head_names(self) -> tuple[str, ...]:
        return tuple(self.base.head_names)

    def doc_ids(self) -> list[str]:
        return [doc_id if r == 0 else f"{doc_id}#{r}" for r in range(self.factor) for doc_id in self.base.doc_ids]

    def rotation(self, copy: int) -> torch.Tensor:
        """The (D, D) float32 rotation of ``copy`` (the identity for copy 0 is never applied)."""
        if copy not in self._rotations:
            dim = next(iter(self.base.dims.values()))
            self._rotations[copy] = torch.from_numpy(random_rotation(dim, self.seed + copy).astype(np.float32))
        return self._rotations[copy]

    def permutation(self, copy: int) -> np.ndarray:
        """The seeded permutation of the base's token rows that copy ``copy`` draws its tokens from, (n_tokens,)."""
        return np.random.default_rng((self.seed, copy)).permutation(self.base.n_tokens)

    def token_lengths(self, rows: np.ndarray) -> np.ndarray:
        return self.base.doc_lengths[np.asarray(rows, dtype=np.int64) % self.base.n_docs]

    def vectors(self, rows: np.ndarray) -> EncodedTokens:
        rows = np.asarray(rows, dtype=np.int64)
        base_rows = rows % self.base.n_docs
        copies = rows // self.base.n_docs
        offsets = self.base.doc_offsets
        lengths = offsets[base_rows + 1] - offsets[base_rows]
        token_rows = np.repeat(offsets[base_rows] - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) + \
            np.arange(int(lengths.sum()))
        token_copy = np.repeat(copies, lengths)
        if self.tiling == "shuffle":  # each copy's positions read its permutation of the base's rows
            for copy in np.unique(token_copy):
                if copy:
                    where = token_copy == copy
                    token_rows[where] = self.permutation(int(copy))[token_rows[where]]
        # Shuffled rows are read in ascending order (a memmap read stays sequential), then put back in place.
        order = np.argsort(token_rows, kind="stable") if self.tiling == "shuffle" else None
        embeddings = {}
        for head in self.head_names:
            table = self.base.embeddings[head]
            if order is None:
                vectors = np.asarray(table[token_rows], dtype=np.float16)
            else:
                vectors = np.empty((len(token_rows), table.shape[1]), dtype=np.float16)
                vectors[order] = table[token_rows[order]]
            if self.tiling == "rotation":
                for copy in np.unique(token_copy):
                    if copy == 0:
                        continue
                    where = token_copy == copy
                    turned = torch.from_numpy(vectors[where].astype(np.float32)) @ self.rotation(int(copy))
                    vectors[where] = turned.numpy().astype(np.float16)
            embeddings[head] = vectors
        token_ids = np.asarray(self.base.token_ids[token_rows], dtype=np.int32)
        return EncodedTokens(embeddings, token_ids, lengths.astype(np.int64))

    def fingerprint(self) -> str:
        base = getattr(self.base, "corpus_fingerprint", None) or fingerprint_strings(self.base.doc_ids)
        return fingerprint_strings([base, "tiled", str(self.factor), self.tiling, str(self.seed)])

    def record(self) -> dict[str, Any]:
        return {"kind": "tiled", "factor": self.factor, "tiling": self.tiling, "seed": self.seed,
                "base": str(getattr(self.base, "directory", "")) or None,
                "base_corpus_fingerprint": getattr(self.base, "corpus_fingerprint", None),
                "base_n_docs": self.base.n_docs, "base_n_tokens": self.base.n_tokens}
