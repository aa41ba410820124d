"""Every tool command parses a typed settings dataclass (issue 39, item 1): ``hil teacher``, ``engines``, ``share``
and ``paper`` build their parsers from the dataclass's fields (no hand-declared option), ``--print_config`` fed
back with ``--config`` is the same settings (an equal dataclass), a ``bool`` field is also a bare flag, the old
spellings still work with one deprecation line each (listed in :data:`hil.compat.SHIMS`), and the settings' own
checks name their keys, which the command shows as options."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from hil.cli.parsers import SettingsParser

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {  # command -> a command line that resolves (nothing is run)
    "teacher": ["--dataset", "scifact", "--teacher", "t", "--output", "o.jsonl", "--nway", "4", "--depth", "9",
                "--quiet", "--teacher_kind", "dense"],
    "engines": ["--model", "a=x", "--model", "b@2=y", "--dataset", "scifact", "--output", "o", "--depth", "50",
                "--bootstrap_samples", "20"],
    "share": ["runs/a/export", "me/model", "--card-only", "--metrics", "a.json", "b.json"],
    "paper": ["--profile", "smoke", "--variants", "colbert,hil", "--output", "o", "--no-corpus-idf", "--seeds", "1,2",
              "--p_adjust", "bh", "--max_steps", "3"],
}


def settings_of(command: str, argv: list[str]):
    parser = importlib.import_module(f"hil.cli.{command}").build_parser()
    return parser.settings(parser.parse_args(argv))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_print_config_fed_back_is_the_same_settings(command, tmp_path, capsys):
    module = importlib.import_module(f"hil.cli.{command}")
    assert module.main([*COMMANDS[command], "--print_config"]) == 0
    path = tmp_path / "settings.yaml"
    path.write_text(capsys.readouterr().out)
    given, read_back = settings_of(command, COMMANDS[command]), settings_of(command, ["--config", str(path)])
    assert type(given).__name__.endswith("Settings") and read_back == given


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_no_option_is_declared_by_hand(command):
    """The command's parser is its settings' (a SettingsParser); its module calls no ``add_argument``."""
    module = importlib.import_module(f"hil.cli.{command}")
    assert isinstance(module.build_parser(), SettingsParser)
    calls = [node for node in ast.walk(ast.parse(Path(module.__file__).read_text(encoding="utf-8")))
             if isinstance(node, ast.Attribute) and node.attr == "add_argument"]
    assert not calls, command


def test_a_bool_setting_is_a_bare_flag_or_takes_a_truth_value():
    base = ["--dataset", "d", "--teacher", "t", "--output", "o"]
    assert settings_of("teacher", [*base, "--quiet", "--overwrite"]).quiet is True
    assert settings_of("teacher", [*base, "--quiet", "false", "--overwrite", "true"]).quiet is False
    assert settings_of("teacher", [*base, "--quiet=false"]).quiet is False
    assert settings_of("teacher", base).quiet is False


def test_teacher_settings_are_checked_naming_the_key_and_the_command_shows_the_option(capsys):
    from hil.errors import UserError
    from hil.experiments.teacher_settings import TeacherSettings

    with pytest.raises(UserError, match=r"^`nway` must be >= 2 \(got 1\)$"):
        TeacherSettings(teacher="t", output="o", dataset="d", nway=1)
    with pytest.raises(UserError, match="`queries` needs `collection`"):
        TeacherSettings(teacher="t", output="o", queries="q.tsv")
    from hil.cli.teacher import main

    assert main(["--dataset", "d", "--teacher", "t", "--output", "o", "--nway", "1"]) == 2
    assert capsys.readouterr().err.strip() == "hil teacher: error: --nway must be >= 2 (got 1)"


def test_the_teacher_run_takes_its_settings_not_a_namespace():
    """Nothing below hil/cli takes an argparse.Namespace (the teacher's run once did)."""
    for module in ("hil/experiments/teacher.py", "hil/experiments/teacher_settings.py"):
        assert "argparse" not in (ROOT / module).read_text(encoding="utf-8"), module


def test_the_engine_study_old_spellings_still_work_with_a_deprecation_line(capsys):
    """``--models a=x,b=y``, ``--out`` and ``--n-bootstrap`` (0.2's spellings) are the study ``--model`` (repeated),
    ``--output`` and ``--bootstrap_samples`` give, each with one warning line, and each a row of hil.compat."""
    from hil.compat import SHIMS

    old = settings_of("engines", ["--models", "a=x,b@2=y", "--dataset", "scifact", "--out", "o", "--n-bootstrap",
                                  "20", "--depth", "50"])
    warned = capsys.readouterr().err.splitlines()
    assert old == settings_of("engines", COMMANDS["engines"])
    assert [line.split(" is deprecated")[0] for line in warned] == [
        "hil engines: warning: --models", "hil engines: warning: --out", "hil engines: warning: --n-bootstrap"]
    assert all("removed in 0.4.0" in line for line in warned)
    listed = {(shim.old, shim.new.split()[0]) for shim in SHIMS if shim.module == "hil/cli/engines.py"}
    assert listed == {("--models", "--model"), ("--out", "--output"), ("--n_bootstrap", "--bootstrap_samples")}


def test_engine_study_models_are_read_once_and_refused_naming_the_option(capsys):
    settings = settings_of("engines", COMMANDS["engines"])
    assert [(spec.column, spec.seed, spec.source) for spec in settings.models()] == [
        ("a", None, "x"), ("b (seed 2)", 2, "y")]
    from hil.cli.engines import main

    assert main(["--model", "ax", "--dataset", "scifact", "--output", "o"]) == 2
    assert capsys.readouterr().err.strip() == \
        "hil engines: error: --model: name=path or name@seed=path expected, got 'ax'"
    assert main(["--model", "a=x", "--dataset", "scifact", "--output", "o", "--max_tokens", "1"]) == 2
    assert "--max_tokens must be >= 2" in capsys.readouterr().err


def test_share_takes_its_leading_words_and_the_list_after_an_option(tmp_path):
    """``hil share EXPORT REPO_ID --metrics a b`` (argparse's spelling of 0.2) and the named options are one
    settings; a flag before the leading words does not take them."""
    from hil.modeling.hub import ShareSettings

    expected = ShareSettings("runs/a/export", "me/model", ["a.json", "b.json"], private=True)
    assert settings_of("share", ["runs/a/export", "me/model", "--metrics", "a.json", "b.json", "--private"]) \
        == expected
    assert settings_of("share", ["--private", "runs/a/export", "me/model", "--metrics", "a.json", "--metrics",
                                 "b.json"]) == expected
    assert settings_of("share", ["--export", "runs/a/export", "--repo_id", "me/model", "--metrics", "a.json",
                                 "--metrics", "b.json", "--private", "true"]) == expected


def test_paper_settings_make_the_profile_and_refuse_names_before_any_work(capsys):
    settings = settings_of("paper", COMMANDS["paper"])
    profile = settings.profile_settings()
    assert (profile.name, profile.max_steps, profile.p_adjust, profile.corpus_idf) == ("smoke", 3, "bh", False)
    assert (settings.variant_names(), settings.seed_list()) == (["colbert", "hil"], [1, 2])
    old = settings_of("paper", [*COMMANDS["paper"][:4], "--out", "o", *COMMANDS["paper"][6:]])
    assert old == settings and capsys.readouterr().err.strip() == \
        "hil paper: warning: --out is deprecated (removed in 0.4.0): use --output"
    from hil.errors import UserError
    from hil.experiments.paper_settings import PaperSettings

    with pytest.raises(UserError, match="^`variants`: unknown 'nope'"):  # when made, not when the run reads it
        PaperSettings(variants="nope")
    from hil.cli.paper import main

    for argv, shown in ((["--variants", "colbert,nope"], "--variants: unknown 'nope'"),
                        (["--seeds", "1,1"], "--seeds: one or more distinct seeds"),
                        (["--max_steps", "0"], "--max_steps must be at least 1")):
        assert main(argv) == 2
        assert capsys.readouterr().err.startswith(f"error: {shown}")
