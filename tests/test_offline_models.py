"""A hub name while the Hugging Face hub cannot be asked (issue 40, row 8): one line at once, naming what to set.

Offline (``HF_HUB_OFFLINE=1``) or with the hub's host not answering, a model name that is no local folder used to
cost 45-60 s of the hub client's "Retrying" lines before an error that did not say ``HIL_MODELS_DIR`` was unset.
"""

from __future__ import annotations

import socket
import time

import pytest

from hil.errors import UserError
from hil.paths import ModelNotFoundError, hub_out_of_reach, resolve_model


@pytest.fixture
def no_models_dir(monkeypatch, tmp_path):
    """``HIL_MODELS_DIR`` unset, the hub's cache empty, no offline switch, no proxy."""
    monkeypatch.delenv("HIL_MODELS_DIR", raising=False)
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy",
                     "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(variable, raising=False)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.chdir(tmp_path)  # no folder of that name here either


def closed_port() -> int:
    with socket.socket() as sock:  # bound, then closed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_offline_a_name_not_on_disk_is_one_line_at_once_naming_hil_models_dir(shared_dir, no_models_dir,
                                                                             monkeypatch):
    from hil.modeling.loading import load_encoder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    with pytest.raises(UserError) as error:
        load_encoder("bert-tiny-splade")
    assert time.monotonic() - started < 2
    message = str(error.value)
    assert "\n" not in message and message.startswith("bert-tiny-splade: not a local model folder")
    assert "HIL_MODELS_DIR is not set" in message and "HIL_MODELS_DIR=<a folder holding bert-tiny-splade/>" in message
    assert "HF_HUB_OFFLINE=1" in message


def test_an_unreachable_hub_fails_fast_without_retries(shared_dir, no_models_dir, monkeypatch, capsys):
    """No offline switch, the hub's host refusing connections: the training command's one line, at once."""
    from hil.cli.train import run_train

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    started = time.monotonic()
    with pytest.raises(SystemExit) as stop:
        run_train(["fit", "--config", "colbert", "--config", "presets/smoke", "--trainer.default_root_dir", "run"])
    seconds = time.monotonic() - started
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Retrying" not in err and seconds < 15, (seconds, err)
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "bert-tiny-splade: not a local model folder (HIL_MODELS_DIR is not set)" in line
    assert "127.0.0.1" in line and "hub cannot be asked" in line


def test_a_models_dir_without_the_model_is_named(shared_dir, no_models_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("HIL_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match=r"no .*models/all-MiniLM-L6-v2 under HIL_MODELS_DIR.*put the model "
                                                 r"at .*models/all-MiniLM-L6-v2"):
        resolve_model("sentence-transformers/all-MiniLM-L6-v2")


def test_offline_a_cached_hub_model_is_read_from_the_cache(no_models_dir, monkeypatch, tmp_path):
    snapshot = tmp_path / "hub-cache" / "models--org--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub-cache" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub-cache" / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("org/tiny") == str(snapshot)


def test_a_reachable_hub_and_paths_are_left_to_the_hub_client(no_models_dir, monkeypatch):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert hub_out_of_reach() is None
        assert resolve_model("org/some-model") == "org/some-model"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("runs/a/b/export") == "runs/a/b/export"  # a path, not a hub name: its loader says so
