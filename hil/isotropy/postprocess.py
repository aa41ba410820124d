"""Post-hoc isotropy transforms for frozen token embeddings: whitening, all-but-the-top, standardization, NICE.

These are the unsupervised post-processing methods of Jung et al. 2023 ("Isotropic Representation Can Improve
Dense Retrieval", paper 000, Section 4.1), Su et al. 2021 ("Whitening sentence representations", paper 002,
Section 3, Algorithm 1) and the transformations compared by Roychowdhury et al. (paper 004, Section 2.5):
whitening, centering + removal of the top principal components (Mu et al. 2017, "all-but-the-top") and
per-dimension standardization. They are fitted once on embeddings of a frozen encoder and applied at test time
before the late-interaction aggregator.

Every transform has the same small interface:

    t = Whitening(k=64).fit(x)          # x (N, D): one row per vector the statistics are fitted on
    z = t.transform(tokens)             # tokens (..., D) -> (..., D'), any leading shape, e.g. (B, L, D)
    t.save(path); t2 = load_transform(path)
    t.to_dict() / Whitening.from_dict(d); t.name; t.settings()

Choices where the papers leave room (each repeated in the docstring of the class concerned):

* **Renormalization.** ColBERT scores with cosines (MaxSim over L2-normalized vectors), and 000 "cascade[s] an
  aggregator that performs the cosine similarity calculation" after whitening or the flow (Section 4.1). A dot
  product of renormalized vectors *is* that cosine, so every transform takes ``renormalize`` (default True) and
  L2-normalizes its output; set it False to get the raw whitened / flowed vectors (e.g. to measure covariance).
  In a pipeline only the last step renormalizes (see :func:`fit_transform_from_config`).
* **Token-wise vs sequence-wise fitting** (000 Section 4.1.1): token-wise fits the statistics on every valid token
  vector; sequence-wise on one mean-pooled vector per sequence. 000 notes only token-wise applies to ColBERT
  (its score needs token vectors); sequence-wise is for single-vector scoring. :func:`pool_for_fitting` /
  :func:`fit_whitening` implement both; the transform itself always maps individual vectors.
* **Padding.** ``transform(x, mask)`` zeroes the output where ``mask`` is False, matching the ``EncodedBatch``
  convention (embeddings are zero where the scoring mask is False). Without a mask every position is mapped.
* **Precision.** Means and covariances are accumulated in float64 (in bounded chunks, so a large token matrix is
  never copied to float64 at once); transforms run in the input's dtype and device.
"""

from __future__ import annotations

import inspect
import math
import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hil.provenance import provenance

if TYPE_CHECKING:  # the encoder module pulls in transformers; only transform_encoded needs it, at call time
    from hil.modeling.contracts import EncodedBatch

__all__ = [
    "PostTransform", "MomentAccumulator", "Whitening", "RemoveTopPCs", "Standardize", "NICEFlow",
    "TransformPipeline", "pool_for_fitting", "fit_whitening", "make_transform", "parse_transform_spec",
    "fit_transform_from_config", "load_transform", "transform_encoded", "TRANSFORM_NAMES",
]

_FORMAT_VERSION = 1
_CHUNK_ROWS = 65536  # rows per float64 chunk when accumulating moments: bounds the temporary copy


# ----------------------------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------------------------

def _check_fit_input(x: Tensor, who: str, min_rows: int = 2) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{who}.fit: expected a torch.Tensor of shape (N, D), got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{who}.fit: expected a 2-D tensor (N, D) of vectors, got shape {tuple(x.shape)}; "
                         "flatten tokens first (see pool_for_fitting)")
    if not x.is_floating_point():
        raise TypeError(f"{who}.fit: expected a floating-point tensor, got dtype {x.dtype}")
    if x.shape[0] < min_rows:
        raise ValueError(f"{who}.fit: need at least {min_rows} vectors, got {x.shape[0]}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{who}.fit: input contains NaN or Inf")
    return x


def _flatten_last(x: Tensor, dim: int, who: str) -> tuple[Tensor, tuple[int, ...]]:
    """(..., D) -> ((M, D), leading shape), checking D."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"{who}.transform: expected a floating-point tensor (..., {dim})")
    if x.dim() < 1 or x.shape[-1] != dim:
        raise ValueError(f"{who}.transform: expected last dimension {dim}, got shape {tuple(x.shape)}")
    return x.reshape(-1, dim), tuple(x.shape[:-1])


def _finish(out: Tensor, lead: tuple[int, ...], renormalize: bool, mask: Tensor | None) -> Tensor:
    """(M, D') -> (..., D'), L2-normalized if asked, zero where mask is False."""
    out = out.reshape(*lead, out.shape[-1])
    if renormalize:
        out = F.normalize(out, p=2, dim=-1)
    if mask is not None:
        if tuple(mask.shape) != lead:
            raise ValueError(f"transform: mask shape {tuple(mask.shape)} does not match leading shape {lead}")
        out = out * mask.to(device=out.device, dtype=torch.bool).unsqueeze(-1).to(out.dtype)
    return out


def _as(t: Tensor, like: Tensor) -> Tensor:
    return t.to(device=like.device, dtype=like.dtype)


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
        _check_fit_input(x, "MomentAccumulator", min_rows=0)
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


def _moments(x: Tensor) -> tuple[Tensor, Tensor]:
    acc = MomentAccumulator().update(x)
    return acc.mean, acc.covariance


# ----------------------------------------------------------------------------------------------------------------
# base class
# ----------------------------------------------------------------------------------------------------------------

class PostTransform:
    """Interface shared by all post-hoc transforms (a mixin: holds no state of its own).

    Subclasses define ``name``, ``settings()``, ``fit``, ``_transform_flat`` ((M, D) -> (M, D')),
    ``_state() -> dict[str, Tensor]``, ``_load_state(state)``, ``input_dim`` / ``output_dim`` and a
    ``renormalize`` attribute.
    """

    name: ClassVar[str] = "?"
    FIT_KWARGS: ClassVar[tuple[str, ...]] = ()  # keyword arguments that go to fit(), not to the constructor

    # -- to be provided by subclasses ----------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        raise NotImplementedError

    def fit(self, x: Tensor) -> "PostTransform":
        raise NotImplementedError

    def _transform_flat(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def _state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    @property
    def fitted(self) -> bool:
        raise NotImplementedError

    @property
    def input_dim(self) -> int:
        raise NotImplementedError

    @property
    def output_dim(self) -> int:
        raise NotImplementedError

    # -- shared --------------------------------------------------------------------------------------------------
    def _require_fitted(self) -> None:
        if not self.fitted:
            raise RuntimeError(f"{type(self).__name__} ({self.name}) is not fitted: call fit(x) or load(path) first")

    def transform(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x (..., D) -> (..., D'); L2-normalized if ``renormalize``; zero where ``mask`` (...) is False."""
        self._require_fitted()
        flat, lead = _flatten_last(x, self.input_dim, type(self).__name__)
        return _finish(self._transform_flat(flat), lead, self.renormalize, mask)

    def fit_transform(self, x: Tensor, **fit_kwargs: Any) -> Tensor:
        return self.fit(x, **fit_kwargs).transform(x)

    def to_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild the fitted transform: name, settings, tensors, fit information."""
        self._require_fitted()
        return {"format_version": _FORMAT_VERSION, "name": self.name, "settings": self.settings(),
                "state": self._state(), "fit_info": dict(getattr(self, "fit_info", {}))}

    @classmethod
    def from_dict(cls, payload: dict[str, Any]) -> "PostTransform":
        transform = _from_dict(payload)
        if not isinstance(transform, cls):
            raise TypeError(f"{cls.__name__}.from_dict: the payload holds a {type(transform).__name__} "
                            f"({payload.get('name')!r})")
        return transform

    def save(self, path: str | os.PathLike) -> Path:
        """torch.save of ``to_dict()`` plus provenance, written to a temporary file then renamed (atomic)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = self.to_dict()
        payload["provenance"] = provenance(self.settings())
        handle = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False)
        try:
            with handle:
                torch.save(payload, handle)
            os.replace(handle.name, path)
        except BaseException:
            Path(handle.name).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PostTransform":
        transform = load_transform(path)
        if not isinstance(transform, cls):
            raise TypeError(f"{path}: holds a {type(transform).__name__}, not a {cls.__name__}")
        return transform

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"{type(self).__name__}({args}){'' if self.fitted else ' [not fitted]'}"


# ----------------------------------------------------------------------------------------------------------------
# linear transforms
# ----------------------------------------------------------------------------------------------------------------

class Whitening(PostTransform):
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

    def __init__(self, k: int | None = None, eps: float = 1e-6, renormalize: bool = True):
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(f"Whitening: k must be a positive int or None, got {k!r}")
        if not eps >= 0:
            raise ValueError(f"Whitening: eps must be >= 0, got {eps!r}")
        self.k = k
        self.eps = float(eps)
        self.renormalize = bool(renormalize)
        self.mean: Tensor | None = None             # (D,) float64
        self.projection: Tensor | None = None       # (D, k) float64: first k columns of U diag(1/sqrt(s))
        self.singular_values: Tensor | None = None  # (D,) float64: s, descending (variance per PC)
        self.fit_info: dict[str, Any] = {}

    def settings(self) -> dict[str, Any]:
        return {"k": self.k, "eps": self.eps, "renormalize": self.renormalize}

    def fit(self, x: Tensor) -> "Whitening":
        """Fit mu and W on the rows of x (N, D) (000 Eqs. 7-9)."""
        _check_fit_input(x, "Whitening")
        mean, cov = _moments(x)
        return self.fit_moments(mean, cov, count=x.shape[0])

    def fit_moments(self, mean: Tensor, covariance: Tensor, count: int | None = None) -> "Whitening":
        """Fit from precomputed mean (D,) and covariance (D, D), e.g. from a :class:`MomentAccumulator`."""
        dim = mean.shape[-1]
        if mean.dim() != 1 or tuple(covariance.shape) != (dim, dim):
            raise ValueError(f"Whitening.fit_moments: expected mean (D,) and covariance (D, D), got "
                             f"{tuple(mean.shape)} and {tuple(covariance.shape)}")
        k = dim if self.k is None else self.k
        if k > dim:
            raise ValueError(f"Whitening: k={k} is larger than the embedding dimension D={dim}")
        cov = covariance.detach().to("cpu", torch.float64)
        u, s, _ = torch.linalg.svd(cov)  # Eq. 9: Sigma = U diag(s) U^T, s descending
        s = s.clamp_min(0.0)  # tiny negative values from round-off
        w = u / torch.sqrt(s + self.eps)  # (D, D): U diag(1/sqrt(s)), Eq. 10
        self.mean = mean.detach().to("cpu", torch.float64)
        self.projection = w[:, :k].contiguous()  # 002 Algorithm 1, step 3
        self.singular_values = s
        self.fit_info = {"n_vectors": count, "dim": dim,
                         "explained_variance": float(s[:k].sum() / s.sum().clamp_min(1e-300))}
        return self

    @property
    def fitted(self) -> bool:
        return self.projection is not None

    @property
    def input_dim(self) -> int:
        self._require_fitted()
        return self.projection.shape[0]

    @property
    def output_dim(self) -> int:
        self._require_fitted()
        return self.projection.shape[1]

    def _transform_flat(self, x: Tensor) -> Tensor:
        return (x - _as(self.mean, x)) @ _as(self.projection, x)  # (M, D) @ (D, k) -> (M, k)

    def _state(self) -> dict[str, Any]:
        return {"mean": self.mean, "projection": self.projection, "singular_values": self.singular_values}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.mean = state["mean"].to(torch.float64)
        self.projection = state["projection"].to(torch.float64)
        self.singular_values = state["singular_values"].to(torch.float64)


class RemoveTopPCs(PostTransform):
    """All-but-the-top (Mu et al. 2017; 004 Section 2.5 "PCA"): centre, then remove the top principal directions.

    ``x' = (x - mu) - sum_{i<=n} (u_i^T (x - mu)) u_i`` where ``u_1..u_n`` are the top-n eigenvectors of the
    covariance. The output keeps dimension D and is orthogonal to the removed directions. ``n_components=0``
    only centres. Mu et al. suggest n ~ D/100 for word vectors; the right n for token embeddings is empirical.
    """

    name = "remove-pcs"

    def __init__(self, n_components: int = 1, renormalize: bool = True):
        if not isinstance(n_components, int) or isinstance(n_components, bool) or n_components < 0:
            raise ValueError(f"RemoveTopPCs: n_components must be an int >= 0, got {n_components!r}")
        self.n_components = n_components
        self.renormalize = bool(renormalize)
        self.mean: Tensor | None = None        # (D,) float64
        self.components: Tensor | None = None  # (n, D) float64, orthonormal rows, largest variance first
        self.fit_info: dict[str, Any] = {}

    def settings(self) -> dict[str, Any]:
        return {"n_components": self.n_components, "renormalize": self.renormalize}

    def fit(self, x: Tensor) -> "RemoveTopPCs":
        _check_fit_input(x, "RemoveTopPCs")
        if self.n_components >= x.shape[1]:
            raise ValueError(f"RemoveTopPCs: n_components={self.n_components} must be < D={x.shape[1]} "
                             "(removing every direction leaves nothing)")
        mean, cov = _moments(x)
        u, s, _ = torch.linalg.svd(cov)
        self.mean = mean
        self.components = u[:, : self.n_components].T.contiguous()
        self.fit_info = {"n_vectors": x.shape[0], "dim": x.shape[1],
                         "removed_variance": float(s[: self.n_components].sum() / s.sum().clamp_min(1e-300))}
        return self

    @property
    def fitted(self) -> bool:
        return self.components is not None

    @property
    def input_dim(self) -> int:
        self._require_fitted()
        return self.mean.shape[0]

    @property
    def output_dim(self) -> int:
        return self.input_dim

    def _transform_flat(self, x: Tensor) -> Tensor:
        centred = x - _as(self.mean, x)                        # (M, D)
        comps = _as(self.components, x)                         # (n, D)
        return centred - (centred @ comps.T) @ comps            # minus projections on the top-n PCs

    def _state(self) -> dict[str, Any]:
        return {"mean": self.mean, "components": self.components}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.mean = state["mean"].to(torch.float64)
        self.components = state["components"].to(torch.float64)


class Standardize(PostTransform):
    """Per-dimension standardization ``(x - mean) / std`` (004 Section 2.5 "Standardized").

    ``std`` is the unbiased standard deviation (the diagonal of 000 Eq. 8), floored at ``eps`` so constant
    dimensions map to 0 instead of dividing by zero. Unlike whitening this leaves correlations in place.
    """

    name = "standardize"

    def __init__(self, eps: float = 1e-6, renormalize: bool = True):
        if not eps >= 0:
            raise ValueError(f"Standardize: eps must be >= 0, got {eps!r}")
        self.eps = float(eps)
        self.renormalize = bool(renormalize)
        self.mean: Tensor | None = None  # (D,) float64
        self.std: Tensor | None = None   # (D,) float64
        self.fit_info: dict[str, Any] = {}

    def settings(self) -> dict[str, Any]:
        return {"eps": self.eps, "renormalize": self.renormalize}

    def fit(self, x: Tensor) -> "Standardize":
        _check_fit_input(x, "Standardize")
        mean, cov = _moments(x)
        self.mean = mean
        self.std = torch.sqrt(torch.diagonal(cov).clamp_min(0.0)).clamp_min(self.eps)
        self.fit_info = {"n_vectors": x.shape[0], "dim": x.shape[1]}
        return self

    @property
    def fitted(self) -> bool:
        return self.std is not None

    @property
    def input_dim(self) -> int:
        self._require_fitted()
        return self.mean.shape[0]

    @property
    def output_dim(self) -> int:
        return self.input_dim

    def _transform_flat(self, x: Tensor) -> Tensor:
        return (x - _as(self.mean, x)) / _as(self.std, x)

    def _state(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.mean = state["mean"].to(torch.float64)
        self.std = state["std"].to(torch.float64)


# ----------------------------------------------------------------------------------------------------------------
# NICE normalizing flow
# ----------------------------------------------------------------------------------------------------------------

class _AdditiveCoupling(nn.Module):
    """NICE additive coupling (Dinh et al. 2014, Eq. for additive coupling): ``y_b = x_b + m(x_a)``, ``y_a = x_a``.

    Volume preserving: log|det J| = 0. ``m`` is an MLP with ReLU hidden layers; its last layer starts at zero so
    the untrained coupling is the identity.
    """

    def __init__(self, dim: int, kept: Tensor, changed: Tensor, hidden: int, hidden_layers: int):
        super().__init__()
        self.register_buffer("kept", kept)        # indices x_a (conditioning half)
        self.register_buffer("changed", changed)  # indices x_b (shifted half)
        layers: list[nn.Module] = []
        width = len(kept)
        for _ in range(hidden_layers):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        last = nn.Linear(width, len(changed))
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
        self.shift_net = nn.Sequential(*layers, last)

    def _shift(self, x: Tensor, sign: float) -> Tensor:
        out = x.clone()
        out[:, self.changed] = x[:, self.changed] + sign * self.shift_net(x[:, self.kept])
        return out

    def forward(self, x: Tensor) -> Tensor:
        return self._shift(x, 1.0)

    def inverse(self, y: Tensor) -> Tensor:
        return self._shift(y, -1.0)  # x_a = y_a, so m(x_a) = m(y_a)


class NICEFlow(nn.Module, PostTransform):
    """NICE normalizing flow (Dinh et al. 2014) as used by 000 Section 4.1.1 (token-wise density estimation).

    ``f(x) = exp(log_scale) * (c_K o ... o c_1)(x - center)``: K additive coupling layers with alternating
    even/odd index partitions, then NICE's diagonal scaling layer. Additive couplings have unit Jacobian, so
    ``log|det Df(x)| = sum(log_scale)``, and under the standard Gaussian prior 000 uses (Eq. 5)
    ``log p_X(x) = sum_d log N(f(x)_d; 0, 1) + sum(log_scale)``. ``fit`` maximizes that likelihood on frozen
    embeddings; ``transform`` returns ``z = f(x)`` (L2-normalized when ``renormalize``).

    Choices: ``center`` is a fixed (non-trainable, volume-preserving) shift set to the data mean, and
    ``log_scale`` starts at ``-log(std)`` of the data, on the first ``fit`` (a data-dependent initialization in
    the spirit of Glow's ActNorm): with zero-initialized coupling outputs the untrained flow is exactly
    per-dimension standardization, and training can only improve on it. 000 used 5-layer, 1000-unit coupling
    networks and lr 1e-4 for several epochs on GPU (Section 5.1.2); the defaults here (``hidden=256``,
    ``hidden_layers=2``, lr 1e-3) are sized for a few hundred CPU steps -- pass ``hidden=1000, hidden_layers=5``
    to follow 000.
    """

    name = "nice"
    FIT_KWARGS = ("epochs", "batch_size", "lr", "seed", "max_steps", "weight_decay")

    def __init__(self, dim: int, n_couplings: int = 4, hidden: int = 256, hidden_layers: int = 2,
                 renormalize: bool = True, init_seed: int = 0):
        nn.Module.__init__(self)
        if not isinstance(dim, int) or dim < 2:
            raise ValueError(f"NICEFlow: dim must be an int >= 2 (a coupling splits the vector), got {dim!r}")
        if n_couplings < 1 or hidden < 1 or hidden_layers < 0:
            raise ValueError(f"NICEFlow: need n_couplings >= 1, hidden >= 1, hidden_layers >= 0; got "
                             f"{n_couplings}, {hidden}, {hidden_layers}")
        self.dim = dim
        self.n_couplings = n_couplings
        self.hidden = hidden
        self.hidden_layers = hidden_layers
        self.renormalize = bool(renormalize)
        self.init_seed = init_seed
        even = torch.arange(0, dim, 2)
        odd = torch.arange(1, dim, 2)
        with torch.random.fork_rng(devices=[]):  # reproducible init without touching the global RNG
            torch.manual_seed(init_seed)
            self.couplings = nn.ModuleList(
                _AdditiveCoupling(dim, *((even, odd) if i % 2 == 0 else (odd, even)), hidden, hidden_layers)
                for i in range(n_couplings))
        self.log_scale = nn.Parameter(torch.zeros(dim))            # NICE diagonal scaling layer
        self.register_buffer("center", torch.zeros(dim))           # fixed shift, set from data on first fit
        self.register_buffer("initialized", torch.tensor(False))   # data-dependent init done / flow fitted
        self.fit_info: dict[str, Any] = {}
        self.history: list[float] = []  # mean training NLL (nats per vector) per epoch

    # -- flow ----------------------------------------------------------------------------------------------------
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        """x (M, D) -> z = f(x) (M, D), log|det Df(x)| (M,)."""
        h = x - self.center
        for coupling in self.couplings:
            h = coupling(h)
        z = h * torch.exp(self.log_scale)
        log_det = self.log_scale.sum().expand(x.shape[0])
        return z, log_det

    def inverse(self, z: Tensor) -> Tensor:
        """z (M, D) -> x = f^{-1}(z) (M, D)."""
        h = z * torch.exp(-self.log_scale)
        for coupling in reversed(self.couplings):
            h = coupling.inverse(h)
        return h + self.center

    def log_prob(self, x: Tensor) -> Tensor:
        """000 Eq. 5 with a standard Gaussian p_Z: log p_X(x) = log p_Z(f(x)) + log|det Df(x)|. x (M, D) -> (M,)"""
        z, log_det = self(x)
        log_pz = -0.5 * (z ** 2).sum(dim=-1) - 0.5 * self.dim * math.log(2 * math.pi)
        return log_pz + log_det

    # -- PostTransform -------------------------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        return {"dim": self.dim, "n_couplings": self.n_couplings, "hidden": self.hidden,
                "hidden_layers": self.hidden_layers, "renormalize": self.renormalize, "init_seed": self.init_seed}

    @property
    def fitted(self) -> bool:
        return bool(self.initialized)

    @property
    def input_dim(self) -> int:
        return self.dim

    @property
    def output_dim(self) -> int:
        return self.dim

    @torch.no_grad()
    def _data_init(self, x: Tensor) -> None:
        mean, cov = _moments(x)
        std = torch.sqrt(torch.diagonal(cov).clamp_min(1e-12))
        self.center.copy_(mean.to(self.center.dtype))
        self.log_scale.copy_((-torch.log(std)).to(self.log_scale.dtype))
        self.initialized.fill_(True)

    def fit(self, x: Tensor, epochs: int = 10, batch_size: int = 256, lr: float = 1e-3, seed: int = 0,
            max_steps: int | None = None, weight_decay: float = 0.0) -> "NICEFlow":
        """Maximum-likelihood training on frozen embeddings x (N, D) with Adam (000 Section 4.1.1).

        The first call also sets ``center`` and ``log_scale`` from x (see the class docstring); later calls
        continue training from the current parameters. ``seed`` fixes the minibatch order.
        """
        _check_fit_input(x, "NICEFlow")
        if x.shape[1] != self.dim:
            raise ValueError(f"NICEFlow.fit: flow has dim {self.dim}, data has D={x.shape[1]}")
        param = self.log_scale
        data = x.detach().to(device=param.device, dtype=param.dtype)
        if not self.fitted:
            self._data_init(data)
        optimizer = torch.optim.Adam(self.parameters(), lr=lr, weight_decay=weight_decay, foreach=True)
        generator = torch.Generator().manual_seed(seed)
        n = data.shape[0]
        steps = 0
        self.train()
        for _ in range(epochs):
            order = torch.randperm(n, generator=generator).to(data.device)
            total, seen = 0.0, 0
            for start in range(0, n, batch_size):
                batch = data[order[start:start + batch_size]]
                loss = -self.log_prob(batch).mean()  # NLL in nats per vector
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += float(loss.detach()) * batch.shape[0]
                seen += batch.shape[0]
                steps += 1
                if max_steps is not None and steps >= max_steps:
                    break
            self.history.append(total / max(seen, 1))
            if max_steps is not None and steps >= max_steps:
                break
        self.eval()
        self.fit_info = {"n_vectors": n, "dim": self.dim, "epochs": epochs, "batch_size": batch_size, "lr": lr,
                         "seed": seed, "steps": self.fit_info.get("steps", 0) + steps,
                         "final_train_nll": self.history[-1] if self.history else None}
        return self

    def _transform_flat(self, x: Tensor) -> Tensor:
        param = self.log_scale
        with torch.no_grad():
            z, _ = self(x.to(device=param.device, dtype=param.dtype))
        return z.to(device=x.device, dtype=x.dtype)

    def _state(self) -> dict[str, Any]:
        return {k: v.detach().cpu() for k, v in self.state_dict().items()}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.to(dtype=state["log_scale"].dtype)  # a flow saved in float64 loads in float64
        self.load_state_dict(state)
        self.eval()

    def __repr__(self) -> str:  # nn.Module's repr lists layers; the settings say more here
        return PostTransform.__repr__(self)


# ----------------------------------------------------------------------------------------------------------------
# pipeline, registry, config specs
# ----------------------------------------------------------------------------------------------------------------

class TransformPipeline(PostTransform):
    """Transforms applied in order; ``fit`` fits each step on the output of the previous ones.

    An empty pipeline is the identity (spec "none"). Renormalization is each step's own setting: build
    pipelines with :func:`fit_transform_from_config` to renormalize only after the last step.
    """

    name = "pipeline"

    def __init__(self, steps: Iterable[PostTransform] = ()):
        self.steps = list(steps)
        for step in self.steps:
            if not isinstance(step, PostTransform):
                raise TypeError(f"TransformPipeline: step {step!r} is not a PostTransform")
        self.renormalize = False  # steps renormalize themselves
        self._input_dim: int | None = None
        self.fit_info: dict[str, Any] = {}

    @property
    def spec(self) -> str:
        """A spec string that rebuilds these (unfitted) steps with :func:`parse_transform_spec` / make_transform."""
        parts = []
        for step in self.steps:
            items = {k: v for k, v in step.settings().items() if not (step.name == "nice" and k == "dim")}
            parts.append(":".join([step.name, *(f"{k}={v}" for k, v in items.items())]))
        return ",".join(parts) or "none"

    def settings(self) -> dict[str, Any]:
        return {"spec": self.spec, "steps": [{"name": s.name, **s.settings()} for s in self.steps]}

    def fit(self, x: Tensor, fit_kwargs: list[dict[str, Any]] | None = None) -> "TransformPipeline":
        _check_fit_input(x, "TransformPipeline", min_rows=1)
        fit_kwargs = fit_kwargs or [{} for _ in self.steps]
        if len(fit_kwargs) != len(self.steps):
            raise ValueError(f"TransformPipeline.fit: {len(fit_kwargs)} fit_kwargs for {len(self.steps)} steps")
        self._input_dim = x.shape[1]
        h = x
        for i, (step, kwargs) in enumerate(zip(self.steps, fit_kwargs)):
            step.fit(h, **kwargs)
            if i + 1 < len(self.steps):
                h = step.transform(h)
        self.fit_info = {"n_vectors": x.shape[0], "dim": x.shape[1]}
        return self

    @property
    def fitted(self) -> bool:
        return self._input_dim is not None and all(step.fitted for step in self.steps)

    @property
    def input_dim(self) -> int:
        self._require_fitted()
        return self._input_dim

    @property
    def output_dim(self) -> int:
        return self.steps[-1].output_dim if self.steps else self.input_dim

    def _transform_flat(self, x: Tensor) -> Tensor:
        for step in self.steps:
            x = step.transform(x)
        return x

    def _state(self) -> dict[str, Any]:
        return {"input_dim": self._input_dim, "steps": [step.to_dict() for step in self.steps]}

    def _load_state(self, state: dict[str, Any]) -> None:
        self._input_dim = int(state["input_dim"])
        self.steps = [_from_dict(step) for step in state["steps"]]

    def __len__(self) -> int:
        return len(self.steps)


_CLASSES: dict[str, type[PostTransform]] = {
    cls.name: cls for cls in (Whitening, RemoveTopPCs, Standardize, NICEFlow, TransformPipeline)}

TRANSFORM_NAMES = ("whitening", "whitening-k", "remove-pcs", "standardize", "nice")


def _from_dict(payload: dict[str, Any]) -> PostTransform:
    where = "transform payload"
    if not isinstance(payload, dict) or "name" not in payload:
        raise ValueError(f"{where}: expected a dict with 'name', 'settings' and 'state'")
    version = payload.get("format_version", _FORMAT_VERSION)
    if version > _FORMAT_VERSION:
        raise ValueError(f"{where}: format_version {version} is newer than this code ({_FORMAT_VERSION})")
    name = payload["name"]
    if name not in _CLASSES:
        raise ValueError(f"{where}: unknown transform name {name!r}; known: {sorted(_CLASSES)}")
    cls = _CLASSES[name]
    settings = dict(payload.get("settings", {}))
    if cls is TransformPipeline:
        transform: PostTransform = TransformPipeline()
    else:
        transform = cls(**settings)
    transform._load_state(payload["state"])
    transform.fit_info = dict(payload.get("fit_info", {}))
    return transform


def load_transform(path: str | os.PathLike) -> PostTransform:
    """Rebuild any transform written by ``save``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_transform: no file at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - say which file was bad
        raise ValueError(f"{path}: not a saved transform ({error})") from error
    try:
        return _from_dict(payload)
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{path}: {error}") from error


def make_transform(name: str, **kwargs: Any) -> PostTransform:
    """An unfitted transform by registry name.

    "whitening" (k=None: full dimension, 000 Eq. 10), "whitening-k" (requires ``k``, 002 Algorithm 1;
    "whitening-<k>" such as "whitening-64" also works), "remove-pcs", "standardize", "nice" (requires ``dim``).
    """
    key = name.strip().lower()
    shorthand = re.fullmatch(r"whitening-(\d+)", key)
    if shorthand:
        if "k" in kwargs and kwargs["k"] != int(shorthand.group(1)):
            raise ValueError(f"make_transform: {name!r} conflicts with k={kwargs['k']!r}")
        return Whitening(**{**kwargs, "k": int(shorthand.group(1))})
    factories: dict[str, Callable[..., PostTransform]] = {
        "whitening": Whitening, "whitening-k": Whitening, "remove-pcs": RemoveTopPCs,
        "standardize": Standardize, "nice": NICEFlow}
    if key not in factories:
        raise ValueError(f"make_transform: unknown transform {name!r}; known: {list(TRANSFORM_NAMES)} "
                         "or whitening-<k>")
    if key == "whitening-k" and kwargs.get("k") is None:
        raise ValueError("make_transform: 'whitening-k' needs k (e.g. 'whitening-k:k=64' or 'whitening-64')")
    if key == "nice" and "dim" not in kwargs:
        raise ValueError("make_transform: 'nice' needs dim (fit_transform_from_config fills it from the data)")
    factory = factories[key]
    allowed = set(inspect.signature(factory).parameters)
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ValueError(f"make_transform: {name!r} does not take {unknown}; it takes {sorted(allowed)}")
    return factory(**kwargs)


def _parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text.strip()


def parse_transform_spec(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """Parse ``"standardize,whitening:k=64"`` into ``[("standardize", {}), ("whitening", {"k": 64})]``.

    Grammar: steps separated by ","; a step is ``name`` followed by ``:key=value`` pairs separated by ":" (or
    ";"), e.g. ``"nice:epochs=5:lr=1e-3"``. Values are parsed as bool / none / int / float / string.
    "" and "none" mean no transform.
    """
    if not isinstance(spec, str):
        raise TypeError(f"transform spec must be a string, got {type(spec).__name__}")
    if spec.strip().lower() in ("", "none", "identity"):
        return []
    steps = []
    for part in spec.split(","):
        pieces = [p.strip() for p in re.split(r"[:;]", part)]
        if not pieces[0]:
            raise ValueError(f"transform spec {spec!r}: empty step name in {part!r}")
        kwargs: dict[str, Any] = {}
        for piece in pieces[1:]:
            if not piece:
                continue
            if "=" not in piece:
                raise ValueError(f"transform spec {spec!r}: expected key=value, got {piece!r} in step {part!r}")
            key, value = piece.split("=", 1)
            kwargs[key.strip()] = _parse_value(value)
        steps.append((pieces[0].lower(), kwargs))
    return steps


def fit_transform_from_config(spec: str, x: Tensor, mask: Tensor | None = None, mode: str = "token",
                              renormalize: bool = True) -> TransformPipeline:
    """Build and fit the pipeline a spec string describes (e.g. "whitening:k=64", "standardize,whitening").

    x is (N, D) vectors, or (..., L, D) token embeddings with ``mask`` (..., L) (see :func:`pool_for_fitting`
    for ``mode``). Every step but the last is built with ``renormalize=False`` (normalizing between, say,
    standardization and whitening would change what the whitening sees); the last step gets ``renormalize``.
    A step's own ``renormalize=...`` in the spec wins. Keys a transform's ``fit`` takes (NICE: epochs,
    batch_size, lr, seed, max_steps, weight_decay) go to ``fit``; NICE's ``dim`` is filled from the data.
    """
    vectors = pool_for_fitting(x, mask=mask, mode=mode)
    parsed = parse_transform_spec(spec)
    steps: list[PostTransform] = []
    fit_kwargs: list[dict[str, Any]] = []
    dim = vectors.shape[1]
    for i, (name, kwargs) in enumerate(parsed):
        kwargs = dict(kwargs)
        kwargs.setdefault("renormalize", renormalize if i == len(parsed) - 1 else False)
        fit_keys = NICEFlow.FIT_KWARGS if name == "nice" else ()
        step_fit = {k: kwargs.pop(k) for k in list(kwargs) if k in fit_keys}
        if name == "nice":
            kwargs.setdefault("dim", dim)
        try:
            step = make_transform(name, **kwargs)
        except (TypeError, ValueError) as error:
            raise ValueError(f"transform spec {spec!r}, step {i + 1} ({name}): {error}") from error
        steps.append(step)
        fit_kwargs.append(step_fit)
        # the next step's input dimension (only NICE needs it, and only Whitening-k changes it)
        if isinstance(step, Whitening) and step.k is not None:
            dim = step.k
    return TransformPipeline(steps).fit(vectors, fit_kwargs)


# ----------------------------------------------------------------------------------------------------------------
# token-wise / sequence-wise fitting, encoded batches
# ----------------------------------------------------------------------------------------------------------------

def pool_for_fitting(embeddings: Tensor, mask: Tensor | None = None, mode: str = "token") -> Tensor:
    """The vectors a transform is fitted on, token-wise or sequence-wise (000 Section 4.1.1).

    embeddings (..., L, D) with mask (..., L) (True = real token), or (N, D) already-flat vectors (token mode
    only, no mask). ``mode="token"``: every valid token vector -> (T, D). ``mode="sequence"``: the masked mean of
    each sequence's token vectors -> (S, D); sequences with no valid token are dropped (they have no mean).
    Without a mask every position counts as valid.
    """
    if mode not in ("token", "sequence"):
        raise ValueError(f"pool_for_fitting: mode must be 'token' or 'sequence', got {mode!r}")
    if not isinstance(embeddings, Tensor):
        raise TypeError(f"pool_for_fitting: expected a tensor, got {type(embeddings).__name__}")
    if embeddings.dim() == 2 and mask is None:
        if mode == "sequence":
            raise ValueError("pool_for_fitting: mode='sequence' needs token embeddings (..., L, D), got (N, D)")
        return embeddings
    if embeddings.dim() < 2:
        raise ValueError(f"pool_for_fitting: expected (..., L, D), got shape {tuple(embeddings.shape)}")
    if mask is None:
        mask = torch.ones(embeddings.shape[:-1], dtype=torch.bool, device=embeddings.device)
    if tuple(mask.shape) != tuple(embeddings.shape[:-1]):
        raise ValueError(f"pool_for_fitting: mask shape {tuple(mask.shape)} does not match embeddings "
                         f"{tuple(embeddings.shape)}")
    mask = mask.to(torch.bool)
    if mode == "token":
        return embeddings[mask]  # (T, D)
    if embeddings.dim() < 3:
        raise ValueError(f"pool_for_fitting: mode='sequence' needs (..., L, D), got {tuple(embeddings.shape)}")
    dim = embeddings.shape[-1]
    flat = embeddings.reshape(-1, embeddings.shape[-2], dim)  # (S, L, D)
    flat_mask = mask.reshape(-1, mask.shape[-1])               # (S, L)
    weights = flat_mask.to(embeddings.dtype).unsqueeze(-1)     # (S, L, 1)
    counts = weights.sum(dim=1)                                # (S, 1)
    pooled = (flat * weights).sum(dim=1) / counts.clamp_min(1)  # (S, D)
    return pooled[counts.squeeze(-1) > 0]


def fit_whitening(token_embeddings: Tensor, mode: str = "token", mask: Tensor | None = None,
                  k: int | None = None, eps: float = 1e-6, renormalize: bool = True) -> Whitening:
    """Whitening fitted token-wise (every valid token vector) or sequence-wise (mean-pooled sequences).

    000 Section 4.1.1-4.1.2: token-wise is the one that applies to ColBERT; sequence-wise statistics describe
    pooled sequence vectors (RepBERT's single-vector case). The fitted transform maps individual vectors either
    way; ``fit_info["mode"]`` records which statistics it holds.
    """
    vectors = pool_for_fitting(token_embeddings, mask=mask, mode=mode)
    whitening = Whitening(k=k, eps=eps, renormalize=renormalize).fit(vectors)
    whitening.fit_info["mode"] = mode
    return whitening


def transform_encoded(batch: "EncodedBatch", transform: PostTransform,
                      heads: Iterable[str] | None = None) -> "EncodedBatch":
    """Apply a fitted transform to the chosen heads (all by default) of an EncodedBatch, keeping the mask.

    Positions outside ``batch.mask`` stay zero, as the encoder leaves them.
    """
    from hil.modeling.contracts import EncodedBatch

    chosen = set(batch.heads) if heads is None else set(heads)
    missing = chosen - set(batch.heads)
    if missing:
        raise KeyError(f"transform_encoded: batch has no head(s) {sorted(missing)}; it has {sorted(batch.heads)}")
    new_heads = {name: transform.transform(emb, mask=batch.mask) if name in chosen else emb
                 for name, emb in batch.heads.items()}
    return EncodedBatch(new_heads, batch.mask, batch.input_ids)
