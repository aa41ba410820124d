#!/usr/bin/env python
"""Train a retriever from a YAML config:  python train.py fit --config configs/colbert.yaml"""

import sys

from hil.cli.train import train_main

if __name__ == "__main__":
    sys.exit(train_main())  # as the hil-train console script runs it: None (status 0) after a successful run
