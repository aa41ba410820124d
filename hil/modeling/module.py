"""The one LightningModule: a retriever trained as encoder + a weighted list of objective terms.

Every model of the paper is a composition chosen in YAML by ``class_path`` (``configs/colbert.yaml`` and the deltas
in ``configs/variants/``):

    ColBERT v1               encoder ColBERTEncoder, loss PairwiseCE, no regularizer
    ColBERT-iso / -aniso     ... + InterIsoRegularizer(weight 0.4 / -0.1)        (also CosReg, I-STAR)
    ColBERT-HIL              encoder HILEncoder, loss HILLoss(reg_weight -0.3)
    distilled (ColBERTv2)    loss KLDistillation on n-way examples with teacher scores, + any regularizer

The objective is ``sum_k weight_k * term_k`` (``hil.modeling.terms``, as Lightning IR's ``loss_functions``): the
``loss`` (weight 1 unless set), the isotropy ``regularizer`` (weight = its lambda) and any further ``terms`` (a
loss or a regularizer each: ``InBatchCE`` beside a distillation loss, ``HILIsotropy`` beside ColBERT-HIL's, ...).

One training step (``batch.py``, ``losses.py``, ``terms.py``, ``hil/isotropy/regularizers.py``):
    batch of strings {queries (B), documents (B, N), [teacher_scores (B, N)]}  (hil.data.datamodule)
          with its tokens {queries (B, Lq), documents (N B, Ld) column by column}, tokenized in the loader with
          the encoder's tokenizer (a batch without them is tokenized here)
    -> encoder.encode                                  queries (B, Lq), docs (N B, Ld): document j of query i at j B + i
    -> RankingBatch(queries, docs, teacher_scores)     (N = 2: the triples' [positives; negatives], as always)
    -> sum_k weight_k * term_k(encoder, batch)         and every term's parts to log
With ``gradcache_chunk_size`` the encoding is done in chunks and the gradient assembled by GradCache
(``hil.modeling.gradcache``). The optimizer and LR schedule are injected (``optimizer`` / ``lr_scheduler`` class
paths, Lightning's CLI callables); reseeding and the non-finite guard are callbacks (``hil.modeling.callbacks``).

A step never makes the host wait for the device (``tests/test_host_syncs.py``): the loss and its parts are logged
as device tensors, which Lightning reads back only at the steps it writes to the loggers (:func:`logs_this_step`);
the progress bar's ``loss`` is copied to the host at those steps only.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor

from hil.data.datamodule import TrainingDataModule, column_by_column
from hil.data.tokenization import ColBERTTokenizer, TokenizedBatch
from hil.errors import UserError, one_line
from hil.isotropy.regularizers import Regularizer
from hil.modeling.batch import RankingBatch
from hil.modeling.encoder import MultiVectorEncoder
from hil.modeling.export import export_model
from hil.modeling.formats import ModelFormatError
from hil.modeling.gradcache import cached_objective
from hil.modeling.initial_weights import initial_state
from hil.modeling.losses import PairwiseCE
from hil.modeling.terms import NamedTerm, Term, name_terms, weighted_objective
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


def ranking_texts(batch: dict[str, Any]) -> tuple[list[str], list[str], Tensor | None]:
    """A batch of strings (``hil.data.datamodule``) as (queries (B), documents (N B) column by column
    (:func:`~hil.data.datamodule.column_by_column`), teacher scores (B, N) or None)."""
    queries, documents = batch["queries"], batch["documents"]
    if not queries or len(documents) != len(queries):
        raise ValueError(f"a training batch has B queries and the N documents of each; got {len(queries)} queries "
                         f"and documents for {len(documents)}")
    return list(queries), column_by_column(documents), batch.get("teacher_scores")


def ranking_inputs(batch: dict[str, Any], tokenizer: ColBERTTokenizer
                   ) -> tuple[TokenizedBatch, TokenizedBatch, Tensor | None]:
    """A training batch as (queries (B, Lq), documents (N B, Ld), teacher scores (B, N) or None): the tokens the
    loader made (``hil.data.datamodule.TokenizedCollate``, under ``tokenized``), else the strings tokenized here --
    the same tensors either way."""
    tokens = batch.get("tokenized")
    if tokens is not None:
        return tokens["queries"], tokens["documents"], batch.get("teacher_scores")
    queries, documents, teacher = ranking_texts(batch)
    return tokenizer.encode_queries(queries), tokenizer.encode_documents(documents), teacher


def logs_this_step(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes this step's metrics to the loggers (every ``log_every_n_steps`` steps, and the step
    training stops at): the steps at which the training loop reads values back from the device. The property
    Lightning's own ``LearningRateMonitor`` reads."""
    return bool(trainer._logger_connector.should_update_logs)


def clip_unscaled_gradients(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, clip_val: float,
                            algorithm: str = "norm") -> None:
    """Clip the gradients of ``optimizer``'s parameters to norm (or, ``algorithm="value"``, to value) ``clip_val``,
    unscaled first by ``scaler`` under fp16 loss scaling -- as ColBERT v1 does (colbertv1 branch,
    colbert/utils/amp.py: ``scaler.unscale_(optimizer)``, then ``clip_grad_norm_(..., 2.0)``).

    Why here: Lightning clips after unscaling, but skips the unscaling for an optimizer that unscales in its own
    step (``fused: true``), and then refuses to clip at all ("does not allow for gradient clipping"), under
    ``bf16-mixed`` too. Unscaled here, the GradScaler records it (on the device, no host sync), so its step neither
    unscales again nor reads anything back, and still skips a step whose gradients are not finite."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    parameters = [param for group in optimizer.param_groups for param in group["params"] if param.grad is not None]
    if algorithm == "value":
        torch.nn.utils.clip_grad_value_(parameters, clip_val)
    elif algorithm == "norm":
        torch.nn.utils.clip_grad_norm_(parameters, clip_val)
    else:
        raise ValueError(f"gradient_clip_algorithm must be 'norm' or 'value' (got {str(algorithm)!r})")


class RetrieverModule(pl.LightningModule):
    """Composes an encoder and the weighted terms of its objective; logs the loss and every term's parts.

    Args:
        encoder: the model trained and exported (``ColBERTEncoder``, ``HILEncoder``).
        loss: the main term (default ``PairwiseCE``, ColBERT v1's): a ranking or distillation loss of
            ``hil.modeling.losses``; its weight is its ``weight`` (1).
        regularizer: an isotropy term (``InterIsoRegularizer``, ``CosRegRegularizer``, ``IStarRegularizer``,
            ``ConditionalIsotropyRegularizer``) added with its lambda as weight; needs a one-head encoder. None: no
            term.
        optimizer: builds the optimizer from parameter groups (biases and LayerNorm weights get no weight decay).
            The configs use ``torch.optim.AdamW`` with ColBERT v1's lr 3e-6, eps 1e-8 and no weight decay; a bare
            default is torch's AdamW with its own defaults.
        lr_scheduler: stepped every optimizer step (the configs: ``LinearWarmup``); None keeps lr constant.
        init_from: start from a Lightning ``.ckpt`` or an exported model directory (fine-tuning).
        terms: further terms, each a loss (``hil.modeling.losses``, ``hil.modeling.terms``) or an isotropy
            regularizer, each with its own weight; summed after ``loss`` and ``regularizer``.
        gradcache_chunk_size: encode the batch in chunks of this many texts and assemble the whole batch's gradient
            with GradCache (``hil.modeling.gradcache``; one process only). None: the whole batch at once.

    Logged (``train/<name>``): ``loss``, every part the loss and the regularizer report (``loss_late``,
    ``pair_accuracy``, ``score_margin``, ``reg``...), ``loss_reg`` (the weighted regularizer term), for each
    further term ``loss_<term>`` (weighted) and ``<term>_<part>``, and InterIso of each head (``inter_iso``, or
    ``inter_iso_<head>`` with several heads): every step, as device tensors, which Lightning reads back at logging
    steps. The progress bar shows ``loss``, the last logging step's.
    """

    def __init__(self, encoder: MultiVectorEncoder, loss: Term | None = None,
                 regularizer: Regularizer | None = None, optimizer: OptimizerCallable = torch.optim.AdamW,
                 lr_scheduler: LRSchedulerCallable | None = None, init_from: str | None = None,
                 terms: list[Term | Regularizer] | None = None, gradcache_chunk_size: int | None = None):
        super().__init__()
        # The modules are recorded through their settings (``on_save_checkpoint``), not as hyperparameters.
        self.save_hyperparameters(ignore=["encoder", "loss", "regularizer", "terms"])
        self.encoder = encoder
        self.loss = loss if loss is not None else PairwiseCE()
        self.regularizer = regularizer
        self.terms = torch.nn.ModuleList(terms or [])
        if gradcache_chunk_size is not None and gradcache_chunk_size < 1:
            raise ValueError(f"model.gradcache_chunk_size must be >= 1 or null (got {gradcache_chunk_size})")
        self.gradcache_chunk_size = gradcache_chunk_size
        keys = ["model.loss", *(["model.regularizer"] if regularizer is not None else []),
                *(f"model.terms[{i}]" for i in range(len(self.terms)))]
        for key, named in zip(keys, self.objective()):
            try:
                named.term.check(encoder)
            except (TypeError, ValueError) as error:
                raise type(error)(f"{key}: {error}") from None
        check_optimizer(optimizer)
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.loss_parts: dict[str, Tensor] = {}  # the last step's parts (the non-finite guard reports them)
        self.load_initial_weights(init_from)

    def objective(self) -> list[NamedTerm]:
        """The terms summed into the loss, in order: ``loss``, ``regularizer``, ``terms``."""
        return name_terms(self.loss, self.regularizer, list(self.terms))

    @property
    def needs_teacher_scores(self) -> bool:
        return any(named.term.needs_teacher_scores for named in self.objective())

    # -- training ---------------------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if stage == "fit" and isinstance(datamodule, TrainingDataModule):
            datamodule.tokenize_with(self.encoder.tokenizer)  # batches arrive tokenized, by the loader's workers
            if self.needs_teacher_scores and not datamodule.has_teacher_scores():
                wanting = [type(named.term).__name__ for named in self.objective() if named.term.needs_teacher_scores]
                raise UserError(f"{', '.join(wanting)} needs teacher scores, but the training data "
                                f"({datamodule.describe_source()}) has none: give a data.source with scores "
                                f"(NWayExamples, TrecRun, PyLateExamples or TeacherOutput)")
            if self.encoder.needs_idf:
                found = datamodule.idf_documents()
                if found is not None:  # None: uniform weights (data.idf_source: none)
                    texts, source = found
                    self.encoder.set_idf_from_texts(texts, source=source)

    def on_fit_start(self) -> None:
        # transformers' from_pretrained leaves the backbone in eval mode (dropout off); ColBERT trains with dropout.
        self.train()

    def objective_value(self, batch: RankingBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """The weighted sum of the terms over one encoded batch, and the detached parts to log."""
        loss, parts = weighted_objective(self.objective(), self.encoder, batch)
        for head in self.encoder.head_names:  # InterIso of each head, shared with whatever computed it already
            name = "inter_iso" if len(self.encoder.head_names) == 1 else f"inter_iso_{head}"
            if name not in parts:
                parts[name] = batch.inter_iso(head).detach().mean()
        return loss, parts

    def compute_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one batch (tokenized, or strings: :func:`ranking_inputs`) and its detached parts (what
        ``training_step`` logs)."""
        queries, documents, teacher = ranking_inputs(batch, self.encoder.tokenizer)
        if teacher is not None:
            teacher = torch.as_tensor(teacher, dtype=torch.float32, device=self.encoder.device)
        if self.gradcache_chunk_size is not None and torch.is_grad_enabled():
            return cached_objective(self.encoder, queries, documents, self.gradcache_chunk_size,
                                    lambda q, d: self.objective_value(RankingBatch(q, d, teacher)))
        encoded_queries = self.encoder.encode(queries, is_query=True)    # (B, Lq)
        encoded_docs = self.encoder.encode(documents, is_query=False)    # (N B, Ld)
        return self.objective_value(RankingBatch(encoded_queries, encoded_docs, teacher))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss, parts = self.compute_loss(batch)
        self.loss_parts = parts  # what the non-finite guard records (the module itself never syncs on the loss)
        batch_size = len(batch["queries"])
        # Device tensors: Lightning reads them back only when it writes to the loggers (no prog_bar here: the bar's
        # values are read back after every batch, see on_train_batch_end).
        self.log("train/loss", loss, on_step=True, batch_size=batch_size)
        for name, value in parts.items():
            self.log(f"train/{name}", value, on_step=True, batch_size=batch_size)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # The progress bar shows the loss of the last logging step: a host copy, made where the loop reads back.
        if self.trainer.progress_bar_callback is not None and logs_this_step(self.trainer) and \
                isinstance(outputs, dict) and isinstance(outputs.get("loss"), Tensor):
            self.log("loss", outputs["loss"].detach().float().cpu(), on_step=True, prog_bar=True, logger=False,
                     batch_size=len(batch["queries"]))

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

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Lightning's clipping, and the same for an optimizer that unscales fp16 gradients itself (``fused: true``,
        ``presets/gpu.yaml``), which Lightning's mixed precision refuses to clip: :func:`clip_unscaled_gradients`."""
        if gradient_clip_val and getattr(optimizer, "_step_supports_amp_scaling", False):
            clip_unscaled_gradients(optimizer, getattr(self.trainer.precision_plugin, "scaler", None),
                                    float(gradient_clip_val), gradient_clip_algorithm or "norm")
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

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
        """How this model is trained: loss, regularizer, further terms, optimizer and schedule settings."""
        return {"loss": self.loss.settings(),
                "regularizer": None if self.regularizer is None else self.regularizer.settings(),
                "terms": [named.term.settings() for named in self.objective()[1 + (self.regularizer is not None):]],
                **{k: v for k, v in self.hparams.items() if not k.startswith("_")}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["hil"] = provenance(self.encoder.settings(), training=self.training_record(),
                                       module_class=f"{type(self).__module__}.{type(self).__qualname__}")

    def export(self, directory: str | Path, data: dict[str, Any] | None = None, *, overwrite: bool = False) -> Path:
        """An export folder (``hil.modeling.export``): our layout, and the Stanford ColBERT layout for a ColBERT.
        ``data``: the training data settings, recorded for the model card.

        ``directory`` is replaced only when it is absent, empty or an earlier export (``overwrite``: a folder of
        other files too), and never when it is (or holds) the folder of the trainer this module is attached to.
        A refused export is still written, beside it (``<name>.new``, named in the ``ExportRefused``): the weights
        are what training made."""
        trainer = self._trainer  # None outside a Trainer (self.trainer raises then)
        # Each logger's own folder, not ``trainer.log_dir``: that one is broadcast from rank 0, a collective that
        # hangs (or, on gloo, fails) when only rank 0 exports after a DDP fit.
        logs = [] if trainer is None else [("log folder", getattr(logger, "log_dir", None))
                                           for logger in trainer.loggers]
        run = [] if trainer is None else [
            (what, str(folder)) for what, folder in (
                ("trainer.default_root_dir", trainer.default_root_dir), *logs,
                ("checkpoint folder", getattr(trainer.checkpoint_callback, "dirpath", None))) if folder]
        return export_model(self.encoder, directory, extra={
            "training": self.training_record(), "global_step": int(self.global_step),
            "module_class": f"{type(self).__module__}.{type(self).__qualname__}",
            **({"data": data} if data is not None else {})}, overwrite=overwrite, run=run, keep_refused=True)
