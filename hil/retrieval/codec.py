"""ColBERTv2 residual compression of token vectors: a centroid id plus a few bits per dimension.

Santhanam et al. 2022 (ColBERTv2, Sec. 3.3): a token vector ``v`` is stored as its nearest centroid ``C_t`` and the
residual ``r = v - C_t`` quantized to ``nbits`` per dimension; decompression is

    v' = normalize(C_t + w[b(r)])          b(r_k) = the bucket of r_k among 2 ** nbits buckets, w its weight

Choices (as ColBERTv2, where it states one): the bucket cutoffs are the quantiles ``k / 2**nbits`` of all residual
values of a sample (every dimension pooled), a bucket's weight is the quantile at its middle
``(k + 0.5) / 2**nbits``; the decompressed vector is L2-normalized again. ``nbits`` is 1, 2, 4 or 8 so that the
values of a byte never straddle two bytes; bits are packed low bits first. With D = 128, 2 bits and 16-bit
centroid ids a token takes 32 + 2 = 34 bytes instead of 256 in fp16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hil.retrieval.devices import canonical_device

NBITS = (1, 2, 4, 8)
# Rows compressed / decompressed at once when streaming a memmap (bounds the fp32 temporaries).
_BLOCK = 1 << 15
# Rows compressed at once inside compress_torch: 4 MiB of fp32 residuals at D = 128, within a core's cache.
_CACHE_BLOCK = 1 << 13


@dataclass
class ResidualCodec:
    """Centroids and the residual buckets of one head (see the module docstring)."""

    centroids: np.ndarray  # (C, D) float32
    nbits: int
    cutoffs: np.ndarray    # (2 ** nbits - 1,) float32, ascending
    weights: np.ndarray    # (2 ** nbits,) float32

    def __post_init__(self) -> None:
        if self.nbits not in NBITS:
            raise ValueError(f"residual nbits must be one of {NBITS}, got {self.nbits}")
        if self.centroids.shape[1] * self.nbits % 8:
            raise ValueError(f"dimension {self.centroids.shape[1]} x {self.nbits} bits is not a whole number of bytes")

    @property
    def dim(self) -> int:
        return int(self.centroids.shape[1])

    @property
    def packed_bytes(self) -> int:
        """Bytes of packed residual per token."""
        return self.dim * self.nbits // 8

    @property
    def per_byte(self) -> int:
        return 8 // self.nbits

    def settings(self) -> dict[str, Any]:
        return {"nbits": self.nbits, "cutoffs": self.cutoffs.tolist(), "weights": self.weights.tolist()}

    # -- compress ---------------------------------------------------------------------------------------------
    def compress(self, vectors: np.ndarray, codes: np.ndarray) -> np.ndarray:
        """vectors (n, D), codes (n,) -> packed residual buckets (n, D * nbits / 8) uint8 (:meth:`compress_torch`
        on the CPU)."""
        return self.compress_torch(torch.from_numpy(np.ascontiguousarray(vectors)),
                                   torch.from_numpy(np.asarray(codes).astype(np.int64))).numpy()

    def compress_torch(self, vectors: torch.Tensor, codes: torch.Tensor, block_tokens: int = _CACHE_BLOCK
                       ) -> torch.Tensor:
        """vectors (n, D) any float dtype, codes (n,) integer, on one device -> packed residual buckets
        (n, D * nbits / 8) uint8 there: ``r = v - C_code`` in fp32, the bucket of each value the number of cutoffs
        at or below it (numpy's ``searchsorted(side="right")``), ``8 / nbits`` buckets per byte, low bits first.

        In blocks of ``block_tokens`` rows, so that the fp32 residuals of a block stay in the CPU's cache through
        the steps (a whole chunk's went to memory and back at each: ~3x slower here); up to 2 bits the bucket is
        a sum of comparisons with the cutoffs, above that ``torch.bucketize``."""
        _, centroids = self.device_tables(vectors.device)
        cutoffs = self.__dict__.setdefault("_cutoffs", {})
        if vectors.device not in cutoffs:
            cutoffs[vectors.device] = torch.from_numpy(
                np.ascontiguousarray(self.cutoffs, np.float32)).to(vectors.device)
        edges = cutoffs[vectors.device]
        codes = codes.to(torch.int64)
        packed = torch.empty((len(vectors), self.packed_bytes), dtype=torch.uint8, device=vectors.device)
        for start in range(0, len(vectors), block_tokens):
            rows = slice(start, start + block_tokens)
            residuals = vectors[rows].to(torch.float32) - centroids.index_select(0, codes[rows])
            if self.nbits <= 2:
                buckets = (residuals >= edges[0]).to(torch.uint8)
                for edge in edges[1:]:
                    buckets += residuals >= edge
            else:
                buckets = torch.bucketize(residuals, edges, right=True).to(torch.uint8)
            grouped = buckets.view(len(buckets), self.packed_bytes, self.per_byte)
            out = packed[rows]
            out.copy_(grouped[:, :, 0])
            for slot in range(1, self.per_byte):  # the fields are disjoint: or-ing them in is exact
                out |= grouped[:, :, slot] << (slot * self.nbits)
        return packed

    def compress_into(self, embeddings: np.ndarray, codes: np.ndarray, out: np.ndarray,
                      block_tokens: int = _BLOCK) -> np.ndarray:
        """:meth:`compress` of a (memmapped) table, block by block, into ``out`` (n, packed_bytes) uint8, so that
        a table larger than memory is read once and never held whole."""
        for start in range(0, len(embeddings), block_tokens):
            end = min(start + block_tokens, len(embeddings))
            out[start:end] = self.compress(embeddings[start:end], codes[start:end])
        return out

    # -- decompress -------------------------------------------------------------------------------------------
    def device_tables(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """What decompression reads, on ``device`` (built on first use, cached per device): the residual weights
        encoded by every byte value (256, 8 / nbits) float32, and the centroids (C, D) float32."""
        device = canonical_device(device)
        cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = self.__dict__.setdefault("_tables", {})
        if device not in cache:
            values = np.arange(256, dtype=np.uint16)[:, None]
            shifts = np.arange(self.per_byte, dtype=np.uint16) * self.nbits
            buckets = (values >> shifts) & ((1 << self.nbits) - 1)  # (256, per_byte)
            cache[device] = (torch.from_numpy(self.weights.astype(np.float32)[buckets]).to(device),
                             torch.from_numpy(np.ascontiguousarray(self.centroids, dtype=np.float32)).to(device))
        return cache[device]

    def decompress_torch(self, codes: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """codes (n,) integer, packed (n, packed_bytes) uint8, both on one device -> (n, D) float32 L2-normalized
        vectors, computed on that device."""
        byte_table, centroids = self.device_tables(packed.device)
        # index_select copies a byte's 8 / nbits values at once (advanced indexing went value by value: ~4x slower
        # for the 40k rows of one query's exact stage on a CPU); the same numbers.
        residual = byte_table.index_select(0, packed.reshape(-1).to(torch.int32)).view(len(packed), self.dim)
        vectors = residual.add_(centroids.index_select(0, codes.long()))  # (n, D)
        return torch.nn.functional.normalize(vectors, p=2, dim=-1)

    def decompress(self, codes: np.ndarray, packed: np.ndarray) -> np.ndarray:
        """numpy version of :meth:`decompress_torch`. -> (n, D) float32."""
        return self.decompress_torch(torch.from_numpy(np.asarray(codes).astype(np.int64)),
                                     torch.from_numpy(np.ascontiguousarray(packed))).numpy()


def fit_residual_codec(sample: np.ndarray, sample_codes: np.ndarray, centroids: np.ndarray,
                       nbits: int) -> ResidualCodec:
    """Bucket cutoffs and weights from the residuals of a sample of token vectors (see the module docstring)."""
    if nbits not in NBITS:
        raise ValueError(f"residual nbits must be one of {NBITS}, got {nbits}")
    residuals = np.asarray(sample, dtype=np.float32) - centroids[np.asarray(sample_codes, dtype=np.int64)]
    values = residuals.ravel()
    levels = 1 << nbits
    cutoffs = np.quantile(values, np.arange(1, levels) / levels).astype(np.float32)
    weights = np.quantile(values, (np.arange(levels) + 0.5) / levels).astype(np.float32)
    return ResidualCodec(np.asarray(centroids, dtype=np.float32), nbits, cutoffs, weights)


class CompressedEmbeddings:
    """A read-only, array-like view of compressed token vectors: ``x[rows]`` decompresses those rows.

    Stands in for the ``(n_tokens, D)`` fp16 table of an index whose vectors are stored compressed only; supports
    integer, slice and integer-array row indexing (``x[rows]``, ``x[a:b]``) and ``shape`` / ``dtype`` / ``len``.
    """

    def __init__(self, codec: ResidualCodec, codes: np.ndarray, packed: np.ndarray):
        if len(codes) != len(packed):
            raise ValueError(f"{len(codes)} codes but {len(packed)} packed residual rows")
        self.codec = codec
        self.codes = codes
        self.packed = packed

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.codes), self.codec.dim)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    def __len__(self) -> int:
        return len(self.codes)

    def rows_torch(self, rows: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
        """Decompress rows given as an int64 tensor, on ``device`` (default the CPU): only the rows' centroid ids
        and packed bytes (``packed_bytes + 4`` bytes a token) are copied there. -> (len(rows), D) float32."""
        device = canonical_device(device) if device is not None else torch.device("cpu")
        rows_np = rows.cpu().numpy()
        codes = torch.from_numpy(np.asarray(self.codes[rows_np]).astype(np.int32)).to(device)
        packed = torch.from_numpy(np.ascontiguousarray(self.packed[rows_np])).to(device)
        return self.codec.decompress_torch(codes, packed)

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, tuple):
            rows, rest = key[0], key[1:]
            return self[rows][(slice(None), *rest)]
        if isinstance(key, (int, np.integer)):
            return self[np.array([key])][0]
        if isinstance(key, slice):
            key = np.arange(*key.indices(len(self)))
        rows = np.asarray(key)
        if rows.dtype == bool:
            rows = np.flatnonzero(rows)
        out = np.empty((len(rows), self.codec.dim), dtype=np.float32)
        for start in range(0, len(rows), _BLOCK):
            part = rows[start: start + _BLOCK]
            out[start: start + len(part)] = self.codec.decompress(self.codes[part], self.packed[part])
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self[slice(None)]
        return array if dtype is None else array.astype(dtype)
