"""YAML option files for the argparse commands (hil.data.option_files): ``--config`` / ``--print_config`` round trips,
later options win, one-line errors naming the file and key; the analysis report on the PLAID back-end from a file."""

from __future__ import annotations

import json

import pytest
import yaml

from hil.console import main as hil

COMMANDS = {  # command -> the options it needs to resolve
    "beir": ["--model", "a=runs/a/export", "--model", "b=runs/b/export", "--datasets", "scifact", "--k", "50"],
    "paper": ["--profile", "smoke", "--variants", "colbert,hil"],
    "analyze": ["--model", "m", "--dataset", "scifact", "--output", "out", "--backend", "plaid"],
    "teacher": ["--dataset", "scifact", "--teacher", "t", "--output", "o.jsonl"],
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
    key = {"beir": "k", "paper": "profile", "analyze": "k", "teacher": "nway"}[command]
    value = {"beir": "7", "paper": "cpu", "analyze": "9", "teacher": "3"}[command]
    again = printed([command, "--config", str(path), f"--{key}", value], capsys)
    assert str(again[key]) == value and {k: v for k, v in again.items() if k != key} == \
        {k: v for k, v in first.items() if k != key}


def test_values_from_a_file_reach_the_command(tmp_path, capsys):
    path = tmp_path / "beir.yaml"
    path.write_text("model: [a=x/export, b=y/export]\ndatasets: scifact,nfcorpus\nindex-root: none\n"
                    "mode: exhaustive\nquiet: true\nbackend_params: '{\"nprobe\": 4}'\n")
    options = printed(["beir", "--config", str(path)], capsys)
    assert options["model"] == ["a=x/export", "b=y/export"] and options["datasets"] == "scifact,nfcorpus"
    assert options["index-root"] == "none" and options["mode"] == "exhaustive" and options["quiet"] is True
    assert options["backend-params"] == {"nprobe": 4}
    # a repeatable option accumulates over the file and the command line
    assert printed(["beir", "--config", str(path), "--model", "c=z"], capsys)["model"][-1] == "c=z"


@pytest.mark.parametrize("text, expected", [
    ("nope: 1\n", "unknown key 'nope'"),
    ("quiet: 3\n", "key 'quiet' is a flag"),
    ("k: [1, 2]\n", "key 'k' takes one value"),
    ("- a\n- b\n", "a mapping of option names to values expected"),
    ("k: [1,\n", "options.yaml:2: not valid YAML"),
])
def test_a_bad_option_file_is_one_line_naming_file_and_key(text, expected, tmp_path, capsys):
    path = tmp_path / "options.yaml"
    path.write_text(text)
    assert hil(["beir", "--config", str(path), "--model", "a=b"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and expected in err, err


def test_a_bad_value_in_a_file_is_refused_as_the_option_would_be(tmp_path, capsys):
    path = tmp_path / "options.yaml"
    path.write_text("k: many\n")
    assert hil(["beir", "--config", str(path), "--model", "a=b"]) == 2
    assert "--k" in capsys.readouterr().err


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
    from hil.experiments import beir, engines, paper

    for module in (beir, paper, engines):
        parser = module.build_parser()
        extra = {engines: ["--models", "a=b", "--dataset", "scifact"], beir: ["--model", "m"], paper: []}[module]
        assert parser.parse_args([*extra, "--output", "x"]).out == parser.parse_args([*extra, "--out", "x"]).out == "x"
