"""``python -m hil``: the ``hil`` command (:mod:`hil.console`)."""

import sys

from hil.console import main

sys.exit(main())
