"""``python -m hil``: the ``hil`` command (:mod:`hil.cli.main`)."""

import sys

from hil.cli.main import main

sys.argv[0] = "hil"  # what usage lines and errors call the command (not "__main__.py")
sys.exit(main())
