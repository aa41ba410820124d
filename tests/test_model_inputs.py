"""Models as users hand them over: heads of any size, options only when given, damaged files named in one line.

- ``evaluate.py --dim`` used to default to 128 and be sent to the loader as a request, so a Stanford or PyLate
  checkpoint whose head is not 128-d was refused (answerai-colbert-small has 96). Options the user did not give
  must not reach the loader; options given to a trained model that keeps its own settings are refused, not ignored.
- A damaged or truncated model file (an interrupted download) is one line naming it, exit 2, for every kind of file
  a model folder holds (JSON, safetensors, a torch archive) and every layout (ours, Stanford, PyLate, a .ckpt).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from hil.cli.evaluate_script import main as evaluate_main
from hil.modeling.formats import ModelFormatError
from hil.modeling.loading import load_encoder

from peer_layouts import write_pylate, write_stanford  # noqa: E402


def write_beir(folder):
    (folder / "qrels").mkdir(parents=True)
    corpus = {f"d{i}": f"document {i} about cells and genes {i % 3}" for i in range(12)}
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": d, "title": "", "text": t}) + "\n"
                                                 for d, t in corpus.items()))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": f"genes {i}"}) + "\n"
                                                  for i in range(3)))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" +
                                               "".join(f"q{i}\td{i}\t1\n" for i in range(3)))
    return folder


@pytest.fixture(scope="module")
def beir(tmp_path_factory):
    return write_beir(tmp_path_factory.mktemp("beir") / "toy")


def evaluate_cli(model, beir, tmp_path, *extra):
    return evaluate_main(["--model", str(model), "--dataset", str(beir), "--mode", "exhaustive", "--index-root",
                          str(tmp_path / "indexes"), "--output", str(tmp_path / "out"), "--quiet", "--no-stats",
                          "--no-bm25", *extra])


# -- head sizes: what the user did not give is not requested -------------------------------------------------------

@pytest.mark.parametrize("layout, dim", [("stanford", 96), ("pylate", 96), ("stanford", 24), ("pylate", 160)])
def test_a_peer_checkpoint_of_any_head_size_evaluates_without_dim(tiny_model_dir, beir, tmp_path, layout, dim):
    writer = write_stanford if layout == "stanford" else write_pylate
    folder = writer(tmp_path / layout, str(tiny_model_dir), dim=dim)
    assert evaluate_cli(folder, beir, tmp_path) == 0
    recorded = json.loads((tmp_path / "out" / "metrics.json").read_text())
    (model,) = recorded["models"].values()
    assert model["settings"]["dim"] == dim
    assert evaluate_cli(folder, beir, tmp_path, "--dim", str(dim)) == 0, "the model's own value is accepted"


def test_a_different_dim_for_a_trained_model_is_refused_in_one_line(tiny_model_dir, beir, tmp_path, capsys):
    folder = write_stanford(tmp_path / "stanford", str(tiny_model_dir), dim=96)
    capsys.readouterr()  # the writer's own loading bar (shown unless an earlier test turned transformers' bars off)
    assert evaluate_cli(folder, beir, tmp_path, "--dim", "128") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dim 128 asked, but the checkpoint's projection gives 96" in err[0]


def test_an_export_refuses_settings_it_would_ignore(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    export = load_encoder(str(tiny_model_dir), dim=16, query_maxlen=12).save_pretrained(tmp_path / "export")
    assert load_encoder(export).settings()["dim"] == 16
    assert load_encoder(export, dim=16, query_maxlen=12).settings()["query_maxlen"] == 12
    with pytest.raises(ModelFormatError, match=r"keeps its own settings \{'query_maxlen': 12\}; "
                                               r"\{'query_maxlen': 64\} asked"):
        load_encoder(export, query_maxlen=64)
    with pytest.raises(ModelFormatError, match=r"\{'dim': 128\} asked"):
        load_encoder(export, dim=128)


def test_an_untrained_backbone_gets_the_default_or_the_asked_head(tiny_model_dir):
    assert load_encoder(str(tiny_model_dir)).settings()["dim"] == 128
    assert load_encoder(str(tiny_model_dir), dim=40).settings()["dim"] == 40


# -- damaged files ---------------------------------------------------------------------------------------------------

def truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)


def flip_middle_byte(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.seek(size // 2)
        byte = handle.read(1)
        handle.seek(size // 2)
        handle.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    from hil.modeling.export import export_model

    export = export_model(load_encoder(str(tiny_model_dir), dim=16), root / "export")
    return {"export": export, "stanford": write_stanford(root / "stanford", str(tiny_model_dir)),
            "pylate": write_pylate(root / "pylate", str(tiny_model_dir))}


CASES = [
    ("export", "model.safetensors", truncate, "unreadable safetensors file"),
    ("export", "hil_heads.pt", truncate, "hil_heads.pt"),
    ("export", "hil_heads.pt", flip_middle_byte, "hil_heads.pt"),
    ("export", "hil_config.json", truncate, "invalid JSON"),
    ("export", "config.json", truncate, "invalid JSON"),
    ("export", "tokenizer.json", truncate, "invalid JSON"),
    ("stanford", "model.safetensors", truncate, "unreadable safetensors file"),
    ("stanford", "artifact.metadata", truncate, "invalid JSON"),
    ("pylate", "1_Dense/model.safetensors", truncate, "unreadable safetensors file"),
    ("pylate", "1_Dense/config.json", truncate, "invalid JSON"),
    ("pylate", "config_sentence_transformers.json", truncate, "invalid JSON"),
    ("pylate", "modules.json", truncate, "invalid JSON"),
]


@pytest.mark.parametrize("layout, name, damage, words", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2].__name__}" for c in CASES])
def test_a_damaged_model_file_is_one_line_naming_it(models, beir, tmp_path, capsys, layout, name, damage, words):
    folder = tmp_path / layout
    shutil.copytree(models[layout], folder)
    damage(folder / name)
    with pytest.raises(ModelFormatError, match=words):
        load_encoder(folder)
    assert evaluate_cli(folder, beir, tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("evaluate.py: error: ") and str(folder / name) in err[0], err
    assert "damaged or truncated" in err[0] and "Traceback" not in err[0]


def test_a_damaged_lightning_checkpoint_is_one_line(models, beir, tmp_path, capsys):
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"encoder.x": torch.zeros(1000)}, "hil": {"settings": {}}}, path)
    truncate(path)
    assert evaluate_cli(path, beir, tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "Traceback" not in err[0]


def test_intact_models_pass_the_checks(models):
    from hil.modeling.model_files import check_model_files

    for folder in models.values():
        check_model_files(folder)  # raises on any problem
