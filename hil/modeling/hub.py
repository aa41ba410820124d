"""The Hugging Face hub: a model name to a local folder, and an export (with its model card) to a repository.

``local_model_dir`` gives the folder a model is read from: a local path, a folder under ``HIL_MODELS_DIR``, or a
snapshot of a hub repository (only the files a model needs). ``push_to_hub`` uploads an export with a ``README.md``
model card written from what the export records (base model, settings, training data and steps) and from the
``metrics.json`` files of its evaluations; ``write_model_card`` alone fills a local folder (what tests use, since
the hub is out of reach here).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol

from hil.errors import MissingInputError, UserError
from hil.paths import ModelNotFoundError, resolve_model
from hil.provenance import file_lock, lock_path, write_text_atomic

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
# What loading a model reads: settings, tokenizer files, weights, the Dense folders of a PyLate model.
HUB_PATTERNS = ["*.json", "*.txt", "*.model", "*.safetensors", "*.pt", "pytorch_model.bin", "*/pytorch_model.bin",
                "artifact.metadata"]
CARD_NAME = "README.md"


class HubError(UserError):
    """A model that is neither a local folder nor obtainable from the hub, or a push that cannot be made."""


def local_model_dir(source: str | Path) -> Path:
    """The local folder of ``source``: a path, ``HIL_MODELS_DIR/<name>``, or a hub snapshot (downloaded once; while
    the hub cannot be asked, only a cached one: :func:`hil.paths.resolve_model`)."""
    try:
        path = Path(resolve_model(source)).expanduser()
    except ModelNotFoundError as error:
        raise HubError(str(error)) from None
    if path.exists():
        return path
    text = str(source)
    if not HUB_ID.fullmatch(text):
        raise MissingInputError(f"{text}: no such model folder or file")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, allow_patterns=HUB_PATTERNS))
    except Exception as error:  # offline, unknown repository, gated: all say the same to the user
        reason = str(error).splitlines()[0] if str(error) else error.__class__.__name__
        raise HubError(f"{text}: not a local model folder, and the Hugging Face hub could not give it "
                       f"({error.__class__.__name__}: {reason[:200]})") from None


# -- the model card -----------------------------------------------------------------------------------------------
def _export_record(export_dir: Path) -> dict[str, Any]:
    path = export_dir / "hil_config.json"
    if not path.is_file():
        raise HubError(f"{export_dir}: not a hil export (no hil_config.json); export the model first "
                       f"(train.py --export_dir, or hil.export_model)")
    return json.loads(path.read_text(encoding="utf-8"))


def _evaluation_rows(metrics_files: Iterable[Path]) -> list[tuple[str, str, dict[str, float]]]:
    """(dataset, run, metrics) for each run of each ``metrics.json`` that ``evaluate.py`` wrote."""
    rows = []
    for path in metrics_files:
        if not path.is_file():
            raise HubError(f"{path}: no such metrics file")
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            dataset = record["dataset"]
            name = f"{dataset['name']} ({dataset.get('split', 'test')})" if isinstance(dataset, dict) else str(dataset)
            for run, result in record["results"].items():
                rows.append((name, str(run), {k: float(v) for k, v in result["metrics"].items()}))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as error:
            raise HubError(f"{path}: not a metrics.json written by evaluate.py ({error.__class__.__name__}: "
                           f"{error})") from None
    return rows


def _evaluation_table(rows: list[tuple[str, str, dict[str, float]]]) -> list[str]:
    columns = list(dict.fromkeys(key for _, _, metrics in rows for key in metrics))
    lines = ["## Evaluation", "", "| dataset | run | " + " | ".join(columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    lines += [f"| {dataset} | {run} | " + " | ".join(f"{m[key]:.4f}" if key in m else "" for key in columns) + " |"
              for dataset, run, m in rows]
    return lines + [""]


def model_card(export_dir: Path, metrics_files: Iterable[Path] = (), repo_id: str | None = None) -> str:
    """A ``README.md`` for the export: YAML front matter for the hub, then what made the model and its figures."""
    record = _export_record(export_dir)
    settings = record.get("settings", {})
    training = record.get("training", {}) or {}
    base = str(settings.get("backbone", ""))
    layouts = record.get("layouts", ["hil"])
    tags = ["colbert", "late-interaction", "hil", "sentence-similarity"] + (["stanford-colbert"]
                                                                         if "stanford" in layouts else [])
    lines = ["---", "library_name: hil", "pipeline_tag: sentence-similarity", "tags:",
             *[f"- {tag}" for tag in tags]]
    if base and not Path(base).is_absolute():
        lines.append(f"base_model: {base}")
    lines += ["---", "", f"# {repo_id or export_dir.name}", "",
              f"A {settings.get('architecture', '?')} retriever trained with "
              "[hil](https://github.com/) (isotropy-regularized late interaction).", ""]
    lines += ["## Settings", "", "| setting | value |", "|---|---|",
              *[f"| {key} | `{value}` |" for key, value in sorted(settings.items()) if key != "idf"], ""]
    data = record.get("data")
    lines += ["## Training", "", f"- steps: {record.get('global_step', 'not recorded')}",
              f"- loss: `{json.dumps(training.get('loss'))}`",
              f"- regularizer: `{json.dumps(training.get('regularizer'))}`",
              f"- training data: `{json.dumps(data) if data else 'not recorded'}`",
              f"- versions: `{json.dumps(record.get('versions', {}))}`", ""]
    rows = _evaluation_rows(metrics_files)
    if rows:
        lines += _evaluation_table(rows)
    how = ("from hil import load_model\nmodel = load_model(\"%s\")" % (repo_id or export_dir))
    lines += ["## Use", "", "```python", how, "```", ""]
    if "stanford" in layouts:
        lines += ["The folder is also a Stanford ColBERT checkpoint (`Checkpoint(path)`) and loads in PyLate "
                  "(`models.ColBERT(path)`).", ""]
    return "\n".join(lines)


def write_model_card(export_dir: str | Path, metrics_files: Iterable[str | Path] = (),
                     repo_id: str | None = None) -> Path:
    """Write the model card into ``export_dir``: whole, with a plain file's permissions, and under the export's lock
    (a re-export carries the card over, ``hil.modeling.export``; it must not copy half of one)."""
    export_dir = Path(export_dir)
    card = model_card(export_dir, [Path(p) for p in metrics_files], repo_id)
    path = export_dir / CARD_NAME
    with file_lock(lock_path(export_dir), what="model card"):
        write_text_atomic(path, card)
    return path


class HubApi(Protocol):
    """The two calls of ``huggingface_hub.HfApi`` that a push makes (a stand-in for tests)."""

    def create_repo(self, repo_id: str, *, private: bool, exist_ok: bool, token: str | None = None) -> Any: ...

    def upload_folder(self, *, repo_id: str, folder_path: str, commit_message: str,
                      token: str | None = None) -> Any: ...


def push_to_hub(export_dir: str | Path, repo_id: str, metrics_files: Iterable[str | Path] = (), *,
                private: bool = False, token: str | None = None, api: HubApi | None = None,
                staging_dir: str | Path | None = None) -> Path:
    """Upload an export and its model card to ``repo_id``; returns the staged folder that was uploaded.

    The export is copied to ``staging_dir`` (a temporary folder by default) with the card added, so the export
    itself is never modified. ``api`` defaults to ``huggingface_hub.HfApi()``.
    """
    export_dir = Path(export_dir)
    if not HUB_ID.fullmatch(repo_id) or "/" not in repo_id:
        raise HubError(f"repo_id {repo_id!r}: expected 'user-or-org/name'")
    _export_record(export_dir)
    if staging_dir is None:
        import tempfile

        staging_dir = Path(tempfile.mkdtemp(prefix="hil-push-")) / export_dir.name
    staging = Path(staging_dir)
    if staging.exists():
        shutil.rmtree(staging)
    shutil.copytree(export_dir, staging)
    write_model_card(staging, metrics_files, repo_id)
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True, token=token)
    api.upload_folder(repo_id=repo_id, folder_path=str(staging), commit_message="Upload a hil model",
                      token=token)
    return staging


@dataclass
class ShareSettings:
    """The settings of hil share, each field the option of its name (the first two also the command's leading words).

    An export and where it goes on the hub (:func:`share`).

    Args:
        export: an export folder (hil fit --export_dir, hil.export_model)
        repo_id: the hub repository, user-or-org/name
        metrics: metrics.json files whose figures go into the card (repeatable; several after one option too)
        private: create the repository private
        card_only: write README.md into the export; push nothing
    """

    export: str
    repo_id: str
    metrics: list[str] = field(default_factory=list)
    private: bool = False
    card_only: bool = False


def share(settings: ShareSettings, token: str | None = None, api: HubApi | None = None) -> str:
    """What ``settings`` ask: the card written into the export, or the export pushed with it. -> what was done, a
    line to show."""
    if settings.card_only:
        return f"wrote {write_model_card(settings.export, settings.metrics, settings.repo_id)}"
    push_to_hub(settings.export, settings.repo_id, settings.metrics, private=settings.private, token=token, api=api)
    return f"pushed {settings.export} to https://huggingface.co/{settings.repo_id}"
