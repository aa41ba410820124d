"""MUVERA's fixed dimensional encodings (FDEs): one vector per token set whose inner products approximate Chamfer.

Dhulipala, Hadian, Jayaram, Lee & Mirrokni 2024, "MUVERA: Multi-Vector Retrieval via Fixed Dimensional Encodings"
(arXiv 2405.19504). Section numbers are those of the arXiv version as we recall them (the paper is not on disk);
the released reference is google/graph-mining, ``sketching/point_cloud/fixed_dimensional_encoding.cc``.

For a query Q and a document P (sets of d-dimensional token vectors), late interaction scores
``Chamfer(Q, P) = sum_{q in Q} max_{p in P} <q, p>`` (Sec. 1; ColBERT's MaxSim). An FDE maps each set to one
vector, F_q(Q) and F_doc(P), so that a single inner product approximates it (Sec. 2):

- **SimHash partition** (Sec. 2): k_sim Gaussian hyperplanes g_1..g_k ~ N(0, I_d) cut R^d into B = 2^k_sim buckets,
  ``phi(x) = sum_j 1(<g_j, x> > 0) 2^j`` (bit j of the bucket is the side of hyperplane j; the reference labels the
  buckets by a Gray code instead, a relabelling that changes no inner product).
- **Blocks** (Sec. 2): for bucket k, the query block is the SUM of the query's vectors in it and the document block
  the MEAN of the document's vectors in it (the centroid):
  ``q_(k) = sum_{q in Q, phi(q) = k} q``,  ``p_(k) = (1 / |P ∩ phi^-1(k)|) sum_{p in P, phi(p) = k} p``.
  Then ``<F_q, F_doc> = sum_q <q, p_(phi(q))>``: each query token meets the centroid of the document tokens that share
  its bucket, a stand-in for its best match.
- **Empty partitions** (Sec. 2, ``fill_empty_partitions``, documents only): a document bucket with no token takes the
  document token whose sketch ``(1(<g_j, p> > 0))_j`` is nearest to the bucket's bits in Hamming distance (ties: the
  earliest token, as the reference's strict ``<`` scan), so no query token meets a zero block.
- **Inner projection** (Sec. 2): ``psi(x) = (1 / sqrt(d_proj)) S x`` with S a d_proj x d matrix of independent
  uniform +-1 entries (``E <psi x, psi y> = <x, y>``), applied to every vector before the blocks are formed (psi is
  linear, so ``psi`` of a block sum or mean is the sum or mean of the ``psi``'s). ``d_proj`` None (or d) is the
  identity. (The reference's "AMS sketch" maps each input coordinate to ONE random output coordinate with a random
  sign instead of the paper's dense matrix; we follow the paper.)
- **Repetitions** (Sec. 2): r_reps independent (partition, projection) pairs, blocks concatenated:
  ``F(Q) = (F^1(Q), ..., F^R(Q))`` of dimension ``d_FDE = R * B * d_proj`` (layout: repetition, bucket, coordinate).
- **Final projection** (optional, Sec. 2 / 3): ``d_final`` coordinates. We apply the reference's Count Sketch (each
  FDE coordinate i added to output coordinate h(i) with sign s(i), h uniform, s uniform +-1) rather than a dense
  +-1 / sqrt(d_final) matrix: the same unbiased inner product (``E <CS x, CS y> = <x, y>``) in O(d_FDE) memory and
  time instead of O(d_FDE * d_final) (a dense 10,240 x 4,096 matrix is 160 MiB), and FDEs comparable with those of
  the released implementation.

**Guarantee** (Theorem 2.1, Sec. 2.1): for unit vectors, with ``k_sim = O(log(m / delta) / epsilon)`` and
``d_proj = O(log(m / (epsilon delta)) / epsilon^2)`` (m = |Q| + |P|), one repetition gives, with probability at least
1 - delta, ``NChamfer(Q, P) - epsilon <= <F_q(Q), F_doc(P)> / |Q| <= NChamfer(Q, P) + epsilon`` where
``NChamfer = Chamfer / |Q|``; with R repetitions the inner product is a sum over them, so the estimate of NChamfer
is ``<F_q(Q), F_doc(P)> / (|Q| R)`` (``tests/test_muvera.py`` measures how close it comes).

Randomness: everything random is drawn from one integer ``seed`` by a CPU ``torch.Generator`` in a fixed order
(:func:`fde_sketch`) and then moved to the device, so any machine derives the same hyperplanes and projections; the
back-end (:mod:`hil.retrieval.backends.muvera`) also stores them with the index, so a search never depends on
torch's generator staying the same across versions.

Every function takes a batch of token sets as padded vectors (N, L, D) with a mask (N, L) (True on real tokens),
runs on their device in float32 with ``index_add_`` (no loop over sets), and bounds its temporaries: the nearest-
token search of the empty buckets runs over chunks of buckets of at most ``block_elements`` (N, R, buckets, L)
entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

MAX_K_SIM = 16  # 65,536 buckets: beyond this an FDE (R * 2^k_sim * d_proj floats) cannot be held anyway
DEFAULT_BLOCK_ELEMENTS = 1 << 24  # entries of the (N, R, buckets, L) nearest-token tensor per chunk (64 MiB fp32)


@dataclass(frozen=True)
class FdeSketch:
    """The random draws of one FDE configuration (all float32 but the count-sketch buckets).

    ``hyperplanes`` (R, D, k_sim) Gaussian; ``inner`` (R, D, d_proj) the +-1 / sqrt(d_proj) matrices (None: the
    identity); ``final_buckets`` (d_FDE,) int64 in [0, d_final) and ``final_signs`` (d_FDE,) +-1 (None: no final
    projection).
    """

    hyperplanes: Tensor
    inner: Tensor | None
    final_buckets: Tensor | None
    final_signs: Tensor | None
    d_final: int | None

    @property
    def r_reps(self) -> int:
        return int(self.hyperplanes.shape[0])

    @property
    def dim(self) -> int:
        return int(self.hyperplanes.shape[1])

    @property
    def k_sim(self) -> int:
        return int(self.hyperplanes.shape[2])

    @property
    def n_buckets(self) -> int:
        return 1 << self.k_sim

    @property
    def d_proj(self) -> int:
        return self.dim if self.inner is None else int(self.inner.shape[2])

    @property
    def fde_dim(self) -> int:
        """d_FDE = R * B * d_proj, before the final projection."""
        return self.r_reps * self.n_buckets * self.d_proj

    @property
    def out_dim(self) -> int:
        """The dimension of the encodings: d_final when there is a final projection, else d_FDE."""
        return self.d_final if self.d_final is not None else self.fde_dim

    def to(self, device: torch.device | str) -> "FdeSketch":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return FdeSketch(move(self.hyperplanes), move(self.inner), move(self.final_buckets), move(self.final_signs),
                         self.d_final)


def fde_dimension(dim: int, k_sim: int, d_proj: int | None, r_reps: int) -> int:
    """d_FDE = r_reps * 2^k_sim * d_proj (d_proj None: dim), the encoding's size before a final projection."""
    return r_reps * (1 << k_sim) * (dim if d_proj is None else d_proj)


def fde_sketch(dim: int, *, k_sim: int, d_proj: int | None, r_reps: int, d_final: int | None, seed: int,
               device: torch.device | str = "cpu") -> FdeSketch:
    """Every random draw of an FDE configuration from ``seed``, in this order on a CPU generator: the hyperplanes
    (R, D, k_sim) ~ N(0, 1); the inner +-1 signs (R, D, d_proj) unless d_proj is None or D (identity); the final
    count sketch's buckets, then signs (d_FDE,) when ``d_final`` is given. Then moved to ``device``."""
    if not 0 <= k_sim <= MAX_K_SIM:
        raise ValueError(f"k_sim must lie in 0..{MAX_K_SIM}, got {k_sim}")
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    hyperplanes = torch.randn((r_reps, dim, k_sim), generator=generator, dtype=torch.float32)
    inner = None
    if d_proj is not None and d_proj != dim:
        signs = torch.randint(0, 2, (r_reps, dim, d_proj), generator=generator).to(torch.float32) * 2 - 1
        inner = signs / math.sqrt(d_proj)
    buckets = signs_final = None
    if d_final is not None:
        size = fde_dimension(dim, k_sim, d_proj, r_reps)
        buckets = torch.randint(0, d_final, (size,), generator=generator)
        signs_final = torch.randint(0, 2, (size,), generator=generator).to(torch.float32) * 2 - 1
    return FdeSketch(hyperplanes, inner, buckets, signs_final, d_final).to(device)


# -- the pieces ---------------------------------------------------------------------------------------------------

def simhash_bits(vectors: Tensor, hyperplanes: Tensor) -> Tensor:
    """The sketch of every vector in every repetition: ``<g_j, x> > 0``. vectors (T, D) -> (T, R, k_sim) bool."""
    return torch.einsum("td,rdk->trk", vectors, hyperplanes) > 0


def bucket_of(bits: Tensor) -> Tensor:
    """phi: bit j of the bucket is hyperplane j's side. bits (..., k_sim) bool -> (...) int64 in [0, 2^k_sim)."""
    weights = 1 << torch.arange(bits.shape[-1], device=bits.device, dtype=torch.int64)
    return (bits.to(torch.int64) * weights).sum(-1)


def inner_projection(vectors: Tensor, inner: Tensor | None, r_reps: int) -> Tensor:
    """psi of every vector in every repetition. vectors (T, D) -> (T, R, d_proj)."""
    if inner is None:
        return vectors.unsqueeze(1).expand(-1, r_reps, -1)
    return torch.einsum("td,rdp->trp", vectors, inner)


def count_sketch(fde: Tensor, sketch: FdeSketch) -> Tensor:
    """The final projection: ``out[:, h(i)] += s(i) fde[:, i]``. fde (N, d_FDE) -> (N, d_final); identity without."""
    if sketch.d_final is None:
        return fde
    out = torch.zeros((fde.shape[0], sketch.d_final), dtype=fde.dtype, device=fde.device)
    return out.index_add_(1, sketch.final_buckets, fde * sketch.final_signs)


def _bucket_sums(vectors: Tensor, mask: Tensor, sketch: FdeSketch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per set, repetition and bucket: the sum of the projected vectors in it and their count.

    -> sums (N, R, B, d_proj), counts (N, R, B), and for the real tokens, in the order of ``vectors[mask]``, their
    sketch bits (T, R, k_sim) and projections (T, R, d_proj).
    """
    n, _, dim = vectors.shape
    if dim != sketch.dim:
        raise ValueError(f"vectors have dimension {dim}, the FDE sketch was drawn for {sketch.dim}")
    rows = torch.nonzero(mask, as_tuple=True)[0]  # (T,) set of each real token, ascending
    tokens = vectors[mask].to(torch.float32)  # (T, D)
    bits = simhash_bits(tokens, sketch.hyperplanes)  # (T, R, k)
    r, b, p = sketch.r_reps, sketch.n_buckets, sketch.d_proj
    slot = (rows.unsqueeze(1) * r + torch.arange(r, device=rows.device)) * b + bucket_of(bits)  # (T, R)
    projected = inner_projection(tokens, sketch.inner, r)  # (T, R, P)
    sums = torch.zeros((n * r * b, p), dtype=torch.float32, device=vectors.device)
    sums.index_add_(0, slot.reshape(-1), projected.reshape(-1, p))
    counts = torch.zeros(n * r * b, dtype=torch.float32, device=vectors.device)
    counts.index_add_(0, slot.reshape(-1), torch.ones(slot.numel(), dtype=torch.float32, device=vectors.device))
    return sums.view(n, r, b, p), counts.view(n, r, b), bits, projected


def query_fde(vectors: Tensor, mask: Tensor, sketch: FdeSketch) -> Tensor:
    """F_q of each query: per repetition and bucket the SUM of its projected vectors (no filling), concatenated,
    then the final projection. vectors (N, L, D), mask (N, L) -> (N, out_dim) float32."""
    sums, _, _, _ = _bucket_sums(vectors, mask, sketch)
    return count_sketch(sums.reshape(len(sums), -1), sketch)


def document_fde(vectors: Tensor, mask: Tensor, sketch: FdeSketch, *, fill_empty: bool = True,
                 block_elements: int = DEFAULT_BLOCK_ELEMENTS) -> Tensor:
    """F_doc of each document: per repetition and bucket the MEAN of its projected vectors; with ``fill_empty`` an
    empty bucket takes the projected token whose sketch is nearest in Hamming distance (earliest on ties); a set
    with no token is all zeros. vectors (N, L, D), mask (N, L) -> (N, out_dim) float32."""
    sums, counts, bits, projected = _bucket_sums(vectors, mask, sketch)
    blocks = sums / counts.clamp(min=1).unsqueeze(-1)  # (N, R, B, P): the centroids; empty buckets stay 0
    if fill_empty and sketch.k_sim > 0 and len(bits):
        nearest = nearest_sketch_tokens(bits, mask, sketch, block_elements)  # (N, R, B) index into the real tokens
        reps = torch.arange(sketch.r_reps, device=vectors.device).view(1, -1, 1)
        filler = projected[nearest, reps]  # (N, R, B, P)
        has_tokens = mask.any(dim=1).view(-1, 1, 1)
        empty = (counts == 0) & has_tokens
        blocks = torch.where(empty.unsqueeze(-1), filler, blocks)
    return count_sketch(blocks.reshape(len(blocks), -1), sketch)


def nearest_sketch_tokens(bits: Tensor, mask: Tensor, sketch: FdeSketch,
                          block_elements: int = DEFAULT_BLOCK_ELEMENTS) -> Tensor:
    """For every set, repetition and bucket, the set's token whose sketch is nearest to the bucket's bits in Hamming
    distance, the earliest on ties (an index into the masked tokens; 0 for a set without tokens).

    Hamming distance = (k - <s(x), s(b)>) / 2 for the +-1 forms s of the bits, so the nearest token is the first
    argmax of that inner product (``torch.argmax`` returns the first maximal index). Chunked over buckets so the
    (N, R, chunk, L) scores stay within ``block_elements``.
    """
    n, width = mask.shape
    r, b, k = sketch.r_reps, sketch.n_buckets, sketch.k_sim
    positions = torch.cumsum(mask.to(torch.int64), dim=1) - 1  # (N, L): rank of each real token within its set
    signs = torch.zeros((n, width, r, k), dtype=torch.float32, device=mask.device)
    signs[mask] = bits.to(torch.float32) * 2 - 1  # padding: all zeros, then excluded below
    bucket_bits = (torch.arange(b, device=mask.device).unsqueeze(1) >> torch.arange(k, device=mask.device)) & 1
    bucket_signs = bucket_bits.to(torch.float32) * 2 - 1  # (B, k)
    first = torch.zeros(n + 1, dtype=torch.int64, device=mask.device)
    first[1:] = torch.cumsum(mask.sum(dim=1), dim=0)  # offset of each set's tokens in the masked order
    chunk = max(1, block_elements // max(1, n * r * width))
    out = torch.empty((n, r, b), dtype=torch.int64, device=mask.device)
    for start in range(0, b, chunk):
        agree = torch.einsum("nlrk,bk->nrbl", signs, bucket_signs[start:start + chunk])  # (N, R, c, L)
        agree = agree.masked_fill(~mask.view(n, 1, 1, width), -float(k + 1))
        out[:, :, start:start + chunk] = agree.argmax(dim=-1)  # position within the padded set
    # position -> its rank among the set's real tokens -> its index in the masked (row-major) order
    rank = positions.gather(1, out.view(n, -1)).view(n, r, b).clamp(min=0)
    return (first[:-1].view(n, 1, 1) + rank).clamp(max=max(len(bits) - 1, 0))  # a set without tokens: any index
