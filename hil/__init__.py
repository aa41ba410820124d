"""hil: isotropy-regularized late-interaction retrievers (ColBERT, ColBERT-HIL)."""

__version__ = "0.1.0"
