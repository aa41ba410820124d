"""Training data as a LightningDataModule: text triples in, batches of strings out.

Batches stay as strings; the LightningModule tokenizes them with its own ColBERTTokenizer, so the data layer never
depends on a model and a checkpoint always tokenizes the way it was trained.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import pytorch_lightning as pl
import torch
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from hil.data.triples import Triple, iter_triples, mine_bm25_triples, read_triples
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


def distributed_world() -> tuple[int, int]:
    """(number of processes, this process's rank) of the default process group; (1, 0) without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


class EpochShuffleSampler(DistributedSampler):
    """This rank's share of a permutation that depends only on (seed, epoch), able to start part-way through.

    Determinism per epoch is what lets a resumed run see exactly the batches an uninterrupted run would have seen.

    Multi-process (DDP): every rank draws the same permutation of the whole dataset and takes every
    ``num_replicas``-th item starting at its rank (after padding the permutation with its own head to a multiple of
    ``num_replicas``, as ``DistributedSampler`` does), so the ranks' shards are disjoint, cover the data, and are the
    same length (DDP needs every rank to run the same number of steps). Subclassing ``DistributedSampler`` is what
    makes Lightning keep this sampler instead of wrapping it in its ``DistributedSamplerWrapper`` (which would
    shard a second time and lose the resume position), so ``use_distributed_sampler`` can stay at its default.

    Resuming: the sampler is *stateful* (``state_dict`` / ``load_state_dict``), and torchdata's
    ``StatefulDataLoader`` keeps its state in Lightning checkpoints. The state is the prefix of the epoch's
    permutation handed out so far, counted over all ranks: ``{"epoch", "consumed", "world_size"}``; after ``k``
    batches of ``b`` on each of ``W`` ranks, ``consumed = k * b * W``. ``load_state_dict`` (or ``resume_at``) skips
    exactly that prefix when that epoch is iterated next -- on any world size that divides it; a finished epoch
    resumes at the start of the next. Iteration is lazy: the permutation is drawn at the first item, after
    Lightning has set the epoch (``set_epoch``).

    Args:
        size: number of items in the dataset.
        seed: the permutation of epoch ``e`` is ``randperm(size, seed + e)``.
        shuffle: False keeps the file order (still sharded by rank).
        num_replicas, rank: default to the initialized process group, else 1 and 0.
    """

    def __init__(self, size: int, seed: int, shuffle: bool = True, num_replicas: int | None = None,
                 rank: int | None = None, drop_last: bool = False):
        world, own_rank = distributed_world()
        num_replicas = world if num_replicas is None else num_replicas
        rank = own_rank if rank is None else rank
        super().__init__(range(size), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.size = size
        self._resume: tuple[int | None, int] | None = None  # (epoch, samples of the permutation consumed)
        self._position = (0, 0)  # (epoch, this rank's samples handed out) of the current iteration

    def resume_at(self, epoch: int | None, consumed: int) -> None:
        """Skip the first ``consumed`` items of epoch ``epoch``'s permutation (all ranks together) when it is next
        iterated; ``epoch=None`` applies to whichever epoch comes next."""
        self._resume = (epoch, int(consumed))

    def _start(self) -> int:
        """How many of this rank's samples the iteration starting now skips: a pending resume position applies
        only if it belongs to the epoch about to be iterated (a finished epoch resumes at the next one)."""
        start = 0
        if self._resume is not None:
            epoch, consumed = self._resume
            self._resume = None
            if epoch is None or epoch == self.epoch:
                start = min(consumed // self.num_replicas, self.num_samples)
        return start

    def permutation(self) -> list[int]:
        """The whole epoch's order, padded (or cut, with drop_last) to ``total_size``."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=generator).tolist()
        else:
            order = list(range(self.size))
        if self.drop_last:
            return order[: self.total_size]
        padding = self.total_size - len(order)
        while padding > 0:  # repeat the head (several times if the dataset is smaller than the world)
            order += order[:padding]
            padding = self.total_size - len(order)
        return order

    def __iter__(self) -> Iterator[int]:
        start = self._start()
        shard = self.permutation()[self.rank: self.total_size: self.num_replicas]  # (num_samples,)
        self._position = (self.epoch, start)
        for index in shard[start:]:
            self._position = (self.epoch, self._position[1] + 1)
            yield index

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict[str, int]:
        epoch, handed_out = self._position
        return {"epoch": epoch, "consumed": handed_out * self.num_replicas, "world_size": self.num_replicas}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_at(int(state["epoch"]), int(state["consumed"]))


def distinct_texts(texts: Iterable[str], limit: int | None) -> list[str]:
    """The distinct ``texts`` in first-seen order, at most ``limit`` of them (None: all)."""
    seen: dict[str, None] = {}
    for text in texts:
        seen.setdefault(text, None)
        if limit is not None and len(seen) >= limit:
            break
    return list(seen)


def idf_source_documents(source: str, limit: int | None, training: Sequence[Triple] | None = None,
                         data_dir: str | None = None) -> tuple[list[str], str] | None:
    """The documents ColBERT-HIL's query-term IDF is computed from (``data.idf_source``), and a label for them.

    ``"train"``: the distinct passages of the training triples (the paper trains and takes IDF on MS MARCO; its
    training passages are the in-domain collection at hand); ``"train_queries"``: the distinct queries of the
    training triples (the HIL authors' code takes its IDF over the MS MARCO training queries; pair it with
    ``idf_formula: authors``); ``"none"``: no table (uniform weights 1, an
    ablation; returns None); a path to a ``query TAB positive TAB negative`` file (its passages); or a BEIR
    dataset name or folder (its corpus). ``limit``: at most the first N distinct documents.
    """
    if source == "none":
        return None
    if source == "train":
        if training is None:
            raise ValueError("data.idf_source=train needs the training triples (call setup('fit') first)")
        return distinct_texts((text for t in training for text in (t.positive, t.negative)), limit), \
            "training triples' passages"
    if source == "train_queries":
        if training is None:
            raise ValueError("data.idf_source=train_queries needs the training triples (call setup('fit') first)")
        return distinct_texts((t.query for t in training), limit), "training triples' queries"
    try:
        path = resolve_data_file(source, data_dir)
    except FileNotFoundError:
        path = None
    if path is not None and path.is_file():
        passages = (text for _, t in iter_triples(path) for text in (t.positive, t.negative))
        return distinct_texts(passages, limit), f"passages of {path}"
    from hil.data.beir import load_beir

    try:
        dataset = load_beir(source, data_dir=data_dir)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"data.idf_source={source!r}: not 'train', 'train_queries', 'none', a triples file or a BEIR "
                                f"dataset ({error})") from None
    texts = dataset.documents()
    return (texts[:limit] if limit else texts), f"corpus of {dataset.name} ({Path(dataset.source).name})"


class TriplesDataModule(pl.LightningDataModule):
    """Triples from an MS MARCO-style TSV, or mined from a BEIR training split with BM25 hard negatives.

    Args:
        triples: a ``query TAB positive TAB negative`` file (a path, or relative to ``HIL_DATA_DIR``).
        beir: a BEIR dataset name or folder; its ``qrels/<beir_split>.tsv`` positives get BM25-mined negatives.
        max_triples: keep only the first N triples (smoke runs).
        batch_size: triples per optimizer step on each device.
        seed: fixes the shuffling order of every epoch.
        idf_source, idf_max_docs: the collection an encoder that weights query terms (ColBERT-HIL) takes its IDF
            from at the start of training, when it has none yet (a model from ``init_from`` or a resumed
            checkpoint keeps its own); see :func:`idf_source_documents`. Ignored by other encoders.
    """

    def __init__(self, triples: str | None = None, beir: str | None = None, beir_split: str = "train",
                 negatives_per_query: int = 1, bm25_depth: int = 100, max_triples: int | None = None,
                 batch_size: int = 32, num_workers: int = 0, shuffle: bool = True, seed: int = 12345,
                 data_dir: str | None = None, idf_source: str = "train", idf_max_docs: int | None = None):
        super().__init__()
        if (triples is None) == (beir is None):
            raise ValueError("data: give exactly one of `triples` (a TSV of text triples) or `beir` (a dataset to "
                             "mine triples from)")
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1 (got {batch_size})")
        if idf_max_docs is not None and idf_max_docs < 1:
            raise ValueError(f"data.idf_max_docs must be >= 1 or null (got {idf_max_docs})")
        self.save_hyperparameters()
        self.train_dataset: TripleDataset | None = None

    def idf_documents(self) -> tuple[list[str], str] | None:
        """The documents of ``idf_source`` and their label (None: no IDF table, uniform weights)."""
        training = self.train_dataset.triples if self.train_dataset is not None else None
        return idf_source_documents(str(self.hparams.idf_source), self.hparams.idf_max_docs, training,
                                    self.hparams.data_dir)

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

    def train_dataloader(self) -> StatefulDataLoader:
        """Batches of string triples; the loader's position in the epoch is saved in checkpoints (the sampler's
        state, see :class:`EpochShuffleSampler`), so a resumed run continues with the next unseen batch."""
        assert self.train_dataset is not None, "call setup('fit') first"
        # Shard by the trainer's ranks (DDP); without a trainer, by the process group if there is one.
        world = (self.trainer.distributed_sampler_kwargs or {}) if self.trainer is not None else {}
        sampler = EpochShuffleSampler(len(self.train_dataset), self.hparams.seed, self.hparams.shuffle,
                                      num_replicas=world.get("num_replicas"), rank=world.get("rank"))
        # A generator of its own keeps the loader from drawing on the global torch RNG.
        with warnings.catch_warnings():  # torchdata 0.11 calls a torch telemetry hook torch 2.13 deprecates
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            return StatefulDataLoader(self.train_dataset, batch_size=self.hparams.batch_size, sampler=sampler,
                                      collate_fn=collate_triples, num_workers=self.hparams.num_workers,
                                      persistent_workers=self.hparams.num_workers > 0,
                                      generator=torch.Generator().manual_seed(0))
