"""Every command line of the package, on one option system (:mod:`hil.cli.parsers`: jsonargparse).

- :mod:`hil.cli.main`: the ``hil`` command (also ``python -m hil``): ``fit``/``validate``/``test``/``predict``
  (:mod:`hil.cli.train`, the LightningCLI of ``train.py`` / ``hil-train``), ``evaluate``/``index``/``search``
  (an :class:`~hil.evaluation.experiment.Experiment` from YAML), and the tools ``beir``, ``paper``, ``teacher``,
  ``engines``, ``analyze``, ``share`` (one module each here: its parser and what it prints; the work is done by the
  layers below);
- :mod:`hil.cli.evaluate_script`: ``evaluate.py`` / ``hil-evaluate``, one model on one dataset.

Importing this package imports nothing else: ``hil --help`` and each subcommand's ``--help`` load only what that
command needs. ``from hil.cli import train_main`` (before 0.2 this package was one module) still works until 0.3.0
(``hil.compat``).
"""

from typing import Any

MOVED = {"train_main": "hil.cli.train", "run_train": "hil.cli.train", "HILCLI": "hil.cli.train",
         "check_checkpoint": "hil.cli.train", "evaluate_main": "hil.cli.evaluate_script"}


def __getattr__(name: str) -> Any:
    """The names ``hil.cli`` had as one module (``MOVED``), from the module that holds each now."""
    if name not in MOVED:
        raise AttributeError(f"module 'hil.cli' has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn(f"hil.cli.{name} moved to {MOVED[name]}", DeprecationWarning, stacklevel=2)
    module = importlib.import_module(MOVED[name])
    return getattr(module, "main" if name == "evaluate_main" else name)
