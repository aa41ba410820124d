"""Callbacks used from the YAML configs."""

from __future__ import annotations

from pathlib import Path

import pytorch_lightning as pl


class ExportOnTrainEnd(pl.Callback):
    """After ``fit``, write a ``from_pretrained``-loadable export of the model (rank 0 only).

    Args:
        dirpath: where to write; default ``<trainer.log_dir>/export``.
    """

    def __init__(self, dirpath: str | None = None):
        self.dirpath = dirpath

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        target = Path(self.dirpath) if self.dirpath else Path(trainer.log_dir or trainer.default_root_dir) / "export"
        pl_module.export(target)
        print(f"exported model to {target}")
