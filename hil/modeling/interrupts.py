"""Ctrl-C during training: stop after the step that is running, with a checkpoint of it.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be -- halfway through an optimizer step, say,
with some parameters updated and others not -- and Lightning then only stops (exit 1), so the run's last checkpoint
is whatever the periodic ``ModelCheckpoint`` wrote, up to ``every_n_train_steps`` steps back. :class:`StopAtStepEnd`
takes SIGINT over while training runs: the first Ctrl-C is noted, the step finishes, ``last.ckpt`` is written at that
step boundary (where the periodic checkpoints are written, so resuming from it is as exact as from them) and
training stops by raising ``KeyboardInterrupt`` there; a second Ctrl-C stops at once, without one.
``train.py`` (:mod:`hil.cli.train`) adds it to every run and prints the command that resumes.

Under DDP every rank gets the signal from the terminal, not necessarily within the same step: the ranks agree at
the next logging step, where they synchronize anyway (an agreement every step would make each step wait for it).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

from hil.modeling.module import logs_this_step

LAST_CHECKPOINT = "last.ckpt"


def checkpoint_folder(trainer: pl.Trainer) -> Path:
    """Where the run's checkpoints go: its ``ModelCheckpoint``'s folder, else ``<log dir>/checkpoints``."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath:
        return Path(callback.dirpath)
    return Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"


def last_checkpoint(trainer: pl.Trainer) -> Path | None:
    """The run's ``last.ckpt`` (the periodic one, or the one written on interrupt) when there is one."""
    callback = trainer.checkpoint_callback
    named = getattr(callback, "last_model_path", "") if isinstance(callback, ModelCheckpoint) else ""
    for candidate in (Path(named) if named else None, checkpoint_folder(trainer) / LAST_CHECKPOINT):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


class StopAtStepEnd(pl.Callback):
    """The first Ctrl-C (SIGINT) stops training after the running step, with ``last.ckpt`` written there (module
    docstring); a second one stops at once. After an interrupt, :attr:`saved` is the checkpoint written (None when
    none could be: a second Ctrl-C, or an interrupt outside a training step) and :attr:`step` the global step.

    The handler is in place from the start of training to its end; the signal handler that was there before is
    put back then. Only the main thread can take signals over; elsewhere (a notebook's worker thread) Ctrl-C keeps
    Python's behaviour.
    """

    def __init__(self) -> None:
        self.requested = False
        self.saved: Path | None = None
        self.step: int | None = None
        self._previous: Any = None
        self._installed = False
        self._announce = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.requested, self.saved, self.step = False, None, None
        self._announce = trainer.is_global_zero
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_signal)
            self._installed = True

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.requested:  # the second Ctrl-C: at once, as without this callback
            self._restore()
            raise KeyboardInterrupt
        self.requested = True
        if self._announce:
            sys.stderr.write("\ninterrupted: stopping after this step with a checkpoint of it "
                             "(Ctrl-C again stops at once, without one)\n")
            sys.stderr.flush()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        requested = self.requested
        if trainer.world_size > 1:
            if not logs_this_step(trainer):
                return
            requested = trainer.strategy.reduce_boolean_decision(requested, all=False)
        if not requested:
            return
        self.step = trainer.global_step
        self.saved = self.save_last(trainer)
        raise KeyboardInterrupt

    @staticmethod
    def save_last(trainer: pl.Trainer) -> Path:
        """``last.ckpt`` of this step, written beside and renamed into place (a ``save_last: link`` run has a link
        there, which must be replaced, not written through into the checkpoint it points at)."""
        target = checkpoint_folder(trainer) / LAST_CHECKPOINT
        staging = target.with_name(f".{target.name}.interrupted.tmp")
        trainer.save_checkpoint(staging, weights_only=False)  # every rank calls it; the global-zero one writes
        if trainer.is_global_zero:
            os.replace(staging, target)
        trainer.strategy.barrier("StopAtStepEnd.save_last")
        return target

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, KeyboardInterrupt):
            self._restore()
            return
        if self.step is None:
            self.step = trainer.global_step
        # Lightning ignores SIGINT while it shuts down (a repeated Ctrl-C would break its teardown): left so; the
        # caller puts its own handler back afterwards (train.py does).
        self._installed = False

    def _restore(self) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.default_int_handler)
            self._installed = False
