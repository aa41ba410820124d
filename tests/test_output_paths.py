"""Outputs checked when a command starts (issue 31): a file where a folder is written, a folder where a file is,
refused at once with one line and exit 2, the user's file untouched and nothing half-written; the folder
replacement never renames a user's file aside."""

from __future__ import annotations

from pathlib import Path

import pytest

from hil.errors import UserError, check_output_path
from hil.provenance import replace_directory


def test_check_output_path(tmp_path):
    (tmp_path / "file.txt").write_text("mine")
    (tmp_path / "folder").mkdir()
    check_output_path(tmp_path / "new" / "deeper", "--out", folder=True)  # not there yet: fine
    check_output_path(tmp_path / "folder", "--out", folder=True)
    check_output_path(tmp_path / "file.txt", "--out", folder=False)
    with pytest.raises(UserError, match="--out .*file.txt: a file is there; a folder is written"):
        check_output_path(tmp_path / "file.txt", "--out", folder=True)
    with pytest.raises(UserError, match="a folder is there; a file is written"):
        check_output_path(tmp_path / "folder", "--out", folder=False)
    with pytest.raises(UserError, match="file.txt is a file, not a folder"):
        check_output_path(tmp_path / "file.txt" / "sub", "--out", folder=True)


def test_replace_directory_never_moves_a_users_file(tmp_path):
    source, target = tmp_path / "built", tmp_path / "target"
    source.mkdir()
    (source / "weights").write_text("new")
    target.write_text("the user's notes")
    with pytest.raises(FileExistsError):
        replace_directory(source, target)
    assert target.read_text() == "the user's notes" and (source / "weights").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["built", "target"]


def test_fit_refuses_an_export_dir_that_is_a_file_before_training(shared_dir, tmp_path, capsys):
    from hil.cli.train import train_main

    mine = tmp_path / "mine.txt"
    mine.write_text("keep me")
    with pytest.raises(SystemExit) as exit_info:
        train_main(["fit", "--config", "colbert", "--config", "presets/smoke", "--trainer.default_root_dir",
                    str(tmp_path / "run"), "--export_dir", str(mine)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--export_dir" in err[0] and "a file is there" in err[0]
    assert mine.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]


def test_hil_evaluate_refuses_an_output_that_is_a_file(shared_dir, tmp_path, capsys):
    from hil.cli.main import main as hil_main

    mine = tmp_path / "results.json"
    mine.write_text("{}")
    assert hil_main(["evaluate", "--model", str(shared_dir / "models" / "bert-tiny-splade"), "--dataset", "scifact",
                     "--output", str(mine)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "output" in err[0] and "a file is there" in err[0] and mine.read_text() == "{}"


def test_teacher_refuses_an_output_that_is_a_folder_before_mining(tmp_path, capsys):
    from hil.cli import teacher as teacher_cli

    (tmp_path / "out").mkdir()
    queries, collection = tmp_path / "q.tsv", tmp_path / "c.tsv"
    queries.write_text("1\tquery one\n")
    collection.write_text("10\tpassage ten\n")
    assert teacher_cli.main(["--queries", str(queries), "--collection", str(collection), "--output",
                         str(tmp_path / "out"), "--teacher", "no-such-teacher", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--output" in err[0] and "a folder is there" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.tsv", "out", "q.tsv"]


def test_a_misspelled_dataset_is_refused_at_once_with_the_close_names(shared_dir, monkeypatch):
    import time

    from hil.data import beir

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub must not be tried for a misspelled name")

    monkeypatch.setattr(beir, "_load_hub", no_hub)
    started = time.perf_counter()
    with pytest.raises(UserError, match="'scifcat'.*did you mean 'scifact'"):
        beir.load_beir("scifcat")
    with pytest.raises(UserError, match="did you mean 'nfcorpus'"):
        beir.load_beir("nfcorpsu")
    assert time.perf_counter() - started < 5
    tried = []
    monkeypatch.setattr(beir, "_load_hub", lambda name, *a: tried.append(name))
    beir.load_beir("cqadupstack-android")  # a BEIR name with its forum, and a name close to nothing: to the hub
    beir.load_beir("my-own-collection")
    assert tried == ["cqadupstack-android", "my-own-collection"]


def test_a_misspelled_dataset_is_refused_before_any_model_loads(shared_dir, tmp_path, capsys, monkeypatch):
    """``hil evaluate`` names the dataset, once each close name, without loading the models first (a model that
    cannot be loaded would otherwise be the error, after its loading time)."""
    from hil.cli.main import main as hil_main
    from hil.evaluation import runner

    loaded = []
    monkeypatch.setattr(runner, "load_model", lambda *args: loaded.append(args))
    assert hil_main(["evaluate", "--dataset", "scifcat", "--model", "no-such-model", "--output",
                     str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "dataset 'scifcat'" in err and err.count("'scifact'") == 1 and not loaded, err


def test_ctrl_c_is_one_line_and_status_130(capsys, monkeypatch):
    from hil.errors import DEBUG_ENV, exit_status

    def interrupted() -> int:
        raise KeyboardInterrupt

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert exit_status("hil evaluate", interrupted) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hil evaluate: interrupted")
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(KeyboardInterrupt):
        exit_status("hil evaluate", interrupted)


def test_every_example_of_hil_help_parses(shared_dir, capsys):
    """Each ``hil <command> ...`` line of the help text (the console's docstring) is accepted as written: its
    options resolve (``--print_config``, exit 0), the training one included."""
    import re

    import hil.cli.main as console

    examples = [line.split("#")[0].split() for line in console.__doc__.splitlines()
                if re.match(r"\s+hil (fit|evaluate|index|search) ", line)]
    assert len(examples) >= 5
    for words in examples:
        argv = [w for w in words[1:] if w != "--print_config"] + ["--print_config"]
        try:
            status = console.main(argv)
        except SystemExit as exit_:  # LightningCLI's --print_config exits
            status = exit_.code or 0
        assert status == 0, (words, capsys.readouterr().err[-300:])


def test_one_version_source():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    import hil

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "hil.__version__"}
    assert hil.__version__ == "0.2.0"


def test_check_output_path_refuses_a_folder_nothing_can_be_written_in(tmp_path):
    # /proc takes no new files, even from root (whom permission bits do not stop): the nearest existing folder of
    # each path below is read-only in the way an immutable or read-only-mounted folder is.
    for target, folder in ((Path("/proc/hil-export"), True), (Path("/proc/self/hil/run.trec"), False),
                           (Path("/proc"), True)):
        with pytest.raises(UserError, match="is not writable"):
            check_output_path(target, "--out", folder=folder)
    check_output_path(tmp_path / "new" / "run.trec", "--out", folder=False)
    assert not list(tmp_path.iterdir())  # the probe leaves nothing behind
