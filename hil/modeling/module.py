"""Lightning plumbing shared by every retriever: batch tokenization, optimizer, init_from, export, NaN guard.

Subclasses build their encoder in ``build_encoder`` and their loss in ``compute_loss``; everything else (what is
logged, how a checkpoint or export records its settings) is common.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor

from hil.modeling.encoder import CONFIG_NAME, MultiVectorEncoder
from hil.provenance import provenance


class NonFiniteLossError(FloatingPointError):
    pass


class RetrieverModule(pl.LightningModule):
    """Base LightningModule. Hyperparameters are saved in every checkpoint (``save_hyperparameters``).

    Args:
        lr, weight_decay, adam_eps: AdamW settings (ColBERT v1: Adam, lr 3e-6, constant).
        warmup_steps: linear warm-up from 0 to ``lr``; constant afterwards.
        init_from: start from a Lightning ``.ckpt`` or an exported model directory (fine-tuning).
        on_nonfinite_loss: ``"raise"`` stops with the step number and the loss parts; ``"skip"`` skips the batch.
    """

    def __init__(self, lr: float = 3e-6, weight_decay: float = 0.0, adam_eps: float = 1e-8, warmup_steps: int = 0,
                 init_from: str | None = None, on_nonfinite_loss: str = "raise"):
        super().__init__()
        if on_nonfinite_loss not in ("raise", "skip"):
            raise ValueError(f"model.on_nonfinite_loss must be 'raise' or 'skip' (got {on_nonfinite_loss!r})")
        self.encoder: MultiVectorEncoder

    # -- subclasses -------------------------------------------------------------------------------------------
    def compute_loss(self, batch: dict[str, list[str]]) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError

    # -- training ---------------------------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        # transformers' from_pretrained leaves the backbone in eval mode (dropout off); ColBERT trains with dropout.
        self.train()

    def training_step(self, batch: dict[str, list[str]], batch_idx: int) -> Tensor | None:
        loss, parts = self.compute_loss(batch)
        if not torch.isfinite(loss):
            detail = ", ".join(f"{k}={float(v):.4g}" for k, v in parts.items())
            if self.hparams.on_nonfinite_loss == "raise":
                raise NonFiniteLossError(f"non-finite loss {float(loss)} at global step {self.global_step} "
                                         f"(batch {batch_idx}): {detail}")
            self.log("train/skipped_nonfinite", 1.0, on_step=True, reduce_fx="sum", batch_size=len(batch["queries"]))
            return None
        batch_size = len(batch["queries"])
        self.log("train/loss", loss, on_step=True, prog_bar=True, batch_size=batch_size)
        for name, value in parts.items():
            self.log(f"train/{name}", value, on_step=True, batch_size=batch_size)
        return loss

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

    def export(self, directory: str | Path) -> Path:
        """An export directory: ``from_pretrained``-loadable backbone + heads + ``hil_config.json``."""
        training = {k: v for k, v in self.hparams.items()}
        return self.encoder.save_pretrained(directory, extra={
            "training": training, "global_step": int(self.global_step),
            "module_class": f"{type(self).__module__}.{type(self).__qualname__}"})


def finite_or_nan(value: float) -> float:
    return value if math.isfinite(value) else float("nan")
