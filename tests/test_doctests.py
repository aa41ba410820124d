"""The examples in the docstrings are run: the score and loss functions (worked by hand, PyLate's habit) and the
table formatting. A changed formula fails its example here as well as its test against a slow loop."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ("hil.modeling.scoring", "hil.modeling.loss_functions", "hil.evaluation.tables")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
