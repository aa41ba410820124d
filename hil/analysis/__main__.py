"""``python -m hil.analysis --model M --dataset scifact --output DIR``: see :mod:`hil.analysis.cli`."""

import sys

from hil.analysis.cli import main

sys.exit(main())
