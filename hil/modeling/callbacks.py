"""Training callbacks: per-batch reseeding (exact resume) and the non-finite loss / gradient guard.

``train.py`` adds both to every run (``step_reseed`` and ``nonfinite_guard`` in the config); a ``pl.Trainer`` built
by hand takes them in ``callbacks=[...]``. Each keeps its state in Lightning checkpoints (``state_dict``).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Literal

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
