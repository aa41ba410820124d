"""``hil fit`` / ``train.py`` / ``hil-train``: the LightningCLI of training.

Errors a user can fix from the config -- a bad or unknown option, a model or data path that is not there, a
tokenizer without the marker tokens, a malformed data file, a ``--ckpt_path`` that is not a training checkpoint, a
value our own validation refuses (``hil.errors.UserError``), a non-finite loss -- are printed as one line,
``error: <what and where>``, with exit status 2 (1 for a non-finite loss), instead of a usage screen or a traceback.
Anything else (a bug) keeps its traceback; ``HIL_DEBUG=1`` keeps them all.

Ctrl-C stops training after the running step with ``last.ckpt`` written there, prints the exact command that
resumes (the same arguments and ``--ckpt_path <that last.ckpt>``) and exits with status 130. The same command run
again without ``--ckpt_path`` does not silently start over: it stops in one line naming the checkpoint, unless
``--resume auto`` (resume it) or ``--resume never`` (a new run beside it) says what to do
(:mod:`hil.cli.train_runs`).
"""

from __future__ import annotations

import os
import sys

# Thread settings must be fixed before torch spins up its pools.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _say_loading() -> None:
    """One line on a terminal before the imports below and the options' parser take their 5-15 s: ``hil fit
    --help`` and every training command were otherwise silent that long."""
    try:
        if sys.stderr.isatty():
            sys.stderr.write("loading the training command (torch, Lightning) ...\n")
            sys.stderr.flush()
    except (AttributeError, ValueError, OSError):  # no stderr, or a closed one
        pass


_say_loading()

import json  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import warnings  # noqa: E402
import zipfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Literal, NoReturn  # noqa: E402

import torch  # noqa: E402
from jsonargparse import Namespace  # noqa: E402
from lightning_fabric.utilities.exceptions import MisconfigurationException  # noqa: E402
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI  # noqa: E402

from hil.cli.parsers import OneLineErrors  # noqa: E402
from hil.cli.train_runs import (  # noqa: E402
    RESUME_HELP,
    ResumeChoice,
    check_accelerator,
    check_checkpoint_fits,
    clear_interrupt,
    record_interrupt,
    resume_command,
    resume_decision,
)
from hil.data.datamodule import TrainingDataModule  # noqa: E402
from hil.data.old_source_keys import add_old_keys, respell_old_keys  # noqa: E402
from hil.data.tokenization import MarkerTokenError  # noqa: E402
from hil.errors import DEBUG_ENV, MissingInputError, UserError, check_output_path, one_line  # noqa: E402
from hil.errors import user_error as _user_error  # noqa: E402
from hil.modeling.callbacks import NonFiniteGuard, NonFiniteLossError, ProgressLines, StepReseed  # noqa: E402
from hil.modeling.export import ExportRefused, export_refusal, run_folders  # noqa: E402
from hil.modeling.interrupts import StopAtStepEnd, last_checkpoint  # noqa: E402
from hil.modeling.module import RetrieverModule  # noqa: E402

__all__ = ["DEBUG_ENV", "HILCLI", "TrainingParser", "check_checkpoint", "one_line", "run_train", "train_main",
           "user_error"]

# Always a user-facing message, wherever raised (besides UserError and its subclasses).
USER_ERRORS = (MarkerTokenError, NonFiniteLossError, MisconfigurationException)
# torch.set_float32_matmul_precision's values (``float32_matmul_precision`` in train.py's config).
MatmulPrecision = Literal["highest", "high", "medium"]
# ``ckpt_path`` values Lightning resolves itself instead of reading a file.
LIGHTNING_CHECKPOINT_NAMES = ("last", "best", "hpc", "registry")
# What every checkpoint ``Trainer.fit`` writes holds; a bare state dict or an export lacks them.
LIGHTNING_CHECKPOINT_KEYS = ("state_dict", "pytorch-lightning_version")


def user_error(error: BaseException) -> BaseException | None:
    """The user-facing error behind ``error`` (:func:`hil.errors.user_error`, with the training errors that
    are always the user's), or None when it looks like a bug."""
    return _user_error(error, also=USER_ERRORS)


def check_checkpoint(path: str | os.PathLike | None, option: str = "--ckpt_path") -> None:
    """Refuse, naming ``option`` and the path, a checkpoint to resume from that is not there, is a folder, or is
    not a Lightning training checkpoint (Lightning itself fails deep inside with ``IndexError`` or ``KeyError``).

    Lightning's own names (``last``, ``best``, ...) and remote URLs are left to Lightning. Only the checkpoint's
    pickled structure is read (tensors stay memory-mapped on disk).
    """
    if path is None or str(path).split(":")[0] in LIGHTNING_CHECKPOINT_NAMES or "://" in str(path):
        return
    where = f"{option} {path}"
    file = Path(path).expanduser()
    if not file.exists():
        raise MissingInputError(f"{where}: no such file")
    if file.is_dir():
        raise UserError(f"{where}: a folder, not a checkpoint file (give a .ckpt, e.g. "
                        f"{file / 'checkpoints' / 'last.ckpt'})")
    if not zipfile.is_zipfile(file):
        raise UserError(f"{where}: not a PyTorch checkpoint (not a torch.save archive)")
    try:
        checkpoint = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # whatever torch's unpickler says of a damaged or foreign file
        raise UserError(f"{where}: not a readable PyTorch checkpoint ({type(error).__name__}: "
                        f"{one_line(error)})") from None
    missing = [key for key in LIGHTNING_CHECKPOINT_KEYS if not isinstance(checkpoint, dict) or key not in checkpoint]
    if missing:
        raise UserError(f"{where}: not a Lightning training checkpoint (no {', '.join(missing)}); to start from "
                        f"a model's weights instead, use model.init_from")


class TrainingParser(OneLineErrors, LightningArgumentParser):
    """LightningCLI's parser with the package's one-line errors and recipes by name (:mod:`hil.cli.parsers`); the
    data keys of before 0.3 are read as ``data.source`` before the config is checked or printed
    (:mod:`hil.data.old_source_keys`)."""

    def _parse_common(self, cfg: Namespace, *args: Any, **kwargs: Any) -> Namespace:
        respell_old_keys(cfg)
        return super()._parse_common(cfg, *args, **kwargs)


class HILCLI(LightningCLI):
    """LightningCLI over ``RetrieverModule`` and ``TrainingDataModule``, with every run's callbacks as settings:
    ``step_reseed`` (per-batch reseeding for exact resume), ``nonfinite_guard`` (``policy: raise | skip``) and
    ``progress_lines`` (``every_n_seconds``, ``when: auto | always | never``: a progress line every 30 s when stdout
    is not a terminal, in place of the progress bar, which a file cannot show); and ``float32_matmul_precision``
    (``highest | high | medium``, torch's setting of that name, applied before anything is built; null leaves
    torch's default, ``highest``: fp32 matrix products in full fp32. ``high`` lets a GPU use TF32 for them); and
    ``resume`` (``auto | never``, unset by default: what ``fit`` does when ``trainer.default_root_dir`` holds an
    interrupted run and no ``--ckpt_path`` is given -- resume it, start a new run beside it, or stop and say so)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--export_dir", type=str, default=None,
                            help="after fit, export the model here (from_pretrained-loadable): a folder of its own, "
                                 "absent, empty or an earlier export (other files, or the run's own folder, are "
                                 "refused before training)")
        parser.add_lightning_class_args(StepReseed, "step_reseed")
        parser.add_lightning_class_args(NonFiniteGuard, "nonfinite_guard")
        parser.add_lightning_class_args(ProgressLines, "progress_lines")
        parser.add_argument("--float32_matmul_precision", type=MatmulPrecision | None, default=None,
                            help="torch.set_float32_matmul_precision before training (null: torch's default)")
        parser.add_argument("--resume", type=ResumeChoice | None, default=None, help=RESUME_HELP)
        add_old_keys(parser)  # data.triples, ...: read as data.source until 0.4.0

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        super().parse_arguments(parser, args)
        # Checked here because LightningCLI reads the checkpoint's hyperparameters next, before any other hook.
        subcommand = self.config.get("subcommand")
        self.argv = list(args) if isinstance(args, (list, tuple)) else sys.argv[1:]  # the resume command's
        if subcommand:
            config = self.config[subcommand]
            check_accelerator(config["trainer"].get("accelerator"), getattr(parser, "argv", self.argv))
            if subcommand == "fit":  # an interrupted run of this root: resumed, left, or the command stops
                root = config["trainer"].get("default_root_dir") or "."
                config["ckpt_path"] = resume_decision(root, config.get("ckpt_path"), config.get("resume"))
            check_checkpoint(config.get("ckpt_path"))

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        if config.get("export_dir"):  # before training: the export is written only after it
            check_output_path(config["export_dir"], "--export_dir", folder=True)
            refusal = export_refusal(config["export_dir"], "--export_dir", run=run_folders(config["trainer"]))
            if refusal:
                raise ExportRefused(refusal)
        if config.get("float32_matmul_precision"):
            torch.set_float32_matmul_precision(config["float32_matmul_precision"])
        # Off a terminal the progress lines replace the bar (whose redraws a file keeps as one endless line), unless
        # the config asks for the bar itself.
        lines = config.get("progress_lines")
        if config["trainer"].get("enable_progress_bar") is None and lines is not None and \
                ProgressLines(lines.every_n_seconds, lines.when).prints_to(sys.stdout):
            config["trainer"]["enable_progress_bar"] = False
        # Unless the config names its own loggers, log to TensorBoard and CSV under default_root_dir.
        trainer = config["trainer"]
        if trainer.get("logger") in (None, True):
            root = trainer.get("default_root_dir") or "."
            trainer["logger"] = [
                Namespace(class_path="pytorch_lightning.loggers.TensorBoardLogger",
                          init_args=Namespace(save_dir=root, name="tb")),
                Namespace(class_path="pytorch_lightning.loggers.CSVLogger",
                          init_args=Namespace(save_dir=root, name="csv"))]

    def fit(self, model: RetrieverModule, **kwargs: Any) -> None:
        """``Trainer.fit``, after refusing in one line a ``--ckpt_path`` whose weights do not fit the model; Ctrl-C
        ends it with the command that resumes and status 130 (the module docstring), and a run that completes
        forgets the interrupted one of its root."""
        if kwargs.get("ckpt_path") and Path(str(kwargs["ckpt_path"])).is_file():
            check_checkpoint_fits(kwargs["ckpt_path"], model)
        handler = signal.getsignal(signal.SIGINT)
        try:
            self.trainer.fit(model, **kwargs)
        except SystemExit:  # Lightning's answer to KeyboardInterrupt: sys.exit(1), the trainer marked interrupted
            if not self.trainer.interrupted:
                raise
            self.interrupted()
        finally:  # Lightning leaves Ctrl-C ignored after an interrupt
            if handler is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, handler)
        if self.trainer.is_global_zero:
            clear_interrupt(self.trainer.default_root_dir)

    def interrupted(self) -> NoReturn:
        """Print how to resume (and record it in the root's ``interrupted.json``); exit with status 130."""
        trainer = self.trainer
        stop = next((c for c in trainer.callbacks if isinstance(c, StopAtStepEnd)), None)
        checkpoint = stop.saved if stop is not None and stop.saved is not None else last_checkpoint(trainer)
        if trainer.is_global_zero:
            if checkpoint is None:
                print(f"interrupted at step {trainer.global_step}, before any checkpoint was written: nothing to "
                      f"resume from (the same command starts over)", file=sys.stderr)
            else:
                step = stop.step if stop is not None and checkpoint == stop.saved else \
                    torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True).get("global_step")
                command = resume_command(self.argv, checkpoint)
                record_interrupt(trainer.default_root_dir, checkpoint, step, command)
                at = "" if step == trainer.global_step else f" (the last checkpoint is of step {step})"
                print(f"interrupted at step {trainer.global_step}{at}; resume with: {command}", file=sys.stderr)
        raise SystemExit(130)

    def after_fit(self) -> None:
        config = self.config.get(self.subcommand, {})
        export_dir = config.get("export_dir")
        if export_dir and self.trainer.is_global_zero:
            if self.trainer.global_step == 0:  # nothing was learned: the export would pass for a trained model
                why = ("trainer.max_steps 0" if self.trainer.max_steps == 0 else "trainer.max_epochs 0"
                       if self.trainer.max_epochs == 0 else "no batch reached the optimizer")
                print(f"warning: no training step ran ({why}); the export holds the weights training started from",
                      file=sys.stderr)
            data = config.get("data")
            data = data.as_dict() if isinstance(data, Namespace) else data
            # JSON-safe (paths and classes as text): the model card reads what the model was trained on.
            self.model.export(export_dir, data=json.loads(json.dumps(data, default=str)) if data else None)
            print(f"exported model to {export_dir}")


# Lightning's lines that tell a user of this package nothing: an advertisement, "no GPU / no TPU" on a machine without
# them (the line that says a GPU is used stays), its "attempting graceful shutdown" after Ctrl-C (train.py's own
# lines say what happens and how to resume), the warning about ``args`` (ours are the command line itself) and a
# torch deprecation inside Lightning.
QUIET_LIGHTNING_LINES = ("💡 Tip:", "GPU available: False", "TPU available: False", "\nDetected KeyboardInterrupt")
QUIET_LIGHTNING_WARNINGS = (r"LightningCLI's args parameter is intended", r".*isinstance\(treespec, LeafSpec\)")
LIGHTNING_INFO_LOGGERS = ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero",
                          "lightning_fabric.utilities.rank_zero")


class _QuietLightning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(QUIET_LIGHTNING_LINES)


def quiet_lightning() -> None:
    """Leave out :data:`QUIET_LIGHTNING_LINES` and :data:`QUIET_LIGHTNING_WARNINGS` (once per process)."""
    for name in LIGHTNING_INFO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietLightning) for f in logger.filters):
            logger.addFilter(_QuietLightning())
    for message in QUIET_LIGHTNING_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def run_train(args: list[str] | None = None) -> HILCLI:
    """``train.py``'s command line (``fit --config configs/colbert.yaml [--config <variant>.yaml] ...``) run in this
    process; -> the CLI (its ``trainer``, ``model``, ``datamodule``).

    A user-facing error (see the module docstring) prints ``error: <message>`` on stderr and raises ``SystemExit``
    with status 2 (1 for a non-finite loss).
    """
    try:
        # The optimizer and schedule are the model's (``model.optimizer``, ``model.lr_scheduler``): no top-level ones.
        args = sys.argv[1:] if args is None else list(args)  # --config recipes: TrainingParser.parse_args
        quiet_lightning()
        return HILCLI(RetrieverModule, TrainingDataModule, args=args, auto_configure_optimizers=False,
                      parser_class=TrainingParser, save_config_kwargs={"overwrite": True},
                      trainer_defaults={"callbacks": [StopAtStepEnd()]})
    except KeyboardInterrupt:  # before training started (loading, setup): nothing of the run to resume
        if os.environ.get(DEBUG_ENV):
            raise
        print("interrupted before the first training step: nothing to resume (the same command starts over)",
              file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as error:
        shown = None if os.environ.get(DEBUG_ENV) else user_error(error)
        if shown is None:
            raise
        print(f"error: {one_line(shown)}", file=sys.stderr)
        raise SystemExit(1 if isinstance(shown, NonFiniteLossError) else 2) from None


def train_main(args: list[str] | None = None) -> HILCLI | None:
    """The ``hil-train`` console script and ``python train.py``: :func:`run_train`.

    Without ``args`` (the process's own command line) it returns None: the console script's wrapper passes the
    return value to ``sys.exit``, which would print an object and exit with status 1 after a successful run. With
    ``args`` (in-process callers) it returns the CLI, as :func:`run_train` does.
    """
    cli = run_train(args)
    return None if args is None else cli

