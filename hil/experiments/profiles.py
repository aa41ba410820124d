"""Budgets for reproducing HIL (001) Tables 2, 3 and 5: every variant trained with the same settings.

A profile fixes what the paper's comparison needs to be fair: one backbone, one training file, one number of
steps, one batch size, one learning rate, one seed and one pair of lengths for every variant. Each variant adds
only its own config file (``configs/<name>.yaml``, the regularizer and its lambda).

- ``smoke``: the shared 4.4M-parameter BERT, 2 steps, slices of each dataset; minutes; run by the test suite.
- ``cpu``: all-MiniLM-L6-v2 on the 1,000-triple MS MARCO sample, sized so the whole run (9 trainings and 30
  evaluations) takes about two hours on 2 CPU cores. Lengths are shortened from 32/180 to 32/128 for training and
  evaluation alike (SciFact abstracts are truncated; BM25 sees full texts), because document length is the main cost
  of both.
- ``paper``: 001's settings (bert-base-uncased, MS MARCO triples, 200k steps, lr 3e-6, batch 32, lengths 32/180)
  for a GPU; ``--max-steps`` runs a shorter prefix of the same schedule.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# name -> (config file, label in the tables)
VARIANTS: dict[str, tuple[str, str]] = {
    "colbert": ("colbert", "ColBERT"),
    "cosreg": ("colbert_cosreg_iso", "ColBERT-cosreg"),
    "istar": ("colbert_istar_iso", "ColBERT-istar"),
    "iso": ("colbert_iso", "ColBERT-iso"),
    "aniso": ("colbert_aniso", "ColBERT-aniso"),
    "hil": ("colbert_hil", "ColBERT-HIL"),
    "hil_no_reg_l": ("colbert_hil_no_reg_l", "ColBERT-HIL w/o reg_L"),
    "hil_no_reg_h": ("colbert_hil_no_reg_h", "ColBERT-HIL w/o reg_H"),
    "hil_no_reg": ("colbert_hil_no_reg", "ColBERT-HIL w/o reg_L, reg_H"),
}
# ColBERT-lambda is not trained: it adds the scores of the two trained members (001 Section 3.2).
ENSEMBLES: dict[str, tuple[str, str, str]] = {"lambda": ("iso", "aniso", "ColBERT-lambda")}

# Trained variants evaluated a second way: ColBERT-HIL with its query-term IDF recomputed on each evaluated corpus
# instead of the training passages' (the issue's "the evaluation can recompute it on the target corpus").
CORPUS_IDF: dict[str, tuple[str, str]] = {"hil_corpus_idf": ("hil", "ColBERT-HIL, target-corpus IDF")}

# dataset key -> (how it is evaluated, where it is found under HIL_DATA_DIR)
DATASETS: dict[str, tuple[str, str]] = {
    "scifact": ("full", "scifact"),
    "nfcorpus": ("full", "nfcorpus"),
    "dl19": ("rerank", "msmarco/dl19-pool"),
}
ZERO_SHOT = ("scifact", "nfcorpus")  # the BEIR average; DL19 is in-domain (001 leaves MS MARCO out of Avg.)


@dataclass(frozen=True)
class Profile:
    name: str
    backbone: str
    triples: str
    max_steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    query_maxlen: int
    doc_maxlen: int
    seed: int = 12345
    precision: str = "32-true"
    accelerator: str = "cpu"
    max_triples: int | None = None
    # dataset key -> (number of queries, number of documents) for a deterministic slice; absent = the whole set
    slices: dict[str, tuple[int, int]] = field(default_factory=dict)
    rerank_depth: int = 100
    k: int = 1000
    interiso_pairs: int = 200  # (query, relevant document) pairs per dataset for InterIso (Table 3)
    figure_pairs: int = 64  # pairs for the cosine distributions (Fig. 2) and InterIso per layer (Fig. 5)
    overlap_depth: int = 100  # documents per query and head for the overlap diagram (Fig. 3)
    n_bootstrap: int = 1000
    n_permutations: int = 10000
    encode_batch_size: int = 32
    description: str = ""

    def train_overrides(self) -> list[str]:
        """Command-line overrides applied on top of every variant's config file (the equal budget)."""
        args = ["--seed_everything", str(self.seed),
                "--trainer.accelerator", self.accelerator, "--trainer.devices", "1",
                "--trainer.precision", self.precision, "--trainer.max_steps", str(self.max_steps),
                "--trainer.log_every_n_steps", str(max(1, min(8, self.max_steps // 4))),
                "--trainer.enable_progress_bar", "false",
                "--model.init_args.backbone", self.backbone,
                "--model.init_args.query_maxlen", str(self.query_maxlen),
                "--model.init_args.doc_maxlen", str(self.doc_maxlen),
                "--model.init_args.lr", str(self.lr),
                "--model.init_args.warmup_steps", str(self.warmup_steps),
                "--data.triples", self.triples, "--data.batch_size", str(self.batch_size),
                "--data.num_workers", "0"]
        if self.max_triples is not None:
            args += ["--data.max_triples", str(self.max_triples)]
        return args

    def budget(self) -> dict[str, Any]:
        return asdict(self)


PROFILES: dict[str, Profile] = {
    "smoke": Profile(
        name="smoke", backbone="bert-tiny-splade", triples="msmarco/triples.train.small.head1000.tsv",
        max_steps=2, batch_size=8, lr=1e-4, warmup_steps=0, query_maxlen=16, doc_maxlen=48, max_triples=32,
        slices={"scifact": (12, 120), "nfcorpus": (12, 120), "dl19": (8, 200)}, rerank_depth=20, k=100,
        interiso_pairs=12, figure_pairs=8, overlap_depth=10, n_bootstrap=200, n_permutations=500,
        description="shared tiny BERT, 2 steps of 8 triples, slices of every dataset: checks the pipeline only"),
    "cpu": Profile(
        name="cpu", backbone="sentence-transformers/all-MiniLM-L6-v2",
        triples="msmarco/triples.train.small.head1000.tsv", max_steps=64, batch_size=16, lr=3e-5,
        warmup_steps=6, query_maxlen=32, doc_maxlen=128,
        description="all-MiniLM-L6-v2, 64 steps x 16 MS MARCO triples (about one pass over the 1,000-triple sample), "
                    "lengths 32/128, about two hours on 2 CPU cores"),
    "paper": Profile(
        name="paper", backbone="bert-base-uncased", triples="msmarco/triples.train.small.tsv", max_steps=200_000,
        batch_size=32, lr=3e-6, warmup_steps=0, query_maxlen=32, doc_maxlen=180, accelerator="gpu",
        precision="16-mixed", encode_batch_size=128,
        description="001's settings: bert-base-uncased, MS MARCO triples, 200k steps, lr 3e-6, batch 32, 32/180"),
}
