"""Linear post-hoc transforms fitted from the mean and covariance: whitening(-k), all-but-the-top, standardization.

Sources: Jung et al. 2023 (paper 000, Section 4.1, Eqs. 7-10: mean, unbiased covariance, SVD, whitening), Su et al.
2021 (paper 002, Section 3, Algorithm 1: Whitening-k), Mu et al. 2017 ("all-but-the-top") and Roychowdhury et al.
(paper 004, Section 2.5: PCA removal and per-dimension standardization).

All three are fitted from the first two moments only, so each can be fitted on a corpus streamed in chunks:
``acc = MomentAccumulator(); acc.update(chunk) ...; t.fit_moments(acc.mean, acc.covariance, acc.count)``.
Moments are accumulated in float64 in bounded chunks (a large token matrix is never copied to float64 at once).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from hil.isotropy.post_transform import PostTransform, as_like, check_fit_input

__all__ = ["MomentAccumulator", "moments", "principal_directions", "Whitening", "RemoveTopPCs", "Standardize"]

_CHUNK_ROWS = 65536  # rows per float64 chunk when accumulating moments: bounds the temporary copy


class MomentAccumulator:
    """Streaming mean and unbiased covariance (000 Eqs. 7-8) in float64, fed in chunks of any size.

    Sums are taken around a shift (the first chunk's mean) so that the ``sum x x^T - n mu mu^T`` cancellation
    stays accurate even for strongly anisotropic embeddings whose mean is far from the origin (a narrow cone).
    Use it to fit whitening on a corpus encoded in bounded chunks: ``acc.update(chunk)`` for each chunk, then
    ``Whitening().fit_moments(acc.mean, acc.covariance, acc.count)``.
    """

    def __init__(self) -> None:
        self.count = 0
        self._shift: Tensor | None = None
        self._sum: Tensor | None = None    # (D,)   sum of (x - shift)
        self._outer: Tensor | None = None  # (D, D) sum of (x - shift)^T (x - shift)

    def update(self, x: Tensor) -> "MomentAccumulator":
        """Add the rows of x (N, D)."""
        check_fit_input(x, "MomentAccumulator", min_rows=0)
        for start in range(0, x.shape[0], _CHUNK_ROWS):
            chunk = x[start:start + _CHUNK_ROWS].detach().to(device="cpu", dtype=torch.float64)  # (n, D)
            if self._shift is None:
                self._shift = chunk.mean(dim=0)
                dim = chunk.shape[1]
                self._sum = torch.zeros(dim, dtype=torch.float64)
                self._outer = torch.zeros(dim, dim, dtype=torch.float64)
            elif chunk.shape[1] != self._shift.shape[0]:
                raise ValueError(f"MomentAccumulator.update: dimension changed from {self._shift.shape[0]} "
                                 f"to {chunk.shape[1]}")
            centred = chunk - self._shift
            self._sum += centred.sum(dim=0)
            self._outer += centred.T @ centred
            self.count += chunk.shape[0]
        return self

    @property
    def mean(self) -> Tensor:
        """Eq. 7: mu = (1/N) sum_i x_i. -> (D,) float64"""
        if self._shift is None or self.count == 0:
            raise ValueError("MomentAccumulator: no vectors seen yet")
        return self._shift + self._sum / self.count

    @property
    def covariance(self) -> Tensor:
        """Eq. 8: Sigma = 1/(N-1) sum_i (x_i - mu)^T (x_i - mu), the unbiased covariance. -> (D, D) float64"""
        if self.count < 2:
            raise ValueError(f"MomentAccumulator: need at least 2 vectors for a covariance, got {self.count}")
        centred_mean = self._sum / self.count  # mean of (x - shift)
        cov = (self._outer - self.count * torch.outer(centred_mean, centred_mean)) / (self.count - 1)
        return (cov + cov.T) / 2  # exact symmetry for the SVD


def moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """Mean (D,) and unbiased covariance (D, D) of the rows of x (N, D), float64 (000 Eqs. 7-8)."""
    acc = MomentAccumulator().update(x)
    return acc.mean, acc.covariance


def principal_directions(covariance: Tensor) -> tuple[Tensor, Tensor]:
    """000 Eq. 9: ``Sigma = U diag(s) U^T`` by SVD -> U (D, D) (columns = principal directions), s (D,) descending.

    s is clamped at 0: a covariance is positive semi-definite, anything below is round-off.
    """
    u, s, _ = torch.linalg.svd(covariance)
    return u, s.clamp_min(0.0)


def _explained_share(s: Tensor, k: int) -> float:
    """Share of the total variance in the first k principal directions: sum(s[:k]) / sum(s)."""
    return float(s[:k].sum() / s.sum().clamp_min(1e-300))


class _MomentTransform(PostTransform):
    """A transform fitted from the mean and covariance, its fitted state the float64 tensors named in ``_TENSORS``.

    ``mean`` (D,) is always the first of them; the output keeps dimension D unless a subclass says otherwise.
    Subclasses implement ``_fit_moments(mean, cov) -> extra fit_info`` and ``_transform_flat``.
    """

    _TENSORS: ClassVar[tuple[str, ...]] = ("mean",)
    mean: Tensor | None  # (D,) float64

    def _init_state(self, renormalize: bool) -> None:
        self.renormalize = bool(renormalize)
        for attribute in self._TENSORS:
            setattr(self, attribute, None)
        self.fit_info: dict[str, Any] = {}

    def fit(self, x: Tensor) -> "_MomentTransform":
        """Fit on the rows of x (N, D) from their mean and unbiased covariance (000 Eqs. 7-8)."""
        check_fit_input(x, type(self).__name__)
        mean, cov = moments(x)
        return self.fit_moments(mean, cov, count=x.shape[0])

    def fit_moments(self, mean: Tensor, covariance: Tensor, count: int | None = None) -> "_MomentTransform":
        """Fit from precomputed mean (D,) and covariance (D, D), e.g. from a :class:`MomentAccumulator`."""
        dim = mean.shape[-1]
        if mean.dim() != 1 or tuple(covariance.shape) != (dim, dim):
            raise ValueError(f"{type(self).__name__}.fit_moments: expected mean (D,) and covariance (D, D), got "
                             f"{tuple(mean.shape)} and {tuple(covariance.shape)}")
        extra = self._fit_moments(mean.detach().to("cpu", torch.float64),
                                  covariance.detach().to("cpu", torch.float64))
        self.fit_info = {"n_vectors": count, "dim": dim, **extra}
        return self

    def _fit_moments(self, mean: Tensor, cov: Tensor) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def fitted(self) -> bool:
        return all(getattr(self, attribute) is not None for attribute in self._TENSORS)

    @property
    def input_dim(self) -> int:
        self._require_fitted()
        return self.mean.shape[0]

    @property
    def output_dim(self) -> int:
        return self.input_dim

    def _state(self) -> dict[str, Any]:
        return {attribute: getattr(self, attribute) for attribute in self._TENSORS}

    def _load_state(self, state: dict[str, Any]) -> None:
        for attribute in self._TENSORS:
            setattr(self, attribute, state[attribute].to(torch.float64))


class Whitening(_MomentTransform):
    """Whitening(-k): ``z = (x - mu) W[:, :k]`` with ``W = U diag(1/sqrt(s))`` and ``Sigma = U diag(s) U^T``.

    000 Eqs. 7-10 (mean, unbiased covariance, SVD, ``z = (x - mu) U sqrt(Lambda^-1)``) and 002 Algorithm 1
    ("Whitening-k": keep the first k columns of ``U sqrt(Lambda^-1)``; singular values come sorted in descending
    order, so this keeps the k directions of largest variance, i.e. PCA to k dims followed by scaling to unit
    variance). The output has zero mean and identity covariance on the fitting data (k x k when k < D).

    ``eps`` is added to the singular values before the inverse square root, so directions with (numerically)
    zero variance are scaled by at most ``1/sqrt(eps)`` instead of dividing by zero; for covariances of
    well-conditioned data (variances >> eps) its effect is negligible.

    ``renormalize`` (default True) L2-normalizes the output: ColBERT / 000 score whitened vectors with a cosine
    (000 Section 4.1.2: "cascade an aggregator that performs the cosine similarity calculation").
    """

    name = "whitening"
    _TENSORS = ("mean", "projection", "singular_values")
    projection: Tensor | None       # (D, k) float64: first k columns of U diag(1/sqrt(s))
    singular_values: Tensor | None  # (D,) float64: s, descending (variance per PC)

    def __init__(self, k: int | None = None, eps: float = 1e-6, renormalize: bool = True):
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(f"Whitening: k must be a positive int or None, got {k!r}")
        if not eps >= 0:
            raise ValueError(f"Whitening: eps must be >= 0, got {eps!r}")
        self.k = k
        self.eps = float(eps)
        self._init_state(renormalize)

    def settings(self) -> dict[str, Any]:
        return {"k": self.k, "eps": self.eps, "renormalize": self.renormalize}

    def _fit_moments(self, mean: Tensor, cov: Tensor) -> dict[str, Any]:
        dim = mean.shape[0]
        k = dim if self.k is None else self.k
        if k > dim:
            raise ValueError(f"Whitening: k={k} is larger than the embedding dimension D={dim}")
        u, s = principal_directions(cov)
        w = u / torch.sqrt(s + self.eps)  # (D, D): U diag(1/sqrt(s)), Eq. 10
        self.mean = mean
        self.projection = w[:, :k].contiguous()  # 002 Algorithm 1, step 3
        self.singular_values = s
        return {"explained_variance": _explained_share(s, k)}

    @property
    def output_dim(self) -> int:
        self._require_fitted()
        return self.projection.shape[1]

    def _transform_flat(self, x: Tensor) -> Tensor:
        return (x - as_like(self.mean, x)) @ as_like(self.projection, x)  # (M, D) @ (D, k) -> (M, k)


class RemoveTopPCs(_MomentTransform):
    """All-but-the-top (Mu et al. 2017; 004 Section 2.5 "PCA"): centre, then remove the top principal directions.

    ``x' = (x - mu) - sum_{i<=n} (u_i^T (x - mu)) u_i`` where ``u_1..u_n`` are the top-n eigenvectors of the
    covariance. The output keeps dimension D and is orthogonal to the removed directions. ``n_components=0``
    only centres. Mu et al. suggest n ~ D/100 for word vectors; the right n for token embeddings is empirical.
    """

    name = "remove-pcs"
    _TENSORS = ("mean", "components")
    components: Tensor | None  # (n, D) float64, orthonormal rows, largest variance first

    def __init__(self, n_components: int = 1, renormalize: bool = True):
        if not isinstance(n_components, int) or isinstance(n_components, bool) or n_components < 0:
            raise ValueError(f"RemoveTopPCs: n_components must be an int >= 0, got {n_components!r}")
        self.n_components = n_components
        self._init_state(renormalize)

    def settings(self) -> dict[str, Any]:
        return {"n_components": self.n_components, "renormalize": self.renormalize}

    def _fit_moments(self, mean: Tensor, cov: Tensor) -> dict[str, Any]:
        if self.n_components >= mean.shape[0]:
            raise ValueError(f"RemoveTopPCs: n_components={self.n_components} must be < D={mean.shape[0]} "
                             "(removing every direction leaves nothing)")
        u, s = principal_directions(cov)
        self.mean = mean
        self.components = u[:, : self.n_components].T.contiguous()
        return {"removed_variance": _explained_share(s, self.n_components)}

    def _transform_flat(self, x: Tensor) -> Tensor:
        centred = x - as_like(self.mean, x)                    # (M, D)
        comps = as_like(self.components, x)                     # (n, D)
        return centred - (centred @ comps.T) @ comps            # minus projections on the top-n PCs


class Standardize(_MomentTransform):
    """Per-dimension standardization ``(x - mean) / std`` (004 Section 2.5 "Standardized").

    ``std`` is the unbiased standard deviation (the diagonal of 000 Eq. 8), floored at ``eps`` so constant
    dimensions map to 0 instead of dividing by zero. Unlike whitening this leaves correlations in place.
    """

    name = "standardize"
    _TENSORS = ("mean", "std")
    std: Tensor | None  # (D,) float64

    def __init__(self, eps: float = 1e-6, renormalize: bool = True):
        if not eps >= 0:
            raise ValueError(f"Standardize: eps must be >= 0, got {eps!r}")
        self.eps = float(eps)
        self._init_state(renormalize)

    def settings(self) -> dict[str, Any]:
        return {"eps": self.eps, "renormalize": self.renormalize}

    def _fit_moments(self, mean: Tensor, cov: Tensor) -> dict[str, Any]:
        self.mean = mean
        self.std = torch.sqrt(torch.diagonal(cov).clamp_min(0.0)).clamp_min(self.eps)
        return {}

    def _transform_flat(self, x: Tensor) -> Tensor:
        return (x - as_like(self.mean, x)) / as_like(self.std, x)
