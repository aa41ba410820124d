"""Exact resume, proven against slow references (issue 13, section 3): what every rank reads after a mid-epoch
resume, a new permutation every epoch, and the step seed restored from the checkpoint without ``seed_everything``.

Each test was checked by breaking the code it guards and watching it fail: the resumed sampler skipping the
all-ranks count instead of this rank's share (``consumed`` not divided by the world size), one permutation for every
epoch, and ``StepReseed`` not restoring its base seed (which ``seed_everything``'s ``PL_GLOBAL_SEED`` would hide:
these tests unset it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from hil.data.datamodule import EpochShuffleSampler, TrainingDataModule
from hil.modeling.callbacks import StepReseed


# -- slow references -------------------------------------------------------------------------------------------------
def epoch_order(size: int, seed: int, epoch: int) -> list[int]:
    """The documented order of an epoch: ``randperm(size)`` from a generator seeded ``seed + epoch``."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def rank_share(order: list[int], world: int, rank: int) -> list[int]:
    """What rank ``rank`` of ``world`` reads in one epoch, written out: the order padded with its own head to a
    multiple of the world size, then every ``world``-th item from position ``rank``."""
    padded = list(order)
    i = 0
    while len(padded) % world:
        padded.append(order[i % len(order)])
        i += 1
    return [padded[p] for p in range(len(padded)) if p % world == rank]


def loader(size: int, batch_size: int, world: int, rank: int, seed: int = 7) -> StatefulDataLoader:
    sampler = EpochShuffleSampler(size, seed, num_replicas=world, rank=rank)
    return StatefulDataLoader(list(range(size)), batch_size=batch_size, sampler=sampler,
                              generator=torch.Generator().manual_seed(0))


def flat(batches) -> list[int]:
    return [int(x) for batch in batches for x in batch]


# -- a new permutation every epoch -----------------------------------------------------------------------------------
def test_every_epoch_draws_its_own_permutation():
    size, seed = 40, 7
    orders = []
    for epoch in range(4):
        sampler = EpochShuffleSampler(size, seed, num_replicas=1, rank=0)
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
        assert sorted(orders[-1]) == list(range(size))
        assert orders[-1] == epoch_order(size, seed, epoch)
    assert len({tuple(o) for o in orders}) == 4, "two epochs share a permutation"
    # the same holds for each rank's share, and a sampler object reused across epochs (as Lightning does)
    for rank in (0, 1):
        sampler = EpochShuffleSampler(size, seed, num_replicas=2, rank=rank)
        shares = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            shares.append(list(sampler))
            assert shares[-1] == rank_share(epoch_order(size, seed, epoch), 2, rank)
        assert len({tuple(s) for s in shares}) == 3


class RecordQueries(pl.LightningModule):
    """Reads the data module's batches through a Trainer and records them by epoch (one dummy parameter)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: dict[int, list[str]] = {}

    def training_step(self, batch, batch_idx):
        self.seen.setdefault(self.current_epoch, []).extend(batch["queries"])
        return self.weight * 0.0 + self.weight.square()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_trainer_reads_a_new_order_of_the_same_triples_each_epoch(tmp_path):
    path = tmp_path / "t.tsv"
    path.write_text("".join(f"query {i}\tpositive {i}\tnegative {i}\n" for i in range(12)), encoding="utf-8")
    module = RecordQueries()
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, TrainingDataModule(triples=str(path), batch_size=4, seed=3))
    assert sorted(module.seen) == [0, 1, 2]
    for epoch, seen in module.seen.items():
        assert sorted(seen) == sorted(f"query {i}" for i in range(12)), epoch
        assert seen == [f"query {i}" for i in epoch_order(12, 3, epoch)], epoch
    assert len({tuple(seen) for seen in module.seen.values()}) == 3, "an epoch repeated the previous order"


# -- resume on two ranks -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size, batch_size, stop_after", [(11, 2, 1), (11, 2, 2), (24, 3, 3), (9, 1, 4)])
def test_two_ranks_resumed_mid_epoch_read_exactly_their_remaining_items(size, batch_size, stop_after):
    world, seed = 2, 7
    order = epoch_order(size, seed, 0)
    states = []
    for rank in range(world):
        crashed = loader(size, batch_size, world, rank, seed)
        crashed.sampler.set_epoch(0)
        iterator = iter(crashed)
        read = flat(next(iterator) for _ in range(stop_after))
        assert read == rank_share(order, world, rank)[: stop_after * batch_size]
        states.append(crashed.state_dict())
    # the checkpoint (rank 0's loader state, as Lightning saves) counts the items of every rank
    assert states[0]["_sampler_iter_state"]["sampler_state"] == {
        "epoch": 0, "consumed": stop_after * batch_size * world, "world_size": world}
    for rank in range(world):
        resumed = loader(size, batch_size, world, rank, seed)
        resumed.load_state_dict(states[0])
        resumed.sampler.set_epoch(0)
        assert flat(iter(resumed)) == rank_share(order, world, rank)[stop_after * batch_size:], rank
        resumed.sampler.set_epoch(1)  # the skip applies once
        assert flat(iter(resumed)) == rank_share(epoch_order(size, seed, 1), world, rank), rank


def test_one_rank_resumed_on_two_reads_the_rest_of_the_permutation_between_them():
    size, seed, batch_size = 20, 7, 2
    single = loader(size, batch_size, 1, 0, seed)
    single.sampler.set_epoch(0)
    iterator = iter(single)
    read = flat(next(iterator) for _ in range(3))  # 6 items of the permutation consumed
    state = single.state_dict()
    rest = []
    for rank in range(2):
        resumed = loader(size, batch_size, 2, rank, seed)
        resumed.load_state_dict(state)
        resumed.sampler.set_epoch(0)
        got = flat(iter(resumed))
        assert got == rank_share(epoch_order(size, seed, 0), 2, rank)[3:], rank
        rest += got
    assert sorted(read + rest) == list(range(size))


# -- the step seed restored on resume, without seed_everything -----------------------------------------------------
class DrawsPerStep(pl.LightningModule):
    """Records one torch random draw per training step (what dropout would use), by (epoch, batch)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(2, 1)
        self.draws: dict[tuple[int, int], float] = {}

    def training_step(self, batch, batch_idx):
        self.draws[(self.current_epoch, batch_idx)] = float(torch.rand(()))
        return self.layer(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):  # 3 batches an epoch, resumable mid-epoch like the training data
        return StatefulDataLoader(torch.arange(12.0).reshape(6, 2), batch_size=2)


def fit(root: Path, max_steps: int, global_seed: int, ckpt_path: Path | None = None) -> DrawsPerStep:
    module = DrawsPerStep()
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1,
                                               filename="{step}")
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root,
                         callbacks=[StepReseed(), checkpoints])  # no seed given: drawn at fit start, or restored
    torch.manual_seed(global_seed)  # what StepReseed would draw its base seed from
    trainer.fit(module, ckpt_path=ckpt_path)
    return module


def test_a_resumed_run_draws_the_numbers_of_the_uninterrupted_run_without_seed_everything(tmp_path, monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)  # seed_everything would hand every run the same base
    uninterrupted = fit(tmp_path / "a", max_steps=7, global_seed=1)
    assert sorted(uninterrupted.draws) == [(e, b) for e in range(3) for b in range(3)][:7]
    assert len(set(uninterrupted.draws.values())) == 7  # the seed depends on the position
    checkpoint = tmp_path / "a" / "step=2.ckpt"  # mid-epoch 0
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    assert any(state.get("base_seed") is not None for state in saved["callbacks"].values())
    # resumed in a process whose global RNG is elsewhere: a base seed drawn anew would differ
    resumed = fit(tmp_path / "b", max_steps=7, global_seed=2, ckpt_path=checkpoint)
    assert sorted(resumed.draws) == sorted(uninterrupted.draws)[2:]
    assert resumed.draws == {k: uninterrupted.draws[k] for k in resumed.draws}
    # while a fresh run with that global RNG state draws another base seed, so the check above can fail
    other = fit(tmp_path / "c", max_steps=2, global_seed=2)
    assert other.draws != {k: uninterrupted.draws[k] for k in other.draws}
