"""Budgets for reproducing HIL (001) Tables 2, 3 and 5: every variant trained with the same settings.

A profile fixes what the paper's comparison needs to be fair: one backbone, one training file, one number of
steps, one batch size, one learning rate, one seed and one pair of lengths for every variant. The training budget is
a preset file, defined once under ``configs/presets/`` and stacked on every variant exactly as a user would
(``--config configs/colbert.yaml [--config configs/variants/<variant>.yaml] --config configs/presets/<preset>``);
the profile adds only how the models are evaluated (dataset slices, depths, bootstrap sizes).

- ``smoke``: ``presets/smoke.yaml`` (the shared 4.4M-parameter BERT, 4 steps), slices of each dataset; minutes;
  run by the test suite.
- ``cpu``: ``presets/paper-cpu.yaml`` (all-MiniLM-L6-v2, 64 steps of 16 triples of the 1,000-triple MS MARCO sample,
  lengths 32/128 for training and evaluation alike), sized so the whole run (9 trainings and 30 evaluations) takes
  about an hour on 2 CPU cores; SciFact abstracts are truncated at 128 tokens (BM25 sees full texts).
- ``paper``: ``presets/paper-gpu.yaml``: 001's settings (bert-base-uncased, MS MARCO triples, 200k steps, lr 3e-6,
  batch 32, lengths 32/180) on one GPU; ``--max-steps`` runs a shorter prefix of the same schedule.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml

from hil.paths import CONFIGS_DIR, resolve_dataset

REPO_CONFIGS = CONFIGS_DIR  # hil/configs (configs/ at the repository root links to it)
BASE_CONFIG = "colbert.yaml"

# name -> (delta file(s) under configs/variants, stacked in order, or None for the base config itself; label)
VARIANTS: dict[str, tuple[str | tuple[str, ...] | None, str]] = {
    "colbert": (None, "ColBERT"),
    "cosreg": ("colbert_cosreg_iso", "ColBERT-cosreg"),
    "istar": ("colbert_istar_iso", "ColBERT-istar"),
    "iso": ("colbert_iso", "ColBERT-iso"),
    "aniso": ("colbert_aniso", "ColBERT-aniso"),
    "hil": ("colbert_hil", "ColBERT-HIL"),
    "hil_no_reg_l": ("colbert_hil_no_reg_l", "ColBERT-HIL w/o reg_L"),
    "hil_no_reg_h": ("colbert_hil_no_reg_h", "ColBERT-HIL w/o reg_H"),
    "hil_no_reg": ("colbert_hil_no_reg", "ColBERT-HIL w/o reg_L, reg_H"),
    "hil_authors": ("colbert_hil_authors", "ColBERT-HIL (authors' code)"),
    # Diagnostics of ColBERT-HIL's loss against ColBERT (issue 13): the paper recipe with one thing changed.
    "hil_detach_h": (("colbert_hil", "diagnostics/zscore_detach_h"), "ColBERT-HIL, H moments detached"),
    "hil_fixed_temperature": (("colbert_hil", "diagnostics/fixed_temperature"), "ColBERT-HIL, fixed temperature 1"),
    "hil_attend_mask": (("colbert_hil", "diagnostics/attend_mask"), "ColBERT-HIL, [MASK] attended"),
    "colbert_attend_mask": ("diagnostics/attend_mask", "ColBERT, [MASK] attended"),
    "hil_no_clip": (("colbert_hil", "diagnostics/no_clip"), "ColBERT-HIL, no gradient clipping"),
    "hil_torch_init": (("colbert_hil", "diagnostics/torch_head_init"), "ColBERT-HIL, torch head init"),
}
# Trained only when asked for by name (--variants): they explain a result rather than reproduce a table.
DIAGNOSTICS = ("hil_detach_h", "hil_fixed_temperature", "hil_attend_mask", "colbert_attend_mask", "hil_no_clip",
               "hil_torch_init")
DEFAULT_VARIANTS = tuple(name for name in VARIANTS if name not in DIAGNOSTICS)
# ColBERT-lambda is not trained: it adds the scores of the two trained members (001 Section 3.2).
ENSEMBLES: dict[str, tuple[str, str, str]] = {"lambda": ("iso", "aniso", "ColBERT-lambda")}

# Trained variants evaluated a second way: ColBERT-HIL with its query-term IDF recomputed on each evaluated corpus
# instead of the training passages' (the issue's "the evaluation can recompute it on the target corpus").
# The authors' recipe takes its IDF over queries: recomputed on the target dataset's queries, as their evaluation does.
CORPUS_IDF: dict[str, tuple[str, str]] = {"hil_corpus_idf": ("hil", "ColBERT-HIL, target-corpus IDF"),
                                          "hil_authors_target_idf": ("hil_authors",
                                                                     "ColBERT-HIL (authors' code), target-query IDF")}

@dataclass(frozen=True)
class FirstStage:
    """A re-ranking set's first stage: a TREC run file in the dataset's folder whose top ``rerank_depth`` documents
    per query are re-ranked, and which, scored as given, is the row ``name``; ``relevance_level`` is the grade the
    set's binary metrics start at. Its qrels judge documents outside the corpus (the passages the run did not
    retrieve): ``judged_outside_corpus="keep"`` counts them in the ideal DCG, as trec_eval does."""

    run_file: str
    name: str
    label: str  # what the first stage is, for the report
    relevance_level: int = 1
    judged_outside_corpus: Literal["keep", "error"] = "keep"


@dataclass(frozen=True)
class RerankingSet:
    """A dataset evaluated by re-ranking the run it ships (``<data dir>/<folder>``: ``corpus.jsonl`` holding the
    run's passages, ``queries.jsonl``, ``qrels/test.tsv`` and the run file), never by full ranking.

    ``optional``: left out of a run that does not name it when its folder is not found (a set that is not in
    ``../shared``; docs/guide.md says where its official files come from)."""

    folder: str
    label: str
    first_stage: FirstStage
    optional: bool = False


# TREC DL passage (graded qrels 0-3, binary metrics at grade >= 2, as TREC DL reports them), each re-ranking the
# official BM25 top 100 (flat BM25 over the 8.8M MS MARCO passages, as castorini's rank_llm distributes it):
# DL19 43 judged queries, BM25 nDCG@10 0.5058; DL20 54 judged queries, published BM25 nDCG@10 0.4796.
TREC_DL_BM25 = FirstStage("bm25-top100.trec", "bm25", "BM25", relevance_level=2)
RERANKING_SETS: dict[str, RerankingSet] = {
    "dl19": RerankingSet("msmarco/dl19", "TREC DL19", TREC_DL_BM25),
    "dl20": RerankingSet("msmarco/dl20", "TREC DL20", TREC_DL_BM25, optional=True),
}

# dataset key -> (how it is evaluated, where it is found under HIL_DATA_DIR)
DATASETS: dict[str, tuple[str, str]] = {
    "scifact": ("full", "scifact"),
    "nfcorpus": ("full", "nfcorpus"),
    **{key: ("rerank", reranking.folder) for key, reranking in RERANKING_SETS.items()},
}
FIRST_STAGES: dict[str, FirstStage] = {key: reranking.first_stage for key, reranking in RERANKING_SETS.items()}
ZERO_SHOT = ("scifact", "nfcorpus")  # the BEIR average; TREC DL is in-domain (001 leaves MS MARCO out of Avg.)


def default_datasets(data_dir: str | Path | None = None) -> tuple[list[str], list[str]]:
    """The datasets a run evaluates when ``--datasets`` is not given, and the optional ones left out because their
    folder is not under ``data_dir`` / ``$HIL_DATA_DIR`` (:func:`hil.paths.resolve_dataset`)."""
    absent = [key for key, reranking in RERANKING_SETS.items()
              if reranking.optional and resolve_dataset(reranking.folder, data_dir) is None]
    return [key for key in DATASETS if key not in absent], absent


def _merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` laid over ``base`` key by key (nested mappings merged, anything else replaced), as stacked
    ``--config`` files resolve for plain keys."""
    out = dict(base)
    for key, value in override.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@dataclass(frozen=True)
class TrainingBudget:
    """What every variant of a profile is trained with, read from the base config and the preset."""

    backbone: str
    triples: str
    max_triples: int | None
    max_steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    query_maxlen: int
    doc_maxlen: int
    seed: int
    precision: str
    accelerator: str

    @classmethod
    def from_configs(cls, *paths: Path) -> "TrainingBudget":
        config: dict[str, Any] = {}
        for path in paths:
            config = _merged(config, yaml.safe_load(path.read_text(encoding="utf-8")) or {})
        trainer, model, data = config["trainer"], config["model"], config["data"]
        encoder = model["encoder"]["init_args"]
        triples = data["source"]["init_args"]["path"]  # the presets' reader: hil.data.triples_file.TextTriples
        return cls(backbone=encoder["backbone"], triples=triples, max_triples=data.get("max_triples"),
                   max_steps=int(trainer["max_steps"]), batch_size=int(data["batch_size"]),
                   lr=float(model["optimizer"]["init_args"]["lr"]),
                   warmup_steps=int(model["lr_scheduler"]["init_args"]["warmup_steps"]),
                   query_maxlen=int(encoder["query_maxlen"]), doc_maxlen=int(encoder["doc_maxlen"]),
                   seed=int(config["seed_everything"]), precision=str(trainer["precision"]),
                   accelerator=str(trainer["accelerator"]))


@dataclass(frozen=True)
class Profile:
    name: str
    preset: str  # a file under configs/presets
    description: str = ""
    max_steps: int | None = None  # overrides the preset's (--max-steps): a shorter prefix of the same schedule
    # overrides the config's seed_everything for training only (--seeds): slices, pairs and bootstraps keep ``seed``
    train_seed: int | None = None
    corpus_idf: bool = True  # also evaluate the CORPUS_IDF columns (--no-corpus-idf leaves them out)
    configs: Path = REPO_CONFIGS
    # dataset key -> (number of queries, number of documents) for a deterministic slice; absent = the whole set
    slices: dict[str, tuple[int, int]] = field(default_factory=dict)
    rerank_depth: int = 100
    k: int = 1000
    interiso_pairs: int = 200  # (query, relevant document) pairs per dataset for InterIso (Table 3)
    figure_pairs: int = 64  # pairs for the cosine distributions (Fig. 2) and InterIso per layer (Fig. 5)
    overlap_depth: int = 100  # documents per query and head for the overlap diagram (Fig. 3)
    n_bootstrap: int = 1000
    n_permutations: int = 10000
    p_adjust: str = "holm"  # multiple-comparison adjustment of the tests against ColBERT (statistics.adjust_p_values)
    encode_batch_size: int = 32
    device: str = "auto"      # evaluation: where models encode and score (training: the preset's accelerator)
    precision: str = "fp32"   # evaluation: corpus encoding autocast (hil.retrieval.devices)

    @cached_property
    def configured(self) -> TrainingBudget:
        """The budget as the base config and the preset give it (no run option applied)."""
        return TrainingBudget.from_configs(self.configs / BASE_CONFIG, self.configs / "presets" / self.preset)

    @property
    def training(self) -> TrainingBudget:
        """What every variant is trained with: the configured budget with ``max_steps`` and ``train_seed``."""
        overrides = {key: value for key, value in (("max_steps", self.max_steps), ("seed", self.train_seed))
                     if value is not None}
        return TrainingBudget(**{**asdict(self.configured), **overrides})

    @property
    def seed(self) -> int:
        """The evaluation's seed (dataset slices, InterIso pairs, bootstraps): the config's ``seed_everything``,
        the same whatever seed the models were trained with, so that every seed is measured on the same data."""
        return self.configured.seed

    def config_args(self, variant: str) -> list[str]:
        """The ``train.py fit`` arguments of one variant: base config, its delta, the preset, then run options."""
        delta, _ = VARIANTS[variant]
        args = ["--config", str(self.configs / BASE_CONFIG)]
        for part in (delta,) if isinstance(delta, str) else (delta or ()):
            args += ["--config", str(self.configs / "variants" / f"{part}.yaml")]
        args += ["--config", str(self.configs / "presets" / self.preset), "--trainer.enable_progress_bar", "false"]
        if self.max_steps is not None:
            args += ["--trainer.max_steps", str(self.max_steps)]
        if self.train_seed is not None:
            args += ["--seed_everything", str(self.train_seed)]
        return args

    def budget(self) -> dict[str, Any]:
        """Everything the run depends on, for ``profile.json``."""
        evaluation = {k: v for k, v in asdict(self).items() if k not in ("configs", "max_steps", "train_seed")}
        return {**evaluation, **asdict(self.training), "evaluation_seed": self.seed}


PROFILES: dict[str, Profile] = {
    "smoke": Profile(
        name="smoke", preset="smoke.yaml",
        slices={"scifact": (12, 120), "nfcorpus": (12, 120), "dl19": (8, 200), "dl20": (8, 200)},
        rerank_depth=20, k=100, interiso_pairs=12, figure_pairs=8, overlap_depth=10, n_bootstrap=200,
        n_permutations=500,
        description="shared tiny BERT, 4 steps of 8 triples, slices of every dataset: checks the pipeline only"),
    "cpu": Profile(
        name="cpu", preset="paper-cpu.yaml",
        description="all-MiniLM-L6-v2, 64 steps x 16 MS MARCO triples (about one pass over the 1,000-triple sample), "
                    "lengths 32/128, about an hour on 2 CPU cores"),
    "paper": Profile(
        name="paper", preset="paper-gpu.yaml", encode_batch_size=128,
        description="001's settings: bert-base-uncased, MS MARCO triples, 200k steps, lr 3e-6, batch 32, 32/180"),
}
