"""What made an artifact: package versions, settings and content fingerprints.

Every checkpoint, exported model, index and results file records these (DESIGN: settings travel with artifacts).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import tempfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

_PACKAGES = ("hil", "torch", "pytorch-lightning", "transformers", "faiss-cpu", "faiss-gpu-cu12",
             "pytrec-eval-terrier", "bm25s", "numpy")


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def provenance(settings: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A record for an artifact: creation time, versions, git commit, the settings and anything extra."""
    record: dict[str, Any] = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "git_commit": git_commit(),
        "host": platform.node(),
    }
    if settings is not None:
        record["settings"] = settings
    record.update(extra)
    return record


def fingerprint_strings(items: Iterable[str]) -> str:
    """A short, order-sensitive SHA-256 fingerprint of a sequence of strings."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(item.encode("utf-8", "surrogatepass"))
        digest.update(b"\x00")
    return digest.hexdigest()[:16]


def fingerprint_files(paths: Iterable[str | os.PathLike]) -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(p) for p in paths):
        digest.update(path.name.encode())
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def write_json_atomic(path: str | os.PathLike, payload: Any) -> None:
    """Write JSON to a temporary file in the same folder, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                     delete=False, encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2, sort_keys=False, default=str)
        handle.write("\n")
        tmp = handle.name
    # NamedTemporaryFile creates 0600; give the result the permissions a plain open() would (0666 & ~umask).
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)
