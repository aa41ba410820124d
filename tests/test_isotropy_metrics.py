"""Isotropy metrics against slow, literal reference implementations and on synthetic point clouds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hil.isotropy.metrics import (
    avg_cos,
    inter_iso,
    isoscore,
    isoscore_from_variances,
    isoscore_star,
    masked_tokens,
    partition_isotropy,
    pca_variances,
)

torch.set_num_threads(1)
SETTINGS = settings(max_examples=40, deadline=None)


# ---------------------------------------------------------------------------------------------------------------
# Slow references, written the obvious way
# ---------------------------------------------------------------------------------------------------------------

def inter_iso_loop(queries: torch.Tensor, docs: torch.Tensor, query_mask: torch.Tensor,
                   doc_mask: torch.Tensor) -> list[float]:
    """Eq. 2 with a double loop over valid (query token, doc token) pairs; 0 when a row has no pair."""
    values = []
    for b in range(queries.shape[0]):
        total, count = 0.0, 0
        for i in range(queries.shape[1]):
            for j in range(docs.shape[1]):
                if query_mask[b, i] and doc_mask[b, j]:
                    total += float(queries[b, i] @ docs[b, j])
                    count += 1
        values.append(total / count if count else 0.0)
    return values


def avg_cos_loop(x: np.ndarray) -> float:
    n = len(x)
    total = 0.0
    for i in range(n):
        for j in range(n):
            if i != j:
                total += x[i] @ x[j] / (np.linalg.norm(x[i]) * np.linalg.norm(x[j]))
    return total / (n * (n - 1))


def isoscore_reference(points: np.ndarray) -> float:
    """Rudman et al. (2022), steps as in their paper: points (N, D)."""
    centered = points - points.mean(axis=0)
    _, _, vt = np.linalg.svd(centered, full_matrices=True)          # rows of vt: principal directions
    reoriented = centered @ vt.T                                    # step 1: PCA reorientation
    variances = np.diag(np.atleast_2d(np.cov(reoriented.T)))        # step 2: variance vector
    n = points.shape[1]
    normalized = variances * math.sqrt(n) / np.linalg.norm(variances)  # step 3
    delta = np.linalg.norm(normalized - np.ones(n)) / math.sqrt(2 * (n - math.sqrt(n)))  # step 4
    phi = (n - delta ** 2 * (n - math.sqrt(n))) ** 2 / n ** 2        # step 5
    return (n * phi - 1) / (n - 1)                                   # step 6


def partition_loop(points: np.ndarray, both_signs: bool = False) -> float:
    _, vectors = np.linalg.eigh(points.T @ points)
    zs = []
    for k in range(vectors.shape[1]):
        c = vectors[:, k]
        c = c * (1.0 if c[np.argmax(np.abs(c))] >= 0 else -1.0)
        for sign in ((1.0, -1.0) if both_signs else (1.0,)):
            zs.append(sum(math.exp(sign * float(c @ x)) for x in points))
    return min(zs) / max(zs)


# ---------------------------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------------------------

@st.composite
def token_batches(draw):
    """Paired query and doc tensors with random masks (rows may be fully masked)."""
    b = draw(st.integers(1, 3))
    lq, ld, d = draw(st.integers(1, 5)), draw(st.integers(1, 6)), draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2 ** 16))
    g = torch.Generator().manual_seed(seed)
    queries = F.normalize(torch.randn(b, lq, d, generator=g, dtype=torch.float64), dim=-1)
    docs = F.normalize(torch.randn(b, ld, d, generator=g, dtype=torch.float64), dim=-1)
    query_mask = torch.rand(b, lq, generator=g) > draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    doc_mask = torch.rand(b, ld, generator=g) > draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    return queries, docs, query_mask, doc_mask


def random_points(n: int, d: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(d, generator=g, dtype=dtype) * 3 + 0.1    # anisotropic variances
    return torch.randn(n, d, generator=g, dtype=dtype) * scales + torch.randn(d, generator=g, dtype=dtype)


# ---------------------------------------------------------------------------------------------------------------
# masked_tokens
# ---------------------------------------------------------------------------------------------------------------

def test_masked_tokens_keeps_valid_tokens_in_order():
    x = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    mask = torch.tensor([[True, False, True], [False, True, False]])
    expected = torch.stack([x[0, 0], x[0, 2], x[1, 1]])
    assert torch.equal(masked_tokens(x, mask), expected)
    assert masked_tokens(x, None).shape == (6, 2)


def test_masked_tokens_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"\(B, L, D\)"):
        masked_tokens(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="mask"):
        masked_tokens(torch.zeros(2, 3, 4), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        masked_tokens(torch.zeros(2, 3, 4), torch.ones(2, 3))


# ---------------------------------------------------------------------------------------------------------------
# InterIso
# ---------------------------------------------------------------------------------------------------------------

@SETTINGS
@given(token_batches())
def test_inter_iso_equals_double_loop(batch):
    queries, docs, query_mask, doc_mask = batch
    got = inter_iso(queries, docs, query_mask, doc_mask)
    assert got.shape == (queries.shape[0],)
    assert got.tolist() == pytest.approx(inter_iso_loop(queries, docs, query_mask, doc_mask), abs=1e-12)


@SETTINGS
@given(token_batches())
def test_inter_iso_without_masks_uses_every_token(batch):
    queries, docs, _, _ = batch
    all_q = torch.ones(queries.shape[:2], dtype=torch.bool)
    all_d = torch.ones(docs.shape[:2], dtype=torch.bool)
    assert torch.allclose(inter_iso(queries, docs), inter_iso(queries, docs, all_q, all_d))


def test_inter_iso_ignores_padding_values():
    g = torch.Generator().manual_seed(1)
    queries = F.normalize(torch.randn(2, 4, 3, generator=g), dim=-1)
    docs = F.normalize(torch.randn(2, 5, 3, generator=g), dim=-1)
    query_mask = torch.tensor([[True, True, False, False], [True, True, True, False]])
    doc_mask = torch.tensor([[True, False, True, False, False], [True, True, True, True, False]])
    garbage_q = queries.clone()
    garbage_q[~query_mask] = 100.0
    garbage_d = docs.clone()
    garbage_d[~doc_mask] = -50.0
    clean = inter_iso(queries, docs, query_mask, doc_mask)
    assert torch.allclose(inter_iso(garbage_q, garbage_d, query_mask, doc_mask), clean)
    # Row 0 by hand: 2 query tokens x 2 doc tokens.
    row0 = sum(float(queries[0, i] @ docs[0, j]) for i in (0, 1) for j in (0, 2)) / 4
    assert clean[0].item() == pytest.approx(row0, abs=1e-6)


def test_inter_iso_gradient_matches_loop():
    g = torch.Generator().manual_seed(2)
    queries = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    docs = torch.randn(2, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    query_mask = torch.tensor([[True, False, True], [True, True, True]])
    doc_mask = torch.tensor([[True, True, False, True, False], [False, True, True, True, True]])
    fast_q, fast_d = torch.autograd.grad(inter_iso(queries, docs, query_mask, doc_mask).sum(), [queries, docs])
    slow = 0.0
    for b in range(2):
        pairs = [queries[b, i] @ docs[b, j] for i in range(3) for j in range(5) if query_mask[b, i] and doc_mask[b, j]]
        slow = slow + torch.stack(pairs).mean()
    slow_q, slow_d = torch.autograd.grad(slow, [queries, docs])
    assert torch.allclose(fast_q, slow_q) and torch.allclose(fast_d, slow_d)
    assert fast_q[0, 1].abs().sum() == 0 and fast_d[0, 2].abs().sum() == 0  # padding gets no gradient


def test_inter_iso_rejects_unpaired_batches():
    with pytest.raises(ValueError, match="batch sizes"):
        inter_iso(torch.zeros(2, 3, 4), torch.zeros(3, 3, 4))


# ---------------------------------------------------------------------------------------------------------------
# Avg-Cos
# ---------------------------------------------------------------------------------------------------------------

@SETTINGS
@given(st.integers(2, 12), st.integers(1, 6), st.integers(0, 2 ** 16))
def test_avg_cos_equals_pair_loop(n, d, seed):
    points = random_points(n, d, seed)
    assert avg_cos(points).item() == pytest.approx(avg_cos_loop(points.numpy()), abs=1e-10)


def test_avg_cos_needs_two_points():
    with pytest.raises(ValueError, match="at least 2"):
        avg_cos(torch.ones(1, 3))


# ---------------------------------------------------------------------------------------------------------------
# IsoScore and IsoScore*
# ---------------------------------------------------------------------------------------------------------------

@SETTINGS
@given(st.integers(3, 40), st.integers(2, 8), st.integers(0, 2 ** 16))
def test_isoscore_equals_reference_algorithm(n, d, seed):
    points = random_points(n, d, seed)
    assert isoscore(points).item() == pytest.approx(isoscore_reference(points.numpy()), abs=1e-9)


@SETTINGS
@given(st.integers(3, 40), st.integers(2, 8), st.integers(0, 2 ** 16))
def test_pca_variances_are_covariance_eigenvalues(n, d, seed):
    points = random_points(n, d, seed)
    expected = np.sort(np.linalg.eigvalsh(np.atleast_2d(np.cov(points.numpy().T))))[::-1]
    assert pca_variances(points).numpy() == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("n,k", [(8, 1), (8, 3), (8, 8), (5, 2)])
def test_isoscore_closed_form_for_k_equal_directions(n, k):
    # Points +-e_i for i < k: k equal variances, n - k zeros -> IsoScore (k - 1) / (n - 1) (Rudman et al.).
    eye = torch.eye(n, dtype=torch.float64)[:k]
    points = torch.cat([eye, -eye])
    assert isoscore(points).item() == pytest.approx((k - 1) / (n - 1), abs=1e-9)
    variances = torch.cat([torch.ones(k), torch.zeros(n - k)]).double()
    assert isoscore_from_variances(variances).item() == pytest.approx((k - 1) / (n - 1), abs=1e-12)


def test_isoscore_is_invariant_to_rotation_scale_and_translation():
    points = random_points(200, 6, seed=3)
    rotation, _ = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4)))
    moved = 7.5 * points @ rotation + 3.0
    assert isoscore(moved).item() == pytest.approx(isoscore(points).item(), abs=1e-9)


def test_isoscore_of_identical_points_is_zero():
    assert isoscore(torch.ones(5, 4)).item() == 0.0


@SETTINGS
@given(st.integers(3, 40), st.integers(2, 8), st.integers(0, 2 ** 16))
def test_isoscore_star_without_shrinkage_equals_isoscore(n, d, seed):
    points = random_points(n, d, seed)
    assert isoscore_star(points).item() == pytest.approx(isoscore(points).item(), abs=1e-8)
    assert isoscore_star(points.float()).item() == pytest.approx(isoscore(points).item(), abs=2e-4)


@SETTINGS
@given(st.integers(2, 20), st.integers(2, 8), st.floats(0.0, 1.0), st.integers(0, 2 ** 16))
def test_isoscore_star_equals_shrunk_covariance_reference(n, d, zeta, seed):
    points = random_points(n, d, seed)
    g = torch.Generator().manual_seed(seed + 1)
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    shrinkage = a @ a.T / d
    sigma = (1 - zeta) * np.cov(points.numpy().T) + zeta * shrinkage.numpy()
    variances = torch.from_numpy(np.clip(np.linalg.eigvalsh(sigma), 0, None))
    expected = isoscore_from_variances(variances).item()
    assert isoscore_star(points, shrinkage, zeta).item() == pytest.approx(expected, abs=1e-8)


def test_isoscore_star_full_shrinkage_to_identity_is_one():
    points = random_points(10, 4, seed=5)
    assert isoscore_star(points, torch.eye(4), zeta=1.0).item() == pytest.approx(1.0, abs=1e-12)


def test_isoscore_star_gradient_is_finite_and_correct():
    points = random_points(12, 4, seed=6).requires_grad_(True)
    shrinkage = torch.eye(4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: isoscore_star(x, shrinkage, 0.2), (points,))
    # Repeated eigenvalues (an exactly isotropic cloud) still give a finite gradient.
    eye = torch.eye(4, dtype=torch.float64)
    cloud = torch.cat([eye, -eye]).requires_grad_(True)
    (grad,) = torch.autograd.grad(isoscore_star(cloud), [cloud])
    assert torch.isfinite(grad).all()


def test_isoscore_star_rejects_bad_shrinkage():
    with pytest.raises(ValueError, match="shrinkage_cov"):
        isoscore_star(torch.randn(5, 3), torch.eye(4))
    with pytest.raises(ValueError, match="zeta"):
        isoscore_star(torch.randn(5, 3), torch.eye(3), zeta=1.5)


# ---------------------------------------------------------------------------------------------------------------
# Partition isotropy I(W)
# ---------------------------------------------------------------------------------------------------------------

@SETTINGS
@given(st.integers(2, 15), st.integers(1, 5), st.booleans(), st.integers(0, 2 ** 16))
def test_partition_isotropy_equals_loop(n, d, both_signs, seed):
    points = random_points(n, d, seed) * 0.5
    expected = partition_loop(points.numpy(), both_signs)
    assert partition_isotropy(points, both_signs).item() == pytest.approx(expected, rel=1e-9)


def test_partition_isotropy_does_not_overflow():
    points = random_points(50, 4, seed=7) * 1e3                 # exp(c^T x) would overflow float64
    value = partition_isotropy(points).item()
    assert math.isfinite(value) and 0.0 <= value < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# Synthetic clouds: isotropic vs anisotropic
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clouds():
    g = torch.Generator().manual_seed(0)
    n, d = 5000, 32
    gaussian = torch.randn(n, d, generator=g)
    axis = F.normalize(torch.randn(d, generator=g), dim=0)
    other = torch.randn(d, generator=g)
    other = F.normalize(other - other.dot(axis) * axis, dim=0)
    # All vectors ~ the same direction: a shifted line (variation along one direction) and a narrow cone.
    line = 3.0 * axis + torch.randn(n, 1, generator=g) * other + 0.01 * torch.randn(n, d, generator=g)
    cone = F.normalize(axis + 0.05 * torch.randn(n, d, generator=g), dim=-1)
    return {"gaussian": gaussian, "line": line, "cone": cone}


def test_isotropic_gaussian_scores_isotropic(clouds):
    gaussian = clouds["gaussian"]
    assert isoscore(gaussian).item() > 0.97
    assert isoscore_star(gaussian).item() > 0.97
    assert partition_isotropy(gaussian).item() > 0.75
    assert partition_isotropy(F.normalize(gaussian, dim=-1)).item() > 0.95
    assert abs(avg_cos(gaussian).item()) < 0.01


def test_points_along_a_line_score_anisotropic(clouds):
    line = clouds["line"]
    assert isoscore(line).item() < 0.01
    assert isoscore_star(line).item() < 0.01
    assert partition_isotropy(line).item() < 0.1
    assert avg_cos(line).item() > 0.85


def test_narrow_cone_scores_anisotropic_on_mean_sensitive_metrics(clouds):
    cone = clouds["cone"]
    assert avg_cos(cone).item() > 0.9
    # Unit vectors bound I(W) below by e^-2; a cone sits near e^-1, far from the Gaussian's ~1.
    assert partition_isotropy(cone).item() < 0.45
    assert partition_isotropy(cone, both_signs=True).item() < 0.2
    # IsoScore centers the data first: isotropic noise around the cone's axis is isotropic to it.
    assert isoscore(cone).item() > 0.9


def test_metrics_on_masked_tokens_exclude_padding():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 7, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 7, generator=g) > 0.4
    mask[:, 0] = True
    padded = x.clone()
    padded[~mask] = 1e3
    clean = torch.cat([x[b][mask[b]] for b in range(3)])
    for metric in (avg_cos, isoscore, isoscore_star, partition_isotropy):
        assert metric(masked_tokens(padded, mask)).item() == pytest.approx(metric(clean).item(), rel=1e-9)


def test_half_precision_inputs_are_computed_in_float32():
    g = torch.Generator().manual_seed(9)
    x = F.normalize(torch.randn(2000, 8, generator=g) + 2.0, dim=-1)           # Avg-Cos ~ 0.8
    exact = avg_cos(x.double()).item()
    assert avg_cos(x.bfloat16()).dtype == torch.float32
    assert avg_cos(x.bfloat16()).item() == pytest.approx(exact, abs=1e-2)
    tokens = x.reshape(20, 100, 8)
    values = inter_iso(tokens[:10].bfloat16(), tokens[10:].bfloat16())
    assert values.dtype == torch.float32
    assert torch.allclose(values.double(), inter_iso(tokens[:10].double(), tokens[10:].double()), atol=1e-2)
    assert isoscore_star(x.bfloat16()).dtype == torch.float32


def test_effective_rank_against_numpy_entropy_of_singular_values():
    """Roy & Vetterli's effective rank, from numpy's SVD and the entropy written out; limits of the definition."""
    from hil.isotropy.metrics import effective_rank

    rng = np.random.default_rng(3)
    x = rng.normal(size=(50, 6)) * np.array([3.0, 2.0, 1.0, 0.5, 0.1, 0.01]) + np.array([1.0, 0, 0, 0, 0, 0])
    s = np.linalg.svd(x, compute_uv=False)
    p = s / s.sum()
    expected = math.exp(-sum(v * math.log(v) for v in p if v > 0))
    assert float(effective_rank(torch.tensor(x))) == pytest.approx(expected, rel=1e-10)
    assert float(effective_rank(torch.eye(5))) == pytest.approx(5.0)  # every direction used equally
    line = torch.tensor(rng.normal(size=(20, 1))) * torch.tensor([[1.0, 2.0, -1.0]])
    assert float(effective_rank(line)) == pytest.approx(1.0, abs=1e-6)  # all points on one line


@pytest.mark.parametrize("shrink", [False, True])
def test_isoscore_star_under_autocast_computes_its_covariance_in_float32(monkeypatch, shrink):
    """Under mixed precision (a training step), the covariance's matrix product must not come back in half
    precision: CUDA's eigvalsh has no half kernel (the first I-STAR step with running shrinkage crashed there) and
    the docstring promises float32. The CPU's autocast stands in for CUDA's: what reaches eigvalsh is recorded
    before any cast of its own, and the value equals the one computed without autocast."""
    seen = []
    real = torch.linalg.eigvalsh
    monkeypatch.setattr(torch.linalg, "eigvalsh", lambda matrix: seen.append(matrix.dtype) or real(matrix))
    points = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    shrinkage = torch.eye(8) if shrink else None
    expected = isoscore_star(points, shrinkage)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = isoscore_star(points, shrinkage)
    assert seen == [torch.float32, torch.float32]
    assert got.dtype == torch.float32 and got.item() == expected.item()
