"""Compressing a chunk's token vectors as it is encoded: each head's centroids, residual codec and assignment.

The compressed build (:mod:`hil.retrieval.compressed_build`) trains PLAID's centroids and ColBERTv2's residual
buckets on a sample first; every chunk is then stored as codes and residuals only (:func:`hil.retrieval.chunks.
store_chunk`). :class:`ChunkCodec` is what a chunk needs for that, per head: the centroids (C, D), the
:class:`~hil.retrieval.codec.ResidualCodec`, and how a token's centroid is found (:func:`hil.retrieval.plaid.
assign_codes`: exact, on the engine's device, or coarse-to-fine through the centroids' groups). It is picklable
(multi-process encoding sends it to every rank, which moves it to its own device: :meth:`ChunkCodec.on`), and its
:meth:`~ChunkCodec.fingerprint` is part of every chunk's identity, so a chunk compressed with other centroids is
never reused.

A chunk's codes and residuals are computed from the fp16 rows an uncompressed chunk would hold (the vectors as
stored, not the encoder's fp32 output), by the same functions that compress a finished fp16 index: the two builds
give the same bytes for the same centroids (``tests/test_compressed_build.py``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from hil.retrieval.codec import ResidualCodec
from hil.retrieval.kmeans import KMeansEngine
from hil.retrieval.plaid import CentroidAssignment, assign_codes


@dataclass
class HeadCodec:
    """One head's compression: centroids (C, D) float32, residual codec, and how codes are assigned."""

    centroids: np.ndarray
    codec: ResidualCodec
    assignment: CentroidAssignment


@dataclass
class ChunkCodec:
    """Every head's :class:`HeadCodec` and the engine exact assignment runs on (module docstring)."""

    heads: dict[str, HeadCodec]
    engine: KMeansEngine

    def on(self, device: torch.device) -> "ChunkCodec":
        """The same codec for a rank on ``device``: a torch engine moves there (FAISS stays where it runs)."""
        if self.engine.name != "torch":
            return self
        return replace(self, engine=replace(self.engine, device=torch.device(device)))

    def chunk_arrays(self, embeddings: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A chunk's fp16 vectors per head -> ``codes:<head>`` (n,) and ``residuals:<head>`` (n, packed) arrays."""
        arrays: dict[str, np.ndarray] = {}
        for head, vectors in embeddings.items():
            spec = self.heads[head]
            codes = assign_codes(vectors, spec.centroids, engine=self.engine, assignment=spec.assignment)
            arrays[f"codes:{head}"] = codes
            arrays[f"residuals:{head}"] = _compress(spec.codec, vectors, codes, self.engine)
        return arrays

    def record(self) -> dict[str, Any]:
        """Per head: the codec's settings and the assignment (what ``index.json`` records as ``codecs``)."""
        return {head: {**spec.codec.settings(), "assignment": spec.assignment.record()}
                for head, spec in self.heads.items()}

    def fingerprint(self) -> str:
        """SHA-256 (16 hex digits) of every head's centroid bytes, codec and assignment."""
        digest = hashlib.sha256(json.dumps(self.record(), sort_keys=True).encode("utf-8"))
        for head in sorted(self.heads):
            digest.update(np.ascontiguousarray(self.heads[head].centroids, dtype=np.float32).tobytes())
        return digest.hexdigest()[:16]


def _compress(codec: ResidualCodec, vectors: np.ndarray, codes: np.ndarray, engine: KMeansEngine) -> np.ndarray:
    """Packed residuals of ``vectors`` (fp16) against their ``codes``, on a torch engine's device (a GPU build's
    chunk is compressed there), else on the CPU: the same bytes either way (fp32 differences, exact comparisons)."""
    if engine.name == "torch" and engine.device.type != "cpu":
        device = engine.device
        packed = codec.compress_torch(torch.from_numpy(np.ascontiguousarray(vectors)).to(device),
                                      torch.from_numpy(np.asarray(codes).astype(np.int64)).to(device))
        return packed.cpu().numpy()
    return codec.compress(vectors, codes)
