"""Moved to :mod:`hil.cli.main` (every command line in :mod:`hil.cli`); this name stays until 0.3.0
(``hil.compat``), so that a ``hil`` script installed by an earlier release keeps working."""

import warnings

from hil.cli.main import main  # noqa: F401

warnings.warn("hil.console moved to hil.cli.main", DeprecationWarning, stacklevel=2)
