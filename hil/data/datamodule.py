"""Training data as a LightningDataModule: text triples in, batches of strings out.

Batches stay as strings; the LightningModule tokenizes them with its own ColBERTTokenizer, so the data layer never
depends on a model and a checkpoint always tokenizes the way it was trained.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from hil.data.triples import Triple, mine_bm25_triples, read_triples
from hil.paths import resolve_data_file


class TripleDataset(Dataset):
    def __init__(self, triples: list[Triple]):
        self.triples = triples

    def __len__(self) -> int:
        return len(self.triples)

    def __getitem__(self, index: int) -> Triple:
        return self.triples[index]


def collate_triples(triples: list[Triple]) -> dict[str, list[str]]:
    return {"queries": [t.query for t in triples], "positives": [t.positive for t in triples],
            "negatives": [t.negative for t in triples]}


class EpochShuffleSampler(Sampler[int]):
    """A permutation that depends only on (seed, epoch), and can start part-way through an epoch.

    Determinism per epoch is what lets a resumed run see exactly the batches an uninterrupted run would have seen.
    """

    def __init__(self, size: int, seed: int, shuffle: bool = True):
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch = 0
        self.start = 0  # samples of the current epoch to skip (set when resuming)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=generator).tolist()
        else:
            order = list(range(self.size))
        start, self.start = self.start, 0
        return iter(order[start:])

    def __len__(self) -> int:
        return self.size


class ResumableDataLoader(DataLoader):
    """A DataLoader whose position in the epoch is saved in Lightning checkpoints (via state_dict)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._batches_yielded = 0

    def __iter__(self):
        sampler = self.batch_sampler.sampler if self.batch_sampler is not None else self.sampler
        resumed = getattr(sampler, "start", 0) // max(self.batch_size or 1, 1)
        self._batches_yielded = resumed
        for batch in super().__iter__():
            self._batches_yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"batches_yielded": self._batches_yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        sampler = self.batch_sampler.sampler if self.batch_sampler is not None else self.sampler
        if hasattr(sampler, "start"):
            sampler.start = int(state.get("batches_yielded", 0)) * (self.batch_size or 1)


class TriplesDataModule(pl.LightningDataModule):
    """Triples from an MS MARCO-style TSV, or mined from a BEIR training split with BM25 hard negatives.

    Args:
        triples: a ``query TAB positive TAB negative`` file (a path, or relative to ``HIL_DATA_DIR``).
        beir: a BEIR dataset name or folder; its ``qrels/<beir_split>.tsv`` positives get BM25-mined negatives.
        max_triples: keep only the first N triples (smoke runs).
        batch_size: triples per optimizer step on each device.
        seed: fixes the shuffling order of every epoch.
    """

    def __init__(self, triples: str | None = None, beir: str | None = None, beir_split: str = "train",
                 negatives_per_query: int = 1, bm25_depth: int = 100, max_triples: int | None = None,
                 batch_size: int = 32, num_workers: int = 0, shuffle: bool = True, seed: int = 12345,
                 data_dir: str | None = None):
        super().__init__()
        if (triples is None) == (beir is None):
            raise ValueError("data: give exactly one of `triples` (a TSV of text triples) or `beir` (a dataset to "
                             "mine triples from)")
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1 (got {batch_size})")
        self.save_hyperparameters()
        self.train_dataset: TripleDataset | None = None

    def load_triples(self) -> list[Triple]:
        hp = self.hparams
        if hp.triples is not None:
            triples = read_triples(resolve_data_file(hp.triples, hp.data_dir), limit=hp.max_triples)
        else:
            from hil.data.beir import load_beir

            dataset = load_beir(hp.beir, split=hp.beir_split, data_dir=hp.data_dir)
            triples = mine_bm25_triples(dataset, negatives_per_query=hp.negatives_per_query, depth=hp.bm25_depth,
                                        seed=hp.seed)
            triples = triples[: hp.max_triples] if hp.max_triples else triples
        if not triples:
            raise ValueError("data: no training triples were loaded")
        return triples

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is None and stage in (None, "fit"):
            self.train_dataset = TripleDataset(self.load_triples())

    def train_dataloader(self) -> ResumableDataLoader:
        assert self.train_dataset is not None, "call setup('fit') first"
        sampler = EpochShuffleSampler(len(self.train_dataset), self.hparams.seed, self.hparams.shuffle)
        return ResumableDataLoader(self.train_dataset, batch_size=self.hparams.batch_size, sampler=sampler,
                                   collate_fn=collate_triples, num_workers=self.hparams.num_workers,
                                   persistent_workers=self.hparams.num_workers > 0)
