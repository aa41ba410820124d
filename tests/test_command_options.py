"""One option system for every command (hil.cli.parsers: jsonargparse): ``--config`` / ``--print_config`` round
trips, later options win, one key style (underscores; dashed spellings accepted), one-line errors naming the file,
line and key; the analysis report on the PLAID back-end from a file."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from hil.cli.main import main as hil

COMMANDS = {  # command -> the options it needs to resolve
    "beir": ["--model", "a=runs/a/export", "--model", "b=runs/b/export", "--datasets", "scifact", "--k", "50"],
    "paper": ["--profile", "smoke", "--variants", "colbert,hil"],
    "analyze": ["--model", "m", "--dataset", "scifact", "--output", "out", "--backend", "plaid"],
    "teacher": ["--dataset", "scifact", "--teacher", "t", "--output", "o.jsonl"],
    "engines": ["--model", "a=x", "--model", "b=y", "--dataset", "scifact", "--output", "o"],
    "share": ["runs/a/export", "me/model", "--card-only"],
}


def printed(argv: list[str], capsys) -> dict:
    assert hil(argv + ["--print_config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_print_config_round_trips_and_later_options_win(command, tmp_path, capsys):
    first = printed([command, *COMMANDS[command]], capsys)
    path = tmp_path / "options.yaml"
    path.write_text(yaml.safe_dump(first))
    assert printed([command, "--config", str(path)], capsys) == first
    # an option after the file wins over the file's value; a value only in the file is kept
    key = {"beir": "k", "paper": "profile", "analyze": "k", "teacher": "nway", "engines": "depth",
           "share": "private"}[command]
    value = {"beir": "7", "paper": "cpu", "analyze": "9", "teacher": "3", "engines": "50", "share": "True"}[command]
    option = ["--private"] if command == "share" else [f"--{key}", value]
    again = printed([command, "--config", str(path), *option], capsys)
    assert str(again[key]) == value and {k: v for k, v in again.items() if k != key} == \
        {k: v for k, v in first.items() if k != key}


def test_values_from_a_file_reach_the_command(tmp_path, capsys):
    path = tmp_path / "beir.yaml"
    path.write_text("model: [a=x/export, b=y/export]\ndatasets: scifact,nfcorpus\nindex-root: none\n"
                    "mode: exhaustive\nquiet: true\nbackend_params: '{\"nprobe\": 4}'\n")
    options = printed(["beir", "--config", str(path)], capsys)
    assert options["model"] == ["a=x/export", "b=y/export"] and options["datasets"] == "scifact,nfcorpus"
    # a dashed key (the spelling of the command line) is read as the underscore one
    assert options["index_root"] == "none" and options["mode"] == "exhaustive" and options["quiet"] is True
    assert options["backend_params"] == {"nprobe": 4}
    # a repeatable option accumulates over the file and the command line
    assert printed(["beir", "--config", str(path), "--model", "c=z"], capsys)["model"][-1] == "c=z"


@pytest.mark.parametrize("text, expected", [
    ("k: 5\nnope: 1\n", "options.yaml:2: Option 'nope' is not accepted"),
    ("mode: full\nquiet: 3\n", "options.yaml:2: Option 'quiet' is a flag: true or false (got 3)"),
    # a quoted word is text, not a truth value: "false" must not turn the flag on (issue 39)
    ("mode: full\nquiet: \"false\"\n", "options.yaml:2: Option 'quiet' is a flag: true or false (got 'false')"),
    ("quiet: 'true'\n", "options.yaml:1: Option 'quiet' is a flag: true or false (got 'true')"),
    ("k: [1, 2]\n", "options.yaml:1: Parser key \"k\""),
    ("k: [1,\n", "options.yaml:2: not valid YAML"),
])
def test_a_bad_option_file_is_one_line_naming_file_line_and_key(text, expected, tmp_path, capsys):
    path = tmp_path / "options.yaml"
    path.write_text(text)
    assert hil(["beir", "--config", str(path), "--model", "a=b"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


def test_a_file_that_is_not_a_mapping_is_refused(tmp_path, capsys):
    path = tmp_path / "options.yaml"
    path.write_text("- a\n- b\n")
    assert hil(["beir", "--config", str(path), "--model", "a=b"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_bad_value_in_a_file_is_refused_as_the_option_would_be(tmp_path, capsys):
    path = tmp_path / "options.yaml"
    path.write_text("k: many\n")
    assert hil(["beir", "--config", str(path), "--model", "a=b"]) == 2
    assert '"k"' in capsys.readouterr().err


def test_missing_option_file(tmp_path, capsys):
    assert hil(["paper", "--config", str(tmp_path / "absent.yaml")]) == 2
    err = capsys.readouterr().err
    assert "absent.yaml" in err and len(err.strip().splitlines()) == 1


@pytest.mark.integration
def test_the_analysis_report_searches_plaid_from_an_option_file(tiny_model_dir, tmp_path, capsys):
    """The analysis command takes every back-end (it once offered flat / IVF only): PLAID from a YAML file, and
    the report's run records the back-end and the search settings it used."""
    output = tmp_path / "report"
    path = tmp_path / "analysis.yaml"
    path.write_text(yaml.safe_dump({
        "model": str(tiny_model_dir), "dataset": "scifact", "max-queries": 6, "max-docs": 150, "k": 20,
        "output": str(output), "index-root": str(tmp_path / "indexes"), "backend": "plaid",
        "backend-params": json.dumps({"n_centroids": 16, "ndocs": 64, "stage2_docs": 32}),
        "pairs": 4, "isotropy-tokens": 500, "vocab-pairs": 5, "bootstrap-samples": 50, "permutations": 50,
        "quiet": True}))
    assert hil(["analyze", "--config", str(path)]) == 0, capsys.readouterr().err
    record = json.loads((output / "runs" / f"{tiny_model_dir.name}.json").read_text())
    assert record["details"]["backend"]["kind"] == "plaid"  # read back from the index
    assert record["details"]["backend"]["params"]["n_centroids"] == 16
    search = record["details"]["search_stats"]["search"]  # read back from the back-end after the search
    assert (search["backend"], search["ndocs"], search["stage2_docs"]) == ("plaid", 64, 32)


def test_the_readme_option_file_commands_resolve(tmp_path, capsys):
    """The README's (and docs/guide.md's) `hil <command> ... --print_config > FILE` lines write files that
    `--config FILE` reads back."""
    import re
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = "\n".join((root / name).read_text(encoding="utf-8") for name in ("README.md", "docs/guide.md"))
    lines = [line for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S) for line in block.splitlines()
             if line.startswith("hil ") and "--print_config >" in line]
    assert len(lines) >= 2
    for line in lines:
        command, target = line.split(" > ")
        argv = shlex.split(command)[1:]
        resolved = printed([a for a in argv if a != "--print_config"], capsys)
        path = tmp_path / target.strip()
        path.write_text(yaml.safe_dump(resolved))
        assert printed([argv[0], "--config", str(path)], capsys) == resolved, line


def test_output_is_the_folder_option_of_every_experiment_command():
    """``--output`` (``hil evaluate``'s name) is accepted by ``hil beir``, ``paper`` and ``engines`` beside their
    ``--out``, on the command line and as an option-file key."""
    from hil.cli import beir, engines, paper

    for module in (beir, paper, engines):
        parser = module.build_parser()
        extra = {engines: ["--models", "a=b", "--dataset", "scifact"], beir: ["--model", "m"], paper: []}[module]
        assert parser.parse_args([*extra, "--output", "x"]).output == parser.parse_args([*extra, "--out", "x"]).output \
            == "x"


COMMAND_MODULES = ("beir", "paper", "teacher", "engines", "analyze", "share", "evaluate_script")


def test_every_command_line_is_on_the_one_option_system():
    """Each command's parser is the package's jsonargparse parser (one class for one-line errors); the experiment
    parser of hil evaluate / index / search and hil fit's too; no module of the package builds an argparse parser of
    its own (the maintainer tool readme_tables aside)."""
    import importlib
    import re
    from pathlib import Path

    from hil.cli.main import experiment_parser
    from hil.cli.parsers import CommandParser, OneLineErrors
    from hil.cli.train import TrainingParser

    for name in COMMAND_MODULES:
        assert isinstance(importlib.import_module(f"hil.cli.{name}").build_parser(), CommandParser), name
    assert isinstance(experiment_parser("hil evaluate"), CommandParser)
    assert issubclass(TrainingParser, OneLineErrors)
    package = Path(__file__).resolve().parents[1] / "hil"
    builders = [str(path.relative_to(package)) for path in package.rglob("*.py")
                if re.search(r"argparse\.ArgumentParser\(", path.read_text(encoding="utf-8"))]
    assert builders == ["experiments/readme_tables.py"], builders


@pytest.mark.parametrize("module, needed, dashed, underscored, key", [
    ("beir", ["--model", "m"], "--index-root", "--index_root", "index_root"),
    ("teacher", ["--dataset", "d", "--teacher", "t", "--output", "o"], "--teacher-kind", "--teacher_kind",
     "teacher_kind"),
    ("evaluate_script", ["--model", "m", "--dataset", "d"], "--first-stage-run", "--first_stage_run",
     "first_stage_run"),
])
def test_dashed_and_underscored_spellings_are_one_option(module, needed, dashed, underscored, key):
    import importlib

    parser = importlib.import_module(f"hil.cli.{module}").build_parser()
    value = "cross-encoder" if key == "teacher_kind" else "x"
    assert parser.parse_args([*needed, dashed, value])[key] == parser.parse_args([*needed, underscored, value])[key] \
        == value


def test_hil_evaluate_takes_both_spellings_of_its_slices(capsys):
    options = printed(["evaluate", "--dataset", "scifact", "--max-docs", "30", "--max_queries", "5"], capsys)
    assert options["datasets"] == [{**options["datasets"][0], "max_docs": 30, "max_queries": 5}]


@pytest.mark.parametrize("command", [*sorted(COMMANDS), "evaluate"])
def test_help_is_plain_text_not_restructured_text(command, capsys):
    """--help shows the module docstrings and option texts without reST markup (````x````, ``:class:`...```)."""
    assert hil([command, "--help"]) == 0
    shown = capsys.readouterr().out
    assert "--config" in shown and "``" not in shown and not re.search(r":(class|func|mod|data|meth):`", shown), \
        shown


def test_evaluate_script_prints_and_reads_back_its_options(tmp_path, capsys):
    from hil.cli.evaluate_script import main as evaluate_script

    assert evaluate_script(["--model", "m", "--dataset", "scifact", "--k", "20", "--no-bm25", "--print_config"]) == 0
    first = yaml.safe_load(capsys.readouterr().out)
    assert first["k"] == 20 and first["no_bm25"] is True and "config" not in first
    path = tmp_path / "evaluate.yaml"
    path.write_text(yaml.safe_dump(first))
    assert evaluate_script(["--config", str(path), "--print_config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == first


def test_help_of_every_command_but_training_loads_no_torch():
    """``hil <command> --help`` imports what builds the parser, not what the command runs (torch, transformers,
    scipy, FAISS): the help of every command but fit/validate/test/predict (the LightningCLI, which reads the
    LightningModule's signature) comes without them. One process; after each command, what it loaded."""
    import subprocess
    import sys

    commands = ["evaluate", "index", "search", "beir", "paper", "teacher", "engines", "analyze", "share"]
    probe = ("import io, sys, contextlib\nfrom hil.cli.main import main\n"
             "from hil.cli.evaluate_script import main as script\n"
             f"for command in {commands!r} + ['evaluate.py']:\n"
             "    with contextlib.redirect_stdout(io.StringIO()):\n"
             "        status = script(['--help']) if command == 'evaluate.py' else main([command, '--help'])\n"
             "    heavy = sorted(m for m in ('torch', 'transformers', 'scipy', 'faiss') if m in sys.modules)\n"
             "    print(command, status, ','.join(heavy) or '-')\n")
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    lines = shown.stdout.split("\n")
    assert [line for line in lines if line] == [f"{command} 0 -" for command in [*commands, "evaluate.py"]], \
        shown.stdout


@pytest.mark.parametrize("given", ["--quiet=false", "--quiet=true", "--quiet=0"])
def test_a_value_given_to_a_flag_on_the_command_line_is_refused(given, capsys):
    assert hil(["beir", given, "--model", "a=b"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--quiet" in err, err
