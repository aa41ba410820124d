"""The interface every post-hoc isotropy transform implements, its registry and its file format.

A transform is fitted once on vectors of a frozen encoder and then maps token vectors of any leading shape:

    t = Whitening(k=64).fit(x)          # x (N, D): one row per vector the statistics are fitted on
    z = t.transform(tokens, mask)       # tokens (..., D) -> (..., D'), e.g. (B, L, D); zero where mask is False
    t.save(path); t2 = Whitening.load(path)      # any transform: hil.isotropy.postprocess.load_transform(path)
    t.to_dict() / Whitening.from_dict(d); t.name; t.settings()

Conventions shared by every transform (the module docstring of :mod:`hil.isotropy.postprocess` gives the why):
``renormalize`` L2-normalizes the output; ``transform(x, mask)`` zeroes positions where ``mask`` is False (the
``EncodedBatch`` convention); fitted parameters are float64 on the CPU, and ``transform`` runs in the input's dtype
and device.

Every concrete class declares a ``name``; defining the class registers it, so a saved payload is rebuilt by
looking its name up (:func:`transform_from_dict`). :mod:`hil.isotropy.postprocess` imports every transform class,
so loading through it knows every name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from hil.provenance import atomic_output, provenance

__all__ = ["PostTransform", "check_fit_input", "as_like", "transform_from_dict", "FORMAT_VERSION"]

FORMAT_VERSION = 1

_REGISTRY: dict[str, type["PostTransform"]] = {}  # name -> class, filled as transform classes are defined


# -- input checks and output shaping ------------------------------------------------------------------------------

def check_fit_input(x: Tensor, who: str, min_rows: int = 2) -> Tensor:
    """x must be a finite floating-point (N, D) tensor with at least ``min_rows`` rows; ``who`` names the caller."""
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


def as_like(t: Tensor, like: Tensor) -> Tensor:
    """A fitted (float64, CPU) parameter in the dtype and on the device of the input it is applied to."""
    return t.to(device=like.device, dtype=like.dtype)


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


# -- the interface ------------------------------------------------------------------------------------------------

class PostTransform:
    """Interface shared by all post-hoc transforms (a mixin: holds no state of its own).

    Subclasses define ``name``, ``settings()``, ``fit``, ``_transform_flat`` ((M, D) -> (M, D')),
    ``_state() -> dict[str, Tensor]``, ``_load_state(state)``, ``fitted``, ``input_dim`` / ``output_dim`` and a
    ``renormalize`` attribute.
    """

    name: ClassVar[str] = "?"
    FIT_KWARGS: ClassVar[tuple[str, ...]] = ()  # keyword arguments that go to fit(), not to the constructor

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:  # a concrete transform: rebuildable from a payload carrying its name
            _REGISTRY[cls.name] = cls

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

    @classmethod
    def _from_settings(cls, settings: dict[str, Any]) -> "PostTransform":
        """An unfitted instance from recorded settings (the constructor's arguments unless a subclass says else)."""
        return cls(**settings)

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
        return {"format_version": FORMAT_VERSION, "name": self.name, "settings": self.settings(),
                "state": self._state(), "fit_info": dict(getattr(self, "fit_info", {}))}

    @classmethod
    def from_dict(cls, payload: dict[str, Any]) -> "PostTransform":
        transform = transform_from_dict(payload)
        if not isinstance(transform, cls):
            raise TypeError(f"{cls.__name__}.from_dict: the payload holds a {type(transform).__name__} "
                            f"({payload.get('name')!r})")
        return transform

    def save(self, path: str | os.PathLike) -> Path:
        """torch.save of ``to_dict()`` plus provenance, through :func:`hil.provenance.atomic_output`."""
        payload = self.to_dict()
        payload["provenance"] = provenance(self.settings())
        with atomic_output(path) as tmp:
            torch.save(payload, tmp)
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PostTransform":
        """The transform saved at ``path``; a TypeError when it is not a ``cls``."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"load_transform: no file at {path}")
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - say which file was bad
            raise ValueError(f"{path}: not a saved transform ({error})") from error
        try:
            transform = transform_from_dict(payload)
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"{path}: {error}") from error
        if not isinstance(transform, cls):
            raise TypeError(f"{path}: holds a {type(transform).__name__}, not a {cls.__name__}")
        return transform

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"{type(self).__name__}({args}){'' if self.fitted else ' [not fitted]'}"


def transform_from_dict(payload: dict[str, Any]) -> PostTransform:
    """Rebuild a fitted transform from ``to_dict()``'s payload (its class found by name in the registry)."""
    where = "transform payload"
    if not isinstance(payload, dict) or "name" not in payload:
        raise ValueError(f"{where}: expected a dict with 'name', 'settings' and 'state'")
    version = payload.get("format_version", FORMAT_VERSION)
    if version > FORMAT_VERSION:
        raise ValueError(f"{where}: format_version {version} is newer than this code ({FORMAT_VERSION})")
    name = payload["name"]
    if name not in _REGISTRY:
        raise ValueError(f"{where}: unknown transform name {name!r}; known: {sorted(_REGISTRY)}")
    transform = _REGISTRY[name]._from_settings(dict(payload.get("settings", {})))
    transform._load_state(payload["state"])
    transform.fit_info = dict(payload.get("fit_info", {}))
    return transform
