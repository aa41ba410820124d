"""Mistakes in a training config end in one line on stderr that says what to change, and exit status 2.

Each case runs ``hil.cli.train_main`` in-process (the same code path as ``python train.py fit``) and reads stderr.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hil.cli.train import one_line, train_main, user_error
from hil.errors import DataFormatError

REPO = Path(__file__).resolve().parents[1]


def run_cli(tmp_path: Path, capsys, *extra: str) -> tuple[int, str]:
    args = ["fit", "--config", str(REPO / "configs/colbert.yaml"), "--config", str(REPO / "configs/presets/smoke.yaml"),
            "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false", "--trainer.max_steps", "1",
            *extra]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train_main(args)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:") or ": error: " in line]
    assert len(errors) == 1, err
    assert "Traceback" not in err and "usage:" not in err, err
    return exit_info.value.code, errors[0]


def write_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "override.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


# -- parse-time errors (no model is built) ------------------------------------------------------------------------
def test_unknown_option_names_it(tmp_path, capsys):
    code, line = run_cli(tmp_path, capsys, "--data.batch_sise", "3")
    assert code == 2
    assert "unrecognized arguments: --data.batch_sise 3" in line and "--help" in line


def test_unknown_key_in_a_config_file_names_it(tmp_path, capsys):
    code, line = run_cli(tmp_path, capsys, "--config", write_config(tmp_path, "data:\n  batch_sise: 3\n"))
    assert code == 2
    assert "batch_sise" in line


def test_wrong_type_names_key_and_value(tmp_path, capsys):
    code, line = run_cli(tmp_path, capsys, "--data.batch_size", "abc")
    assert code == 2
    assert 'Parser key "data.batch_size"' in line and "int" in line and "abc" in line


def test_wrong_type_inside_the_model_names_the_field_without_union_noise(tmp_path, capsys):
    code, line = run_cli(tmp_path, capsys, "--model.encoder.init_args.dim", "abc")
    assert code == 2
    assert '"dim"' in line and "abc" in line
    assert "NoneType" not in line and "Union" not in line


# -- errors raised while building the model or reading data (ours, unwrapped from jsonargparse) --------------------
def test_missing_model_path_says_where_it_looked(shared_dir, tmp_path, capsys):
    code, line = run_cli(tmp_path, capsys, "--model.encoder.init_args.backbone", "/nonexistent/model")
    assert code == 2
    assert "/nonexistent/model" in line
    assert "not a local model directory" in line and "HIL_MODELS_DIR" in line and "hub" in line


def test_tokenizer_without_the_marker_token(shared_dir, tmp_path, capsys):
    # From a YAML file: on the command line jsonargparse reads `[no-such-token]` as a YAML list (quote it twice).
    config = write_config(tmp_path, 'model:\n  encoder:\n    init_args:\n      query_marker: "[no-such-token]"\n')
    code, line = run_cli(tmp_path, capsys, "--config", config)
    assert code == 2
    assert "[no-such-token]" in line and "query_marker" in line and "unused vocabulary token" in line
    assert "model.encoder.init_args.query_marker" in line


def test_missing_data_file(shared_dir, tmp_path, capsys):
    code, line = run_cli(tmp_path, capsys, "--data.source.path", str(tmp_path / "missing.tsv"))
    assert code == 2
    assert line.startswith(f"error: TextTriples.path: {tmp_path / 'missing.tsv'}: no such file")


def test_malformed_data_file_names_file_and_line(shared_dir, tmp_path, capsys):
    bad = tmp_path / "bad.tsv"
    bad.write_text("q1\tpositive one\tnegative one\nq2\tonly two columns\n", encoding="utf-8")
    code, line = run_cli(tmp_path, capsys, "--data.source.path", str(bad))
    assert code == 2
    assert line.startswith(f"error: {bad}:2:") and "3 tab-separated columns" in line


@pytest.mark.parametrize("option, value, expected", [
    ("--data.batch_size", "0", "data.batch_size must be >= 1 (got 0)"),
    ("--nonfinite_guard.policy", "explode", "nonfinite_guard.policy"),
    ("--data.idf_max_docs", "0", "data.idf_max_docs must be >= 1"),
    ("--model.lr_scheduler.init_args.warmup_steps", "-1", "warmup_steps must be >= 0"),
])
def test_values_refused_by_our_validation(shared_dir, tmp_path, capsys, option, value, expected):
    code, line = run_cli(tmp_path, capsys, option, value)
    assert code == 2
    assert expected in line


# -- what is *not* turned into one line ---------------------------------------------------------------------------
def test_errors_from_outside_the_package_keep_their_traceback():
    def third_party():
        raise ValueError("an internal bug")

    try:
        third_party()
    except ValueError as error:
        assert user_error(error) is None  # raised in this test file, not in hil/: a bug keeps its traceback
    wrapped = DataFormatError("x.tsv", 3, "bad")
    try:
        try:
            raise wrapped
        except DataFormatError as inner:
            raise ValueError("Does not validate against any of the Union subtypes") from inner
    except ValueError as outer:
        assert user_error(outer) is wrapped


def test_one_line_drops_union_boilerplate():
    message = ("Does not validate against any of the Union subtypes\nSubtypes: [A, None]\nErrors:\n"
               "  - model.x must be > 0\n  - Expected a <class 'NoneType'>\nGiven value type: <class 'X'>\n"
               "Given value: Namespace(...)")
    assert one_line(message) == "model.x must be > 0"


def test_debug_env_restores_the_traceback(shared_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HIL_DEBUG", "1")
    with pytest.raises(ValueError, match="must be >= 1"):
        train_main(["fit", "--config", str(REPO / "configs/colbert.yaml"), "--config",
                    str(REPO / "configs/presets/smoke.yaml"), "--trainer.default_root_dir", str(tmp_path),
                    "--trainer.logger", "false", "--data.batch_size", "0"])
