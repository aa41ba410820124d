"""Isotropy metrics of token embeddings, as pure tensor functions.

InterIso (Eq. 2 of HIL) measures query-passage interaction; Avg-Cos, IsoScore and the partition score I(W) are the
single-distribution metrics of HIL Appendix A.1; IsoScore* is the differentiable IsoScore of I-STAR used by the
I-STAR regularizer (A.1 / A.3).

Shapes: B batch, Lq query tokens, Ld document tokens, L tokens, N points, D embedding dimension. Masks are boolean,
True where a token takes part (padding is False); masked tokens are left out of every sum *and* every count.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor

# --------------------------------------------------------------------------------------------------------------
# Input checks and token selection
# --------------------------------------------------------------------------------------------------------------

def _check_tokens(name: str, x: Tensor, mask: Tensor | None) -> None:
    """Raise a ValueError naming the argument when ``x`` is not (B, L, D) or ``mask`` is not a matching (B, L) bool."""
    if x.dim() != 3:
        raise ValueError(f"hil.isotropy.metrics: {name} must be (B, L, D), got shape {tuple(x.shape)}")
    if mask is None:
        return
    if mask.dtype != torch.bool:
        raise ValueError(f"hil.isotropy.metrics: {name} mask must be bool, got {mask.dtype}")
    if tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"hil.isotropy.metrics: {name} mask must be (B, L) = {tuple(x.shape[:2])}, "
                         f"got {tuple(mask.shape)}")


def _check_points(name: str, x: Tensor, min_points: int = 2) -> None:
    """Raise a ValueError when ``x`` is not an (N, D) matrix with at least ``min_points`` rows."""
    if x.dim() != 2:
        raise ValueError(f"hil.isotropy.metrics: {name} expects points (N, D), got shape {tuple(x.shape)}; "
                         f"flatten token tensors with masked_tokens(x, mask) first")
    if x.shape[0] < min_points:
        raise ValueError(f"hil.isotropy.metrics: {name} needs at least {min_points} points, got {x.shape[0]}")


def masked_tokens(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """The valid token vectors of a batch as one point cloud: x (B, L, D), mask (B, L) bool -> (N, D).

    N is the number of True entries of ``mask`` (B * L when ``mask`` is None); rows come in batch-then-position
    order. Differentiable (boolean indexing).
    """
    _check_tokens("masked_tokens", x, mask)
    if mask is None:
        return x.reshape(-1, x.shape[-1])
    return x[mask]


def token_cloud(x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The tokens of a batch as one point cloud with the valid ones marked instead of selected: x (B, L, D),
    mask (B, L) bool -> points (B L, D) and weights (B L,) 1.0 / 0.0 in x's dtype (None without a mask).

    What :func:`masked_tokens` selects, without its boolean indexing, which reads the number of valid tokens back
    from the device (a host sync on a GPU each training step). :func:`covariance` and :func:`isoscore_star` take
    the weights; zeroed rows contribute nothing to :func:`sum_offdiagonal_cosines`."""
    _check_tokens("token_cloud", x, mask)
    points = x.reshape(-1, x.shape[-1])
    return points, None if mask is None else mask.reshape(-1).to(x.dtype)


# --------------------------------------------------------------------------------------------------------------
# InterIso (HIL Eq. 2)
# --------------------------------------------------------------------------------------------------------------

def _masked_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    """Mean token vector per row over valid tokens: x (B, L, D) -> (B, D); a row with no valid token gives 0."""
    if mask is None:
        return x.mean(dim=1)
    weights = mask.to(x.dtype).unsqueeze(-1)                    # (B, L, 1)
    counts = weights.sum(dim=1).clamp(min=1.0)                  # (B, 1): an empty row has sum 0, so its mean is 0
    return (x * weights).sum(dim=1) / counts


def inter_iso(queries: Tensor, docs: Tensor, query_mask: Tensor | None = None,
              doc_mask: Tensor | None = None) -> Tensor:
    """Interactive Isotropy, HIL Eq. 2, for paired rows:

        InterIso(q, d) = 1 / (|E_q| |E_d|) * sum_i sum_j E_qi . E_dj

    queries (B, Lq, D), docs (B, Ld, D), query_mask (B, Lq) bool, doc_mask (B, Ld) bool -> (B,).

    The double sum factorises, ``sum_i sum_j q_i . d_j = (sum_i q_i) . (sum_j d_j)``, so the mean over all valid
    (query token, doc token) pairs equals the dot product of the masked mean query vector and the masked mean
    document vector: O((Lq + Ld) D) instead of O(Lq Ld D). Masked tokens count neither in the sums nor in |E_q|,
    |E_d|. With L2-normalized embeddings (as the encoders produce) every term is a cosine, so the value lies in
    [-1, 1]: near 0 isotropic, near 1 anisotropic. A row with no valid query or no valid document token gives 0.
    Differentiable; computed and returned in float32 at least (sums over ~180 tokens lose digits in bfloat16).
    """
    _check_tokens("inter_iso queries", queries, query_mask)
    _check_tokens("inter_iso docs", docs, doc_mask)
    if queries.shape[0] != docs.shape[0] or queries.shape[-1] != docs.shape[-1]:
        raise ValueError(f"hil.isotropy.metrics: inter_iso pairs rows of queries {tuple(queries.shape)} with docs "
                         f"{tuple(docs.shape)}: batch sizes and embedding dimensions must match")
    dtype = torch.promote_types(torch.promote_types(queries.dtype, docs.dtype), torch.float32)
    mean_query = _masked_mean(queries.to(dtype), query_mask)    # (B, D)
    mean_doc = _masked_mean(docs.to(dtype), doc_mask)           # (B, D)
    return (mean_query * mean_doc).sum(dim=-1)                  # (B,)


# --------------------------------------------------------------------------------------------------------------
# Avg-Cos (A.1; Ethayarajh 2019)
# --------------------------------------------------------------------------------------------------------------

def sum_offdiagonal_cosines(x: Tensor) -> Tensor:
    """``sum_{i != j} cos(x_i, x_j)`` over ordered pairs in O(N D) via ``||sum_i x^_i||^2 - sum_i ||x^_i||^2``.

    x (N, D) -> scalar. Rows are L2-normalized first (``x^_i = x_i / ||x_i||``; an all-zero row stays zero and
    contributes nothing). Differentiable; shared by avg_cos and the CosReg regularizer. Computed in float32 at
    least: the identity subtracts two numbers of order N^2, which half precision cannot resolve.
    """
    unit = F.normalize(x.to(torch.promote_types(x.dtype, torch.float32)), dim=-1)  # (N, D)
    total = unit.sum(dim=0)                                     # (D,)
    return total.dot(total) - (unit * unit).sum()


def avg_cos(x: Tensor) -> Tensor:
    """Avg-Cos, HIL Appendix A.1: the mean cosine similarity over ordered pairs i != j,

        Avg-Cos(s) = 1 / (|E_s| (|E_s| - 1)) * sum_{i != j} E_si . E_sj

    x (N, D), N >= 2 -> scalar. Rows are L2-normalized, so it is a cosine even for unnormalized input (Jung et al.
    Eq. 4 writes cos(w_i, w_j); their 2/(n(n-1)) over unordered pairs is the same number). Near 0 isotropic, near
    1 anisotropic (all vectors in a narrow cone). Differentiable.
    """
    _check_points("avg_cos", x)
    n = x.shape[0]
    return sum_offdiagonal_cosines(x) / (n * (n - 1))


# --------------------------------------------------------------------------------------------------------------
# IsoScore (A.1; Rudman et al. 2022) and IsoScore* (I-STAR; Rudman & Eickhoff 2023)
# --------------------------------------------------------------------------------------------------------------

def isoscore_from_variances(variances: Tensor) -> Tensor:
    """Steps 3-6 of IsoScore from the variance vector of PCA-reoriented data (or covariance eigenvalues).

    variances (n,) >= 0 -> scalar in [0, 1]:

        v^   = sqrt(n) * v / ||v||                                   (normalize to the length of 1 = (1, ..., 1))
        delta = ||v^ - 1|| / sqrt(2 (n - sqrt(n)))                   (isotropy defect, in [0, 1])
        phi   = (n - delta^2 (n - sqrt(n)))^2 / n^2                  (fraction of dimensions used, in [1/n, 1])
        IsoScore = (n phi - 1) / (n - 1)

    HIL A.1 prints ``phi = (n - delta)^2 (n - sqrt n)^2 / n^2``, which is a garbled transcription (it is not in
    [1/n, 1]); this follows the original paper and its reference code. 1 for isotropic data (equal variances),
    0 when all variance lies in one direction, (k - 1)/(n - 1) when k directions share it equally. An all-zero
    variance vector (all points identical) gives 0. Differentiable where ``||v|| > 0``.
    """
    if variances.dim() != 1 or variances.numel() < 2:
        raise ValueError(f"hil.isotropy.metrics: isoscore needs a variance vector of length n >= 2, "
                         f"got shape {tuple(variances.shape)}")
    n = variances.numel()
    sqrt_n = math.sqrt(n)
    norm = torch.linalg.vector_norm(variances)
    safe_norm = torch.where(norm > 0, norm, torch.ones_like(norm))   # keeps the gradient finite when norm == 0
    normalized = variances * (sqrt_n / safe_norm)                    # (n,)
    defect_squared = (normalized - 1.0).square().sum() / (2.0 * (n - sqrt_n))
    phi = (n - defect_squared * (n - sqrt_n)).square() / n ** 2
    score = (n * phi - 1.0) / (n - 1.0)
    return torch.where(norm > 0, score, torch.zeros_like(score))


def pca_variances(x: Tensor) -> Tensor:
    """Steps 1-2 of IsoScore: variances of the data reoriented onto its principal components.

    x (N, D) -> (D,), largest first. Centers the points, projects them on the eigenvectors of their covariance
    (PCA with all D components, as the reference code's ``PCA(n_components=D)``) and takes the per-component
    sample variance (ddof 1, as ``np.cov``; the scale cancels in IsoScore). When N <= D the trailing components
    have variance 0. Computed in float64.
    """
    _check_points("pca_variances", x)
    points = x.detach().to(torch.float64)
    centered = points - points.mean(dim=0, keepdim=True)        # (N, D)
    covariance = centered.T @ centered / (points.shape[0] - 1)  # (D, D)
    _, components = torch.linalg.eigh(covariance)               # columns: principal directions, ascending
    reoriented = centered @ components.flip(-1)                 # (N, D): PCA coordinates, largest variance first
    return reoriented.var(dim=0, unbiased=True)


def isoscore(x: Tensor) -> Tensor:
    """IsoScore of Rudman et al. (2022), HIL Appendix A.1: how uniformly a point cloud uses its D dimensions.

    x (N, D), N >= 2 -> scalar in [0, 1] (float64, no gradient). The algorithm of the original paper:
    (1) PCA-reorient the centered data, (2) take the variance vector of the reoriented data, (3) normalize it to
    length sqrt(n), (4) isotropy defect delta = ||v^ - 1|| / sqrt(2 (n - sqrt n)), (5) phi = (n - delta^2 (n -
    sqrt n))^2 / n^2, (6) IsoScore = (n phi - 1) / (n - 1); see ``isoscore_from_variances``. Here n = D, the
    embedding dimension (the reference code takes n from the data's dimension, not from the number of points).

    IsoScore is invariant to translation, rotation and scale: a narrow cone with isotropic noise around its axis
    scores high, while points along a line score 0. Use ``isoscore_star`` for a differentiable version.
    """
    _check_points("isoscore", x)
    return isoscore_from_variances(pca_variances(x))


def effective_rank(x: Tensor) -> Tensor:
    """Effective rank of Roy & Vetterli (2007, Eq. 2): ``exp(H(p))`` with ``p_i = s_i / sum_j s_j`` the normalized
    singular values of the *uncentered* points x (N, D) and ``H`` the Shannon entropy (0 log 0 = 0) -> scalar in
    [1, min(N, D)], float64, no gradient. Uncentered on purpose: a common direction shared by every token (the
    anisotropy MUVERA's SimHash suffers from) shows as one dominant singular value and lowers it, where the
    centered IsoScore would not see it. D means every direction used equally; 1 means all points on one line."""
    _check_points("effective_rank", x)
    singular = torch.linalg.svdvals(x.detach().to(torch.float64))
    p = singular / singular.sum()
    p = p[p > 0]
    return torch.exp(-(p * p.log()).sum())


def covariance(x: Tensor, weights: Tensor | None = None) -> Tensor:
    """Sample covariance (ddof 1, as ``torch.cov`` and the I-STAR code) of points x (N, D) -> (D, D). Differentiable.

    ``weights`` (N,) 1.0 / 0.0 (:func:`token_cloud`): the covariance of the rows weighted 1 only, as if the others
    were not there, counted on the device; with fewer than 2 such rows (no covariance) the zero matrix."""
    _check_points("covariance", x)
    if weights is None:
        centered = x - x.mean(dim=0, keepdim=True)
        return centered.T @ centered / (x.shape[0] - 1)
    w = weights.to(x.dtype)[:, None]                                  # (N, 1)
    n = w.sum()
    centered = (x - (x * w).sum(dim=0, keepdim=True) / n.clamp(min=1)) * w
    return centered.T @ centered / (n - 1).clamp(min=1)


def isoscore_star(x: Tensor, shrinkage_cov: Tensor | None = None, zeta: float = 0.2,
                  weights: Tensor | None = None) -> Tensor:
    """IsoScore* of I-STAR (Rudman & Eickhoff 2023): IsoScore computed from a shrinkage covariance, differentiable.

    x (N, D), N >= 2, shrinkage_cov C (D, D) or None -> scalar.

        Sigma = (1 - zeta) * Cov(x) + zeta * C
        IsoScore* = isoscore_from_variances(eigenvalues(Sigma))

    The eigenvalues of a covariance are exactly the variances of the PCA-reoriented data, so they replace IsoScore
    steps 1-2 (the I-STAR code takes the singular values of Sigma, which equal its eigenvalues since Sigma is
    symmetric PSD; ``eigvalsh`` is used here, with a well-defined gradient even for repeated eigenvalues).
    Shrinking toward C stabilizes the estimate on a mini-batch with fewer points than dimensions. HIL A.1 writes
    C_i, a covariance re-estimated each epoch; HIL A.3 uses the identity matrix, IsoScore(X, I). Cov(x) uses
    ddof 1 as ``torch.cov``. With ``shrinkage_cov=None`` (or zeta = 0) this is IsoScore of the batch covariance
    alone and equals ``isoscore(x)`` up to float error. Computed in float32 at least (eigvalsh has no half
    precision), returned in that dtype. ``weights``: as :func:`covariance`'s (the valid tokens of a padded batch).
    """
    _check_points("isoscore_star", x)
    if not 0.0 <= zeta <= 1.0:
        raise ValueError(f"hil.isotropy.metrics: isoscore_star zeta must lie in [0, 1], got {zeta}")
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    d = x.shape[1]
    if shrinkage_cov is not None and tuple(shrinkage_cov.shape) != (d, d):
        raise ValueError(f"hil.isotropy.metrics: isoscore_star shrinkage_cov must be (D, D) = ({d}, {d}), "
                         f"got {tuple(shrinkage_cov.shape)}")
    # Outside autocast: under mixed precision its matrix product would come back in half precision, which CUDA's
    # eigvalsh does not take (the CPU's autocast casts it back up; CUDA's does not).
    with _autocast_off(x.device):
        sigma = covariance(x.to(compute_dtype), weights)        # (D, D)
        if shrinkage_cov is not None:
            sigma = (1.0 - zeta) * sigma + zeta * shrinkage_cov.to(device=sigma.device, dtype=compute_dtype)
        eigenvalues = torch.linalg.eigvalsh(sigma).clamp(min=0.0)  # (D,); clamp round-off negatives of a PSD matrix
    return isoscore_from_variances(eigenvalues)


def _autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """A region where autocast, if this device type has one, computes in the tensors' own dtypes."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------------------------
# Partition isotropy score I(W) (A.1; Mu et al. 2017, as used by Jung et al. 2022)
# --------------------------------------------------------------------------------------------------------------

def partition_isotropy(x: Tensor, both_signs: bool = False) -> Tensor:
    """Partition isotropy score I(W) of Mu et al. (2017), HIL Appendix A.1 and Jung et al. Eq. 3:

        Z(c) = sum_i exp(c^T x_i),        I(W) = min_{c in E} Z(c) / max_{c in E} Z(c)

    x (N, D), N >= 2 -> scalar in (0, 1] (float64, no gradient). E is the set of the D unit eigenvectors of
    X^T X (D x D, uncentered, as Mu et al. and Jung et al.; HIL A.1 writes XX^T, whose eigenvectors are
    N-dimensional and cannot be dotted with x_i, so its D-dimensional counterpart is used). Each eigenvector is
    defined only up to sign; the sign is fixed so that its largest-magnitude component is positive (as
    scikit-learn's ``svd_flip``) so that results do not depend on the solver. ``both_signs=True`` takes E as
    {+c, -c}, a sign-free variant. Computed as ``exp(min log Z - max log Z)`` with logsumexp, so large norms do
    not overflow.

    Near 1 for an isotropic Gaussian cloud, near 0 for points with a large common component. Note that for
    unit vectors c^T x_i lies in [-1, 1], so I(W) >= e^-2 whatever the data.
    """
    _check_points("partition_isotropy", x)
    points = x.detach().to(torch.float64)
    _, eigenvectors = torch.linalg.eigh(points.T @ points)      # (D, D), columns are eigenvectors of X^T X
    largest = eigenvectors.abs().argmax(dim=0)                  # (D,)
    signs = torch.sign(eigenvectors.gather(0, largest[None, :]))  # (1, D)
    directions = eigenvectors * torch.where(signs == 0, torch.ones_like(signs), signs)
    if both_signs:
        directions = torch.cat([directions, -directions], dim=1)  # (D, 2D)
    log_z = torch.logsumexp(points @ directions, dim=0)         # (D,) or (2D,): log Z(c) per direction
    return torch.exp(log_z.min() - log_z.max())
