"""Faults during training: a SIGKILL mid-epoch and a resume, non-finite losses and gradients, resumable data.

The resume test compares a killed-and-resumed run with an uninterrupted one step by step: same batches, same
weights after every step, and identical final weights, optimizer and scheduler state (``torch.equal``). What makes
that hold is in ``hil.data.datamodule`` (the loader's position is the prefix of the epoch's permutation consumed,
checkpointed) and ``hil.modeling.callbacks.StepReseed`` (dropout is reseeded from (seed, epoch, batch, rank) before
each batch).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from hil.data.datamodule import EpochShuffleSampler, TrainingDataModule
from hil.modeling.callbacks import NonFiniteGuard, NonFiniteLossError, step_seed
from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.losses import LossOutput, PairwiseCE
from hil.modeling.module import RetrieverModule

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


# -- a callback the subprocess runs load by class path (test_faults.RecordBatches) ---------------------------------
def parameter_fingerprint(module: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, param in sorted(module.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class RecordBatches(pl.Callback):
    """Per rank and step: the batch's triples and a fingerprint of the weights, to ``out_dir/rank<r>.jsonl``.

    ``pause_at_step``: before the batch that would make that step + 1, write ``out_dir/paused`` and sleep (so a test
    can SIGKILL the run at a known point, after the checkpoints of ``pause_at_step`` are complete).
    """

    def __init__(self, out_dir: str, pause_at_step: int = -1):
        self.out_dir = Path(out_dir)
        self.pause_at_step = pause_at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
        if trainer.global_step == self.pause_at_step:
            (self.out_dir / "paused").write_text(str(trainer.global_step))
            time.sleep(600)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        self.out_dir.mkdir(parents=True, exist_ok=True)
        metric = trainer.callback_metrics.get("train/in_batch_candidates")
        record = {"rank": trainer.global_rank, "world": trainer.world_size, "step": trainer.global_step,
                  "epoch": trainer.current_epoch, "batch_idx": batch_idx,
                  "triples": [[query, *documents] for query, documents in zip(batch["queries"], batch["documents"])],
                  "params": parameter_fingerprint(pl_module),
                  "in_batch_candidates": None if metric is None else float(metric)}
        with open(self.out_dir / f"rank{trainer.global_rank}.jsonl", "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def read_records(directory: Path, rank: int = 0) -> list[dict]:
    path = directory / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def restore_determinism():
    """Lightning's ``deterministic: true`` flips a process-wide torch switch; put it back for the other tests."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


# -- SIGKILL mid-epoch, resume, compare with an uninterrupted run ---------------------------------------------------
def cli_args(root: Path, records: Path, *extra: str) -> list[str]:
    # smoke: 32 triples / batch 8 = 4 batches an epoch, checkpoints every 2 steps; 6 steps cross into epoch 1.
    return ["fit", "--config", str(REPO / "configs/colbert.yaml"), "--config", str(REPO / "configs/presets/smoke.yaml"),
            "--trainer.default_root_dir", str(root), "--trainer.logger", "false", "--trainer.deterministic", "true",
            "--trainer.max_steps", "6",
            "--trainer.callbacks+=test_faults.RecordBatches", f"--trainer.callbacks.out_dir={records}", *extra]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_same_tensors(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_tensors(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.integration
def test_sigkill_mid_epoch_then_resume_equals_uninterrupted_run(shared_dir, tmp_path, restore_determinism):
    from hil.cli.train import train_main

    killed_root, killed_records = tmp_path / "killed", tmp_path / "killed_records"
    killed_records.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # same float reductions as this process
    env.setdefault("HF_HUB_OFFLINE", "1")
    process = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"),
         *cli_args(killed_root, killed_records, "--trainer.callbacks.pause_at_step=2")],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # meanwhile, the uninterrupted reference run in this process
        reference_root, reference_records = tmp_path / "reference", tmp_path / "reference_records"
        train_main(cli_args(reference_root, reference_records))

        deadline = time.monotonic() + 300
        while not (killed_records / "paused").exists():
            assert process.poll() is None, f"training exited early: {process.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "training never reached step 2"
            time.sleep(0.2)
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=60) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

    killed_checkpoints = killed_root / "checkpoints"
    assert sorted(p.name for p in killed_checkpoints.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    last = load(killed_checkpoints / "last.ckpt")
    assert last["global_step"] == 2
    # the loader's position: 2 batches of 8 of epoch 0 consumed (the 3rd, already fetched when killed, is not)
    (loader_state,) = last["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert sampler_state(loader_state) == {"epoch": 0, "consumed": 16, "world_size": 1}
    # the crashed process computed exactly what the reference computed up to step 2
    reference_step2 = load(reference_root / "checkpoints" / "epoch=0-step=2.ckpt")
    assert_same_tensors(last["state_dict"], reference_step2["state_dict"], "weights at step 2")

    resumed_root, resumed_records = tmp_path / "resumed", tmp_path / "resumed_records"
    cli = train_main(cli_args(resumed_root, resumed_records, "--ckpt_path", str(killed_checkpoints / "last.ckpt")))
    assert cli.trainer.global_step == 6

    reference, killed, resumed = (read_records(d) for d in (reference_records, killed_records, resumed_records))
    assert [r["step"] for r in reference] == list(range(1, 7))
    assert [r["step"] for r in killed] == [1, 2]
    assert [r["step"] for r in resumed] == [3, 4, 5, 6], "the global step does not continue from the checkpoint"
    # the data position continues: the batches after the crash are the ones the uninterrupted run saw
    # (steps 3-4 finish epoch 0, steps 5-6 start epoch 1's permutation), with the same batch indices
    assert [(r["epoch"], r["batch_idx"]) for r in resumed] == [(0, 2), (0, 3), (1, 0), (1, 1)]
    for ref, res in zip(reference[2:], resumed):
        assert (res["epoch"], res["batch_idx"]) == (ref["epoch"], ref["batch_idx"])
        assert res["triples"] == ref["triples"], f"step {res['step']} trained on other triples"
        assert res["params"] == ref["params"], f"weights differ after step {res['step']}"
    assert [r["triples"] for r in killed] == [r["triples"] for r in reference[:2]]

    final_reference = load(reference_root / "checkpoints" / "last.ckpt")
    final_resumed = load(resumed_root / "checkpoints" / "last.ckpt")
    assert final_resumed["global_step"] == final_reference["global_step"] == 6
    assert_same_tensors(final_resumed["state_dict"], final_reference["state_dict"], "final weights")
    assert_same_tensors(final_resumed["optimizer_states"], final_reference["optimizer_states"], "optimizer")
    assert_same_tensors(final_resumed["lr_schedulers"], final_reference["lr_schedulers"], "lr scheduler")
    adam_steps = {int(s["step"]) for s in final_resumed["optimizer_states"][0]["state"].values()}
    assert adam_steps == {6}
    assert final_resumed["lr_schedulers"][0]["last_epoch"] == 6
    loader_states = [sampler_state(final["loops"]["fit_loop"]["state_dict"]["combined_loader"][0])
                     for final in (final_resumed, final_reference)]
    assert loader_states == [{"epoch": 1, "consumed": 16, "world_size": 1}] * 2
    # and dropout was on: without it, matching weights would not show that its randomness is restored
    assert cli.model.encoder.backbone.config.hidden_dropout_prob > 0


def test_dropout_seed_depends_on_position_only():
    seeds = {step_seed(12345, epoch, batch, rank) for epoch in range(3) for batch in range(50) for rank in range(4)}
    assert len(seeds) == 3 * 50 * 4  # every (epoch, batch, rank) its own stream
    assert step_seed(12345, 1, 7, 0) == step_seed(12345, 1, 7, 0) != step_seed(12346, 1, 7, 0)
    assert all(0 <= s < 2**63 for s in seeds)


# -- the loader's position, without a trainer -----------------------------------------------------------------------
def write_triples(path: Path, n: int) -> Path:
    path.write_text("".join(f"query {i}\tpositive {i}\tnegative {i}\n" for i in range(n)), encoding="utf-8")
    return path


def loader_for(path: Path, batch_size: int = 4, num_replicas: int = 1, rank: int = 0) -> StatefulDataLoader:
    data = TrainingDataModule(triples=str(path), batch_size=batch_size, seed=7)
    data.setup("fit")
    sampler = EpochShuffleSampler(len(data.train_dataset), 7, num_replicas=num_replicas, rank=rank)
    from hil.data.datamodule import collate_triples

    return StatefulDataLoader(data.train_dataset, batch_size=batch_size, sampler=sampler,
                              collate_fn=collate_triples, generator=torch.Generator().manual_seed(0))


def sampler_state(loader_state: dict) -> dict:
    """The position a StatefulDataLoader saved: its (stateful) sampler's state."""
    return loader_state["_sampler_iter_state"]["sampler_state"]


def queries(batches) -> list[str]:
    return [q for batch in batches for q in batch["queries"]]


@pytest.mark.parametrize("stop_after", [0, 1, 3, 5])
def test_loader_resumes_at_the_next_unseen_batch(tmp_path, stop_after):
    path = write_triples(tmp_path / "t.tsv", 20)  # 5 batches of 4 per epoch
    full = loader_for(path)
    expected = {epoch: (full.sampler.set_epoch(epoch), queries(iter(full)))[1] for epoch in (0, 1)}

    crashed = loader_for(path)
    crashed.sampler.set_epoch(0)
    iterator = iter(crashed)
    for _ in range(stop_after):
        next(iterator)
    state = crashed.state_dict()
    assert sampler_state(state) == {"epoch": 0, "consumed": 4 * stop_after, "world_size": 1}

    resumed = loader_for(path)
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(0)
    assert queries(iter(resumed)) == expected[0][4 * stop_after:]
    resumed.sampler.set_epoch(1)  # the skip applies once: the next epoch is whole
    assert queries(iter(resumed)) == expected[1]


def test_a_finished_epoch_resumes_at_the_start_of_the_next(tmp_path):
    path = write_triples(tmp_path / "t.tsv", 12)
    loader = loader_for(path)
    loader.sampler.set_epoch(0)
    list(iter(loader))
    state = loader.state_dict()
    assert sampler_state(state)["consumed"] == 12
    resumed = loader_for(path)
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(1)  # what Lightning does when the checkpoint was taken at the end of epoch 0
    reference = loader_for(path)
    reference.sampler.set_epoch(1)
    assert queries(iter(resumed)) == queries(iter(reference))  # not an empty epoch


def test_resume_on_a_different_world_size_skips_the_same_prefix(tmp_path):
    path = write_triples(tmp_path / "t.tsv", 24)
    two = [loader_for(path, batch_size=3, num_replicas=2, rank=r) for r in (0, 1)]
    seen = []
    for loader in two:
        loader.sampler.set_epoch(0)
        iterator = iter(loader)
        seen += queries([next(iterator), next(iterator)])  # 2 batches of 3 on each of 2 ranks: 12 items
    state = two[0].state_dict()
    assert sampler_state(state) == {"epoch": 0, "consumed": 12, "world_size": 2}
    single = loader_for(path, batch_size=3)
    single.load_state_dict(state)
    single.sampler.set_epoch(0)
    rest = queries(iter(single))
    assert sorted(seen + rest) == sorted(f"query {i}" for i in range(24))  # nothing lost, nothing repeated


def test_loader_iteration_leaves_the_global_rng_alone(tmp_path):
    loader = loader_for(write_triples(tmp_path / "t.tsv", 8))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    list(iter(loader))
    assert torch.equal(torch.get_rng_state(), before)


# -- non-finite losses and gradients ---------------------------------------------------------------------------------
class NaNOnCue(PairwiseCE):
    """ColBERT's pairwise loss, made NaN (or given a NaN gradient with a finite value) at chosen global steps."""

    def __init__(self, nan_loss_at: tuple[int, ...] = (), nan_grad_at: tuple[int, ...] = ()):
        super().__init__()
        self.nan_loss_at, self.nan_grad_at = nan_loss_at, nan_grad_at
        self.step = 0  # one call per optimizer step (no accumulation in these tests)

    def forward(self, encoder, batch):
        out = super().forward(encoder, batch)
        loss = out.loss
        if self.step in self.nan_loss_at:
            loss = loss * float("nan")
        if self.step in self.nan_grad_at:
            # finite value (0), NaN gradient: d sqrt(u)/du is inf at u = 0, times du/dw = 0
            loss = loss + 0.0 * torch.sqrt(encoder.linear.weight.sum() * 0.0)
        self.step += 1
        return LossOutput(loss, out.parts)


def toy_module(hf_tokenizer, **cues) -> RetrieverModule:
    from conftest import random_bert

    torch.manual_seed(0)
    encoder = ColBERTEncoder("random-bert", dim=8, query_maxlen=8, doc_maxlen=12,
                             _loaded=(random_bert(hidden=16), hf_tokenizer))
    return RetrieverModule(encoder, NaNOnCue(**cues), optimizer=partial(torch.optim.AdamW, lr=0.1))


class WeightsPerStep(pl.Callback):
    def __init__(self):
        self.before: dict[int, torch.Tensor] = {}
        self.after: dict[int, torch.Tensor] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
        self.before[trainer.global_step] = pl_module.encoder.linear.weight.detach().clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        self.after[trainer.global_step - 1] = pl_module.encoder.linear.weight.detach().clone()


def toy_fit(tmp_path: Path, model: RetrieverModule, steps: int = 4, policy: str = "raise",
            callbacks: tuple = ()) -> tuple[pl.Trainer, NonFiniteGuard]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = TrainingDataModule(triples=str(write_triples(tmp_path / "toy.tsv", 16)), batch_size=4, seed=1)
    guard = NonFiniteGuard(policy)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[guard, *callbacks])
    trainer.fit(model, data)
    return trainer, guard


def test_nonfinite_loss_stops_with_step_and_parts(tmp_path, hf_tokenizer):
    with pytest.raises(NonFiniteLossError) as error:
        toy_fit(tmp_path, toy_module(hf_tokenizer, nan_loss_at=(2,)))
    message = str(error.value)
    assert "non-finite loss nan at global step 2" in message and "batch 2" in message
    assert "loss_late=" in message and "pair_accuracy=" in message and "inter_iso=" in message
    assert "nonfinite_guard.policy=skip" in message  # says what to change


def test_nonfinite_loss_skip_keeps_training_and_counts(tmp_path, hf_tokenizer):
    record = WeightsPerStep()
    model = toy_module(hf_tokenizer, nan_loss_at=(1, 3))
    with pytest.warns(UserWarning, match="skipping batch: non-finite loss nan at global step 1"):
        trainer, guard = toy_fit(tmp_path, model, steps=5, policy="skip", callbacks=(record,))
    assert trainer.global_step == 5
    assert guard.skipped == 2
    assert float(trainer.logged_metrics["train/nonfinite_skipped"]) == 2.0
    for step in range(5):
        unchanged = torch.equal(record.before[step], record.after[step])
        assert unchanged == (step in (1, 3)), f"step {step}: weights {'un' if unchanged else ''}changed"
        assert torch.isfinite(record.after[step]).all()
    # skipped steps leave Adam's state alone: 3 real updates
    state = trainer.optimizers[0].state_dict()["state"]
    assert {int(s["step"]) for s in state.values()} == {3}
    # the count survives a checkpoint
    trainer.save_checkpoint(tmp_path / "skip.ckpt")
    restored = NonFiniteGuard("skip")
    (saved,) = [v for k, v in torch.load(tmp_path / "skip.ckpt", weights_only=False)["callbacks"].items()
                if k.startswith("NonFiniteGuard")]
    restored.load_state_dict(saved)
    assert restored.skipped == 2


def test_nonfinite_gradient_of_a_finite_loss(tmp_path, hf_tokenizer):
    with pytest.raises(NonFiniteLossError, match="non-finite gradient at global step 1"):
        toy_fit(tmp_path / "raise", toy_module(hf_tokenizer, nan_grad_at=(1,)))
    record = WeightsPerStep()
    model = toy_module(hf_tokenizer, nan_grad_at=(1,))
    with pytest.warns(UserWarning, match="skipping step: non-finite gradient"):
        _, guard = toy_fit(tmp_path / "skip", model, steps=3, policy="skip", callbacks=(record,))
    assert guard.skipped == 1
    assert torch.equal(record.before[1], record.after[1]) and not torch.equal(record.before[2], record.after[2])
    assert torch.isfinite(model.encoder.linear.weight).all()


def test_guard_policy_is_checked():
    with pytest.raises(ValueError, match="'raise' or 'skip'"):
        NonFiniteGuard("explode")


@pytest.mark.integration
def test_cli_reports_a_nonfinite_loss_in_one_line(shared_dir, tmp_path, capsys, monkeypatch):
    from hil.cli.train import train_main

    calls = []
    original = PairwiseCE.forward

    def nan_at_step_1(self, encoder, batch):
        out = original(self, encoder, batch)
        calls.append(1)
        return LossOutput(out.loss * float("nan"), out.parts) if len(calls) == 2 else out

    monkeypatch.setattr(PairwiseCE, "forward", nan_at_step_1)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train_main(["fit", "--config", str(REPO / "configs/colbert.yaml"), "--config",
                    str(REPO / "configs/presets/smoke.yaml"), "--trainer.default_root_dir", str(tmp_path),
                    "--trainer.logger", "false", "--trainer.max_steps", "3"])
    assert exit_info.value.code == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert errors[0].startswith("error: non-finite loss nan at global step 1 (epoch 0, batch 1); loss parts: "
                                "loss_late=")
    assert "pair_accuracy=" in errors[0]
