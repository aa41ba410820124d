"""Exports never delete what the user put in their folder (issue 40, rows 1, 4 and 13).

An export replaces its folder whole, so only a folder that is absent, empty or an earlier export (which lists the
files it wrote in ``hil_config.json``) is replaced; a folder holding other files, and the training run's own
folder, are refused -- by ``hil fit`` before training, and again at export time (the export is then left beside).
The model card ``hil share --card-only`` wrote survives a re-export; every exported file has the umask's mode; a
fit that made no optimizer step says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hil.modeling.export import ExportRefused, export_model, export_refusal, run_folders

REPO = Path(__file__).resolve().parents[1]


def listing(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes (what a refused export must leave as it was)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def fit_args(root: Path, export: Path | str, *extra: str) -> list[str]:
    return ["fit", "--config", "colbert", "--config", "presets/smoke", "--trainer.default_root_dir", str(root),
            "--export_dir", str(export), *extra]


def run_fit(args: list[str], capsys) -> tuple[int, list[str]]:
    """``hil fit`` (train.py's entry point) in this process: -> (exit status, stderr lines)."""
    from hil.cli.train import train_main

    try:
        train_main(args)
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err.strip().splitlines()


# -- the rule, programmatically (hil.export_model) ------------------------------------------------------------------

def test_an_export_refuses_a_folder_holding_a_users_file_and_writes_nothing(tiny_random_colbert, tmp_path):
    target = tmp_path / "X"
    target.mkdir()
    (target / "notes.txt").write_text("hi")
    with pytest.raises(ExportRefused, match=r"X: holds files an export did not write \(notes.txt\).*nothing was "
                                            r"written"):
        export_model(tiny_random_colbert, target)
    assert listing(tmp_path) == {"X/notes.txt": b"hi"} and sorted(os.listdir(tmp_path)) == ["X"]

    # Kept (a trained model is not thrown away): written beside, named in the message, the folder untouched.
    with pytest.raises(ExportRefused, match=r"nothing there was touched: the export is in .*X\.new$"):
        export_model(tiny_random_colbert, target, keep_refused=True)
    assert listing(target) == {"notes.txt": b"hi"}
    assert (tmp_path / "X.new" / "hil_config.json").is_file() and sorted(os.listdir(tmp_path)) == ["X", "X.new"]

    export_model(tiny_random_colbert, target, overwrite=True)  # asked for: replaced
    assert not (target / "notes.txt").exists() and (target / "hil_config.json").is_file()


def test_an_absent_or_empty_folder_or_an_earlier_export_is_replaced(tiny_random_colbert, tmp_path):
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "absent", tmp_path / "empty"):
        export_model(tiny_random_colbert, target)
        record = json.loads((target / "hil_config.json").read_text())
        assert sorted(record["files"]) == sorted(os.listdir(target)), "the export lists every file it wrote"
    first = listing(tmp_path / "absent")
    with torch.no_grad():
        tiny_random_colbert.linear.weight.add_(1.0)
    export_model(tiny_random_colbert, tmp_path / "absent")  # an earlier export: replaced by the new one
    assert listing(tmp_path / "absent")["hil_heads.pt"] != first["hil_heads.pt"]
    assert sorted(os.listdir(tmp_path)) == ["absent", "empty"]

    (tmp_path / "absent" / "tb").mkdir()  # a folder (and what it holds) the export did not write
    (tmp_path / "absent" / "tb" / "events").write_text("log")
    with pytest.raises(ExportRefused, match=r"\(tb/events\)"):
        export_model(tiny_random_colbert, tmp_path / "absent")
    assert (tmp_path / "absent" / "tb" / "events").read_text() == "log"


def test_an_export_that_lists_no_files_is_not_taken_for_one(tiny_random_colbert, tmp_path):
    """An export from before the list (or a folder with a hand-made hil_config.json): nothing tells its files
    from the user's, so it is refused, never emptied."""
    target = tmp_path / "old"
    export_model(tiny_random_colbert, target)
    record = json.loads((target / "hil_config.json").read_text())
    del record["files"]
    (target / "hil_config.json").write_text(json.dumps(record))
    before = listing(target)
    with pytest.raises(ExportRefused, match="does not list its files"):
        export_model(tiny_random_colbert, target)
    assert listing(target) == before


def test_a_reexport_keeps_the_model_card_hil_share_wrote(tiny_random_colbert, tmp_path, capsys):
    from hil.cli.share import main as share_main

    target = tmp_path / "export"
    export_model(tiny_random_colbert, target)
    assert share_main([str(target), "me/tiny", "--card-only"]) == 0
    card = (target / "README.md").read_text()
    assert "me/tiny" in card
    export_model(tiny_random_colbert, target)
    assert (target / "README.md").read_text() == card
    assert "README.md" not in json.loads((target / "hil_config.json").read_text())["files"]


@pytest.mark.parametrize("stanford", [True, False])  # the Stanford weights, or the backbone's save_pretrained
def test_every_exported_file_has_the_mode_of_a_plain_file(tiny_random_colbert, tmp_path, stanford):
    """safetensors writes model.safetensors through mkstemp (0600); the rest are 0666 less the umask."""
    for umask, mode in ((0o022, 0o644), (0o027, 0o640)):
        previous = os.umask(umask)
        try:
            export_model(tiny_random_colbert, tmp_path / f"export-{umask:o}", stanford=stanford)
        finally:
            os.umask(previous)
        modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / f"export-{umask:o}").iterdir()}
        assert "model.safetensors" in modes and modes == dict.fromkeys(modes, mode), modes


def test_files_that_appear_while_the_export_is_written_are_kept(tiny_random_colbert, tmp_path, monkeypatch):
    target = tmp_path / "X"
    save = type(tiny_random_colbert).save_pretrained

    def user_writes_meanwhile(self, directory, extra=None):
        target.mkdir(exist_ok=True)
        (target / "notes.txt").write_text("hi")
        return save(self, directory, extra)

    monkeypatch.setattr(type(tiny_random_colbert), "save_pretrained", user_writes_meanwhile)
    with pytest.raises(ExportRefused, match=r"\(notes.txt\).*nothing there was touched: the export is in .*X\.new$"):
        export_model(tiny_random_colbert, target)
    assert listing(target) == {"notes.txt": b"hi"} and (tmp_path / "X.new" / "hil_heads.pt").is_file()


def test_the_runs_own_folder_is_refused_but_a_folder_inside_it_is_not(tmp_path):
    root = tmp_path / "run"
    trainer = {"default_root_dir": str(root), "callbacks": [
        {"class_path": "pytorch_lightning.callbacks.ModelCheckpoint", "init_args": {"dirpath": str(tmp_path / "ck")}}]}
    run = run_folders(trainer)
    assert export_refusal(root / "export", "--export_dir", run=run) is None
    assert "is the run's own trainer.default_root_dir" in export_refusal(root, "--export_dir", run=run)
    assert "holds the run's own trainer.default_root_dir" in export_refusal(tmp_path, "--export_dir", run=run)
    assert "checkpoint folder" in export_refusal(tmp_path / "ck", "--export_dir", run=run)
    assert "is the run's own" in export_refusal(tmp_path / "run" / ".." / "run", "--export_dir", run=run)
    assert "is the run's own trainer.default_root_dir" in export_refusal(
        Path.cwd(), "--export_dir", run=run_folders({"default_root_dir": None}))  # unset: the working folder


# -- hil fit: refused before training, re-checked at export time -----------------------------------------------------

@pytest.mark.integration
def test_fit_refuses_a_folder_with_a_users_file_before_training(shared_dir, tmp_path, capsys):
    (tmp_path / "X").mkdir()
    (tmp_path / "X" / "notes.txt").write_text("hi")
    code, err = run_fit(fit_args(tmp_path / "run", tmp_path / "X"), capsys)
    assert code == 2 and len(err) == 1 and "--export_dir" in err[0] and "notes.txt" in err[0], err
    assert listing(tmp_path) == {"X/notes.txt": b"hi"} and not (tmp_path / "run").exists(), "before training"


@pytest.mark.integration
@pytest.mark.parametrize("where", ["root", "above root", "checkpoint folder"])
def test_fit_refuses_the_runs_own_folder_before_training(shared_dir, tmp_path, capsys, where):
    root = tmp_path / "run"
    extra = []
    if where == "checkpoint folder":
        extra = ["--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={tmp_path / 'ck'}"]
    export = {"root": root, "above root": tmp_path, "checkpoint folder": tmp_path / "ck"}[where]
    code, err = run_fit(fit_args(root, export, *extra), capsys)
    assert code == 2 and len(err) == 1 and "--export_dir" in err[0] and "the run's own" in err[0], err
    assert ("checkpoint folder" in err[0]) == (where == "checkpoint folder"), err
    assert not root.exists() and not (tmp_path / "ck").exists()


@pytest.mark.integration
def test_fit_refuses_a_read_only_export_folder_before_training(shared_dir, tmp_path, capsys):
    code, err = run_fit(fit_args(tmp_path / "run", "/proc/hil-no-such/export"), capsys)
    assert code == 2 and len(err) == 1 and "--export_dir" in err[0] and "not writable" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.integration
def test_fit_without_a_step_warns_that_the_export_is_untrained(shared_dir, tmp_path, capsys):
    code, err = run_fit(fit_args(tmp_path / "run", tmp_path / "export", "--trainer.max_steps", "0"), capsys)
    assert code == 0 and (tmp_path / "export" / "hil_config.json").is_file()
    warnings = [line for line in err if line.startswith("warning: no training step ran")]
    assert warnings == ["warning: no training step ran (trainer.max_steps 0); the export holds the weights "
                        "training started from"], err


@pytest.mark.integration
def test_files_that_appear_during_training_are_kept_and_the_export_left_beside(shared_dir, tmp_path, capsys,
                                                                                monkeypatch):
    from hil.modeling.module import RetrieverModule

    export = tmp_path / "export"

    def user_writes_meanwhile(self) -> None:
        export.mkdir()
        (export / "notes.txt").write_text("written during training")

    monkeypatch.setattr(RetrieverModule, "on_fit_end", user_writes_meanwhile, raising=False)
    code, err = run_fit(fit_args(tmp_path / "run", export, "--trainer.max_steps", "1"), capsys)
    assert code == 2 and "notes.txt" in err[-1] and str(tmp_path / "export.new") in err[-1], err
    assert listing(export) == {"notes.txt": b"written during training"}
    assert (tmp_path / "export.new" / "hil_config.json").is_file()


@pytest.mark.integration
def test_fit_reexports_into_an_earlier_export_keeping_its_card(shared_dir, tiny_random_colbert, tmp_path, capsys):
    from hil.cli.share import main as share_main

    export = tmp_path / "export"
    export_model(tiny_random_colbert, export)
    assert share_main([str(export), "me/tiny", "--card-only"]) == 0
    card = (export / "README.md").read_text()
    code, err = run_fit(fit_args(tmp_path / "run", export, "--trainer.max_steps", "1"), capsys)
    assert code == 0, err
    assert (export / "README.md").read_text() == card
    assert json.loads((export / "hil_config.json").read_text())["global_step"] == 1
    assert sorted(os.listdir(tmp_path)) == ["export", "run"]
