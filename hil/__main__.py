"""``python -m hil``: the ``hil`` command (:mod:`hil.cli.main`)."""

import sys

from hil.cli.main import main

sys.exit(main())
