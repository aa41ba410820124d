"""Moved to :mod:`hil.errors` (the bottom layer: every layer raises these). This name stays until 0.3.0
(``hil.compat``)."""

import warnings

from hil.errors import *  # noqa: F401,F403

warnings.warn("hil.data.errors moved to hil.errors", DeprecationWarning, stacklevel=2)
