"""Training callbacks: per-batch reseeding (exact resume), the non-finite loss / gradient guard, and progress lines
for runs whose output goes to a file.

``train.py`` adds all three to every run (``step_reseed``, ``nonfinite_guard`` and ``progress_lines`` in the
config); a ``pl.Trainer`` built by hand takes them in ``callbacks=[...]``. The first two keep their state in
Lightning checkpoints (``state_dict``).
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from typing import Any, Callable, Literal, Mapping, TextIO

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor

from hil.modeling.distributed import rank
from hil.modeling.module import RetrieverModule

NonFinitePolicy = Literal["raise", "skip"]


class NonFiniteLossError(FloatingPointError):
    pass


def step_seed(base_seed: int, epoch: int, batch_idx: int, process_rank: int) -> int:
    """The torch seed of one training batch: a hash of (run seed, epoch, batch in epoch, rank), 63 bits."""
    digest = hashlib.blake2b(f"{base_seed}:{epoch}:{batch_idx}:{process_rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class StepReseed(pl.Callback):
    """Reseed torch before every training batch from (seed, epoch, batch, rank) -- see :func:`step_seed`.

    This makes dropout a function of *where* training is, not of how it got there (as fairseq reseeds per update):
    a run resumed from a checkpoint draws the same masks as an uninterrupted one without saving any RNG state, on
    any number of ranks, and each rank (and each micro-batch of an accumulated step) gets its own stream.

    Args:
        seed: the base of every batch's seed; None takes the run's ``seed_everything`` (``PL_GLOBAL_SEED``), or
            draws one at fit start (rank 0's, broadcast). Saved in checkpoints, so a resumed run keeps it.
    """

    def __init__(self, seed: int | None = None):
        self.base_seed: int | None = seed

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.base_seed is None:  # neither configured nor restored from a checkpoint
            env_seed = os.environ.get("PL_GLOBAL_SEED")
            drawn = int(env_seed) if env_seed is not None else int(torch.randint(0, 2**62, ()).item())
            self.base_seed = int(trainer.strategy.broadcast(drawn, src=0))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.base_seed is not None:
            torch.manual_seed(step_seed(self.base_seed, trainer.current_epoch, batch_idx, rank()))

    def state_dict(self) -> dict[str, Any]:
        return {"base_seed": self.base_seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.base_seed = state_dict.get("base_seed", self.base_seed)


class NonFiniteGuard(pl.Callback):
    """What a non-finite loss (or, outside fp16 loss scaling, a non-finite gradient of a finite loss) does.

    ``policy="raise"`` stops training with the global step and the loss parts (``NonFiniteLossError``; ``train.py``
    prints it as one line and exits 1). ``"skip"`` drops that step -- weights and optimizer state stay as they
    were (the gradients are removed, so the optimizer skips every parameter: no update, no moment decay, no step
    count) -- warns, and counts it in ``train/nonfinite_skipped`` (saved in checkpoints). The step still counts
    toward ``max_steps`` and the LR schedule.

    Under DDP the loss decision is taken jointly (``strategy.reduce_boolean_decision``): if any rank is non-finite,
    every rank raises or skips, so no rank waits alone in the gradient all-reduce. The gradient check needs no
    vote: it runs after the all-reduce, on gradients that are the same on every rank. Under fp16 loss scaling
    (``16-mixed``) the GradScaler already skips steps with non-finite gradients and lowers its scale.
    """

    def __init__(self, policy: NonFinitePolicy = "raise"):
        if policy not in ("raise", "skip"):
            raise ValueError(f"nonfinite_guard.policy must be 'raise' or 'skip' (got {policy!r})")
        self.policy = policy
        self.skipped = 0             # steps skipped so far, checkpointed
        self._drop_step = False      # set for the current step, consumed in on_before_optimizer_step
        self._batch_idx = -1         # the batch being trained, for messages

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._batch_idx = batch_idx

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        local = not bool(torch.isfinite(loss.detach()).all())
        if not trainer.strategy.reduce_boolean_decision(local, all=False):
            return
        what = f"non-finite loss {float(loss.detach().float())}" if local else "non-finite loss on another rank"
        parts = pl_module.loss_parts if isinstance(pl_module, RetrieverModule) else {}
        detail = ", ".join(f"{k}={float(v):.4g}" for k, v in parts.items())
        message = (f"{what} at global step {trainer.global_step} (epoch {trainer.current_epoch}, batch "
                   f"{self._batch_idx}); loss parts: {detail}")
        self._handle(pl_module, message, "batch", "set nonfinite_guard.policy=skip to skip such batches")

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if not self._drop_step and getattr(trainer.precision_plugin, "scaler", None) is None:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            if grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
                message = f"non-finite gradient at global step {trainer.global_step} (finite loss)"
                self._handle(pl_module, message, "step", "set nonfinite_guard.policy=skip to skip such steps")
        if self._drop_step:
            for group in optimizer.param_groups:  # optimizers leave parameters without a gradient alone
                for param in group["params"]:
                    param.grad = None
            self._drop_step = False

    def _handle(self, pl_module: pl.LightningModule, message: str, what: str, hint: str) -> None:
        if self.policy == "raise":
            raise NonFiniteLossError(f"{message}; {hint}")
        self.skipped += 1
        self._drop_step = True
        rank_zero_warn(f"skipping {what}: {message} (skipped so far: {self.skipped})")
        pl_module.log("train/nonfinite_skipped", float(self.skipped), on_step=True, batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))


ProgressWhen = Literal["auto", "always", "never"]
LOSS_KEY = "train/loss"  # what RetrieverModule.training_step logs


def clock_text(seconds: float) -> str:
    """``3725.4`` -> ``"1:02:05"`` (hours unbounded)."""
    whole = int(round(max(seconds, 0.0)))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def _unit(batch: Any) -> str:
    """What one example of ``batch`` is: a triple (one negative per query), else a query with its N documents."""
    if isinstance(batch, Mapping) and "queries" in batch and "negatives" in batch and \
            len(batch["negatives"]) != len(batch["queries"]):
        return "queries"
    return "triples"


def _triples(batch: Any) -> int:
    """Triples in one batch on one process (a ``TriplesDataModule`` batch: its queries), 0 when unknown."""
    if isinstance(batch, Mapping) and "queries" in batch:
        return len(batch["queries"])
    return int(batch.shape[0]) if isinstance(batch, torch.Tensor) and batch.dim() else 0


class ProgressLines(pl.Callback):
    """A line every ``every_n_seconds`` (and after the first and the last step) saying where training is::

        step 24/64 (38%) | loss 0.6412 | 37.5 triples/s | elapsed 0:00:20 | ETA 0:00:34

    for a run whose output goes to a file or a pipe (``make demo > log``), where the progress bar cannot be seen.
    ``loss`` is the step's logged ``train/loss``; triples/s counts every process's triples since training started
    (queries/s for n-way batches, a query with its N documents);
    ETA extrapolates that pace to ``max_steps`` (or to the planned number of steps when only epochs are set).

    Args:
        every_n_seconds: the least time between two lines.
        when: ``auto`` prints when the output (:attr:`stream`, stdout by default, where Lightning's bar draws) is
            not a terminal, and ``train.py`` then turns the bar off unless the config asks for it; ``always`` /
            ``never`` regardless.

    :attr:`stream` (default: ``sys.stdout`` at training start) and :attr:`clock` (``time.monotonic``) can be
    replaced, e.g. by a test. Only the global-zero process prints.
    """

    def __init__(self, every_n_seconds: float = 30.0, when: ProgressWhen = "auto"):
        if not every_n_seconds > 0 or not math.isfinite(every_n_seconds):
            raise ValueError(f"progress_lines.every_n_seconds must be a positive number (got {every_n_seconds})")
        if when not in ("auto", "always", "never"):
            raise ValueError(f"progress_lines.when must be 'auto', 'always' or 'never' (got {when!r})")
        self.every_n_seconds = float(every_n_seconds)
        self.when = when
        self.stream: TextIO | None = None
        self.clock: Callable[[], float] = time.monotonic
        self._out: TextIO = sys.stdout
        self._active = False
        self._started = self._last_line = 0.0
        self._first_step = self._seen_step = 0
        self._printed_step: int | None = None
        self._triples_seen = 0

    def prints_to(self, stream: TextIO) -> bool:
        """Whether lines go to ``stream`` under this ``when``."""
        return self.when == "always" or (self.when == "auto" and not _is_terminal(stream))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._out = self.stream if self.stream is not None else sys.stdout
        self._active = trainer.is_global_zero and self.prints_to(self._out)
        self._started = self._last_line = self.clock()
        self._first_step = self._seen_step = trainer.global_step
        self._printed_step = None
        self._triples_seen = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._active:
            return
        self._triples_seen += _triples(batch) * trainer.world_size
        self._unit = _unit(batch)
        if trainer.global_step == self._seen_step:  # a micro-batch of an accumulated step: no optimizer step yet
            return
        self._seen_step = trainer.global_step
        now = self.clock()
        if self._printed_step is None or now - self._last_line >= self.every_n_seconds:
            self._print(trainer, outputs, now)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active and self._seen_step != self._printed_step and self._seen_step > self._first_step:
            self._print(trainer, None, self.clock())

    def _print(self, trainer: pl.Trainer, outputs: Any, now: float) -> None:
        self._out.write(self.line(trainer, outputs, now) + "\n")
        self._out.flush()
        self._printed_step, self._last_line = trainer.global_step, now

    def line(self, trainer: pl.Trainer, outputs: Any, now: float) -> str:
        """The progress line at ``now`` (see the class docstring)."""
        step, elapsed = trainer.global_step, max(now - self._started, 1e-9)
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if total is None and math.isfinite(float(trainer.estimated_stepping_batches)):
            total = int(trainer.estimated_stepping_batches)
        parts = [f"step {step}/{total} ({100 * step / total:.0f}%)" if total else f"step {step}"]
        loss = trainer.callback_metrics.get(LOSS_KEY)
        if loss is None and isinstance(outputs, Mapping):
            loss = outputs.get("loss")
        if loss is not None:
            parts.append(f"loss {float(loss):.4f}")
        if self._triples_seen:
            parts.append(f"{self._triples_seen / elapsed:.1f} {getattr(self, '_unit', 'triples')}/s")
        parts.append(f"elapsed {clock_text(elapsed)}")
        done = step - self._first_step
        if total and done > 0:
            parts.append(f"ETA {clock_text((total - step) * elapsed / done)}")
        return " | ".join(parts)
