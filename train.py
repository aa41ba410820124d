#!/usr/bin/env python
"""Train a retriever from a YAML config:  python train.py fit --config configs/colbert.yaml"""

from hil.cli import train_main

if __name__ == "__main__":
    train_main()
