"""Coarse-to-fine k-means and nearest-centroid assignment: PLAID's centroids and codes for large corpora on a CPU.

Exact assignment costs ``n * C * D`` multiply-adds: 209M tokens against 131,072 centroids at D = 128 is ~7 PFLOP,
days on two cores. Both halves of the index build are made coarse-to-fine here, in torch on any device:

*Training* (:func:`two_level_kmeans`), FAISS's recipe (``faiss/contrib/clustering.py two_level_clustering``):

1. *level 1*: spherical k-means (:func:`hil.retrieval.kmeans.spherical_kmeans`) into ``G = round(sqrt(C))``
   coarse clusters, on a seeded subsample of at most ``256 G`` points (FAISS's default
   ``max_points_per_centroid``; ``two_level_clustering`` passes 2000, we keep 256: the coarse centroids only
   partition the points, and level 2 sees every point); every point then goes to its nearest coarse centroid;
2. *rebalance*: the C fine centroids are shared out in proportion to the coarse clusters' point counts by FAISS's
   rule ``diff(cumsum(n_g) * C // n)`` (:func:`fine_centroid_counts`: exactly C in all, and never more than a
   cluster's points: the bound is proved there, so no clamp or redistribution is ever needed);
3. *level 2*: spherical k-means of each coarse cluster's points into its share, the seed derived from ``seed``
   and the cluster number (``numpy.random.SeedSequence((seed, 3 + g))``; streams 0, 1, 2 are the level-1 sample,
   level 1 and the refinement's splits). The fine centroids are stored cluster after cluster, so coarse cluster g
   owns the contiguous range ``group_offsets[g]: group_offsets[g + 1]``;
4. *refinement* (ours, off by default; not in FAISS's recipe): ``refine_niter`` iterations of k-means over all
   the points and all C centroids at once, each point assigned by :func:`coarse_nearest_centroids` (the level-2
   groups, ``refine_nprobe``) instead of exactly. Level 2 never lets a centroid take points across a coarse
   boundary; on blobs (tests) that costs ~4% of inertia against flat k-means, and 4 refinement iterations at
   nprobe 4 win back two thirds of it. A centroid keeps its row (and group) through the refinement.

The niter iterations run at both levels (FAISS: 25 at level 1, the caller's at level 2; ours: one setting). Work:
``n * (G + C / G) * D`` per iteration instead of ``n * C * D`` (2 * sqrt(C) instead of C products per point); a
refinement iteration ``n * (G + nprobe * C / G) * D``.

*Assignment* (:func:`coarse_nearest_centroids`): a coarse quantizer over any centroids (:func:`centroid_groups`,
k-means of the centroids themselves, or :meth:`CentroidGroups.from_two_level`); a point scores the G group
centroids (one product), probes its ``nprobe`` best groups (``torch.topk``) and takes the centroid of largest
inner product among their members (ties: the lowest centroid number, as :func:`~hil.retrieval.kmeans.
nearest_centroids` and FAISS's ``IndexFlatIP``). This is an IVF search (FAISS ``IndexIVFFlat``, ``nprobe``) whose
inverted lists hold centroids. Per block of rows the (row, group) probes are sorted by group and each group is one
matrix product of the rows probing it against its members (contiguous in a reordered copy of the centroids): G
products per block, no per-point work. A larger ``nprobe`` probes a superset of groups (``topk`` of k + 1
contains ``topk`` of k, ties among group scores aside), so agreement with exact assignment can only grow with it;
``nprobe >= G`` is exact.

Rounding: every product is fp32 at full precision (:func:`~hil.retrieval.kmeans.full_precision_matmul`), the
points widened from their stored dtype block by block. MKL (torch's CPU BLAS here) computes a matrix product with
fewer than 16 rows or columns by other kernels whose roundings differ from the large ones'; each product here is
padded with zero rows to at least :data:`MIN_PRODUCT_SIDE` on both sides, so a (point, centroid) score is the same
float whichever group, block or probe count computed it: equal centroids tie exactly, and with ``nprobe >= G`` the
scores equal :func:`~hil.retrieval.kmeans.nearest_centroids`'s bit for bit (whose own blocks are that large). On
another BLAS or a GPU they agree to rounding. Ties among group scores at the ``nprobe``-th place go as
``torch.topk`` takes them (it needs a point exactly as close to two group centroids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from hil.retrieval.devices import host_tensor
from hil.retrieval.kmeans import (
    SCORE_BLOCK_ELEMENTS,
    cluster_means,
    full_precision_matmul,
    l2_normalized,
    nearest_centroids,
    spherical_kmeans,
    split_empty_clusters,
)

# Both sides of every product padded to this many rows: MKL's kernels below it round differently (module docstring).
MIN_PRODUCT_SIDE = 16
# Level 1 trains on at most this many points per coarse centroid (FAISS's default max_points_per_centroid).
COARSE_POINTS_PER_CENTROID = 256
# Rows per block of coarse_nearest_centroids at most: G products per block, so blocks are large.
_MAX_BLOCK_ROWS = 1 << 16
# Rows of the memmap read at once by assign_codes_coarse (32 MiB of fp16 at D = 128).
_ASSIGN_BLOCK = 1 << 17
# Rows checked for NaN / inf at once (bounds the boolean temporary).
_CHECK_ROWS = 1 << 16


def _stream_seed(seed: int, stream: int) -> int:
    """An independent seed for random stream ``stream`` of the run seeded ``seed`` (numpy's SeedSequence)."""
    return int(np.random.SeedSequence((seed, stream)).generate_state(1)[0])


def _check_finite(points: torch.Tensor, caller: str) -> None:
    for start in range(0, len(points), _CHECK_ROWS):
        if not bool(torch.isfinite(points[start: start + _CHECK_ROWS]).all()):
            raise ValueError(f"{caller}: the points hold NaN or inf")


def _product(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``rows @ cols.T``: rows (m, D), cols (k, D) fp32 -> (m, k) fp32, each side padded with zero rows to at least
    MIN_PRODUCT_SIDE first (the large kernels' rounding, whatever m and k: module docstring)."""
    m, k = len(rows), len(cols)
    if m < MIN_PRODUCT_SIDE:
        rows = torch.cat([rows, rows.new_zeros(MIN_PRODUCT_SIDE - m, rows.shape[1])])
    if k < MIN_PRODUCT_SIDE:
        cols = torch.cat([cols, cols.new_zeros(MIN_PRODUCT_SIDE - k, cols.shape[1])])
    return (rows @ cols.T)[:m, :k]


# -- training -----------------------------------------------------------------------------------------------------

def fine_centroid_counts(cluster_sizes: np.ndarray, n_centroids: int) -> np.ndarray:
    """How many of ``n_centroids`` fine centroids each coarse cluster gets: FAISS's rebalance
    (``two_level_clustering``), ``e_g = S_g * C // n`` with ``S_g`` the cumulative sizes, and cluster g gets
    ``e_g - e_{g-1}``. cluster_sizes (G,) -> (G,) int64, summing to exactly C (``e_G = C``).

    Never more than a cluster's points when ``C <= n``: with ``a = S_{g-1} C / n`` and ``b = n_g C / n <= n_g``,
    ``floor(a + b) - floor(a) < b + 1``, an integer, so at most ``ceil(b) <= n_g``; and at least
    ``floor(b)``. So the rule needs no clamp (an empty cluster gets none; one with fewer than n / C points may get
    none, as in FAISS: its points are then served by the neighbouring clusters' centroids).
    """
    sizes = np.asarray(cluster_sizes, dtype=np.int64)
    n = int(sizes.sum())
    if (sizes < 0).any() or not 1 <= n_centroids <= n:
        raise ValueError(f"fine_centroid_counts: n_centroids must lie in 1..{n} (the points), got {n_centroids}")
    return np.diff(np.cumsum(sizes) * n_centroids // n, prepend=0)


@dataclass
class TwoLevelKMeans:
    """What :func:`two_level_kmeans` found."""

    centroids: torch.Tensor      # (C, D) float32, L2-normalized; coarse cluster g's are rows offsets[g]: offsets[g+1]
    coarse: torch.Tensor         # (G, D) float32, L2-normalized: the level-1 centroids
    group_offsets: torch.Tensor  # (G + 1,) int64, on the host
    cluster_sizes: torch.Tensor  # (G,) int64, on the host: the points of each coarse cluster

    @property
    def n_centroids(self) -> int:
        return int(self.centroids.shape[0])


def two_level_kmeans(points: torch.Tensor, n_centroids: int, *, niter: int, seed: int = 0,
                     n_coarse: int | None = None, coarse_points_per_centroid: int = COARSE_POINTS_PER_CENTROID,
                     refine_niter: int = 0, refine_nprobe: int = 4,
                     on_cluster: Callable[[int], None] | None = None) -> TwoLevelKMeans:
    """Spherical k-means of ``points`` (n, D), any float dtype, on their device, coarse to fine (module docstring):
    ``n_coarse`` (default ``round(sqrt(C))``) coarse clusters, then each one's share of the ``n_centroids`` fine
    ones, then ``refine_niter`` iterations over all of them with coarse assignment. Deterministic for a seed. The
    points stay in their dtype: only gathered clusters and blocks are widened. ``on_cluster(1)`` is called after
    level 1 and after each coarse cluster of level 2 (``n_coarse + 1`` calls in all: a progress bar's steps).
    """
    if points.dim() != 2:
        raise ValueError(f"two_level_kmeans: points must be (n, D), got shape {tuple(points.shape)}")
    n = len(points)
    if not 1 <= n_centroids <= n:
        raise ValueError(f"two_level_kmeans: n_centroids must lie in 1..{n} (the points), got {n_centroids}")
    if niter < 1:
        raise ValueError(f"two_level_kmeans: niter must be >= 1, got {niter}")
    n_coarse = max(1, round(n_centroids ** 0.5)) if n_coarse is None else n_coarse
    if not 1 <= n_coarse <= n_centroids:
        raise ValueError(f"two_level_kmeans: n_coarse must lie in 1..{n_centroids} (n_centroids), got {n_coarse}")
    if coarse_points_per_centroid < 1:
        raise ValueError(f"two_level_kmeans: coarse_points_per_centroid must be >= 1, got {coarse_points_per_centroid}")
    if refine_niter < 0 or refine_nprobe < 1:
        raise ValueError(f"two_level_kmeans: refine_niter must be >= 0 and refine_nprobe >= 1, got {refine_niter} "
                         f"and {refine_nprobe}")
    _check_finite(points, "two_level_kmeans")
    n_sample = min(n, coarse_points_per_centroid * n_coarse)
    sample = points
    if n_sample < n:
        rows = np.sort(np.random.default_rng(_stream_seed(seed, 0)).choice(n, size=n_sample, replace=False))
        sample = points[torch.from_numpy(rows).to(points.device)]  # (S, D), the stored dtype
    coarse = spherical_kmeans(sample, n_coarse, niter=niter, seed=_stream_seed(seed, 1)).centroids
    del sample
    step = on_cluster or (lambda done: None)
    coarse_codes, _ = nearest_centroids(points, coarse)  # (n,)
    order = torch.argsort(coarse_codes, stable=True)      # points cluster after cluster
    sizes = torch.bincount(coarse_codes, minlength=n_coarse).cpu()
    del coarse_codes
    counts = fine_centroid_counts(sizes.numpy(), n_centroids)
    step(1)
    fine, start = [], 0
    for group, (size, count) in enumerate(zip(sizes.tolist(), counts.tolist())):
        members = order[start: start + size]
        start += size
        if count:
            fine.append(spherical_kmeans(points[members], count, niter=niter,
                                         seed=_stream_seed(seed, 3 + group)).centroids)
        step(1)
    offsets = torch.zeros(n_coarse + 1, dtype=torch.int64)
    torch.cumsum(torch.from_numpy(counts), 0, out=offsets[1:])
    result = TwoLevelKMeans(torch.cat(fine), coarse, offsets, sizes)
    if refine_niter:
        result.centroids = _refined(points, result, refine_niter, refine_nprobe, np.random.default_rng(
            _stream_seed(seed, 2)))
    return result


def _refined(points: torch.Tensor, result: TwoLevelKMeans, niter: int, nprobe: int, rng: np.random.Generator
             ) -> torch.Tensor:
    """k-means iterations from ``result.centroids`` (C, D) over ``points`` (n, D), each point assigned by
    :func:`coarse_nearest_centroids` (the level-2 groups); empty clusters split as in spherical_kmeans."""
    groups, centroids = CentroidGroups.from_two_level(result), result.centroids
    for _ in range(niter):
        codes, _ = coarse_nearest_centroids(points, centroids, groups, nprobe=nprobe)
        means, counts = cluster_means(points, codes, len(centroids), block_rows=_CHECK_ROWS)
        split_empty_clusters(means, counts, rng)
        centroids = l2_normalized(means)
    return centroids


# -- the coarse quantizer over centroids --------------------------------------------------------------------------

@dataclass(frozen=True)
class CentroidGroups:
    """A partition of C centroids into G non-empty groups, each with a group centroid: group g's members are the
    centroid numbers ``members[offsets[g]: offsets[g + 1]]``, ascending."""

    group_centroids: torch.Tensor  # (G, D) float32
    members: torch.Tensor          # (C,) int64, a permutation of 0..C-1, sorted by group
    offsets: torch.Tensor          # (G + 1,) int64, strictly increasing from 0 to C (no empty group)

    def __post_init__(self) -> None:
        offsets, n = self.offsets.cpu(), len(self.members)
        if len(offsets) != len(self.group_centroids) + 1 or int(offsets[0]) != 0 or int(offsets[-1]) != n:
            raise ValueError(f"CentroidGroups: offsets must run from 0 to {n} over {len(self.group_centroids)} "
                             "groups")
        if not bool((offsets[1:] > offsets[:-1]).all()):
            raise ValueError("CentroidGroups: every group needs a member")
        if not torch.equal(torch.sort(self.members.cpu()).values, torch.arange(n)):
            raise ValueError("CentroidGroups: members must be a permutation of the centroid numbers")

    @property
    def n_groups(self) -> int:
        return int(self.group_centroids.shape[0])

    @classmethod
    def from_two_level(cls, result: TwoLevelKMeans) -> CentroidGroups:
        """The groups of a :func:`two_level_kmeans` result: coarse cluster g, its centroid, and its fine centroids
        (already contiguous), the clusters that got no fine centroid left out."""
        offsets = result.group_offsets.cpu()
        kept = offsets[1:] > offsets[:-1]
        return cls(result.coarse.to(torch.float32)[kept.to(result.coarse.device)],
                   torch.arange(result.n_centroids, dtype=torch.int64), torch.cat([offsets[:1], offsets[1:][kept]]))


def groups_of(group_codes: torch.Tensor, group_centroids: torch.Tensor) -> CentroidGroups:
    """The groups given each centroid's group number: group_codes (C,) int64 in 0..G-1, group_centroids (G, D)
    -> CentroidGroups, the groups without a member left out."""
    group_codes = group_codes.cpu()
    members = torch.argsort(group_codes, stable=True)  # by group, ascending within one
    sizes = torch.bincount(group_codes, minlength=len(group_centroids))
    kept = sizes > 0
    offsets = torch.zeros(int(kept.sum()) + 1, dtype=torch.int64)
    torch.cumsum(sizes[kept], 0, out=offsets[1:])
    return CentroidGroups(group_centroids.to(torch.float32)[kept.to(group_centroids.device)], members, offsets)


def centroid_groups(centroids: torch.Tensor, *, n_groups: int | None = None, niter: int = 10,
                    seed: int = 0) -> CentroidGroups:
    """A coarse quantizer over any centroids (C, D): spherical k-means of the centroids into ``n_groups`` (default
    ``round(sqrt(C))``) groups, each centroid a member of the group of its nearest group centroid (ties: the
    lowest group), groups left without a member dropped."""
    n_groups = max(1, round(len(centroids) ** 0.5)) if n_groups is None else n_groups
    table = centroids.to(torch.float32)
    group_centroids = spherical_kmeans(table, n_groups, niter=niter, seed=seed).centroids
    codes, _ = nearest_centroids(table, group_centroids)
    return groups_of(codes, group_centroids)


# -- coarse assignment --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Probe:
    """CentroidGroups ready for a search on one device."""

    group_centroids: torch.Tensor  # (G, D) float32
    table: torch.Tensor            # (C, D) float32: centroids[members], each group's members contiguous
    members: torch.Tensor          # (C,) int64
    offsets: list[int]             # (G + 1,) on the host


def _probe(centroids: torch.Tensor, groups: CentroidGroups, device: torch.device) -> _Probe:
    if centroids.dim() != 2 or len(centroids) != len(groups.members):
        raise ValueError(f"coarse assignment: {len(groups.members)} grouped centroids, got centroids of shape "
                         f"{tuple(centroids.shape)}")
    if groups.group_centroids.shape[1] != centroids.shape[1]:
        raise ValueError(f"coarse assignment: group centroids of dimension {groups.group_centroids.shape[1]}, "
                         f"centroids of dimension {centroids.shape[1]}")
    members = groups.members.to(device)
    table = centroids.to(device, torch.float32)[members]
    return _Probe(groups.group_centroids.to(device, torch.float32), table, members, groups.offsets.tolist())


def _nearest_in_probed_groups(rows: torch.Tensor, probe: _Probe, nprobe: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (b, D) fp32 -> (codes (b,) int64, scores (b,) fp32): the best member of each row's nprobe best groups."""
    b = len(rows)
    probes = _product(rows, probe.group_centroids).topk(nprobe, dim=1).indices.reshape(-1)  # (b * p,)
    order = torch.argsort(probes, stable=True)    # the probes group after group
    probe_rows = order // nprobe                  # the row of each sorted probe
    sizes = torch.bincount(probes, minlength=len(probe.offsets) - 1).tolist()
    values = torch.empty(b * nprobe, dtype=torch.float32, device=rows.device)
    places = torch.empty(b * nprobe, dtype=torch.int64, device=rows.device)  # rows of probe.table
    start = 0
    for group, size in enumerate(sizes):
        if size:
            first, last = probe.offsets[group], probe.offsets[group + 1]
            best, index = _product(rows[probe_rows[start: start + size]], probe.table[first: last]).max(dim=1)
            values[start: start + size], places[start: start + size] = best, index + first  # ties: lowest member
            start += size
    scores = torch.empty_like(values)
    scores[order] = values                        # back to (row, probe) order
    codes = torch.empty_like(places)
    codes[order] = probe.members[places]
    scores, codes = scores.view(b, nprobe), codes.view(b, nprobe)
    best = scores.max(dim=1).values
    tied = torch.where(scores == best.unsqueeze(1), codes, torch.full_like(codes, len(probe.members)))
    return tied.min(dim=1).values, best           # ties across groups: the lowest centroid number


def _assign(points: torch.Tensor, probe: _Probe, nprobe: int, block_rows: int | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    if nprobe < 1:
        raise ValueError(f"coarse assignment: nprobe must be >= 1, got {nprobe}")
    if points.dim() != 2 or points.shape[1] != probe.table.shape[1]:
        raise ValueError(f"coarse assignment: points must be (n, {probe.table.shape[1]}), got "
                         f"{tuple(points.shape)}")
    nprobe = min(nprobe, len(probe.offsets) - 1)
    block_rows = block_rows or max(1024, min(_MAX_BLOCK_ROWS, SCORE_BLOCK_ELEMENTS // len(probe.group_centroids)))
    codes = torch.empty(len(points), dtype=torch.int64, device=points.device)
    scores = torch.empty(len(points), dtype=torch.float32, device=points.device)
    with full_precision_matmul():
        for start in range(0, len(points), block_rows):
            rows = points[start: start + block_rows].to(torch.float32)  # (b, D): fp16 widens exactly
            if not bool(torch.isfinite(rows).all()):
                raise ValueError("coarse assignment: the points hold NaN or inf")
            codes[start: start + len(rows)], scores[start: start + len(rows)] = _nearest_in_probed_groups(
                rows, probe, nprobe)
    return codes, scores


def coarse_nearest_centroids(points: torch.Tensor, centroids: torch.Tensor, groups: CentroidGroups, *,
                             nprobe: int, block_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For each point, the centroid of largest inner product among the members of its ``nprobe`` best groups (by
    ``point . group centroid``); ties: the lowest centroid number. points (n, D) any float dtype, centroids (C, D)
    -> (codes (n,) int64, scores (n,) float32) on the points' device. ``nprobe >= G``: :func:`~hil.retrieval.
    kmeans.nearest_centroids`'s result. ``block_rows`` (default: 2^16, fewer for G above 512) does not change it.
    """
    return _assign(points, _probe(centroids, groups, points.device), nprobe, block_rows)


def _code_dtype(n_centroids: int) -> np.dtype:
    """:func:`hil.retrieval.plaid.code_dtype`'s rule, written again: plaid imports this module, not the reverse."""
    return np.dtype(np.uint16) if n_centroids <= 1 << 16 else np.dtype(np.int32)


def assign_codes_coarse(embeddings: np.ndarray, centroids: np.ndarray, groups: CentroidGroups, *, nprobe: int,
                        out: np.ndarray | None = None, block_tokens: int | None = None,
                        block_rows: int | None = None, device: torch.device | str = "cpu") -> np.ndarray:
    """:func:`coarse_nearest_centroids` of every token, as :func:`hil.retrieval.plaid.assign_codes`: embeddings
    (n_tokens, D) fp16 / fp32 (a memmap is fine) read ``block_tokens`` rows at a time (default 2^17) and copied to
    ``device``; centroids (C, D) -> (n_tokens,) codes of ``plaid.code_dtype(C)``, written into ``out`` if given."""
    n_tokens = embeddings.shape[0]
    codes = out if out is not None else np.empty(n_tokens, dtype=_code_dtype(len(centroids)))
    if len(codes) != n_tokens:
        raise ValueError(f"assign_codes_coarse: out holds {len(codes)} codes for {n_tokens} tokens")
    device = torch.device(device)
    probe = _probe(host_tensor(np.asarray(centroids), np.float32), groups, device)
    block_tokens = block_tokens or _ASSIGN_BLOCK
    for start in range(0, n_tokens, block_tokens):
        block = host_tensor(embeddings[start: start + block_tokens]).to(device)
        nearest, _ = _assign(block, probe, nprobe, block_rows)
        codes[start: start + len(block)] = nearest.cpu().numpy()
    return codes


def agreement(codes_a: np.ndarray | torch.Tensor, codes_b: np.ndarray | torch.Tensor) -> float:
    """The share of positions where two code arrays (n,) agree."""
    a = codes_a.cpu().numpy() if isinstance(codes_a, torch.Tensor) else np.asarray(codes_a)
    b = codes_b.cpu().numpy() if isinstance(codes_b, torch.Tensor) else np.asarray(codes_b)
    if a.shape != b.shape or a.ndim != 1 or len(a) == 0:
        raise ValueError(f"agreement: two non-empty code arrays of one length, got shapes {a.shape} and {b.shape}")
    return float(np.mean(a.astype(np.int64) == b.astype(np.int64)))
