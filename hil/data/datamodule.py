"""Training data as a LightningDataModule: triples or n-way examples in, batches out -- of strings, or tokenized.

Where the examples come from is one setting, ``data.source``: a reader chosen by ``class_path``
(:class:`~hil.data.examples.ExampleReader`, one module each: text or id triples, BM25-mined triples, ColBERTv2's
n-way files, a TREC run with teacher scores, PyLate's layout, what ``hil teacher`` wrote -- or one defined outside
the package). Files are read from disk by index (:mod:`hil.data.triples_file`, :mod:`hil.data.nway_files`), so
their size is bounded by the disk, not by memory; only BM25-mined triples (small) and ``.gz`` files are held as a
list. The spelling before 0.3 (a key per reader and per reader setting) is read by :mod:`hil.data.old_source_keys`.

A batch of B examples of N documents each (:func:`collate_examples`) is a dict:
    queries         (B)     the queries (strings)
    documents       (B, N)  a list of B lists: each query's N documents (strings) in its example's order -- the
                            positive first (for examples graded by a teacher simply the first); a triple's are
                            ``[positive, negative]`` (:func:`collate_triples`)
    teacher_scores  (B, N)  a float tensor, only when the examples carry teacher scores: ``teacher_scores[i, j]``
                            grades ``documents[i][j]``
The documents are one (B, N) field, the shape of the teacher scores, and are laid out for the encoder in one
place only: :func:`column_by_column` gives the (N B) list of ``hil.modeling.batch.RankingBatch``'s layout
(document j of query i at j B + i; for triples, the positives then the negatives of ColBERT v1 training).

Training tokenizes in the loader: ``RetrieverModule`` hands the data module its encoder's tokenizer at setup
(:meth:`TrainingDataModule.tokenize_with`; the data layer never picks a tokenizer itself, so a checkpoint always
tokenizes the way it was trained), and each batch of strings then also carries ``tokenized``
(:class:`TokenizedCollate`): ``{"queries": (B, Lq), "documents": (N B, Ld)}`` as
:class:`~hil.data.tokenization.TokenizedBatch`, the documents tokenized column by column -- the very tensors the
module would build from the strings. With ``num_workers`` > 0 the loader's workers tokenize ahead of the training
step; on a GPU the batches are pinned and copied to the device asynchronously.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import pytorch_lightning as pl
import torch
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

# The built-in readers' modules, imported so that a config may name a reader by its class name and `hil fit --help`
# lists them (a reader of your own is named by its full class_path). teacher_output imports nway_files, run_examples
# and pylate_files; triples_file imports triples.
import hil.data.teacher_output  # noqa: F401
import hil.data.triples_file  # noqa: F401
from hil.data.distinct import StreamedTexts, iter_distinct
from hil.data.examples import ExampleReader, ExampleSource, ReadSettings, ScoredExample
from hil.data.tokenization import ColBERTTokenizer
from hil.data.triples import Triple, TripleDataset, iter_triples
from hil.errors import UserError
from hil.paths import resolve_data_file

__all__ = ["EpochShuffleSampler", "TokenizedCollate", "TrainingDataModule", "TripleDataset", "collate_examples",
           "collate_triples", "column_by_column", "idf_source_documents"]


def collate_triples(triples: list[Triple]) -> dict[str, list[Any]]:
    """B triples as a batch of strings: ``queries`` (B) and ``documents`` (B, 2), each ``[positive, negative]``."""
    return {"queries": [t.query for t in triples], "documents": [[t.positive, t.negative] for t in triples]}


def column_by_column(documents: Sequence[Sequence[str]]) -> list[str]:
    """B queries' N documents each, (B, N), as the (N B) list the encoder takes: document 0 of every query, then
    document 1 of every query, ... -- document j of query i at j B + i (``hil.modeling.batch.RankingBatch``'s
    layout; for triples the positives, then the negatives)."""
    n = len(documents[0]) if documents else 0
    if any(len(docs) != n for docs in documents):
        raise ValueError(f"a training batch has N documents for each query; got "
                         f"{sorted({len(docs) for docs in documents})}")
    return [docs[j] for j in range(n) for docs in documents]


def _documents(item: Triple | ScoredExample) -> tuple[tuple[str, ...], tuple[float, ...] | None]:
    if isinstance(item, Triple):
        return (item.positive, item.negative), None
    return item.documents, item.scores


def collate_examples(items: list[Triple | ScoredExample]) -> dict[str, list[Any] | torch.Tensor]:
    """B triples or examples as one batch of strings (the layout of the module docstring). Every example of a batch
    has the same N (the readers cut each to ``data.nway``), and all or none carry teacher scores."""
    documents, scores = zip(*(_documents(item) for item in items))
    n = len(documents[0])
    if any(len(docs) != n for docs in documents):
        raise UserError(f"a training batch mixes examples of {sorted({len(docs) for docs in documents})} documents; "
                        f"set data.nway so that every example has the same number")
    if len({s is None for s in scores}) > 1:
        raise UserError("a training batch mixes examples with and without teacher scores")
    batch: dict[str, list[Any] | torch.Tensor] = {
        "queries": [item.query for item in items], "documents": [list(docs) for docs in documents]}
    if scores[0] is not None:
        batch["teacher_scores"] = torch.tensor(scores, dtype=torch.float32)  # (B, N)
    return batch


class TokenizedCollate:
    """:func:`collate_examples`, plus ``"tokenized": {"queries": TokenizedBatch (B, Lq), "documents": TokenizedBatch
    (N B, Ld)}`` of the same texts, the documents tokenized together :func:`column_by_column` (padded to the longest
    of all N B, as training always did). Runs in the loader's workers (it pickles with its tokenizer)."""

    def __init__(self, tokenizer: ColBERTTokenizer):
        self.tokenizer = tokenizer

    def __call__(self, items: list[Triple | ScoredExample]) -> dict[str, Any]:
        batch: dict[str, Any] = collate_examples(items)
        batch["tokenized"] = {"queries": self.tokenizer.encode_queries(batch["queries"]),
                              "documents": self.tokenizer.encode_documents(column_by_column(batch["documents"]))}
        return batch


def distributed_world() -> tuple[int, int]:
    """(number of processes, this process's rank) of the default process group; (1, 0) without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


_SHARD_CHUNK = 1 << 16  # positions of a rank's shard turned into Python ints at a time


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

    def permutation(self) -> torch.Tensor:
        """The whole epoch's order of the dataset, (size,): ``randperm(size)`` seeded ``seed + epoch``, or
        ``0..size-1`` without shuffling. Nothing is turned into Python ints up front, and the order is int32 below
        2^31 items (4 bytes an item: 160 MB for MS MARCO's 40M triples); torch draws the same numbers in int32 as
        in int64 (``tests/test_streamed_triples.py`` checks it), so the batches are those of earlier versions."""
        dtype = torch.int32 if self.size < 2**31 else torch.int64
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            return torch.randperm(self.size, generator=generator, dtype=dtype)
        return torch.arange(self.size, dtype=dtype)

    def shard(self, start: int = 0) -> Iterator[int]:
        """This rank's items of the epoch from its ``start``-th on: positions ``rank, rank + W, ...`` below
        ``total_size`` of the permutation, which is cut to ``total_size`` (drop_last) or padded to it by repeating
        itself from the head (as ``DistributedSampler`` does: position ``p`` holds item ``order[p % size]``).
        Read a chunk of positions at a time, so only the permutation is held."""
        order, world = self.permutation(), self.num_replicas
        step = world * _SHARD_CHUNK
        for first in range(self.rank + start * world, self.total_size, step):
            positions = torch.arange(first, min(first + step, self.total_size), world)
            yield from order[positions % self.size].tolist()

    def __iter__(self) -> Iterator[int]:
        start = self._start()
        self._position = (self.epoch, start)
        for index in self.shard(start):
            self._position = (self.epoch, self._position[1] + 1)
            yield index

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict[str, int]:
        epoch, handed_out = self._position
        return {"epoch": epoch, "consumed": handed_out * self.num_replicas, "world_size": self.num_replicas}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_at(int(state["epoch"]), int(state["consumed"]))


def idf_source_documents(source: str, limit: int | None, training: ExampleSource | None = None,
                         data_dir: str | None = None) -> tuple[Iterable[str], str] | None:
    """The documents ColBERT-HIL's query-term IDF is computed from (``data.idf_source``), and a label for them.

    ``"train"``: the distinct passages of the training triples (the paper trains and takes IDF on MS MARCO; its
    training passages are the in-domain collection at hand); ``"train_queries"``: the distinct queries of the
    training triples (the HIL authors' code takes its IDF over the MS MARCO training queries; pair it with
    ``idf_formula: authors``); ``"none"``: no table (uniform weights 1, an
    ablation; returns None); a path to a ``query TAB positive TAB negative`` file (its passages); or a BEIR
    dataset name or folder (its corpus). ``limit``: at most the first N distinct documents.

    Texts from triples are streamed (:class:`~hil.data.distinct.StreamedTexts`: read from disk again at each
    iteration, deduplicated by 64-bit hash, :func:`~hil.data.distinct.iter_distinct`), in first-seen order: the
    same texts, in the same order, as deduplicating an in-memory list. The id layout gives each pid's (qid's) text
    once before that, which does not change the result: texts are distinct texts, even where the collection repeats
    a passage under two pids.
    """
    if source == "none":
        return None
    if source in ("train", "train_queries"):
        if training is None:
            raise ValueError(f"data.idf_source={source} needs the training triples (call setup('fit') first)")
        if source == "train":
            return StreamedTexts(lambda: iter_distinct(training.iter_passages(), limit), "training passages"), \
                "training triples' passages"
        return StreamedTexts(lambda: iter_distinct(training.iter_queries(), limit), "training queries"), \
            "training triples' queries"
    try:
        path = resolve_data_file(source, data_dir)
    except FileNotFoundError:
        path = None
    if path is not None and path.is_file():
        def passages() -> Iterator[str]:
            return (text for _, t in iter_triples(path) for text in (t.positive, t.negative))

        return StreamedTexts(lambda: iter_distinct(passages(), limit), str(path)), f"passages of {path}"
    from hil.data.beir import load_beir

    try:
        dataset = load_beir(source, data_dir=data_dir)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"data.idf_source={source!r}: not 'train', 'train_queries', 'none', a triples file "
                                f"or a BEIR dataset ({error})") from None
    texts = dataset.documents()
    return (texts[:limit] if limit else texts), f"corpus of {dataset.name} ({Path(dataset.source).name})"


class TrainingDataModule(pl.LightningDataModule):
    """The training examples, from any source, as batches of B queries x N documents.

    The source is one setting, ``source``: a reader chosen by ``class_path``, with its own settings
    (:class:`~hil.data.examples.ExampleReader`). The built-in ones: text triples
    (:class:`~hil.data.triples_file.TextTriples`), id triples with their queries and collection
    (:class:`~hil.data.triples_file.IdTriples`), triples mined from a BEIR training split with BM25 hard negatives
    (:class:`~hil.data.triples.MinedTriples`), n-way examples with or without teacher scores from a ColBERTv2 file
    (:class:`~hil.data.nway_files.NWayExamples`), a TREC run (:class:`~hil.data.run_examples.TrecRun`), PyLate's
    layout (:class:`~hil.data.pylate_files.PyLateExamples`) or what ``hil teacher`` wrote
    (:class:`~hil.data.teacher_output.TeacherOutput`). The settings below are the ones every reader shares.
    (Named ``TriplesDataModule`` before it served more than triples; that name still imports, with a deprecation
    warning, until 0.3.0: ``hil.compat``.)

    Files are read from disk by index: any size trains in bounded memory, and every rank and loader worker shares
    the same memory-mapped line offsets. Their batches are those an in-memory list of the same triples would give.

    Args:
        source: the reader of the training examples, e.g. ``{class_path: hil.data.triples_file.TextTriples,
            init_args: {path: msmarco/triples.train.small.tsv}}`` (relative paths are also looked for under
            ``HIL_DATA_DIR``).
        nway: documents per example (the first ``nway`` of each line of an n-way or PyLate file; None: all, the same
            on every line); required by ``TrecRun``. Triples are N = 2.
        max_triples: keep only the first N triples or examples (smoke runs).
        batch_size: triples (examples) per optimizer step on each device.
        num_workers: loader processes reading and tokenizing batches ahead of the training step (0: in the
            training process, between steps).
        shuffle: a new order every epoch (False: the file's order).
        seed: fixes the shuffling order of every epoch (and a reader's draws: ``TrecRun``'s ``selection: sample``,
            ``MinedTriples``' negatives).
        data_dir: where relative paths are also looked for (default ``$HIL_DATA_DIR``).
        idf_source, idf_max_docs: the collection an encoder that weights query terms (ColBERT-HIL) takes its IDF
            from at the start of training, when it has none yet (a model from ``init_from`` or a resumed
            checkpoint keeps its own); see :func:`idf_source_documents`. Ignored by other encoders.
        cache_dir: where the line offsets of the files are kept; default ``$HIL_CACHE_DIR``, else beside the data
            when its folder is writable, else ``~/.cache/hil`` (:func:`hil.data.line_index.cache_file`).
        old_keys: the spelling before 0.3 (``triples=``, ``teacher_output=``, ``run_depth=``, ...), read as
            ``source`` with a deprecation warning until 0.4.0 (:mod:`hil.data.old_source_keys`).
    """

    def __init__(self, source: ExampleReader | None = None, nway: int | None = None, max_triples: int | None = None,
                 batch_size: int = 32, num_workers: int = 0, shuffle: bool = True, seed: int = 12345,
                 data_dir: str | None = None, idf_source: str = "train", idf_max_docs: int | None = None,
                 cache_dir: str | None = None, **old_keys: Any):
        super().__init__()
        if old_keys:
            from hil.data.old_source_keys import reader_from_old_keys

            source = reader_from_old_keys(old_keys, source)
        if not isinstance(source, ExampleReader):
            raise UserError("data.source: give the reader of the training examples, e.g. {class_path: "
                            "hil.data.triples_file.TextTriples, init_args: {path: msmarco/triples.train.small.tsv}}"
                            + ("" if source is None else f" (got {type(source).__name__})"))
        if nway is not None and source.n_documents is not None:
            raise UserError(f"data.nway applies to n-way examples; {type(source).__name__} gives examples of "
                            f"{source.n_documents} documents")
        if batch_size < 1:
            raise UserError(f"data.batch_size must be >= 1 (got {batch_size})")
        if idf_max_docs is not None and idf_max_docs < 1:
            raise UserError(f"data.idf_max_docs must be >= 1 or null (got {idf_max_docs})")
        # the reader that reads (a TeacherOutput: the one its record names) and its settings, checked before any work
        self.reader, self.read = source.resolve(ReadSettings(nway, max_triples, seed, cache_dir, data_dir))
        # recorded as used (a TeacherOutput's reader and nway), plain values: a checkpoint loads with weights_only
        self.save_hyperparameters({
            "source": self.reader.record(), "nway": self.read.nway, "max_triples": max_triples,
            "batch_size": batch_size, "num_workers": num_workers, "shuffle": shuffle, "seed": seed,
            "data_dir": data_dir, "idf_source": idf_source, "idf_max_docs": idf_max_docs, "cache_dir": cache_dir})
        self.train_dataset: ExampleSource | None = None
        self.tokenizer: ColBERTTokenizer | None = None  # set by tokenize_with: batches are then tokenized

    def tokenize_with(self, tokenizer: ColBERTTokenizer | None) -> None:
        """Tokenize every batch with ``tokenizer`` in the loader (:class:`TokenizedCollate`); None: batches of
        strings. ``RetrieverModule`` calls it with its encoder's tokenizer when training starts."""
        self.tokenizer = tokenizer

    def idf_documents(self) -> tuple[Iterable[str], str] | None:
        """The documents of ``idf_source`` (streamed when they come from triples) and their label (None: no IDF
        table, uniform weights)."""
        return idf_source_documents(str(self.hparams.idf_source), self.hparams.idf_max_docs, self.train_dataset,
                                    self.hparams.data_dir)

    def describe_source(self) -> str:
        """The reader and its settings (``data.source=NWayExamples(path=..., ...)``)."""
        return f"data.source={self.reader.describe()}"

    def has_teacher_scores(self) -> bool:
        """Whether the training examples carry teacher scores (read off the first one; call setup('fit') first)."""
        assert self.train_dataset is not None, "call setup('fit') first"
        if len(self.train_dataset) == 0:
            return False
        first = self.train_dataset[0]
        return isinstance(first, ScoredExample) and first.scores is not None

    def load_dataset(self) -> ExampleSource:
        """The training examples, as the reader opens them (every line checked when first opened)."""
        dataset = self.reader.open(self.read)
        if len(dataset) == 0:
            raise UserError(f"data.source: no training triples or examples were loaded ({self.reader.describe()})")
        return dataset

    def prepare_data(self) -> None:
        """The reader's shared work (line offsets, checking, conversions), done once per node before the ranks'
        ``setup`` (Lightning runs this on one process per node first), so that the ranks map a finished cache
        instead of each scanning the file."""
        self.reader.prepare(self.read)

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is None and stage in (None, "fit"):
            self.train_dataset = self.load_dataset()

    def train_dataloader(self) -> StatefulDataLoader:
        """Batches of strings (:func:`collate_examples`), tokenized too after :meth:`tokenize_with`
        (:class:`TokenizedCollate`, in the workers when ``num_workers`` > 0, pinned when training on a GPU); the
        loader's position in the epoch is saved in checkpoints (the sampler's state, see
        :class:`EpochShuffleSampler`), so a resumed run continues with the next unseen batch."""
        assert self.train_dataset is not None, "call setup('fit') first"
        # Shard by the trainer's ranks (DDP); without a trainer, by the process group if there is one.
        world = (self.trainer.distributed_sampler_kwargs or {}) if self.trainer is not None else {}
        sampler = EpochShuffleSampler(len(self.train_dataset), self.hparams.seed, self.hparams.shuffle,
                                      num_replicas=world.get("num_replicas"), rank=world.get("rank"))
        collate = collate_examples if self.tokenizer is None else TokenizedCollate(self.tokenizer)
        on_gpu = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        # A generator of its own keeps the loader from drawing on the global torch RNG.
        with warnings.catch_warnings():  # torchdata 0.11 calls a torch telemetry hook torch 2.13 deprecates
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            return StatefulDataLoader(self.train_dataset, batch_size=self.hparams.batch_size, sampler=sampler,
                                      collate_fn=collate, num_workers=self.hparams.num_workers,
                                      persistent_workers=self.hparams.num_workers > 0, pin_memory=on_gpu,
                                      generator=torch.Generator().manual_seed(0))


def __getattr__(name: str) -> Any:
    """The data module's name before it served n-way examples, runs and teacher outputs (``hil.compat``)."""
    if name == "TriplesDataModule":
        warnings.warn("hil.data.datamodule.TriplesDataModule is deprecated: use TrainingDataModule (the same class)",
                      DeprecationWarning, stacklevel=2)
        return TrainingDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
