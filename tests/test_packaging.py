"""The installed package: the console scripts run as subprocesses from outside the repository, the YAML recipes
resolved by name, and the recipes inside the wheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hil.paths import CONFIGS_DIR, resolve_config

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def script(name: str, *args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    if not (BIN / name).exists():
        pytest.skip(f"{name} is not installed beside this Python (pip install -e .)")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HIL_DEBUG": ""}
    return subprocess.run([str(BIN / name), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_recipes_resolve_by_name_and_paths_stay_paths(tmp_path):
    assert resolve_config("colbert_hil") == str(CONFIGS_DIR / "variants" / "colbert_hil.yaml")
    assert resolve_config("presets/smoke.yaml") == str(CONFIGS_DIR / "presets" / "smoke.yaml")
    assert resolve_config("configs/colbert.yaml") == "configs/colbert.yaml" or Path("configs/colbert.yaml").exists()
    mine = tmp_path / "colbert_hil.yaml"
    mine.write_text("trainer: {}\n")
    assert resolve_config(str(mine)) == str(mine)  # an existing file wins over a recipe's name
    assert resolve_config("no_such_recipe") == "no_such_recipe"


def test_train_evaluate_and_share_scripts_from_outside_the_repository(shared_dir, tmp_path):
    """``hil-train`` with recipes by name exits 0 (it used to print the CLI object and exit 1), its export is
    evaluated by ``hil-evaluate``, and ``hil-share --card-only`` writes the card; a bad recipe is one line, exit 2."""
    out = tmp_path / "run"
    trained = script("hil-train", "fit", "--config", "colbert", "--config", "colbert_hil", "--config", "smoke",
                     "--trainer.max_steps", "1", "--trainer.default_root_dir", str(out),
                     "--export_dir", str(out / "export"), cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    record = json.loads((out / "export" / "hil_config.json").read_text())
    assert record["settings"]["architecture"] == "hil" and record["global_step"] == 1
    assert record["data"]["source"]["init_args"]["path"] == "msmarco/triples.train.small.head1000.tsv"
    evaluated = script("hil-evaluate", "--model", str(out / "export"), "--dataset", "scifact", "--max-docs", "40",
                       "--max-queries", "4", "--mode", "exhaustive", "--no-bm25", "--no-stats", "--quiet",
                       "--output", str(tmp_path / "eval"), cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    shared = script("hil-share", str(out / "export"), "me/tiny-hil", "--card-only", "--metrics",
                    str(tmp_path / "eval" / "metrics.json"), cwd=tmp_path)
    assert shared.returncode == 0, shared.stderr[-3000:]
    card = (out / "export" / "README.md").read_text()
    assert "| scifact (test) |" in card and "- steps: 1" in card
    bad = script("hil-train", "fit", "--config", "colbert_hill", cwd=tmp_path)
    assert bad.returncode == 2
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:") or ": error: " in line]
    assert len(errors) == 1 and "colbert_hill" in errors[0] and "Traceback" not in bad.stderr


def test_the_wheel_carries_every_recipe(tmp_path):
    if shutil.which("pip", path=str(BIN)) is None:
        pytest.skip("no pip beside this Python")
    pytest.importorskip("setuptools")  # the build backend, used without an isolated environment (offline)
    # Built from a copy of what the package is made of, so setuptools' build/ folder never lands in the repository.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "hil", source / "hil", ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([str(BIN / "pip"), "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("hil-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    recipes = {f"hil/configs/{p.relative_to(CONFIGS_DIR)}" for p in CONFIGS_DIR.rglob("*.yaml")}
    assert recipes and recipes <= names, sorted(recipes - names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "hil-train = hil.cli.train:train_main" in entry_points and "hil-share = hil.cli.share:main" in entry_points
