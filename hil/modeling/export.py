"""Exports: our own layout for every model, and the Stanford ColBERT layout beside it for a ColBERT.

``export_model`` writes, into one folder, what ``hil`` loads (``hil_config.json``, ``hil_heads.pt``, the backbone
and tokenizer) and, for a ``ColBERTEncoder`` without a projection bias, the Stanford ColBERT layout too: the
weights file holds the backbone under its ``base_model_prefix`` plus ``linear.weight``, ``config.json`` names the
architecture ``HF_ColBERT`` and ``artifact.metadata`` carries the ColBERTConfig settings. Stanford ColBERT
(``Checkpoint(path)``) and PyLate (``models.ColBERT(path)``, through its Stanford path) then load the right head
and settings; ``AutoModel.from_pretrained`` still reads the backbone (it strips the prefix).

ColBERT-HIL (two heads, an IDF table, z-score statistics) has no counterpart in either peer: its layout is
described in ``docs/hil-format.md``. The folder appears only once complete (built beside it, then renamed).

An export replaces its folder whole, so it never replaces one that holds what it did not write: the target must be
absent, empty, or an earlier export, which lists every file it wrote in its ``hil_config.json`` (``files``). A
model card (``README.md``, ``hil share --card-only``) is carried over into the new export; any other file refuses
the folder (:class:`ExportRefused`, naming the file), and so does the folder of the training run itself
(``--export_dir`` equal to, or above, ``trainer.default_root_dir`` or the checkpoint folder).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

from safetensors.torch import save_file

from hil.errors import UserError
from hil.modeling.contracts import Encoder
from hil.modeling.encoder import CONFIG_NAME, ColBERTEncoder, MultiVectorEncoder
from hil.modeling.formats import SHARDED_INDEXES, STANFORD_ARCHITECTURE, STANFORD_METADATA, WEIGHT_FILES
from hil.modeling.hub import CARD_NAME
from hil.provenance import (
    atomic_directory,
    atomic_output,
    file_lock,
    give_plain_file_modes,
    lock_path,
    versions,
    write_json_atomic,
)

logger = logging.getLogger(__name__)

STANFORD_VERSION = "colbert-v0.4"  # what ColBERTConfig.save writes into meta.version
MANIFEST_KEY = "files"  # hil_config.json's list of the files the export wrote: what a re-export may replace
# Files a user adds to an export that a re-export carries over (the model card hil share --card-only writes).
KEPT_FILES = (CARD_NAME,)


class ExportRefused(UserError):
    """An export folder that holds files no export wrote, or that is the training run's own folder: nothing in it
    was replaced."""


def stanford_representable(encoder: Encoder) -> str | None:
    """Why ``encoder`` cannot be written in the Stanford layout, or None when it can."""
    if not isinstance(encoder, ColBERTEncoder):
        return f"a {encoder.architecture} model has no Stanford ColBERT counterpart (see docs/hil-format.md)"
    if encoder.projection_bias:
        return "Stanford ColBERT's projection has no bias"
    return None


def stanford_metadata(encoder: ColBERTEncoder) -> dict[str, Any]:
    """The ``artifact.metadata`` of ``encoder``: the ColBERTConfig keys that decide how it encodes."""
    settings = encoder.tokenizer.settings()
    return {"query_token_id": settings["query_marker"], "doc_token_id": settings["doc_marker"],
            "query_token": "[Q]", "doc_token": "[D]", "query_maxlen": settings["query_maxlen"],
            "doc_maxlen": settings["doc_maxlen"], "dim": encoder.dim,
            "mask_punctuation": settings["mask_punctuation"],
            "attend_to_mask_tokens": settings["attend_to_mask_tokens"], "similarity": "cosine",
            "interaction": "colbert",
            "meta": {"version": STANFORD_VERSION, "written_by": f"hil {versions().get('hil', 'unknown')}"}}


def write_stanford_files(encoder: ColBERTEncoder, directory: Path) -> None:
    """Turn a folder holding ``encoder``'s backbone (``save_pretrained``) into a Stanford ColBERT checkpoint."""
    reason = stanford_representable(encoder)
    if reason is not None:
        raise ValueError(f"cannot write the Stanford ColBERT layout: {reason}")
    prefix = encoder.backbone.base_model_prefix
    # Cloned so that no two entries share memory (safetensors refuses shared tensors).
    state = {f"{prefix}.{key}": value.detach().cpu().clone().contiguous()
             for key, value in encoder.backbone.state_dict().items()}
    state["linear.weight"] = encoder.linear.weight.detach().cpu().float().clone().contiguous()
    for name in (*WEIGHT_FILES, *SHARDED_INDEXES):
        (directory / name).unlink(missing_ok=True)
    for shard in directory.glob("model-*-of-*.safetensors"):
        shard.unlink()
    with atomic_output(directory / "model.safetensors") as tmp:  # given the umask's mode, as every other file
        save_file(state, str(tmp), metadata={"format": "pt"})
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["architectures"] = [STANFORD_ARCHITECTURE]
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (directory / STANFORD_METADATA).write_text(json.dumps(stanford_metadata(encoder), indent=4) + "\n",
                                               encoding="utf-8")


def _entries(directory: Path) -> list[str]:
    """Every file, link and empty folder under ``directory`` (relative paths; a folder ends in ``/``); a folder
    that cannot be read counts as one entry (what it holds is unknown, so it is not the package's)."""
    found: list[str] = []

    def unreadable(error: OSError) -> None:
        found.append(Path(error.filename).relative_to(directory).as_posix() + "/")

    for root, folders, files in os.walk(directory, onerror=unreadable):
        base = Path(root).relative_to(directory)
        found += [(base / name).as_posix() for name in files]
        found += [(base / name).as_posix() for name in folders if os.path.islink(os.path.join(root, name))]
        if not folders and not files and base != Path("."):
            found.append(base.as_posix() + "/")
    return sorted(found)


def _manifest(directory: Path) -> list[str] | None:
    """The files an earlier export in ``directory`` says it wrote, or None when no export record lists them."""
    try:
        listed = json.loads((directory / CONFIG_NAME).read_text(encoding="utf-8")).get(MANIFEST_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return listed if isinstance(listed, list) and all(isinstance(name, str) for name in listed) else None


def _kept(directory: Path) -> list[str]:
    return [name for name in KEPT_FILES if (directory / name).is_file()]


def foreign_files(directory: str | os.PathLike) -> list[str]:
    """The files in ``directory`` that an export may not replace: none when it is absent or empty, those its
    record does not list when it holds an earlier export, all of them otherwise; :data:`KEPT_FILES` (carried over)
    never count."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    written = set(_manifest(directory) or ()) | set(_kept(directory))
    return [name for name in _entries(directory) if name not in written]


def run_folders(trainer: Any) -> list[tuple[str, str]]:
    """The folders a training run writes into, from a config's ``trainer`` settings (a mapping or a jsonargparse
    ``Namespace``): ``default_root_dir`` (the working folder when unset), which holds the logs and checkpoints, and
    the ``dirpath`` of any checkpoint callback that puts them elsewhere. -> (setting, folder) pairs for
    :func:`export_refusal`."""
    folders = [("trainer.default_root_dir", str(trainer.get("default_root_dir") or os.getcwd()))]
    callbacks = trainer.get("callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        init_args = callback.get("init_args") if hasattr(callback, "get") else None
        dirpath = init_args.get("dirpath") if hasattr(init_args, "get") else None
        if dirpath:
            folders.append(("checkpoint folder (dirpath)", str(dirpath)))
    return folders


def export_refusal(directory: str | os.PathLike, option: str = "export folder",
                   run: Iterable[tuple[str, str | os.PathLike]] = (), overwrite: bool = False) -> str | None:
    """Why an export may not replace ``directory`` (one line naming ``option``, the folder and what to do), or
    None. ``run``: the training run's own folders (:func:`run_folders`), which an export never replaces nor sits
    above. ``overwrite`` allows replacing a folder of other files (never a run's folder, never a file)."""
    target = Path(directory).expanduser().resolve()
    for what, folder in run:
        own = Path(folder).expanduser().resolve()
        if target == own or target in own.parents:
            where = "is" if target == own else "holds"
            return (f"{option} {directory}: {where} the run's own {what} {folder} (its checkpoints and logs), which "
                    f"an export would replace; give a folder of its own, e.g. {Path(folder) / 'export'}")
    if target.exists() and not target.is_dir():
        return f"{option} {directory}: a file is there, not a folder; give another path or remove it"
    foreign = [] if overwrite else foreign_files(target)
    if not foreign:
        return None
    if _manifest(target) is None and (target / CONFIG_NAME).is_file():
        return (f"{option} {directory}: holds an export that does not list its files (written before hil "
                f"recorded them), so what else is there cannot be told apart; remove it or give another folder")
    shown = ", ".join(foreign[:2]) + (f" and {len(foreign) - 2} more" if len(foreign) > 2 else "")
    return (f"{option} {directory}: holds files an export did not write ({shown}), which an export would replace; "
            f"give another folder or remove them")


def _free_sibling(directory: Path) -> Path:
    """A name beside ``directory`` that nothing holds: ``<name>.new``, ``<name>.new-2``, ..."""
    candidate, number = directory.with_name(f"{directory.name}.new"), 1
    while candidate.exists() or candidate.is_symlink():
        number += 1
        candidate = directory.with_name(f"{directory.name}.new-{number}")
    return candidate


def export_model(encoder: MultiVectorEncoder, directory: str | Path, extra: dict[str, Any] | None = None,
                 stanford: bool = True, *, overwrite: bool = False, run: Iterable[tuple[str, str]] = (),
                 keep_refused: bool = False) -> Path:
    """Write ``encoder`` to ``directory``: our layout, plus the Stanford layout when it can hold the model and
    ``stanford`` is True. The folder is built beside its final place and renamed, so a crash or a second
    exporter never leaves a half-written one.

    ``directory`` is replaced only when it is absent, empty or an earlier export (:func:`export_refusal`; its model
    card is carried over); otherwise :class:`ExportRefused`, before anything is written, or -- ``keep_refused``, for
    a model whose training should not be lost -- once the export is written to a free name beside it
    (``<name>.new``), which the message names. The check is made again once the export is built (files may appear
    meanwhile). ``overwrite`` replaces a folder of other files too; ``run``: the training run's folders
    (:func:`run_folders`), never replaced.
    """
    directory = Path(directory)
    run = list(run)
    write_stanford = stanford and stanford_representable(encoder) is None
    with file_lock(lock_path(directory), what="export"):
        refusal = export_refusal(directory, run=run, overwrite=overwrite)
        if refusal and not keep_refused:
            raise ExportRefused(f"{refusal}; nothing was written")
        with atomic_directory(directory) as building:
            encoder.save_pretrained(building, extra={**(extra or {}), "layouts": ["hil", "stanford"]
                                                     if write_stanford else ["hil"]})
            if write_stanford:
                assert isinstance(encoder, ColBERTEncoder)
                write_stanford_files(encoder, building)
            record = json.loads((building / CONFIG_NAME).read_text(encoding="utf-8"))
            write_json_atomic(building / CONFIG_NAME, {**record, MANIFEST_KEY: _entries(building)})
            give_plain_file_modes(building)
            refusal = refusal or export_refusal(directory, run=run, overwrite=overwrite)  # files may have appeared
            if refusal:
                beside = _free_sibling(directory)
                os.replace(building, beside)
                raise ExportRefused(f"{refusal}; nothing there was touched: the export is in {beside}")
            for name in _kept(directory):
                shutil.copy2(directory / name, building / name)
                logger.warning("%s: kept %s from the export it replaces (it describes that model; hil share "
                               "--card-only rewrites it)", directory, name)
    return directory
