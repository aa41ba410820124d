"""Coarse-to-fine k-means and nearest-centroid assignment (hil.retrieval.two_level) against numpy loops, brute force
and hand computations: exact when every group is probed, the best member of the probed groups otherwise, ties to
the lowest centroid number, FAISS's rebalance rule, and the inertia of two-level against flat k-means.

Data: clustered synthetic unit vectors (blobs, as tests/test_kmeans.py) and small hand-made vectors whose products
are exact in binary (ties that hold on any BLAS).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hil.retrieval.kmeans import nearest_centroids, spherical_kmeans
from hil.retrieval.two_level import (
    CentroidGroups,
    agreement,
    assign_codes_coarse,
    centroid_groups,
    coarse_nearest_centroids,
    fine_centroid_counts,
    groups_of,
    two_level_kmeans,
)


def unit_rows(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def blobs(n: int, dim: int, n_blobs: int, spread: float, seed: int) -> np.ndarray:
    """``n`` unit vectors around ``n_blobs`` random unit directions (Gaussian noise of ``spread`` per coordinate)."""
    rng = np.random.default_rng(seed)
    centers = unit_rows(rng.standard_normal((n_blobs, dim)))
    return unit_rows(centers[rng.integers(0, n_blobs, n)] + spread * rng.standard_normal((n, dim)))


def numpy_inertia(x: np.ndarray, centroids: np.ndarray) -> float:
    """``sum_i (1 - max_c x_i . c)`` in float64, by brute force."""
    return float((1.0 - (x.astype(np.float64) @ centroids.astype(np.float64).T).max(axis=1)).sum())


def probed_best(points: np.ndarray, centroids: np.ndarray, groups: CentroidGroups, nprobe: int) -> np.ndarray:
    """The reference, point by point: rank the groups by ``x . group centroid`` (float64), walk the members of the
    ``nprobe`` best, keep the largest ``x . c`` (ties: the lower centroid number)."""
    group_centroids = groups.group_centroids.numpy().astype(np.float64)
    members, offsets = groups.members.numpy(), groups.offsets.numpy()
    codes = []
    for x in points.astype(np.float64):
        probed = np.argsort(-(group_centroids @ x), kind="stable")[:nprobe]
        best, code = -np.inf, -1
        for group in probed:
            for c in members[offsets[group]: offsets[group + 1]]:
                score = float(centroids[c].astype(np.float64) @ x)
                if score > best or (score == best and c < code):
                    best, code = score, int(c)
        codes.append(code)
    return np.array(codes)


@pytest.fixture(scope="module")
def trained():
    """Blobs, 256 centroids by two-level k-means (16 coarse clusters), and the two kinds of groups over them."""
    x = blobs(20000, 32, 300, 0.25, 0)
    result = two_level_kmeans(torch.from_numpy(x), 256, niter=10, seed=0)
    return x, result, {"from_two_level": CentroidGroups.from_two_level(result),
                       "centroid_groups": centroid_groups(result.centroids, seed=1)}


# -- coarse assignment --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["from_two_level", "centroid_groups"])
def test_probing_every_group_is_nearest_centroids(trained, kind):
    x, result, groups = trained[0], trained[1], trained[2][kind]
    points = torch.from_numpy(x[:3000])
    codes, scores = coarse_nearest_centroids(points, result.centroids, groups, nprobe=groups.n_groups)
    exact_codes, exact_scores = nearest_centroids(points, result.centroids)
    assert torch.equal(codes, exact_codes)
    assert torch.equal(scores, exact_scores)  # bit for bit: every product on MKL's large kernels (module docstring)


def test_probing_every_group_ties_duplicated_centroids_like_nearest_centroids():
    """Blob centroids, a third of them duplicated at higher numbers into *other* groups (and some within the same
    group): equal vectors score equally whichever product computed them, so the lower number wins, as exactly."""
    rng = np.random.default_rng(4)
    base = blobs(120, 16, 10, 0.3, 2)
    copies = rng.choice(120, 40, replace=False)
    centroids = torch.from_numpy(np.concatenate([base, base[copies], base[copies[:5]]]))  # (165, 16)
    group_codes = np.concatenate([np.arange(120) % 7, (np.arange(40) + 3) % 7,
                                  (copies[:5] % 7 + 3) % 7]).astype(np.int64)  # the copies' groups differ
    group_centroids = torch.from_numpy(unit_rows(rng.standard_normal((7, 16))))
    groups = groups_of(torch.from_numpy(group_codes), group_centroids)
    points = torch.from_numpy(np.concatenate([blobs(500, 16, 10, 0.3, 3), base[copies]]))  # some points = a centroid
    codes, scores = coarse_nearest_centroids(points, centroids, groups, nprobe=7)
    exact_codes, exact_scores = nearest_centroids(points, centroids)
    assert (exact_codes < 120).all()  # the duplicates never win
    assert torch.equal(codes, exact_codes)
    assert torch.equal(scores, exact_scores)


@pytest.mark.parametrize("nprobe", [1, 2, 3])
@pytest.mark.parametrize("kind", ["from_two_level", "centroid_groups"])
def test_small_nprobe_is_the_best_member_of_the_probed_groups(trained, kind, nprobe):
    x, result, groups = trained[0], trained[1], trained[2][kind]
    points = x[5000:5300]
    codes, scores = coarse_nearest_centroids(torch.from_numpy(points), result.centroids, groups, nprobe=nprobe)
    reference = probed_best(points, result.centroids.numpy(), groups, nprobe)
    np.testing.assert_array_equal(codes.numpy(), reference)
    best = np.einsum("nd,nd->n", points.astype(np.float64), result.centroids.numpy()[reference].astype(np.float64))
    np.testing.assert_allclose(scores.numpy(), best, atol=1e-6)


def test_ties_go_to_the_lowest_centroid_number_across_and_within_groups():
    """Exact products: group 0 holds centroids {1, 2}, group 1 holds {0, 3, 4}; 0 = 2 and 1 = 3 = 4 as vectors."""
    centroids = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    groups = CentroidGroups(torch.tensor([[1.0, 0.25], [0.25, 1.0]]), torch.tensor([1, 2, 0, 3, 4]),
                            torch.tensor([0, 2, 5]))
    points = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    one, _ = coarse_nearest_centroids(points, centroids, groups, nprobe=1)
    assert one.tolist() == [2, 3]  # within one group: (1, 0) probes group 0 (2 of {1, 2}), (0, 1) group 1 (3 = 4)
    both, _ = coarse_nearest_centroids(points, centroids, groups, nprobe=2)
    assert both.tolist() == [0, 1]  # across groups: 0 (group 1) before 2 (group 0), 1 (group 0) before 3 and 4
    assert both.tolist() == nearest_centroids(points, centroids)[0].tolist()


@pytest.mark.parametrize("kind, at_4", [("from_two_level", 0.95), ("centroid_groups", 0.9)])
def test_agreement_with_exact_is_high_and_grows_with_nprobe(trained, kind, at_4):
    """Flat blobs (no nesting for the groups to follow), 16 groups: measured 0.74 / 0.86 / 0.96 / 0.996 at nprobe
    1 / 2 / 4 / 8 for the two-level groups, 0.60 / 0.78 / 0.91 / 0.98 for k-means groups of the centroids."""
    x, result, groups = trained[0], trained[1], trained[2][kind]
    points = torch.from_numpy(x[:8000])
    exact, _ = nearest_centroids(points, result.centroids)
    shares = [agreement(coarse_nearest_centroids(points, result.centroids, groups, nprobe=p)[0], exact)
              for p in (1, 2, 4, 8, groups.n_groups)]
    assert shares == sorted(shares)
    assert shares[2] >= at_4 and shares[3] >= 0.975
    assert shares[-1] == 1.0


@pytest.mark.parametrize("block_rows", [7, 100, 4096])
def test_blocks_do_not_change_the_result(trained, block_rows):
    x, result, groups = trained[0], trained[1], trained[2]["centroid_groups"]
    points = torch.from_numpy(x[:1000])
    whole = coarse_nearest_centroids(points, result.centroids, groups, nprobe=3)
    blocked = coarse_nearest_centroids(points, result.centroids, groups, nprobe=3, block_rows=block_rows)
    assert torch.equal(whole[0], blocked[0])
    assert torch.equal(whole[1], blocked[1])


def test_fp16_points_give_the_codes_of_their_fp32_widening(trained):
    x, result, groups = trained[0], trained[1], trained[2]["from_two_level"]
    half = torch.from_numpy(x[:2000]).to(torch.float16)
    codes16, scores16 = coarse_nearest_centroids(half, result.centroids, groups, nprobe=2)
    codes32, scores32 = coarse_nearest_centroids(half.to(torch.float32), result.centroids, groups, nprobe=2)
    assert torch.equal(codes16, codes32)
    assert torch.equal(scores16, scores32)


def test_assign_codes_coarse_blocks_a_memmap_into_the_codes(trained, tmp_path):
    x, result, groups = trained[0], trained[1], trained[2]["from_two_level"]
    stored = np.lib.format.open_memmap(tmp_path / "tokens.npy", mode="w+", dtype=np.float16, shape=(3000, 32))
    stored[:] = x[:3000]
    out = np.lib.format.open_memmap(tmp_path / "codes.npy", mode="w+", dtype=np.uint16, shape=(3000,))
    codes = assign_codes_coarse(stored, result.centroids.numpy(), groups, nprobe=2, block_tokens=700, out=out)
    expected, _ = coarse_nearest_centroids(torch.from_numpy(np.asarray(stored)), result.centroids, groups, nprobe=2)
    assert codes is out
    np.testing.assert_array_equal(out, expected.numpy())
    assert assign_codes_coarse(stored, result.centroids.numpy(), groups, nprobe=2).dtype == np.uint16


def test_assign_codes_coarse_holds_numbers_above_65536():
    """Above 2^16 centroids the codes are int32 (plaid.code_dtype's rule); arbitrary groups, exact with all probed."""
    rng = np.random.default_rng(7)
    centroids = unit_rows(rng.standard_normal((70000, 4)))
    groups = groups_of(torch.arange(70000) % 64, torch.from_numpy(unit_rows(rng.standard_normal((64, 4)))))
    points = unit_rows(rng.standard_normal((50, 4)))
    codes = assign_codes_coarse(points, centroids, groups, nprobe=64)
    assert codes.dtype == np.int32
    np.testing.assert_array_equal(codes, (points.astype(np.float64) @ centroids.astype(np.float64).T).argmax(1))


# -- the groups ---------------------------------------------------------------------------------------------------

def test_centroid_groups_put_each_centroid_in_its_nearest_group(trained):
    centroids = trained[1].centroids.numpy()
    groups = centroid_groups(trained[1].centroids, n_groups=12, seed=3)
    members, offsets = groups.members.numpy(), groups.offsets.numpy()
    assert sorted(members.tolist()) == list(range(len(centroids)))
    nearest = (centroids.astype(np.float64) @ groups.group_centroids.numpy().astype(np.float64).T).argmax(1)
    for group in range(groups.n_groups):
        own = members[offsets[group]: offsets[group + 1]]
        assert len(own) > 0 and (np.diff(own) > 0).all()
        assert (nearest[own] == group).all()


def test_groups_from_two_level_are_the_coarse_clusters(trained):
    result, groups = trained[1], trained[2]["from_two_level"]
    assert torch.equal(groups.members, torch.arange(256))
    assert torch.equal(groups.offsets, result.group_offsets)  # no coarse cluster without a fine centroid here
    assert torch.equal(groups.group_centroids, result.coarse)


def test_groups_without_members_are_left_out():
    groups = groups_of(torch.tensor([2, 0, 2, 2]), torch.eye(3))
    assert groups.members.tolist() == [1, 0, 2, 3] and groups.offsets.tolist() == [0, 1, 4]
    assert torch.equal(groups.group_centroids, torch.eye(3)[[0, 2]])


# -- two-level k-means --------------------------------------------------------------------------------------------

def test_fine_centroid_counts_by_hand():
    # cumulative sizes 5, 6, 10 -> 5 * 5 // 10, 6 * 5 // 10, 10 * 5 // 10 = 2, 3, 5 -> 2, 1, 2
    assert fine_centroid_counts(np.array([5, 1, 4]), 5).tolist() == [2, 1, 2]
    assert fine_centroid_counts(np.array([3, 0, 9]), 12).tolist() == [3, 0, 9]  # C = n: every point a centroid


def test_fine_centroid_counts_sum_to_c_never_pass_a_clusters_points_and_stay_proportional():
    rng = np.random.default_rng(0)
    for _ in range(300):
        sizes = rng.integers(0, 4, rng.integers(1, 40)) * rng.integers(1, 50, 1) + (rng.random() < 0.5)
        sizes[rng.integers(0, len(sizes))] += rng.integers(0, 3)  # tiny, empty and large clusters
        n = int(sizes.sum())
        if n == 0:
            continue
        c = int(rng.integers(1, n + 1))
        counts = fine_centroid_counts(sizes, c)
        assert counts.sum() == c
        assert (counts >= 0).all() and (counts <= sizes).all()
        assert (np.abs(counts - sizes * c / n) < 1).all()


def test_two_level_kmeans_structure():
    x = blobs(6000, 16, 80, 0.3, 1)
    result = two_level_kmeans(torch.from_numpy(x), 200, niter=5, seed=2, n_coarse=9)
    offsets, sizes = result.group_offsets.numpy(), result.cluster_sizes.numpy()
    assert result.centroids.shape == (200, 16) and result.coarse.shape == (9, 16)
    np.testing.assert_allclose(np.linalg.norm(result.centroids.numpy(), axis=1), 1.0, atol=1e-6)
    assert offsets[0] == 0 and offsets[-1] == 200 and (np.diff(offsets) >= 0).all()
    coarse_codes = (x.astype(np.float64) @ result.coarse.numpy().astype(np.float64).T).argmax(1)
    np.testing.assert_array_equal(sizes, np.bincount(coarse_codes, minlength=9))  # every point, nearest coarse
    assert (np.diff(offsets) <= sizes).all()
    np.testing.assert_array_equal(np.diff(offsets), fine_centroid_counts(sizes, 200))
    for group in range(9):  # a cluster's fine centroids are nearer its own points than the other clusters' are
        own = x[coarse_codes == group]
        mine = result.centroids.numpy()[offsets[group]: offsets[group + 1]]
        others = np.delete(result.centroids.numpy(), np.arange(offsets[group], offsets[group + 1]), axis=0)
        assert numpy_inertia(own, mine) < numpy_inertia(own, others)


def test_two_level_kmeans_reports_level_one_then_each_coarse_cluster():
    x = torch.from_numpy(blobs(3000, 16, 40, 0.3, 3))
    steps = []
    quiet = two_level_kmeans(x, 60, niter=3, seed=1, n_coarse=7)
    loud = two_level_kmeans(x, 60, niter=3, seed=1, n_coarse=7, on_cluster=steps.append)
    assert steps == [1] * 8, "level 1, then the 7 coarse clusters of level 2"
    assert torch.equal(quiet.centroids, loud.centroids), "progress changes nothing"


def test_two_level_kmeans_is_seeded():
    x = torch.from_numpy(blobs(4000, 16, 60, 0.3, 2))
    first = two_level_kmeans(x, 64, niter=4, seed=5)
    again = two_level_kmeans(x, 64, niter=4, seed=5)
    other = two_level_kmeans(x, 64, niter=4, seed=6)
    assert torch.equal(first.centroids, again.centroids) and torch.equal(first.group_offsets, again.group_offsets)
    assert not torch.equal(first.centroids, other.centroids)


def test_level_two_is_spherical_kmeans_of_each_coarse_cluster_seeded_by_seed_and_cluster():
    """The documented recipe, cluster by cluster: the points nearest coarse centroid g (in their order), k-means
    into g's share, seed ``SeedSequence((seed, 3 + g))``; level 1 (no subsample at this size) seeded by the seed."""
    x = blobs(1500, 16, 40, 0.3, 6)  # at most 256 G points: level 1 sees them all
    result = two_level_kmeans(torch.from_numpy(x), 49, niter=3, seed=8)
    assert not torch.equal(result.coarse, two_level_kmeans(torch.from_numpy(x), 49, niter=3, seed=9).coarse)
    coarse_codes = (x.astype(np.float64) @ result.coarse.numpy().astype(np.float64).T).argmax(1)
    offsets = result.group_offsets.numpy()
    for group in range(len(offsets) - 1):
        share = offsets[group + 1] - offsets[group]
        if share:
            seed = int(np.random.SeedSequence((8, 3 + group)).generate_state(1)[0])
            expected = spherical_kmeans(torch.from_numpy(x[coarse_codes == group]), int(share), niter=3, seed=seed)
            assert torch.equal(result.centroids[offsets[group]: offsets[group + 1]], expected.centroids)


def test_level_one_samples_across_the_whole_input():
    """Points stored blob after blob (as tokens are stored document after document): the level-1 sample must be
    drawn from all of them, so the coarse centroids cover every blob as well as for shuffled points."""
    rng = np.random.default_rng(2)
    centers = unit_rows(rng.standard_normal((40, 16)))
    labels = np.sort(rng.integers(0, 40, 20000))
    x = unit_rows(centers[labels] + 0.2 * rng.standard_normal((20000, 16)))  # sorted by blob
    shuffled = rng.permutation(20000)
    stored = two_level_kmeans(torch.from_numpy(x), 64, niter=5, seed=0).coarse.numpy()  # 8 coarse, 2048 sampled
    mixed = two_level_kmeans(torch.from_numpy(x[shuffled]), 64, niter=5, seed=0).coarse.numpy()
    assert numpy_inertia(x, stored) <= 1.1 * numpy_inertia(x, mixed)


@pytest.mark.parametrize("seed", [0, 1])
def test_inertia_near_flat_kmeans(seed):
    """Measured on these blobs: two-level 3.6-4.8% above flat k-means (the coarse boundaries), 1.1-1.7% after 4
    refinement iterations at nprobe 4."""
    x = blobs(20000, 32, 300, 0.3, seed)
    flat = numpy_inertia(x, spherical_kmeans(torch.from_numpy(x), 256, niter=10, seed=seed).centroids.numpy())
    plain = numpy_inertia(x, two_level_kmeans(torch.from_numpy(x), 256, niter=10, seed=seed).centroids.numpy())
    refined = numpy_inertia(x, two_level_kmeans(torch.from_numpy(x), 256, niter=10, seed=seed,
                                                refine_niter=4).centroids.numpy())
    assert plain <= 1.05 * flat
    assert refined <= 1.02 * flat and refined < plain


def test_two_level_kmeans_when_clusters_get_none_or_all_of_their_points():
    """fp16 points. C = G = 12: a cluster with fewer than n / C points may get no fine centroid (FAISS's rule); its
    group is left out and its points go to the next groups. C = n: every cluster gets all its points as centroids."""
    half = torch.from_numpy(blobs(400, 8, 3, 0.3, 3)).to(torch.float16)
    result = two_level_kmeans(half, 12, niter=4, seed=0, n_coarse=12)
    shares, sizes = np.diff(result.group_offsets.numpy()), result.cluster_sizes.numpy()
    assert shares.sum() == 12 and (shares <= sizes).all()
    assert ((shares == 0) & (sizes > 0)).any()  # here: 25 points, no centroid (and 7 points, one)
    groups = CentroidGroups.from_two_level(result)
    assert groups.n_groups == int((shares > 0).sum())
    codes, _ = coarse_nearest_centroids(half, result.centroids, groups, nprobe=1)
    np.testing.assert_array_equal(codes.numpy(), probed_best(half.float().numpy(), result.centroids.numpy(),
                                                             groups, 1))
    every = two_level_kmeans(half, len(half), niter=3, seed=0, n_coarse=5)
    np.testing.assert_array_equal(np.diff(every.group_offsets.numpy()), every.cluster_sizes.numpy())
    assert numpy_inertia(half.float().numpy(), every.centroids.numpy()) < 1e-4
    assert every.centroids.dtype == torch.float32


# -- refused ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"n_centroids": 0}, "n_centroids"), ({"n_centroids": 101}, "n_centroids"), ({"niter": 0}, "niter"),
    ({"n_coarse": 11}, "n_coarse"), ({"n_coarse": 0}, "n_coarse"), ({"refine_niter": -1}, "refine"),
    ({"nan": True}, "NaN")])
def test_two_level_kmeans_refuses_bad_input(kwargs, message):
    x = torch.from_numpy(blobs(100, 8, 4, 0.3, 0))
    if kwargs.pop("nan", False):
        x[17, 3] = float("nan")
    with pytest.raises(ValueError, match=message):
        two_level_kmeans(x, **{"n_centroids": 10, "niter": 2, **kwargs})


def test_coarse_assignment_refuses_bad_input(trained):
    x, result, groups = trained[0], trained[1], trained[2]["from_two_level"]
    points = torch.from_numpy(x[:50].copy())
    with pytest.raises(ValueError, match="nprobe"):
        coarse_nearest_centroids(points, result.centroids, groups, nprobe=0)
    with pytest.raises(ValueError, match="grouped centroids"):
        coarse_nearest_centroids(points, result.centroids[:-1], groups, nprobe=2)
    with pytest.raises(ValueError, match="points must be"):
        coarse_nearest_centroids(points[:, :16], result.centroids, groups, nprobe=2)
    points[3, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        coarse_nearest_centroids(points, result.centroids, groups, nprobe=2)
    with pytest.raises(ValueError, match="every group"):
        CentroidGroups(torch.eye(2), torch.tensor([0, 1]), torch.tensor([0, 0, 2]))
    with pytest.raises(ValueError, match="permutation"):
        CentroidGroups(torch.eye(2), torch.tensor([0, 0]), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="one length"):
        agreement(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="n_centroids"):
        fine_centroid_counts(np.array([2, 1]), 4)
