"""``bench/gpu_check.py --exports DIR``: the exported models to evaluate without training, and what their records say.

``DIR`` is an export (a folder with ``hil_config.json``), or holds exports as its sub-folders, or as
``<run>/export`` sub-folders (the layout of the check's own ``work/train``, so a check's trainings can be evaluated
again). The model comes from ``hil_config.json`` (``settings.architecture``); the training precision, which the
export does not record, from the ``config.yaml`` that ``train.py`` (LightningCLI) saved beside its logs when its
``export_dir`` names this export, else ``unknown``.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from gpu_check_plan import GivenExport
from hil.errors import UserError

CONFIG_NAME = "hil_config.json"  # hil.modeling.encoder.CONFIG_NAME, not imported: that would load transformers

# hil_config.json's architecture -> the check's model names (configs/colbert.yaml, configs/variants/colbert_hil.yaml)
MODEL_NAMES = {"colbert": "colbert", "hil": "colbert_hil"}


def is_export(folder: Path) -> bool:
    return (folder / CONFIG_NAME).is_file()


def export_folders(root: Path) -> list[Path]:
    """``root`` if it is an export, else its export sub-folders and ``<sub-folder>/export`` folders, sorted."""
    if is_export(root):
        return [root]
    found = []
    for child in sorted(p for p in root.iterdir() if p.is_dir()):
        found += [child] if is_export(child) else [child / "export"] if is_export(child / "export") else []
    return found


def training_precision(export: Path) -> tuple[str, str]:
    """(precision, where it was read) from a LightningCLI ``config.yaml`` within two levels below the export's
    parent (``<root>/tb/version_0/config.yaml``, ``<root>/lightning_logs/version_0/config.yaml``) whose
    ``export_dir`` is this export (the same path, or the same last two parts where the run folder was moved)."""
    for path in sorted(export.parent.glob("*/*/config.yaml")) + sorted(export.parent.glob("*/config.yaml")):
        try:
            config = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue
        if not isinstance(config, dict) or not config.get("export_dir"):
            continue
        named = Path(str(config["export_dir"]))
        if named.resolve() == export.resolve() or named.parts[-2:] == export.resolve().parts[-2:]:
            precision = (config.get("trainer") or {}).get("precision")
            if precision is not None:
                return str(precision), str(path)
    return "unknown", "not recorded"


def given_export(folder: Path) -> GivenExport:
    """One export's label (its folder's name, or its run folder's for ``<run>/export``), model and precision."""
    try:
        settings = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8")).get("settings") or {}
    except (OSError, ValueError) as error:
        raise UserError(f"--exports: {folder / CONFIG_NAME} cannot be read ({error})") from None
    architecture = str(settings.get("architecture", "unknown"))
    precision, source = training_precision(folder)
    label = folder.parent.name if folder.name == "export" else folder.name
    return GivenExport(label=label, path=str(folder.resolve()), model=MODEL_NAMES.get(architecture, architecture),
                       precision=precision, precision_source=source)


def find_exports(given: str) -> tuple[GivenExport, ...]:
    """The exports ``--exports given`` names; :class:`UserError` (one line) when there are none."""
    root = Path(given).expanduser()
    if not root.is_dir():
        raise UserError(f"--exports {given}: no such folder")
    folders = export_folders(root)
    if not folders:
        raise UserError(f"--exports {given}: no export in it (a folder with {CONFIG_NAME}, itself, as a "
                        f"sub-folder or as <sub-folder>/export)")
    return tuple(given_export(folder) for folder in folders)  # labels differ: each is a different sub-folder's
