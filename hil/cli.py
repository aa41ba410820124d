"""Command-line entry points: ``train.py`` (LightningCLI) and ``evaluate.py``.

Errors a user can fix from the config -- a bad or unknown option, a model or data path that is not there, a
tokenizer without the marker tokens, a malformed data file, a value our own validation refuses, a non-finite loss --
are printed as one line, ``error: <what and where>``, with exit status 2 (1 for a non-finite loss), instead of a
usage screen or a traceback. Anything else (a bug) keeps its traceback; ``HIL_DEBUG=1`` keeps them all.
"""

from __future__ import annotations

import os
import sys

# Thread settings must be fixed before torch spins up its pools.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402
from typing import NoReturn  # noqa: E402

from jsonargparse import Namespace  # noqa: E402
from lightning_fabric.utilities.exceptions import MisconfigurationException  # noqa: E402
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI  # noqa: E402

from hil.data.datamodule import TriplesDataModule  # noqa: E402
from hil.data.errors import DataFormatError  # noqa: E402
from hil.data.tokenization import MarkerTokenError  # noqa: E402
from hil.modeling.callbacks import NonFiniteGuard, NonFiniteLossError, StepReseed  # noqa: E402
from hil.modeling.module import RetrieverModule  # noqa: E402

DEBUG_ENV = "HIL_DEBUG"  # set to 1 for full tracebacks and jsonargparse's usage screens
PACKAGE_DIR = Path(__file__).resolve().parent
# Always a user-facing message, wherever raised.
USER_ERRORS = (MarkerTokenError, DataFormatError, NonFiniteLossError, MisconfigurationException)
# A user-facing message when raised by our own code (a missing path, a refused value); elsewhere possibly a bug.
OWN_ERRORS = (FileNotFoundError, NotADirectoryError, ValueError)
# Lines of jsonargparse's messages that only repeat that an argument is ``X | None``.
_UNION_NOISE = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:",
                "- Expected a <class 'NoneType'>", "Given value type:", "Given value:")


def one_line(message: str) -> str:
    """A (possibly nested, multi-line) error message on one line, without jsonargparse's Union boilerplate."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    return " ".join(line.removeprefix("- ") for line in lines if not line.startswith(_UNION_NOISE))


def _raised_in_package(error: BaseException) -> bool:
    frame = error.__traceback__
    if frame is None:
        return False
    while frame.tb_next is not None:
        frame = frame.tb_next
    return PACKAGE_DIR in Path(frame.tb_frame.f_code.co_filename).resolve().parents


def user_error(error: BaseException) -> BaseException | None:
    """The user-facing error behind ``error``, following ``__cause__``/``__context__`` (jsonargparse wraps the
    exceptions of the classes it instantiates in its own ValueError); None when it looks like a bug."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, USER_ERRORS):
            return current
        if isinstance(current, OWN_ERRORS) and _raised_in_package(current):
            return current
        current = current.__cause__ or current.__context__
    return None


class HILArgumentParser(LightningArgumentParser):
    """jsonargparse's parser, whose errors are one line (``error: ... (options: train.py fit --help)``), not the
    40-line usage screen followed by the message."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if os.environ.get(DEBUG_ENV) or not self.exit_on_error:
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"error: {one_line(message)} (options: {prog} --help)\n")
        self.exit(2)


class HILCLI(LightningCLI):
    """LightningCLI over ``RetrieverModule`` and ``TriplesDataModule``, with every run's callbacks as settings:
    ``step_reseed`` (per-batch reseeding for exact resume) and ``nonfinite_guard`` (``policy: raise | skip``)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--export_dir", type=str, default=None,
                            help="after fit, export the model here (from_pretrained-loadable)")
        parser.add_lightning_class_args(StepReseed, "step_reseed")
        parser.add_lightning_class_args(NonFiniteGuard, "nonfinite_guard")

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
    """``python train.py fit --config configs/colbert.yaml [--config configs/variants/<variant>.yaml]``.

    A user-facing error (see the module docstring) exits with ``error: <message>`` on stderr.
    """
    try:
        # The optimizer and schedule are the model's (``model.optimizer``, ``model.lr_scheduler``): no top-level ones.
        return HILCLI(RetrieverModule, TriplesDataModule, args=args, auto_configure_optimizers=False,
                      parser_class=HILArgumentParser, save_config_kwargs={"overwrite": True})
    except Exception as error:
        shown = None if os.environ.get(DEBUG_ENV) else user_error(error)
        if shown is None:
            raise
        print(f"error: {one_line(str(shown))}", file=sys.stderr)
        raise SystemExit(1 if isinstance(shown, NonFiniteLossError) else 2) from None


def evaluate_main(args: list[str] | None = None) -> int:
    from hil.evaluation.cli import main

    return main(sys.argv[1:] if args is None else args)
