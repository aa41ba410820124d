"""The compatibility shims are all listed (hil.compat.SHIMS), each still where the list says, and none outlives the
release that removes it: when ``hil.__version__`` reaches a shim's ``removed_in``, this fails until the shim and
its row are deleted."""

from __future__ import annotations

from pathlib import Path

import pytest

import hil
from hil.compat import SHIMS

REPO = Path(__file__).resolve().parents[1]


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3])


@pytest.mark.parametrize("shim", SHIMS, ids=lambda s: f"{s.module}:{s.old}")
def test_each_listed_shim_is_where_the_list_says(shim):
    assert shim.old in (REPO / shim.module).read_text(encoding="utf-8"), (
        f"{shim.old!r} is no longer in {shim.module}: remove its row from hil/compat.py")


@pytest.mark.parametrize("shim", [s for s in SHIMS if s.removed_in], ids=lambda s: f"{s.module}:{s.old}")
def test_no_shim_outlives_the_release_that_removes_it(shim):
    assert version(hil.__version__) < version(shim.removed_in), (
        f"{shim.old} ({shim.module}) goes in {shim.removed_in}: delete it (use {shim.new}) and its row")


def test_the_deprecated_spellings_say_so_when_used():
    """Two of the listed spellings, used: each warns and names its replacement."""
    from hil.evaluation.evaluate import EvaluationSettings

    with pytest.warns(DeprecationWarning, match="deprecated"):
        EvaluationSettings(backend="ivfflat", backend_params={"nlist": 4, "nprobe": 2}, index_root="x")
    from hil.retrieval.builder import backend_from

    with pytest.warns(DeprecationWarning, match="deprecated"):
        backend_from(faiss_kind="flat")


def test_the_data_module_old_name_still_imports_with_a_warning():
    """``TriplesDataModule`` (the name before the data module served n-way examples, runs and teacher outputs) is
    the same class, and says that its name is deprecated; an unknown name is still an AttributeError."""
    import hil.data.datamodule as datamodule

    with pytest.warns(DeprecationWarning, match="TriplesDataModule is deprecated: use TrainingDataModule"):
        from hil.data.datamodule import TriplesDataModule
    assert TriplesDataModule is datamodule.TrainingDataModule
    with pytest.raises(AttributeError, match="NoSuchDataModule"):
        datamodule.NoSuchDataModule  # noqa: B018


def test_the_moved_modules_still_import_with_a_warning():
    """hil.data.errors, hil.console and hil.cli's names of before 0.2 (one module then) still work, and say where
    they went."""
    import importlib
    import sys

    import hil.cli
    from hil.cli.train import train_main
    from hil.errors import UserError

    for name in ("hil.data.errors", "hil.console"):
        sys.modules.pop(name, None)
        with pytest.warns(DeprecationWarning, match="moved to"):
            module = importlib.import_module(name)
        assert getattr(module, "UserError", None) is UserError or getattr(module, "main", None) is not None
    with pytest.warns(DeprecationWarning, match="hil.cli.train_main moved to hil.cli.train"):
        assert hil.cli.train_main is train_main
    with pytest.raises(AttributeError):
        hil.cli.no_such_name

