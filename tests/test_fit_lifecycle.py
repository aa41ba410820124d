"""``hil fit`` from start to interruption to resume (issue 40, rows 6, 7, 11 and 13):

- Ctrl-C (a real SIGINT, in this process) stops after the running step with ``last.ckpt`` of it, prints the exact
  command that resumes, exits with status 130; that command resumes at the step where it stopped, and ends with the
  weights of an uninterrupted run; a second Ctrl-C (a ``KeyboardInterrupt`` mid-step) points to the last periodic
  checkpoint instead;
- the same command again does not silently start over: one line naming the checkpoint and ``--resume``
  (``auto`` resumes, ``never`` starts a new run beside it);
- ``--ckpt_path`` of a model that the config does not build: one line naming what differs, exit 2;
- a GPU accelerator on a CPU-only machine names ``trainer.accelerator``; an abbreviated option is refused;
- progress lines start at the first step, not at the first logging step; on a terminal, ``hil fit`` says it is
  loading before its imports.
"""

from __future__ import annotations

import csv
import io
import os
import select
import shlex
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from hil.cli.train import run_train
from hil.modeling.module import RetrieverModule

REPO = Path(__file__).resolve().parents[1]
SMOKE = ["fit", "--config", "colbert", "--config", "presets/smoke"]  # 4 steps, a checkpoint every 2


def fit_args(root: Path, *more: str) -> list[str]:
    return [*SMOKE, "--trainer.default_root_dir", str(root), *more]


@pytest.fixture
def interrupt_at(monkeypatch):
    """``arm(step)``: Ctrl-C -- SIGINT sent to this process -- during the training step that starts at global step
    ``step``, once (``signal_it=False``: a ``KeyboardInterrupt`` raised there, as a second Ctrl-C does)."""

    def arm(step: int, signal_it: bool = True) -> None:
        original = RetrieverModule.training_step
        fired = []

        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == step and not fired:
                fired.append(step)
                if not signal_it:
                    raise KeyboardInterrupt
                signal.raise_signal(signal.SIGINT)  # handled between two bytecodes, as a terminal's Ctrl-C
            return original(self, batch, batch_idx)

        monkeypatch.setattr(RetrieverModule, "training_step", training_step)

    return arm


def stopped(args: list[str], capsys) -> tuple[int, list[str]]:
    """Run ``args`` expecting it to end with SystemExit; -> (status, stderr lines)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        run_train(args)
    return stop.value.code, capsys.readouterr().err.strip().splitlines()


def resume_line(lines: list[str]) -> list[str]:
    """The arguments of the resume command printed (``... resume with: hil fit ...``), without ``hil``."""
    (line,) = [line for line in lines if "resume with: " in line]
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert command[0] == "hil"
    return command[1:]


def logged_steps(root: Path, version: int) -> list[int]:
    rows = csv.DictReader((root / "csv" / f"version_{version}" / "metrics.csv").open())
    return sorted({int(row["step"]) for row in rows if row.get("train/loss")})


def global_step(checkpoint: str | Path) -> int:
    return torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)["global_step"]


def test_ctrl_c_stops_after_the_step_saves_it_and_prints_the_command_that_resumes(shared_dir, tmp_path, capsys,
                                                                                   interrupt_at):
    interrupt_at(2)  # during the third step
    code, lines = stopped(fit_args(tmp_path / "run"), capsys)
    assert code == 130, lines
    args = resume_line(lines)
    checkpoint = args[args.index("--ckpt_path") + 1]
    assert args[:-2] == fit_args(tmp_path / "run")  # the same command, plus where to resume from
    assert Path(checkpoint) == tmp_path / "run" / "tb" / "version_0" / "checkpoints" / "last.ckpt"
    assert global_step(checkpoint) == 3  # the step that was running finished and was saved
    assert (tmp_path / "run" / "interrupted.json").is_file()
    assert not (tmp_path / "run" / "export").exists()

    cli = run_train(args)  # the printed command resumes where it stopped
    assert cli.trainer.global_step == 4
    assert logged_steps(tmp_path / "run", 1) == [3]  # the resumed run trained step 4 only (0-based 3)
    assert not (tmp_path / "run" / "interrupted.json").exists()  # completed: nothing left to resume


def test_the_same_command_again_does_not_start_over_silently(shared_dir, tmp_path, capsys, interrupt_at):
    interrupt_at(1)
    assert stopped(fit_args(tmp_path / "run"), capsys)[0] == 130
    checkpoint = tmp_path / "run" / "tb" / "version_0" / "checkpoints" / "last.ckpt"

    code, lines = stopped(fit_args(tmp_path / "run"), capsys)
    errors = [line for line in lines if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in "\n".join(lines), lines
    assert f"--ckpt_path {checkpoint}" in errors[0] and "--resume auto" in errors[0] and \
        "--resume never" in errors[0] and "step 2" in errors[0]
    assert not (tmp_path / "run" / "tb" / "version_1").exists()  # refused before any work

    cli = run_train(fit_args(tmp_path / "run", "--resume", "auto"))
    assert cli.trainer.global_step == 4 and logged_steps(tmp_path / "run", 1) == [2, 3]


def test_resume_never_starts_a_new_run_beside_the_interrupted_one(shared_dir, tmp_path, capsys, interrupt_at):
    interrupt_at(0)
    assert stopped(fit_args(tmp_path / "run", "--trainer.max_steps", "2"), capsys)[0] == 130
    cli = run_train(fit_args(tmp_path / "run", "--trainer.max_steps", "2", "--resume", "never"))
    assert cli.trainer.global_step == 2 and logged_steps(tmp_path / "run", 1) == [0, 1]  # from the start
    assert (tmp_path / "run" / "tb" / "version_0" / "checkpoints" / "last.ckpt").is_file()  # the old run's kept


def test_a_second_ctrl_c_stops_at_once_and_points_to_the_last_periodic_checkpoint(shared_dir, tmp_path, capsys,
                                                                                   interrupt_at):
    interrupt_at(3, signal_it=False)  # mid-step: nothing consistent to save; the checkpoint of step 2 is there
    code, lines = stopped(fit_args(tmp_path / "run"), capsys)
    assert code == 130
    assert any("interrupted at step 3 (the last checkpoint is of step 2)" in line for line in lines), lines
    args = resume_line(lines)
    assert global_step(args[args.index("--ckpt_path") + 1]) == 2


def test_ctrl_c_before_training_starts_is_one_line_and_status_130(shared_dir, tmp_path, capsys, monkeypatch):
    def loading(*args, **kwargs):
        raise KeyboardInterrupt  # while the model loads

    import hil.modeling.encoder

    monkeypatch.setattr(hil.modeling.encoder, "load_backbone", loading)
    code, lines = stopped(fit_args(tmp_path / "run"), capsys)
    assert code == 130 and lines == ["interrupted before the first training step: nothing to resume (the same "
                                     "command starts over)"], lines


@pytest.mark.slow
def test_an_interrupted_and_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(shared_dir, tmp_path, capsys,
                                                                                       interrupt_at):
    whole = run_train(fit_args(tmp_path / "whole")).model.state_dict()
    interrupt_at(2)
    code, lines = stopped(fit_args(tmp_path / "cut"), capsys)
    assert code == 130
    resumed = run_train(resume_line(lines)).model.state_dict()
    assert whole.keys() == resumed.keys()
    for key in whole:
        assert torch.equal(whole[key], resumed[key]), key


# -- a checkpoint of another model ----------------------------------------------------------------------------
def colbert_checkpoint(path: Path, dim: int = 128) -> Path:
    """A Lightning-shaped checkpoint of the smoke preset's ColBERT (``dim`` its projection size)."""
    from hil.modeling.encoder import ColBERTEncoder

    torch.manual_seed(0)
    encoder = ColBERTEncoder(backbone="bert-tiny-splade", dim=dim, query_maxlen=16, doc_maxlen=48)
    torch.save({"state_dict": {f"encoder.{k}": v for k, v in encoder.state_dict().items()},
                "pytorch-lightning_version": "2.6.6", "global_step": 4, "epoch": 0,
                "hil": {"settings": {"architecture": "colbert"}}}, path)
    return path


def test_a_checkpoint_of_another_model_is_one_line_naming_what_differs(shared_dir, tmp_path, capsys):
    checkpoint = colbert_checkpoint(tmp_path / "colbert.ckpt")
    code, lines = stopped([*SMOKE[:3], "--config", "variants/colbert_hil", *SMOKE[3:], "--trainer.default_root_dir",
                           str(tmp_path / "hil"), "--ckpt_path", str(checkpoint)], capsys)
    (error,) = [line for line in lines if line.startswith("error:")]
    assert code == 2 and "Traceback" not in "\n".join(lines), lines
    assert f"--ckpt_path {checkpoint}" in error and "holds a colbert model, this config builds a hil one" in error
    assert "missing: encoder.idf" in error and "unexpected: encoder.linear.weight" in error

    other_dim = colbert_checkpoint(tmp_path / "dim64.ckpt", dim=64)
    code, lines = stopped([*fit_args(tmp_path / "colbert"), "--ckpt_path", str(other_dim)], capsys)
    (error,) = [line for line in lines if line.startswith("error:")]
    assert code == 2 and "other shapes: encoder.linear.weight (64, 128) here (128, 128)" in error, error


# -- row 13: the accelerator, abbreviations ----------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(), reason="a GPU is here")
def test_a_gpu_preset_on_a_cpu_names_trainer_accelerator(shared_dir, tmp_path, capsys):
    code, lines = stopped([*fit_args(tmp_path), "--config", "presets/gpu"], capsys)
    (error,) = [line for line in lines if line.startswith("error:")]
    assert code == 2 and "trainer.accelerator: gpu" in error and "presets/gpu.yaml:" in error, error
    assert "presets/cpu" in error and "--trainer.accelerator cpu" in error
    code, lines = stopped([*fit_args(tmp_path), "--trainer.accelerator", "cuda"], capsys)
    assert code == 2 and any("trainer.accelerator: cuda" in line and ".yaml:" not in line for line in lines), lines


def test_an_abbreviated_option_is_refused_as_a_config_file_refuses_it(shared_dir, tmp_path, capsys):
    code, lines = stopped([*fit_args(tmp_path), "--trainer.max_step", "3"], capsys)
    assert code == 2 and len(lines) == 1 and "--trainer.max_step" in lines[0], lines
    from hil.cli.main import main as hil_main

    assert hil_main(["evaluate", "--mod", "x", "--dataset", "scifact", "--print_config"]) == 2
    assert "--mod" in capsys.readouterr().err


# -- row 11: a first line promptly ---------------------------------------------------------------------------
def test_progress_lines_start_at_the_first_step_between_logging_steps(shared_dir, tmp_path):
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import CSVLogger

    from hil.data.datamodule import TrainingDataModule
    from hil.data.triples_file import TextTriples
    from hil.modeling.callbacks import ProgressLines
    from hil.modeling.encoder import ColBERTEncoder

    pl.seed_everything(0)
    lines = ProgressLines(every_n_seconds=30, when="always")
    ticks = iter(range(0, 1000, 10))  # 10 s a step
    lines.stream, lines.clock = io.StringIO(), lambda: float(next(ticks))
    model = RetrieverModule(ColBERTEncoder(backbone="bert-tiny-splade", dim=16, query_maxlen=16, doc_maxlen=32),
                            optimizer=partial(torch.optim.AdamW, lr=1e-4))
    data = TrainingDataModule(TextTriples("msmarco/triples.train.small.head1000.tsv"), max_triples=24, batch_size=4)
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", logger=CSVLogger(tmp_path), log_every_n_steps=5,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[lines])
    trainer.fit(model, data)
    printed = lines.stream.getvalue().splitlines()
    # Step 1 at once (no loss read yet: step 5 is the first logging step), step 4 after 30 s more with no loss
    # logged yet, the last step with its own.
    assert [line.split(" | ")[0] for line in printed] == ["step 1/6 (17%)", "step 4/6 (67%)", "step 6/6 (100%)"]
    assert "loss" not in printed[0] and "loss" not in printed[1] and " | loss " in printed[2], printed


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="no pseudo-terminals")
def test_on_a_terminal_the_training_command_says_it_is_loading_before_its_imports():
    leader, follower = os.openpty()
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-c", "import hil.cli.train"], stderr=follower,
                               stdout=subprocess.DEVNULL, cwd=REPO)
    os.close(follower)
    try:
        ready, _, _ = select.select([leader], [], [], 30)
        try:
            first = os.read(leader, 200).decode() if ready else ""
        except OSError:  # EIO: the process ended without writing to the terminal
            first = ""
        waited = time.monotonic() - started
    finally:
        process.wait(timeout=120)
        os.close(leader)
    assert first.startswith("loading the training command (torch, Lightning)"), first
    assert waited < 10, waited  # python and hil's own first lines, not torch's imports
