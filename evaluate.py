#!/usr/bin/env python
"""Evaluate a retriever on a BEIR dataset:  python evaluate.py --model PATH --dataset scifact"""

import sys

from hil.cli.evaluate_script import main as evaluate_main

if __name__ == "__main__":
    sys.exit(evaluate_main())
