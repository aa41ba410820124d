"""Command-line entry points: ``train.py`` (LightningCLI) and ``evaluate.py``."""

from __future__ import annotations

import os
import sys

# Thread settings must be fixed before torch spins up its pools.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from jsonargparse import Namespace  # noqa: E402
from pytorch_lightning.cli import LightningCLI  # noqa: E402

from hil.data.datamodule import TriplesDataModule  # noqa: E402
from hil.modeling.module import RetrieverModule  # noqa: E402


class HILCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("--export_dir", type=str, default=None,
                            help="after fit, export the model here (from_pretrained-loadable)")

    def before_instantiate_classes(self) -> None:
        # Unless the config names its own loggers, log to TensorBoard and CSV under default_root_dir.
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        trainer = config["trainer"]
        if trainer.get("logger") in (None, True):
            root = trainer.get("default_root_dir") or "."
            trainer["logger"] = [
                Namespace(class_path="pytorch_lightning.loggers.TensorBoardLogger",
                          init_args=Namespace(save_dir=root, name="tb")),
                Namespace(class_path="pytorch_lightning.loggers.CSVLogger",
                          init_args=Namespace(save_dir=root, name="csv"))]

    def after_fit(self) -> None:
        export_dir = self.config.get(self.subcommand, {}).get("export_dir")
        if export_dir and self.trainer.is_global_zero:
            self.model.export(export_dir)
            print(f"exported model to {export_dir}")


def train_main(args: list[str] | None = None) -> HILCLI:
    """``python train.py fit --config configs/colbert.yaml``; any model class deriving RetrieverModule."""
    return HILCLI(RetrieverModule, TriplesDataModule, subclass_mode_model=True, args=args,
                  save_config_kwargs={"overwrite": True})


def evaluate_main(args: list[str] | None = None) -> int:
    from hil.evaluation.cli import main

    return main(sys.argv[1:] if args is None else args)
