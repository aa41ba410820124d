"""The one LightningModule: a retriever trained as encoder + loss (+ isotropy regularizer).

Every model of the paper is a composition chosen in YAML by ``class_path`` (``configs/colbert.yaml`` and the deltas
in ``configs/variants/``):

    ColBERT v1               encoder ColBERTEncoder, loss PairwiseCE, no regularizer
    ColBERT-iso / -aniso     ... + InterIsoRegularizer(weight 0.4 / -0.1)        (also CosReg, I-STAR)
    ColBERT-HIL              encoder HILEncoder, loss HILLoss(reg_weight -0.3)

One training step (four files: this one, ``encoder.py``, ``losses.py``, ``hil/isotropy/regularizers.py``):
    batch of strings {queries, positives, negatives} (B each, ``hil.data.datamodule``)
    -> encoder.encode_queries / encode_documents       queries (B, Lq), docs (2B, Ld) = [positives; negatives]
    -> loss(encoder, TripleBatch)                       L_late and the parts to log
    -> + regularizer(queries, docs, masks, pair_index)  lambda * L_reg
The optimizer and LR schedule are injected (``optimizer`` / ``lr_scheduler`` class paths, Lightning's CLI
callables); reseeding and the non-finite guard are callbacks (``hil.modeling.callbacks``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor

from hil.data.datamodule import TriplesDataModule
from hil.data.errors import UserError, one_line
from hil.isotropy.regularizers import Regularizer
from hil.modeling.encoder import MultiVectorEncoder
from hil.modeling.export import export_model
from hil.modeling.formats import ModelFormatError
from hil.modeling.initial_weights import initial_state
from hil.modeling.losses import PairwiseCE, TrainingLoss, TripleBatch
from hil.provenance import provenance

# Parameters that take no weight decay when the optimizer has one (BERT's convention).
NO_DECAY_SUFFIXES = ("bias", "LayerNorm.weight", "layer_norm.weight")
# Optimizer settings every torch optimizer that takes them wants finite and >= 0.
NON_NEGATIVE_OPTIMIZER_SETTINGS = ("lr", "eps", "weight_decay", "momentum")
OPTIMIZER_KEY = "model.optimizer.init_args"


def parameter_groups(decay: list[Tensor], no_decay: list[Tensor]) -> list[dict[str, Any]]:
    """What the optimizer is built from: biases and LayerNorm weights without weight decay."""
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def check_optimizer(optimizer: OptimizerCallable) -> None:
    """Refuse, naming the config key, optimizer settings that torch would only refuse when training starts, with a
    traceback (``torch.optim``'s ``ValueError: Invalid learning rate``): the common ones by name, then any other by
    building the optimizer once over stand-in parameters."""
    settings = getattr(optimizer, "keywords", None) or {}  # jsonargparse gives a functools.partial of the class
    for name, value in settings.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if name in NON_NEGATIVE_OPTIMIZER_SETTINGS and value is not None and number and not (
                math.isfinite(value) and value >= 0):
            raise UserError(f"{OPTIMIZER_KEY}.{name} must be a finite number >= 0 (got {value!r})")
        if name == "betas" and isinstance(value, (tuple, list)) and not (
                len(value) == 2 and all(isinstance(beta, (int, float)) and 0 <= beta < 1 for beta in value)):
            raise UserError(f"{OPTIMIZER_KEY}.betas must be two numbers in [0, 1) (got {list(value)!r})")
    try:
        optimizer(parameter_groups([torch.nn.Parameter(torch.zeros(1))], [torch.nn.Parameter(torch.zeros(1))]))
    except (ValueError, TypeError, RuntimeError) as error:  # the optimizer's own checks of the other settings
        raise UserError(f"{OPTIMIZER_KEY}: {one_line(error)}") from None


class LinearWarmup(torch.optim.lr_scheduler.LambdaLR):
    """Linear warm-up from ``lr / warmup_steps`` to ``lr`` over ``warmup_steps`` steps, constant afterwards
    (``warmup_steps = 0``: constant, ColBERT v1's schedule). Stepped every optimizer step.

    The factor is written in closed form, ``min(1, (step + 1) / warmup_steps)``: torch's ``LinearLR`` reaches the
    same values by repeated multiplication, which rounds differently.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int = 0):
        if warmup_steps < 0:
            raise ValueError(f"lr_scheduler.warmup_steps must be >= 0 (got {warmup_steps})")
        self.warmup_steps = int(warmup_steps)
        super().__init__(optimizer, self.factor)

    def factor(self, step: int) -> float:
        return min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else 1.0


class RetrieverModule(pl.LightningModule):
    """Composes an encoder, a loss and an optional isotropy regularizer; logs the loss and its parts.

    Args:
        encoder: the model trained and exported (``ColBERTEncoder``, ``HILEncoder``).
        loss: the training objective over a batch of triples (default ``PairwiseCE``, ColBERT v1's).
        regularizer: an isotropy term added to the loss (``InterIsoRegularizer``, ``CosRegRegularizer``,
            ``IStarRegularizer``); needs a one-head encoder. None: no term.
        optimizer: builds the optimizer from parameter groups (biases and LayerNorm weights get no weight decay).
            The configs use ``torch.optim.AdamW`` with ColBERT v1's lr 3e-6, eps 1e-8 and no weight decay; a bare
            default is torch's AdamW with its own defaults.
        lr_scheduler: stepped every optimizer step (the configs: ``LinearWarmup``); None keeps lr constant.
        init_from: start from a Lightning ``.ckpt`` or an exported model directory (fine-tuning).

    Logged (``train/<name>``): ``loss``, every part the loss and the regularizer report (``loss_late``,
    ``pair_accuracy``, ``score_margin``, ``reg``...), ``loss_reg`` (the weighted regularizer term) and InterIso of
    each head (``inter_iso``, or ``inter_iso_<head>`` with several heads).
    """

    def __init__(self, encoder: MultiVectorEncoder, loss: TrainingLoss | None = None,
                 regularizer: Regularizer | None = None, optimizer: OptimizerCallable = torch.optim.AdamW,
                 lr_scheduler: LRSchedulerCallable | None = None, init_from: str | None = None):
        super().__init__()
        # The modules are recorded through their settings (``on_save_checkpoint``), not as hyperparameters.
        self.save_hyperparameters(ignore=["encoder", "loss", "regularizer"])
        self.encoder = encoder
        self.loss = loss if loss is not None else PairwiseCE()
        self.regularizer = regularizer
        if regularizer is not None:
            if len(encoder.head_names) != 1:
                raise ValueError(f"model.regularizer applies to a one-head encoder; {encoder.architecture} has heads "
                                 f"{list(encoder.head_names)} (ColBERT-HIL regularizes through its loss)")
            regularizer.bind(encoder.dim)
        check_optimizer(optimizer)
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.loss_parts: dict[str, Tensor] = {}  # the last step's parts (the non-finite guard reports them)
        self.load_initial_weights(init_from)

    # -- training ---------------------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if stage == "fit" and self.encoder.needs_idf and isinstance(datamodule, TriplesDataModule):
            found = datamodule.idf_documents()
            if found is not None:  # None: uniform weights (data.idf_source: none)
                texts, source = found
                self.encoder.set_idf_from_texts(texts, source=source)

    def on_fit_start(self) -> None:
        # transformers' from_pretrained leaves the backbone in eval mode (dropout off); ColBERT trains with dropout.
        self.train()

    def compute_loss(self, batch: dict[str, list[str]]) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one batch of string triples and its detached parts (what ``training_step`` logs)."""
        queries = self.encoder.encode_queries(batch["queries"])                              # (B, Lq)
        docs = self.encoder.encode_documents(batch["positives"] + batch["negatives"])       # (2B, Ld)
        triples = TripleBatch(queries, docs)
        out = self.loss(self.encoder, triples)
        loss, parts = out.loss, dict(out.parts)
        if self.regularizer is not None:
            (head,) = self.encoder.head_names
            reg, logs = self.regularizer(queries.heads[head], docs.heads[head], queries.mask, docs.mask,
                                         triples.pair_index, inter_iso_values=triples.inter_iso(head))
            loss = loss + reg
            parts.update(loss_reg=reg.detach(), **logs)
        for head in self.encoder.head_names:  # InterIso of each head, shared with whatever computed it already
            name = "inter_iso" if len(self.encoder.head_names) == 1 else f"inter_iso_{head}"
            if name not in parts:
                parts[name] = triples.inter_iso(head).detach().mean()
        return loss, parts

    def training_step(self, batch: dict[str, list[str]], batch_idx: int) -> Tensor:
        loss, parts = self.compute_loss(batch)
        self.loss_parts = parts  # what the non-finite guard reports (the module itself never syncs on the loss)
        batch_size = len(batch["queries"])
        self.log("train/loss", loss, on_step=True, prog_bar=True, batch_size=batch_size)
        for name, value in parts.items():
            self.log(f"train/{name}", value, on_step=True, batch_size=batch_size)
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        decay, no_decay = [], []
        for name, param in self.named_parameters():
            if param.requires_grad:
                (no_decay if name.endswith(NO_DECAY_SUFFIXES) else decay).append(param)
        optimizer = self.optimizer_factory(parameter_groups(decay, no_decay))
        if self.scheduler_factory is None:
            return {"optimizer": optimizer}
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer), "interval": "step"}}

    # -- init / export --------------------------------------------------------------------------------------------
    def load_initial_weights(self, source: str | None) -> None:
        """Apply ``init_from`` (``hil.modeling.initial_weights``): a ``.ckpt``, an export, a Stanford ColBERT or a
        PyLate checkpoint."""
        if not source:
            return
        state, may_stay = initial_state(self.encoder, source)
        missing, unexpected = self.encoder.load_state_dict(state, strict=False)
        missing = [key for key in missing if key not in may_stay]
        if missing or unexpected:
            raise ModelFormatError(f"model.init_from={source}: weights do not fit this model "
                                   f"(missing {missing[:5]}, unexpected {unexpected[:5]}); check backbone/dim")

    def training_record(self) -> dict[str, Any]:
        """How this model is trained: loss, regularizer, optimizer and schedule settings."""
        return {"loss": self.loss.settings(),
                "regularizer": None if self.regularizer is None else self.regularizer.settings(),
                **{k: v for k, v in self.hparams.items() if not k.startswith("_")}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["hil"] = provenance(self.encoder.settings(), training=self.training_record(),
                                       module_class=f"{type(self).__module__}.{type(self).__qualname__}")

    def export(self, directory: str | Path, data: dict[str, Any] | None = None) -> Path:
        """An export folder (``hil.modeling.export``): our layout, and the Stanford ColBERT layout for a ColBERT.
        ``data``: the training data settings, recorded for the model card."""
        return export_model(self.encoder, directory, extra={
            "training": self.training_record(), "global_step": int(self.global_step),
            "module_class": f"{type(self).__module__}.{type(self).__qualname__}",
            **({"data": data} if data is not None else {})})
