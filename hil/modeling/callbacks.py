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
from typing import Any, Callable, Iterable, Literal, Mapping, TextIO

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor

from hil.modeling.distributed import is_distributed, rank
from hil.modeling.module import RetrieverModule, logs_this_step

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


# What the first non-finite step since the last check was (the ``kind`` recorded on the device).
LOSS, GRADIENT, OTHER_RANK = 1, 2, 3


def nonfinite_gradients(parameters: Iterable[Tensor]) -> Tensor | None:
    """1.0 if any gradient holds a NaN or an infinity, else 0.0 (float32, on the first gradient's device), computed
    on the device; None without gradients. One multi-tensor kernel per device and dtype: GradScaler's own check,
    run with a scale of 1 (it multiplies each gradient by 1.0, which leaves every value as it was)."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for param in parameters:
        grad = param.grad
        if grad is not None:
            grad = grad.coalesce().values() if grad.is_sparse else grad
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
    flags = []
    for (device, _), grads in groups.items():
        found = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.ones((), device=device))
        flags.append(found)
    if not flags:
        return None
    return flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).amax()


class NonFiniteRecord:
    """On the device: the first non-finite step since the last check (its position in the guard's list of batches,
    its kind, the loss and its parts then) and the steps dropped since. Updated with ``torch.where``, never read
    back but by :meth:`read`."""

    def __init__(self, values: Tensor):
        device = values.device
        self.index = torch.full((), -1, dtype=torch.long, device=device)
        self.kind = torch.zeros((), dtype=torch.long, device=device)
        self.values = torch.full_like(values, float("nan"), dtype=torch.float64)
        self.dropped = torch.zeros((), dtype=torch.float64, device=device)

    def note(self, bad: Tensor, kind: Tensor | int, index: int, values: Tensor) -> None:
        first = (bad > 0) & (self.index < 0)
        self.index = torch.where(first, index, self.index)
        self.kind = torch.where(first, kind, self.kind)
        if values.shape == self.values.shape:  # the parts are the same every step (else the record keeps its own)
            self.values = torch.where(first, values.to(self.values.device, torch.float64), self.values)

    def read(self) -> tuple[int, int, int, list[float]]:
        """(index or -1, kind, steps dropped, [loss, *parts]) -- one copy to the host -- and start afresh."""
        summary = torch.cat([torch.stack([self.index.double(), self.kind.double(), self.dropped]),
                             self.values]).cpu().tolist()
        self.index = torch.full_like(self.index, -1)
        self.dropped = torch.zeros_like(self.dropped)
        return int(summary[0]), int(summary[1]), int(summary[2]), summary[3:]


class NonFiniteGuard(pl.Callback):
    """What a non-finite loss (or, outside fp16 loss scaling, a non-finite gradient of a finite loss) does. Decided
    on the device every step; read back at checks only, so a training step makes no host sync for it.

    Every step, on the device: whether the loss is finite (under DDP all-reduced, MAX, so every rank holds the
    joint answer and acts alike), and outside fp16 loss scaling whether every gradient is (:func:`nonfinite_gradients`,
    after DDP's all-reduce, so the same on every rank). The first non-finite step since the last check is recorded
    where it happened (:class:`NonFiniteRecord`: its global step, epoch and batch, the loss and its parts).

    Checks read that record: at every logging step (``log_every_n_steps``), at the step training stops at, before
    any checkpoint is written (``state_dict``) and at the end of training.

    ``policy="raise"``: the check raises ``NonFiniteLossError`` naming the *first* non-finite step (global step,
    epoch, batch) and its loss parts as recorded then; ``train.py`` prints it as one line and exits 1. Training may
    have run on past that step up to the check, but no checkpoint or export ever holds such weights: a checkpoint is
    checked before it is written, and the export follows a finished fit. (With a fused optimizer the non-finite
    step's update is also dropped on the device, see below.)

    ``policy="skip"``: such a step is dropped -- weights and optimizer state stay as they were (no update, no moment
    decay, no step count) -- and the next check warns (the first dropped step, the count) and logs
    ``train/nonfinite_skipped`` (saved in checkpoints). The step still counts toward ``max_steps`` and the LR
    schedule. With a fused optimizer (``fused: true``; AdamW, Adam, SGD) the drop is the optimizer's own
    ``found_inf`` (as under GradScaler), on the device: no host sync. Any other optimizer only skips parameters
    without a gradient, so the gradients are removed on the host: ``skip`` then reads one flag back every step.

    Under fp16 loss scaling (``16-mixed``) the GradScaler skips steps with non-finite gradients itself and lowers its
    scale; a non-finite loss makes every gradient NaN before the scaler looks (``on_after_backward``), so the scaler
    drops that step too, and the guard raises or counts it. Give the optimizer ``fused: true`` there: with any other,
    torch's GradScaler reads its own flag back every step.
    """

    def __init__(self, policy: NonFinitePolicy = "raise"):
        if policy not in ("raise", "skip"):
            raise ValueError(f"nonfinite_guard.policy must be 'raise' or 'skip' (got {policy!r})")
        self.policy = policy
        self.skipped = 0  # steps skipped so far (up to the last check), checkpointed
        self._positions: list[tuple[int, int, int]] = []  # (global step, epoch, batch) of each batch since the check
        self._record: NonFiniteRecord | None = None
        self._part_names: list[str] = []
        self._values: Tensor | None = None     # [loss, *parts] of the last batch
        self._loss_bad: Tensor | None = None   # the joint flag of this step's batches so far
        self._flagged: torch.optim.Optimizer | None = None  # the optimizer given ``found_inf`` this step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._positions, self._record, self._loss_bad = [], None, None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._positions.append((trainer.global_step, trainer.current_epoch, batch_idx))

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        loss = loss.detach()
        local = (~torch.isfinite(loss)).any().float()
        joint = local.clone()
        if is_distributed():  # the joint vote, on the device: every rank then raises or skips alike
            dist.all_reduce(joint, op=dist.ReduceOp.MAX)
        self._loss_bad = joint if self._loss_bad is None else torch.maximum(self._loss_bad, joint)
        parts = pl_module.loss_parts if isinstance(pl_module, RetrieverModule) else {}
        self._part_names = list(parts)
        self._values = torch.stack([loss.float().reshape(()),
                                    *(v.detach().to(loss.device, torch.float32).reshape(()) for v in parts.values())])
        if self._record is None:
            self._record = NonFiniteRecord(self._values)
        self._record.note(joint, torch.where(local > 0, LOSS, OTHER_RANK), len(self._positions) - 1, self._values)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._loss_bad is not None and _scaler(trainer) is not None:  # before GradScaler's check (unscale_)
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None and not p.grad.is_sparse]
            if grads:
                torch._foreach_mul_(grads, torch.where(self._loss_bad > 0, float("nan"), 1.0))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's torch optimizer
        loss_bad, self._loss_bad = self._loss_bad, None
        if _scaler(trainer) is not None:  # the scaler drops non-finite gradients (and, poisoned, non-finite losses)
            found = loss_bad
        else:
            grads_bad = nonfinite_gradients(pl_module.parameters())
            if grads_bad is not None and self._record is not None and self._values is not None:
                self._record.note(grads_bad, GRADIENT, len(self._positions) - 1, self._values)
            found = grads_bad if loss_bad is None else loss_bad if grads_bad is None else \
                torch.maximum(loss_bad, grads_bad.to(loss_bad.device))
            if found is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
                optimizer.found_inf = found  # a fused optimizer skips the step on the device
                self._flagged = optimizer
            elif found is not None and self.policy == "skip" and bool(found):  # the one host read (see above)
                for group in optimizer.param_groups:  # optimizers leave parameters without a gradient alone
                    for param in group["params"]:
                        param.grad = None
        if found is not None and self._record is not None:
            self._record.dropped = self._record.dropped + found.to(self._record.dropped.device)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._flagged is not None:
            del self._flagged.found_inf
            self._flagged = None
        stopping = trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step
        if logs_this_step(trainer) or stopping:
            self.check(pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check(None)

    def check(self, pl_module: pl.LightningModule | None) -> None:
        """Read the record (one copy from the device): raise, or warn and count (and log, given ``pl_module``)."""
        positions, self._positions = self._positions, []
        if self._record is None:
            return
        index, kind, dropped, values = self._record.read()
        if index >= 0:
            step, epoch, batch = positions[index]
            self.report(kind, step, epoch, batch, values, self.skipped + dropped)
        if dropped:
            self.skipped += dropped
            if pl_module is not None:
                pl_module.log("train/nonfinite_skipped", torch.tensor(float(self.skipped)), on_step=True,
                              batch_size=1)

    def report(self, kind: int, step: int, epoch: int, batch: int, values: list[float], skipped: int) -> None:
        if kind == GRADIENT:
            message, what, unit = f"non-finite gradient at global step {step} (finite loss)", "step", "steps"
        else:
            loss = f"non-finite loss {values[0]}" if kind == LOSS else "non-finite loss on another rank"
            detail = ", ".join(f"{name}={value:.4g}" for name, value in zip(self._part_names, values[1:]))
            message = f"{loss} at global step {step} (epoch {epoch}, batch {batch}); loss parts: {detail}"
            what, unit = "batch", "batches"
        if self.policy == "raise":
            raise NonFiniteLossError(f"{message}; set nonfinite_guard.policy=skip to skip such {unit}")
        rank_zero_warn(f"skipping {what}: {message} (skipped so far: {skipped})")

    def state_dict(self) -> dict[str, Any]:
        self.check(None)  # a checkpoint never holds weights trained past an unreported non-finite step
        return {"skipped": self.skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))


def _scaler(trainer: pl.Trainer) -> Any:
    return getattr(trainer.precision_plugin, "scaler", None)


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
    """What one example of ``batch`` is: a triple (two documents per query), else a query with its N documents."""
    if isinstance(batch, Mapping) and batch.get("documents") and len(batch["documents"][0]) != 2:
        return "queries"
    return "triples"


def _triples(batch: Any) -> int:
    """Triples in one batch on one process (a ``TrainingDataModule`` batch: its queries), 0 when unknown."""
    if isinstance(batch, Mapping) and "queries" in batch:
        return len(batch["queries"])
    return int(batch.shape[0]) if isinstance(batch, torch.Tensor) and batch.dim() else 0


class ProgressLines(pl.Callback):
    """A line at most every ``every_n_seconds`` (and after the first and the last step) saying where training is::

        step 24/64 (38%) | loss 0.6412 | 37.5 triples/s | elapsed 0:00:20 | ETA 0:00:34

    for a run whose output goes to a file or a pipe (``make demo > log``), where the progress bar cannot be seen.
    ``loss`` is the step's logged ``train/loss``; triples/s counts every process's triples since training started
    (queries/s for n-way batches, a query with its N documents);
    ETA extrapolates that pace to ``max_steps`` (or to the planned number of steps when only epochs are set).
    The first line comes after the first step (on a CPU that can be a minute into ``make demo``; waiting for the
    first logging step was minutes more of silence), the next ones whenever ``every_n_seconds`` have passed. The
    loss is read only at logging steps (``log_every_n_steps``), where the training loop reads values back from the
    device anyway: a line between them shows the last logged loss with its step, ``loss 0.6412 (step 8)``, or none
    yet, so that no step waits for the device.

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
        self._logged: tuple[float, int] | None = None  # (loss, step) read at the last logging step

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
        self._logged = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._active:
            return
        self._triples_seen += _triples(batch) * trainer.world_size
        self._unit = _unit(batch)
        if trainer.global_step == self._seen_step:  # a micro-batch of an accumulated step: no optimizer step yet
            return
        self._seen_step = trainer.global_step
        if logs_this_step(trainer) or not trainer.log_every_n_steps:
            self._read_loss(trainer, outputs)
        now = self.clock()
        if self._printed_step is None or now - self._last_line >= self.every_n_seconds:
            self._print(trainer, now)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active and self._seen_step != self._printed_step and self._seen_step > self._first_step:
            self._print(trainer, self.clock())

    def _read_loss(self, trainer: pl.Trainer, outputs: Any) -> None:
        """Keep the step's logged ``train/loss`` (else its ``loss`` output): called at logging steps only."""
        loss = trainer.callback_metrics.get(LOSS_KEY)
        if loss is None and isinstance(outputs, Mapping):
            loss = outputs.get("loss")
        if loss is not None:
            self._logged = (float(loss), trainer.global_step)

    def _print(self, trainer: pl.Trainer, now: float) -> None:
        self._out.write(self.line(trainer, now) + "\n")
        self._out.flush()
        self._printed_step, self._last_line = trainer.global_step, now

    def line(self, trainer: pl.Trainer, now: float) -> str:
        """The progress line at ``now`` (see the class docstring)."""
        step, elapsed = trainer.global_step, max(now - self._started, 1e-9)
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if total is None and math.isfinite(float(trainer.estimated_stepping_batches)):
            total = int(trainer.estimated_stepping_batches)
        parts = [f"step {step}/{total} ({100 * step / total:.0f}%)" if total else f"step {step}"]
        if self._logged is not None:
            loss, logged_at = self._logged
            parts.append(f"loss {loss:.4f}" + ("" if logged_at == step else f" (step {logged_at})"))
        if self._triples_seen:
            parts.append(f"{self._triples_seen / elapsed:.1f} {getattr(self, '_unit', 'triples')}/s")
        parts.append(f"elapsed {clock_text(elapsed)}")
        done = step - self._first_step
        if total and done > 0:
            parts.append(f"ETA {clock_text((total - step) * elapsed / done)}")
        return " | ".join(parts)
