"""The settings of the paper experiment (``hil paper``, :mod:`hil.experiments.paper`), without torch, so that the
command's ``--help`` needs nothing more: :class:`PaperSettings`, the profile they make, and the readers of their
comma-separated lists (read once, when the settings are made)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Collection, Literal, Optional

from hil.errors import UserError
from hil.evaluation.statistics import P_ADJUST_METHODS
from hil.experiments.profiles import DATASETS, PROFILES, REPO_CONFIGS, VARIANTS, Profile
from hil.retrieval.choices import PRECISIONS

ProfileName = Literal[tuple(sorted(PROFILES))]  # type: ignore[valid-type]  # the profiles, read at import
Precision = Literal[tuple(PRECISIONS)]  # type: ignore[valid-type]
PAdjust = Literal[tuple(P_ADJUST_METHODS)]  # type: ignore[valid-type]


def seed_list(text: str | None) -> list[int] | None:
    """``seeds`` ``1,2,3`` as distinct integers (None when not given)."""
    if text is None:
        return None
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"`seeds`: comma-separated integers expected (got {text!r})") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise UserError(f"`seeds`: one or more distinct seeds expected (got {text!r})")
    return seeds


def names(key: str, text: str | None, known: Collection[str]) -> list[str] | None:
    """The comma-separated names of the setting ``key`` (None when not given), each one of ``known``."""
    if not text:
        return None
    given = [name for name in text.split(",") if name]
    unknown = [name for name in given if name not in known]
    if unknown:
        raise UserError(f"`{key}`: unknown {', '.join(map(repr, unknown))} (known: {', '.join(known)})")
    return given


@dataclass
class PaperSettings:
    """The settings of hil paper, each field the option of its name.

    The paper experiment's scale and what of it to run (:func:`hil.experiments.paper.run_paper`). A setting that
    cannot work is refused at construction, naming its key in backquotes, which the command shows as its option.

    Args:
        profile: the scale: a profile of hil.experiments.profiles
        output: the output folder (default results/<profile>)
        variants: a comma-separated subset of the variants (default: the profile's)
        datasets: a comma-separated subset of the datasets (default: every one that is there)
        max_steps: overrides the profile's training steps (a shorter prefix of the same schedule)
        configs: the config folder (colbert.yaml, variants/, presets/)
        device: where models are evaluated: auto (the GPU when there is one; the default), cpu, cuda, cuda:N
        precision: corpus encoding autocast at evaluation (default: the profile's, fp32)
        p_adjust: multiple-comparison adjustment of the tests against ColBERT, shown beside the raw p-values and
            used for the dagger: holm (Holm-Bonferroni; the profile's default), bh (Benjamini-Hochberg) or none
        seeds: comma-separated training seeds: the experiment once per seed into <output>/seed-<s>/, then
            <output>/seeds.md (every variant over the seeds, against ColBERT); default: one run with the config's
            seed_everything
        no_corpus_idf: leave out the ColBERT-HIL columns with IDF recomputed on each evaluated dataset
        force: redo finished stages instead of skipping them
        report_only: only rewrite the report from finished stages
        publish: then copy the report, summary.json, figures and per-model metric JSONs (no runs, score matrices or
            models) to this folder, e.g. docs/paper-cpu
    """

    profile: ProfileName = "cpu"
    output: Optional[str] = None
    variants: Optional[str] = None
    datasets: Optional[str] = None
    max_steps: Optional[int] = None
    configs: str = str(REPO_CONFIGS)
    device: Optional[str] = None
    precision: Optional[Precision] = None
    p_adjust: Optional[PAdjust] = None
    seeds: Optional[str] = None
    no_corpus_idf: bool = False
    force: bool = False
    report_only: bool = False
    publish: Optional[str] = None

    def __post_init__(self) -> None:
        if self.max_steps is not None and self.max_steps < 1:
            raise UserError(f"`max_steps` must be at least 1 (got {self.max_steps})")
        self.variant_names(), self.dataset_names(), self.seed_list()  # read now: refused before any work

    def variant_names(self) -> list[str] | None:
        return names("variants", self.variants, VARIANTS)

    def dataset_names(self) -> list[str] | None:
        return names("datasets", self.datasets, DATASETS)

    def seed_list(self) -> list[int] | None:
        return seed_list(self.seeds)

    def profile_settings(self) -> Profile:
        """The profile, with what these settings override."""
        profile = replace(PROFILES[self.profile], configs=Path(self.configs))
        overrides = {key: getattr(self, key) for key in ("max_steps", "device", "precision", "p_adjust")
                     if getattr(self, key) is not None}
        return replace(profile, **overrides, **({"corpus_idf": False} if self.no_corpus_idf else {}))

    def output_folder(self) -> Path:
        return Path(self.output or Path("results") / self.profile)
