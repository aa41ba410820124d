"""Where data and models live: settings, never paths inside the code.

``HIL_DATA_DIR``   a folder holding BEIR datasets as ``<dir>/beir/<name>`` or ``<dir>/<name>``,
                   and MS MARCO files under ``<dir>/msmarco``.
``HIL_MODELS_DIR`` a folder holding Hugging Face model directories by their base name; a hub name such as
                   ``sentence-transformers/all-MiniLM-L6-v2`` resolves to ``<dir>/all-MiniLM-L6-v2`` when it exists.
``HIL_CACHE_DIR``  a folder for derived files (the line offsets of big training files, ``hil.data.line_index``):
                   when set they go there, instead of beside their data (or ``~/.cache/hil`` for read-only data).

Anything not found locally is passed through unchanged so that Hugging Face hub loading works online. When the hub
cannot be asked -- ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` set, or its host not answering a connection within
:data:`HUB_PROBE_SECONDS` (probed once per process) -- a name that is no local folder and not in the hub's cache is
refused at once, in one line naming ``HIL_MODELS_DIR`` (unset, or where it looked): the hub's client would otherwise
retry for 45-60 s before failing with a message that names neither.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from urllib.parse import urlsplit

from hil.errors import MissingInputError

DATA_DIR_ENV = "HIL_DATA_DIR"
MODELS_DIR_ENV = "HIL_MODELS_DIR"
CACHE_DIR_ENV = "HIL_CACHE_DIR"
# The hub client's own switches (huggingface_hub, transformers): set to 1, nothing is asked of the hub.
HUB_OFFLINE_ENVS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
HUB_ENDPOINT_ENV = "HF_ENDPOINT"
HUB_PROBE_SECONDS = 3.0  # a reachable hub answers a TCP connection well within this
# What the hub could hold: ``bert-base-uncased``, ``org/name`` (a path of more parts, or an absolute one, is a path).
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


class ModelNotFoundError(MissingInputError):
    """A model name that is no local folder (nor one under ``HIL_MODELS_DIR``), while the hub cannot be asked."""


def _env_dir(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def resolve_model(name_or_path: str | os.PathLike) -> str:
    """A local directory for ``name_or_path`` if there is one, else the name itself (a hub id).

    While the hub cannot be asked (:func:`hub_out_of_reach`), a hub name is its snapshot in the hub's cache when one
    is there, else a :class:`ModelNotFoundError` saying what to set (the module docstring).
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return str(path)
    name = str(name_or_path)
    models_dir = _env_dir(MODELS_DIR_ENV)
    if models_dir is not None:
        candidate = models_dir / Path(name).name
        if candidate.is_dir():
            return str(candidate)
    if HUB_NAME.fullmatch(name) and (reason := hub_out_of_reach()) is not None:
        cached = _cached_snapshot(name)
        if cached is not None:
            return cached
        where = (f"no {models_dir / Path(name).name} under {MODELS_DIR_ENV}" if models_dir is not None
                 else f"{MODELS_DIR_ENV} is not set")
        fix = (f"put the model at {models_dir / Path(name).name}" if models_dir is not None
               else f"set {MODELS_DIR_ENV}=<a folder holding {Path(name).name}/>")
        raise ModelNotFoundError(f"{name}: not a local model folder ({where}), and the Hugging Face hub cannot be "
                                 f"asked ({reason}): give the model's local folder, or {fix}")
    return name


def hub_out_of_reach() -> str | None:
    """Why the Hugging Face hub cannot be asked now (an offline switch, or its host -- or the proxy in the way --
    not answering), or None when it can."""
    for variable in HUB_OFFLINE_ENVS:
        if os.environ.get(variable, "").strip().lower() in ("1", "on", "yes", "true"):
            return f"{variable}={os.environ[variable]}"
    endpoint = urlsplit(os.environ.get(HUB_ENDPOINT_ENV) or "https://huggingface.co")
    scheme = endpoint.scheme or "https"
    proxies = [f"{scheme.upper()}_PROXY", f"{scheme}_proxy", "ALL_PROXY", "all_proxy"]
    proxy = next((os.environ[v] for v in proxies if os.environ.get(v)), None)
    target = urlsplit(proxy if "://" in proxy else f"http://{proxy}") if proxy else endpoint
    try:
        port = target.port or (443 if target.scheme == "https" else 80)
    except ValueError:  # a malformed port: the hub's client will say so
        return None
    return _unreachable(target.hostname, port) if target.hostname else None


@functools.lru_cache(maxsize=8)
def _unreachable(host: str, port: int) -> str | None:
    """Why a TCP connection to ``host:port`` fails (once per process and address), or None when it opens. Run in a
    thread so that a resolver that never answers costs :data:`HUB_PROBE_SECONDS` too (``getaddrinfo`` has no
    timeout of its own)."""
    import socket
    import threading

    outcome: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=HUB_PROBE_SECONDS).close()
            outcome.append(None)
        except OSError as error:
            outcome.append(error.strerror or str(error) or type(error).__name__)

    thread = threading.Thread(target=probe, name="hil-hub-probe", daemon=True)
    thread.start()
    thread.join(HUB_PROBE_SECONDS + 0.5)
    if not outcome:
        return f"{host}:{port} gave no answer within {HUB_PROBE_SECONDS:g} s"
    return None if outcome[0] is None else f"{host}:{port}: {outcome[0]}"


def _cached_snapshot(name: str) -> str | None:
    """The hub cache's snapshot of ``name`` (what the hub's client reads offline), or None; asks no server."""
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(name, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), or no huggingface_hub: nothing cached to give
        return None


def resolve_dataset(name_or_path: str | os.PathLike, data_dir: str | os.PathLike | None = None) -> Path | None:
    """The local BEIR folder for a dataset name or path, or None when it is only on the hub."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    root = Path(data_dir).expanduser() if data_dir is not None else _env_dir(DATA_DIR_ENV)
    if root is None:
        return None
    for candidate in (root / "beir" / str(name_or_path), root / str(name_or_path)):
        if candidate.is_dir():
            return candidate
    return None


def resolve_data_file(name_or_path: str | os.PathLike, data_dir: str | os.PathLike | None = None) -> Path:
    """A data file given as a path, or relative to ``HIL_DATA_DIR`` (e.g. ``msmarco/triples.tsv``)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    root = Path(data_dir).expanduser() if data_dir is not None else _env_dir(DATA_DIR_ENV)
    if root is not None and (root / path).exists():
        return root / path
    hint = f" (also looked under {DATA_DIR_ENV}={root})" if root is not None else f" (set {DATA_DIR_ENV} to look there)"
    raise FileNotFoundError(f"{name_or_path}: no such file{hint}")


CONFIGS_DIR = Path(__file__).resolve().parent / "configs"  # the YAML recipes, installed with the package


def resolve_config(value: str) -> str:
    """A ``--config`` value: an existing file as given, else a recipe of the package named ``colbert``,
    ``colbert_hil``, ``variants/colbert_hil``, ``presets/smoke`` (``.yaml`` optional); anything else unchanged (the
    CLI then says the file is missing)."""
    if Path(value).expanduser().exists() or not value or "\n" in value or value.lstrip().startswith(("{", "[")):
        return value
    name = value.removesuffix(".yaml").removeprefix("configs/")
    direct = CONFIGS_DIR / f"{name}.yaml"
    if direct.is_file():
        return str(direct)
    matches = sorted(CONFIGS_DIR.rglob(f"{Path(name).name}.yaml")) if "/" not in name else []
    return str(matches[0]) if len(matches) == 1 else value
