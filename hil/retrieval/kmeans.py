"""Spherical k-means in torch, on any device: PLAID's centroids without faiss-gpu (issue 29: faiss-gpu wheels are
CUDA 12, current torch builds CUDA 13, so a GPU build would otherwise run k-means in FAISS on the CPU).

The contract is FAISS's ``Kmeans(d, k, niter=, seed=, spherical=True)`` as :func:`hil.retrieval.plaid.
train_centroids` calls it (``faiss/Clustering.cpp``, ``Clustering::train_encoded``):

1. *init*: ``k`` distinct training points drawn at random (seeded), L2-normalized;
2. ``niter`` times: every point goes to the centroid of largest inner product (ties: the lowest centroid number, as
   ``IndexFlatIP``); each centroid becomes the mean of its points (``compute_centroids``), empty clusters are
   re-seeded by splitting a large one (below), and every centroid is L2-normalized (``post_process_centroids``).

The objective FAISS reports for the spherical case is the sum over points of the largest inner product (higher is
better); the *inertia* compared with FAISS's in the tests is ``sum_i (1 - max_c x_i . c)``, the same number
counted from the other end (smaller is better, and a 1% bound on it is the stricter one).

Where it differs from FAISS, on purpose:

- *Random numbers*: numpy's generator seeded with ``seed`` (the same start on every device, CPU or GPU), not
  FAISS's ``rand_perm(seed + 1)``: the init points differ, so the local optimum does; the tests bound the inertia.
- *Empty clusters*: FAISS's ``split_clusters`` walks the clusters cyclically and takes cluster ``j`` with
  probability ``(n_j - 1) / (n - k)`` per step; here ``j`` is drawn once with probability proportional to
  ``n_j - 1`` (the same preference for large clusters). The rest is FAISS's: the empty centroid becomes a copy of
  ``j``'s, the two are pushed apart by the factors ``1 +- 1/1024`` on alternating coordinates, and ``j``'s count is
  shared between them for later draws of the same iteration.
- *Summation order* of the centroid sums (FAISS: point order per thread range; here torch's): the centroids agree
  to rounding.

Memory and speed: the (points x centroids) scores exist only in blocks of ``block_rows x block_centroids`` (by
default at most :data:`SCORE_BLOCK_ELEMENTS` fp32 values), so MS MARCO's 2^18 centroids never need an (n, k)
matrix; the products are fp32 at full precision (TF32 and reduced-precision CPU matmuls are switched off inside:
:func:`full_precision_matmul`), the points stay in their stored dtype (fp16) and are widened block by block. No
block reads a value back to the host: an iteration syncs once (the number of empty clusters). The centroid sums
are deterministic on both kinds of device (``index_add_`` on a CPU, ``index_put_(accumulate=True)`` on CUDA,
whose sort-based kernel is deterministic, unlike CUDA's atomic ``index_add_``), so a seed gives one result.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from hil.errors import UserError
from hil.retrieval.backends.configs import KMEANS_CHOICES
from hil.retrieval.devices import canonical_device, faiss_gpu_count

# fp32 scores held at once by nearest_centroids (128 MiB): the memory bound of the assignment, whatever n and k.
SCORE_BLOCK_ELEMENTS = 1 << 25
# Rows a score block keeps at least before the centroids are cut into blocks (k above SCORE_BLOCK / this).
_MIN_BLOCK_ROWS = 4096
# FAISS's split_clusters perturbation, "a bit above machine epsilon for float16".
_SPLIT_EPS = 1 / 1024


@dataclass(frozen=True)
class KMeansEngine:
    """Which k-means (and nearest-centroid assignment) a build runs, and where."""

    name: str                         # "faiss" or "torch": what index.json records under kmeans
    device: torch.device              # where torch runs (the CPU for FAISS)
    faiss_gpu: int | None = None      # the GPU faiss-gpu runs on (None: FAISS on the CPU)


FAISS_ON_CPU = KMeansEngine("faiss", torch.device("cpu"))


def check_kmeans_choice(value: object) -> str:
    if value not in KMEANS_CHOICES:
        raise UserError(f"PlaidIndexConfig.kmeans must be one of {', '.join(KMEANS_CHOICES)} (got {value!r})")
    return str(value)


def kmeans_engine(requested: str, device: torch.device | str = "cpu", *, use_gpu: bool = False,
                  gpu_device: int = 0) -> KMeansEngine:
    """The engine ``requested`` (``auto``, ``faiss``, ``torch``) means for a build whose encoder is on ``device``.

    The build's GPU is ``cuda:<gpu_device>`` when ``use_gpu`` (and torch sees it), else ``device`` when it is a CUDA
    device, else none. ``faiss``: FAISS, on that GPU where faiss-gpu sees it, else on the CPU. ``torch``: torch on
    that GPU, else on ``device``. ``auto``: faiss-gpu where it sees the build's GPU; else torch on that GPU; else
    FAISS on the CPU (fast on many cores, and the engine of every index built before this setting existed).
    Resolving a resolved name gives the same engine, so a build can resolve once and record the name.
    """
    requested = check_kmeans_choice(requested)
    device = canonical_device(device)
    gpu: torch.device | None = device if device.type == "cuda" else None
    if use_gpu and torch.cuda.is_available() and gpu_device < torch.cuda.device_count():
        gpu = torch.device("cuda", gpu_device)
    faiss_gpu = gpu.index if gpu is not None and requested != "torch" and gpu.index < faiss_gpu_count() else None
    if requested == "faiss" or (requested == "auto" and (faiss_gpu is not None or gpu is None)):
        return KMeansEngine("faiss", torch.device("cpu"), faiss_gpu)
    return KMeansEngine("torch", gpu if gpu is not None else device)


@contextlib.contextmanager
def full_precision_matmul() -> Iterator[None]:
    """fp32 matrix products at full precision for the duration (``torch.set_float32_matmul_precision("highest")``):
    a process that allowed TF32 (or bf16 on a CPU) for training would otherwise assign near-ties differently from
    FAISS's fp32 products. Restored after."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _block_sizes(n_centroids: int, block_rows: int | None, block_centroids: int | None) -> tuple[int, int]:
    """(rows, centroids) of one score block: the given sizes, else a budget of SCORE_BLOCK_ELEMENTS values."""
    centroids = min(n_centroids, block_centroids or max(1, SCORE_BLOCK_ELEMENTS // _MIN_BLOCK_ROWS))
    return block_rows or max(1, SCORE_BLOCK_ELEMENTS // centroids), centroids


def _nearest_in_block(rows: torch.Tensor, centroids: torch.Tensor, block_centroids: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (b, D) fp32, centroids (k, D) fp32 -> (codes (b,) int64, scores (b,) fp32), a running max over
    centroid blocks; a later block takes a row only with a strictly larger score (ties keep the lower number)."""
    best, code = None, None
    for first in range(0, len(centroids), block_centroids):
        scores = rows @ centroids[first: first + block_centroids].T  # (b, bc)
        value, index = scores.max(dim=1)  # ties: the first maximal index
        if best is None:
            best, code = value, index
            continue
        better = value > best
        best = torch.where(better, value, best)
        code = torch.where(better, index + first, code)
    return code, best


def nearest_centroids(points: torch.Tensor, centroids: torch.Tensor, *, block_rows: int | None = None,
                      block_centroids: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The centroid of largest inner product of every point, as FAISS's ``IndexFlatIP.search(points, 1)`` (ties:
    the lowest centroid number). points (n, D) in any float dtype, centroids (k, D), on one device -> (codes (n,)
    int64, scores (n,) float32), on that device. fp32 products in blocks (module docstring), no host sync."""
    n, n_centroids = len(points), len(centroids)
    block_rows, block_centroids = _block_sizes(n_centroids, block_rows, block_centroids)
    centroids = centroids.to(points.device, torch.float32)
    codes = torch.empty(n, dtype=torch.int64, device=points.device)
    scores = torch.empty(n, dtype=torch.float32, device=points.device)
    with full_precision_matmul():
        for start in range(0, n, block_rows):
            rows = points[start: start + block_rows].to(torch.float32)  # (b, D): fp16 widens exactly
            codes[start: start + len(rows)], scores[start: start + len(rows)] = _nearest_in_block(
                rows, centroids, block_centroids)
    return codes, scores


def _add_rows(sums: torch.Tensor, codes: torch.Tensor, rows: torch.Tensor) -> None:
    """``sums[codes[i]] += rows[i]`` for every i, deterministically: ``index_add_`` adds in index order on a CPU;
    on CUDA it uses atomics (order varies run to run), ``index_put_(accumulate=True)`` sorts instead (torch's
    ``use_deterministic_algorithms`` lists CUDA ``index_add`` as nondeterministic, CUDA ``index_put`` with
    ``accumulate`` as not)."""
    if sums.device.type == "cpu":
        sums.index_add_(0, codes, rows)
    else:
        sums.index_put_((codes,), rows, accumulate=True)


def cluster_means(points: torch.Tensor, codes: torch.Tensor, n_centroids: int, *, block_rows: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each cluster's mean (FAISS's ``compute_centroids``: the sum times ``1 / count``, fp32) and its count.
    points (n, D), codes (n,) -> (means (k, D) float32, zero for an empty cluster; counts (k,) int64)."""
    sums = torch.zeros(n_centroids, points.shape[1], dtype=torch.float32, device=points.device)
    for start in range(0, len(points), block_rows):
        _add_rows(sums, codes[start: start + block_rows], points[start: start + block_rows].to(torch.float32))
    counts = torch.bincount(codes, minlength=n_centroids)
    return sums * (1.0 / counts.clamp(min=1).to(torch.float32)).unsqueeze(1), counts


def split_pairs(counts: np.ndarray, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(empty cluster, cluster it splits) for every empty cluster, in ascending order of the empty ones: each draws
    a cluster with probability proportional to ``count - 1``, and the drawn count is then halved between the two
    (FAISS ``split_clusters``; module docstring). counts (k,) of a clustering of more points than clusters."""
    shares = counts.astype(np.float64)
    pairs = []
    for empty in np.flatnonzero(counts == 0):
        weights = np.maximum(shares - 1.0, 0.0)
        donor = int(rng.choice(len(shares), p=weights / weights.sum()))
        pairs.append((int(empty), donor))
        shares[empty] = shares[donor] / 2
        shares[donor] -= shares[empty]
    return pairs


def split_empty_clusters(means: torch.Tensor, counts: torch.Tensor, rng: np.random.Generator) -> int:
    """Re-seed every empty cluster of ``means`` (k, D) in place by splitting a large one (:func:`split_pairs`):
    the empty centroid becomes the donor's times ``1 + eps, 1 - eps, ...`` and the donor is multiplied by
    ``1 - eps, 1 + eps, ...`` (eps = 1/1024, FAISS's). -> the number of clusters split. One host sync (the count
    of empty clusters); the counts reach the host only when there is one."""
    n_empty = int((counts == 0).sum())
    if n_empty == 0:
        return 0
    pairs = split_pairs(counts.cpu().numpy(), rng)
    up = torch.ones(means.shape[1], dtype=means.dtype, device=means.device)
    up[0::2] += _SPLIT_EPS
    up[1::2] -= _SPLIT_EPS
    down = 2.0 - up  # 1 - eps where up is 1 + eps, and the reverse
    for empty, donor in pairs:  # in order: a later split may take an earlier one's centroid
        means[empty] = means[donor] * up
        means[donor] = means[donor] * down
    return len(pairs)


def l2_normalized(vectors: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit L2 norm, a zero row left zero (FAISS's ``fvec_renorm_L2``)."""
    norms = torch.linalg.vector_norm(vectors, dim=1, keepdim=True)
    return vectors * torch.where(norms > 0, 1.0 / norms, torch.zeros_like(norms))


@dataclass
class KMeansResult:
    """What :func:`spherical_kmeans` found."""

    centroids: torch.Tensor  # (k, D) float32, L2-normalized, on the points' device
    objective: list[float]   # per iteration, FAISS's obj: sum over points of the largest inner product
    n_split: list[int]       # per iteration, empty clusters re-seeded


def spherical_kmeans(points: torch.Tensor, n_centroids: int, *, niter: int, seed: int = 0,
                     init_centroids: torch.Tensor | None = None, block_rows: int | None = None,
                     block_centroids: int | None = None) -> KMeansResult:
    """Spherical k-means of ``points`` (n, D), any float dtype, on their device (see the module docstring).

    ``init_centroids`` (k, D): start from these (normalized) instead of ``k`` seeded distinct points, as FAISS's
    ``Kmeans.train(x, init_centroids=...)``. ``block_rows`` / ``block_centroids``: the score blocks (default: a
    budget of :data:`SCORE_BLOCK_ELEMENTS`); the result does not depend on them.
    """
    n, dim = points.shape
    if not 1 <= n_centroids <= n:
        raise ValueError(f"spherical_kmeans: n_centroids must lie in 1..{n} (the number of points), got {n_centroids}")
    if niter < 1:
        raise ValueError(f"spherical_kmeans: niter must be >= 1, got {niter}")
    if not bool(torch.isfinite(points).all()):
        raise ValueError("spherical_kmeans: the points hold NaN or inf")  # as FAISS refuses them
    rng = np.random.default_rng(seed)
    if init_centroids is None:
        first = torch.from_numpy(rng.choice(n, size=n_centroids, replace=False)).to(points.device)
        centroids = l2_normalized(points[first].to(torch.float32))
    else:
        centroids = l2_normalized(init_centroids.to(points.device, torch.float32))
    rows, _ = _block_sizes(n_centroids, block_rows, block_centroids)
    objectives, splits = [], []
    for _ in range(niter):
        codes, scores = nearest_centroids(points, centroids, block_rows=block_rows, block_centroids=block_centroids)
        objectives.append(scores.sum(dtype=torch.float64))  # kept on the device until the end
        means, counts = cluster_means(points, codes, n_centroids, block_rows=rows)
        splits.append(split_empty_clusters(means, counts, rng))
        centroids = l2_normalized(means)
    return KMeansResult(centroids, [float(value) for value in objectives], splits)


def spherical_inertia(points: torch.Tensor, centroids: torch.Tensor) -> float:
    """``sum_i (1 - max_c points_i . centroids_c)`` in fp64 (0 when every point is a centroid): what k-means
    lowers, for unit points and centroids."""
    _, scores = nearest_centroids(points, centroids)
    return float((1.0 - scores.to(torch.float64)).sum())
