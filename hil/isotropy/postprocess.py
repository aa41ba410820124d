"""Post-hoc isotropy transforms for frozen token embeddings: whitening, all-but-the-top, standardization, NICE.

These are the unsupervised post-processing methods of Jung et al. 2023 ("Isotropic Representation Can Improve
Dense Retrieval", paper 000, Section 4.1), Su et al. 2021 ("Whitening sentence representations", paper 002,
Section 3, Algorithm 1) and the transformations compared by Roychowdhury et al. (paper 004, Section 2.5):
whitening, centering + removal of the top principal components (Mu et al. 2017, "all-but-the-top") and
per-dimension standardization. They are fitted once on embeddings of a frozen encoder and applied at test time
before the late-interaction aggregator.

Where things are: the interface, registry and file format in :mod:`hil.isotropy.post_transform`; moment
accumulation and the linear transforms (whitening, all-but-the-top, standardization) in
:mod:`hil.isotropy.linear_transforms`; the NICE flow in :mod:`hil.isotropy.nice_flow`; this module holds pipelines,
the spec strings configs use (``"standardize,whitening:k=64"``), loading any saved transform, and the choice of
fitting vectors. Applying a fitted transform to an encoder's heads is
:class:`hil.retrieval.transformed.TransformedEncoder`.

    pipeline = fit_transform_from_config("whitening:k=64", token_embeddings, mask)   # fitted TransformPipeline
    z = pipeline.transform(tokens, mask)     # tokens (..., D) -> (..., D'), any leading shape, e.g. (B, L, D)
    pipeline.save(path); again = load_transform(path)

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
import os
import re
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from hil.isotropy.linear_transforms import RemoveTopPCs, Standardize, Whitening
from hil.isotropy.nice_flow import NICEFlow
from hil.isotropy.post_transform import PostTransform, check_fit_input, transform_from_dict

__all__ = [
    "TransformPipeline", "pool_for_fitting", "fit_whitening", "make_transform", "parse_transform_spec",
    "fit_transform_from_config", "load_transform", "TRANSFORM_NAMES",
]


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
        check_fit_input(x, "TransformPipeline", min_rows=1)
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

    @classmethod
    def _from_settings(cls, settings: dict[str, Any]) -> "TransformPipeline":
        return cls()  # the steps come back from the state, each with its own settings

    def _load_state(self, state: dict[str, Any]) -> None:
        self._input_dim = int(state["input_dim"])
        self.steps = [transform_from_dict(step) for step in state["steps"]]

    def __len__(self) -> int:
        return len(self.steps)


TRANSFORM_NAMES = ("whitening", "whitening-k", "remove-pcs", "standardize", "nice")


def load_transform(path: str | os.PathLike) -> PostTransform:
    """Rebuild any transform written by ``save`` (every transform class is imported here, so every name is known)."""
    return PostTransform.load(path)


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
# token-wise / sequence-wise fitting
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
