"""Experiments that compose the package end to end (``hil paper``)."""
