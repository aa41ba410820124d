"""The settings of the isotropy x engine study (``hil engines``, :mod:`hil.experiments.engines`), without torch, so
that the command's ``--help`` needs nothing more: :class:`EngineStudySettings`, and the one reader of its models'
``NAME=PATH`` / ``NAME@SEED=PATH``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from hil.errors import UserError

if TYPE_CHECKING:
    from hil.evaluation.experiment import ModelSpec


def model_spec(value: str) -> ModelSpec:
    """``NAME=PATH``, or ``NAME@SEED=PATH`` (one training of the method NAME) -> its model; else a UserError naming
    the ``model`` setting."""
    from hil.evaluation.experiment import ModelSpec

    name, sep, path = value.partition("=")
    method, at, seed_text = name.partition("@")
    if not sep or not method or not path or (at and not seed_text.isdigit()):
        raise UserError(f"`model`: name=path or name@seed=path expected, got {value!r}")
    if at:
        return ModelSpec(path, name=f"{method} (seed {seed_text})", seed=int(seed_text), method=method)
    return ModelSpec(path, name=method)


@dataclass
class EngineStudySettings:
    """The settings of hil engines, each field the option of its name.

    What :func:`hil.experiments.engines.engine_study` measures, on what. A setting that cannot work is refused at
    construction, naming its key in backquotes, which the command shows as its option.

    Args:
        model: a model of the study, NAME=PATH or NAME@SEED=PATH (an export, a checkpoint, ...); repeatable
        dataset: a BEIR name or folder
        output: the output folder (engines.json, engines.md, the figure)
        max_queries: a seeded slice of the queries
        max_docs: a seeded slice of the corpus (judged documents kept)
        index_root: where the models' indexes are built or reused
        depth: documents ranked; recall is measured at it
        max_tokens: document tokens sampled for isotropy
        bootstrap_samples: bootstrap samples of each interval over queries
        seed: of the slices, the token samples and the bootstrap
    """

    model: list[str]
    dataset: str
    output: str
    max_queries: Optional[int] = None
    max_docs: Optional[int] = None
    index_root: str = "indexes"
    depth: int = 100
    max_tokens: int = 20_000
    bootstrap_samples: int = 1000
    seed: int = 12345

    def __post_init__(self) -> None:
        if not self.model:
            raise UserError("the engine study needs at least one `model` (NAME=PATH)")
        for key, least in (("depth", 1), ("max_tokens", 2), ("bootstrap_samples", 1)):
            if getattr(self, key) < least:
                raise UserError(f"`{key}` must be >= {least} (got {getattr(self, key)})")
        self.models()  # each NAME=PATH read now: a bad one is refused before any work

    def models(self) -> list[ModelSpec]:
        return [model_spec(value) for value in self.model]
