"""Lightning plumbing shared by every retriever: batch tokenization, optimizer, init_from, export, NaN guard.

Subclasses build their encoder in ``build_encoder`` and their loss in ``compute_loss``; everything else (what is
logged, how a checkpoint or export records its settings) is common.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor

from hil.modeling.distributed import any_rank, rank
from hil.modeling.encoder import CONFIG_NAME, MultiVectorEncoder
from hil.provenance import provenance


class NonFiniteLossError(FloatingPointError):
    pass


TRAINING_STATE_KEY = "hil_training_state"  # checkpoint entry: the step RNG seed and the skip counter


def step_seed(base_seed: int, epoch: int, batch_idx: int, process_rank: int) -> int:
    """The torch seed of one training batch: a hash of (run seed, epoch, batch in epoch, rank), 63 bits.

    Reseeding before every batch (as fairseq does per update) makes dropout a function of *where* training is, not of
    how it got there: a run resumed from a checkpoint draws the same masks as an uninterrupted one without saving
    any RNG state, on any number of ranks, and each rank (and each micro-batch of an accumulated step) gets its own.
    """
    digest = hashlib.blake2b(f"{base_seed}:{epoch}:{batch_idx}:{process_rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class RetrieverModule(pl.LightningModule):
    """Base LightningModule. Hyperparameters are saved in every checkpoint (``save_hyperparameters``).

    Args:
        lr, weight_decay, adam_eps: AdamW settings (ColBERT v1: Adam, lr 3e-6, constant).
        warmup_steps: linear warm-up from 0 to ``lr``; constant afterwards.
        init_from: start from a Lightning ``.ckpt`` or an exported model directory (fine-tuning).
        on_nonfinite_loss: what a non-finite loss (or, outside fp16 loss scaling, a non-finite gradient) does.
            ``"raise"`` stops training with the global step and the loss parts (``NonFiniteLossError``); ``"skip"``
            leaves weights and optimizer state as they were for that step, warns, and counts it in
            ``train/nonfinite_skipped`` (saved in checkpoints). The step still counts toward ``max_steps`` and
            the LR schedule. Under DDP the decision is taken jointly: if any rank is non-finite, every rank raises
            or skips (a lone rank skipping would leave the others waiting in the gradient all-reduce).

    Reproducibility: before every batch the torch RNG is reseeded from (``PL_GLOBAL_SEED``, epoch, batch, rank) --
    see ``step_seed`` -- so a run resumed from a checkpoint continues bit-for-bit like an uninterrupted one.
    """

    def __init__(self, lr: float = 3e-6, weight_decay: float = 0.0, adam_eps: float = 1e-8, warmup_steps: int = 0,
                 init_from: str | None = None, on_nonfinite_loss: str = "raise"):
        super().__init__()
        if on_nonfinite_loss not in ("raise", "skip"):
            raise ValueError(f"model.on_nonfinite_loss must be 'raise' or 'skip' (got {on_nonfinite_loss!r})")
        self.encoder: MultiVectorEncoder
        self.nonfinite_skipped = 0             # batches skipped so far (on_nonfinite_loss: skip), checkpointed
        self._skip_optimizer_step = False      # set by a skipped batch, consumed by on_before_optimizer_step
        self._step_seed_base: int | None = None  # fixed at fit start (or restored from the checkpoint)

    # -- subclasses -------------------------------------------------------------------------------------------
    def compute_loss(self, batch: dict[str, list[str]]) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError

    # -- training ---------------------------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        # transformers' from_pretrained leaves the backbone in eval mode (dropout off); ColBERT trains with dropout.
        self.train()
        if self._step_seed_base is None:  # not restored from a checkpoint
            env_seed = os.environ.get("PL_GLOBAL_SEED")
            drawn = int(env_seed) if env_seed is not None else int(torch.randint(0, 2**62, ()).item())
            self._step_seed_base = int(self.trainer.strategy.broadcast(drawn, src=0))

    def training_step(self, batch: dict[str, list[str]], batch_idx: int) -> Tensor | None:
        if self._step_seed_base is not None:
            torch.manual_seed(step_seed(self._step_seed_base, self.current_epoch, batch_idx, rank()))
        loss, parts = self.compute_loss(batch)
        batch_size = len(batch["queries"])
        local_nonfinite = not bool(torch.isfinite(loss.detach()).all())
        if any_rank(local_nonfinite, device=loss.device):
            return self._nonfinite(loss, parts, batch_idx, batch_size, local_nonfinite)
        self.log("train/loss", loss, on_step=True, prog_bar=True, batch_size=batch_size)
        for name, value in parts.items():
            self.log(f"train/{name}", value, on_step=True, batch_size=batch_size)
        return loss

    def _nonfinite(self, loss: Tensor, parts: dict[str, Tensor], batch_idx: int, batch_size: int,
                   local: bool) -> Tensor:
        detail = ", ".join(f"{k}={float(v):.4g}" for k, v in parts.items())
        what = f"non-finite loss {float(loss.detach().float())}" if local else "non-finite loss on another rank"
        message = (f"{what} at global step {self.global_step} (epoch {self.current_epoch}, batch {batch_idx}); "
                   f"loss parts: {detail}")
        if self.hparams.on_nonfinite_loss == "raise":
            raise NonFiniteLossError(message + "; set model.init_args.on_nonfinite_loss=skip to skip such batches")
        self.nonfinite_skipped += 1
        rank_zero_warn(f"skipping batch: {message} (skipped so far: {self.nonfinite_skipped})")
        self.log("train/nonfinite_skipped", float(self.nonfinite_skipped), on_step=True, batch_size=batch_size)
        # A loss with exact zero gradient for every parameter, not None: under DDP every rank must run backward
        # (the gradient all-reduce). The step itself is then dropped in on_before_optimizer_step.
        self._skip_optimizer_step = True
        return sum((p.sum() for p in self.parameters() if p.requires_grad), torch.zeros((), device=loss.device)) * 0.0

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the step of a skipped batch; apply the non-finite policy to gradients of a finite loss too."""
        if not self._skip_optimizer_step and not self._loss_scaling():
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            # Gradients are already all-reduced under DDP, so every rank takes the same decision here.
            if grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
                message = f"non-finite gradient at global step {self.global_step} (finite loss)"
                if self.hparams.on_nonfinite_loss == "raise":
                    raise NonFiniteLossError(message + "; set model.init_args.on_nonfinite_loss=skip to skip such "
                                             "steps")
                self.nonfinite_skipped += 1
                rank_zero_warn(f"skipping step: {message} (skipped so far: {self.nonfinite_skipped})")
                self._skip_optimizer_step = True
        if self._skip_optimizer_step:
            # Optimizers leave parameters without a gradient alone: no update, no moment decay, no step count.
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None
            self._skip_optimizer_step = False

    def _loss_scaling(self) -> bool:
        """True under fp16 loss scaling, whose GradScaler already skips steps with non-finite gradients."""
        return getattr(self.trainer.precision_plugin, "scaler", None) is not None

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
        decay = [p for n, p in self.named_parameters() if p.requires_grad and not n.endswith(no_decay)]
        other = [p for n, p in self.named_parameters() if p.requires_grad and n.endswith(no_decay)]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                                       {"params": other, "weight_decay": 0.0}], lr=hp.lr, eps=hp.adam_eps)
        warmup = max(int(hp.warmup_steps), 0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- init / export --------------------------------------------------------------------------------------------
    def load_initial_weights(self) -> None:
        """Apply ``init_from``: a ``.ckpt`` (its module state) or an export directory (its encoder)."""
        source = self.hparams.init_from
        if not source:
            return
        path = Path(source)
        if path.is_dir():
            if not (path / CONFIG_NAME).is_file():
                raise FileNotFoundError(f"model.init_from={source}: directory has no {CONFIG_NAME} (not an export)")
            from hil.modeling.loading import load_encoder

            state = load_encoder(path).state_dict()
        elif path.is_file():
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
            state = {k.removeprefix("encoder."): v for k, v in checkpoint["state_dict"].items()
                     if k.startswith("encoder.")}
        else:
            raise FileNotFoundError(f"model.init_from={source}: no such checkpoint file or export directory")
        missing, unexpected = self.encoder.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"model.init_from={source}: weights do not fit this model "
                             f"(missing {missing[:5]}, unexpected {unexpected[:5]}); check backbone/dim")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["hil"] = provenance(self.encoder.settings(),
                                       module_class=f"{type(self).__module__}.{type(self).__qualname__}")
        checkpoint[TRAINING_STATE_KEY] = {"step_seed_base": self._step_seed_base,
                                          "nonfinite_skipped": self.nonfinite_skipped}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(TRAINING_STATE_KEY, {})
        self._step_seed_base = state.get("step_seed_base", self._step_seed_base)
        self.nonfinite_skipped = int(state.get("nonfinite_skipped", 0))

    def export(self, directory: str | Path) -> Path:
        """An export directory: ``from_pretrained``-loadable backbone + heads + ``hil_config.json``."""
        training = {k: v for k, v in self.hparams.items()}
        return self.encoder.save_pretrained(directory, extra={
            "training": training, "global_step": int(self.global_step),
            "module_class": f"{type(self).__module__}.{type(self).__qualname__}"})


def finite_or_nan(value: float) -> float:
    return value if math.isfinite(value) else float("nan")
