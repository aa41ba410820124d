"""Experiments that compose the package end to end (``python -m hil.experiments.paper``)."""
